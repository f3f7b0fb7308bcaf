"""Second-round review of the less-travelled paths: delayed messages copied from the
"all" log (catch-up, reset, replay, play), concurrent replays, bad replay input, aio
cancellation. Each test failed before the fix it names."""
from __future__ import annotations

import time

import pytest

import fdq
from fdq import membership
from fdq.keyspace import Keyspace
from fdqtest import fast, read_version, with_faults


def _sub_stats(db, topic, sub):
    return fdq.Supervisor(db).stats(topic)["subscriptions"][sub]


def _fetch_ids(db, topic, sub, timeout=0.3):
    c = fdq.Consumer(db, topic, subscription=sub, create=False)
    try:
        got = c.fetch(100, timeout=timeout)
        c.ack_many(got)
        return [m.replay_of or m.id for m in got]
    finally:
        c.close()


def _advance_clock(db, ms):
    """Move the database clock (what delays are due by) ``ms`` ahead, as consumers do
    with the time their monotonic clocks saw pass."""
    ck = Keyspace().clock_key
    tr = db.create_transaction()
    now = membership.read_clock(tr, ck)
    tr.cancel()
    membership.advance_clock(db, ck, now + ms)


def test_a_new_subscription_gets_a_delayed_message_at_its_due_time(db):
    """Catch-up copied a delayed message, not due yet, into the new subscription's ready
    queue: delivered at once, 10 minutes early (the log entry had no due time)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    late = p.push("t", b"later", shard_key="a", delay=600).id
    due_soon = p.push("t", b"soon", shard_key="b", delay=1).id
    now = p.push("t", b"now", shard_key="c").id
    _advance_clock(db, 2000)        # "soon" is due by now, "later" is not
    sup.create_subscription("t", "new", fdq.SubscriptionConfig(deliver_policy="all"))
    st = _sub_stats(db, "t", "new")
    assert (st["backlog"], st["delayed"]) == (3, 1)
    assert sorted(_fetch_ids(db, "t", "new")) == sorted([due_soon, now])
    assert _sub_stats(db, "t", "new")["delayed"] == 1
    _advance_clock(db, 600_000)
    assert _fetch_ids(db, "t", "new") == [late]


def test_a_rewind_keeps_a_pending_delay(db):
    """A reset to an earlier time re-queued a delayed message that was not due yet as
    ready (delivered at once)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    late = p.push("t", b"later", shard_key="a", delay=600).id
    now = p.push("t", b"now", shard_key="c").id
    assert _fetch_ids(db, "t", "default") == [now]
    sup.reset("t", "default", 0)
    st = _sub_stats(db, "t", "default")
    assert (st["backlog"], st["delayed"]) == (2, 1)
    assert _fetch_ids(db, "t", "default") == [now]
    _advance_clock(db, 600_000)
    assert _fetch_ids(db, "t", "default") == [late]


