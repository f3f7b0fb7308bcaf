"""Replay of a time window of the "all" log: exactly what the window holds, each once
(killed midway and resumed, under fault injection, taken over from a killed run, two at
once, racing a trim, interrupted), pending delays kept, headers preserved, transactions
under FDB's limit."""
from __future__ import annotations

import collections
import os
import time

import msgpack
import pytest

import fdq
from fdq.ops.replay import replay_beat
from fdq.headers import DISPATCH_TAG, TRACE_ID
from fdq.keyspace import Keyspace
from fdq.keyspace.codec import unpack
from fdq.ops import replay

from fdqtest import (advance_clock, collect, fetch_ids, log_records, replay_counts, scan, sub_stats,
                     wait_for, with_faults)
from ophelpers import check_order, consume, drain_bodies, fan_out_topic, push_keys, Recorder, SUPERVISED


def test_an_interrupt_right_after_a_chunk_commits_still_reports_that_chunk(db):
    n = 2500
    p = fdq.Producer(db)
    for i in range(0, n, 500):
        p.push_many("t", [fdq.Envelope(f"m{j}".encode()) for j in range(i, i + 500)])
    sup = fdq.Supervisor(db)
    reported = []

    def progress(k):
        if not reported:
            reported.append(0)      # the first report: interrupted before it counts anything
            raise KeyboardInterrupt
        reported.append(k)

    with pytest.raises(KeyboardInterrupt):
        p.replay("t", 0, progress=progress)
    pushed = sup.stats("t")["counters"]["inserted"] - n
    assert pushed > 0                   # the first chunk committed before the interrupt
    assert sum(reported) == pushed      # and is reported (once)
    # the same call again finishes the window: each message replayed once in all
    assert p.replay("t", 0) + pushed == n
    assert sup.stats("t")["counters"]["inserted"] == 2 * n


RICH = {"s": "héllo ☃", "i": 2**64 - 1, "neg": -2**63, "f": 0.1, "one_f": 1.0, "one_i": 1,
        "t": True, "n": None, "l": [1, "x", [2.5, None], {"k": "v"}], "m": {"a": {"b": [False]}},
        "e": "", TRACE_ID: "42"}


def _packed(v) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


def test_headers_preserved_through_replay_and_consumer(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, extend=True)
    p = fdq.Producer(db)
    t0 = int(time.time() * 1000) - 1000
    originals = [RICH, {DISPATCH_TAG: "A", "x": [1, 2.0]}, {"only": "one"}]
    p.push_many("t", [fdq.Envelope(b"m%d" % i, shard_key="same", headers=h) for i, h in enumerate(originals)]
                + [fdq.Envelope(b"plain", shard_key="same")])
    by_body = {b"m%d" % i: _packed(h) for i, h in enumerate(originals)}
    by_body[b"plain"] = _packed({})
    first = sorted(collect(db, "t", 4, extend_support=True), key=lambda m: m.body)
    assert {m.body: _packed(dict(m.headers)) for m in first} == by_body
    assert p.replay("t", t0) == 4
    recs = log_records(db, "t")
    assert len(recs) == 8
    orig, replayed = recs[:4], recs[4:]
    for o, r in zip(orig, replayed):
        oh = o[3] if len(o) > 3 else None
        rh = r[3] if len(r) > 3 else None
        assert _packed(oh) == _packed(rh)                           # byte for byte
        assert r[7] is not None                                     # replay_of kept
    again = sorted(collect(db, "t", 4, extend_support=True), key=lambda m: m.body)
    assert {m.body: _packed(dict(m.headers)) for m in again} == by_body
    assert [m.replay_of for m in again] == [m.id for m in first]
    assert [m.tag for m in again] == ["", "A", "", ""]


SUBS = 9        # the default subscription and 8 more


