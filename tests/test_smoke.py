"""End-to-end smoke tests: the engine's conflict rule, one push/consume round trip per
delivery mode, and the README's demonstration (separate OS processes, one consumer
killed with SIGKILL, exactly-once counts checked)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import fdq
from fdqtest import engine_errors, wait_for  # noqa: F401 - re-exported to this directory's tests


def test_read_then_write_conflict(db):
    a, b = db.create_transaction(), db.create_transaction()
    a[b"k"].present()          # both read k at their read version
    b[b"k"].present()
    a[b"k"] = b"a"
    b[b"k"] = b"b"
    a.commit().wait()
    with pytest.raises(engine_errors()) as e:
        b.commit().wait()
    assert e.value.code == 1020
    assert db[b"k"] == b"a"


def test_exactly_once_round_trip(db):
    p = fdq.Producer(db)
    ids = [r.id for r in p.push_many("orders", [fdq.Envelope(f"m{i}".encode(), shard_key=f"k{i % 7}")
                                                for i in range(200)])]
    assert len(set(ids)) == 200
    seen = []
    lock = threading.Lock()

    def handler(tr, m):
        tr[b"seen/" + m.id.encode()] = m.body
        with lock:
            seen.append(m.id)
    c = fdq.tail(db, "orders", handler, transactional=True)
    try:
        wait_for(lambda: fdq.Supervisor(db).stats("orders")["subscriptions"]["default"]["backlog"] == 0,
                 what="backlog drained")
    finally:
        c.shutdown()
    stored = {kv.key[5:].decode() for kv in db.get_range(b"seen/", b"seen0")}
    assert stored == set(ids)


def test_at_least_once_ack_and_nak(db):
    p = fdq.Producer(db)
    p.push("jobs", b"fails-once", shard_key="a")
    p.push("jobs", b"ok", shard_key="b")
    attempts = {}
    done = threading.Event()

    def handler(m):
        attempts[m.body] = m.attempts
        if m.body == b"fails-once" and m.attempts == 1:
            raise RuntimeError("transient")
        if len(attempts) == 2 and attempts[b"fails-once"] == 2:
            done.set()
    c = fdq.tail(db, "jobs", handler, config=fdq.ConsumerConfig(ack_wait_s=30))
    try:
        assert done.wait(30), attempts
        wait_for(lambda: fdq.Supervisor(db).stats("jobs")["subscriptions"]["default"]["backlog"] == 0)
    finally:
        c.shutdown()
    st = fdq.Supervisor(db).stats("jobs")
    assert st["counters"]["acked"] == 2 and st["subscriptions"]["default"]["dlq"] == 0


def test_pause_keeps_pushes_in_the_log_and_play_routes_them(db):
    s = fdq.Supervisor(db)
    s.create_topic("t", shards=4)
    s.pause("t")
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"x%d" % i) for i in range(10)])
    c = s.stats("t")["counters"]
    assert (c["inserted"], c["routed"]) == (10, 0)
    assert s.play("t") == 10
    c = s.stats("t")["counters"]
    assert (c["inserted"], c["routed"]) == (10, 10)
    assert s.stats("t")["subscriptions"]["default"]["backlog"] == 10


def test_bad_input_is_refused_with_a_named_error(db):
    p = fdq.Producer(db)
    with pytest.raises(fdq.InvalidName, match="bad name!"):
        p.push("bad name!", b"x")
    with pytest.raises(fdq.InvalidMessage, match="bytes"):
        p.push("t", "not bytes")
    with pytest.raises(fdq.TopicNotFound, match="nope"):
        fdq.Supervisor(db).stats("nope")
    with pytest.raises(fdq.ConnectError, match="unknown scheme"):
        fdq.connect("mysql://localhost/x")


@pytest.mark.slow
def test_demo_survives_a_kill_9_with_exactly_once_counts(tmp_path):
    # As `make demo` on a new machine: the default database, in a home not created yet.
    env = {k: v for k, v in os.environ.items() if k != "FDQ_URL"}
    env["FDQ_HOME"] = str(tmp_path / "new" / "home")
    out = subprocess.run([sys.executable, "-m", "fdq.demo", "--messages", "600"], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK: every message processed exactly once" in out.stdout
    assert "kill -9 consumer-0" in out.stdout
    assert "survivors took over consumer-0's shards after" in out.stdout     # required for OK
    assert (tmp_path / "new" / "home" / "fdq.db").exists()


def test_tail_shutdown_finishes_the_in_flight_batch(db):
    """shutdown() of a running tail waits for the handler, settles what it handled and
    returns the rest of the batch: nothing handled is redelivered, nothing is lost."""
    fdq.Supervisor(db).create_topic("slow", shards=1)
    fdq.Producer(db).push_many("slow", [fdq.Envelope(b"%d" % i) for i in range(40)])
    handled, errors = [], []
    started = threading.Event()

    def handler(m):
        started.set()
        time.sleep(0.02)
        handled.append(m.id)
    c = fdq.tail(db, "slow", handler, batch_size=40, on_error=errors.append)
    assert started.wait(30)
    c.shutdown()
    st = fdq.Supervisor(db).stats("slow")["subscriptions"]["default"]
    assert errors == []
    assert 0 < len(handled) < 40
    assert st["acked"] == len(handled) == len(set(handled))
    assert st["in_flight"] == 0 and st["backlog"] == 40 - len(handled)


def test_reshard_terminates_when_a_chunk_is_all_stay_puts(db, monkeypatch):
    """A shard whose first CHUNK entries all keep their shard must not be re-read
    forever: resharding walks each queue with a cursor."""
    from fdq import supervisor
    monkeypatch.setattr(supervisor, "CHUNK", 5)
    s = fdq.Supervisor(db)
    s.create_topic("r", shards=2)
    keys = [f"k{i}" for i in range(200)]
    stay = [k for k in keys if fdq.keyspace.codec.shard_of(k, 2) == 0 and fdq.keyspace.codec.shard_of(k, 4) == 0]
    move = [k for k in keys if fdq.keyspace.codec.shard_of(k, 2) == 0 and fdq.keyspace.codec.shard_of(k, 4) == 2]
    envs = [fdq.Envelope(b"s", shard_key=k) for k in stay[:12]] + [fdq.Envelope(b"m", shard_key=k) for k in move[:12]]
    fdq.Producer(db).push_many("r", envs)
    done = threading.Event()
    t = threading.Thread(target=lambda: (s.rebalance("r", shards=4), done.set()), daemon=True)
    t.start()
    assert done.wait(60), "rebalance did not terminate"
    shards = {c["shard"]: c["backlog"] for c in s.stats("r")["subscriptions"]["default"]["shards"]}
    assert shards == {0: 12, 1: 0, 2: 12, 3: 0}


def test_push_async_futures_share_transactions_and_report_errors(db):
    # linger_ms: the leader waits that long for more pushes, so batching does not depend
    # on how fast this thread enqueues on a loaded machine.
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=20))
    commits = []
    real_commit = p._commit
    p._commit = lambda items: (commits.append(len(items)), real_commit(items))[1]
    before = threading.active_count()
    futures = [p.push_async("a", b"%d" % i, shard_key=f"k{i % 5}") for i in range(500)]
    bad = p.push_async("a", b"x" * (2 << 20))          # over max_message_bytes (1 MiB)
    ids = [f.result(timeout=60).id for f in futures]
    with pytest.raises(fdq.MessageTooLarge):
        bad.result(timeout=60)
    assert threading.active_count() <= before + 1      # one flusher, not a thread per push
    assert len(set(ids)) == 500
    assert len(commits) < 100, commits                 # batched, not one transaction each
    st = fdq.Supervisor(db).stats("a")
    assert st["counters"]["inserted"] == 500


@pytest.mark.parametrize("name", ["orders\n", "a" * 65, "", "a b", "é", "x#ephemeral#ephemeral"])
def test_invalid_topic_names_are_refused(db, name):
    with pytest.raises(fdq.InvalidName):
        fdq.Producer(db).push(name, b"x")
    assert fdq.Supervisor(db).topics() == []


def test_consumer_identify_creates_a_matching_topic_and_refuses_before_binding(db):
    with fdq.Consumer(db, "ext", extend_support=True):       # missing topic: created extend
        pass
    assert fdq.Supervisor(db).config("ext").extend
    fdq.Supervisor(db).create_topic("plain")
    with pytest.raises(fdq.ConfigError, match="no extend support"):
        fdq.Consumer(db, "plain", extend_support=True, subscription="new-sub")
    assert fdq.Supervisor(db).config("plain").subs == ("default",)   # nothing bound


def test_consumers_with_different_heartbeat_intervals_do_not_evict_each_other(db):
    """A fast-heartbeating consumer judges a slow one by the slow one's own timeout."""
    fdq.Supervisor(db).create_topic("hb", shards=4)
    errors = []
    slow = fdq.Consumer(db, "hb", consumer_id="slow", on_error=errors.append,
                        config=fdq.ConsumerConfig(heartbeat_interval_s=1.0))       # zombie after 3 s
    fast = fdq.Consumer(db, "hb", consumer_id="fast", config=fdq.ConsumerConfig(heartbeat_interval_s=0.1))
    try:
        deadline = time.monotonic() + 4.0        # > 3 fast zombie timeouts, < slow's own 3 s + margin
        while time.monotonic() < deadline:
            members = {c["id"] for c in fdq.Supervisor(db).stats("hb")["subscriptions"]["default"]["consumers"]}
            assert members == {"slow", "fast"}, f"a live consumer was evicted: {members}"
            time.sleep(0.05)
    finally:
        fast.close()
        slow.close()
