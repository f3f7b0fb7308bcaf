"""Pausing one subscription: its consumers take nothing while pushes keep filling its
queues; other subscriptions go on; resuming delivers what waited, once."""
from __future__ import annotations

import pytest

import fdq


def test_pause_one_subscription(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "b", fdq.SubscriptionConfig(deliver_policy="new"))
    p = fdq.Producer(db)
    assert sup.pause_subscription("t", "b") is False
    assert sup.pause_subscription("t", "b") is True          # re-running is a no-op
    ids = {r.id for r in p.push_many("t", [fdq.Envelope(b"%d" % i) for i in range(20)])}
    with fdq.Consumer(db, "t", subscription="b") as cb, fdq.Consumer(db, "t") as ca:
        assert cb.fetch(50, timeout=0.5) == []                 # paused: nothing
        got_a = []
        while len(got_a) < 20:
            batch = ca.fetch(50, timeout=5)
            assert batch, "the other subscription stopped too"
            got_a += batch
        ca.ack_many(got_a)
        st = sup.stats("t")["subscriptions"]
        assert st["b"]["paused"] and not st["default"]["paused"] and st["b"]["backlog"] == 20
        assert sup.play_subscription("t", "b") is True
        got_b = []
        while len(got_b) < 20:
            batch = cb.fetch(50, timeout=5)
            assert batch, "nothing delivered after play_subscription"
            got_b += batch
        cb.ack_many(got_b)
    assert {m.id for m in got_a} == {m.id for m in got_b} == ids
    with pytest.raises(fdq.SubscriptionNotFound):
        sup.pause_subscription("t", "nope")
    sup.delete_subscription("t", "b")
    assert "b" not in sup.config("t").paused_subs
