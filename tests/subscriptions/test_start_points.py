"""Subscriptions created while producer processes keep pushing receive exactly the
right set for their deliver policy: no gap and no duplicate at the catch-up boundary."""
from __future__ import annotations

import json
import time
from functools import partial

import pytest

import fdq
from fdq.log import iter_window

import fdqtest
from fdqtest import advance_clock, fast, fetch_ids, kill_all, sub_stats, wait_for


# The subscription tests' consumer: FAST with slower polls and lease checks.
SUBS_FAST = fast(lease_check_interval_s=0.2, poll_interval_s=0.1)
# Everything a subscription delivers until it stays empty for idle_s (acked, unless settle=None).
drain = partial(fdqtest.drain, idle_s=1.0, batch=500, settle="ack_many", create=False, config=SUBS_FAST)

COUNT = 1500


def inserted(db, topic):
    return fdq.Supervisor(db).stats(topic)["counters"]["inserted"]


def log_entries(db, topic, shards):
    """{id: insertion ms} of the whole "all" log (the reference, read independently)."""
    ts = fdq.Supervisor(db).keyspace.topic(topic)
    return {vs.to_bytes().hex(): rec.ts_ms for vs, _b, rec in iter_window(db, ts, shards, None, None)}


@pytest.mark.slow
def test_late_subscriptions_get_exactly_their_start_point(db, url, procs):
    sup = fdq.Supervisor(db)
    sup.create_topic("orders", shards=4)
    producers = [procs.start("push-ids", f"p{i}", "--topic", "orders", "--count", COUNT) for i in range(2)]
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
        assert all(p.poll() is None for p in producers), "producers finished too early: no live boundary"
        outs = [p.communicate(timeout=120)[0] for p in producers]
    finally:
        kill_all(producers)
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


def test_a_new_subscription_gets_a_delayed_message_at_its_due_time(db):
    """Catch-up copied a delayed message, not due yet, into the new subscription's ready
    queue: delivered at once, 10 minutes early (the log entry had no due time)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    late = p.push("t", b"later", shard_key="a", delay=600).id
    due_soon = p.push("t", b"soon", shard_key="b", delay=1).id
    now = p.push("t", b"now", shard_key="c").id
    advance_clock(db, 2000)        # "soon" is due by now, "later" is not
    sup.create_subscription("t", "new", fdq.SubscriptionConfig(deliver_policy="all"))
    st = sub_stats(db, "t", "new")
    assert (st["backlog"], st["delayed"]) == (3, 1)
    assert sorted(fetch_ids(db, "t", "new")) == sorted([due_soon, now])
    assert sub_stats(db, "t", "new")["delayed"] == 1
    advance_clock(db, 600_000)
    assert fetch_ids(db, "t", "new") == [late]


def test_a_topics_first_subscription_starts_where_the_topic_does(db):
    """A topic's ``default`` subscription gets its record (config, start boundary) with the
    topic, whether created or auto-created by a push: its start is the topic's creation."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    first = fdq.Producer(db).push("u", b"auto-created").id     # the push creates "u"
    for topic in ("t", "u"):
        info = sup.subscription(topic, "default")
        assert info["config"] == fdq.SubscriptionConfig() and not info["catching_up"]
        assert len(info["start_position"]) == 24
    assert sup.subscription("u", "default")["start_position"][:20] == first[:20]   # the same commit
    assert [m.body for m in drain(db, "u")] == [b"auto-created"]
