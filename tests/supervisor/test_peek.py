"""Looking at messages without consuming them: ``Supervisor.peek`` and ``Supervisor.get``
read at one version with snapshot reads (no write, no conflict), and show each message
where it is (ready, delayed, in flight, dead) with its attempts, due time, lease holder,
dead-letter reason."""
from __future__ import annotations

import datetime
import os
import time

import pytest

import fdq
from fdq.errors import MessageNotFound
from fdq.keyspace import Keyspace, parse_message_id
from fdq.keyspace.codec import CHUNK_BYTES
from fdq.ops import peek as peek_ops

from fdqtest import fast, fetch_until, scan


def _every_state(db):
    """Topic "t" (2 shards, subscriptions "default" and "other") with, in "default",
    messages ready (one nak'd: attempts 1), delayed, in flight, dead and acked. Returns
    (the open consumer holding the in-flight one, {body: id})."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "other")
    p = fdq.Producer(db)
    ids = {b: p.push("t", b, shard_key=b.decode()).id for b in (b"acked", b"dead", b"naked", b"leased")}
    c = fdq.Consumer(db, "t", config=fast(ack_wait_s=60))
    got = {m.body: m for m in fetch_until(c, lambda g: len(g) >= 4)}
    got[b"acked"].ack()
    got[b"dead"].term("cannot parse")
    got[b"naked"].nak()
    ids[b"later"] = p.push("t", b"later", shard_key="later", delay=3600).id
    ids[b"fresh"] = p.push("t", b"fresh", shard_key="fresh").id
    return c, ids


def _freeze(c):
    """Stop the consumer's threads (heartbeats, clock, lease checks) as a kill -9 would,
    its lease left held: nothing but the test writes to the database any more."""
    c._stop.set()
    c._member.join(timeout=10)


def test_peek_and_get_write_nothing_with_every_state_present(db, dump):
    c, ids = _every_state(db)
    _freeze(c)
    try:
        sup = fdq.Supervisor(db)
        before = dump()
        seen = sup.peek("t", limit=100)
        assert {e["state"] for e in seen} == {"ready", "delayed", "in_flight", "dead"}
        for mid in ids.values():
            sup.get("t", mid)
        sup.peek("t", "other", states=["ready"], limit=5)
        assert dump() == before
    finally:
        c.close()


def test_peek_takes_no_read_conflict(db):
    """Everything a peek and a get read is rewritten by another transaction before
    theirs commits (with one write of its own, so the commit is checked): it commits,
    as no read of theirs is a conflict range. A non-snapshot read would fail it (1020)."""
    c, ids = _every_state(db)
    _freeze(c)
    try:
        ts = Keyspace().topic("t")
        tr = db.create_transaction()
        assert {e["state"] for e in peek_ops.peek(tr, ts, "default", peek_ops.STATES, 100)} == \
            {"ready", "delayed", "in_flight", "dead"}
        for mid in ids.values():
            peek_ops.get(tr, ts, parse_message_id(mid))
        other = db.create_transaction()
        for key, value in scan(db, b""):
            other[key] = value
        other.commit().wait()
        tr[b"peek-test-own-write"] = b"x"
        tr.commit().wait()
    finally:
        c.close()


def test_peek_shows_attempts_due_time_lease_holder_and_reason(db):
    c, ids = _every_state(db)
    try:
        sup = fdq.Supervisor(db)
        by_body = {e["body"]: e for e in sup.peek("t", limit=100)}
        assert set(by_body) == {b"dead", b"naked", b"leased", b"later", b"fresh"}
        assert [e["id"] for e in sup.peek("t", limit=100)] == sorted(e["id"] for e in by_body.values())
        naked, leased, dead, later = by_body[b"naked"], by_body[b"leased"], by_body[b"dead"], by_body[b"later"]
        assert (naked["state"], naked["attempts"], naked["id"]) == ("ready", 1, ids[b"naked"])
        assert (leased["state"], leased["attempts"], leased["leased_by"], leased["ack_wait_s"]) == \
            ("in_flight", 1, c.id, 60)
        assert (dead["state"], dead["reason"], dead["consumer"], dead["attempts"]) == \
            ("dead", "terminated: cannot parse", c.id, 1)
        assert 0 <= dead["dead_age_s"] < 60
        assert later["state"] == "delayed" and 3500 < later["due_in_s"] <= 3600
        assert by_body[b"fresh"]["attempts"] == 0 and by_body[b"fresh"]["shard_key"] == "fresh"
        assert all(e["shard"] in (0, 1) and e["tag"] == "" for e in by_body.values() if e["state"] != "dead")
        # states and limit
        assert [e["body"] for e in sup.peek("t", states=["dead", "delayed"])] == [b"dead", b"later"]
        assert [e["state"] for e in sup.peek("t", states="in_flight")] == ["in_flight"]
        assert len(sup.peek("t", limit=2)) == 2
        assert [(e["body"], e["state"]) for e in sup.peek("t", "other", limit=100)] == \
            [(b"acked", "ready"), (b"dead", "ready"), (b"naked", "ready"), (b"leased", "ready"),
             (b"later", "delayed"), (b"fresh", "ready")]
        for bad in (dict(limit=0), dict(limit=True), dict(states=["gone"]), dict(states=[])):
            with pytest.raises(fdq.ConfigError):
                sup.peek("t", **bad)
        with pytest.raises(fdq.SubscriptionNotFound):
            sup.peek("t", "nosuch")
        with pytest.raises(fdq.TopicNotFound):
            sup.peek("nosuch")
    finally:
        c.close()


def test_peek_from_a_time_and_a_large_body_whole(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    p.push("t", b"old")
    time.sleep(0.05)
    cut = datetime.datetime.now(datetime.timezone.utc)
    time.sleep(0.05)
    big = os.urandom(2 * CHUNK_BYTES + 5)
    p.push("t", big)
    p.push("t", b"new")
    assert [e["body"] for e in sup.peek("t")] == [b"old", big, b"new"]
    assert [e["body"] for e in sup.peek("t", from_time=cut)] == [big, b"new"]


def test_get_says_where_the_message_is_in_each_subscription(db):
    c, ids = _every_state(db)
    try:
        sup = fdq.Supervisor(db)
        got = sup.get("t", ids[b"leased"])
        assert got["id"] == ids[b"leased"] and got["log"]["body"] == b"leased"
        assert got["log"]["shard_key"] == "leased" and got["pending"] is False
        assert got["subscriptions"]["default"]["state"] == "in_flight"
        assert got["subscriptions"]["default"]["places"][0]["leased_by"] == c.id
        assert got["subscriptions"]["other"]["state"] == "ready"
        states = {b: sup.get("t", mid)["subscriptions"]["default"]["state"] for b, mid in ids.items()}
        assert states == {b"acked": "done", b"dead": "dead", b"naked": "ready", b"leased": "in_flight",
                          b"later": "delayed", b"fresh": "ready"}
        [place] = sup.get("t", ids[b"dead"])["subscriptions"]["default"]["places"]
        assert place["reason"] == "terminated: cannot parse"
        # trimmed from the log: still found where it is queued (every shard looked at)
        sup.trim("t", before_ms=int(time.time() * 1000) + 60_000)
        got = sup.get("t", ids[b"naked"])
        assert got["log"] is None and got["subscriptions"]["default"]["state"] == "ready"
        with pytest.raises(MessageNotFound, match="not found"):
            sup.get("t", ids[b"acked"][:-1] + "f")
        with pytest.raises(fdq.ConfigError, match="24 hex digits"):
            sup.get("t", "zz")
    finally:
        c.close()


def test_get_of_a_message_pushed_while_paused_is_pending(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.pause("t")
    mid = fdq.Producer(db).push("t", b"x").id
    got = sup.get("t", mid)
    assert got["pending"] and got["subscriptions"]["default"] == {"state": "pending", "places": []}
    sup.play("t")
    assert sup.get("t", mid)["subscriptions"]["default"]["state"] == "ready"


def test_peek_shows_a_damaged_record_as_stored_and_leaves_it(db, dump):
    """A ready value that does not decode is shown raw (its bytes as the body), not
    dead-lettered: moving it is the consumers' job, a peek writes nothing."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    mid = fdq.Producer(db).push("t", b"fine").id
    [(key, value)] = scan(db, Keyspace().topic("t").shard("default", "", 0).ready.key())
    tr = db.create_transaction()
    tr[key] = value + b"\x01"
    tr.commit().wait()
    before = dump()
    [e] = sup.peek("t")
    assert (e["id"], e["state"], e["raw"], e["body"], e["attempts"]) == (mid, "ready", True, value + b"\x01", None)
    assert sup.get("t", mid)["subscriptions"]["default"]["places"][0]["raw"] is True
    assert dump() == before
