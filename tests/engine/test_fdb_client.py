"""FDQ on FoundationDB's own client: what a real ``fdb://`` deployment does that the
embedded engine never shows (the binding's process-wide state, its network thread, its
atexit handler, its C types). Each case runs in a fresh process with the binding over the
libfdb_c stand-in (``tests/standin``), so the fdb pass runs them."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import fdq
from fdq.engine import retry
from fdqtest import STANDIN, database_url

pytestmark = pytest.mark.skipif(not STANDIN, reason="needs FoundationDB's binding over the libfdb_c stand-in "
                                                    "(the fdb pass: FDQ_TEST_ENGINE=fdb)")


def run(code: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python (the stand-in loads through this pass's environment)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_push_async_queued_at_exit_is_committed_before_the_client_stops(tmp_path):
    url = database_url(tmp_path / "fdq.db")
    out = run(f"""
        import fdq
        p = fdq.Producer(fdq.connect({url!r}), config=fdq.ProducerConfig(linger_ms=500))
        for i in range(20):
            p.push_async("t", b"m%d" % i)
    """)
    assert out.returncode == 0, out.stderr
    assert fdq.Supervisor(fdq.connect(url)).stats("t")["counters"]["inserted"] == 20, out.stderr


def test_importing_fdq_leaves_the_binding_usable_by_the_application(tmp_path):
    url = database_url(tmp_path / "fdq.db")
    out = run(f"""
        import fdq
        import fdb
        fdb.api_version(730)
        db = fdb.open({url[len("fdb://"):]!r})
        db[b"k"] = b"v"
        assert db[b"k"] == b"v"
        fdq.Producer(db).push("t", b"x")     # and FDQ on the application's Database
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_fdq_takes_a_database_the_application_opened(tmp_path):
    """fdb.open() is the FDB idiom: FDQ must recognise the binding's transactions and
    errors without having connected itself."""
    url = database_url(tmp_path / "fdq.db")
    out = run(f"""
        import fdb
        fdb.api_version(730)
        db = fdb.open({url[len("fdb://"):]!r})
        import fdq
        sup = fdq.Supervisor(db)
        sup.create_topic("t", shards=2)
        p = fdq.Producer(db)
        p.push_many("t", [fdq.Envelope(b"a"), fdq.Envelope(b"b")])
        with fdq.Consumer(db, "t") as c:
            got = []
            while len(got) < 2:
                got += c.fetch(2, timeout=5)
            c.ack_many(got)
        s = sup.stats("t")
        assert (s["counters"]["inserted"], s["counters"]["acked"]) == (2, 2), s

        @fdq.transactional
        def too_big(tr):
            tr[b"x"] = b"v" * 200_000
        try:
            too_big(db)
        except fdq.EngineError as e:
            assert e.code == 2103 and "b'" not in str(e), str(e)
            print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_producer_used_after_fork_fails_at_once(tmp_path):
    url = database_url(tmp_path / "fdq.db")
    out = run(f"""
        import os, sys, time
        import fdq
        db = fdq.connect({url!r})
        p = fdq.Producer(db)
        p.push("t", b"parent")
        c = fdq.Consumer(db, "t")
        pid = os.fork()
        if pid == 0:
            t0 = time.monotonic()
            codes = []
            for call in (lambda: p.push("t", b"child"), lambda: c.fetch(1, timeout=1),
                         lambda: fdq.Supervisor(db).stats("t")):
                try:
                    call()
                    codes.append("no error")
                except fdq.ClientForked as e:
                    codes.append("forked" if "spawn" in str(e) else str(e))
            print(codes, round(time.monotonic() - t0, 1), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        c.close()
    """, timeout=60)
    assert out.returncode == 0, out.stderr
    codes, took = out.stdout.strip().rsplit(" ", 1)
    assert codes == "['forked', 'forked', 'forked']" and float(took) < 5, out.stdout + out.stderr


def test_an_unreachable_cluster_gives_a_connect_error_naming_the_cluster_file(tmp_path):
    cluster = tmp_path / "down.cluster"
    cluster.write_text("down:down@10.255.255.1:4500\n")   # no stand-in line: nothing answers
    out = run(f"""
        import time, fdq, fdq.engine.connection
        fdq.engine.connection.CONNECT_TIMEOUT_S = 1.0
        t0 = time.monotonic()
        try:
            fdq.connect("fdb://{cluster}")
        except fdq.ConnectError as e:
            print(round(time.monotonic() - t0), e)
    """, timeout=60)
    assert out.returncode == 0, out.stderr
    took, message = out.stdout.strip().split(" ", 1)
    assert int(took) <= 5 and str(cluster) in message and "no answer" in message, out.stdout


@pytest.mark.parametrize("chosen,accepted", [(720, True), (730, True), (700, False)])
def test_an_api_version_the_application_chose(tmp_path, chosen, accepted):
    url = database_url(tmp_path / "fdq.db")
    out = run(f"""
        import fdb
        fdb.api_version({chosen})
        import fdq
        try:
            fdq.Producer(fdq.connect({url!r})).push("t", b"x")
            print("connected")
        except fdq.ConnectError as e:
            print(e)
    """)
    assert out.returncode == 0, out.stderr
    if accepted:
        assert out.stdout.strip() == "connected"
    else:
        assert f"selected FoundationDB API version {chosen}" in out.stdout and "710 to 730" in out.stdout


def test_a_client_library_older_than_the_binding_says_what_to_install(tmp_path):
    url = database_url(tmp_path / "fdq.db")
    out = run(f"""
        import fdq
        try:
            fdq.connect({url!r})
        except fdq.ConnectError as e:
            print(e)
    """, env={"FDQ_STANDIN_MAX_API": "720"})     # a 7.2 libfdb_c
    assert out.returncode == 0, out.stderr
    assert "foundationdb-clients 7.3" in out.stdout and "'foundationdb>=7.3,<7.4'" in out.stdout, out.stdout


def test_fdb_urls_take_no_options(tmp_path):
    url = database_url(tmp_path / "fdq.db") + "?timeout=5"
    with pytest.raises(fdq.ConnectError) as info:
        fdq.connect(url)
    assert "unknown option(s) timeout" in str(info.value)


def test_an_engine_error_reads_as_text(tmp_path):
    import fdb
    fdq.connect(database_url(tmp_path / "fdq.db"))     # selects the API version: fdb.FDBError exists from then
    err = retry._translate(fdb.FDBError(1020))    # noqa: SLF001 - where FDB errors leave FDQ
    assert isinstance(err, fdq.EngineError) and err.code == 1020
    assert "b'" not in str(err) and "conflict" in str(err)


def test_spark_plans_a_log_too_large_for_a_32_bit_split_chunk(tmp_path):
    """The binding passes get_range_split_points' chunk size as a C int: a log of some
    GB planned into two partitions asked for chunks past 2**31 (the stand-in plays the
    log 10**7 times larger than it is)."""
    import fdq.spark
    from fdq import log
    from fdq.keyspace import Keyspace
    db = fdq.connect(database_url(tmp_path / "fdq.db"))
    fdq.Supervisor(db).create_topic("t", shards=2)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"x" * 1000, shard_key=str(i)) for i in range(2000)])
    big = fdq.connect(database_url(tmp_path / "fdq.db", estimate_scale=10_000_000))
    ts = Keyspace().topic("t")
    plan = fdq.spark.plan_ranges(big, ts, log.last_positions(big, ts), None, None, 2)
    assert 1 <= len(plan) <= 2
    tr = db.create_transaction()
    rows = sum(len(list(tr.snapshot.get_range(b, e))) for part in plan for _bucket, b, e in part)
    assert rows == 2000
