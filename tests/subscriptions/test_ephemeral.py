"""Ephemeral subscriptions: deleted when the LAST consumer leaves or becomes a zombie,
never when the first of two leaves (JetStream ADR-15's drain problem)."""
import signal
import subprocess
import sys
import time

import pytest

import fdq
from fdq.keyspace import decode_counter

from fdqtest import fast, wait_for
from workers.common import seen_key


# The subscription tests' consumer: FAST with slower polls and lease checks.
SUBS_FAST = fast(lease_check_interval_s=0.2, poll_interval_s=0.1)


def seen_all(db, sub, ids):
    tr = db.create_transaction()
    fs = [tr.snapshot[seen_key(sub, i)] for i in ids]
    ok = all(decode_counter(f) >= 1 for f in fs)
    tr.cancel()
    return ok


def push(db, n, tag):
    return [r.id for r in fdq.Producer(db).push_many(
        "events", [fdq.Envelope(f"{tag}{i}".encode(), shard_key=f"k{i}") for i in range(n)])]


def sub_keys(db, sup, sub):
    """Keys of the subscription's state (queues, consumers, shard records, record)."""
    ts = sup.keyspace.topic("events")
    tr = db.create_transaction()
    n = 0
    for space in (ts.subs[sub], ts.consumers[sub], ts.heartbeats[sub], ts.shard_records[sub], ts.sub_records[sub]):
        r = space.range()
        n += len(list(tr.snapshot.get_range(r.start, r.stop)))
    n += 0 if tr.snapshot[ts.sub_records.pack((sub,))] == None else 1  # noqa: E711
    tr.cancel()
    return n


@pytest.mark.slow
def test_ephemeral_lifecycle_two_members(db, url, workers):
    sup = fdq.Supervisor(db)
    sup.create_topic("events", shards=4)
    sub = "watch#ephemeral"
    sup.create_subscription("events", sub, fdq.SubscriptionConfig(deliver_policy="new"))
    a = workers.start("subs-consumer", "a", "--topic", "events", "--sub", sub, "--mode", "acking", wait_ready=True)
    b = workers.start("subs-consumer", "b", "--topic", "events", "--sub", sub, "--mode", "acking", wait_ready=True)
    ids = push(db, 40, "x")
    wait_for(lambda: seen_all(db, sub, ids), what="both members consuming")
    workers.term(a)                        # the first member leaves: nothing is deleted
    assert sub in sup.config("events").subs
    ids = push(db, 40, "y")
    wait_for(lambda: seen_all(db, sub, ids), what="the second member receiving everything")
    assert sub in sup.config("events").subs
    workers.term(b)                        # the last member leaves: deleted with it
    assert sub not in sup.config("events").subs
    assert sub_keys(db, sup, sub) == 0
    assert sup.stats("events")["subscriptions"].keys() == {"default"}


@pytest.mark.slow
def test_ephemeral_deleted_after_kill9_of_last_member(db, url, workers):
    sup = fdq.Supervisor(db)
    sup.create_topic("events", shards=4)
    sub = "tmp"
    sup.create_subscription("events", sub, ephemeral=True)
    a = workers.start("subs-consumer", "a", "--topic", "events", "--sub", sub, "--mode", "acking", wait_ready=True)
    b = workers.start("subs-consumer", "b", "--topic", "events", "--sub", sub, "--mode", "acking", wait_ready=True)
    ids = push(db, 30, "x")
    wait_for(lambda: seen_all(db, sub, ids), what="members consuming")
    workers.kill9(a)     # b declares a a zombie; the subscription stays and b takes over
    wait_for(lambda: len(sup.stats("events")["subscriptions"][sub]["consumers"]) == 1, timeout=30,
             what="a declared a zombie")
    assert sub in sup.config("events").subs
    ids = push(db, 30, "y")
    wait_for(lambda: seen_all(db, sub, ids), what="b receiving after a's death")
    # The last member dies: a consumer of another subscription of the topic notices.
    observer = fdq.tail(db, "events", lambda m: None, config=SUBS_FAST)
    try:
        workers.kill9(b)
        t0 = time.monotonic()
        wait_for(lambda: sub not in sup.config("events").subs, timeout=30, what="ephemeral reaped")
        assert time.monotonic() - t0 >= 1.0, "deleted before the zombie timeout"
    finally:
        observer.shutdown()
    assert sub_keys(db, sup, sub) == 0


