"""What a lease round costs and that its watches miss no push.

A round that takes messages commits once, and is its only transaction: a shard it
drained is watched in it, on the shard's ``routed`` counter, which a push adds to
without a write conflict range (a watch is a read with a conflict range: a push
meanwhile would otherwise abort the round, which then waits the engine's retry
backoff, or run an exactly-once handler again). A push committed while the round runs
never aborts it and is never left to the sweep. The sweep here is a minute away: only a
watch delivers in time."""
from __future__ import annotations

import threading

import fdq
from fdq.ops import queue

from fdqtest import QUIET, QUIET_WAIT_S as WAIT_S, CountingDatabase, drained_consumer, key_on_shard, wait_for


def test_a_round_that_drains_its_shard_is_one_transaction_and_sets_its_watch(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    counting = CountingDatabase(db)
    c = drained_consumer(counting)
    p = fdq.Producer(db)
    try:
        p.push_many("t", [fdq.Envelope(b"%d" % i) for i in range(3)])
        before = counting.mine()
        got = c.fetch(10, timeout=WAIT_S)     # waits for the watch (a round without work costs none)
        assert [m.body for m in got] == [b"0", b"1", b"2"]
        assert counting.mine() - before == 1, "a round that leased and drained its shard: one transaction"
        c.ack_many(got)
        p.push("t", b"next")        # the watch that round set wakes the next fetch
        assert [m.body for m in c.fetch(10, timeout=WAIT_S)] == [b"next"]
    finally:
        c.close()


def test_a_push_during_the_lease_transaction_neither_aborts_it_nor_is_missed(db, monkeypatch):
    """The push commits after the round's read version and before its commit: the round
    commits at its first attempt (no conflict, no retry backoff), and the push is
    delivered by the next round (the round's watch fired), and so is a push after it."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    c = drained_consumer(db)
    p = fdq.Producer(db)
    lease_batch = queue.lease_batch
    raced, calls = [], []

    def racing_lease_batch(tr, *args, **kwargs):
        taken = lease_batch(tr, *args, **kwargs)
        calls.append([m.body for m in taken])
        if not raced:
            raced.append(True)
            p.push("t", b"during")      # its own transaction, committed at once
        return taken
    monkeypatch.setattr(queue, "lease_batch", racing_lease_batch)
    try:
        p.push("t", b"first")
        got = []
        wait_for(lambda: got.extend(c.fetch(10, timeout=0.5)) or {m.body for m in got} >= {b"first", b"during"},
                 WAIT_S, what="both messages delivered")
        assert sorted(m.body for m in got) == [b"during", b"first"]
        assert calls[:2] == [[b"first"], [b"during"]], "the push aborted the leasing round (it ran again)"
        c.ack_many(got)
        p.push("t", b"after")
        assert [m.body for m in c.fetch(10, timeout=WAIT_S)] == [b"after"]
    finally:
        c.close()


def test_a_push_during_an_exactly_once_handler_neither_reruns_it_nor_is_missed(db):
    """The taking transaction of exactly-once delivery runs the handler and watches
    the drained shard: a push meanwhile neither aborts it (the handler would run again)
    nor is missed: it is delivered (by the watch, not the sweep), once."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    runs = []

    def handler(tr, m):
        runs.append(m.body)
        if m.body == b"first":
            p.push("t", b"during")      # its own transaction, committed while this one runs

    c = fdq.tail(db, "t", handler, transactional=True, config=QUIET)
    try:
        wait_for(lambda: c.owned_shards, 10, what="the shard owned")
        p.push("t", b"first")
        wait_for(lambda: b"during" in runs, WAIT_S, what="the message pushed during the handler delivered")
        p.push("t", b"after")
        wait_for(lambda: b"after" in runs, WAIT_S, what="a later push delivered")
    finally:
        c.shutdown()
    assert runs == [b"first", b"during", b"after"]


def test_an_exactly_once_round_over_several_shards_is_one_transaction(db):
    """Exactly-once takes from every shard that may have work in one transaction, as a
    lease round does: messages waiting on 4 shards when the tail starts are all handled
    in its first round, one transaction, each once (a transaction per shard cost a commit
    per ~4 messages at 5,000 msgs/s over 16 shards)."""
    fdq.Supervisor(db).create_topic("t", shards=4)
    keys = [key_on_shard(n, 4) for n in range(4)]
    bodies = [b"%d" % i for i in range(12)]
    fdq.Producer(db).push_many("t", [fdq.Envelope(b, shard_key=keys[i % 4]) for i, b in enumerate(bodies)])
    counting = CountingDatabase(db)
    runs = []

    def handler(tr, m):
        runs.append((m.body, threading.get_ident()))
        tr[b"qt/done/" + m.body] = b"1"

    c = fdq.tail(counting, "t", handler, transactional=True, config=QUIET)
    try:
        wait_for(lambda: len(runs) >= len(bodies), WAIT_S, what="the messages of the 4 shards handled")
        worker = runs[0][1]
        assert counting.by_thread[worker] == 1, "one transaction per shard, not one per round"
    finally:
        c.shutdown()
    assert sorted(b for b, _t in runs) == sorted(bodies)
    tr = db.create_transaction()
    assert len(list(tr.snapshot.get_range(b"qt/done/", b"qt/done0"))) == len(bodies)
    tr.cancel()