def test_a_replay_keeps_a_pending_delay_and_delivers_a_past_one_at_once(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    late = p.push("t", b"later", shard_key="a", delay=600).id
    soon = p.push("t", b"soon", shard_key="b", delay=1).id
    _advance_clock(db, 2000)
    assert _fetch_ids(db, "t", "default") == [soon]
    assert p.replay("t", 0) == 2
    st = _sub_stats(db, "t", "default")
    assert (st["backlog"], st["delayed"]) == (3, 2)     # "later" and its replay wait, not "soon"'s replay
    assert _fetch_ids(db, "t", "default") == [soon]          # the replay of "soon": due already
    _advance_clock(db, 600_000)
    assert sorted(_fetch_ids(db, "t", "default")) == [late, late]   # "later" and its replay


def test_play_routes_a_delayed_message_by_its_push_time_due(db):
    """A delayed message pushed while paused waited ``delay`` from the play, not from its
    push: paused for longer than its delay, it still waited the whole delay again."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.pause("t")
    p = fdq.Producer(db)
    soon = p.push("t", b"soon", shard_key="b", delay=1).id
    late = p.push("t", b"later", shard_key="a", delay=600).id
    _advance_clock(db, 2000)
    assert sup.play("t") == 2
    st = _sub_stats(db, "t", "default")
    assert (st["backlog"], st["delayed"]) == (2, 1)
    assert _fetch_ids(db, "t", "default") == [soon]
    _advance_clock(db, 600_000)
    assert _fetch_ids(db, "t", "default") == [late]


def _replay_counts(db, topic):
    import collections

    from fdq.keyspace.codec import Record
    ts = Keyspace().topic(topic)
    counts = collections.Counter()
    r = ts.log.range()
    tr = db.create_transaction()
    for kv in tr.snapshot.get_range(r.start, r.stop):
        rec = Record.decode(kv.value)
        if rec.replay_of is not None:
            counts[rec.replay_of] += 1
    tr.cancel()
    return counts


def test_two_concurrent_replays_of_one_window_each_deliver_it(db):
    """Two replays of the same window at once shared one progress record (keyed by the
    window): together they pushed the window once, not once per call."""
    import threading
    p = fdq.Producer(db)
    ids = [r.id for r in p.push_many("t", [fdq.Envelope(f"m{i}".encode(), shard_key=f"k{i % 7}")
                                           for i in range(1500)])]
    time.sleep(0.01)
    end = int(time.time() * 1000)       # the replays are inserted after it: not in the window
    time.sleep(0.01)
    b_started, results, errors = threading.Event(), {}, []

    def run(name, progress):
        try:
            results[name] = p.replay("t", 0, end, progress=progress)
        except Exception as e:     # reported below
            errors.append(e)

    b = threading.Thread(target=run, args=("b", lambda n: b_started.set()))

    def a_progress(n):          # the first call, after its first chunk: the second one starts
        if not b.is_alive() and not b_started.is_set():
            b.start()
            assert b_started.wait(60), "the second replay made no progress"
    a = threading.Thread(target=run, args=("a", a_progress))
    a.start()
    a.join(120)
    b.join(120)
    assert not errors and not a.is_alive() and not b.is_alive()
    assert results == {"a": 1500, "b": 1500}
    counts = _replay_counts(db, "t")
    assert set(counts) == set(ids) and set(counts.values()) == {2}
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 4500


def test_log_reads_and_a_replay_survive_retryable_read_errors(db, url):
    """The log readers (fdq.log: the time index, each page of the merged buckets, a large
    body's chunks, the bucket list; replay's and Spark's reads) ran in bare transactions
    without a retry: one retryable read error (1009 future_version, 1037
    process_behind, which FDB raises and the engine injects on a transaction's first
    read) failed the whole replay or scan."""
    from fdq import log
    p = fdq.Producer(db)
    ids = [r.id for r in p.push_many("t", [fdq.Envelope(f"m{i}".encode(), shard_key=f"k{i % 7}")
                                           for i in range(60)])]
    ids += [p.push("t", b"x" * 200_000, shard_key="big").id]        # chunked: its chunks read apart
    time.sleep(0.01)
    end = int(time.time() * 1000)       # the replays are inserted after it: not in the window
    time.sleep(0.01)
    faulty = fdq.connect(with_faults(url, 0.5, 5))       # a read fault in 1 of 20 transactions
    ts = Keyspace().topic("t")
    for _ in range(60):         # some 4 bare transactions each: 240 in all
        rows = list(log.iter_window(faulty, ts, log.log_buckets(faulty, ts), 0, end))
        assert len(rows) == 61
        assert [len(log.body_of(faulty, ts, vs, rec)) for vs, _b, rec in rows if rec.nchunks] == [200_000]
        keys = [k for b in log.log_buckets(faulty, ts)
                for ks, _raws in log.scan_entries(faulty, ts, *log.bucket_range(ts, b)) for k in ks]
        assert len(keys) == 61
    assert fdq.Producer(faulty).replay("t", 0, end) == 61
    counts = _replay_counts(db, "t")
    assert set(counts) == set(ids) and set(counts.values()) == {1}


def test_a_killed_replay_run_is_taken_over_once_and_its_old_owner_fenced(db, monkeypatch):
    """A run whose heartbeat stays unchanged (its caller killed: here a run begun and
    never driven) is finished by the next call of the same window, from its progress;
    the old owner, were it to wake up, can commit no chunk of it."""
    from fdq import supervisor
    monkeypatch.setattr(supervisor, "REPLAY_ORPHAN_S", 0.3)
    p = fdq.Producer(db)
    ids = [r.id for r in p.push_many("t", [fdq.Envelope(f"m{i}".encode()) for i in range(1200)])]
    time.sleep(0.01)
    end = int(time.time() * 1000)
    time.sleep(0.01)
    ts = Keyspace().topic("t")
    window = f"0:{end}"
    run, _state = supervisor.replay_begin(db, ts, window, "dead-owner", 0, end)
    rows = list(supervisor.iter_window(db, ts, supervisor.log_buckets(db, ts), 0, end))
    first = [(vs, supervisor._ReplayEnvelope(rec.body, None, None, None, None, replay_of=fdq.keyspace.message_id(vs)))
             for vs, _b, rec in rows[:500]]
    ks = Keyspace()
    assert supervisor.replay_chunk(db, ks, ts, (window, run, "dead-owner"), first,
                                   b"x" * 16, end, {})[:2] == (500, 500)
    assert p.replay("t", 0, end) == 700           # taken over: what the dead run left
    counts = _replay_counts(db, "t")
    assert set(counts) == set(ids) and set(counts.values()) == {1}
    assert supervisor._replay_runs(db, ts, window) == {}
    # The old owner's next chunk is refused (here: the run is finished and gone; while
    # another owner runs it, ReplayTakenOver).
    run2, _ = supervisor.replay_begin(db, ts, window, "dead-2", 0, end)
    assert supervisor.replay_begin(db, ts, window, "thief", 0, end,
                                   claim=(run2, "dead-2", 0)) == (run2, _ | {"owner": "thief"})
    with pytest.raises(fdq.ReplayTakenOver):
        supervisor.replay_chunk(db, ks, ts, (window, run2, "dead-2"), first, b"y" * 16, end, {})
    with pytest.raises(fdq.ConfigError, match="not running"):
        supervisor.replay_chunk(db, ks, ts, (window, run, "dead-owner"), first, b"z" * 16, end, {})


def test_a_replay_resumes_a_run_an_older_version_left(db, monkeypatch):
    """Progress written by a version that kept one record per window (no owner, no
    heartbeat) is resumed, not replayed again from the start."""
    from fdq import supervisor
    from fdq.keyspace.codec import pack
    monkeypatch.setattr(supervisor, "REPLAY_ORPHAN_S", 0.3)
    p = fdq.Producer(db)
    ids = [r.id for r in p.push_many("t", [fdq.Envelope(f"m{i}".encode()) for i in range(300)])]
    ts = Keyspace().topic("t")
    rows = list(supervisor.iter_window(db, ts, supervisor.log_buckets(db, ts), 0, None))
    rv = read_version(db)
    legacy = {"start": 0, "end": None, "stop": rv, "after": rows[99][0].to_bytes(), "count": 100}

    @fdq.transactional
    def put(tr):
        tr[ts.replays.pack(("0:None",))] = pack(legacy)
    put(db)
    assert p.replay("t", 0) == 200
    counts = _replay_counts(db, "t")
    assert set(counts) == set(ids[100:]) and set(counts.values()) == {1}
    tr = db.create_transaction()
    assert list(tr.get_range(*[ts.replays.range().start, ts.replays.range().stop])) == []


def test_stats_and_trim_survive_retryable_read_errors(db, url):
    """Supervisor.stats, and trim's size estimate and read version, ran in bare
    transactions: one retryable read error failed them."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4, retention_bytes=10_000_000)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m", shard_key=f"k{i}") for i in range(50)])
    faulty = fdq.Supervisor(fdq.connect(with_faults(url, 0.5, 7)))
    for _ in range(40):
        assert faulty.stats("t")["subscriptions"]["default"]["backlog"] == 50
        assert faulty.trim("t") == 0


