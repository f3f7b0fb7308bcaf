"""fdq tail beside a consumer holding the only shard is on standby: no stall line on stderr
(it was reported as ConsumerStalled after 3 heartbeats), and once the shard is free it
delivers."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import fdq

FDQ = Path(sys.executable).parent / "fdq"


@pytest.mark.slow
def test_tail_on_standby_reports_no_stall_and_takes_a_freed_shard(tmp_path, url, db, sup, wait):
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
        # none and is on standby; past 3 heartbeats (1 s each by default), no stall line.
        def tail_row():
            rows = sup.stats("orders")["subscriptions"]["default"]["consumers"]
            return next((c for c in rows if c["id"] != holder.id), None)
        wait(lambda: tail_row() is not None and tail_row()["standby"], what="the tail to join on standby")
        start = tail_row()["heartbeats"]
        wait(lambda: tail_row()["heartbeats"] >= start + 5, what="5 heartbeats of the tail")
        seen = []
        while not lines.empty():
            seen.append(lines.get())
        assert not [x for x in seen if "stalled" in x], seen
        assert proc.poll() is None                                  # it keeps going
        holder.close()                                              # the shard is free: the tail takes it
        pushed = fdq.Producer(db).push("orders", b"after the standby")
        out, _ = proc.communicate(timeout=60)
    finally:
        holder.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    assert proc.returncode == 0
    [row] = [json.loads(x) for x in out.decode().splitlines()]
    assert (row["id"], row["body"]) == (pushed.id, "after the standby")
    assert sup.stats("orders")["subscriptions"]["default"]["acked"] == 1
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert not [x for x in rest if "stalled" in x]
