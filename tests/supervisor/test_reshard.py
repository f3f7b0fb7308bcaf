"""Resharding (``rebalance(shards=N)``): key order kept (killed midway or after its
finish), counters kept, nothing stranded (naks, DLQ redrives, plays during an unfinished
reshard), a new reshard after an unfinished drain."""
from __future__ import annotations

import threading
import time

import pytest

import fdq
from fdq import supervisor as supmod, supervisor as sv
from fdq.keyspace import Keyspace
from fdq.keyspace.codec import shard_of

from fdqtest import key_on_shard, sub_stats, wait_for
from ophelpers import (check_order, consume, consume_recorded, fetch_acked, push_keys, ready_ids, Recorder,
                       reshard_steps, SUPERVISED)


@pytest.mark.parametrize("delay", [None, 0.2])
def test_nak_during_reshard_is_not_stranded_in_a_removed_shard(db, delay):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    key = key_on_shard(1, 2)
    [pushed] = fdq.Producer(db).push_many("t", [fdq.Envelope(b"x", shard_key=key)])
    c = fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=600))
    got = []
    for _ in range(50):
        got += c.fetch(1, timeout=0.2)
        if got:
            break
    [m] = got
    ts = Keyspace().topic("t")
    sv.reshard_begin(db, ts, 1)
    for n in range(2):
        sv.reshard_chunk(db, ts, "default", "", n, "ready", 1, 500)
    m.nak(delay)                              # the handler gives up meanwhile
    for n in range(2):
        for area in ("delayed", "leased"):
            sv.reshard_chunk(db, ts, "default", "", n, area, 1, 500)
    sv.reshard_finish(db, ts)
    sup.play("t")
    back = []
    for _ in range(50):
        back += c.fetch(10, timeout=0.2)
        if back:
            break
    c.close()
    assert [b.id for b in back] == [pushed.id], f"message stranded; stats {sub_stats(db, 't')}"


def _fetch_until_leased(c, want: int, timeout: float) -> list:
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += c.fetch(want - len(got), timeout=0.2)
    return got


