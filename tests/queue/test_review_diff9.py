"""Found in the review of the session's diff (rv-diff9): each test failed before its fix."""
from __future__ import annotations

import pytest

import fdq

from fdqtest import FAST, fast, sub_stats, wait_for



def test_exactly_once_failing_message_inside_a_batch_runs_once_per_attempt(db):
    """Exactly-once, a handler failing on a message that is not first in its batch: the
    messages before it commit without it, and its attempt is counted. It was rerun
    until it became the head of a batch: isolated with a batch of one, the next visit
    ran the whole batch again up to it, so a message at index i ran i + 1 times for its
    first attempt and the messages before it up to i + 1 times each (batch_size²/2
    handler runs for a failure at the end of a batch)."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    bodies = [b"ok0", b"ok1", b"ok2", b"poison", b"ok3", b"ok4"]
    fdq.Producer(db).push_many("t", [fdq.Envelope(b, shard_key="k") for b in bodies])
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
    assert [a for b, a in calls if b == b"poison"] == [1, 2, 3], calls
    for b in (b"ok0", b"ok1", b"ok2"):      # run in the failed batch, then in the one that committed
        assert [x for x, _a in calls if x == b] == [b, b], calls
    for b in (b"ok3", b"ok4"):
        assert [x for x, _a in calls if x == b] == [b], calls
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert (dead["body"], dead["attempts"]) == (b"poison", 3)
    tr = db.create_transaction()
    wrote = sorted(kv.key for kv in tr.snapshot.get_range(b"qt/ok/", b"qt/ok0"))
    tr.cancel()
    assert wrote == sorted(b"qt/ok/" + b for b in bodies if b != b"poison")


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


def test_exactly_once_term_after_the_handler_returned_raises(db):
    """Exactly-once ``msg.term()`` dead-letters the message in its handler's
    transaction. Called after that handler returned (the message kept for later, or
    termed while handling the next one), it did nothing and said nothing: the caller
    believed it dead-lettered, but it had been processed (done) with its transaction.
    It raises, as ``term()`` of a message no longer leased does."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"a", shard_key="k"), fdq.Envelope(b"b", shard_key="k")])
    kept, errors = [], []

    def handler(tr, m):
        if kept:
            try:
                kept[0].term("too late, in the next handler")
            except fdq.FDQError as e:
                errors.append(e)
        kept.append(m)
    c = fdq.tail(db, "t", handler, transactional=True, batch_size=1, config=FAST)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0 and len(kept) == 2, 30, what="both handled")
    finally:
        c.shutdown()
    assert len(errors) == 1
    with pytest.raises(fdq.FDQError):
        kept[1].term("too late, after the consumer stopped")
    assert fdq.Supervisor(db).dlq_list("t") == []
    assert sub_stats(db, "t")["acked"] == 2


def test_a_long_round_stays_leased_when_the_ack_wait_is_raised_meanwhile(db):
    """A round running past half its ack wait is kept leased (``_Round.keep``). Its
    leases were taken with the ack wait of the round's start; a subscription update
    raising ``ack_wait_s`` (applied by the consumer at its next heartbeat) made the
    round wait for half the new ack wait before touching them: the messages still
    waiting expired and were redelivered while in hand."""
    import time
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(4)])
    seen, errors, first, tail = [], [], [], {}

    def handler(m):
        seen.append((m.body, m.attempts))
        if not first:
            first.append(1)
            sup.update_subscription("t", "default", ack_wait_s=60)
            wait_for(lambda: "c" in tail and tail["c"].config.ack_wait_s == 60, 30,
                     what="the consumer to apply the new ack wait")
            m.in_progress()     # its own lease: what it waited for may have taken long under load
        time.sleep(0.6)
    c = tail["c"] = fdq.tail(db, "t", handler, batch_size=4, on_error=errors.append,
                             config=fast(ack_wait_s=1.5))
    try:
        wait_for(lambda: sub_stats(db, "t")["acked"] == 4, 60, what="the four acked")
    finally:
        c.shutdown()
    assert seen == [(b"%d" % i, 1) for i in range(4)], f"redelivered while in hand: {seen} {errors}"
    assert errors == []
