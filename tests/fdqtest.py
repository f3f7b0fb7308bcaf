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


def readline_within(proc, timeout: float = 60.0, what: str = "a line"):
    """The next line of ``proc.stdout`` (a pipe), failing the test if none comes within
    ``timeout`` seconds (a child stuck before it prints must not hang the run). Returns
    what ``readline()`` returns (empty at end of output)."""
    import selectors
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"timed out after {timeout}s waiting for {what} from pid {proc.pid}")
    return proc.stdout.readline()


def kill_all(procs, timeout: float = 30.0):
    """SIGKILL (and reap) every process of ``procs`` still running: a ``finally`` for
    tests that start processes, so a failure or a timeout leaves none behind."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            try:
                p.wait(timeout)
            except Exception:       # noqa: BLE001 - reaping is best effort; the kill was sent
                pass
