"""Exactly-once ``term()``: the handler dead-letters a message inside the dequeue
transaction. It lands in the DLQ with the reason and its whole body (a chunked one too),
once, with the handler's writes; the others are processed; counters add up; a redrive
brings it back intact."""
from __future__ import annotations

import fdq
from fdq.keyspace.codec import CHUNK_BYTES

from fdqtest import FAST_STEADY, wait_for

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
