"""Consumer-side guarantees found wanting in review: each test failed before its fix."""
from __future__ import annotations

import fdq
from fdq.errors import LeaseLost

from qhelpers import sub_stats, wait_for

FAST = dict(heartbeat_interval_s=0.2, zombie_timeout_s=1.5, poll_interval_s=0.05, lease_check_interval_s=0.05)


def test_close_returns_only_its_own_leases(db):
    """A consumer that took over a shard observes the leases another live consumer still
    holds there (to expire them after their ack wait). Closing it must return only the
    leases it took itself: naking the other's would redeliver them long before their ack
    wait, while their holder is still working on them (and its ack then fails)."""
    fdq.Supervisor(db).create_topic("t", shards=2)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i, shard_key=f"k{i}") for i in range(20)])
    holder = fdq.Consumer(db, "t", consumer_id="holder", config=fdq.ConsumerConfig(ack_wait_s=600, **FAST))
    try:
        held = []
        wait_for(lambda: held.extend(holder.fetch(100, timeout=0.2)) or len(held) == 20, 30,
                 what="the holder leasing every message")
        joiner = fdq.Consumer(db, "t", consumer_id="joiner", config=fdq.ConsumerConfig(ack_wait_s=600, **FAST))
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


def test_exactly_once_failed_attempts_count_once_under_commit_unknown_result(url):
    """Exactly-once: a handler failure counts one attempt on the ready record
    (``fail_in_place``). A retry after ``commit_unknown_result`` whose first attempt
    committed must not count it again: the handler sees every attempt number, and the
    message is dead-lettered after ``max_deliver`` of them, not fewer."""
    fdq.Supervisor(fdq.connect(url)).create_topic("t", shards=1)
    fdq.Producer(fdq.connect(url)).push("t", b"poison", shard_key="k")
    db = fdq.connect(url + "?fault_injection=0.4&seed=3")
    seen = []

    def handler(tr, m):
        seen.append(m.attempts)
        raise RuntimeError("cannot handle")
    c = fdq.tail(db, "t", handler, transactional=True,
                 config=fdq.ConsumerConfig(max_deliver=8, **FAST), on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(fdq.connect(url), "t")["dlq"] == 1, 60, what="the message dead-lettered")
    finally:
        c.shutdown()
    assert sorted(set(seen)) == list(range(8)), f"attempts counted twice: the handler saw {sorted(set(seen))}"
    [dead] = fdq.Supervisor(fdq.connect(url)).dlq_list("t")
    assert dead["attempts"] == 8


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
    c1 = fdq.tail(db, "t", stopping, batch_size=10, config=fdq.ConsumerConfig(ack_wait_s=600, **FAST))
    started.set()
    wait_for(lambda: c1._closed and not c1._thread.is_alive(), 60, what="the first consumer closed")
    assert first == [b"0"]
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"]) == (4, 0), "the unhandled messages were not returned at once"
    calls = {}

    def failing(m):
        calls.setdefault(m.body, []).append(m.attempts)
        raise RuntimeError("cannot handle")
    c2 = fdq.tail(db, "t", failing, config=fdq.ConsumerConfig(max_deliver=2, ack_wait_s=600, **FAST),
                  on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(db, "t")["dlq"] == 4, 30, what="the four dead-lettered")
    finally:
        c2.shutdown()
    assert calls == {b"%d" % i: [1, 2] for i in range(1, 5)}, f"handler attempts before the DLQ: {calls}"


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
                 config=fdq.ConsumerConfig(max_deliver=3, **FAST), on_error=lambda e: None)
    try:
        wait_for(lambda: b"poison" in seen, 30, what="the delayed message delivered")
        p.push_many("t", [fdq.Envelope(b"after%d" % i, shard_key="k") for i in range(3)])
        wait_for(lambda: sub_stats(db, "t")["dlq"] == 1, 30, what="the poison message dead-lettered")
        wait_for(lambda: sum(1 for b in seen if b.startswith(b"after")) == 3, 30, what="the messages behind it")
    finally:
        c.shutdown()
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert dead["body"] == b"poison" and dead["attempts"] == 3