AIO_FAST = fast(ack_wait_s=30)


async def _aio_until(cond, timeout, what):
    import asyncio
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.02)


def test_aio_a_handler_raising_cancelled_error_is_a_failed_handler(db):
    """A handler that raised asyncio.CancelledError of its own (it awaited a task that
    someone else cancelled) ended the whole consuming task: the tail stopped, silently,
    still a live member owning its shards."""
    import asyncio

    import fdq.aio
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    for i in range(3):
        p.push("t", f"m{i}".encode(), shard_key="k")
    seen = []

    async def main():
        async def handler(m):
            seen.append((m.body, m.attempts))
            if m.body == b"m1" and m.attempts == 1:
                other = asyncio.get_running_loop().create_future()
                other.cancel()
                await other                 # raises CancelledError into the handler
        t = await fdq.aio.tail(db, "t", handler, config=AIO_FAST, batch_size=1)
        try:
            await _aio_until(lambda: _sub_stats(db, "t", "default")["backlog"] == 0, 5, "all acked")
            assert not t._task.done()
        finally:
            await asyncio.wait_for(t.shutdown(), 20)
    asyncio.run(main())
    assert (b"m1", 2) in seen and [b for b, _a in seen].count(b"m1") == 2


def test_bad_times_are_refused_and_harm_nothing(db):
    """Replay, reset and trim times: NaN and infinities raised ValueError or
    OverflowError (not an FDQError), a window past int64 an OverflowError midway, a
    window ending before it starts replayed nothing silently, and trim(before_ms=NaN)
    deleted the whole log (no entry compares as newer than NaN)."""
    import datetime
    sup = fdq.Supervisor(db)
    p = fdq.Producer(db)
    ids = [p.push("t", f"m{i}".encode()).id for i in range(4)]
    for bad in (float("nan"), float("inf"), -float("inf"), 10**30, "2026-01-01", True):
        with pytest.raises(fdq.ConfigError, match="time must be"):
            p.replay("t", bad)
        with pytest.raises(fdq.ConfigError, match="time must be"):
            p.replay("t", 0, bad)
        with pytest.raises(fdq.ConfigError, match="time must be"):
            sup.reset("t", "default", bad)
        with pytest.raises(fdq.ConfigError, match="time must be"):
            sup.trim("t", before_ms=bad)
    with pytest.raises(fdq.ConfigError, match="ends .* before it starts"):
        p.replay("t", 1_795_399_200_000, 1_795_399_100_000)
    # epoch seconds where milliseconds are meant (time.time()) would replay, or rewind
    # to, the start of the log: refused, naming both readings
    secs = 1_795_399_200
    for call in (lambda: p.replay("t", secs), lambda: p.replay("t", 0, secs + 0.5),
                 lambda: sup.reset("t", "default", secs), lambda: sup.trim("t", before_ms=secs)):
        with pytest.raises(fdq.ConfigError, match=r"looks like epoch seconds .*1970-01-21.*pass 1795399200[05]00 "):
            call()
    assert sup.stats("t")["counters"]["inserted"] == 4 and _replay_counts(db, "t") == {}
    assert sup.stats("t")["subscriptions"]["default"]["backlog"] == 4
    with pytest.raises(fdq.TopicNotFound):
        p.replay("nope", 0)
    # datetimes, aware in any zone or naive (UTC), mean the same instant
    now = datetime.datetime.now(datetime.timezone.utc)
    east = (now - datetime.timedelta(minutes=1)).astimezone(datetime.timezone(datetime.timedelta(hours=5)))
    assert p.replay("t", east, now) == 4
    assert p.replay("t", (now - datetime.timedelta(minutes=1)).replace(tzinfo=None), now) == 4
    assert sup.trim("t", before_ms=now - datetime.timedelta(hours=1)) == 0
    assert set(_replay_counts(db, "t")) == set(ids)