def test_reshard_killed_after_finish_keeps_key_order(db):
    """Messages pushed during a reshard wait in the pending area until the play that
    follows ``reshard_finish``. The finish made the topic route again at once, so a push
    between the finish and that play (or after a kill between them) went straight to
    a ready queue and was consumed before the older pending message of its key, which
    stayed stranded until someone ran rebalance again."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    key = next(f"k{i}" for i in range(100) if shard_of(f"k{i}", 2) != shard_of(f"k{i}", 3))
    p = fdq.Producer(db)
    sv.reshard_begin(db, ts, 3)
    first = p.push("t", b"first", shard_key=key).id      # during the reshard: pending
    reshard_steps(db, ts, 3, 2)                          # ... and killed before its play
    second = p.push("t", b"second", shard_key=key).id
    cons = fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=600))
    try:
        early = fetch_acked(cons, 1, 1.5)     # nothing may overtake the pending message
        sup.rebalance("t", shards=3)            # the rerun finishes the job
        got = early + fetch_acked(cons, 2 - len(early), 30)
    finally:
        cons.close()
    assert [i for i, _k, _b in got] == [first, second], "per-key order broken"
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"]) == (2, 2)
    assert sup.config("t").resharding_to is None and sup.config("t").shards == 3


def test_play_during_unfinished_reshard_does_not_spin(procs, db):
    """``play`` of a paused topic whose reshard was killed midway looped forever (each
    play chunk returns at once while resharding, the topic stays paused); and
    ``rebalance`` without a count (the CLI's plain ``fdq rebalance``) left the reshard
    unfinished, the topic consuming nothing. Play now says to finish the reshard, and
    an argument-less rebalance finishes it."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    ids = [r.id for r in p.push_many("t", [fdq.Envelope(b"m", shard_key=f"k{j}") for j in range(20)])]
    sup.pause("t")
    ts = Keyspace().topic("t")
    sv.reshard_begin(db, ts, 3)                # a rebalance killed right after it began
    ids.append(p.push("t", b"late", shard_key="k1").id)
    w = procs.start("play", "play", "--topic", "t")
    rc = w.wait(timeout=30)                   # the old code never returns (killed at teardown)
    assert rc != 0 and "rebalance" in procs.stderr(w), procs.stderr(w)
    sup.rebalance("t")                         # no count: finishes the reshard to 3
    config = sup.config("t")
    assert (config.shards, config.resharding_to, config.paused) == (3, None, True)
    assert sup.play("t") == 1
    got = consume(db, 21, 30)
    assert sorted(i for i, _k, _b in got) == sorted(ids)


def test_shrinking_reshard_keeps_subscription_counters(db):
    """The subscription's emitted / acked / done counters are sums over the current
    shards: a reshard to fewer shards dropped those of the removed shards from stats."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(b"m", shard_key=f"k{j}") for j in range(40)])
    assert len(consume(db, 30, 30)) == 30
    p.push_many("t", [fdq.Envelope(b"n", shard_key=f"k{j}") for j in range(5)])
    before = sub_stats(db, "t")
    assert (before["emitted"], before["acked"], before["backlog"]) == (30, 30, 15)
    sup.rebalance("t", shards=2)
    after = sub_stats(db, "t")
    assert (after["emitted"], after["acked"], after["backlog"], after["in_flight"]) == (30, 30, 15, 0)
    assert sum(s["done"] for s in after["shards"]) == 30
    sup.rebalance("t", shards=2)              # a rerun changes nothing
    assert sub_stats(db, "t")["acked"] == 30


def test_stats_and_max_backlog_count_a_growing_reshards_new_shards(db):
    """Midway through a reshard to more shards, the messages already moved sit in shards
    beyond the old count: stats' backlog and max_backlog counted only the old ones."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, max_backlog=40)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(b"m", shard_key=f"k{j}") for j in range(40)])
    ts = Keyspace().topic("t")
    sv.reshard_begin(db, ts, 6)
    after = None
    while True:       # shard 0's ready queue moved to the new layout, shard 1's not yet
        _r, after, done, *_ = sv.reshard_chunk(db, ts, "default", "", 0, "ready", 6, sv.CHUNK, after)
        if done:
            break
    st = sub_stats(db, "t")
    assert st["backlog"] == 40 and any(s["backlog"] for s in st["shards"] if s["shard"] >= 2)
    with pytest.raises(fdq.BacklogFull):
        p.push("t", b"over", shard_key="k0")
    sup.rebalance("t")                         # finishes the reshard
    assert sup.config("t").shards == 6 and sub_stats(db, "t")["backlog"] == 40


def test_dlq_redrive_during_reshard_is_not_stranded(db):
    """A DLQ redrive committed during a reshard, after the reshard's pass over the
    message's old shard, put it in that shard's ready queue by the old count: with
    fewer shards that shard is gone and the message was never delivered again."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    key = key_on_shard(1, 2)
    pushed = fdq.Producer(db).push("t", b"x", shard_key=key).id
    c = fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=600))
    try:
        [m] = _fetch_until_leased(c, 1, 30)
        m.term("bad")
        assert sub_stats(db, "t")["dlq"] == 1
        ts = Keyspace().topic("t")
        sv.reshard_begin(db, ts, 1)
        for n in range(2):
            for area in ("ready", "delayed", "leased"):
                sv.reshard_chunk(db, ts, "default", "", n, area, 1, sv.CHUNK)
        assert sup.dlq_redrive("t") == 1          # while the reshard runs
        sv.reshard_finish(db, ts)                 # the reshard's own next steps
        sup.play("t")
        got = fetch_acked(c, 1, 10)
    finally:
        c.close()
    assert [i for i, _k, _b in got] == [pushed], f"stranded; stats {sub_stats(db, 't')}"
    s = sub_stats(db, "t")
    assert (s["dlq"], s["backlog"]) == (0, 0)


def test_new_reshard_after_an_unfinished_drain(db):
    """A reshard killed before routing what was pushed meanwhile, then a reshard to yet
    another count: it finishes the first one's routing, then changes the count."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    p = fdq.Producer(db)
    ids = [r.id for r in p.push_many("t", [fdq.Envelope(b"a", shard_key=f"k{j}") for j in range(20)])]
    sv.reshard_begin(db, ts, 3)
    ids += [r.id for r in p.push_many("t", [fdq.Envelope(b"b", shard_key=f"k{j}") for j in range(20)])]
    reshard_steps(db, ts, 3, 2)
    assert sup.rebalance("t", shards=5).shards == 5
    config = sup.config("t")
    assert (config.shards, config.resharding_to, config.paused) == (5, None, False)
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"]) == (40, 40)
    got = consume(db, 40, 30)
    assert sorted(i for i, _k, _b in got) == sorted(ids)
    want = {}
    for i, k, _b in got:
        want.setdefault(k, []).append(i)
    assert all(v == sorted(v) for v in want.values()), "per-key order broken"


def _stay_put_key(old, new):
    for i in range(10000):
        k = f"hot{i}"
        if shard_of(k, old) == shard_of(k, new):
            return k
    raise AssertionError("no key keeps its shard")


@pytest.mark.parametrize("old,new", [(4, 7), (6, 3)])
def test_rebalance_shard_count_keeps_order(db, old, new):
    """Consumers run while the shard count changes and a producer keeps pushing; a hot key
    with more than one chunk of backlog keeps its shard (stays put)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=old)
    hot = _stay_put_key(old, new)
    p = fdq.Producer(db)
    pushed = []
    envs = [fdq.Envelope(f"h:{i}".encode(), shard_key=hot) for i in range(supmod.CHUNK + 200)]
    pushed += [(r.id, e.shard_key, e.body) for r, e in zip(p.push_many("t", envs), envs)]
    pushed += push_keys(db, "t", 2000, 37)
    rec = Recorder()
    consumer = fdq.tail(db, "t", rec, transactional=True, config=SUPERVISED, batch_size=20)
    stop = threading.Event()
    live = []

    def stream():
        i = 0
        while not stop.is_set() and i < 2000:
            e = fdq.Envelope(f"s:{i}".encode(), shard_key=f"k{i % 37}")
            live.append((p.push("t", e.body, shard_key=e.shard_key).id, e.shard_key, e.body))
            i += 1
    t = threading.Thread(target=stream, daemon=True)
    t.start()
    done = []
    runner = threading.Thread(target=lambda: done.append(sup.rebalance("t", shards=new)), daemon=True)
    try:
        wait_for(lambda: len(rec.committed(db)) >= 200, 60, what="consumption under way")
        runner.start()
        runner.join(120)
        assert done and done[0].shards == new, "rebalance did not finish"
        assert done[0].config.resharding_to is None and not done[0].config.paused   # the topic as it is now
        stop.set()
        t.join(30)
        assert sup.config("t").shards == new
        total = len(pushed) + len(live)
        wait_for(lambda: len(rec.committed(db)) >= total, 120, what="everything consumed")
    finally:
        stop.set()
        consumer.shutdown()
    counts = rec.committed(db)
    assert set(counts) == {i for i, _k, _b in pushed + live}
    assert set(counts.values()) == {1}
    delivered = rec.seen(db)
    # pushed and live may interleave per key: check each producer's own sequence
    check_order(pushed, [d for d in delivered if not d[2].startswith(b"s:")])
    check_order(live, [d for d in delivered if d[2].startswith(b"s:")])
    s = sub_stats(db, "t")
    assert s["backlog"] == 0 and s["in_flight"] == 0
    assert sup.stats("t")["counters"]["routed"] == total


@pytest.mark.slow
def test_rebalance_killed_midway_and_rerun(procs, db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    pushed = push_keys(db, "t", 8000, 40)
    p = procs.start("rebalance", "rebalance", "--topic", "t", "--count", 7)
    assert procs.readline(p, 60).strip() == "start"
    while True:    # kill it once it has moved a full chunk (mid-way through a shard)
        line = procs.readline(p, 60)
        assert line.startswith("chunk"), f"rebalance finished before the kill: {line!r}"
        if int(line.split()[1]) == supmod.CHUNK:
            break
    procs.kill9(p)
    config = sup.config("t")
    assert config.resharding_to == 7 and config.shards == 4, "the kill did not land mid-way"
    # Pushes meanwhile wait in the pending area (not routed while resharding).
    more = push_keys(db, "t", 300, 40, "late")
    returned = sup.rebalance("t", shards=7)
    config = sup.config("t")
    assert config.shards == 7 and config.resharding_to is None
    assert returned.config == config      # what is stored once it returns (it had resharding_to=7)
    assert returned.from_shards == 4 and returned.queued == 8000 and 0 < returned.moved < 8000
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (8300, 8300, 0)
    assert sorted(ready_ids(db)) == sorted(i for i, _k, _b in pushed + more)
    assert sub_stats(db, "t")["backlog"] == 8300
    rec = consume_recorded(db)
    counts = rec.committed(db)
    assert len(counts) == 8300 and set(counts.values()) == {1}
    check_order(pushed + more, rec.seen(db))


@pytest.mark.parametrize("old,new", [(5, 3), (3, 8)])
def test_rebalance_reports_the_messages_it_moved_and_progress_adds_up_to_the_queued(db, old, new):
    """``Rebalanced``: ``queued`` is what the queues held at its start (ready, delayed
    and leased, from counters), ``moved`` the messages whose shard changed, each once
    (a shrink to a count that is not a divisor moves messages into shards not processed
    yet, read there again); ``progress`` counts every queued message once: with no push
    or settlement meanwhile, moved + kept == queued == the progress total."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=old)
    ready = push_keys(db, "t", supmod.CHUNK + 300, 97)      # more than a chunk per shard for some
    p = fdq.Producer(db)
    delayed = [(p.push("t", b"later", shard_key=f"d{i}", delay=600).id, f"d{i}") for i in range(20)]
    c = fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=600))
    leased = []
    wait_for(lambda: leased.extend(c.fetch(30 - len(leased), timeout=0.2)) or len(leased) >= 30, 30,
             what="30 messages leased")
    keys = [k for _i, k, _b in ready] + [k for _i, k in delayed]
    assert sub_stats(db, "t")["in_flight"] == 30 and sub_stats(db, "t")["delayed"] == 20
    counted = []
    try:
        result = sup.rebalance("t", shards=new, progress=counted.append)
    finally:
        c.close()
    want_moved = sum(1 for k in keys if shard_of(k, old) != shard_of(k, new))
    assert 0 < want_moved < len(keys)
    assert (result.from_shards, result.shards, result.config.shards) == (old, new, new)
    assert result.queued == len(keys)
    assert result.moved == want_moved
    assert result.moved + sum(1 for k in keys if shard_of(k, old) == shard_of(k, new)) == result.queued
    assert sum(counted) == result.queued
    again = sup.rebalance("t", shards=new)                 # nothing to do: nothing queued or moved
    assert (again.from_shards, again.shards, again.queued, again.moved) == (new, new, 0, 0)
