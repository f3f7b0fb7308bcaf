"""Exactly once: the handler runs in the dequeue transaction, once per attempt; failures,
large bodies and oversized effects go to the DLQ.

Exactly-once ``term()``: the handler dead-letters a message inside the dequeue
transaction. It lands in the DLQ with the reason and its whole body (a chunked one too),
once, with the handler's writes; the others are processed; counters add up; a redrive
brings it back intact."""
from __future__ import annotations

import os

import pytest

import fdq
from fdq.keyspace.codec import CHUNK_BYTES

from fdqtest import FAST, fast, FAST_STEADY, key_on_shard, scan, sub_stats, wait_for, with_faults


BIG = bytes(range(256)) * ((2 * CHUNK_BYTES + 1234) // 256 + 1)     # three chunks


def _sub(db):
    return fdq.Supervisor(db).stats("t")["subscriptions"]["default"]


def test_term_dead_letters_in_the_transaction(db):
    fdq.Supervisor(db).create_topic("t", shards=2)
    envs = [fdq.Envelope(b"ok%d" % i, shard_key="k") for i in range(3)]
    envs.insert(1, fdq.Envelope(b"poison", shard_key="k"))
    envs.append(fdq.Envelope(BIG, shard_key="k"))
    fdq.Producer(db).push_many("t", envs)
    seen = []

    def handler(tr, m):
        seen.append((m.body[:8], m.attempts))
        tr[b"qt/wrote/" + m.id.encode()] = b"1"
        if m.body in (b"poison", BIG):
            m.term("cannot parse")
    c = fdq.tail(db, "t", handler, transactional=True, batch_size=10, config=FAST_STEADY)
    try:
        wait_for(lambda: _sub(db)["backlog"] == 0, 30, what="the queue emptied")
    finally:
        c.shutdown()
    assert [b for b, _a in seen] == [b"ok0", b"poison", b"ok1", b"ok2", BIG[:8]], seen
    assert all(a == 1 for _b, a in seen)
    dead = {d["body"]: d for d in fdq.Supervisor(db).dlq_list("t")}
    assert set(dead) == {b"poison", BIG}
    assert all(d["reason"] == "terminated: cannot parse" and d["attempts"] == 1 for d in dead.values())
    st = fdq.Supervisor(db).stats("t")
    assert st["counters"]["acked"] == 3, st["counters"]
    assert _sub(db)["dlq"] == 2
    tr = db.create_transaction()
    wrote = [kv.key for kv in tr.snapshot.get_range(b"qt/wrote/", b"qt/wrote0")]
    tr.cancel()
    assert len(wrote) == 5      # the handler's writes commit with the dead-lettering

    # the redrive brings both back whole; this time they are handled
    fdq.Supervisor(db).dlq_redrive("t")
    got = []
    c = fdq.tail(db, "t", lambda tr, m: got.append(m.body), transactional=True, config=FAST_STEADY)
    try:
        wait_for(lambda: len(got) == 2, 30, what="the redriven messages")
    finally:
        c.shutdown()
    assert sorted(got) == sorted([b"poison", BIG])
    assert _sub(db)["dlq"] == 0 and fdq.Supervisor(db).stats("t")["counters"]["acked"] == 5


def test_term_then_raise_counts_an_attempt_instead(db):
    """A handler that calls term() and then raises: the transaction (and the term) is
    discarded; the failure counts an attempt, as any raise."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push("t", b"m")
    calls = []

    def handler(tr, m):
        calls.append(m.attempts)
        if len(calls) == 1:
            m.term("first try")
            raise RuntimeError("then failed")
    c = fdq.tail(db, "t", handler, transactional=True, config=FAST_STEADY, on_error=lambda e: None)
    try:
        wait_for(lambda: _sub(db)["backlog"] == 0, 30, what="the queue emptied")
    finally:
        c.shutdown()
    assert calls == [1, 2] and _sub(db)["dlq"] == 0


def _run_poison_batch(db, bodies, keys=None, shards=1) -> list:
    """Push ``bodies`` (on one key, else on ``keys``, one per body, of a topic of
    ``shards``) and run an exactly-once tail (batches of 10, max_deliver 3) whose handler
    fails on ``poison`` and writes ``qt/ok/<body>`` for the others, until the queue is
    empty. Returns the handler's calls: [(body, attempts)]."""
    fdq.Supervisor(db).create_topic("t", shards=shards)
    keys = keys or ["k"] * len(bodies)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b, shard_key=k) for b, k in zip(bodies, keys)])
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
    return calls


