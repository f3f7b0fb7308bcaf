"""fdq.hooks around handlers: each delivery mode of fdq.tail and fdq.aio.tail calls
handle_begin/handle_end around the handler, in its thread, with the outcome."""
from __future__ import annotations

import asyncio
import threading

import pytest

import fdq
import fdq.aio
from fdq import hooks

from fdqtest import FAST, fast, wait_for


class Recorder(hooks.Hook):
    def __init__(self):
        self.ended = {}

    def handle_begin(self, message):
        return threading.current_thread()

    def handle_end(self, state, message, outcome, error, seconds):
        assert state is threading.current_thread()
        self.ended.setdefault(message.body, []).append((outcome, type(error).__name__ if error else None))


@pytest.fixture
def recorder():
    r = Recorder()
    hooks.register(r)
    yield r
    hooks.unregister(r)


BODIES = [b"ok", b"nak", b"term", b"raise"]


def _act(m):
    if m.body == b"nak":
        m.nak(0)
    elif m.body == b"term":
        m.term("no")
    elif m.body == b"raise":
        raise ValueError("no")


def test_at_least_once_outcomes(db, recorder):
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", BODIES)
    c = fdq.tail(db, "t", _act, on_error=lambda e: None, config=fast(max_deliver=2))
    try:
        wait_for(lambda: len(recorder.ended.get(b"raise", ())) == 2 and len(recorder.ended.get(b"nak", ())) == 2,
                 30, what="two attempts of the failing messages")
    finally:
        c.shutdown()
    assert recorder.ended == {b"ok": [("ack", None)], b"nak": [("nak", None)] * 2, b"term": [("term", None)],
                              b"raise": [("error", "ValueError")] * 2}


def test_at_most_once_and_exactly_once_outcomes(db, recorder):
    fdq.Supervisor(db).create_topic("amo", shards=1)
    fdq.Supervisor(db).create_topic("eo", shards=1)
    p = fdq.Producer(db)
    p.push_many("amo", [b"ok", b"raise"])
    p.push_many("eo", [b"ok", b"term"])

    def once(tr, m):
        if m.body == b"term":
            m.term("no")

    a = fdq.tail(db, "amo", _act, acking=False, on_error=lambda e: None, config=FAST)
    e = fdq.tail(db, "eo", once, transactional=True, config=FAST)
    try:
        wait_for(lambda: len(recorder.ended) == 3 and len(recorder.ended.get(b"ok", ())) == 2, 30,
                 what="the four handler calls")
    finally:
        a.shutdown()
        e.shutdown()
    assert sorted(recorder.ended[b"ok"]) == [("ok", None)] * 2
    assert recorder.ended[b"raise"] == [("error", "ValueError")]
    assert recorder.ended[b"term"] == [("term", None)]


def test_aio_outcomes(db, recorder):
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [b"ok", b"raise"])

    async def main():
        async def handle(m):
            _act(m)

        t = await fdq.aio.tail(db, "t", handle, on_error=lambda e: None, config=fast(max_deliver=1))
        try:
            while len(recorder.ended) < 2:
                await asyncio.sleep(0.02)
        finally:
            await t.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert recorder.ended == {b"ok": [("ack", None)], b"raise": [("error", "ValueError")]}
