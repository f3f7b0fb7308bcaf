"""Leftovers of earlier reviews, each with the test that failed before its fix:
stats' heartbeat age across version jumps and clock skew, a heartbeat racing a zombie
declaration, replay chunks sized by the subscriptions of the moment."""
from __future__ import annotations

import time

import fdq
from fdq import membership
from fdq.keyspace import Keyspace, decode_counter

from fdqtest import database_url, engine_errors, read, read_version, scan, wait_for, with_faults

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


# -- 2. a heartbeat racing a zombie declaration ------------------------------------------

def _member_keys(db, ts, cid: str) -> list:
    return [k for k, _v in scan(db, ts.consumers["default"][cid].range().start[:-1])
            if ts.consumers["default"].unpack(k)[0] == cid]


def _commit_retrying(tr, attempt) -> int:
    """Commit ``tr`` (its first attempt made by the caller, the other transaction
    interleaved by hand), retrying as ``fdq.transactional`` does: on a conflict, reset
    and run ``attempt(tr)`` again. Returns how many retries it took."""
    retries = 0
    while True:
        try:
            tr.commit().wait()
            return retries
        except engine_errors() as e:
            tr.on_error(e.code).wait()
            retries += 1
            attempt(tr)


def test_heartbeat_racing_a_zombie_declaration_leaves_no_keys(db):
    """T1 (heartbeat) reads the member's record; T2 (declare_zombie) removes the member
    and commits; T1 commits. Before the fix T1 read the record by snapshot, committed,
    and left its "hb"/"hbv" keys without a record for good. Now T1 conflicts, and its
    retry finds the member gone: no key of it remains."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    config = sup.config("t")
    membership.join(db, ts, "default", "zombie", {"id": "zombie"}, config)
    membership.join(db, ts, "default", "survivor", {"id": "survivor"}, config)
    observed = membership.read_members(db, ts, "default")["zombie"]["hb"]

    t1 = db.create_transaction()
    assert membership.heartbeat(t1, ts, "default", "zombie") is True       # read, not committed
    assert membership.declare_zombie(db, ts, "default", "zombie", observed, config) is True
    results = []
    retries = _commit_retrying(t1, lambda tr: results.append(membership.heartbeat(tr, ts, "default", "zombie")))

    assert retries == 1 and results == [False], "the heartbeat committed after the zombie declaration"
    assert _member_keys(db, ts, "zombie") == []
    assert set(membership.read_members(db, ts, "default")) == {"survivor"}


def test_assignment_clears_heartbeat_keys_left_without_a_record(db):
    """Keys an older FDQ's racing heartbeat left behind are cleared by the next
    re-division of shards (a join, leave or zombie declaration)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    config = sup.config("t")

    @fdq.transactional
    def leak(tr):   # what the race left: a heartbeat's keys, no record
        tr.add(ts.heartbeat_key("default", "gone"), (7).to_bytes(8, "little"))
        tr.max(ts.consumers.pack(("default", "gone", "hbv")), (5).to_bytes(8, "little"))
    leak(db)
    assert len(_member_keys(db, ts, "gone")) == 2
    membership.join(db, ts, "default", "next", {"id": "next"}, config)
    assert _member_keys(db, ts, "gone") == []
    assert set(membership.read_members(db, ts, "default")) == {"next"}


# -- 3. replay chunks sized by the subscriptions of the moment -------------------------

