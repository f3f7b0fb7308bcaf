"""``max_deliver`` bounds deliveries whatever gives a message back: a pull consumer that
closes without settling naks what it fetched (an attempt), a tail gives back what no
handler got (no attempt), and a message delivered ``max_deliver`` times already is
dead-lettered by the next lease, never delivered again."""
from __future__ import annotations

import threading

import fdq
from fdq.ops import queue
from fdq import tailing

from fdqtest import FAST, fast, fetch_until, sub_stats, wait_for


def test_fetch_and_close_unsettled_counts_attempts_and_dead_letters_at_max_deliver(db):
    """Fetched and never settled, seven times over: attempts 1 to 5, then the message is
    in the DLQ (the last attempt named) and the next fetches get nothing (before: attempts
    1 to 7, the DLQ empty: a close's hand-back counted without a bound)."""
    fdq.Producer(db).push("t", b"m")
    seen = []
    for _ in range(7):
        with fdq.Consumer(db, "t", config=fast(max_deliver=5)) as c:
            seen += [m.attempts for m in c.fetch(1, timeout=0.5 if len(seen) >= 5 else 10)]
    assert seen == [1, 2, 3, 4, 5]
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert dead["attempts"] == 5
    assert dead["reason"] == "max_deliver (5) reached: last attempt not settled (consumer closed)"
    s = sub_stats(db, "t")
    assert s["backlog"] == 0 and s["in_flight"] == 0 and s["dlq"] == 1


def test_a_message_past_max_deliver_is_dead_lettered_by_the_lease_never_delivered(db):
    """A message nak'd three times under max_deliver=10, then leased by a consumer with
    max_deliver=3: dead-lettered in that lease transaction, with the delivery it would
    have been; the consumer gets the next message (before: delivered as attempt 4)."""
    p = fdq.Producer(db)
    p.push("t", b"tired", shard_key="k")
    with fdq.Consumer(db, "t", config=fast(max_deliver=10)) as c:
        for _ in range(3):
            [m] = fetch_until(c, lambda g: len(g) >= 1, 30)
            m.nak(0)
    p.push("t", b"fresh", shard_key="k")
    with fdq.Consumer(db, "t", config=fast(max_deliver=3)) as c:
        got = fetch_until(c, lambda g: len(g) >= 1, 30)
        assert [(m.body, m.attempts) for m in got] == [(b"fresh", 1)]
        got[0].ack()
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert dead["body"] == b"tired" and dead["attempts"] == 3
    assert dead["reason"] == "max_deliver (3) reached before delivery 4"
    s = sub_stats(db, "t")
    assert s["backlog"] == 0 and s["in_flight"] == 0 and s["dlq"] == 1


def test_a_tail_shut_down_mid_batch_gives_back_the_unstarted_messages_uncounted(db):
    """The handler shuts the tail down on the first message of a 10-message batch: the
    nine it never got go back with their attempts unchanged (released, not nak'd)."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i) for i in range(10)])
    handled, first, started = [], threading.Event(), threading.Event()

    def handler(m):
        started.wait(30)
        handled.append(m.body)
        t.shutdown()
        first.set()
    t = fdq.tail(db, "t", handler, config=FAST, batch_size=10)
    started.set()
    try:
        assert first.wait(30)
        wait_for(lambda: t._closed, 30, what="the tail closed")
    finally:
        t.shutdown()
    assert handled == [b"m0"]
    with fdq.Consumer(db, "t", config=FAST) as c:
        rest = fetch_until(c, lambda g: len(g) >= 9, 30)
        assert sorted((m.body, m.attempts) for m in rest) == [(b"m%d" % i, 1) for i in range(1, 10)]
        c.ack_many(rest)


def test_consumer_release_gives_fetched_messages_back_uncounted(db):
    """``Consumer.release(msgs)``: fetched and never begun on, given back in one go; the
    next fetch has them as attempt 1 again."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i) for i in range(3)])
    with fdq.Consumer(db, "t", config=FAST) as c:
        first = fetch_until(c, lambda g: len(g) >= 3, 30)
        c.release(first)
        again = fetch_until(c, lambda g: len(g) >= 3, 30)
        assert [(m.body, m.attempts) for m in again] == [(b"m0", 1), (b"m1", 1), (b"m2", 1)]
        c.ack_many(again)


def test_a_head_of_messages_past_max_deliver_is_dead_lettered_over_several_transactions(db, monkeypatch):
    """160 messages nak'd once, then leased under max_deliver=1: each is dead-lettered by
    the lease that meets it. All in one transaction could pass FDB's 10 MB or 5 s with
    large records, and then failed at every retry (the shard stuck); at most
    ``DEAD_PER_TX`` go per transaction (50 here), the round goes on to the next one, and
    the fresh message behind them is delivered."""
    monkeypatch.setattr(queue, "DEAD_PER_TX", 50)
    spent = []
    real = queue.Batch.spent

    def counted(self, raw):
        done = real(self, raw)
        spent.append(self.dead)
        return done
    monkeypatch.setattr(queue.Batch, "spent", counted)
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(b"m%d" % i) for i in range(160)])
    with fdq.Consumer(db, "t", config=fast(max_deliver=10)) as c:
        got = fetch_until(c, lambda g: len(g) >= 160, 30)
        for m in got:
            m.nak(0)
    p.push("t", b"fresh")
    with fdq.Consumer(db, "t", config=fast(max_deliver=1)) as c:
        got = fetch_until(c, lambda g: len(g) >= 1, 30)
        assert [(m.body, m.attempts) for m in got] == [(b"fresh", 1)]
        got[0].ack()
    assert max(spent) == 50 and len(spent) == 160
    s = sub_stats(db, "t")
    assert s["backlog"] == 0 and s["in_flight"] == 0 and s["dlq"] == 160


def test_a_message_whose_handler_outlives_the_close_counts_its_attempt(db, monkeypatch):
    """A tail closing waits for its worker's round a while (``WORKER_JOIN_S``, at least
    the ack wait), then gives back what it leased. The message a still-running handler
    holds was handed over: it goes back as an attempt (nak), so a message that hangs its
    handler reaches ``max_deliver`` (before: released, attempt uncounted, for ever)."""
    monkeypatch.setattr(tailing, "WORKER_JOIN_S", 0.5)
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push("t", b"hang")
    entered, release = threading.Event(), threading.Event()

    def handler(m):
        entered.set()
        release.wait(30)
    t = fdq.tail(db, "t", handler, config=fast(ack_wait_s=0.2), batch_size=1)
    try:
        assert entered.wait(30)
        t.shutdown()                # returns after WORKER_JOIN_S with the handler still in
    finally:
        release.set()
    with fdq.Consumer(db, "t", config=FAST) as c:
        [m] = fetch_until(c, lambda g: len(g) >= 1, 30)
        assert (m.body, m.attempts) == (b"hang", 2)
        m.ack()
