"""Supervisor operations: pause / play (inserted vs routed), a play kill -9'd midway and
run again, rebalance with a shard-count change (order per key kept, nothing lost or
doubled, also for a hot key whose backlog stays put), replay of a time window."""
from __future__ import annotations

import collections
import threading
import time
import weakref

import pytest

import fdq
from fdq import supervisor as supmod
from fdq.keyspace import Keyspace, message_id, vs_key
from fdq.keyspace.codec import pack, unpack
from fdq.keyspace.codec import shard_of

from fdqtest import FAST, fast, scan, sub_stats, wait_for, with_faults



class Recorder:
    """An exactly-once handler recording each delivery through the dequeue transaction:
    a count per id and a versionstamped entry, so ``seen()`` lists committed deliveries
    in commit order (a retried transaction's handler calls leave no trace)."""

    def __init__(self):
        self.uv = weakref.WeakKeyDictionary()

    def __call__(self, tr, m):
        tr.add(b"qt/count/" + m.id.encode(), (1).to_bytes(8, "little"))
        uv = self.uv.get(tr, 0)
        self.uv[tr] = uv + 1
        tr.set_versionstamped_key(vs_key(b"qt/seen/", uv), pack([m.id, m.shard_key, m.body, m.replay_of]))

    def committed(self, db):
        return {k[len(b"qt/count/"):].decode(): int.from_bytes(bytes(v)[:8], "little")
                for k, v in scan(db, b"qt/count/")}

    def seen(self, db):
        return [tuple(unpack(v)) for _k, v in scan(db, b"qt/seen/")]


def _push_keys(db, topic, n, keys, tag="m"):
    p = fdq.Producer(db)
    out = []
    for i in range(0, n, 500):
        envs = [fdq.Envelope(f"{tag}:{j}".encode(), shard_key=f"k{j % keys}") for j in range(i, min(n, i + 500))]
        out += [(r.id, e.shard_key, e.body) for r, e in zip(p.push_many(topic, envs), envs)]
    return out


def _ready_ids(db, topic="t"):
    """Message ids in every ready queue of the default subscription (a key-space scan)."""
    ts = Keyspace().topic(topic)
    space = ts.subs["default"]["shards"]
    ids = []
    for k, _v in scan(db, space.key()):
        t = space.unpack(k)
        if len(t) == 4 and t[2] == "ready":
            ids.append(message_id(t[3]))
    return ids


def _check_order(pushed, delivered):
    """Per shard key, the delivered bodies (first deliveries) come in push order."""
    want = collections.defaultdict(list)
    for _i, key, body in pushed:
        want[key].append(body)
    got = collections.defaultdict(list)
    for _i, key, body, _r in delivered:
        got[key].append(body)
    for key in want:
        assert got[key] == want[key], f"key {key}: order broken"


