"""``Consumer.messages()`` and ``fdq.aio.Consumer.messages()``: leased messages one at a
time, for ``for`` and ``async for``; leaving the loop early gives back the batch's
messages not yet yielded, no attempt counted."""
from __future__ import annotations

import asyncio
import time

import pytest

import fdq
import fdq.aio
from fdqtest import FAST, fast, sub_stats


def _push(db, n, topic="t", shards=4):
    fdq.Supervisor(db).create_topic(topic, shards=shards)
    fdq.Producer(db).push_many(topic, [fdq.Envelope(f"m{i}".encode()) for i in range(n)])


def _attempts_left(db, topic, n) -> dict:
    """{body: attempts} of every message left, fetched (and acked) by a new consumer."""
    out = {}
    with fdq.Consumer(db, topic, config=FAST) as c:
        for m in c.messages(timeout=2):
            out[m.body] = m.attempts
            m.ack()
            if len(out) == n:
                break
    return out


def test_iterating_messages_delivers_each_message_and_ends_after_the_timeout(db):
    _push(db, 250)
    got = []
    with fdq.Consumer(db, "t", config=FAST) as c:
        for m in c.messages(batch=40, timeout=0.5):
            got.append(m.body)
            m.ack()
    assert sorted(got) == sorted(f"m{i}".encode() for i in range(250))
    s = sub_stats(db, "t")
    assert s["backlog"] == 0 and s["in_flight"] == 0


def test_breaking_out_of_messages_gives_back_the_rest_of_the_batch_uncounted(db):
    _push(db, 100, shards=1)
    with fdq.Consumer(db, "t", config=FAST) as c:
        it = c.messages(batch=50)
        first = next(it)
        first.ack()
        second = next(it)       # handed over, left unsettled: an attempt (nak'd at close)
        it.close()              # the 48 others of the batch: back now
        assert sub_stats(db, "t")["in_flight"] == 1
        with pytest.raises(fdq.FDQError, match="handed"):
            second.release()
    left = _attempts_left(db, "t", 99)
    assert len(left) == 99
    assert left.pop(second.body) == 2
    assert set(left.values()) == {1}


def test_messages_ends_when_the_consumer_closes(db):
    _push(db, 3)
    c = fdq.Consumer(db, "t", config=FAST)
    got = []
    for m in c.messages():
        got.append(m)
        m.ack()
        if len(got) == 3:
            c.close()
    assert len(got) == 3


def test_a_batch_waiting_behind_a_slow_message_is_kept_leased(db):
    """ack wait 1 s: the 2nd message is yielded 1.5 s after the batch was leased, still
    its lease (touched meanwhile), so its ack commits."""
    _push(db, 2, shards=1)
    with fdq.Consumer(db, "t", config=fast(ack_wait_s=1.0)) as c:
        it = c.messages(batch=2)
        m1 = next(it)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:      # a handler working on m1
            m1.in_progress()
            time.sleep(0.2)
        m1.ack()
        m2 = next(it)
        m2.ack()                # LeaseLost if it had expired
        assert m2.attempts == 1
        it.close()


@pytest.mark.parametrize("arg, value", [("batch", 0), ("batch", True), ("timeout", -1), ("timeout", "1")])
def test_messages_refuses_bad_arguments(db, arg, value):
    with fdq.Consumer(db, "t", config=FAST) as c:
        with pytest.raises(fdq.ConfigError, match=arg):
            next(c.messages(**{arg: value}))


def test_async_for_over_messages_delivers_each_message_and_commits_the_acks(db):
    _push(db, 250)

    async def main():
        got = []
        async with await fdq.aio.Consumer.open(db, "t", config=FAST) as c:
            async for m in c.messages(batch=40, timeout=0.5):
                await asyncio.sleep(0)
                got.append(m.body)
                m.ack()
        return got

    got = asyncio.run(main())
    assert sorted(got) == sorted(f"m{i}".encode() for i in range(250))
    s = sub_stats(db, "t")
    assert s["backlog"] == 0 and s["in_flight"] == 0


@pytest.mark.parametrize("close_it", [True, False])
def test_leaving_async_for_early_commits_the_acks_and_gives_back_the_rest(db, close_it):
    """``break`` then ``aclose()``, or ``break`` alone (the iterator is closed only when
    collected, after ``async with`` closed the consumer): the acks recorded commit, the
    rest of the batch goes back uncounted."""
    _push(db, 100, shards=1)

    async def main():
        async with await fdq.aio.Consumer.open(db, "t", config=FAST) as c:
            it = c.messages(batch=50)
            async for m in it:
                m.ack()
                if m.body == b"m9":
                    break
            if close_it:
                await it.aclose()
                return sub_stats(db, "t")
        return sub_stats(db, "t")

    s = asyncio.run(main())
    assert (s["in_flight"], s["backlog"], s["acked"]) == (0, 90, 10)
    left = _attempts_left(db, "t", 90)
    assert len(left) == 90 and set(left.values()) == {1}
