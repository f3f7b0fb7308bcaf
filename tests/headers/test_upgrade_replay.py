"""Upgrade of a topic holding plain messages; push_many mixing tagged and untagged
messages; headers preserved exactly through the consumer and through replay; trace id."""
from __future__ import annotations

import time

import msgpack
import pytest

import fdq
from fdq.headers import DISPATCH_TAG, TRACE_ID

from fdqtest import FAST, wait_for


RICH = {"s": "héllo ☃", "i": 2**64 - 1, "neg": -2**63, "f": 0.1, "one_f": 1.0, "one_i": 1,
        "t": True, "n": None, "l": [1, "x", [2.5, None], {"k": "v"}], "m": {"a": {"b": [False]}},
        "e": "", TRACE_ID: "42"}


def _collect(db, topic, want: int, **kw) -> list:
    got = []
    with fdq.Consumer(db, topic, config=FAST, **kw) as c:
        def step():
            for m in c.fetch(100, timeout=0.2):
                got.append(m)
                m.ack()
            return len(got) >= want
        wait_for(step, 30, f"{want} messages from {topic}")
    return got


def _log_records(db, topic) -> list:
    """Raw record fields of the "all" log, in log order per bucket, decoded with bytes
    kept as bytes (so header encodings compare byte for byte)."""
    ts = fdq.Supervisor(db).keyspace.topic(topic)
    r = ts.log.range()
    tr = db.create_transaction()
    rows = []
    for kv in tr.snapshot.get_range(r.start, r.stop):
        vs = ts.log.unpack(kv.key)[1]
        rows.append((vs, msgpack.unpackb(bytes(kv.value), raw=False)))
    tr.cancel()
    rows.sort(key=lambda x: x[0])
    return [f for _vs, f in rows]


def _packed(v) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


def test_upgrade_keeps_plain_messages_readable(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(b"old-%d" % i, shard_key=f"k{i}") for i in range(10)])
    p.push("t", b"old-delayed", delay=0.3)
    with pytest.raises(fdq.InvalidHeader):
        p.push("t", b"x", headers={"a": 1})
    plain = fdq.Consumer(db, "t")           # a plain consumer is fine before the upgrade
    early = plain.fetch(3, timeout=2)
    for m in early:
        m.ack()
    plain.close()
    assert len(early) == 3

    cfg = sup.upgrade_extend("t")
    assert cfg.extend and sup.config("t").extend
    assert sup.upgrade_extend("t").extend                   # idempotent
    with pytest.raises(fdq.TopicNotFound):
        sup.upgrade_extend("nope")
    # One-way: creating it again as plain changes nothing; plain consumers are refused.
    assert sup.create_topic("t", shards=2).extend
    with pytest.raises(fdq.ConfigError, match="extend_support=True"):
        fdq.Consumer(db, "t")

    p.push("t", b"new-tagged", headers={DISPATCH_TAG: "A", "h": 1})
    p.push("t", b"new-plain")
    got = _collect(db, "t", 8 + 2, extend_support=True)      # untagged consumer: A falls back
    bodies = {m.body: m for m in got}
    assert set(bodies) | {m.body for m in early} == \
        {b"old-%d" % i for i in range(10)} | {b"old-delayed", b"new-tagged", b"new-plain"}
    old = [m for m in got if m.body.startswith(b"old")]
    assert len(old) == 8 and all(dict(m.headers) == {} and m.tag == "" for m in old)
    assert dict(bodies[b"new-tagged"].headers) == {DISPATCH_TAG: "A", "h": 1}
    assert bodies[b"new-tagged"].tag == "A"
    # The log still reads every message, old ones without a headers field at all.
    recs = _log_records(db, "t")
    assert len(recs) == 13 and sum(1 for f in recs if len(f) > 3 and f[3]) == 1


