"""Consumer-side guarantees found wanting in the second review: each test failed before
its fix."""
from __future__ import annotations

import threading
import time

import pytest

import fdq
from fdqtest import embedded_only, FAST, fast, sub_stats, threads_in, wait_for




@pytest.mark.parametrize("max_concurrency", [1, 2])
@pytest.mark.parametrize("touching", [False, True])
def test_a_batch_longer_than_the_ack_wait_is_not_redelivered(db, touching, max_concurrency):
    """A tail round leases a batch and commits its acks after the last handler. A batch
    whose handlers together run longer than the ack wait (each well within it, or one
    far past it calling ``in_progress()``) must not see the messages already handled
    (their acks not committed yet) nor those still waiting for the handler expire and be
    redelivered: the consumer is working on them."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(4)])
    seen, errors = [], []

    def handler(m):
        seen.append((m.body, m.attempts))
        if touching:            # 1.8 s of work on each, its lease extended as it goes
            for _ in range(3):
                time.sleep(0.6)
                m.in_progress()
        else:                   # each within the ack wait, the batch 2.4 s
            time.sleep(0.6)
    ack_wait = 1.2 if touching else 1.5
    c = fdq.tail(db, "t", handler, batch_size=4, on_error=errors.append,
                 config=fast(ack_wait_s=ack_wait, max_concurrency=max_concurrency))
    try:
        wait_for(lambda: sub_stats(db, "t")["acked"] == 4, 60, what="the four acked")
        time.sleep(ack_wait)    # a redelivery, if any, would come meanwhile
    finally:
        c.shutdown()
    assert seen == [(b"%d" % i, 1) for i in range(4)], f"redelivered while in hand: {seen}"
    assert errors == []
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["acked"]) == (0, 0, 4)


@pytest.mark.parametrize("kwargs, names", [
    (dict(acking=0), "acking"), (dict(acking="no"), "acking"), (dict(acking=1), "acking"),
    (dict(transactional="no"), "transactional"), (dict(transactional=1), "transactional"),
    (dict(transactional=True, acking=False), "acking="),
])
def test_delivery_mode_arguments_are_checked(db, kwargs, names):
    """``acking=0`` (or ``"no"``) silently meant at-least-once, ``transactional="no"``
    exactly-once: only ``acking=False`` selects at-most-once. Anything but a bool (or
    None) is a ConfigError naming the argument, in ``fdq.tail`` and ``fdq.aio.tail``,
    before any consumer joins."""
    import asyncio

    with pytest.raises(fdq.ConfigError, match=names):
        fdq.tail(db, "t", lambda *a: None, **kwargs)

    async def handler(m):
        pass

    async def start():
        await fdq.aio.tail(db, "t", handler, **kwargs)
    with pytest.raises(fdq.ConfigError, match=names):
        asyncio.run(start())
    assert "t" not in dict(fdq.Supervisor(db).topics()), "a consumer was started (it created the topic)"


@pytest.mark.parametrize("shards", [1, 2])
def test_aio_round_longer_than_the_ack_wait_is_not_redelivered(db, shards):
    """``fdq.aio.tail`` commits a round's settlements when its last handler returns. A
    round longer than the ack wait (each handler well within it) saw every message
    expire and be redelivered, round after round, until ``max_deliver`` dead-lettered
    them all though every handler succeeded."""
    import asyncio
    fdq.Supervisor(db).create_topic("t", shards=shards)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i, shard_key="k") for i in range(4)])
    seen, errors = [], []

    async def handler(m):
        seen.append((m.body, m.attempts))
        await asyncio.sleep(0.6)

    async def run():
        t = await fdq.aio.tail(db, "t", handler, batch_size=4, on_error=errors.append,
                               config=fast(ack_wait_s=1.5))
        try:
            deadline = time.monotonic() + 60
            while sub_stats(db, "t")["acked"] + sub_stats(db, "t")["dlq"] < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.5)     # a redelivery, if any, would come meanwhile
        finally:
            await t.shutdown()
    asyncio.run(run())
    assert seen == [(b"%d" % i, 1) for i in range(4)], f"redelivered while in hand: {seen}"
    assert errors == []
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["acked"], s["dlq"]) == (0, 0, 4, 0)


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


def test_a_stuck_handler_does_not_keep_its_batch_leased(db):
    """A round that runs long keeps its waiting messages leased only while it moves: a
    handler stuck past its message's ack wait (no ``in_progress()``) lets that message
    expire, and the messages waiting behind it in the batch expire with it, as they did
    before rounds were kept leased (else they stayed leased for as long as it hangs)."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(3)])
    stuck, seen = threading.Event(), []

    def handler(m):
        seen.append(m.body)
        assert stuck.wait(60)
    c = fdq.tail(db, "t", handler, batch_size=3, on_error=lambda e: None,
                 config=fast(ack_wait_s=1.0))
    try:
        wait_for(lambda: seen == [b"0"], 30, what="the first message handed over")
        wait_for(lambda: sub_stats(db, "t")["in_flight"] == 0, 30,
                 what="the stuck message and the two behind it expired")
        assert sub_stats(db, "t")["backlog"] == 3
    finally:
        stuck.set()
        c.shutdown()


