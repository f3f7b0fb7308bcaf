"""``max_concurrency`` with tag dispatch: a shard key's tagged and untagged messages are
queued on shards of one number in different tags; one consumer owning both (nobody
wants the tag, so it falls back to the untagged consumers) must never run two handlers
of that key at once, in ``fdq.tail`` and in ``fdq.aio.tail``."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

import fdq
import fdq.aio
from fdq.headers import DISPATCH_TAG

from fdqtest import fast, FAST_STEADY, wait_for

KEYS = [f"k{i}" for i in range(4)]
PER_KEY_AND_TAG = 6


class Overlap:
    """Handlers running per key; the most seen at once for any key."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = {}
        self.most = 0
        self.seen = []
        self.max_running = 0

    def enter(self, m):
        with self.lock:
            n = self.running.get(m.shard_key, 0) + 1
            self.running[m.shard_key] = n
            self.most = max(self.most, n)
            self.max_running = max(self.max_running, sum(self.running.values()))

    def leave(self, m):
        with self.lock:
            self.running[m.shard_key] -= 1
            self.seen.append((m.shard_key, m.tag, m.body))


def _push_backlog(db):
    """Each key's tagged ("gpu") and untagged messages, pushed interleaved."""
    fdq.Supervisor(db).create_topic("t", shards=4, extend=True)
    envs = []
    for i in range(PER_KEY_AND_TAG):
        for k in KEYS:
            envs.append(fdq.Envelope(b"%s-u%d" % (k.encode(), i), shard_key=k))
            envs.append(fdq.Envelope(b"%s-g%d" % (k.encode(), i), shard_key=k, headers={DISPATCH_TAG: "gpu"}))
    fdq.Producer(db).push_many("t", envs)
    return len(envs)


def _per_tag_order_kept(seen):
    for k in KEYS:
        for tag, letter in (("", b"u"), ("gpu", b"g")):
            bodies = [b for key, t, b in seen if key == k and (t or "") == tag]
            assert bodies == [b"%s-%s%d" % (k.encode(), letter, i) for i in range(PER_KEY_AND_TAG)]


@pytest.mark.parametrize("mode", ["at_least_once", "at_most_once"])
def test_tail_never_runs_one_key_twice_across_tags(db, mode):
    total = _push_backlog(db)
    ov = Overlap()

    def handler(m):
        ov.enter(m)
        time.sleep(0.01)        # long enough for the pool's other threads to start theirs
        ov.leave(m)
    c = fdq.tail(db, "t", handler, acking=(mode == "at_least_once"), extend_support=True, batch_size=3,
                 config=fast(FAST_STEADY, max_concurrency=8))
    try:
        wait_for(lambda: len(ov.seen) >= total, 60, f"{total} deliveries")
    finally:
        c.shutdown()
    assert len(ov.seen) == total
    assert ov.max_running > 1, "handlers never ran concurrently: the test shows nothing"
    assert ov.most == 1, f"{ov.most} handlers of one shard key ran at once"
    _per_tag_order_kept(ov.seen)


def test_aio_tail_never_runs_one_key_twice_across_tags(db):
    total = _push_backlog(db)
    ov = Overlap()

    async def main():
        async def handler(m):
            ov.enter(m)
            await asyncio.sleep(0.01)
            ov.leave(m)
        t = await fdq.aio.tail(db, "t", handler, extend_support=True,
                               config=fast(FAST_STEADY, max_concurrency=8))
        try:
            deadline = time.monotonic() + 60
            while len(ov.seen) < total and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        finally:
            await t.shutdown()
    asyncio.run(main())
    assert len(ov.seen) == total
    assert ov.max_running > 1, "handlers never ran concurrently: the test shows nothing"
    assert ov.most == 1, f"{ov.most} handlers of one shard key ran at once"
    _per_tag_order_kept(ov.seen)
