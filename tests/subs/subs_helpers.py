"""Helpers of the subscription tests (module name unique across test directories)."""
import os
import selectors
import signal
import subprocess
import sys
import time

import fdq
from fdqtest import wait_for  # noqa: F401 - re-exported to this directory's tests

WORKER = os.path.join(os.path.dirname(__file__), "worker.py")
FAST = dict(heartbeat_interval_s=0.2, zombie_timeout_s=1.5, lease_check_interval_s=0.2,
            poll_interval_s=0.1)


class Workers:
    def __init__(self):
        self.procs = []

    def start(self, url, topic, sub, mode, name, timeout=60.0):
        p = subprocess.Popen([sys.executable, WORKER, url, topic, sub, mode, name],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.procs.append(p)
        with selectors.DefaultSelector() as sel:    # bounded: a worker stuck before "ready" fails the test
            sel.register(p.stdout, selectors.EVENT_READ)
            assert sel.select(timeout), f"worker {name} printed nothing within {timeout} s"
        line = p.stdout.readline()   # the worker prints "ready" or exits
        assert line.strip() == "ready", f"worker {name} did not start: {line!r}"
        return p

    def kill(self, p):
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)

    def leave(self, p):
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def drain(db, topic, sub, idle_s=1.0, timeout=60.0, ack=True):
    """Fetch everything a subscription delivers until it stays empty for ``idle_s``."""
    c = fdq.Consumer(db, topic, subscription=sub, create=False, config=fdq.ConsumerConfig(**FAST))
    got = []
    deadline = time.monotonic() + timeout
    try:
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            ms = c.fetch(500, timeout=0.2)
            if ms:
                got += ms
                if ack:
                    c.ack_many(ms)
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > idle_s:
                break
    finally:
        c.close()
    return got
