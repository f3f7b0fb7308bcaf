"""Helpers shared by every test directory (``tests/`` is on ``sys.path`` through its
conftest): bounded waiting on a condition."""
from __future__ import annotations

import time


def wait_for(cond, timeout: float = 60.0, what: str = "condition", interval: float = 0.05):
    """Poll ``cond()`` until it returns a truthy value (returned); fail the test naming
    ``what`` after ``timeout`` seconds. Tests wait for conditions, never for fixed sleeps."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