def _assert_poison_dead_and_the_rest_written(db, bodies):
    """After ``_run_poison_batch``: ``poison`` dead-lettered after its 3 attempts, and
    what the handler wrote for every other body committed."""
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert (dead["body"], dead["attempts"]) == (b"poison", 3)
    tr = db.create_transaction()
    wrote = sorted(kv.key for kv in tr.snapshot.get_range(b"qt/ok/", b"qt/ok0"))
    tr.cancel()
    assert wrote == sorted(b"qt/ok/" + b for b in bodies if b != b"poison")


def test_exactly_once_failing_head_runs_the_handler_once_per_attempt(db):
    """Exactly-once: a handler failing on a message retries it alone (the messages
    before it commit without it). One that is already first in its batch was run again
    alone before its attempt was counted: the handler ran twice per attempt (effects
    outside the transaction, an alert say, doubled). Once per attempt, ``max_deliver``
    in all; the messages behind it are handled exactly once."""
    calls = _run_poison_batch(db, [b"poison"] + [b"ok%d" % i for i in range(4)])
    # attempts is the delivery's number, 1 for the first, as in at-least-once
    assert [a for b, a in calls if b == b"poison"] == [1, 2, 3], calls
    assert sorted(b for b, _a in calls if b != b"poison") == [b"ok%d" % i for i in range(4)]
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert (dead["body"], dead["attempts"]) == (b"poison", 3)


def test_exactly_once_failed_attempts_count_once_under_commit_unknown_result(url):
    """Exactly-once: a handler failure counts one attempt on the ready record
    (``fail_in_place``). A retry after ``commit_unknown_result`` whose first attempt
    committed must not count it again: the handler sees every attempt number, and the
    message is dead-lettered after ``max_deliver`` of them, not fewer."""
    fdq.Supervisor(fdq.connect(url)).create_topic("t", shards=1)
    fdq.Producer(fdq.connect(url)).push("t", b"poison", shard_key="k")
    db = fdq.connect(with_faults(url, 0.4, 3))
    seen = []

    def handler(tr, m):
        seen.append(m.attempts)
        raise RuntimeError("cannot handle")
    c = fdq.tail(db, "t", handler, transactional=True,
                 config=fast(max_deliver=8), on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(fdq.connect(url), "t")["dlq"] == 1, 60, what="the message dead-lettered")
    finally:
        c.shutdown()
    assert sorted(set(seen)) == list(range(1, 9)), f"attempts counted twice: the handler saw {sorted(set(seen))}"
    [dead] = fdq.Supervisor(fdq.connect(url)).dlq_list("t")
    assert dead["attempts"] == 8


