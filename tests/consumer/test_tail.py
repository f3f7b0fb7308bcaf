"""``fdq.tail``: delivery modes checked at the call, one key never handled twice at once.

A tail consumer is woken by new messages, not found by its sweep: with a sweep far
longer than the waits here, a message on a quiet shard arrives promptly both while the
worker goes round after round for a busy shard (its rounds check the shards whose
watches they left unarmed) and after it went idle (it armed them before waiting)."""
from __future__ import annotations

import collections
import threading
import time

import pytest

import fdq

from fdqtest import CountingDatabase, fast, sub_stats, wait_for


SLOW_SWEEP = fdq.ConsumerConfig(heartbeat_interval_s=0.2, zombie_timeout_s=1.5, poll_interval_s=60.0,
                                lease_check_interval_s=0.2)
WAIT_S = 5.0     # far below the 60 s sweep: only a watch or a round's check can deliver in time


@pytest.mark.parametrize("acking", [True, False])
def test_quiet_shard_messages_arrive_without_the_sweep(db, acking):
    fdq.Supervisor(db).create_topic("t", shards=8)
    p = fdq.Producer(db)
    got = {}
    cond = threading.Condition()

    def handler(m):
        with cond:
            got[m.body] = time.monotonic()
            cond.notify_all()

    def wait_for(body):
        with cond:
            assert cond.wait_for(lambda: body in got, WAIT_S), f"{body!r} not delivered within {WAIT_S} s"

    c = fdq.tail(db, "t", handler, acking=acking, config=SLOW_SWEEP)
    try:
        deadline = time.monotonic() + 10
        while len(c.owned_shards) < 8:        # it owns every shard (and swept them once)
            assert time.monotonic() < deadline, "consumer never owned the shards"
            time.sleep(0.02)
        for i in range(16):                       # every shard has had a lease round
            b = f"warm-{i}".encode()
            p.push("t", b, shard_key=f"q{i}")
            wait_for(b)

        stop = threading.Event()

        pushed = [0]

        def busy():                               # keeps the worker going round after round
            while not stop.is_set() and pushed[0] < 5000:
                p.push("t", f"busy-{pushed[0]}".encode(), shard_key="busy")
                pushed[0] += 1
        t = threading.Thread(target=busy)
        t.start()
        try:
            for i in range(16):
                b = f"during-{i}".encode()
                p.push("t", b, shard_key=f"q{i}")
                wait_for(b)
        finally:
            stop.set()
            t.join(30)
        wait_for(f"busy-{pushed[0] - 1}".encode())    # drained: the worker waits now
        for i in range(16):
            b = f"after-{i}".encode()
            p.push("t", b, shard_key=f"q{i}")
            wait_for(b)
    finally:
        c.shutdown()


def test_a_consumer_out_of_watches_polls_instead_of_spinning(db_url):
    """FDB's watch budget is per Database, so per process: past it a watch fails at once
    with too_many_watches (1032). The consumer must leave such a shard to its sweep, not
    set the next watch at once (a hot loop of transactions)."""
    db = fdq.connect(db_url)
    db.options.set_max_watches(2)
    fdq.Supervisor(db).create_topic("t", shards=8)
    counting = CountingDatabase(db)
    got = []
    c = fdq.tail(counting, "t", lambda m: got.append(m.body),
                 config=fdq.ConsumerConfig(heartbeat_interval_s=0.2, zombie_timeout_s=1.5, poll_interval_s=0.5,
                                           maintenance=False))     # (its passes are not rounds)
    try:
        deadline = time.monotonic() + 10
        while len(c.owned_shards) < 8:
            assert time.monotonic() < deadline, "consumer never owned the shards"
            time.sleep(0.02)
        fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i, shard_key=str(i)) for i in range(16)])
        while len(got) < 16:            # delivered: by watches where they fit, else by sweeps
            assert time.monotonic() < deadline + 10, f"{len(got)} of 16 delivered"
            time.sleep(0.02)
        before = counting.transactions
        time.sleep(2.0)     # idle: what it does with 6 shards it cannot watch
        idle = counting.transactions - before
    finally:
        c.shutdown()
    # Heartbeats (~10, ~7 transactions each: membership, config, ownership), lease checks
    # every 0.25 s and a sweep every 0.5 s (~4 rounds, each a transaction or two): ~80 here,
    # more when a retry meets a busy machine; a consumer re-arming a failing watch makes
    # thousands.
    assert idle < 250, f"{idle} transactions in 2 s idle"


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


def test_max_concurrency_never_runs_one_key_twice_at_once(db):
    fdq.Supervisor(db).create_topic("t", shards=8)
    fdq.Producer(db).push_many("t", [fdq.Envelope(f"{i}".encode(), shard_key=f"k{i % 6}") for i in range(120)])
    lock = threading.Lock()
    active = collections.Counter()
    peak = [0]
    clash = []
    handled = []

    def handler(m):
        with lock:
            active[m.shard_key] += 1
            if active[m.shard_key] > 1:
                clash.append(m.shard_key)
            peak[0] = max(peak[0], sum(active.values()))
        time.sleep(0.005)
        with lock:
            active[m.shard_key] -= 1
            handled.append(m.body)
    c = fdq.tail(db, "t", handler, batch_size=5, config=fast(max_concurrency=4))
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 60, what="all handled")
    finally:
        c.shutdown()
    assert not clash and sorted(handled) == sorted(f"{i}".encode() for i in range(120))
    assert peak[0] > 1, "handlers never ran concurrently"
