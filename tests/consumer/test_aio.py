"""fdq.aio: coroutine handlers on an event loop (the kill -9 run is in test_kill9.py)."""
from __future__ import annotations

import asyncio
import collections
import time

import pytest

import fdq
import fdq.aio

from fdqtest import embedded_only, FAST, fast, sub_stats, threads_in


POOL = fast(max_concurrency=4)


async def _until(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def test_at_least_once_order_concurrency_and_settlements(db):
    fdq.Supervisor(db).create_topic("t", shards=8)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(f"{k}:{i}".encode(), shard_key=f"k{k}") for i in range(40) for k in range(10)])
    p.push("t", b"fail-once", shard_key="x")
    p.push("t", b"poison", shard_key="x")
    p.push("t", b"retry-later", shard_key="y")
    seen = collections.defaultdict(list)
    attempts = collections.Counter()
    running = {"now": 0, "max": 0}

    async def handler(m):
        attempts[m.body] += 1
        running["now"] += 1
        running["max"] = max(running["max"], running["now"])
        try:
            await asyncio.sleep(0.001)             # other shards' handlers run meanwhile
            if m.body == b"fail-once" and m.attempts == 1:
                raise RuntimeError("transient")    # raise = nak: redelivered
            if m.body == b"poison":
                m.term("cannot parse")             # explicit: dead-lettered with the round
                return
            if m.body == b"retry-later" and m.attempts == 1:
                m.nak(delay=0.3)
                return
            k, i = m.body.decode().split(":") if b":" in m.body else (m.body.decode(), "0")
            seen[k].append(int(i))
        finally:
            running["now"] -= 1

    errors = []

    async def main():
        t = await fdq.aio.tail(db, "t", handler, config=POOL, batch_size=50, on_error=errors.append)
        assert t.is_acking and t.batch_size == 50
        try:
            await _until(lambda: sub_stats(db, "t")["backlog"] == 0 and attempts[b"retry-later"] == 2
                         and attempts[b"fail-once"] == 2, 60, "every message settled")
        finally:
            await t.shutdown()

    asyncio.run(main())
    assert {k: v for k, v in seen.items() if k.isdigit()} == {str(k): list(range(40)) for k in range(10)}
    assert attempts[b"poison"] == 1 and attempts[b"fail-once"] == 2 and attempts[b"retry-later"] == 2
    assert 1 < running["max"] <= POOL.max_concurrency
    assert [type(e).__name__ for e in errors] == ["RuntimeError"]
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert dead["body"] == b"poison" and dead["reason"] == "terminated: cannot parse"
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["dlq"]) == (0, 0, 1)
    assert s["consumers"] == []                    # shutdown left the subscription


def test_at_most_once_acks_before_handling(db):
    fdq.Supervisor(db).create_topic("t", shards=2)
    fdq.Producer(db).push_many("t", [fdq.Envelope(str(i).encode()) for i in range(20)])
    handled = []

    async def handler(m):
        handled.append(m.body)
        assert sub_stats(db, "t")["in_flight"] == 0   # already gone from the queue
        raise RuntimeError("not redelivered at most once")

    async def main():
        async with await fdq.aio.tail(db, "t", handler, acking=False, config=POOL,
                                      on_error=lambda e: None) as t:
            assert not t.is_acking
            await _until(lambda: len(handled) == 20, 30, "20 messages handled")
            await asyncio.sleep(0.3)                # a redelivery would show up here

    asyncio.run(main())
    assert sorted(handled, key=int) == [str(i).encode() for i in range(20)]
    assert sub_stats(db, "t")["backlog"] == 0