def test_replay_of_a_big_message_after_smaller_ones_fits_its_transactions(db):
    """Same budget in a replay: a batch under 2 MB took one more message (its log copy
    and one per subscription) before checking, up to ~11 MB: the replay failed with
    transaction_too_large, and again on every rerun."""
    fan_out_topic(db)
    p = fdq.Producer(db)
    start = int(time.time() * 1000) - 1
    small, big = os.urandom(199_000), os.urandom(900_000)
    p.push("t", small, shard_key="k")
    p.push("t", big, shard_key="k")
    assert drain_bodies(db, "t", "s3", 2) == [small, big]
    assert p.replay("t", start) == 2
    assert drain_bodies(db, "t", "s3", 2) == [small, big]
    assert fdq.Supervisor(db).stats("t")["subscriptions"]["s5"]["backlog"] == 4


def test_a_replay_keeps_a_pending_delay_and_delivers_a_past_one_at_once(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    late = p.push("t", b"later", shard_key="a", delay=600).id
    soon = p.push("t", b"soon", shard_key="b", delay=1).id
    advance_clock(db, 2000)
    assert fetch_ids(db, "t", "default") == [soon]
    assert p.replay("t", 0) == 2
    st = sub_stats(db, "t", "default")
    assert (st["backlog"], st["delayed"]) == (3, 2)     # "later" and its replay wait, not "soon"'s replay
    assert fetch_ids(db, "t", "default") == [soon]          # the replay of "soon": due already
    advance_clock(db, 600_000)
    assert sorted(fetch_ids(db, "t", "default")) == [late, late]   # "later" and its replay


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
    counts = replay_counts(db, "t")
    assert set(counts) == set(ids) and set(counts.values()) == {2}
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 4500


def test_a_killed_replay_run_is_taken_over_once_and_its_old_owner_fenced(db, monkeypatch):
    """A run whose heartbeat stays unchanged (its caller killed: here a run begun and
    never driven) is finished by the next call of the same window, from its progress;
    the old owner, were it to wake up, can commit no chunk of it."""
    from fdq import supervisor
    from fdq.log import iter_window, log_buckets
    from fdq.ops import replay
    from fdq.ops.push import PushItem
    monkeypatch.setattr(supervisor, "REPLAY_ORPHAN_S", 0.3)
    p = fdq.Producer(db)
    ids = [r.id for r in p.push_many("t", [fdq.Envelope(f"m{i}".encode()) for i in range(1200)])]
    time.sleep(0.01)
    end = int(time.time() * 1000)
    time.sleep(0.01)
    ts = Keyspace().topic("t")
    window = f"0:{end}"
    run, _state = replay.replay_begin(db, ts, window, "dead-owner", 0, end)
    rows = list(iter_window(db, ts, log_buckets(db, ts), 0, end))
    first = [(vs, PushItem(rec.body, replay_of=fdq.keyspace.message_id(vs))) for vs, _b, rec in rows[:500]]
    ks = Keyspace()
    assert replay.replay_chunk(db, ks, ts, (window, run, "dead-owner"), first, b"x" * 16, end, {}) == (500, 500)
    assert p.replay("t", 0, end) == 700           # taken over: what the dead run left
    counts = replay_counts(db, "t")
    assert set(counts) == set(ids) and set(counts.values()) == {1}
    assert replay.replay_runs(db, ts, window) == {}
    # The old owner's next chunk is refused (here: the run is finished and gone; while
    # another owner runs it, ReplayTakenOver).
    run2, _ = replay.replay_begin(db, ts, window, "dead-2", 0, end)
    assert replay.replay_begin(db, ts, window, "thief", 0, end,
                               claim=(run2, "dead-2", 0)) == (run2, _ | {"owner": "thief"})
    with pytest.raises(fdq.ReplayTakenOver):
        replay.replay_chunk(db, ks, ts, (window, run2, "dead-2"), first, b"y" * 16, end, {})
    with pytest.raises(fdq.ConfigError, match="not running"):
        replay.replay_chunk(db, ks, ts, (window, run, "dead-owner"), first, b"z" * 16, end, {})


def test_replay_racing_a_trim_pushes_no_empty_bodies(db):
    """A replay reads the log in pages and each large body's chunks apart: a trim
    committed in between (here: after the replay's first chunk) left entries the replay
    had read whose chunks were gone, and it replayed them with an empty body."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    big = [bytes([65 + i]) * 150_000 for i in range(20)]
    p = fdq.Producer(db)
    for b in big:
        p.push("t", b, shard_key="k")
    trimmed = []

    def progress(_n):
        if not trimmed:
            trimmed.append(sup.trim("t", before_ms=2 ** 62))
    n = p.replay("t", 0, progress=progress)
    assert trimmed[0] > 20      # the originals and what the replay pushed so far
    got = consume(db, 20 + n, 30)
    assert len(got) == 20 + n
    assert all(b in big for _i, _k, b in got), "a replayed message lost its body"
    assert 0 < n < 20       # those trimmed before the replay reached them are not replayed


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


def _replayed(db, ts):
    """{original id: times replayed} from the "all" log's records."""
    counts = collections.Counter()
    for _k, v in scan(db, ts.log.key()):
        rec = unpack(v)
        if len(rec) > 7 and rec[7] is not None:
            counts[rec[7]] += 1
    return counts


def test_replay_time_window(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    p = fdq.Producer(db)
    before = push_keys(db, "t", 50, 5, "before")
    time.sleep(0.05)
    start = int(time.time() * 1000)
    time.sleep(0.05)
    window = push_keys(db, "t", 80, 5, "window")
    time.sleep(0.05)
    end = int(time.time() * 1000)
    time.sleep(0.05)
    after = push_keys(db, "t", 30, 5, "after")
    rec = Recorder()
    consumer = fdq.tail(db, "t", rec, transactional=True, config=SUPERVISED)
    try:
        wait_for(lambda: len(rec.committed(db)) == 160, 60, what="the originals consumed")
        assert p.replay("t", start, end) == 80
        wait_for(lambda: len(rec.committed(db)) == 240, 60, what="the replay consumed")
        time.sleep(0.3)
    finally:
        consumer.shutdown()
    counts = rec.committed(db)
    assert len(counts) == 240 and set(counts.values()) == {1}
    replayed = [s for s in rec.seen(db) if s[3] is not None]
    assert sorted(r for _i, _k, _b, r in replayed) == sorted(i for i, _k, _b in window)
    assert {i for i, _k, _b, _r in replayed}.isdisjoint(i for i, _k, _b in before + window + after)
    check_order(window, replayed)
    assert sup.stats("t")["counters"]["inserted"] == 240


def test_replay_without_end_stops_at_its_start(db):
    """An open-ended replay replays what was committed when it began, not its own pushes
    (it used to read them back and replay them again: 2,500 messages gave 15,700)."""
    pushed = push_keys(db, "t", 2500, 40)
    assert fdq.Producer(db).replay("t", 0) == 2500
    counts = _replayed(db, Keyspace().topic("t"))
    assert set(counts) == {i for i, _k, _b in pushed} and set(counts.values()) == {1}
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 5000
    ts = Keyspace().topic("t")
    assert replay.replay_runs(db, ts, "0:open") == {}              # finished: no progress left
    assert [ts.replays.unpack(k) for k, _v in scan(db, ts.replays.key())] == [("0:open", "done")]


def test_replay_killed_midway_resumes_without_duplicates(procs, db):
    pushed = push_keys(db, "t", 6000, 40)
    p = procs.start("replay", "replay", "--topic", "t")
    assert procs.readline(p, 60).strip() == "start"
    assert procs.readline(p, 60).startswith("chunk")     # at least one chunk committed
    procs.kill9(p)
    ts = Keyspace().topic("t")
    done = sum(_replayed(db, ts).values())
    assert 0 < done < 6000, f"the kill did not land midway: {done} replayed"
    assert fdq.Producer(db).replay("t", 0) == 6000 - done    # the same replay, resumed
    counts = _replayed(db, ts)
    assert set(counts) == {i for i, _k, _b in pushed} and set(counts.values()) == {1}
    assert replay.replay_runs(db, ts, "0:open") == {}
    # finished: the same replay again does nothing; again=True replays the window's 6,000
    # originals, not their 6,000 copies
    sup = fdq.Supervisor(db)
    assert fdq.Producer(db).replay("t", 0) == 0
    assert sup.replay("t", 0, again=True).replayed == 6000
    assert set(_replayed(db, ts).values()) == {2}


def test_replay_under_fault_injection_pushes_each_once(db, url):
    """Retryable errors and commit_unknown_result after real commits: each chunk's
    pushes and its progress commit together, so a retried chunk pushes nothing twice."""
    pushed = push_keys(db, "t", 3000, 40)
    faulty = fdq.connect(with_faults(url, 0.3, 11))
    assert fdq.Producer(faulty).replay("t", 0) == 3000
    counts = _replayed(db, Keyspace().topic("t"))
    assert set(counts) == {i for i, _k, _b in pushed} and set(counts.values()) == {1}
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 6000


def test_running_the_same_replay_again_does_not_compound(db):
    """``fdq replay r --start T0`` three times gave 100, 200, 400: each run replayed the
    copies the earlier ones had pushed into the window. Now the same replay (its id:
    its window) runs once; again=True replays the originals again, never copies."""
    ids = {r.id for r in fdq.Producer(db).push_many("t", [fdq.Envelope(f"m{i}".encode()) for i in range(100)])}
    p, sup = fdq.Producer(db), fdq.Supervisor(db)
    assert [p.replay("t", 0) for _ in range(3)] == [100, 0, 0]
    again = sup.replay("t", 0)
    assert (again.replay_id, again.replayed, again.finished["count"]) == ("0:open", 0, 100)
    assert again.finished["finished_ms"] > 0
    assert sup.stats("t")["counters"]["inserted"] == 200
    r = sup.replay("t", 0, again=True)
    assert (r.replayed, r.skipped_replays) == (100, 100)
    counts = _replayed(db, Keyspace().topic("t"))
    assert set(counts) == ids and set(counts.values()) == {2}       # copies of originals only
    # another id is another replay; include_replays takes the copies too
    r = sup.replay("t", 0, replay_id="with-copies", include_replays=True)
    assert (r.replay_id, r.replayed, r.skipped_replays) == ("with-copies", 300, 0)
    assert sup.stats("t")["counters"]["inserted"] == 600
    with pytest.raises(fdq.ConfigError, match="invalid replay id"):
        sup.replay("t", 0, replay_id="a/b")


def test_a_dry_run_changes_nothing_and_counts_what_the_replay_pushes(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "keyed", fdq.SubscriptionConfig(filter_shard_key="a*"))
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(f"m{i}".encode(), shard_key="a1" if i % 3 == 0 else None) for i in range(30)])
    assert sup.replay("t", 0, replay_id="first").replayed == 30
    before = scan(db, b"")
    plan = sup.replay("t", 0, dry_run=True)
    assert scan(db, b"") == before
    assert plan == {"replay_id": "0:open", "window_ms": [0, None], "finished": None, "messages": 30,
                    "bytes": sum(len(f"m{i}") for i in range(30)), "skipped_replays": 30, "trimmed": 0,
                    "resumes": 0, "subscriptions": {"default": 30, "keyed": 10}}
    done = sup.replay("t", 0)
    assert (done.replayed, done.skipped_replays) == (plan["messages"], plan["skipped_replays"])
    plan = sup.replay("t", 0, dry_run=True)
    assert plan["finished"]["count"] == 30 and plan["messages"] == 0
    assert sup.replay("t", 0, dry_run=True, include_replays=True, again=True)["messages"] == 90


def test_a_replay_heartbeat_after_its_run_finished_writes_nothing(db):
    """The runner's heartbeat thread may commit a beat just after the run's finish
    removed its progress: the beat read nothing and left a counter of a finished run
    behind for good. A beat writes only while its run's progress record exists."""
    p = fdq.Producer(db)
    start = int(time.time() * 1000) - 1
    p.push_many("t", [fdq.Envelope(b"m%d" % i) for i in range(3)])
    fdq.Supervisor(db).replay("t", start)
    ts = Keyspace().topic("t")
    before = scan(db, ts.replays.key())
    replay_beat(db, ts, f"{start}:open", "0123456789abcdef")
    assert scan(db, ts.replays.key()) == before
