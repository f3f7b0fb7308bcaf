"""fdq tail reports ConsumerStalled (its consumer owned no shard for over 3 heartbeats)
with one line on stderr and keeps going: once a shard is free it delivers."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import fdq

FDQ = Path(sys.executable).parent / "fdq"


@pytest.mark.slow
def test_tail_reports_a_stall_and_keeps_going(tmp_path, url, db, sup, wait):
    sup.create_topic("orders", shards=1)
    holder = fdq.Consumer(db, "orders")          # the tail's heartbeat interval: peers judge by their own
    wait(lambda: holder.owned_shards, what="the first consumer to own the only shard")
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME")}
    proc = subprocess.Popen([str(FDQ), "--url", url, "tail", "orders", "--count", "1", "--json",
                             "--timeout", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, cwd=tmp_path)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.decode()) for line in proc.stderr], daemon=True).start()
    try:
        # The holder keeps its shard (the consumer holding most keeps it): the tail owns
        # none, and after 3 heartbeats (1 s each by default) reports it.
        deadline = time.monotonic() + 60
        seen = []
        while not seen or not seen[-1].startswith("fdq: warning: stalled"):
            try:
                seen.append(lines.get(timeout=max(0.05, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"fdq tail reported no stall within 60 s: {seen}") from None
        line = seen[-1]
        assert line.startswith("fdq: warning: stalled: consumer ") and "of orders/default owns no shard for " \
            in line and line.rstrip().endswith("(over 3 heartbeats)"), line
        assert proc.poll() is None                                  # it keeps going
        holder.close()                                              # the shard is free: the tail takes it
        pushed = fdq.Producer(db).push("orders", b"after the stall")
        out, _ = proc.communicate(timeout=60)
    finally:
        holder.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    assert proc.returncode == 0
    [row] = [json.loads(x) for x in out.decode().splitlines()]
    assert (row["id"], row["body"]) == (pushed.id, "after the stall")
    assert sup.stats("orders")["subscriptions"]["default"]["acked"] == 1
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert not [x for x in rest if "stalled" in x]                  # reported once
