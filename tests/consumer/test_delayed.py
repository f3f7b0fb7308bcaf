"""Delayed messages: ready ones are not blocked, nak delays are respected.

Promotion of due delayed messages: the shard's ``delayed`` counter stays exact when
only some are due, and a take that promoted messages is recognised after
``commit_unknown_result`` only if it really committed (both found in review)."""
from __future__ import annotations

import time

import fdq
from fdq.keyspace import Keyspace

from fdqtest import FAST, fetch_until, scan, sub_stats


def test_delayed_counter_exact_when_only_some_are_due(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    p.push("t", b"soon", delay=0.2)
    p.push("t", b"later", delay=600)
    with fdq.Consumer(db, "t", config=FAST) as c:
        got = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            got = c.fetch(10, timeout=0.2)
        assert [m.body for m in got] == [b"soon"]
        c.ack_many(got)
        assert sub_stats(db, "t")["delayed"] == 1       # only "later" is delayed


def test_an_uncommitted_take_of_promoted_messages_is_not_taken_as_committed(db):
    """After commit_unknown_result an at-most-once consumer asks whether its attempt
    committed. The first check (the taken ready keys gone) took an attempt that promoted
    messages from the delayed area and did not commit for one that did (those never had
    a ready key): handed over while still delayed, delivered again (found in review). The
    attempt's marker (``mark_take``, written by the take) answers it: absent, not ours."""
    import os
    from fdq.ops import queue
    from fdq.keyspace import Keyspace
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push("t", b"due", delay=0.05)
    ts = Keyspace().topic("t")
    shard = ts.shard("default", "", 0)
    with fdq.Consumer(db, "t", config=FAST) as c:   # owns the shard
        deadline = time.monotonic() + 20
        while True:
            epoch = c._owned.get(("", 0))
            tr = db.create_transaction()
            taken = queue.take_batch(tr, ts, shard, c.id, epoch, 10, max_deliver=5) if epoch is not None else []
            if taken or time.monotonic() > deadline:
                break
            tr.cancel()
            time.sleep(0.05)
        assert [t.body for t in taken] == [b"due"] and taken[0].delayed_key is not None
        attempt = os.urandom(12)
        queue.mark_take(tr, ts, "default", c.id, attempt)
        tr.cancel()                                   # this attempt never commits
        assert not queue.take_committed(db, ts, "default", c.id, attempt)
        got = []
        while not got and time.monotonic() < deadline:  # still there: delivered once
            got = c.fetch(10, timeout=0.2)
        assert [m.body for m in got] == [b"due"]


def test_delayed_message_does_not_block_ready_ones(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    t0 = time.monotonic()
    p.push("t", b"later", shard_key="k", delay=3.0)
    for i in range(5):
        p.push("t", f"now{i}".encode(), shard_key="k")
    with fdq.Consumer(db, "t", config=FAST) as c:
        first = fetch_until(c, lambda g: len(g) >= 5, 10)
        assert [m.body for m in first] == [f"now{i}".encode() for i in range(5)]
        assert time.monotonic() - t0 < 3.0, "ready messages waited for the delayed one"
        for m in first:
            m.ack()
        later = fetch_until(c, lambda g: g, 30)
        assert [m.body for m in later] == [b"later"]
        assert time.monotonic() - t0 >= 2.9, "delivered before its delay"
        later[0].ack()
    # It keeps its place in the "all" log: first.
    log = scan(db, Keyspace().topic("t").log.key())
    assert b"later" in bytes(log[0][1]) and len(log) == 6


def test_nak_delay_is_respected(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push("t", b"x")
    with fdq.Consumer(db, "t", config=FAST) as c:
        [m] = fetch_until(c, lambda g: g, 10)
        t0 = time.monotonic()
        m.nak(delay=1.2)
        [m2] = fetch_until(c, lambda g: g, 30)
        assert time.monotonic() - t0 >= 1.1 and m2.attempts == 2 and m2.id == m.id
        m2.ack()


def _clock(db, topic="t"):
    from fdq.ops.clock import read_clock
    return read_clock(db.create_transaction(), Keyspace().topic(topic).clock_key)


def test_a_delay_counted_while_the_clock_lags_never_ends_early(db):
    """Delays are due by the topic's clock, which its consumers advance every lease
    check: between two advances it lags real time. A due time counted from the lagging
    reading ended early by that lag (pushed 1.5 s after an advance with a 1 s delay,
    due at the next advance, 0.5 s later); it is counted from the clock plus the
    versions since its last advance."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    slow = fdq.ConsumerConfig(lease_check_interval_s=2.0, poll_interval_s=0.05)
    with fdq.Consumer(db, "t", config=slow) as c:
        before = _clock(db)
        deadline = time.monotonic() + 30
        while _clock(db) == before:          # an advance: the clock is exact now, then lags
            assert time.monotonic() < deadline, "the consumer never advanced the clock"
            time.sleep(0.01)
        advanced = time.monotonic()
        while time.monotonic() < advanced + 1.5:     # let it lag 1.5 s (of a 2 s interval)
            time.sleep(0.05)
        pushed = time.monotonic()
        fdq.Producer(db).push("t", b"x", delay=1.0)
        [m] = fetch_until(c, lambda g: g, 30)
        assert time.monotonic() - pushed >= 1.0, time.monotonic() - pushed
        m.ack()
