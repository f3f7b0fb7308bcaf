"""Consumer-side guarantees found wanting in the second review: each test failed before
its fix."""
from __future__ import annotations

import threading
import time

import pytest

import fdq

from qhelpers import sub_stats, wait_for

FAST = dict(heartbeat_interval_s=0.2, zombie_timeout_s=1.5, poll_interval_s=0.05, lease_check_interval_s=0.05)


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
                 config=fdq.ConsumerConfig(ack_wait_s=ack_wait, max_concurrency=max_concurrency, **FAST))
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
                               config=fdq.ConsumerConfig(ack_wait_s=1.5, **FAST))
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
