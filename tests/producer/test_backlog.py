"""``max_backlog``: whole pushes refused over it, held while paused.

A push of a msg_id already stored within the dedupe window writes nothing: it must be
answered as the duplicate it is, whatever the backlog (a producer retrying after
commit_unknown_result was told 'push refused' for a message that was stored)."""
from __future__ import annotations

import pytest

import fdq
from fdq.errors import BacklogFull
from fdq.keyspace import Keyspace

from fdqtest import FAST, fetch_until, scan, sub_stats


def test_a_duplicate_push_to_a_topic_over_its_max_backlog_is_answered_as_a_duplicate(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1, max_backlog=2)
    p = fdq.Producer(db)
    first = p.push("t", b"a", msg_id="a")
    p.push("t", b"b")
    sup.update_topic("t", max_backlog=1)     # (or producers overshot it together)
    again = p.push("t", b"a", msg_id="a")
    assert again.duplicate and again.id == first.id
    [dup] = p.push_many("t", [fdq.Envelope(b"a", msg_id="a")])
    assert dup.duplicate and dup.id == first.id
    with pytest.raises(BacklogFull):          # a new message still is refused
        p.push("t", b"c", msg_id="c")
    with pytest.raises(BacklogFull):          # and so is a batch with one
        p.push_many("t", [fdq.Envelope(b"a", msg_id="a"), fdq.Envelope(b"d")])
    assert sup.stats("t")["counters"]["inserted"] == 2


def test_max_backlog_refuses_whole_pushes(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, max_backlog=10)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(f"{i}".encode()) for i in range(10)])
    with pytest.raises(fdq.BacklogFull, match="max_backlog"):
        p.push("t", b"one too many")
    with pytest.raises(fdq.BacklogFull):
        p.push_many("t", [fdq.Envelope(b"x"), fdq.Envelope(b"y")])
    ts = Keyspace().topic("t")
    assert sup.stats("t")["counters"]["inserted"] == 10
    assert len(scan(db, ts.log.key())) == 10 and sub_stats(db, "t")["backlog"] == 10
    with fdq.Consumer(db, "t", config=FAST) as c:
        got = fetch_until(c, lambda g: len(g) >= 4, 10)
        for m in got[:4]:
            m.ack()
        for m in got[4:]:
            m.nak(0)
    p.push_many("t", [fdq.Envelope(f"more{i}".encode()) for i in range(4)])
    with pytest.raises(fdq.BacklogFull):
        p.push("t", b"full again")
    assert sup.stats("t")["counters"]["inserted"] == 14


def test_max_backlog_holds_while_paused(db):
    """A push while paused only lands in the log (routed later by play): it counts
    toward every subscription's backlog all the same, else a paused topic took pushes
    without bound and play then routed far past max_backlog."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, max_backlog=10)
    sup.create_subscription("t", "other")
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(f"{i}".encode()) for i in range(6)])
    sup.pause("t")
    p.push_many("t", [fdq.Envelope(f"p{i}".encode()) for i in range(4)])
    with pytest.raises(fdq.BacklogFull, match="max_backlog"):
        p.push("t", b"one too many")
    assert sup.stats("t")["counters"]["inserted"] == 10
    sup.play("t")
    with pytest.raises(fdq.BacklogFull):
        p.push("t", b"still full")
    subs = sup.stats("t")["subscriptions"]
    assert subs["default"]["backlog"] == subs["other"]["backlog"] == 10
