"""Leftovers of earlier reviews, each with the test that failed before its fix:
stats' heartbeat age across version jumps and clock skew, a heartbeat racing a zombie
declaration, replay chunks sized by the subscriptions of the moment."""
from __future__ import annotations

import time

import fdq
from fdq import membership
from fdq.keyspace import Keyspace, decode_counter

from qhelpers import scan, wait_for

JUMP = 90_000_000


def _read_version(db) -> int:
    return db.create_transaction().get_read_version().wait()


def _jump(db, url: str) -> int:
    """Inject one FDB-recovery-like version jump (+100,000,000) into the database at
    ``url``: commit tiny transactions on a fault-injecting connection until one jumps.
    Returns the read version after it."""
    jumper = fdq.connect(f"{url}?fault_injection=0.5&seed=11")
    before = _read_version(db)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        tr = jumper.create_transaction()
        tr.options.set_max_retry_delay(50)
        try:
            tr.add(b"lt/jumper", (1).to_bytes(8, "little"))
            tr.commit().wait()
        except fdq.EngineError as e:
            try:
                tr.on_error(e.code).wait()
            except fdq.EngineError:
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
    return decode_counter(db.create_transaction().snapshot[ts.heartbeat_key("default", cid)])


# -- 1. heartbeat age: honest after a version jump and under clock skew -------------------

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
        ck = Keyspace().clock_key
        jumped_at = _jump(db, url)
        clock0 = membership.read_clock(db.create_transaction(), ck)
        # the clock advances after the jump: a lease check of the live consumer
        wait_for(lambda: membership.read_clock(db.create_transaction(), ck) > clock0 + 100, 30,
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
    config = fdq.Supervisor(db).config("t")
    membership.join(db, ts, "default", "dead", {"id": "dead"}, config)
    assert membership.heartbeat(db, ts, "default", "dead")
    t0 = time.monotonic()
    wait_for(lambda: (_consumer_row(db, "t", "dead")["heartbeat_age_s"] or 0) >= 1.0, 30,
             what="the dead member's heartbeat age to reach 1 s")
    assert time.monotonic() - t0 >= 0.9     # the age is not ahead of real time (no jump here)