def test_push_many_mixing_tagged_and_untagged(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, extend=True)
    p = fdq.Producer(db)
    envs = [fdq.Envelope(b"u0"),
            fdq.Envelope(b"a0", shard_key="x", headers={DISPATCH_TAG: "A"}),
            fdq.Envelope(b"b0", headers={DISPATCH_TAG: "B", TRACE_ID: "7"}),
            fdq.Envelope(b"u1", headers={"k": "v"}),
            fdq.Envelope(b"a1", shard_key="x", headers={DISPATCH_TAG: "A", "n": 2}),
            b"u2"]
    res = p.push_many("t", envs)
    assert [r.trace_id for r in res] == [None, None, "7", None, None, None]
    assert res[2].position == res[2].id and res[0].position is None
    assert len({r.id for r in res}) == 6 and sorted(r.id for r in res) == [r.id for r in res]
    tags = sup.stats("t")["subscriptions"]["default"]["tags"]
    assert {t: v["backlog"] for t, v in tags.items()} == {"": 3, "A": 2, "B": 1}
    a = fdq.Consumer(db, "t", extend_support=True, desired_tag="A", config=fdq.ConsumerConfig(heartbeat_interval_s=0.1, poll_interval_s=0.1))
    try:
        got_a = []
        wait_for(lambda: got_a.extend(a.fetch(10, timeout=0.2)) or len(got_a) >= 2, 30, "A's two messages")
        assert [m.body for m in got_a] == [b"a0", b"a1"]            # same shard key: in order
        assert [dict(m.headers) for m in got_a] == [{DISPATCH_TAG: "A"}, {DISPATCH_TAG: "A", "n": 2}]
        for m in got_a:
            m.ack()
    finally:
        a.close()
    got = _collect(db, "t", 4, extend_support=True)
    assert sorted(m.body for m in got) == [b"b0", b"u0", b"u1", b"u2"]
    assert {m.body: m.tag for m in got}[b"b0"] == "B"


def test_headers_preserved_through_replay_and_consumer(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, extend=True)
    p = fdq.Producer(db)
    t0 = int(time.time() * 1000) - 1000
    originals = [RICH, {DISPATCH_TAG: "A", "x": [1, 2.0]}, {"only": "one"}]
    p.push_many("t", [fdq.Envelope(b"m%d" % i, shard_key="same", headers=h) for i, h in enumerate(originals)]
                + [fdq.Envelope(b"plain", shard_key="same")])
    by_body = {b"m%d" % i: _packed(h) for i, h in enumerate(originals)}
    by_body[b"plain"] = _packed({})
    first = sorted(_collect(db, "t", 4, extend_support=True), key=lambda m: m.body)
    assert {m.body: _packed(dict(m.headers)) for m in first} == by_body
    assert p.replay("t", t0) == 4
    recs = _log_records(db, "t")
    assert len(recs) == 8
    orig, replayed = recs[:4], recs[4:]
    for o, r in zip(orig, replayed):
        oh = o[3] if len(o) > 3 else None
        rh = r[3] if len(r) > 3 else None
        assert _packed(oh) == _packed(rh)                           # byte for byte
        assert r[7] is not None                                     # replay_of kept
    again = sorted(_collect(db, "t", 4, extend_support=True), key=lambda m: m.body)
    assert {m.body: _packed(dict(m.headers)) for m in again} == by_body
    assert [m.replay_of for m in again] == [m.id for m in first]
    assert [m.tag for m in again] == ["", "A", "", ""]


def test_trace_id(db, dump):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", extend=True)
    p = fdq.Producer(db)
    r = p.push("t", b"x", headers={TRACE_ID: "000123"})
    assert r.trace_id == "000123" and r.position == r.id
    r = p.push("t", b"x", headers={TRACE_ID: 123})          # a JSON number: echoed as its digits
    assert r.trace_id == "123" and r.position == r.id
    for not_digits in ("12a", "", " 1", "１２", -1, 1.5, True, None, ["1"]):
        r2 = p.push("t", b"y", headers={TRACE_ID: not_digits})
        assert r2.trace_id is None and r2.position is None
    d1 = p.push("t", b"z", msg_id="m-1", headers={TRACE_ID: "9"})
    d2 = p.push("t", b"z", msg_id="m-1", headers={TRACE_ID: "9"})
    assert d2.duplicate and d2.position == d1.id == d1.position and d2.trace_id == "9"
    before = dump()
    with pytest.raises(fdq.InvalidHeader, match="'##trace'"):
        p.push("t", b"x", headers={"##trace": "1"})
    assert dump() == before
