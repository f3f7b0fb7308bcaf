"""Heartbeats: a peer's heartbeat is timed from when it was seen; ``heartbeat_age``
across version jumps, client clock skew and no consumer at all; heartbeat keys left by
a zombie declaration or without a record."""
from __future__ import annotations

import threading
import time

import fdq
from fdq.ops import subscriptions
from fdq.ops import clock, membership
from fdq.keyspace import decode_counter, Keyspace

from fdqtest import commit_retrying, engine_errors, read, read_version, scan, wait_for, with_faults


def test_a_peer_heartbeat_seen_after_a_held_up_round_is_timed_from_when_it_was_seen(db):
    """The membership loop takes ``now`` before its heartbeat and then observes its
    peers with it. A round held up in its heartbeat (an FDB recovery stalls commits for
    seconds; the peers' too) stamped a peer's heartbeat first seen after the stall with
    the time from before it: a peer that then went one heartbeat interval without
    beating again had been "unchanged" for the stall plus that interval and was
    declared a zombie while alive. The loop's steps are run by hand here, in its order,
    with the stall as a sleep."""
    fdq.Supervisor(db).create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    obs = fdq.Consumer(db, "t", consumer_id="obs", config=fdq.ConsumerConfig(heartbeat_interval_s=0.5))
    try:
        obs._stop.set()                 # its own loop stops: this test runs the rounds
        obs._member.thread.join(10)
        assert obs.config.zombie_after_s == 1.5
        membership.join(db, ts, "default", "peer", {"id": "peer", "zombie_after_s": 1.5})
        obs._member.observe_peers(time.monotonic())            # a round sees the peer
        now = time.monotonic()                          # the next round starts
        time.sleep(2.0)                                 # its heartbeat held up 2 s ...
        assert membership.heartbeat(db, ts, "default", "peer")     # ... the peer's went through
        obs._member.observe_peers(now)                         # the round observes (its `now`)
        time.sleep(0.3)                                 # one round later, the peer beat 0.3 s ago
        obs._member.observe_peers(time.monotonic())
        assert "peer" in membership.read_members(db, ts, "default")
    finally:
        obs.close()


JUMP = 90_000_000


def _read_version(db) -> int:
    return read_version(db)


def _jump(db, url: str) -> int:
    """Inject one FDB-recovery-like version jump (+100,000,000) into the database at
    ``url``: commit tiny transactions on a fault-injecting connection until one jumps.
    Returns the read version after it."""
    jumper = fdq.connect(with_faults(url, 0.5, 11))
    before = _read_version(db)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        tr = jumper.create_transaction()
        tr.options.set_max_retry_delay(50)
        try:
            tr.add(b"lt/jumper", (1).to_bytes(8, "little"))
            tr.commit().wait()
        except engine_errors() as e:
            try:
                tr.on_error(e.code).wait()
            except engine_errors():
                pass
        v = _read_version(db)
        if v - before >= JUMP:
            return v
    raise AssertionError("no version jump was injected within 30 s")


def _consumer_row(db, topic: str, cid: str) -> dict:
    [row] = [c for c in fdq.Supervisor(db).consumers(topic) if c["id"] == cid]
    return row


def _heartbeats(db, topic: str, cid: str) -> int:
    ts = Keyspace().topic(topic)
    return decode_counter(read(db, ts.heartbeat_key("default", cid)))


def _member_keys(db, ts, cid: str) -> list:
    """Consumer ``cid``'s record and heartbeat keys."""
    return [k for space in (ts.consumers["default"], ts.heartbeats["default"])
            for k, _v in scan(db, space[cid].range().start[:-1]) if space.unpack(k)[0] == cid]


def test_heartbeat_age_after_a_version_jump(db, url):
    """A live consumer whose last heartbeat was before a version jump of 100,000,000
    (~100 s of versions) shows the time since that heartbeat, not ~100 s, once the
    database clock has moved on (any live consumer moves it every lease check). It
    heartbeats every 30 s, so no heartbeat of its own lands between the jump and the
    read (asserted): by versions alone (before the fix) its age read >= 100 s."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    cfg = fdq.ConsumerConfig(heartbeat_interval_s=30, zombie_timeout_s=90, lease_check_interval_s=0.05)
    c = fdq.Consumer(db, "t", consumer_id="live", config=cfg)
    try:
        wait_for(lambda: _consumer_row(db, "t", "live")["heartbeat_age_s"] is not None, 30,
                 what="the consumer's first heartbeat")
        beats = _heartbeats(db, "t", "live")
        ck = Keyspace().topic("t").clock_key
        jumped_at = _jump(db, url)
        clock0 = clock.read_clock(db.create_transaction(), ck)
        # the clock advances after the jump: a lease check of the live consumer
        wait_for(lambda: clock.read_clock(db.create_transaction(), ck) > clock0 + 100, 30,
                 what="the database clock to advance after the jump")
        assert _read_version(db) >= jumped_at
        age = _consumer_row(db, "t", "live")["heartbeat_age_s"]
        assert _heartbeats(db, "t", "live") == beats, "a heartbeat landed: the test proves nothing"
        assert age is not None and age < 10, f"heartbeat age {age} s after a version jump"
    finally:
        c.close()


def test_heartbeat_age_under_client_clock_skew(db, monkeypatch):
    """A consumer (and the stats reader) whose time.time() is 3 hours ahead: the age
    is seconds, not hours (no wall clock is compared)."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3 * 3600)
    fdq.Supervisor(db).create_topic("t", shards=2)
    cfg = fdq.ConsumerConfig(heartbeat_interval_s=0.1, zombie_timeout_s=1.0, lease_check_interval_s=0.05)
    c = fdq.Consumer(db, "t", consumer_id="skewed", config=cfg)
    try:
        beats = _heartbeats(db, "t", "skewed")
        wait_for(lambda: _heartbeats(db, "t", "skewed") >= beats + 3, 30, what="three heartbeats")
        age = _consumer_row(db, "t", "skewed")["heartbeat_age_s"]
        assert age is not None and 0 <= age < 5, f"heartbeat age {age} s under a 3 h clock skew"
    finally:
        c.close()


