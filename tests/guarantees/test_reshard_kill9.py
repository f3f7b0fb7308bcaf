"""Shard-count changes under load, all in real processes: 2 producers push keyed
messages and 2 exactly-once consumers consume while a rebalance to 7 shards is kill -9'd
midway (consumers join meanwhile) and run again, then a rebalance to 3 runs with fault injection (retryable
errors, commit_unknown_result). Every message is processed exactly once and, per shard
key, in push order; the counters agree."""
from __future__ import annotations

import collections
import json

import pytest

import fdq

from fdqtest import read_lines, scan, sub_stats, wait_for, with_faults


CONSUMER_ARGS = ("--mode", "eo", "--hb", 0.2, "--zombie", 1.5, "--batch", 20)


def _results(db):
    done = {k[len(b"qt/t/done/"):].decode(): int.from_bytes(bytes(v)[:8], "little")
            for k, v in scan(db, b"qt/t/done/")}
    order = collections.defaultdict(list)
    for k, v in scan(db, b"qt/t/order/"):
        order[k[len(b"qt/t/order/"):].split(b"/", 1)[0].decode()].append(int(bytes(v)))
    return done, order


@pytest.mark.slow
def test_reshards_killed_and_faulty_under_load(procs, db, url):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    pre = []    # a backlog big enough that the kill lands while the reshard moves it
    p = fdq.Producer(db)
    for i in range(0, 10000, 500):
        envs = [fdq.Envelope(f"pre:{j}".encode(), shard_key=f"pre-k{j % 7}") for j in range(i, i + 500)]
        pre += [{"id": r.id, "key": e.shard_key, "body": e.body.decode()} for r, e in zip(p.push_many("t", envs), envs)]
    prods = [procs.start("producer", f"p{i}", "--count", 3000, "--batch", 5, "--keys", 7, "--sleep", 0.01)
             for i in range(2)]
    wait_for(lambda: sup.stats("t")["counters"]["inserted"] >= 10600, 60, what="pushes under way")
    r = procs.start("rebalance", "r1", "--count", 7)
    assert procs.readline(r, 60).strip() == "start"
    for _ in range(5):
        line = procs.readline(r, 60)
        assert line.startswith("chunk"), f"the rebalance finished before the kill: {line!r}"
    procs.kill9(r)
    assert sup.config("t").resharding_to == 7, "the kill did not land mid-way"
    cons = [procs.start("consumer", f"c{i}", *CONSUMER_ARGS, wait_ready=True) for i in range(2)]
    before = sup.stats("t")["counters"]["inserted"]
    procs.wait(procs.start("rebalance", "r2", "--count", 7), 120)
    assert sup.stats("t")["counters"]["inserted"] > before, "no push landed during the rerun: not under load"
    procs.wait(procs.start("rebalance", "r3", "--count", 3, url=with_faults(url, 0.05, 7)), 180)
    config = sup.config("t")
    assert (config.shards, config.resharding_to, config.paused) == (3, None, False)
    for p in prods:
        procs.wait(p, 180)
    pushed = pre + [json.loads(line) for p in prods for line in read_lines(p.out)]
    ids = {x["id"] for x in pushed}
    assert len(ids) == 16000
    wait_for(lambda: len(_results(db)[0]) >= len(ids), 180, interval=0.3, what="every message processed")
    for c in cons:
        procs.stop(c)
    done, order = _results(db)
    assert set(done) == ids and set(done.values()) == {1}
    expected = collections.defaultdict(list)
    for x in pushed:
        expected[x["key"]].append(int(x["body"].rsplit(":", 1)[1]))
    for key, seqs in expected.items():
        assert order[key] == seqs, f"key {key}: out of push order"
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (16000, 16000, 0)
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["emitted"], s["acked"]) == (0, 0, 16000, 16000)
