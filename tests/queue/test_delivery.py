"""Delivery details and producer limits, in one process: delayed messages don't block
ready ones, DLQ after max_deliver, term, nak delay, in_progress extending a lease, the
dedupe window, max_backlog, auto-batching from 8 threads, large bodies, bad input."""
from __future__ import annotations

import collections
import os
import threading
import time

import pytest

import fdq
from fdq.keyspace import Keyspace, parse_message_id
from fdq.keyspace.codec import CHUNK_BYTES

from fdqtest import FAST, fast, read, scan, sub_stats, wait_for, with_faults



def _fetch_until(c, cond, timeout=30):
    """Fetch repeatedly (bounded) until ``cond(all fetched so far)``; returns them."""
    got = []
    deadline = time.monotonic() + timeout
    while not cond(got):
        assert time.monotonic() < deadline, f"timed out; fetched {[(m.body, m.attempts) for m in got]}"
        got += c.fetch(100, timeout=0.2)
    return got


def test_delayed_message_does_not_block_ready_ones(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    t0 = time.monotonic()
    p.push("t", b"later", shard_key="k", delay=3.0)
    for i in range(5):
        p.push("t", f"now{i}".encode(), shard_key="k")
    with fdq.Consumer(db, "t", config=FAST) as c:
        first = _fetch_until(c, lambda g: len(g) >= 5, 10)
        assert [m.body for m in first] == [f"now{i}".encode() for i in range(5)]
        assert time.monotonic() - t0 < 3.0, "ready messages waited for the delayed one"
        for m in first:
            m.ack()
        later = _fetch_until(c, lambda g: g, 30)
        assert [m.body for m in later] == [b"later"]
        assert time.monotonic() - t0 >= 2.9, "delivered before its delay"
        later[0].ack()
    # It keeps its place in the "all" log: first.
    log = scan(db, Keyspace().topic("t").log.key())
    assert b"later" in bytes(log[0][1]) and len(log) == 6


def test_dead_letter_after_max_deliver(db):
    fdq.Supervisor(db).create_topic("t", shards=2)
    fdq.Producer(db).push("t", b"poison", shard_key="k")
    calls = []

    def handler(m):
        calls.append(m.attempts)
        raise RuntimeError("cannot handle")
    c = fdq.tail(db, "t", handler, config=fast(max_deliver=3), on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(db, "t")["dlq"] == 1, 30, what="the message dead-lettered")
        time.sleep(0.3)
    finally:
        c.shutdown()
    assert calls == [1, 2, 3]
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert dead["body"] == b"poison" and "max_deliver (3)" in dead["reason"] and dead["attempts"] == 3
    s = sub_stats(db, "t")
    assert s["backlog"] == 0 and s["in_flight"] == 0


def test_term_nak_delay_and_in_progress(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    for body in (b"term", b"nak", b"touched", b"untouched"):
        p.push("t", body, shard_key="k")
    with fdq.Consumer(db, "t", config=fast(ack_wait_s=1.0)) as c:
        got = {m.body: m for m in _fetch_until(c, lambda g: len(g) >= 4, 10)}
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


def test_nak_delay_is_respected(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push("t", b"x")
    with fdq.Consumer(db, "t", config=FAST) as c:
        [m] = _fetch_until(c, lambda g: g, 10)
        t0 = time.monotonic()
        m.nak(delay=1.2)
        [m2] = _fetch_until(c, lambda g: g, 30)
        assert time.monotonic() - t0 >= 1.1 and m2.attempts == 2 and m2.id == m.id
        m2.ack()


def test_dedupe_window(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, dedupe_window_s=1.0)
    p = fdq.Producer(db)
    r1 = p.push("t", b"a", msg_id="order-1")
    r2 = p.push("t", b"a again", msg_id="order-1")
    assert r2.duplicate and r2.id == r1.id and not r1.duplicate
    rs = p.push_many("t", [fdq.Envelope(b"b", msg_id="order-2"), fdq.Envelope(b"b", msg_id="order-2")])
    assert not rs[0].duplicate and rs[1].duplicate and rs[1].id == rs[0].id
    assert sup.stats("t")["counters"]["inserted"] == 2
    time.sleep(1.2)    # past the window: the id is new again
    r3 = p.push("t", b"a later", msg_id="order-1")
    assert not r3.duplicate and r3.id != r1.id
    assert sup.stats("t")["counters"]["inserted"] == 3
    ts = Keyspace().topic("t")
    assert len(scan(db, ts.dedupe.key())) == 2
    sup.trim("t")      # order-1's first entry expired, but the id was pushed again since:
    r4 = p.push("t", b"a again", msg_id="order-1")    # its new entry must survive the trim
    assert r4.duplicate and r4.id == r3.id
    time.sleep(1.2)
    sup.trim("t")      # expired dedupe entries are cleaned
    assert scan(db, ts.dedupe.key()) == [] and scan(db, ts.dedupe_by_version.key()) == []


def test_max_backlog_refuses_whole_pushes(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, max_backlog=10)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(f"{i}".encode()) for i in range(10)])
    with pytest.raises(fdq.BacklogFull, match="max_backlog"):
        p.push("t", b"one too many")
    with pytest.raises(fdq.BacklogFull):
        p.push_many("t", [fdq.Envelope(b"x"), fdq.Envelope(b"y")])
    ts = Keyspace().topic("t")
    assert sup.stats("t")["counters"]["inserted"] == 10
    assert len(scan(db, ts.log.key())) == 10 and sub_stats(db, "t")["backlog"] == 10
    with fdq.Consumer(db, "t", config=FAST) as c:
        got = _fetch_until(c, lambda g: len(g) >= 4, 10)
        for m in got[:4]:
            m.ack()
        for m in got[4:]:
            m.nak(0)
    p.push_many("t", [fdq.Envelope(f"more{i}".encode()) for i in range(4)])
    with pytest.raises(fdq.BacklogFull):
        p.push("t", b"full again")
    assert sup.stats("t")["counters"]["inserted"] == 14


def test_auto_batching_from_8_threads(db):
    fdq.Supervisor(db).create_topic("t", shards=4)
    p = fdq.Producer(db)
    ts = Keyspace().topic("t")
    per_thread, threads = 150, 8
    ids, errors = [], []
    start = threading.Barrier(threads)

    def run(t):
        start.wait(30)
        try:
            for i in range(per_thread):
                r = p.push("t", f"{t}:{i}".encode(), shard_key=f"k{t}")
                # The call returns after its commit: a new transaction sees the message.
                raw = read(db, ts.log_key(r.shard, parse_message_id(r.id)))
                if raw == None:  # noqa: E711
                    errors.append(f"{r.id} not committed when push returned")
                ids.append(r.id)
        except Exception as e:
            errors.append(repr(e))
    ths = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    assert not errors, errors[:3]
    total = per_thread * threads
    assert len(set(ids)) == total
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == total
    transactions = len(scan(db, ts.marks_by_version.key()))   # one marker per push transaction
    print(f"\nauto-batching: {total} pushes from {threads} threads in {transactions} transactions")
    assert transactions < total


def test_a_cancelled_push_async_future_does_not_strand_the_other_pushes_of_its_commit(db):
    # concurrent.futures lets its owner cancel a pending future; the group commit must
    # still release every other push of that commit (a caller of push() returns), and
    # the cancelled push is stored all the same (a cancel cannot recall it).
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=500))
    f = p.push_async("t", b"async")            # the flusher lingers 500 ms, then commits
    assert f.cancel()
    result = []
    t = threading.Thread(target=lambda: result.append(p.push("t", b"sync")), daemon=True)
    t.start()
    t.join(30)
    assert result and result[0].id, "push() never returned"
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 2


