"""Consumer-side guarantees found wanting in review: each test failed before its fix."""
from __future__ import annotations

import pytest

import fdq
from fdq.errors import LeaseLost

from fdqtest import FAST, fast, read, sub_stats, wait_for, with_faults



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
    wait_for(lambda: c1._closed and not c1._thread.is_alive(), 60, what="the first consumer closed")
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


def test_touch_during_a_database_stall_restarts_the_full_ack_wait(db, db_path):
    """The shard owner times a lease from when it first sees its current state. A
    lease check that started before a database stall (its heartbeat waiting on the
    write lock) and then read a touch committed after the stall must time the touch from
    when it read it, not from when the check started: else the lease expires early by
    the length of the stall, while its holder is working on it."""
    import sqlite3
    import threading
    import time
    fdq.Supervisor(db).create_topic("t", shards=2)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i, shard_key=f"k{i}") for i in range(20)])
    cfg = fast(heartbeat_interval_s=0.2, lease_check_interval_s=0.2, ack_wait_s=3.0)
    holder = fdq.Consumer(db, "t", consumer_id="holder", config=cfg)
    owner = None
    try:
        held = []
        wait_for(lambda: held.extend(holder.fetch(100, timeout=0.2)) or len(held) == 20, 30,
                 what="the holder leasing every message")
        owner = fdq.Consumer(db, "t", consumer_id="owner", config=cfg)
        [(_tag, n)] = owner.owned_shards
        m = next(m for m in held if m.shard == n)
        key = (("", n), m._taken.vs.to_bytes())
        wait_for(lambda: key in owner._leases, 30, what="the owner observing the lease")
        stall = sqlite3.connect(str(db_path), timeout=30)
        stall.execute("BEGIN IMMEDIATE")        # the database stalls: no commit for 2 s
        try:
            toucher = threading.Thread(target=m.in_progress)
            time.sleep(0.3)
            toucher.start()                     # the holder extends the lease: waits too
            time.sleep(1.7)
        finally:
            stall.rollback()
            stall.close()
        toucher.join(30)
        touched = time.monotonic()
        assert not toucher.is_alive()
        leased = lambda: m._taken.lease_key is not None and read(db, m._taken.lease_key, snapshot=False) is not None  # noqa: E731
        while time.monotonic() < touched + 2.0:     # 1 s short of the ack wait the touch restarted
            assert leased(), f"lease expired {time.monotonic() - touched:.2f}s after its touch (ack wait 3s)"
            time.sleep(0.05)
        m.ack()     # its siblings, untouched, expired meanwhile: they were due
    finally:
        if owner is not None:
            owner.close()
        holder.close()


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
