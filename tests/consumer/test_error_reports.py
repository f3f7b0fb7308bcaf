"""What a consumer reports without ``on_error``: an error met every round is logged
once, not once a round (a damaged database once logged ~19 lines a second)."""
from __future__ import annotations

import logging

import fdq
from fdq.errors import FDQError
from fdq.ops import queue

from fdqtest import FAST, wait_for


def test_an_identical_error_every_round_is_logged_once(db, caplog, monkeypatch):
    """Every lease round fails the same way for a while: one warning line (before: one
    per round, every 50 ms); a different error is logged at once."""
    fdq.Producer(db).push("t", b"m")
    rounds = []

    def failing(*a, **kw):
        rounds.append(1)
        raise FDQError("the same failure" if len(rounds) < 30 else "another failure")
    monkeypatch.setattr(queue, "lease_batch", failing)
    with caplog.at_level(logging.WARNING, logger="fdq.consumer"):
        t = fdq.tail(db, "t", lambda m: None, config=FAST)
        try:
            wait_for(lambda: len(rounds) >= 32, 60, what="32 failing rounds")
        finally:
            t.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == "fdq.consumer"]
    assert sum("the same failure" in line for line in lines) == 1, lines
    assert sum("another failure" in line for line in lines) == 1, lines
