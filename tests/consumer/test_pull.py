"""Pull consumers (``fetch``, settles, ``ack_many``): arguments checked, lost leases reported.

Pull-style settles made one by one from several threads commit together (one
transaction for those that come at once), each call returning after its own settle
committed and failing alone when its own lease was lost."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import fdq
from fdq.errors import LeaseLost

from fdqtest import fast, sub_stats, wait_for


def _stats(url):
    st = fdq.Supervisor(fdq.connect(url)).stats("t")
    sub = st["subscriptions"]["default"]
    return sub["backlog"], sub["in_flight"], st["counters"]["acked"]


def test_acks_from_eight_threads_each_commit(url, db):
    fdq.Supervisor(db).create_topic("t", shards=4)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i, shard_key=f"k{i}") for i in range(400)])
    acked = []
    with fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=60)) as c, ThreadPoolExecutor(8) as pool:
        deadline = time.monotonic() + 60
        while len(acked) < 400 and time.monotonic() < deadline:
            msgs = c.fetch(100, timeout=0.5)

            def ack(m):
                m.ack()     # returns once committed: read the state from another connection
                return m.id
            acked += pool.map(ack, msgs)
            assert _stats(url)[1] == 0, "an ack returned before its commit"
    assert len(acked) == len(set(acked)) == 400
    assert _stats(url) == (0, 0, 400)


def test_a_lost_lease_fails_only_its_own_settle(url, db, monkeypatch):
    """Two acks committed in one transaction (queued while another settle commits): the
    one whose lease expired and was redelivered raises LeaseLost naming it; the other
    commits."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"a"), fdq.Envelope(b"b"), fdq.Envelope(b"c")])
    c = fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=60, lease_check_interval_s=0.05))
    try:
        a, = c.fetch(1, timeout=5, ack_wait_s=0.2)
        b, = c.fetch(1, timeout=5)
        blocker, = c.fetch(1, timeout=5)
        again = []
        deadline = time.monotonic() + 30    # a's lease expires: redelivered to us
        while not again and time.monotonic() < deadline:
            again = c.fetch(1, timeout=0.2)
        assert [m.id for m in again] == [a.id] and again[0].attempts == 2
        # The first settle holds the commit until the two acks are queued behind it.
        real, entered, go, batches = c.settle, threading.Event(), threading.Event(), []

        def settle(items):
            batches.append([s.message.id for s in items])
            if len(batches) == 1:
                entered.set()
                assert go.wait(30)
            return real(items)
        monkeypatch.setattr(c._settle_group, "_commit", settle)
        results = {}

        def ack(m):
            try:
                m.ack()
                results[m.id] = "ok"
            except LeaseLost as e:
                results[m.id] = e
        first = threading.Thread(target=ack, args=(blocker,))
        first.start()
        assert entered.wait(30)
        others = [threading.Thread(target=ack, args=(m,)) for m in (a, b)]
        for t in others:
            t.start()
        deadline = time.monotonic() + 30
        while len(c._settle_group._queue) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        go.set()
        for t in [first] + others:
            t.join(30)
        assert batches[1:] == [[a.id, b.id]]
        assert results[blocker.id] == results[b.id] == "ok"
        assert isinstance(results[a.id], LeaseLost) and results[a.id].ids == (a.id,)
        again[0].ack()
    finally:
        c.close()
    assert _stats(url) == (0, 0, 3)