def test_large_bodies_split_and_reassembled(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    bodies = [os.urandom(CHUNK_BYTES + 1), os.urandom(250_000), os.urandom(1 << 20)]
    for b in bodies:
        p.push("t", b, shard_key="big")
    with pytest.raises(fdq.MessageTooLarge, match="max_message_bytes"):
        p.push("t", os.urandom((1 << 20) + 1), shard_key="big")
    sup.create_topic("small", shards=1, max_message_bytes=200_000)
    with pytest.raises(fdq.MessageTooLarge):
        p.push("small", os.urandom(200_001))
    assert sup.stats("t")["counters"]["inserted"] == 3
    assert sup.stats("small")["counters"]["inserted"] == 0
    with fdq.Consumer(db, "t", config=FAST) as c:
        got = _fetch_until(c, lambda g: len(g) >= 3, 30)
        assert [m.body for m in got] == bodies
        for m in got:
            m.ack()
    ts = Keyspace().topic("t")
    assert scan(db, ts.subs["default"]["chunks"].key()) == []   # acked: chunks removed
    # The "all" log keeps the full bodies for replay.
    assert p.replay("t", 0) == 3


def test_large_dead_letter_listed_whole_and_redriven(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    big = os.urandom(3 * CHUNK_BYTES + 7)
    fdq.Producer(db).push("t", big, shard_key="big")
    with fdq.Consumer(db, "t", config=FAST) as c:
        [m] = _fetch_until(c, lambda g: len(g) >= 1, 30)
        m.term("too big to handle")
    [dead] = sup.dlq_list("t")
    assert dead["body"] == big and dead["reason"] == "terminated: too big to handle"
    assert sup.dlq_redrive("t") == 1
    with fdq.Consumer(db, "t", config=FAST) as c:
        [m] = _fetch_until(c, lambda g: len(g) >= 1, 30)
        assert m.body == big
        m.ack()
    assert scan(db, Keyspace().topic("t").subs["default"]["chunks"].key()) == []


def test_dlq_of_an_unknown_subscription_is_an_error(db):
    """A misspelt subscription is named in an error (it returned 0 / [] as if its DLQ
    were empty, so a redrive or purge 'succeeded' doing nothing)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    for call in (sup.dlq_list, sup.dlq_redrive, sup.dlq_purge):
        with pytest.raises(fdq.SubscriptionNotFound, match="nope"):
            call("t", "nope")
    assert sup.dlq_list("t") == [] and sup.dlq_redrive("t") == 0 and sup.dlq_purge("t") == 0


def test_max_backlog_holds_while_paused(db):
    """A push while paused only lands in the log (routed later by play): it counts
    toward every subscription's backlog all the same, else a paused topic took pushes
    without bound and play then routed far past max_backlog."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, max_backlog=10)
    sup.create_subscription("t", "other")
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(f"{i}".encode()) for i in range(6)])
    sup.pause("t")
    p.push_many("t", [fdq.Envelope(f"p{i}".encode()) for i in range(4)])
    with pytest.raises(fdq.BacklogFull, match="max_backlog"):
        p.push("t", b"one too many")
    assert sup.stats("t")["counters"]["inserted"] == 10
    sup.play("t")
    with pytest.raises(fdq.BacklogFull):
        p.push("t", b"still full")
    subs = sup.stats("t")["subscriptions"]
    assert subs["default"]["backlog"] == subs["other"]["backlog"] == 10


