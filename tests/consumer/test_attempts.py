"""``Message.attempts`` is the delivery's number, 1 for the first, in every delivery
mode (at-least-once counts it in the lease; at-most-once and exactly-once take the
message as queued, whose record counts failed attempts only)."""
from __future__ import annotations

import threading

import pytest

import fdq

from fdqtest import FAST_STEADY


@pytest.mark.parametrize("mode", ["at_most_once", "at_least_once", "exactly_once", "pull"])
def test_first_delivery_is_attempt_one(db, mode):
    fdq.Producer(db).push("t", b"m")
    if mode == "pull":
        with fdq.Consumer(db, "t", config=FAST_STEADY) as c:
            [m] = c.fetch(1, timeout=10)
            m.ack()
        assert m.attempts == 1
        return
    seen, done = [], threading.Event()

    def handle(m):
        seen.append(m.attempts)
        done.set()
    if mode == "exactly_once":
        c = fdq.tail(db, "t", lambda tr, m: handle(m), transactional=True, config=FAST_STEADY)
    else:
        c = fdq.tail(db, "t", handle, acking=mode == "at_least_once", config=FAST_STEADY)
    try:
        assert done.wait(30)
    finally:
        c.shutdown()
    assert seen == [1]