def test_settle_twice_is_refused_before_anything_commits(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push("t", b"x")
    with fdq.Consumer(db, "t") as c:
        m, = c.fetch(1, timeout=5)
        m.in_progress()
        m.ack()
        with pytest.raises(fdq.FDQError, match="already settled"):
            m.ack()


def test_a_bad_nak_delay_is_refused_at_the_call(db):
    """Refused before it is queued with other threads' settles (it failed their commit)."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"a"), fdq.Envelope(b"b")])
    with fdq.Consumer(db, "t") as c:
        a, b = c.fetch(2, timeout=5)
        for bad in ("5", -1, True, float("nan"), float("inf")):
            with pytest.raises(fdq.ConfigError, match="nak delay"):
                a.nak(bad)
        a.nak(0)
        b.ack()
        again = c.fetch(1, timeout=5)
        assert [m.id for m in again] == [a.id]
        again[0].ack()


@pytest.mark.parametrize("timeout", [None, "1", float("nan"), True])
def test_fetch_timeout_is_checked(db, timeout):
    """``fetch(timeout=None)`` (or a string) raised a TypeError from inside the wait,
    NaN meant no wait and True one second: a ConfigError naming ``timeout``, nothing
    leased. (A negative timeout stays a valid "no wait": callers pass time left.)"""
    fdq.Producer(db).push("t", b"x")
    with fdq.Consumer(db, "t") as c:
        with pytest.raises(fdq.ConfigError, match="timeout"):
            c.fetch(10, timeout=timeout)
        assert sub_stats(db, "t")["in_flight"] == 0
        [m] = c.fetch(10, timeout=-1) or c.fetch(10, timeout=10)
        m.ack()


# The subscription tests' consumer: FAST with slower polls and lease checks.
SUBS_FAST = fast(lease_check_interval_s=0.2, poll_interval_s=0.1)


def test_ack_many_of_unleased_messages_is_a_clear_error(db):
    """``ack_many`` of messages a subscription with ack_policy='none' delivered (taken, not
    leased) raised a bare TypeError from the engine; ``Message.ack`` says why."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "n", fdq.SubscriptionConfig(ack_policy="none"))
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"x") for _ in range(3)])
    c = fdq.Consumer(db, "t", subscription="n", config=SUBS_FAST)
    try:
        ms = wait_for(lambda: c.fetch(10, timeout=0.2), timeout=20, what="messages")
        with pytest.raises(fdq.FDQError, match="is not leased: ack needs at-least-once delivery"):
            c.ack_many(ms)
    finally:
        c.close()


def test_release_gives_a_message_back_without_counting_an_attempt(url, db):
    """``release()``: a fetched message never handed to a handler goes back first in line,
    its attempt not counted (a ``nak`` counts it, and dead-letters it at max_deliver)."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"a"), fdq.Envelope(b"b")])
    with fdq.Consumer(db, "t", config=fast(max_deliver=1)) as c:
        for _ in range(3):
            a, b = c.fetch(2, timeout=5)
            assert (a.body, a.attempts, b.body, b.attempts) == (b"a", 1, b"b", 1)
            c.settle([fdq.Settlement(a, fdq.Action.RELEASE), fdq.Settlement(b, fdq.Action.RELEASE)])
        a, = c.fetch(1, timeout=5)
        a.release()
        with pytest.raises(fdq.FDQError, match="already settled"):
            a.ack()
        a, b = c.fetch(2, timeout=5)
        assert (a.body, a.attempts) == (b"a", 1)
        a.ack()
        b.release()
        assert _stats(url) == (1, 0, 1)
        assert sub_stats(db, "t")["dlq"] == 0


def test_release_of_a_message_a_handler_had_is_refused(db):
    """A handler's message was an attempt: ``nak()`` it; ``release()`` would hide it from
    max_deliver."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push("t", b"x")
    errors = []

    def handler(m):
        try:
            m.release()
        except fdq.FDQError as e:
            errors.append(e)
            raise
    t = fdq.tail(db, "t", handler, config=fast(max_deliver=1))
    try:
        wait_for(lambda: errors and sub_stats(db, "t")["dlq"] == 1, 30, what="the failed handler's nak")
    finally:
        t.shutdown()
    assert "nak() it" in str(errors[0])


def test_settle_takes_settlements(db):
    """``Consumer.settle`` takes ``fdq.Settlement`` items: anything else (the tuples of
    earlier versions, a string action) is refused before anything commits."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push("t", b"x")
    with fdq.Consumer(db, "t") as c:
        m, = c.fetch(1, timeout=5)
        for bad in ([(m, "ack", None)], [fdq.Settlement(m, "ack")], [fdq.Settlement(m, fdq.Action.NAK, -1)]):
            with pytest.raises(fdq.ConfigError):
                c.settle(bad)
        assert sub_stats(db, "t")["in_flight"] == 1
        c.settle([fdq.Settlement(m, fdq.Action.ACK)])
        assert sub_stats(db, "t")["in_flight"] == 0
