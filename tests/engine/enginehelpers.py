"""Helpers the engine tests import (a module of its own: importing from ``conftest``
depends on which directory's conftest Python finds first)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from fdq.engine import error_types

WORKER = str(Path(__file__).with_name("engine_worker.py"))


def code_of(fn) -> int | None:
    """Run ``fn``; the FDB error code it raised, or None if it returned."""
    try:
        fn()
    except error_types() as e:
        return e.code
    return None


def wait_ready(future, timeout: float = 20.0) -> bool:
    """Poll ``future.is_ready()`` until ``timeout`` (FDB futures have no wait timeout)."""
    deadline = time.monotonic() + timeout
    while not future.is_ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def commit_by_other(eng, fn):
    """Run ``fn(tr)`` in a transaction of its own and commit it."""
    tr = eng.db.create_transaction()
    fn(tr)
    tr.commit().wait()


def started(eng):
    """A transaction whose read version is fixed (later commits are after it)."""
    tr = eng.db.create_transaction()
    tr.get_read_version().wait()
    return tr


def failed_commits(db, code: int, attempts: int, setup):
    """Yields ``(tr, setup(tr, i))`` for each of ``attempts`` transactions whose commit
    failed with ``code`` (fault injection decides; other outcomes are skipped)."""
    for i in range(attempts):
        tr = db.create_transaction()
        got = setup(tr, i)
        try:
            tr.commit().wait()
            continue
        except Exception as e:  # noqa: BLE001 - the engine's error type
            if getattr(e, "code", None) != code:
                continue
        yield tr, got


# A process that holds the embedded engine's version clock lock (argv[1]: its file) as a
# commit does, stopped there: a committer that does not finish.
HOLD_CLOCK_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def spawn(command: str, url: str, **args) -> subprocess.Popen:
    """Start ``engine_worker.py command`` in its own OS process."""
    return subprocess.Popen([sys.executable, WORKER, command, url, json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(proc: subprocess.Popen, timeout: float = 120.0):
    """Wait for a worker (bounded) and return its JSON result."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"worker timed out; stderr: {err[-2000:]}")
    assert proc.returncode == 0, f"worker failed ({proc.returncode}): {err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])
