"""Retention that runs by itself: the topic's consumer processes enforce it, one at a
time by the topic's maintenance role, which another takes over after the holder is
killed; its progress in ``stats()["maintenance"]``."""
from __future__ import annotations

import time

import pytest

import fdq
from fdq.keyspace import Keyspace
from fdq.ops.leaders import read_leader, take_leader

from fdqtest import engine_errors, wait_for

ARGS = ("--mode", "alo", "--hb", 0.2, "--zombie", 1.5)


def log_count(sup, name) -> int:
    c = sup.stats(name)["counters"]
    return c["inserted"] - c["trimmed"]


def holder_pid(sup, name):
    st = sup.stats(name)
    holder = st["maintenance"]["holder"]
    pids = {c["id"]: c["pid"] for c in st["subscriptions"]["default"]["consumers"]}
    return holder, pids.get(holder)


def test_consumers_keep_the_log_within_retention_by_count_while_pushing_one_holder(procs, db, sup):
    sup.create_topic("t", shards=2, retention_messages=50)
    a = procs.start("consumer", "a", *ARGS, wait_ready=True)
    b = procs.start("consumer", "b", *ARGS, wait_ready=True)
    p = fdq.Producer(db)
    holders = set()
    for i in range(20):
        p.push_many("t", [fdq.Envelope(b"m%d" % j) for j in range(20)])
        holder = sup.stats("t")["maintenance"]["holder"]
        if holder is not None:
            holders.add(holder)
    # a pass is recorded when it ends, after the step that trimmed the log
    wait_for(lambda: log_count(sup, "t") <= 50 and sup.stats("t")["maintenance"]["last_pass_by"] is not None, 30,
             what="the log trimmed to 50 entries by a recorded pass")
    st = sup.stats("t")
    holders.add(st["maintenance"]["holder"])
    assert holders <= {"a", "b"} and len(holders) == 1, f"the role changed hands with both alive: {holders}"
    assert st["counters"]["inserted"] == 400 and st["maintenance"]["trimmed"] == 350
    assert st["maintenance"]["trimmed_bytes"] > 0 and st["maintenance"]["last_pass_by"] in holders
    assert st["maintenance"]["last_pass_age_s"] is not None
    assert a.poll() is None and b.poll() is None


def test_consumers_trim_entries_older_than_retention_s(procs, db, sup):
    sup.create_topic("t", shards=2, retention_s=1.0)
    procs.start("consumer", "a", *ARGS, wait_ready=True)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % j) for j in range(100)])
    wait_for(lambda: log_count(sup, "t") == 0, 30, what="entries older than 1 s trimmed")
    assert sup.stats("t")["maintenance"]["holder"] == "a"


def test_kill9_of_the_holder_another_takes_over_within_its_timeout(procs, db, sup):
    sup.create_topic("t", shards=2, retention_messages=10)
    a = procs.start("consumer", "a", *ARGS, wait_ready=True)
    b = procs.start("consumer", "b", *ARGS, wait_ready=True)
    holder, _pid = wait_for(lambda: holder_pid(sup, "t")[0] and holder_pid(sup, "t"), 30, what="a holder")
    killed, other = (a, "b") if holder == "a" else (b, "a")
    procs.kill9(killed)
    t0 = time.monotonic()
    wait_for(lambda: sup.stats("t")["maintenance"]["holder"] == other, 15, what=f"{other} taking over")
    assert time.monotonic() - t0 < 12     # its timeout (1.5 s) and a tick, on a busy machine
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % j) for j in range(40)])
    wait_for(lambda: log_count(sup, "t") <= 10, 30, what="the new holder trimming")


def heartbeats(sup, name, cid) -> int:
    return next(c["heartbeats"] for c in sup.stats(name)["subscriptions"]["default"]["consumers"] if c["id"] == cid)