def test_pause_play_inserted_vs_routed(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    first = _push_keys(db, "t", 100, 10, "a")
    sup.pause("t")
    paused = _push_keys(db, "t", 300, 10, "b")
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (400, 100, 300)
    assert sub_stats(db, "t")["backlog"] == 100
    rec = Recorder()
    consumer = fdq.tail(db, "t", rec, transactional=True, config=fast(poll_interval_s=0.1, lease_check_interval_s=0.1))
    try:
        time.sleep(0.5)   # a paused topic delivers nothing, even what was routed before
        assert rec.committed(db) == {}
        assert sup.play("t") == 300
        assert not sup.config("t").paused
        c = sup.stats("t")["counters"]
        assert (c["inserted"], c["routed"], c["pending"]) == (400, 400, 0)
        wait_for(lambda: len(rec.committed(db)) == 400, 60, what="all 400 consumed")
    finally:
        consumer.shutdown()
    assert set(rec.committed(db).values()) == {1}
    _check_order(first + paused, rec.seen(db))


@pytest.mark.slow
def test_play_killed_midway_and_rerun(procs, db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    sup.pause("t")
    pushed = _push_keys(db, "t", 8000, 40)
    assert sup.stats("t")["counters"]["pending"] == 8000
    p = procs.start("play", "play", "--topic", "t")
    assert procs.readline(p, 60).strip() == "start"
    assert procs.readline(p, 60).startswith("chunk")     # at least one chunk committed
    procs.kill9(p)
    c = sup.stats("t")["counters"]
    assert 0 < c["pending"] < 8000, f"the kill did not land midway: {c}"
    assert sup.config("t").paused
    assert sup.play("t") == c["pending"]
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (8000, 8000, 0)
    ready = _ready_ids(db)
    assert len(ready) == 8000 and set(ready) == {i for i, _k, _b in pushed}
    assert sub_stats(db, "t")["backlog"] == 8000
    rec = Recorder()
    consumer = fdq.tail(db, "t", rec, transactional=True, config=FAST, batch_size=500)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 120, what="the backlog consumed")
    finally:
        consumer.shutdown()
    counts = rec.committed(db)
    assert len(counts) == 8000 and set(counts.values()) == {1}
    _check_order(pushed, rec.seen(db))


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
    pushed += _push_keys(db, "t", 2000, 37)
    rec = Recorder()
    consumer = fdq.tail(db, "t", rec, transactional=True, config=FAST, batch_size=20)
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
        assert done[0].resharding_to is None and not done[0].paused   # it returns the topic as it is now
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
    _check_order(pushed, [d for d in delivered if not d[2].startswith(b"s:")])
    _check_order(live, [d for d in delivered if d[2].startswith(b"s:")])
    s = sub_stats(db, "t")
    assert s["backlog"] == 0 and s["in_flight"] == 0
    assert sup.stats("t")["counters"]["routed"] == total


@pytest.mark.slow
def test_rebalance_killed_midway_and_rerun(procs, db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    pushed = _push_keys(db, "t", 8000, 40)
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
    more = _push_keys(db, "t", 300, 40, "late")
    returned = sup.rebalance("t", shards=7)
    config = sup.config("t")
    assert config.shards == 7 and config.resharding_to is None
    assert returned == config      # what is stored once it returns (it had resharding_to=7)
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (8300, 8300, 0)
    assert sorted(_ready_ids(db)) == sorted(i for i, _k, _b in pushed + more)
    assert sub_stats(db, "t")["backlog"] == 8300
    rec = Recorder()
    consumer = fdq.tail(db, "t", rec, transactional=True, config=FAST, batch_size=500)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 120, what="the backlog consumed")
    finally:
        consumer.shutdown()
    counts = rec.committed(db)
    assert len(counts) == 8300 and set(counts.values()) == {1}
    _check_order(pushed + more, rec.seen(db))


def test_replay_time_window(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    p = fdq.Producer(db)
    before = _push_keys(db, "t", 50, 5, "before")
    time.sleep(0.05)
    start = int(time.time() * 1000)
    time.sleep(0.05)
    window = _push_keys(db, "t", 80, 5, "window")
    time.sleep(0.05)
    end = int(time.time() * 1000)
    time.sleep(0.05)
    after = _push_keys(db, "t", 30, 5, "after")
    rec = Recorder()
    consumer = fdq.tail(db, "t", rec, transactional=True, config=fast(poll_interval_s=0.1, lease_check_interval_s=0.1))
    try:
        wait_for(lambda: len(rec.committed(db)) == 160, 60, what="the originals consumed")
        assert p.replay("t", start, end) == 80
        wait_for(lambda: len(rec.committed(db)) == 240, 60, what="the replay consumed")
        time.sleep(0.3)
    finally:
        consumer.shutdown()
    counts = rec.committed(db)
    assert len(counts) == 240 and set(counts.values()) == {1}
    replayed = [s for s in rec.seen(db) if s[3] is not None]
    assert sorted(r for _i, _k, _b, r in replayed) == sorted(i for i, _k, _b in window)
    assert {i for i, _k, _b, _r in replayed}.isdisjoint(i for i, _k, _b in before + window + after)
    _check_order(window, replayed)
    assert sup.stats("t")["counters"]["inserted"] == 240


def test_create_topic_existing_with_another_shard_count(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    assert sup.create_topic("t").shards == 4            # no count asked: the topic as it is
    assert sup.create_topic("t", shards=4).shards == 4  # same count: no-op
    with pytest.raises(fdq.TopicExists, match=r"already exists with 4 shards, not 16 \(change"):
        sup.create_topic("t", shards=16)                # the default count, asked for explicitly
    assert sup.config("t").shards == 4


def test_producer_auto_create_options(db):
    strict = fdq.Producer(db, config=fdq.ProducerConfig(auto_create=False))
    with pytest.raises(fdq.TopicNotFound, match="'a' does not exist"):
        strict.push("a", b"x")
    shaped = fdq.Producer(db, config=fdq.ProducerConfig(auto_create=fdq.TopicConfig(shards=4, subs=())))
    shaped.push_many("a", [fdq.Envelope(b"x"), fdq.Envelope(b"y")])
    sup = fdq.Supervisor(db)
    assert (sup.config("a").shards, sup.config("a").subs) == (4, ())
    assert sup.stats("a")["counters"]["inserted"] == 2      # in the "all" log, no queue
    fdq.Producer(db).push("b", b"z")                        # the default: 16 shards, "default"
    assert (sup.config("b").shards, sup.config("b").subs) == (16, ("default",))
    with pytest.raises(fdq.ConfigError, match="auto_create must be True, False or a TopicConfig"):
        fdq.ProducerConfig(auto_create="yes")


def _replayed(db, ts):
    """{original id: times replayed} from the "all" log's records."""
    counts = collections.Counter()
    for _k, v in scan(db, ts.log.key()):
        rec = unpack(v)
        if len(rec) > 7 and rec[7] is not None:
            counts[rec[7]] += 1
    return counts


def test_replay_without_end_stops_at_its_start(db):
    """An open-ended replay replays what was committed when it began, not its own pushes
    (it used to read them back and replay them again: 2,500 messages gave 15,700)."""
    pushed = _push_keys(db, "t", 2500, 40)
    assert fdq.Producer(db).replay("t", 0) == 2500
    counts = _replayed(db, Keyspace().topic("t"))
    assert set(counts) == {i for i, _k, _b in pushed} and set(counts.values()) == {1}
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 5000
    assert scan(db, Keyspace().topic("t").replays.key()) == []    # finished: no progress left


def test_replay_killed_midway_resumes_without_duplicates(procs, db):
    pushed = _push_keys(db, "t", 6000, 40)
    p = procs.start("replay", "replay", "--topic", "t")
    assert procs.readline(p, 60).strip() == "start"
    assert procs.readline(p, 60).startswith("chunk")     # at least one chunk committed
    procs.kill9(p)
    ts = Keyspace().topic("t")
    done = sum(_replayed(db, ts).values())
    assert 0 < done < 6000, f"the kill did not land midway: {done} replayed"
    assert fdq.Producer(db).replay("t", 0) == 6000 - done    # the same replay, resumed
    counts = _replayed(db, ts)
    assert set(counts) == {i for i, _k, _b in pushed} and set(counts.values()) == {1}
    assert scan(db, ts.replays.key()) == []
    # finished: the same window may be replayed again, as a new replay (it now holds the
    # 6,000 messages and their 6,000 replays)
    assert fdq.Producer(db).replay("t", 0) == 12000


def test_replay_under_fault_injection_pushes_each_once(db, url):
    """Retryable errors and commit_unknown_result after real commits: each chunk's
    pushes and its progress commit together, so a retried chunk pushes nothing twice."""
    pushed = _push_keys(db, "t", 3000, 40)
    faulty = fdq.connect(with_faults(url, 0.3, 11))
    assert fdq.Producer(faulty).replay("t", 0) == 3000
    counts = _replayed(db, Keyspace().topic("t"))
    assert set(counts) == {i for i, _k, _b in pushed} and set(counts.values()) == {1}
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 6000
