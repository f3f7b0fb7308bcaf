"""Shutdown and close: shards released at once, only the consumer's own leases
returned, unhandled messages returned without counting an attempt, no handler on a batch
leased after shutdown began, shutdown called from a handler."""
from __future__ import annotations

import threading

import pytest

import fdq
from fdq.errors import LeaseLost
from fdq.keyspace import Keyspace

from fdqtest import embedded_only, FAST, fast, fetch_until, sub_stats, threads_in, wait_for


@embedded_only     # holds the lease at its commit by the embedded engine's lock: its frames show it
def test_no_handler_runs_on_a_batch_leased_after_shutdown_began(db, db_path):
    """``shutdown()`` from another thread while the worker is committing a lease: the
    batch it leases is given back (uncounted), not handed to the handler after
    shutdown() began, when the caller may be tearing down what the handler uses.
    (The lease is held at its commit by another connection holding SQLite's write lock,
    released once the shutdown is under way.)"""
    import sqlite3
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    p.push("t", b"first")
    handling, release = [], threading.Event()

    def handler(m):
        handling.append(m.body)
        assert release.wait(30)
    c = fdq.tail(db, "t", handler, batch_size=1,
                 config=fast(ack_wait_s=600))
    wait_for(lambda: handling == [b"first"], 30, what="the first message handled")
    p.push("t", b"second")              # ready: the next round leases it
    lock = sqlite3.connect(str(db_path), isolation_level=None, timeout=30)
    stopper = None
    try:
        lock.execute("BEGIN IMMEDIATE")
        release.set()                   # the round ends; the next lease blocks at its commit
        wait_for(lambda: threads_in("_lease_many", "begin_immediate"), 30, what="the next lease held at its commit")
        stopper = threading.Thread(target=c.shutdown)
        stopper.start()
        wait_for(c._stop.is_set, 30, what="the shutdown under way")
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    if stopper is not None:
        stopper.join(60)
        assert not stopper.is_alive()
    assert handling == [b"first"], "a message was handed to the handler after shutdown() began"
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["acked"], s["consumers"]) == (1, 0, 1, []), s
    with fdq.Consumer(db, "t", create=False) as pc:
        [m] = pc.fetch(10, timeout=10)
        pc.ack_many([m])
    assert (m.body, m.attempts) == (b"second", 1)     # given back uncounted


def test_close_returns_only_its_own_leases(db):
    """A consumer that took over a shard observes the leases another live consumer still
    holds there (to expire them after their ack wait). Closing it must return only the
    leases it took itself: naking the other's would redeliver them long before their ack
    wait, while their holder is still working on them (and its ack then fails)."""
    fdq.Supervisor(db).create_topic("t", shards=2)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i, shard_key=f"k{i}") for i in range(20)])
    holder = fdq.Consumer(db, "t", consumer_id="holder", config=fast(ack_wait_s=600))
    try:
        held = []
        wait_for(lambda: held.extend(holder.fetch(100, timeout=0.2)) or len(held) == 20, 30,
                 what="the holder leasing every message")
        joiner = fdq.Consumer(db, "t", consumer_id="joiner", config=fast(ack_wait_s=600))
        try:
            [(tag, n)] = joiner.owned_shards
            there = sum(1 for m in held if m.shard == n)
            assert there > 0
            # The joiner's lease check has seen the holder's leases on its shard.
            wait_for(lambda: len(joiner._leases) == there, 30, what="the joiner observing the held leases")
        finally:
            joiner.close()
        assert sub_stats(db, "t")["in_flight"] == 20, "the joiner's close returned the holder's leases"
        try:
            holder.ack_many(held)
        except LeaseLost as e:
            raise AssertionError(f"leases returned under their holder: {e}") from None
        s = sub_stats(db, "t")
        assert (s["backlog"], s["in_flight"]) == (0, 0)
    finally:
        holder.close()