def test_replay_chunks_follow_subscriptions_added_midway(db):
    """A replay sized its chunks by the topic's subscriptions read once at the start:
    with one subscription a chunk carried ~1 MB of bodies, twice (log + queue). Twelve
    subscriptions created after its first chunk made every later chunk write 14 copies,
    over FDB's 10 MB transaction limit (2101): the replay failed. Each chunk now reads
    the config in its own transaction and takes what fits its subscriptions then; the
    new subscriptions get every message replayed after their creation."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    start = int(time.time() * 1000) - 1
    body = b"x" * 300_000
    for i in range(12):
        p.push("t", body + str(i).encode(), shard_key=f"k{i}")
    end = int(time.time() * 1000) + 1
    added = []
    chunks = []

    def progress(n):
        chunks.append(n)
        if not added:
            for i in range(12):
                sup.create_subscription("t", f"late{i}", fdq.SubscriptionConfig(deliver_policy="new"))
                added.append(f"late{i}")
    assert p.replay("t", start, end, progress=progress) == 12
    assert sum(chunks) == 12 and len(chunks) > 2
    subs = sup.stats("t")["subscriptions"]
    assert subs["default"]["backlog"] == 24          # 12 pushed, 12 replayed
    for sub in added:
        assert subs[sub]["backlog"] == 12 - chunks[0], sub


# -- 4. counting an older topic's log (an exact log_bytes) ----------------------------

def _log_size(db, ts) -> int:
    """The log's bytes by a full scan: its entries' and body chunks' keys and values."""
    return sum(len(k) + len(v) for space in (ts.log, ts.all_chunks) for k, v in scan(db, space.key()))


def _old_topic(db, name: str, shards: int = 4):
    """A topic as an older FDQ left it: a config without ``log_bytes_counted`` and a
    log whose entries the counter does not hold (it counts from some later push on)."""
    ts = Keyspace().topic(name)
    fdq.topic.write_topic_config(db, ts, fdq.TopicConfig(shards=shards, extend=True))
    p = fdq.Producer(db)
    for r in range(2):
        p.push_many(name, [fdq.Envelope(b"p" * (10 + i), shard_key=f"k{i}") for i in range(30)])
        p.push(name, b"id", msg_id=f"m{r}")
        p.push(name, b"h", headers={"a": "b"})
        p.push(name, b"d", delay=60)
        p.push(name, b"L" * 250_000, shard_key="big")        # body chunks
        p.push(name, b"M" * 90_000 + b"m")
    cut_ms = int(time.time() * 1000) + 1    # the above are older, the rest not
    while int(time.time() * 1000) <= cut_ms:
        time.sleep(0.001)
    for i in range(12):
        p.push_many(name, [fdq.Envelope(b"w" * 100, shard_key=f"w{i}-{j}") for j in range(500)])

    @fdq.transactional
    def forget(tr):     # the older FDQ's pushes added nothing
        tr.add(ts.stat("log_bytes"), (-1234567).to_bytes(8, "little", signed=True))
    forget(db)
    return ts, cut_ms


def test_count_log_bytes_killed_midway_with_pushes_and_trims_is_exact(procs, db):
    """A count killed (kill -9) after its first chunk, with a producer process pushing
    all along and a trim by age between the kill and the rerun (deleting entries
    counted and entries not yet counted): the rerun finishes, and log_bytes equals the
    log's bytes, then stays so under more pushes and trims."""
    sup = fdq.Supervisor(db)
    ts, cut_ms = _old_topic(db, "old")
    assert sup.stats("old")["counters"]["log_bytes"] is None
    prod = procs.start("producer", "p1", "--topic", "old", "--count", 3000, "--batch", 5, "--keys", 7,
                       "--sleep", 0.005)
    w = procs.start("count", "count1", "--topic", "old", "--sleep", 0.5)
    assert procs.readline(w, 60).strip() == "start"
    first = procs.readline(w, 60).strip()
    assert first.startswith("chunk "), first
    procs.kill9(w)
    assert not sup.config("old").log_bytes_counted, "the kill did not land mid-way"
    assert sup.stats("old")["counters"]["log_bytes"] is None
    # every bucket's oldest entries: bucket 0's counted, the others' not yet
    def older(): return [k for k, v in scan(db, ts.log.key()) if fdq.log.Record.decode(v).ts_ms < cut_ms]
    assert {ts.log.unpack(k)[0] for k in older()} == {0, 1, 2, 3}
    assert sup.trim("old", before_ms=cut_ms) > 0
    assert older() == []
    w2 = procs.start("count", "count2", "--topic", "old")
    procs.wait(w2, 120)
    assert sup.config("old").log_bytes_counted
    procs.wait(prod, 120)
    assert sup.stats("old")["counters"]["log_bytes"] == _log_size(db, ts)
    assert scan(db, ts.log_count.key()) == []
    fdq.Producer(db).push_many("old", [fdq.Envelope(b"after" * 50, shard_key=f"a{j}") for j in range(100)])
    assert sup.trim("old", before_ms=int(time.time() * 1000) - 1) > 0
    assert sup.stats("old")["counters"]["log_bytes"] == _log_size(db, ts)
    assert sup.count_log_bytes("old") == 0      # counted: nothing to do


