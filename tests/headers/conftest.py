"""Fixtures for the extend-headers tests: a fresh embedded database per test, a key-space
dump (to prove a refused push wrote nothing), consumer worker processes, bounded waits."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import fdq
from fdqtest import database_url, wait_for  # noqa: F401 - re-exported to this directory's tests

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")


@pytest.fixture
def db_url(tmp_path):
    return database_url(tmp_path / "fdq.db")


@pytest.fixture
def db(db_url):
    return fdq.connect(db_url)


def dump(db) -> dict:
    """Every key and value of the database (the tests' databases are small)."""
    tr = db.create_transaction()
    out = {bytes(kv.key): bytes(kv.value) for kv in tr.snapshot.get_range(b"", b"\xff")}
    tr.cancel()
    return out


class Worker:
    """A consumer in its own OS process (tests/headers/worker.py). It appends one JSON
    line per delivery to its events file; ``ready`` once it has joined."""

    def __init__(self, tmp_path, db_url, topic, cid, tag=None, **opts):
        self.cid = cid
        self.path = tmp_path / f"events-{cid}.jsonl"
        args = [sys.executable, WORKER, db_url, topic, cid, tag or "", str(self.path), json.dumps(opts)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"err-{cid}.txt", "w"))

    def events(self) -> list:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            lines = f.read().splitlines()
        return [json.loads(l) for l in lines if l.endswith("}")]   # a killed writer's last line may be cut

    def deliveries(self) -> list:
        return [e for e in self.events() if e["event"] == "delivered"]

    def wait_ready(self, timeout=60.0):
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.cid} exited with {self.proc.returncode}")
            return any(e["event"] == "ready" for e in self.events())
        wait_for(ready, timeout, f"worker {self.cid} to join", 0.1)

    def kill9(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill9()


@pytest.fixture
def workers(tmp_path, db_url):
    started = []

    def start(topic, cid, tag=None, **opts):
        w = Worker(tmp_path, db_url, topic, cid, tag, **opts)
        started.append(w)
        return w
    yield start
    for w in started:
        w.stop()