def test_shutdown_returns_unhandled_messages_without_counting_an_attempt(db):
    """``shutdown()`` mid-batch: the messages of the batch its handler never saw go back
    to the queue. They were not delivered: they must not count an attempt, else the next
    consumer gives them fewer than ``max_deliver`` handler attempts before the DLQ."""
    import threading
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(5)])
    first, started = [], threading.Event()

    def stopping(m):
        first.append(m.body)
        if len(first) == 1:     # shut down while the batch is in hand
            assert started.wait(30)
            threading.Thread(target=c1.shutdown, daemon=True).start()
            wait_for(c1._stop.is_set, 30, what="the shutdown starting")
    c1 = fdq.tail(db, "t", stopping, batch_size=10, config=fast(ack_wait_s=600))
    started.set()
    wait_for(lambda: c1._closed and not c1._member.thread.is_alive(), 60, what="the first consumer closed")
    assert first == [b"0"]
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"]) == (4, 0), "the unhandled messages were not returned at once"
    calls = {}

    def failing(m):
        calls.setdefault(m.body, []).append(m.attempts)
        raise RuntimeError("cannot handle")
    c2 = fdq.tail(db, "t", failing, config=fast(max_deliver=2, ack_wait_s=600),
                  on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(db, "t")["dlq"] == 4, 30, what="the four dead-lettered")
    finally:
        c2.shutdown()
    assert calls == {b"%d" % i: [1, 2] for i in range(1, 5)}, f"handler attempts before the DLQ: {calls}"


@pytest.mark.parametrize("max_concurrency", [1, 2])
def test_shutdown_called_by_the_handler(db, max_concurrency):
    """``shutdown()`` from inside a handler ("stop after this one"): the message in hand
    is acked (not nak'd by an error and redelivered), the rest of the batch goes back,
    and the consumer leaves at once (its shards are not held until it times out)."""
    import threading
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(5)])
    got, errors, started = [], [], threading.Event()

    def handler(m):
        got.append(m.body)
        if len(got) == 2:
            assert started.wait(30)
            c.shutdown()
    c = fdq.tail(db, "t", handler, batch_size=10, on_error=errors.append,
                 config=fast(max_concurrency=max_concurrency))
    started.set()
    wait_for(lambda: not sub_stats(db, "t")["consumers"], 30, what="the consumer leaving")
    assert errors == [] and got == [b"0", b"1"]
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["acked"]) == (3, 0, 2)
    with fdq.Consumer(db, "t", config=FAST) as again:
        rest = again.fetch(10, timeout=5)
        assert [(m.body, m.attempts) for m in rest] == [(b"2", 1), (b"3", 1), (b"4", 1)]
        again.ack_many(rest)


def test_shutdown_releases_shards_at_once(db):
    """shutdown() hands the shards to the others now, not after the zombie timeout, and
    returns what it leased unsettled."""
    from fdq.ops import membership
    fdq.Supervisor(db).create_topic("t", shards=4)
    slow = fast(zombie_timeout_s=30.0)
    a = fdq.Consumer(db, "t", consumer_id="a", config=slow)
    b = fdq.Consumer(db, "t", consumer_id="b", config=slow)
    try:
        ts = Keyspace().topic("t")
        assert {o for o, _e in membership.read_owners(db, ts, "default").values()} == {"a", "b"}
        fdq.Producer(db).push_many("t", [fdq.Envelope(f"{i}".encode(), shard_key=f"k{i}") for i in range(40)])
        leased = fetch_until(b, lambda g: g, 10)
        b.shutdown()
        assert {o for o, _e in membership.read_owners(db, ts, "default").values()} == {"a"}
        got = fetch_until(a, lambda g: len(g) >= 40, 10)    # well before the 30 s zombie timeout
        assert {m.body for m in got} == {f"{i}".encode() for i in range(40)}
        assert {m.id for m in leased} <= {m.id for m in got}
        for m in got:
            m.ack()
    finally:
        a.shutdown()
        b.shutdown()
    assert sub_stats(db, "t")["backlog"] == 0
