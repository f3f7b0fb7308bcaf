"""Per-message TTL: a message whose TTL ended (by the topic's clock) is never delivered,
in any delivery mode; it is dropped (counted ``expired``) or dead-lettered, by the
topic's ``ttl_action``, in the transaction that skips it."""
from __future__ import annotations

import threading

import pytest

import fdq
from fdq.errors import InvalidMessage
from fdq.keyspace import Keyspace
from fdq.keyspace.codec import Record
from fdq.ops.clock import read_clock

from fdqtest import FAST, wait_for


def clock_ms(db, name) -> int:
    tr = db.create_transaction()
    try:
        return read_clock(tr, Keyspace().topic(name).clock_key)
    finally:
        tr.cancel()


def ready_expiries(db, name) -> dict:
    """{body: expires} of the ready rows of shard 0 of the default subscription."""
    shard = Keyspace().topic(name).shard("default", "", 0)
    tr = db.create_transaction()
    try:
        r = shard.ready_range
        return {rec.body: rec.expires for rec in (Record.decode(kv.value) for kv in tr.get_range(r.start, r.stop))}
    finally:
        tr.cancel()


def sub_stats(sup, name):
    return sup.stats(name)["subscriptions"]["default"]


@pytest.mark.parametrize("action", ["drop", "dead_letter"])
@pytest.mark.parametrize("mode", ["at_least_once", "at_most_once", "exactly_once"])
def test_an_expired_message_is_never_delivered(db, sup, mode, action):
    sup.create_topic("t", shards=1, ttl_action=action)
    sup.pause_subscription("t", "default")      # nothing delivered until its TTL ends
    handled = []
    lock = threading.Lock()

    def record(m):
        with lock:
            handled.append(m.body)
    kwargs = {"at_least_once": dict(acking=True), "at_most_once": dict(acking=False),
              "exactly_once": dict(transactional=True)}[mode]
    handler = (lambda tr, m: record(m)) if mode == "exactly_once" else record
    c = fdq.tail(db, "t", handler, config=FAST, **kwargs)      # its membership runs the topic's clock
    try:
        p = fdq.Producer(db)
        p.push("t", b"short", ttl=0.3)
        p.push("t", b"long", ttl=600)
        p.push_many("t", [fdq.Envelope(b"none")])
        expires = ready_expiries(db, "t")
        # (the base, due_base, may move either way by a little between two pushes)
        assert expires[b"none"] is None and abs(expires[b"long"] - expires[b"short"] - 599_700) < 5_000
        wait_for(lambda: clock_ms(db, "t") >= expires[b"short"], 30, what="the topic's clock past the TTL")
        sup.play_subscription("t", "default")
        wait_for(lambda: len(handled) >= 2, 30, what="the two live messages")
        st = wait_for(lambda: (s := sub_stats(sup, "t"))["backlog"] == 0 and s, 30, what="an empty backlog")
    finally:
        c.shutdown()
    assert sorted(handled) == [b"long", b"none"]
    assert st["expired"] == 1
    if action == "dead_letter":
        assert st["dlq"] == 1
        [d] = sup.peek("t", states=("dead",))
        assert d["body"] == b"short" and d["reason"].startswith("ttl expired")
    else:
        assert st["dlq"] == 0


def test_a_nacked_message_whose_ttl_ends_before_its_redelivery_is_not_redelivered(db, sup):
    sup.create_topic("t", shards=1)
    with fdq.Consumer(db, "t", config=FAST) as c:
        fdq.Producer(db).push("t", b"once", ttl=0.5)
        [m] = wait_for(lambda: c.fetch(1, timeout=0.2), 30, what="the first delivery")
        m.nak(delay=0.8)
        redelivered = []
        wait_for(lambda: redelivered.extend(c.fetch(1, timeout=0.2)) or sub_stats(sup, "t")["expired"] == 1, 30,
                 what="the expiry at its would-be redelivery")
        assert redelivered == [] and sub_stats(sup, "t")["backlog"] == 0


def test_a_topic_default_ttl_applies_to_pushes_without_their_own(db, sup):
    sup.create_topic("t", shards=1, ttl_s=60)
    p = fdq.Producer(db)
    p.push("t", b"default")
    p.push("t", b"own", ttl=600)
    p.push_many("t", [fdq.Envelope(b"plain")])
    e = ready_expiries(db, "t")
    assert 59_000 <= e[b"default"] - clock_ms(db, "t") <= 61_000 + 60_000    # (+ versions since the clock moved)
    assert abs(e[b"own"] - e[b"default"] - 540_000) < 5_000 and abs(e[b"plain"] - e[b"default"]) < 5_000


def test_ttl_is_checked_at_the_call(db):
    for bad in (0, -1, float("nan"), "1", True):
        with pytest.raises(InvalidMessage):
            fdq.Envelope(b"x", ttl_s=bad)
    with pytest.raises(InvalidMessage, match="must exceed delay"):
        fdq.Producer(db).push("t", b"x", delay=5, ttl=2)
    with pytest.raises(fdq.ConfigError):
        fdq.TopicConfig(ttl_action="keep")


def test_the_maintenance_removes_expired_messages_of_a_subscription_nobody_consumes(db, sup):
    sup.create_topic("t", shards=2, ttl_action="dead_letter")
    sup.create_subscription("t", "idle")
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i, ttl_s=0.3) for i in range(5)])
    with fdq.Consumer(db, "t", config=FAST):     # holds the topic's maintenance, runs its clock
        st = wait_for(lambda: (s := sup.stats("t")["subscriptions"]["idle"])["backlog"] == 0 and s, 30,
                      what="the idle subscription's expired messages removed")
    assert (st["expired"], st["dlq"]) == (5, 5)
    assert sup.stats("t")["maintenance"]["last_pass_by"] is not None
