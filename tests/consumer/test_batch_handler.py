"""``fdq.tail(..., batch=True)``: the handler takes a round's messages as one list, in each
delivery mode."""
from __future__ import annotations

import threading

import pytest

import fdq
from fdqtest import FAST, fast, sub_stats, wait_for


def _push(db, bodies, shards=2):
    fdq.Supervisor(db).create_topic("t", shards=shards)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b) for b in bodies])


def test_a_batch_handler_gets_lists_and_its_return_acks_them(db):
    _push(db, [f"m{i}".encode() for i in range(300)])
    batches = []
    t = fdq.tail(db, "t", lambda ms: batches.append([m.body for m in ms]), batch=True, batch_size=50,
                 config=FAST)
    try:
        wait_for(lambda: sum(map(len, batches)) >= 300, 30, "300 handled")
    finally:
        t.shutdown()
    assert all(isinstance(b, list) and 0 < len(b) <= 50 for b in batches)
    assert any(len(b) > 1 for b in batches)
    assert sorted(sum(batches, [])) == sorted(f"m{i}".encode() for i in range(300))
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["acked"]) == (0, 0, 300)


def test_a_batch_handler_that_raises_naks_the_ones_it_left_and_keeps_its_own_settlements(db):
    _push(db, [b"ok", b"bad", b"retry"], shards=1)
    calls = []

    def handle(ms):
        calls.append([(m.body, m.attempts) for m in ms])
        for m in ms:
            if m.body == b"bad":
                m.term("cannot parse")
            if m.body == b"ok":
                m.ack()
        if len(calls) == 1:
            raise RuntimeError("flaky")

    errors = []
    t = fdq.tail(db, "t", handle, batch=True, config=fast(backoff_s=(0,)), on_error=errors.append)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0 and len(calls) >= 2, 30, "the retry handled")
    finally:
        t.shutdown()
    assert calls[0] == [(b"ok", 1), (b"bad", 1), (b"retry", 1)]
    assert calls[1] == [(b"retry", 2)]          # nak'd by the raise: an attempt
    assert [type(e) for e in errors] == [RuntimeError]
    s = sub_stats(db, "t")
    assert (s["dlq"], s["acked"]) == (1, 2)


def test_a_batch_handler_at_most_once_gets_each_message_once(db):
    _push(db, [f"m{i}".encode() for i in range(120)])
    got = []
    t = fdq.tail(db, "t", lambda ms: got.extend(m.body for m in ms), acking=False, batch=True, config=FAST)
    try:
        wait_for(lambda: len(got) >= 120, 30, "120 handled")
    finally:
        t.shutdown()
    assert sorted(got) == sorted(f"m{i}".encode() for i in range(120))


def test_an_exactly_once_batch_handler_commits_its_writes_with_the_batch_and_isolates_a_failure(db):
    """The handler raises whenever its batch holds m7: the batch is halved until m7 is
    alone, which fails in place (an attempt each time) until dead-lettered; the others
    commit with their writes."""
    bodies = [f"m{i}".encode() for i in range(40)]
    _push(db, bodies, shards=1)

    def handle(tr, ms):
        for m in ms:
            if m.body == b"m7":
                raise ValueError("m7 is poison")
            tr[b"seen/" + m.body] = b"1"

    t = fdq.tail(db, "t", handle, transactional=True, batch=True, config=fast(max_deliver=3),
                 on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 30, "drained")
    finally:
        t.shutdown()
    tr = db.create_transaction()
    seen = {bytes(kv.key)[len(b"seen/"):] for kv in tr.get_range(b"seen/", b"seen0")}
    tr.cancel()
    assert seen == set(bodies) - {b"m7"}
    dead = fdq.Supervisor(db).dlq_list("t")
    assert [d["body"] for d in dead] == [b"m7"] and "m7 is poison" in dead[0]["reason"]


def test_a_shutdown_before_a_batch_handler_began_gives_the_batch_back_uncounted(db):
    _push(db, [f"m{i}".encode() for i in range(20)], shards=1)
    started, release = threading.Event(), threading.Event()

    def handle(ms):
        started.set()
        release.wait(30)

    t = fdq.tail(db, "t", handle, batch=True, batch_size=5, config=FAST)
    assert started.wait(30)
    closing = threading.Thread(target=t.shutdown)
    closing.start()
    release.set()
    closing.join(30)
    s = sub_stats(db, "t")
    assert (s["acked"], s["in_flight"], s["backlog"]) == (5, 0, 15)
    with fdq.Consumer(db, "t", config=FAST) as c:
        assert {m.attempts for m in c.fetch(20, timeout=5)} == {1}


def test_batch_must_be_a_bool(db):
    with pytest.raises(fdq.ConfigError, match="batch must be True or False"):
        fdq.tail(db, "t", lambda ms: None, batch=1)