def test_a_clean_close_releases_the_role_and_maintenance_false_never_takes_it(db, sup):
    sup.create_topic("t", retention_messages=5)
    quick = dict(heartbeat_interval_s=0.2)
    off = fdq.Consumer(db, "t", consumer_id="off", config=fdq.ConsumerConfig(maintenance=False, **quick))
    try:
        on = fdq.Consumer(db, "t", consumer_id="on", config=fdq.ConsumerConfig(**quick))
        wait_for(lambda: sup.stats("t")["maintenance"]["holder"] == "on", 15, what="'on' holding the role")
        on.close()
        assert sup.stats("t")["maintenance"]["holder"] is None
        fdq.Producer(db).push_many("t", [fdq.Envelope(b"x")] * 20)
        # five heartbeats of 'off' (its maintenance would tick every 0.15 s): it never takes the role
        beats = heartbeats(sup, "t", "off")
        wait_for(lambda: heartbeats(sup, "t", "off") >= beats + 5, 15, what="five heartbeats of 'off'")
        assert sup.stats("t")["maintenance"]["holder"] is None and log_count(sup, "t") == 20
    finally:
        off.close()


def test_deleting_a_topic_clears_its_maintenance_role(db, sup, dump):
    sup.create_topic("t", retention_messages=5)
    c = fdq.Consumer(db, "t", consumer_id="c", config=fdq.ConsumerConfig(heartbeat_interval_s=0.2))
    try:
        wait_for(lambda: sup.stats("t")["maintenance"]["holder"] == "c", 15, what="'c' holding the role")
        sup.delete_topic("t")      # while it holds the role
        wait_for(lambda: not c._member.maintainer.holding, 15, what="'c' seeing the role gone")
    finally:
        c.close()
    ts = Keyspace().topic("t")
    keys = dump()
    assert not any(k in keys for k in ts.maintenance_role_keys)
    assert not [k for k in keys if k.startswith(ts.space.key())]


def test_a_take_of_the_maintenance_role_racing_the_topic_delete_retries_and_leaves_no_role(db, sup, dump):
    """A maintainer's take reads the topic's config with a conflict: a delete committed
    between its read and its commit fails it (1020), and its retry finds no topic, so
    the delete's clearing of the role is never undone by a take it did not see."""
    sup.create_topic("t")
    ks = Keyspace()
    ts = ks.topic("t")
    tr = db.create_transaction()
    seen = read_leader(tr, ks, ts.maintenance_role)
    assert take_leader(tr, ks, ts.maintenance_role, "m", 5.0, seen, requires=ts.config_key)
    sup.delete_topic("t")
    with pytest.raises(engine_errors()) as e:
        tr.commit().wait()
    assert e.value.code == 1020
    assert not take_leader(db, ks, ts.maintenance_role, "m", 5.0, seen, requires=ts.config_key)
    keys = dump()
    assert not any(k in keys for k in ts.maintenance_role_keys)


def test_fdq_maintenance_maintains_every_topic_one_process_at_a_time(db, sup):
    """``fdq.Maintenance`` (what a service running no consumer uses, the broker): each
    topic held by one of two instances, trimmed; a topic created later is picked up;
    a clean close hands its topics to the other at once."""
    sup.create_topic("a", retention_messages=5)
    p = fdq.Producer(db)
    with fdq.Maintenance(db, name="m1", lease_s=1.0) as m1, fdq.Maintenance(db, name="m2", lease_s=1.0) as m2:
        m1.REFRESH_S = m2.REFRESH_S = 0.2
        sup.create_topic("b", retention_messages=5)
        for name in ("a", "b"):
            p.push_many(name, [fdq.Envelope(b"x")] * 20)
        for name in ("a", "b"):
            wait_for(lambda: log_count(sup, name) <= 5, 30, what=f"topic {name} trimmed")
        held = {n: sup.stats(n)["maintenance"]["holder"] for n in ("a", "b")}
        assert set(held.values()) <= {"m1", "m2"} and None not in held.values()
        first = held["a"]
        (m1 if first == "m1" else m2).close()
        other = "m2" if first == "m1" else "m1"
        wait_for(lambda: sup.stats("a")["maintenance"]["holder"] == other, 15, what=f"{other} taking topic a")
        p.push_many("a", [fdq.Envelope(b"y")] * 20)
        wait_for(lambda: log_count(sup, "a") <= 5, 30, what="topic a trimmed by the other")
