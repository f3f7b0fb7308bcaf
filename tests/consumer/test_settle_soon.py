"""``Consumer.settle_soon``: settlements carried by the next lease transaction of a fetch
(one commit for both, as a tail's round carries its settlements), or committed alone
after their linger when no fetch runs; a lease lost among them fails that batch's
future alone, and the fetch that carried them still hands over what it leased."""
from __future__ import annotations

import time

import pytest

import fdq
from fdq import Action, Settlement

from fdqtest import QUIET, QUIET_WAIT_S as WAIT_S, CountingDatabase, drained_consumer, sub_stats, wait_for


def test_settlements_waiting_are_committed_by_the_next_fetch_in_its_lease_transaction(db):
    """The fetch waits for a push (its shard drained and watched); the acks queued
    meanwhile commit in the lease transaction that takes the push: the fetching thread's
    one transaction, with a linger far longer than the test (no commit of their own)."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    counting = CountingDatabase(db)
    c = drained_consumer(counting)
    p = fdq.Producer(db)
    try:
        p.push_many("t", [fdq.Envelope(b"%d" % i) for i in range(3)])
        got = c.fetch(10, timeout=WAIT_S)
        assert len(got) == 3
        done = c.settle_soon([Settlement(m, Action.ACK) for m in got], linger_s=60)
        time.sleep(0.05)
        assert not done.done(), "committed before any fetch, long before its linger"
        p.push("t", b"next")
        before = counting.mine()
        assert [m.body for m in c.fetch(10, timeout=WAIT_S)] == [b"next"]
        assert counting.mine() - before == 1, "the acks and the lease: one transaction"
        assert done.result(timeout=0) is None
        s = sub_stats(db, "t")
        assert (s["acked"], s["in_flight"]) == (3, 1)
    finally:
        c.close()


def test_a_lost_lease_among_carried_settlements_fails_its_batch_alone(db):
    """Two batches carried by one fetch: the one settling a message already acked fails
    with LeaseLost naming it (as ``settle`` raises); the other batch's ack and the fetch's
    lease commit, and the fetch returns its message."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(3)])
    c = fdq.Consumer(db, "t", config=QUIET)
    try:
        wait_for(lambda: c.owned_shards, 10, what="the shard owned")
        got = c.fetch(3, timeout=WAIT_S)
        assert len(got) == 3
        c.settle([Settlement(got[0], Action.ACK)])
        lost = c.settle_soon([Settlement(got[0], Action.ACK), Settlement(got[1], Action.NAK, 60)], linger_s=60)
        fine = c.settle_soon([Settlement(got[2], Action.ACK)], linger_s=60)
        fdq.Producer(db).push("t", b"next")
        assert [m.body for m in c.fetch(10, timeout=WAIT_S)] == [b"next"]
        with pytest.raises(fdq.LeaseLost) as e:
            lost.result(timeout=0)
        assert e.value.ids == (got[0].id,)
        assert fine.result(timeout=0) is None
        s = sub_stats(db, "t")
        assert (s["acked"], s["in_flight"]) == (2, 1)      # got[1] nak'd with a delay: waiting
    finally:
        c.close()


def test_settlements_no_fetch_carries_commit_alone_after_their_linger(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(2)])
    c = fdq.Consumer(db, "t", config=QUIET)
    try:
        wait_for(lambda: c.owned_shards, 10, what="the shard owned")
        got = c.fetch(2, timeout=WAIT_S)
        start = time.monotonic()
        done = c.settle_soon([Settlement(m, Action.ACK) for m in got], linger_s=0.05)
        assert done.result(timeout=WAIT_S) is None
        assert time.monotonic() - start >= 0.05
        assert sub_stats(db, "t")["acked"] == 2
    finally:
        c.close()


def test_settlements_waiting_at_close_commit_before_the_leases_are_returned(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(2)])
    c = fdq.Consumer(db, "t", config=QUIET)
    wait_for(lambda: c.owned_shards, 10, what="the shard owned")
    got = c.fetch(2, timeout=WAIT_S)
    done = c.settle_soon([Settlement(m, Action.ACK) for m in got], linger_s=60)
    c.close()
    assert done.result(timeout=0) is None
    s = sub_stats(db, "t")
    assert (s["acked"], s["backlog"]) == (2, 0)
    with pytest.raises(fdq.FDQError, match="closed"):
        c.settle_soon([Settlement(got[0], Action.ACK)]).result(timeout=0)
