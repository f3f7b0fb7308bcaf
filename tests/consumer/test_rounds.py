"""A consumer's round keeps its batch leased while the handler runs, and only then: a
batch longer than the ack wait is not redelivered, a stuck handler does not keep it,
a raised ack wait is picked up, a kill -9 releases it."""
from __future__ import annotations

import threading
import time

import pytest

import fdq

from fdqtest import fast, sub_stats, wait_for


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
        if touching:            # 2 s of work on each, its lease extended every 0.5 s
            for _ in range(4):
                time.sleep(0.5)
                m.in_progress()
        else:                   # each within the ack wait, the batch 2.4 s
            time.sleep(0.6)
    ack_wait = 1.5
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