def test_in_progress_keeps_a_lease_and_push_awaits_its_commit(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    config = fdq.ConsumerConfig(heartbeat_interval_s=0.2, zombie_timeout_s=1.5, poll_interval_s=0.05,
                                lease_check_interval_s=0.05, ack_wait_s=1.0)
    calls = []

    async def main():
        p = fdq.Producer(db)
        rs = await asyncio.gather(*(fdq.aio.push(p, "t", f"m{i}".encode(), shard_key="k") for i in range(5)))
        assert len({r.id for r in rs}) == 5
        holder = {}

        async def handler(m):
            calls.append((m.body, m.attempts))
            if m.body == b"m0":
                for _ in range(12):                 # 3 × ack_wait, kept alive
                    await holder["t"].in_progress(m)
                    await asyncio.sleep(0.25)

        # batch_size 1: the rest of a batch waits behind m0 with its own leases running
        holder["t"] = t = await fdq.aio.tail(db, "t", handler, config=config, batch_size=1)
        try:
            await _until(lambda: sub_stats(db, "t")["backlog"] == 0, 30, "all acked")
        finally:
            await t.shutdown()

    asyncio.run(main())
    assert calls == [(f"m{i}".encode(), 1) for i in range(5)]   # in order, none redelivered


def test_bad_arguments(db):
    def plain(m):
        pass

    async def coro(tr, m):
        pass

    async def main():
        with pytest.raises(fdq.ConfigError, match="coroutine function"):
            await fdq.aio.tail(db, "t", plain)
        with pytest.raises(fdq.ConfigError, match="no exactly-once mode"):
            await fdq.aio.tail(db, "t", coro, transactional=True)
        with pytest.raises(fdq.InvalidName):
            await fdq.aio.tail(db, "bad name", coro)

    asyncio.run(main())


# -- shutdown while a fetch is under way in a worker thread ----------------------------

# Long heartbeats and lease checks: the consumer's own thread writes nothing while a
# test holds the database's write lock (its first heartbeat is 30 s after it starts).
QUIET = fdq.ConsumerConfig(heartbeat_interval_s=60, lease_check_interval_s=60, ack_wait_s=60,
                           poll_interval_s=0.2)


def test_shutdown_ends_a_waiting_fetch_at_once(db):
    """A fetch waiting for messages (up to ``poll_interval_s``, here 30 s) ends when
    shutdown begins: shutdown does not wait out the poll."""
    fdq.Supervisor(db).create_topic("t", shards=2)

    async def handler(m):
        raise AssertionError("no message was pushed")

    async def main():
        config = fdq.ConsumerConfig(heartbeat_interval_s=0.2, poll_interval_s=30)
        t = await fdq.aio.tail(db, "t", handler, config=config)
        await _until(lambda: threads_in("_fetch_tracked", "_idle"), 30, "the tail's fetch waiting in its worker thread")
        began = time.monotonic()
        await asyncio.wait_for(t.shutdown(), 60)
        return time.monotonic() - began

    took = asyncio.run(main())
    assert took < 5, f"shutdown took {took:.1f} s: it waited out the fetch's poll"
    assert sub_stats(db, "t")["consumers"] == []


@embedded_only     # holds a fetch at its commit by the embedded engine's lock: its frames show it
def test_shutdown_after_a_cancel_returns_the_leases_of_the_fetch_under_way(db, db_path):
    """The tail's task is cancelled (its loop ending, a timeout) while its fetch is
    committing a lease in a worker thread; shutdown's close then runs while that fetch
    is still under way. The lease it commits is returned at once, not left to its
    60 s ack wait. (The fetch is held at its commit by another connection holding
    SQLite's write lock, released once close is under way.)"""
    import contextlib
    import sqlite3
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    p.push("t", b"first")
    handling = []

    async def main():
        release = asyncio.Event()

        async def handler(m):
            handling.append(m.body)
            await release.wait()        # at most once: acked already, nothing to settle

        t = await fdq.aio.tail(db, "t", handler, acking=False, config=QUIET, batch_size=1)
        await _until(lambda: handling == [b"first"], 30, "the first message handled")
        p.push("t", b"second")          # ready: the next fetch leases it
        lock = sqlite3.connect(str(db_path), isolation_level=None, timeout=30)
        try:
            lock.execute("BEGIN IMMEDIATE")
            release.set()               # the round ends; the next fetch blocks at its commit
            await _until(lambda: threads_in("_fetch_tracked", "begin_immediate"), 30,
                         "the next fetch held at its commit")
            t._task.cancel()            # the loop gives up on that fetch; its thread goes on
            shutdown = asyncio.ensure_future(t.shutdown())
            await _until(lambda: threads_in("close", ("begin_immediate", "_await_fetches")), 30,
                         "close under way while the fetch is")
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(shutdown, 60)

    asyncio.run(main())
    assert handling == [b"first"]
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["consumers"]) == (1, 0, []), s
    with fdq.Consumer(db, "t", create=False) as c:
        [m] = c.fetch(10, timeout=10)
        c.ack_many([m])
    # leased by the cancelled fetch, never handed to a handler: given back uncounted
    assert (m.body, m.attempts) == (b"second", 1)


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
    It returns at once; the round in hand finishes (its settlements committed, the
    messages no handler began given back uncounted, as for a shutdown from outside) and
    the tail's task closes the consumer. Also when a shutdown from outside is already
    under way."""
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
    assert got == [b"0", b"1"]
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["acked"]) == (3, 0, 2)
    with fdq.Consumer(db, "t", config=FAST) as c:
        assert [m.attempts for m in c.fetch(10, timeout=5)] == [1, 1, 1]


AIO_FAST = fast(ack_wait_s=30)


async def _aio_until(cond, timeout, what):
    import asyncio
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.02)


def test_aio_a_handler_raising_cancelled_error_is_a_failed_handler(db):
    """A handler that raised asyncio.CancelledError of its own (it awaited a task that
    someone else cancelled) ended the whole consuming task: the tail stopped, silently,
    still a live member owning its shards."""
    import asyncio

    import fdq.aio
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    for i in range(3):
        p.push("t", f"m{i}".encode(), shard_key="k")
    seen = []

    async def main():
        async def handler(m):
            seen.append((m.body, m.attempts))
            if m.body == b"m1" and m.attempts == 1:
                other = asyncio.get_running_loop().create_future()
                other.cancel()
                await other                 # raises CancelledError into the handler
        t = await fdq.aio.tail(db, "t", handler, config=AIO_FAST, batch_size=1)
        try:
            await _aio_until(lambda: sub_stats(db, "t", "default")["backlog"] == 0, 5, "all acked")
            assert not t._task.done()
        finally:
            await asyncio.wait_for(t.shutdown(), 20)
    asyncio.run(main())
    assert (b"m1", 2) in seen and [b for b, _a in seen].count(b"m1") == 2


def test_aio_tail_of_an_ack_policy_none_subscription_loses_nothing(db):
    """``fdq.aio.tail`` on a subscription with ``ack_policy='none'`` (its messages are
    taken, not leased): at-least-once acked each handled message, which is not leased,
    so the ack and then the nak raised, ending the shard's run: the rest of the batch,
    already taken, was never handled (4 of 5 lost); at-most-once acked the taken batch
    before any handler ran, raised, and lost all of it. As ``fdq.tail``: acking=True is
    refused, otherwise it is at-most-once and every message reaches the handler."""
    import asyncio

    import fdq.aio
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    sup.create_subscription("t", "s", fdq.SubscriptionConfig(ack_policy="none"))
    got, errors = [], []

    async def handler(m):
        got.append(m.body)

    async def run(acking, n):
        fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i, shard_key="k") for i in range(n)])
        t = await fdq.aio.tail(db, "t", handler, acking=acking, subscription="s", on_error=errors.append,
                               config=FAST)
        try:
            deadline = asyncio.get_running_loop().time() + 30
            while len(got) < n and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        finally:
            await t.shutdown()
    for acking in (None, False):
        got.clear()
        asyncio.run(run(acking, 5))
        assert sorted(got) == [b"%d" % i for i in range(5)], (acking, got, errors)
        assert errors == []

    async def refused():
        await fdq.aio.tail(db, "t", handler, acking=True, subscription="s")
    with pytest.raises(fdq.ConfigError, match="ack_policy"):
        asyncio.run(refused())
    assert sup.stats("t")["subscriptions"]["s"]["consumers"] == []
