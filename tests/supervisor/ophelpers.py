"""Helpers of the supervisor tests (pause/play, reshard, replay, retention): topics fanned
out to several subscriptions, keyed pushes and the order they must come back in, a
reshard run by hand, consumers that fetch and ack."""
from __future__ import annotations

import collections
import time
import weakref

import fdq
import fdq.supervisor as sv
from fdq.keyspace import Keyspace, message_id, vs_key
from fdq.keyspace.codec import pack, unpack

from fdqtest import drain, fast, scan, sub_stats, wait_for


SUBS = 9        # fan_out_topic: the default subscription and 8 more
# The supervisor tests' exactly-once consumers: FAST with slower polls and lease checks.
SUPERVISED = fast(poll_interval_s=0.1, lease_check_interval_s=0.1)


def fetch_acked(c, want: int, timeout: float) -> list:
    """Fetch (and ack) until ``want`` messages came or ``timeout`` passed."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        for m in c.fetch(want - len(got), timeout=0.2):
            got.append((m.id, m.shard_key, m.body))
            m.ack()
    return got


def consume(db, want: int, timeout: float) -> list:
    """``fetch_acked`` with a consumer of its own (leases of 10 minutes), closed after."""
    cons = fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=600))
    try:
        return fetch_acked(cons, want, timeout)
    finally:
        cons.close()


def push_keys(db, topic, n, keys, tag="m"):
    p = fdq.Producer(db)
    out = []
    for i in range(0, n, 500):
        envs = [fdq.Envelope(f"{tag}:{j}".encode(), shard_key=f"k{j % keys}") for j in range(i, min(n, i + 500))]
        out += [(r.id, e.shard_key, e.body) for r, e in zip(p.push_many(topic, envs), envs)]
    return out


def check_order(pushed, delivered):
    """Per shard key, the delivered bodies (first deliveries) come in push order."""
    want = collections.defaultdict(list)
    for _i, key, body in pushed:
        want[key].append(body)
    got = collections.defaultdict(list)
    for _i, key, body, _r in delivered:
        got[key].append(body)
    for key in want:
        assert got[key] == want[key], f"key {key}: order broken"


def reshard_steps(db, ts, shards: int, old: int):
    """What ``rebalance(shards=...)`` commits before its play: begin, every chunk, finish
    (a run kill -9'd right after ``reshard_finish`` leaves exactly this state)."""
    sv.reshard_begin(db, ts, shards)
    for n in range(max(old, shards)):
        for area in ("ready", "delayed", "leased"):
            after = None
            while True:
                _r, after, done, *_ = sv.reshard_chunk(db, ts, "default", "", n, area, shards, sv.CHUNK, after)
                if done:
                    break
    sv.reshard_finish(db, ts)


def ready_ids(db, topic="t"):
    """Message ids in every ready queue of the default subscription (a key-space scan)."""
    ts = Keyspace().topic(topic)
    space = ts.subs["default"]["shards"]
    ids = []
    for k, _v in scan(db, space.key()):
        t = space.unpack(k)
        if len(t) == 4 and t[2] == "ready":
            ids.append(message_id(t[3]))
    return ids


def fan_out_topic(db, name: str = "t"):
    s = fdq.Supervisor(db)
    s.create_topic(name, shards=2)
    for i in range(1, SUBS):
        s.create_subscription(name, f"s{i}")
    assert len(s.config(name).subs) == SUBS
    return s


def drain_bodies(db, topic: str, sub: str, want: int, timeout: float = 30.0) -> list:
    return [m.body for m in drain(db, topic, sub, until=want, batch=None, timeout=timeout,
                                  config=fdq.ConsumerConfig(ack_wait_s=600))]


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


def consume_recorded(db, batch_size: int = 500) -> Recorder:
    """Consume topic ``t``'s whole backlog exactly once, recorded (see :class:`Recorder`)."""
    rec = Recorder()
    consumer = fdq.tail(db, "t", rec, transactional=True, config=SUPERVISED, batch_size=batch_size)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 120, what="the backlog consumed")
    finally:
        consumer.shutdown()
    return rec