def test_two_counts_at_once_under_fault_injection_are_exact(tmp_path):
    """Two counts at once on fault-injecting connections (retryable errors,
    commit_unknown_result, version jumps), while a thread pushes: nothing counted twice."""
    import threading
    url = database_url(tmp_path / "f.db")
    db = fdq.connect(url)
    sup = fdq.Supervisor(db)
    ts, _cut = _old_topic(db, "old", shards=3)
    stop = threading.Event()
    errors = []

    def push():
        p = fdq.Producer(db)
        i = 0
        while not stop.is_set() and i < 2000:
            p.push("old", b"s" * (i % 300), shard_key=f"s{i % 11}")
            i += 1

    def count(seed):
        try:
            fdq.Supervisor(fdq.connect(with_faults(url, 0.3, seed))).count_log_bytes("old")
        except Exception as e:      # reported below
            errors.append(e)
    pusher = threading.Thread(target=push)
    counters = [threading.Thread(target=count, args=(s,)) for s in (3, 4)]
    pusher.start()
    for t in counters:
        t.start()
    for t in counters:
        t.join(120)
    stop.set()
    pusher.join(60)
    assert not errors, errors
    assert sup.config("old").log_bytes_counted
    assert sup.stats("old")["counters"]["log_bytes"] == _log_size(db, ts)


def test_a_count_chunk_and_a_trim_racing_serialize(db):
    """Both orders of a count chunk and a trim chunk over the same entries, interleaved
    by hand: the one committing second conflicts and redoes its decision (the chunk
    does not count what the trim deleted without subtracting; the trim subtracts what
    the chunk counted meanwhile)."""
    from fdq import logcount
    from fdq import supervisor as sv
    sup = fdq.Supervisor(db)
    for order in ("count first", "trim first"):
        name = "race" + str(len(order))
        ts = Keyspace().topic(name)
        fdq.topic.write_topic_config(db, ts, fdq.TopicConfig(shards=1))
        fdq.Producer(db).push_many(name, [fdq.Envelope(b"r" * (50 + i)) for i in range(10)])
        assert logcount.count_begin(db, ts)
        held = db.create_transaction()
        if order == "count first":
            assert logcount.count_chunk(held, ts, 0, 100) == (10, True)        # not committed
            assert sv.trim_bucket_chunk(db, ts, 0, 2 ** 62, 3)[0] == 3
            assert _commit_retrying(held, lambda tr: logcount.count_chunk(tr, ts, 0, 100)) == 1
        else:
            assert sv.trim_bucket_chunk(held, ts, 0, 2 ** 62, 3)[0] == 3        # not committed
            assert logcount.count_chunk(db, ts, 0, 100) == (10, True)
            assert _commit_retrying(held, lambda tr: sv.trim_bucket_chunk(tr, ts, 0, 2 ** 62, 3)) == 1
        assert logcount.count_finish(db, ts)
        assert len(scan(db, ts.log.key())) == 7
        assert sup.stats(name)["counters"]["log_bytes"] == _log_size(db, ts), order