@pytest.mark.parametrize("mode", ["alo", "aio"])
def test_long_round_kept_leased_across_processes_then_kill9(procs, db, mode):
    """Processes: consumer A leases a batch of 12 whose round lasts ~6 s (0.5 s a
    message) with a 2 s ack wait; consumer B joins and takes one of the two shards,
    observing A's leases there. While A is alive and working, B must not expire and
    redeliver the messages A has in hand (A keeps them leased). Then A is killed
    (SIGKILL) mid-round: B takes its shard and redelivers every message A had not
    acked, so each of the 12 is handled at least once."""
    from fdqtest import read_lines
    fdq.Supervisor(db).create_topic("t", shards=2)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m:%d" % i, shard_key=f"k{i}") for i in range(12)])
    args = ("--mode", mode, "--hb", 0.2, "--zombie", 1.5, "--ack-wait", 2)
    a = procs.start("consumer", "a", *args, "--batch", 12, "--hold-s", 0.5, wait_ready=True)
    handled = lambda p: [line.split() for line in read_lines(p.out)]  # noqa: E731 - [H, id, attempts, key, body]
    wait_for(lambda: len(handled(a)) >= 1, 60, what="A handling its batch")
    b = procs.start("consumer", "b", *args, "--batch", 12, wait_ready=True)
    wait_for(lambda: len(handled(a)) >= 9, 60, what="A handling most of its batch, over 2 ack waits")
    before_kill = handled(b)
    procs.kill9(a)
    by_a = handled(a)
    assert before_kill == [], f"B redelivered what A had in hand: {before_kill}"
    assert all(h[2] == "1" for h in by_a), f"A saw a redelivery of its own batch: {by_a}"
    wait_for(lambda: {h[4] for h in handled(a) + handled(b)} == {"m:%d" % i for i in range(12)}, 60,
             what="every message handled (A's unacked ones redelivered by B)")
    wait_for(lambda: sub_stats(db, "t")["acked"] == 12 and sub_stats(db, "t")["in_flight"] == 0, 60,
             what="all acked")
    procs.stop(b)


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


def test_aio_second_shutdown_returns_once_closed(db):
    """``await t.shutdown()`` while another task's shutdown is under way returned at
    once, before the consumer had left (its shards still held): it waits for that
    shutdown, as a sync ``shutdown()`` returns only once the consumer has left."""
    import asyncio

    async def handler(m):
        pass

    async def run():
        t = await fdq.aio.tail(db, "t", handler, config=FAST)
        assert len(sub_stats(db, "t")["consumers"]) == 1
        first = asyncio.ensure_future(t.shutdown())
        await asyncio.sleep(0)          # the first shutdown under way
        await asyncio.wait_for(t.shutdown(), 60)
        assert sub_stats(db, "t")["consumers"] == [], "the second shutdown returned before the consumer left"
        await asyncio.wait_for(first, 60)
        await t.shutdown()              # and once more, after
    asyncio.run(run())


@pytest.mark.parametrize("outside_first", [False, True])
def test_aio_shutdown_called_by_the_handler(db, outside_first):
    """``await t.shutdown()`` from inside an aio handler awaited the tail's task, which
    awaited that handler: a deadlock (and a RecursionError when the loop cancelled it).
    It returns at once; the round in hand finishes (its settlements committed, as for
    a shutdown from outside) and the tail's task closes the consumer. Also when a
    shutdown from outside is already under way."""
    import asyncio
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(5)])
    got = []

    async def run():
        gate = asyncio.Event()

        async def handler(m):
            got.append(m.body)
            if len(got) == 2:
                await gate.wait()
                await asyncio.wait_for(t.shutdown(), 30)
        t = await fdq.aio.tail(db, "t", handler, batch_size=10, config=FAST)
        outside = None
        if outside_first:
            while len(got) < 2:
                await asyncio.sleep(0.01)
            outside = asyncio.ensure_future(t.shutdown())
            await asyncio.sleep(0.05)
        gate.set()
        await asyncio.wait_for(asyncio.shield(t._task), 30)
        if outside is not None:
            await asyncio.wait_for(outside, 30)
        await asyncio.wait_for(t.shutdown(), 30)
        assert sub_stats(db, "t")["consumers"] == []
    asyncio.run(run())
    assert got == [b"%d" % i for i in range(5)]
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["acked"]) == (0, 0, 5)


def test_exactly_once_failing_head_runs_the_handler_once_per_attempt(db):
    """Exactly-once: a handler failing on a message retries it alone (the messages
    before it commit without it). One that is already first in its batch was run again
    alone before its attempt was counted: the handler ran twice per attempt (effects
    outside the transaction, an alert say, doubled). Once per attempt, ``max_deliver``
    in all; the messages behind it are handled exactly once."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"poison", shard_key="k")] +
                               [fdq.Envelope(b"ok%d" % i, shard_key="k") for i in range(4)])
    calls = []

    def handler(tr, m):
        calls.append((m.body, m.attempts))
        if m.body == b"poison":
            raise RuntimeError("cannot handle")
        tr[b"qt/ok/" + m.body] = b"1"
    c = fdq.tail(db, "t", handler, transactional=True, batch_size=10,
                 config=fast(max_deliver=3), on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 60, what="the queue emptied")
    finally:
        c.shutdown()
    # attempts is the delivery's number, 1 for the first, as in at-least-once
    assert [a for b, a in calls if b == b"poison"] == [1, 2, 3], calls
    assert sorted(b for b, _a in calls if b != b"poison") == [b"ok%d" % i for i in range(4)]
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert (dead["body"], dead["attempts"]) == (b"poison", 3)