def test_ephemeral_in_process_and_supervisor_reap(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("events", shards=2)
    cfg = SUBS_FAST
    c1 = fdq.Consumer(db, "events", subscription="e#ephemeral", subscription_config=fdq.SubscriptionConfig(
        deliver_policy="new"), config=cfg)
    c2 = fdq.Consumer(db, "events", subscription="e#ephemeral", config=cfg)
    assert sup.subscription("events", "e#ephemeral")["ephemeral"]
    c1.close()
    assert "e#ephemeral" in sup.config("events").subs
    push(db, 5, "z")
    got = []
    wait_for(lambda: got.extend(c2.fetch(10, timeout=0.1)) or len(got) == 5, what="c2 receives")
    c2.ack_many(got)
    c2.close()
    assert "e#ephemeral" not in sup.config("events").subs
    # A member that stops heartbeating (its threads stopped, record left behind, as after
    # kill -9) is reaped by Supervisor.reap after the zombie timeout.
    c3 = fdq.Consumer(db, "events", subscription="r", ephemeral=True, config=cfg)
    c3._stop.set()
    c3._member.thread.join(timeout=10)
    assert "r" in sup.config("events").subs
    assert sup.reap("events", zombie_after_s=1.0) == {"zombies": [{"subscription": "r", "id": c3.id}],
                                                      "deleted_subscriptions": ["r"]}
    assert "r" not in sup.config("events").subs
    # A durable subscription is never reaped (its zombie is declared one).
    c4 = fdq.Consumer(db, "events", subscription="durable", config=cfg)
    c4._stop.set()
    c4._member.thread.join(timeout=10)
    assert sup.reap("events", zombie_after_s=1.0) == {"zombies": [{"subscription": "durable", "id": c4.id}],
                                                      "deleted_subscriptions": []}
    assert "durable" in sup.config("events").subs


_DIE_AT_JOIN = """
import os, signal, sys
import fdq
import fdq.ops.membership


def die(*args, **kwargs):          # the process is killed where it joins the subscription
    os.kill(os.getpid(), signal.SIGKILL)

fdq.ops.membership.join = die
db = fdq.connect(sys.argv[1])
fdq.Consumer(db, "events", subscription=sys.argv[2], config=fdq.ConsumerConfig(heartbeat_interval_s=0.2,
             zombie_timeout_s=1.5), subscription_config=fdq.SubscriptionConfig(deliver_policy=sys.argv[3]))
"""


@pytest.mark.parametrize("policy", ["new", "all"])
def test_ephemeral_creator_killed_before_joining_leaves_nothing(db, url, tmp_path, policy):
    """A consumer creating an ephemeral subscription and killed before it joined must not
    leave a subscription without members: no reaper would ever delete it (they look for
    zombie members), and every push would fan out to it forever."""
    sup = fdq.Supervisor(db)
    sup.create_topic("events", shards=2)
    push(db, 5, "before")
    sub = "gone#ephemeral"
    script = tmp_path / "die_at_join.py"
    script.write_text(_DIE_AT_JOIN)
    proc = subprocess.run([sys.executable, str(script), url, sub, policy], timeout=60, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert sub not in sup.config("events").subs
    assert sub_keys(db, sup, sub) == 0
    push(db, 5, "after")    # pushes fan out to the default subscription only
    assert set(sup.stats("events")["subscriptions"]) == {"default"}


def test_ephemeral_long_catch_up_is_not_reaped(db, monkeypatch):
    """The creator of an ephemeral subscription joins before it copies the backlog (its
    catch-up) and heartbeats meanwhile: a catch-up longer than the zombie timeout does
    not get the subscription reaped under it by another consumer of the topic."""
    from fdq.ops import catchup as subs
    sup = fdq.Supervisor(db)
    sup.create_topic("events", shards=2)
    ids = push(db, 40, "x")
    cfg = fdq.ConsumerConfig(heartbeat_interval_s=0.1, zombie_timeout_s=0.5, lease_check_interval_s=0.1,
                             poll_interval_s=0.1)
    observer = fdq.tail(db, "events", lambda m: None, config=cfg)    # runs a reaper
    chunk = subs.catch_up_chunk
    monkeypatch.setattr(subs, "CHUNK", 5)
    calls = []

    def slow_chunk(*args, **kwargs):     # 8+ chunks, ~1.6 s: 3 zombie timeouts
        calls.append(1)
        time.sleep(0.2)
        return chunk(*args, **kwargs)
    monkeypatch.setattr(subs, "catch_up_chunk", slow_chunk)
    monkeypatch.setattr(fdq.member, "CHUNK", 5)     # the member loop's catch-up help
    try:
        c = fdq.Consumer(db, "events", subscription="slow#ephemeral", config=cfg)
        assert len(calls) >= 8
        assert "slow#ephemeral" in sup.config("events").subs
        got = []
        wait_for(lambda: got.extend(c.fetch(50, timeout=0.1)) or len(got) >= len(ids), what="the backlog")
        assert sorted(m.id for m in got) == sorted(ids)
        c.ack_many(got)
        c.close()
        assert "slow#ephemeral" not in sup.config("events").subs
    finally:
        observer.shutdown()


@pytest.mark.slow
def test_reaped_after_recreated_ephemeral_under_a_durable_name(db, url, workers):
    """A consumer's reaper must not keep what it first saw of a subscription name: a
    durable subscription deleted and created again as ephemeral (same name) is deleted
    once its last member is killed."""
    sup = fdq.Supervisor(db)
    sup.create_topic("events", shards=2)
    observer = fdq.tail(db, "events", lambda m: None, config=SUBS_FAST)
    try:
        sup.create_subscription("events", "tmp")            # durable, seen by the observer
        def beats():
            return sup.stats("events")["subscriptions"]["default"]["consumers"][0]["heartbeats"]
        hb = beats()
        # two heartbeats of the observer: one full round after "tmp" was created looked at it
        wait_for(lambda: beats() >= hb + 2, timeout=30, what="the observer's heartbeats")
        sup.delete_subscription("events", "tmp")
        sup.create_subscription("events", "tmp", ephemeral=True)
        a = workers.start("subs-consumer", "a", "--topic", "events", "--sub", "tmp", "--mode", "acking", wait_ready=True)
        workers.kill9(a)
        wait_for(lambda: "tmp" not in sup.config("events").subs, timeout=30, what="ephemeral reaped")
    finally:
        observer.shutdown()
