"""Topics: creating one that exists with another shard count, and upgrading a topic
that holds plain messages."""
from __future__ import annotations

import pytest

import fdq
from fdq.headers import DISPATCH_TAG

from fdqtest import collect, log_records


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
    got = collect(db, "t", 8 + 2, extend_support=True)      # untagged consumer: A falls back
    bodies = {m.body: m for m in got}
    assert set(bodies) | {m.body for m in early} == \
        {b"old-%d" % i for i in range(10)} | {b"old-delayed", b"new-tagged", b"new-plain"}
    old = [m for m in got if m.body.startswith(b"old")]
    assert len(old) == 8 and all(dict(m.headers) == {} and m.tag == "" for m in old)
    assert dict(bodies[b"new-tagged"].headers) == {DISPATCH_TAG: "A", "h": 1}
    assert bodies[b"new-tagged"].tag == "A"
    # The log still reads every message, old ones without a headers field at all.
    recs = log_records(db, "t")
    assert len(recs) == 13 and sum(1 for f in recs if len(f) > 3 and f[3]) == 1


def test_create_topic_existing_with_another_shard_count(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    assert sup.create_topic("t").shards == 4            # no count asked: the topic as it is
    assert sup.create_topic("t", shards=4).shards == 4  # same count: no-op
    with pytest.raises(fdq.TopicExists, match=r"already exists with 4 shards, not 16 \(change"):
        sup.create_topic("t", shards=16)                # the default count, asked for explicitly
    assert sup.config("t").shards == 4
