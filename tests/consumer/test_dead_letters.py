"""Dead letters: a message goes to the DLQ after max_deliver, and records at the value
limit lease and dead-letter whole."""
from __future__ import annotations

import os
import time

import fdq
from fdq.keyspace.codec import CHUNK_BYTES

from fdqtest import FAST, drain, fast, fetch_until, sub_stats, wait_for


def test_dead_letter_after_max_deliver(db):
    fdq.Supervisor(db).create_topic("t", shards=2)
    fdq.Producer(db).push("t", b"poison", shard_key="k")
    calls = []

    def handler(m):
        calls.append(m.attempts)
        raise RuntimeError("cannot handle")
    c = fdq.tail(db, "t", handler, config=fast(max_deliver=3), on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(db, "t")["dlq"] == 1, 30, what="the message dead-lettered")
        time.sleep(0.3)
    finally:
        c.shutdown()
    assert calls == [1, 2, 3]
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert dead["body"] == b"poison" and "max_deliver (3)" in dead["reason"] and dead["attempts"] == 3
    s = sub_stats(db, "t")
    assert s["backlog"] == 0 and s["in_flight"] == 0


def test_records_at_the_value_limit_lease_and_dead_letter(db):
    """A body that fits one value alone but not with its headers and a long shard key is
    chunked; leased and then dead-lettered with a 200,000-character reason (cut), it stays
    whole (before: a lease or dead letter over FDB's value limit failed every attempt)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1, extend=True)
    key = "k" * 1024
    headers = {f"h{i}": "v" * 1000 for i in range(8)}
    bodies = [os.urandom(CHUNK_BYTES), os.urandom(CHUNK_BYTES - 100), b"small"]
    p = fdq.Producer(db)
    for b in bodies:
        p.push("t", b, shard_key=key, headers=headers)
    p.push("t", os.urandom(CHUNK_BYTES), shard_key=key)      # no headers: fits inline
    with fdq.Consumer(db, "t", config=FAST, extend_support=True) as c:
        got = fetch_until(c, lambda g: len(g) >= 4, 30)
        assert [m.body for m in got[:3]] == bodies and dict(got[0].headers) == headers
        for m in got:
            m.term("r" * 200_000)
    dead = sup.dlq_list("t")
    assert [d["body"] for d in dead[:3]] == bodies and len(dead) == 4
    assert all(len(d["reason"]) == 1000 and d["reason"].startswith("terminated: rrr") for d in dead)
    assert sup.dlq_redrive("t") == 4
    with fdq.Consumer(db, "t", config=FAST, extend_support=True) as c:
        again = fetch_until(c, lambda g: len(g) >= 4, 30)
        assert [m.body for m in again] == [m.body for m in got]
        c.ack_many(again)
    assert sub_stats(db, "t")["backlog"] == 0


def test_an_unkeyed_dead_letter_redriven_after_a_rewind_over_it_is_queued_once(db):
    """A rewind queues dead letters again (the DLQ is left alone) where their push put
    them; a redrive then only drops a dead letter whose copy is queued (that copy
    delivers it). An unkeyed one was looked for in the shard of its versionstamp
    (``vs[-4:] % shards``), not where the copy was, and queued a second time: delivered
    twice, a backlog left for good. Every copy now goes where its push put it."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    sup.create_subscription("t", "r")
    ids = {r.id for r in fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i) for i in range(8)])}
    with fdq.Consumer(db, "t", subscription="r", config=FAST) as c:
        for m in fetch_until(c, lambda g: len(g) >= 8, 30):
            m.term("bad")
    assert sub_stats(db, "t", "r")["dlq"] == 8
    sup.reset("t", "r", 0)
    assert sup.dlq_redrive("t", "r") == 8
    st = sub_stats(db, "t", "r")
    assert (st["backlog"], st["dlq"]) == (8, 0)
    got = [m.id for m in drain(db, "t", "r", idle_s=1.0, settle="ack_many", create=False, config=FAST)]
    assert sorted(got) == sorted(ids)
    assert sub_stats(db, "t", "r")["backlog"] == 0


def test_the_dead_letter_reason_keeps_the_handlers_last_exception(db):
    """A handler failing every attempt: the dead letter says which exception ended the
    last one (before: 'max_deliver (2) reached: last attempt nak'd'); a pull consumer's
    ``nak(error=...)`` likewise."""
    fdq.Producer(db).push("t", b"order 17")

    def handler(m):
        raise ValueError("order 17 has no customer")
    c = fdq.tail(db, "t", handler, config=fast(max_deliver=2), on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(db, "t")["dlq"] == 1, 30, what="the message dead-lettered")
    finally:
        c.shutdown()
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert dead["reason"] == "max_deliver (2) reached: last attempt failed: ValueError: order 17 has no customer"
    fdq.Producer(db).push("t", b"pulled")
    with fdq.Consumer(db, "t", config=fast(max_deliver=1)) as c:
        [m] = fetch_until(c, lambda g: len(g) >= 1, 30)
        m.nak(error=KeyError("customer\nid"))
    assert fdq.Supervisor(db).dlq_list("t")[1]["reason"] == (
        "max_deliver (1) reached: last attempt failed: KeyError: 'customer\\nid'")


def test_the_default_on_error_logs_a_handlers_failure_with_its_traceback(db, caplog):
    """No on_error: a handler's exception is logged as an error naming the message and
    its attempt, with the traceback (before: one warning line, no traceback)."""
    import logging
    fdq.Producer(db).push("t", b"m")

    def handler(m):
        raise ValueError("order 17 has no customer")
    with caplog.at_level(logging.WARNING, logger="fdq.consumer"):
        c = fdq.tail(db, "t", handler, config=fast(max_deliver=1))
        try:
            wait_for(lambda: sub_stats(db, "t")["dlq"] == 1, 30, what="the message dead-lettered")
        finally:
            c.shutdown()
    [rec] = [r for r in caplog.records if r.name == "fdq.consumer" and "handler failed" in r.getMessage()]
    assert rec.levelname == "ERROR" and rec.exc_info is not None and "(attempt 1 of 1)" in rec.getMessage()
    text = caplog.text
    assert "Traceback" in text and "ValueError: order 17 has no customer" in text
