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
