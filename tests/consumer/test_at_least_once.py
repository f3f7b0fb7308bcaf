"""At least once: settlements (ack, nak with delay, term, in_progress, touch) are exact, also
when carried by the next lease and under fault injection.

Leasing and settling are exact when commits come back with ``commit_unknown_result``:
a retried lease batch whose first attempt committed returns that batch (not a second one,
leaving the first invisible until its ack wait), and a retried settle whose first attempt
committed does not report its own leases as lost."""
from __future__ import annotations

import collections
import time

import fdq
from fdq.errors import LeaseLost

from fdqtest import database_url, fast, fetch_until, read, sub_stats, threads_in, wait_for, with_faults


def test_acks_under_commit_unknown_result_are_exact(tmp_path):
    url = database_url(tmp_path / "f.db")
    fdq.Supervisor(fdq.connect(url)).create_topic("t", shards=2)
    fdq.Producer(fdq.connect(url)).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(300)])
    db = fdq.connect(with_faults(url, 0.3, 7))    # 1021 after ~30% of real commits
    lost, acked = [], set()
    with fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=60)) as c:
        for _ in range(200):
            msgs = c.fetch(20, timeout=0.2)
            if not msgs and len(acked) == 300:
                break
            try:
                c.ack_many(msgs)
            except LeaseLost as e:
                lost.append(str(e))
            acked.update(m.id for m in msgs)
    assert lost == []
    assert len(acked) == 300, "leased messages went missing (a retried lease took another batch)"
    st = fdq.Supervisor(fdq.connect(url)).stats("t")
    sub = st["subscriptions"]["default"]
    assert len(acked) == 300
    assert (sub["backlog"], sub["in_flight"], st["counters"]["acked"]) == (0, 0, 300)


def test_touch_during_a_database_stall_restarts_the_full_ack_wait(db, db_path):
    """The shard owner times a lease from when it first sees its current state. A
    lease check that started before a database stall (its heartbeat waiting on the
    write lock) and then read a touch committed after the stall must time the touch from
    when it read it, not from when the check started: else the lease expires early by
    the length of the stall, while its holder is working on it."""
    import sqlite3
    import threading
    import time
    fdq.Supervisor(db).create_topic("t", shards=2)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i, shard_key=f"k{i}") for i in range(20)])
    cfg = fast(heartbeat_interval_s=0.2, lease_check_interval_s=0.2, ack_wait_s=3.0)
    holder = fdq.Consumer(db, "t", consumer_id="holder", config=cfg)
    owner = None
    try:
        held = []
        wait_for(lambda: held.extend(holder.fetch(100, timeout=0.2)) or len(held) == 20, 30,
                 what="the holder leasing every message")
        owner = fdq.Consumer(db, "t", consumer_id="owner", config=cfg)
        [(_tag, n)] = owner.owned_shards
        m = next(m for m in held if m.shard == n)
        key = (("", n), m._taken.vs.to_bytes())
        wait_for(lambda: key in owner._leases, 30, what="the owner observing the lease")
        stall = sqlite3.connect(str(db_path), timeout=30)
        stall.execute("BEGIN IMMEDIATE")        # the database stalls: no commit for 2 s
        try:
            toucher = threading.Thread(target=m.in_progress)
            time.sleep(0.3)
            toucher.start()                     # the holder extends the lease: waits too
            time.sleep(1.7)
        finally:
            stall.rollback()
            stall.close()
        toucher.join(30)
        touched = time.monotonic()
        assert not toucher.is_alive()
        leased = lambda: m._taken.lease_key is not None and read(db, m._taken.lease_key, snapshot=False) is not None  # noqa: E731
        while time.monotonic() < touched + 2.0:     # 1 s short of the ack wait the touch restarted
            assert leased(), f"lease expired {time.monotonic() - touched:.2f}s after its touch (ack wait 3s)"
            time.sleep(0.05)
        m.ack()     # its siblings, untouched, expired meanwhile: they were due
    finally:
        if owner is not None:
            owner.close()
        holder.close()


def test_term_nak_delay_and_in_progress(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    for body in (b"term", b"nak", b"touched", b"untouched"):
        p.push("t", body, shard_key="k")
    with fdq.Consumer(db, "t", config=fast(ack_wait_s=1.0)) as c:
        got = {m.body: m for m in fetch_until(c, lambda g: len(g) >= 4, 10)}
        leased_at = time.monotonic()
        got[b"term"].term("bad input")
        got[b"nak"].nak(delay=1.0)
        # Keep one lease alive with in_progress for 3 × ack_wait; the other expires.
        redelivered = []
        while time.monotonic() - leased_at < 3.0:
            got[b"touched"].in_progress()
            for m in c.fetch(10, timeout=0.25):
                redelivered.append(m)
                m.ack()
        bodies = [(m.body, m.attempts) for m in redelivered]
        assert sorted(bodies) == [(b"nak", 2), (b"untouched", 2)], bodies
        assert all(b != b"touched" for b, _a in bodies), "a lease kept by in_progress expired"
        assert all(b != b"term" for b, _a in bodies), "a terminated message came back"
        got[b"touched"].ack()     # still ours: no LeaseLost
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert dead["body"] == b"term" and dead["reason"] == "terminated: bad input"
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["dlq"]) == (0, 0, 1)


