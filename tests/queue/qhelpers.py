"""Helpers for the queue tests: worker processes that are always reaped (killed by
PID), bounded condition waits, key-space scans."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fdq
from fdq.keyspace import decode_counter
from fdqtest import read, wait_for  # noqa: F401 - re-exported to this directory's tests

WORKER = Path(__file__).with_name("worker.py")


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_lines(path):
    try:
        with open(path) as f:
            return [line.rstrip("\n") for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


class Procs:
    """Starts worker processes and reaps every one of them at teardown."""

    def __init__(self, tmp_path: Path, url: str):
        self.tmp = tmp_path
        self.url = url
        self.procs = []

    def start(self, role: str, name: str, *args, url: str | None = None, wait_ready=False,
              timeout: float = 60):
        out = str(self.tmp / f"{name}.log")
        status = str(self.tmp / f"{name}.status")
        cmd = [sys.executable, str(WORKER), role, "--url", url or self.url, "--name", name,
               "--out", out, "--status", status, *map(str, args)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(self.tmp / f"{name}.err", "w"),
                             text=True)
        p.name, p.out, p.status = name, out, status
        self.procs.append(p)
        if wait_ready:
            line = self.readline(p, timeout)
            assert line.strip() == "ready", f"{name} did not start: {line!r} {self.stderr(p)}"
        return p

    def readline(self, p, timeout: float) -> str:
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                raise AssertionError(f"{p.name}: no output within {timeout}s; stderr: {self.stderr(p)}")
        finally:
            sel.close()
        return p.stdout.readline()

    def stderr(self, p) -> str:
        try:
            return (self.tmp / f"{p.name}.err").read_text()[-8000:]
        except FileNotFoundError:
            return ""

    def kill9(self, p):
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)

    def stop(self, p, timeout: float = 90):
        """SIGTERM (the worker shuts its consumer down cleanly) and wait."""
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGUSR1)     # the worker dumps every thread's stack
            time.sleep(1)
            raise AssertionError(f"{p.name} did not stop within {timeout}s: {self.stderr(p)[-6000:]}")
        assert rc == 0, f"{p.name} exited {rc}: {self.stderr(p)}"

    def wait(self, p, timeout: float = 120):
        rc = p.wait(timeout=timeout)
        assert rc == 0, f"{p.name} exited {rc}: {self.stderr(p)}"

    def cleanup(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout:
                p.stdout.close()


def counter_value(db, key: bytes) -> int:
    return decode_counter(read(db, key))


def scan(db, prefix: bytes) -> list:
    """Every (key, value) under ``prefix``, in key order, in bounded transactions."""
    out = []
    begin, end = prefix, prefix + b"\xff"
    while True:
        tr = db.create_transaction()
        rows = list(tr.snapshot.get_range(begin, end, limit=5000))
        out += [(kv.key, kv.value) for kv in rows]
        if len(rows) < 5000:
            return out
        begin = rows[-1].key + b"\x00"


def sub_stats(db, topic: str) -> dict:
    return fdq.Supervisor(db).stats(topic)["subscriptions"]["default"]


def threads_in(*names) -> list:
    """Idents of the threads whose stack has a frame of each function in ``names`` (a
    name, or a tuple of names any one of which will do)."""
    import sys
    out = []
    for ident, frame in sys._current_frames().items():
        seen = set()
        while frame is not None:
            seen.add(frame.f_code.co_name)
            frame = frame.f_back
        if all(n in seen if isinstance(n, str) else seen & set(n) for n in names):
            out.append(ident)
    return out