def test_dlq_purge_removes_large_bodies_chunks(db):
    """A purged dead letter of a large body leaves nothing behind: its chunks (kept in
    the subscription's chunk area with the DLQ entry) go with it; other chunks stay."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    big, kept = os.urandom(2 * CHUNK_BYTES + 1), os.urandom(CHUNK_BYTES + 9)
    p = fdq.Producer(db)
    p.push("t", big, shard_key="k")
    with fdq.Consumer(db, "t", config=FAST) as c:
        [m] = _fetch_until(c, lambda g: len(g) >= 1, 30)
        m.term("purge me")
    p.push("t", kept, shard_key="k")         # queued: its chunks must survive the purge
    chunks = Keyspace().topic("t").subs["default"]["chunks"]
    assert len(scan(db, chunks.key())) == 3 + 2
    assert sup.dlq_purge("t") == 1
    assert sup.dlq_list("t") == [] and len(scan(db, chunks.key())) == 2
    with fdq.Consumer(db, "t", config=FAST) as c:
        [m] = _fetch_until(c, lambda g: len(g) >= 1, 30)
        assert m.body == kept
        m.ack()
    assert scan(db, chunks.key()) == []


def test_records_at_the_value_limit_lease_and_dead_letter(db):
    """A body that fits one value alone but not with its headers and a long shard key is
    chunked; leased and then dead-lettered with a 200,000-character reason (cut), it stays
    whole (before: a lease or dead letter over FDB's value limit failed every attempt)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1, extend=True)
    key = "k" * 1024
    headers = {f"h{i}": "v" * 1000 for i in range(8)}
    bodies = [os.urandom(CHUNK_BYTES), os.urandom(CHUNK_BYTES - 100), b"small"]
    p = fdq.Producer(db)
    for b in bodies:
        p.push("t", b, shard_key=key, headers=headers)
    p.push("t", os.urandom(CHUNK_BYTES), shard_key=key)      # no headers: fits inline
    with fdq.Consumer(db, "t", config=FAST, extend_support=True) as c:
        got = _fetch_until(c, lambda g: len(g) >= 4, 30)
        assert [m.body for m in got[:3]] == bodies and dict(got[0].headers) == headers
        for m in got:
            m.term("r" * 200_000)
    dead = sup.dlq_list("t")
    assert [d["body"] for d in dead[:3]] == bodies and len(dead) == 4
    assert all(len(d["reason"]) == 1000 and d["reason"].startswith("terminated: rrr") for d in dead)
    assert sup.dlq_redrive("t") == 4
    with fdq.Consumer(db, "t", config=FAST, extend_support=True) as c:
        again = _fetch_until(c, lambda g: len(g) >= 4, 30)
        assert [m.body for m in again] == [m.body for m in got]
        c.ack_many(again)
    assert sub_stats(db, "t")["backlog"] == 0


def test_exactly_once_large_body(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    body = os.urandom(300_000)
    fdq.Producer(db).push("t", body)
    got = []
    c = fdq.tail(db, "t", lambda tr, m: got.append(m.body), transactional=True, config=FAST)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 30, what="consumed")
    finally:
        c.shutdown()
    assert got[-1] == body


def test_bad_input_is_refused_clearly_and_harms_nothing(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    stored = [f"m{i}".encode() for i in range(20)]
    p.push_many("t", [fdq.Envelope(b, shard_key="k") for b in stored])

    for name in ("bad name", "", "a" * 65, "x/y", "t#other", "ü", None, 42):
        with pytest.raises(fdq.InvalidName, match="invalid topic name"):
            p.push(name, b"x")
        with pytest.raises(fdq.InvalidName):
            sup.create_topic(name)
        with pytest.raises(fdq.InvalidName):
            fdq.tail(db, name, lambda m: None)
    with pytest.raises(fdq.InvalidName):
        fdq.Consumer(db, "t", subscription="no such/sub")
    for body in ("text", 42, None, {"a": 1}, [b"x"]):
        with pytest.raises(fdq.InvalidMessage, match="body must be bytes"):
            p.push("t", body)
        with pytest.raises(fdq.InvalidMessage):
            p.push_many("t", [fdq.Envelope(b"ok"), fdq.Envelope(body)])
    with pytest.raises(fdq.InvalidMessage, match="shard_key"):
        p.push("t", b"x", shard_key=5)
    with pytest.raises(fdq.InvalidMessage, match="shard_key of 1,025 bytes"):
        p.push("t", b"x", shard_key="k" * 1025)
    with pytest.raises(fdq.InvalidMessage, match="shard_key of 200,001 bytes"):
        p.push_many("t", [fdq.Envelope(b"ok"), fdq.Envelope(b"x", shard_key="é" * 100_000 + "k")])
    for cid in ("", "x" * 129, "a\nb", 7):
        with pytest.raises(fdq.ConfigError, match="consumer_id"):
            fdq.Consumer(db, "t", consumer_id=cid)
    with pytest.raises(fdq.InvalidMessage, match="delay"):
        p.push("t", b"x", delay=-1)
    with pytest.raises(fdq.MessageTooLarge):
        p.push_many("t", [fdq.Envelope(b"fine"), fdq.Envelope(b"x" * ((1 << 20) + 1))])
    with pytest.raises(fdq.TopicNotFound, match="nope"):
        sup.stats("nope")
    with pytest.raises(fdq.TopicNotFound):
        fdq.Consumer(db, "nope", create=False)
    with pytest.raises(fdq.ConfigError):
        fdq.tail(db, "t", lambda tr, m: None, transactional=True, acking=True)
    for e in (fdq.InvalidName, fdq.InvalidMessage, fdq.MessageTooLarge, fdq.TopicNotFound, fdq.BacklogFull):
        assert issubclass(e, fdq.FDQError)

    # Nothing already stored was harmed, nothing half-written, no stray topic.
    assert [n for n, _c in sup.topics()] == ["t"]
    assert sup.stats("t")["counters"]["inserted"] == 20
    with fdq.Consumer(db, "t", config=FAST) as c:
        got = _fetch_until(c, lambda g: len(g) >= 20, 10)
        assert [m.body for m in got] == stored
        for m in got:
            m.ack()


def test_exactly_once_handler_errors_and_oversized_effects_go_to_dlq(db):
    """Exactly-once: a handler that always raises is dead-lettered after max_deliver; a
    handler whose writes cannot fit in one transaction (2101) is dead-lettered with that
    reason instead of retrying forever; the other messages are processed exactly once."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    p.push("t", b"raises", shard_key="k")
    p.push("t", b"too-big", shard_key="k")
    for i in range(5):
        p.push("t", f"ok{i}".encode(), shard_key="k")

    def handler(tr, m):
        if m.body == b"raises":
            raise ValueError("bad message")
        if m.body == b"too-big":
            for i in range(110):                 # ~11 MB of writes: over the 10 MB limit
                tr[b"qt/big/%d" % i] = b"x" * 99_000
            return
        tr.add(b"qt/ok/" + m.body, (1).to_bytes(8, "little"))
    c = fdq.tail(db, "t", handler, transactional=True, batch_size=10,
                 config=fast(max_deliver=2), on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 60, what="the queue emptied")
    finally:
        c.shutdown()
    dead = {d["body"]: d["reason"] for d in fdq.Supervisor(db).dlq_list("t")}
    assert set(dead) == {b"raises", b"too-big"}
    assert "ValueError" in dead[b"raises"]
    assert "transaction_too_large" in dead[b"too-big"]
    ok = {k: int.from_bytes(bytes(v)[:8], "little") for k, v in scan(db, b"qt/ok/")}
    assert ok == {b"qt/ok/ok%d" % i: 1 for i in range(5)}
    assert scan(db, b"qt/big/") == []


def test_shutdown_releases_shards_at_once(db):
    """shutdown() hands the shards to the others now, not after the zombie timeout, and
    returns what it leased unsettled."""
    from fdq import membership
    fdq.Supervisor(db).create_topic("t", shards=4)
    slow = fast(zombie_timeout_s=30.0)
    a = fdq.Consumer(db, "t", consumer_id="a", config=slow)
    b = fdq.Consumer(db, "t", consumer_id="b", config=slow)
    try:
        ts = Keyspace().topic("t")
        assert {o for o, _e in membership.read_owners(db, ts, "default").values()} == {"a", "b"}
        fdq.Producer(db).push_many("t", [fdq.Envelope(f"{i}".encode(), shard_key=f"k{i}") for i in range(40)])
        leased = _fetch_until(b, lambda g: g, 10)
        b.shutdown()
        assert {o for o, _e in membership.read_owners(db, ts, "default").values()} == {"a"}
        got = _fetch_until(a, lambda g: len(g) >= 40, 10)    # well before the 30 s zombie timeout
        assert {m.body for m in got} == {f"{i}".encode() for i in range(40)}
        assert {m.id for m in leased} <= {m.id for m in got}
        for m in got:
            m.ack()
    finally:
        a.shutdown()
        b.shutdown()
    assert sub_stats(db, "t")["backlog"] == 0


def test_max_concurrency_never_runs_one_key_twice_at_once(db):
    fdq.Supervisor(db).create_topic("t", shards=8)
    fdq.Producer(db).push_many("t", [fdq.Envelope(f"{i}".encode(), shard_key=f"k{i % 6}") for i in range(120)])
    lock = threading.Lock()
    active = collections.Counter()
    peak = [0]
    clash = []
    handled = []

    def handler(m):
        with lock:
            active[m.shard_key] += 1
            if active[m.shard_key] > 1:
                clash.append(m.shard_key)
            peak[0] = max(peak[0], sum(active.values()))
        time.sleep(0.005)
        with lock:
            active[m.shard_key] -= 1
            handled.append(m.body)
    c = fdq.tail(db, "t", handler, batch_size=5, config=fast(max_concurrency=4))
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 60, what="all handled")
    finally:
        c.shutdown()
    assert not clash and sorted(handled) == sorted(f"{i}".encode() for i in range(120))
    assert peak[0] > 1, "handlers never ran concurrently"


def test_at_most_once_under_fault_injection_loses_nothing(db, url):
    """With no consumer killed, at-most-once under injected faults (commit_unknown_result
    after a real commit included) still hands every message over exactly once."""
    p = fdq.Producer(db)
    fdq.Supervisor(db).create_topic("t", shards=2)
    pushed = [r.id for r in p.push_many("t", [fdq.Envelope(f"{i}".encode()) for i in range(600)])]
    faulty = fdq.connect(with_faults(url, 0.1, 21))
    handled = []
    c = fdq.tail(faulty, "t", lambda m: handled.append(m.id), acking=False, batch_size=10,
                 config=FAST, on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 60, what="the queue emptied")
        wait_for(lambda: len(handled) >= len(pushed), 10, what="every message handled")
    finally:
        c.shutdown()
    assert sorted(handled) == sorted(pushed)


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