def test_acks_under_fault_injection_are_not_reported_lost(db, url):
    """An ack whose commit returned commit_unknown_result but did happen is not reported
    as a lost lease when retried (and nothing is redelivered)."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(f"{i}".encode()) for i in range(200)])
    faulty = fdq.connect(with_faults(url, 0.1, 8))
    acked = 0
    with fdq.Consumer(faulty, "t", config=fast(ack_wait_s=60)) as c:
        deadline = time.monotonic() + 60
        while acked < 200 and time.monotonic() < deadline:
            for m in c.fetch(20, timeout=0.2):
                assert m.attempts == 1
                m.ack()          # raises LeaseLost if misreported
                acked += 1
    assert acked == 200
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"]) == (0, 0)


def test_tail_acks_ride_the_next_lease_and_are_flushed_when_idle(db):
    """At-least-once tail commits a batch's acks inside the next round's lease
    transaction: when the handler sees a message, the previous batch's acks are committed
    (in flight is at most one batch); when no more messages come, the last batch's acks
    are committed while the consumer keeps running (not only at shutdown)."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(95)])
    seen_in_flight, handled, errors = [], [], []

    def handler(m):
        seen_in_flight.append(sub_stats(db, "t")["in_flight"])
        handled.append(m.body)

    # No sweep within the test (poll_interval_s): only the worker's flush before it waits
    # can commit the last batch's acks in time.
    c = fdq.tail(db, "t", handler, batch_size=10, on_error=errors.append,
                 config=fast(ack_wait_s=60, poll_interval_s=60))
    try:
        wait_for(lambda: len(handled) >= 95, 60, what="every message handled")
        wait_for(lambda: sub_stats(db, "t")["in_flight"] == 0, 10, what="the last batch's acks committed")
        s = sub_stats(db, "t")
        assert (s["backlog"], s["in_flight"]) == (0, 0)
        assert c._worker.is_alive()
    finally:
        c.shutdown()
    assert sorted(handled) == sorted(b"%d" % i for i in range(95))
    assert max(seen_in_flight) <= 10, f"acks of an earlier batch were not committed: {max(seen_in_flight)}"
    assert not [e for e in errors if not isinstance(e, fdq.ConsumerStalled)], errors
    st = fdq.Supervisor(db).stats("t")
    assert st["counters"]["acked"] == 95


def test_a_tail_keeps_its_acks_for_the_next_lease_after_a_round_a_push_marked(db, monkeypatch):
    """A push while a round runs marks its shard and wakes the worker; the next round
    takes that shard. The wake goes with it: the worker, with nothing left to do, then
    waits its ack linger for the next message, whose lease commits the acks. A wake left
    set ended that wait at once and the acks committed alone, a writing commit more (at
    one message per round: 1-13% of the rounds)."""
    monkeypatch.setattr(fdq.tailing, "ACK_LINGER_S", 60.0)     # what decides it is the wake
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    handled = []

    def handler(m):
        handled.append(m.body)
        if m.body == b"1":
            p.push("t", b"2")       # during round 1: marks the shard (its watch fires)

    c = fdq.tail(db, "t", handler, config=fast(ack_wait_s=60, poll_interval_s=60))
    try:
        p.push("t", b"1")
        wait_for(lambda: handled == [b"1", b"2"] and threads_in("_work_loop", "_idle"), 30,
                 what="both handled, the worker waiting")
        counters = fdq.Supervisor(db).stats("t")["counters"]
        assert counters["acked"] == 1, "the acks of round 2 committed alone, not with a next lease"
        p.push("t", b"3")
        wait_for(lambda: fdq.Supervisor(db).stats("t")["counters"]["acked"] == 2, 30,
                 what="the ack of 2 committed with the lease of 3")
        assert handled == [b"1", b"2", b"3"]
    finally:
        c.shutdown()
    assert fdq.Supervisor(db).stats("t")["counters"]["acked"] == 3


def test_tail_carried_settlements_under_fault_injection_are_exact(db, url):
    """Acks, naks and terms carried into the next lease transaction, with injected
    faults (commit_unknown_result after a real commit included): every message is
    acked or dead-lettered exactly as the handler decided, none is reported lost, none
    is left in flight."""
    fdq.Supervisor(db).create_topic("t", shards=2)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(300)])
    faulty = fdq.connect(with_faults(url, 0.2, 11))
    attempts, lost = collections.Counter(), []

    def handler(m):
        attempts[m.body] += 1
        i = int(m.body)
        if i % 7 == 0:
            m.term("sevens")
        elif i % 5 == 0 and m.attempts == 1:
            m.nak(0)

    def on_error(e):
        if isinstance(e, fdq.LeaseLost):
            lost.append(e)

    c = fdq.tail(faulty, "t", handler, batch_size=16, on_error=on_error,
                 config=fast(ack_wait_s=60))
    try:
        wait_for(lambda: (lambda s: s["backlog"] == 0 and s["in_flight"] == 0)(sub_stats(db, "t")), 60,
                 what="everything settled")
    finally:
        c.shutdown()
    assert lost == []
    dead = {i for i in range(300) if i % 7 == 0}
    assert set(attempts) == {b"%d" % i for i in range(300)}
    for i in range(300):
        want = 2 if (i % 5 == 0 and i not in dead) else 1
        assert attempts[b"%d" % i] == want, (i, attempts[b"%d" % i])
    st = fdq.Supervisor(db).stats("t")
    assert st["counters"]["acked"] == 300 - len(dead)
    assert st["subscriptions"]["default"]["dlq"] == len(dead)
