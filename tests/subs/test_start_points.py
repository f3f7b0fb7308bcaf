"""Subscriptions created while producer processes keep pushing receive exactly the
right set for their deliver policy: no gap and no duplicate at the catch-up boundary."""
import json
import os
import subprocess
import sys
import time

import pytest

import fdq
from fdq.keyspace import decode_counter
from fdq.log import iter_window
from subs_helpers import drain, wait_for

PRODUCER = os.path.join(os.path.dirname(__file__), "producer.py")
COUNT = 1500


def inserted(db, topic):
    ts = fdq.Supervisor(db).keyspace.topic(topic)
    tr = db.create_transaction()
    v = decode_counter(tr.snapshot[ts.stat("inserted")].wait())
    tr.cancel()
    return v


def log_entries(db, topic, shards):
    """{id: insertion ms} of the whole "all" log (the reference, read independently)."""
    ts = fdq.Supervisor(db).keyspace.topic(topic)
    return {vs.to_bytes().hex(): rec.ts_ms for vs, _b, rec in iter_window(db, ts, shards, None, None)}


@pytest.mark.slow
def test_late_subscriptions_get_exactly_their_start_point(db, url):
    sup = fdq.Supervisor(db)
    sup.create_topic("orders", shards=4)
    procs = [subprocess.Popen([sys.executable, PRODUCER, url, "orders", str(COUNT)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(2)]
    try:
        wait_for(lambda: inserted(db, "orders") >= 300, what="first pushes")
        sup.create_subscription("orders", "all", fdq.SubscriptionConfig(deliver_policy="all"))
        t_ms = int(time.time() * 1000)
        wait_for(lambda: inserted(db, "orders") >= 900, what="more pushes")
        sup.create_subscription("orders", "bytime", fdq.SubscriptionConfig(
            deliver_policy="by_start_time", start_time_ms=t_ms))
        sup.create_subscription("orders", "new", fdq.SubscriptionConfig(deliver_policy="new"))
        sup.create_subscription("orders", "last", fdq.SubscriptionConfig(deliver_policy="last"))
        # Creations happened while both producers were still pushing.
        assert all(p.poll() is None for p in procs), "producers finished too early: no live boundary"
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    pushed = set()
    for out in outs:
        pushed |= set(json.loads(out))
    assert len(pushed) == 2 * COUNT
    log = log_entries(db, "orders", 4)
    assert set(log) == pushed
    start = {s: sup.subscription("orders", s)["start_position"] for s in ("all", "bytime", "new", "last")}
    before_new = [i for i in pushed if i < start["new"]]
    assert 0 < len(before_new) < len(pushed), "the boundary must fall inside the stream"
    last_before = max(i for i in pushed if i < start["last"])
    expected = {
        "all": pushed,
        "bytime": {i for i in pushed if log[i] >= t_ms or i > start["bytime"]},
        "new": {i for i in pushed if i > start["new"]},
        "last": {last_before} | {i for i in pushed if i > start["last"]},
    }
    assert len(expected["bytime"]) < len(pushed)
    for sub, want in expected.items():
        got = [m.id for m in drain(db, "orders", sub)]
        assert len(got) == len(set(got)), f"{sub}: {len(got) - len(set(got))} duplicates"
        missing, extra = want - set(got), set(got) - want
        assert not missing and not extra, f"{sub}: {len(missing)} missing, {len(extra)} extra"