def test_heartbeat_age_grows_when_no_consumer_runs(db):
    """The database clock stands still while no consumer runs: a member record whose
    consumer died (no process left to advance the clock) still ages, by versions."""
    fdq.Supervisor(db).create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    membership.join(db, ts, "default", "dead", {"id": "dead"})
    assert membership.heartbeat(db, ts, "default", "dead")
    t0 = time.monotonic()
    wait_for(lambda: (_consumer_row(db, "t", "dead")["heartbeat_age_s"] or 0) >= 1.0, 30,
             what="the dead member's heartbeat age to reach 1 s")
    assert time.monotonic() - t0 >= 0.9     # the age is not ahead of real time (no jump here)


def test_heartbeat_racing_a_zombie_declaration_leaves_no_keys(db):
    """T1 (heartbeat) reads the member's record; T2 (declare_zombie) removes the member
    and commits; T1 commits. Before the fix T1 read the record by snapshot, committed,
    and left its "hb"/"hbv" keys without a record for good. Now T1 conflicts, and its
    retry finds the member gone: no key of it remains."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    membership.join(db, ts, "default", "zombie", {"id": "zombie"})
    membership.join(db, ts, "default", "survivor", {"id": "survivor"})
    observed = membership.read_members(db, ts, "default")["zombie"]["hb"]

    t1 = db.create_transaction()
    assert membership.heartbeat(t1, ts, "default", "zombie") is True       # read, not committed
    assert membership.declare_zombie(db, ts, "default", "zombie", observed) is True
    results = []
    retries = commit_retrying(t1, lambda tr: results.append(membership.heartbeat(tr, ts, "default", "zombie")))

    assert retries == 1 and results == [False], "the heartbeat committed after the zombie declaration"
    assert _member_keys(db, ts, "zombie") == []
    assert set(membership.read_members(db, ts, "default")) == {"survivor"}


def test_one_member_declares_a_zombie(db, monkeypatch):
    """Every member times its peers' heartbeats; when one stops, all of them saw it
    stop, and each declared it (a conflicting transaction each, hundreds at once in a
    large group). The live member with the smallest id declares it; the others would
    only after twice the timeout (their observation may differ)."""
    fdq.Supervisor(db).create_topic("t", shards=4)
    ts = Keyspace().topic("t")
    calls = []
    real = subscriptions.declare_zombie

    def declare(*args, **kwargs):
        calls.append((threading.current_thread().name, args[3]))
        return real(*args, **kwargs)
    monkeypatch.setattr(subscriptions, "declare_zombie", declare)
    cfg = fdq.ConsumerConfig(heartbeat_interval_s=0.2, zombie_timeout_s=3.0, poll_interval_s=0.05)
    consumers = [fdq.Consumer(db, "t", consumer_id=cid, config=cfg) for cid in ("c", "b", "a")]
    try:
        membership.join(db, ts, "default", "z", {"incarnation": "z", "zombie_after_s": 1.0})  # never beats
        wait_for(lambda: "z" not in membership.read_members(db, ts, "default"), 60, what="z declared a zombie")
        assert calls and {name for name, cid in calls if cid == "z"} == {"fdq-member-a"}, calls
    finally:
        for c in consumers:
            c.close()


def test_a_consumer_advances_only_its_own_topics_clock(db, sup):
    """Delays are due by a clock per topic: one key for the whole database was written
    by every consumer 4 times a second (one storage team for all of them). A topic with
    no consumer keeps its clock still, and its heartbeat ages grow by versions."""
    sup.create_topic("a", shards=1)
    sup.create_topic("b", shards=1)
    ka, kb = Keyspace().topic("a").clock_key, Keyspace().topic("b").clock_key
    assert ka != kb
    c = fdq.Consumer(db, "a", config=fdq.ConsumerConfig(lease_check_interval_s=0.05))
    try:
        start = clock.read_clock(db.create_transaction(), ka)
        wait_for(lambda: clock.read_clock(db.create_transaction(), ka) > start + 200, 30,
                 what="topic a's clock to advance")
        assert clock.read_clock(db.create_transaction(), kb) == 0
    finally:
        c.close()