def test_exactly_once_poison_delayed_message_is_dead_lettered(db):
    """Exactly-once: a delayed message is promoted to the ready queue by the transaction
    that takes it. When its handler fails, that transaction is discarded, promotion
    included: the failure must still count on the message (and dead-letter it after
    ``max_deliver``), not find it "gone" and retry it forever, blocking its shard."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    p.push("t", b"poison", shard_key="k", delay=0.2)
    seen = []

    def handler(tr, m):
        seen.append(m.body)
        if m.body == b"poison":
            raise RuntimeError("cannot handle")
    c = fdq.tail(db, "t", handler, transactional=True,
                 config=fast(max_deliver=3), on_error=lambda e: None)
    try:
        wait_for(lambda: b"poison" in seen, 30, what="the delayed message delivered")
        p.push_many("t", [fdq.Envelope(b"after%d" % i, shard_key="k") for i in range(3)])
        wait_for(lambda: sub_stats(db, "t")["dlq"] == 1, 30, what="the poison message dead-lettered")
        wait_for(lambda: sum(1 for b in seen if b.startswith(b"after")) == 3, 30, what="the messages behind it")
    finally:
        c.shutdown()
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert dead["body"] == b"poison" and dead["attempts"] == 3


def test_exactly_once_failing_message_inside_a_batch_runs_once_per_attempt(db):
    """Exactly-once, a handler failing on a message that is not first in its batch: the
    messages before it commit without it, and its attempt is counted. It was rerun
    until it became the head of a batch: isolated with a batch of one, the next visit
    ran the whole batch again up to it, so a message at index i ran i + 1 times for its
    first attempt and the messages before it up to i + 1 times each (batch_size²/2
    handler runs for a failure at the end of a batch)."""
    bodies = [b"ok0", b"ok1", b"ok2", b"poison", b"ok3", b"ok4"]
    calls = _run_poison_batch(db, bodies)
    assert [a for b, a in calls if b == b"poison"] == [1, 2, 3], calls
    for b in (b"ok0", b"ok1", b"ok2"):      # run in the failed batch, then in the one that committed
        assert [x for x, _a in calls if x == b] == [b, b], calls
    for b in (b"ok3", b"ok4"):
        assert [x for x, _a in calls if x == b] == [b], calls
    _assert_poison_dead_and_the_rest_written(db, bodies)


def test_exactly_once_failing_message_on_a_later_shard_of_the_round_fails_on_its_shard(db):
    """A round takes from several shards in one transaction: a handler failing on a
    message of its second shard counts the attempt on that message, in its own shard
    (max_deliver of them, then the DLQ); every other message of both shards is handled
    and written once, those behind it included."""
    ka, kb = key_on_shard(0, 2), key_on_shard(1, 2)
    bodies = [b"a0", b"a1", b"b0", b"poison", b"b1"]
    calls = _run_poison_batch(db, bodies, keys=[ka, ka, kb, kb, kb], shards=2)
    assert [a for b, a in calls if b == b"poison"] == [1, 2, 3], calls
    assert all(1 <= sum(1 for x, _a in calls if x == b) <= 2 for b in bodies if b != b"poison"), calls
    _assert_poison_dead_and_the_rest_written(db, bodies)


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


def test_exactly_once_large_body(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    body = os.urandom(300_000)
    fdq.Producer(db).push("t", body)
    got = []
    c = fdq.tail(db, "t", lambda tr, m: got.append(m.body), transactional=True, config=FAST)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 30, what="consumed")
    finally:
        c.shutdown()
    assert got[-1] == body


def test_exactly_once_handler_errors_and_oversized_effects_go_to_dlq(db):
    """Exactly-once: a handler that always raises is dead-lettered after max_deliver; a
    handler whose writes cannot fit in one transaction (2101) is dead-lettered with that
    reason instead of retrying forever; the other messages are processed exactly once."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    p.push("t", b"raises", shard_key="k")
    p.push("t", b"too-big", shard_key="k")
    for i in range(5):
        p.push("t", f"ok{i}".encode(), shard_key="k")

    def handler(tr, m):
        if m.body == b"raises":
            raise ValueError("bad message")
        if m.body == b"too-big":
            for i in range(110):                 # ~11 MB of writes: over the 10 MB limit
                tr[b"qt/big/%d" % i] = b"x" * 99_000
            return
        tr.add(b"qt/ok/" + m.body, (1).to_bytes(8, "little"))
    c = fdq.tail(db, "t", handler, transactional=True, batch_size=10,
                 config=fast(max_deliver=2), on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 60, what="the queue emptied")
    finally:
        c.shutdown()
    dead = {d["body"]: d["reason"] for d in fdq.Supervisor(db).dlq_list("t")}
    assert set(dead) == {b"raises", b"too-big"}
    assert "ValueError" in dead[b"raises"]
    assert "transaction_too_large" in dead[b"too-big"]
    ok = {k: int.from_bytes(bytes(v)[:8], "little") for k, v in scan(db, b"qt/ok/")}
    assert ok == {b"qt/ok/ok%d" % i: 1 for i in range(5)}
    assert scan(db, b"qt/big/") == []
