"""The hot-spot analyzer's ratios (bench/hotspots.py), which do not depend on the
machine: what FDQ's transactions share on a FoundationDB cluster, recorded through
FoundationDB's binding over the libfdb_c stand-in (a workload of seconds, run once).

* no key is written by more than a quarter of single-message push transactions, nor of
  lease/settle transactions (a key every transaction writes stays on one storage team);
* every append family a push phase writes per message (or per transaction) spreads over
  at least 4 append points (versionstamped keys land at the end of their prefix);
* mutations per message within a budget;
* no membership transaction (join, leave, takeover) reads a range a heartbeat writes.

A rule today's code breaks is a finding, marked xfail(strict=True) with its key family:
fixed, it XPASSes and the mark must go."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
from fdb.tuple import Versionstamp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import fdqtest  # noqa: E402 - first: on the fdb pass it installs the libfdb_c stand-in
import standin  # noqa: E402
from bench import hotspots  # noqa: E402
from fdq.keyspace import Keyspace  # noqa: E402

pytestmark = pytest.mark.xdist_group("hotspots")

# Findings: rule -> why today's code breaks it (each runs as xfail(strict=True)); none now.
FINDINGS = {}
RULES = (["key_share[push]", "key_share[push_msg_id]", "key_share[consume]"]
         + [f"append_partitions[{p}]" for p in ("push", "push_msg_id", "push_many", "push_large", "push_paused",
                                                "play", "consume")]
         + [f"mutations_per_message[{p}]" for p in hotspots.MUTATION_BUDGETS]
         + ["heartbeats_outside_assignment_reads"])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "FDQ_URL"}
    out = subprocess.run([sys.executable, "-m", "bench.hotspots", "--quick", "--json",
                          "--dir", str(tmp_path_factory.mktemp("hotspots"))],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("rule", [pytest.param(r, marks=pytest.mark.xfail(strict=True, reason=FINDINGS[r]))
                                  if r in FINDINGS else r for r in RULES])
def test_ratio(report, rule):
    check = report["checks"][rule]
    assert check["ok"], check["detail"]


def test_every_committed_push_is_recorded_once(report):
    """One write transaction per single push (a retried attempt is not counted twice),
    each appending the message to the log."""
    push = report["phases"]["push"]
    assert push["transactions"] == push["count"] == 100
    log = next(r for r in push["append_families"] if r["family"] == "topic/<topic>/all/log/<n>/<vs>…")
    assert log["appends"] == 100 and log["tx_share"] == 1.0


def test_keys_are_named_by_family():
    """Variable parts of a key become placeholders: the topic and subscription names the
    workload used, numbers, ids, versionstamps."""
    names = {"t": "<topic>", "default": "<sub>"}
    ts = Keyspace().topic("t")
    assert hotspots.family(ts.stat("inserted", 3), names) == "topic/<topic>/all/stats/inserted/<n>"
    assert hotspots.family(ts.heartbeat_key("default", "host-12-ab34"), names) == \
        "config/topics/<topic>/heartbeats/<sub>/<id>/hb"
    assert hotspots.family(ts.dedupe_key("m-17"), names) == "topic/<topic>/dedupe/<id>"
    r = ts.log_bucket_range(2)
    assert hotspots.range_family(r.start, r.stop, names) == "topic/<topic>/all/log/<n>/*"


def test_a_single_hot_key_crowds_one_team_in_the_distribution():
    """The simulated distribution cannot split a single key: one key taking half the
    writes (1,000/s) is one team's whole load, twice the mean of 4 teams, while the
    other half (30 keys) splits into shards of at most 100 writes/s spread over the rest."""
    args = argparse.Namespace(split_rate=100, split_bytes=1e9, teams=4, team_writes=20_000, team_bytes=30e6,
                              _scales={"push": 1000, "consume": 1000, "membership": 10})
    hot = Keyspace().topic("t").stat("inserted")
    cold = [Keyspace().topic("t").log_key(n, Versionstamp(b"\x00" * 10, 0)) for n in range(30)]
    txs = [{"muts": [("add", hot, 10, None), ("set", cold[i % 30], 10, None)], "reads": [], "writes": []}
           for i in range(100)]
    phases = {p: {"count": 100, "heads": [], "_txs": txs if p == "push" else []} for p in ("push", "consume",
                                                                                             "membership")}
    d = hotspots.distribution(phases, {"t": "<topic>"}, args)
    assert d["teams"][0]["top"] == "topic/t/all/stats/inserted/0"
    assert d["teams"][0]["writes_s"] == pytest.approx(1000)
    assert d["max_over_mean"] == pytest.approx(2.0)



@pytest.mark.skipif(not fdqtest.STANDIN, reason="the libfdb_c stand-in's recorder (the fdb pass)")
def test_the_stand_in_records_committed_attempts_only(db):
    """``Library.recorder`` gets each committed attempt's calls, in order; an attempt
    reset, or one that fails its commit on a conflict, is not recorded."""
    lib = standin.install_from_env()
    got = []
    lib.recorder = got.append
    try:
        tr = db.create_transaction()
        tr[b"hot/x1"] = b"1"
        tr.reset()
        tr[b"hot/x2"] = b"22"
        tr.add(b"hot/n", b"\x01" + b"\x00" * 7)
        tr.commit().wait()
        assert got == [[("set", b"hot/x2", 2), ("atomic", b"hot/n", "add", 8)]]
        got.clear()
        loser = db.create_transaction()
        loser[b"hot/y"].present()           # a read with a conflict range
        loser[b"hot/z"] = b"1"
        db[b"hot/y"] = b"2"                  # a commit after its read version
        with pytest.raises(Exception) as e:
            loser.commit().wait()
        assert getattr(e.value, "code", None) == 1020
        assert got == [[("set", b"hot/y", 1)]]
    finally:
        lib.recorder = None
