"""Retention of the "all" log by size and by age, across buckets a reshard left behind;
queued messages are untouched, replay reads every bucket, and the exact ``log_bytes``
through trims, races and fault injection."""
from __future__ import annotations

import time

import pytest

import fdq
from fdq.ops.retention import expire_markers_chunk
from fdq.ops import retention as sv
from fdq.config import CHUNK
from fdq.engine import sqlite as engine_sqlite
from fdq.keyspace import Keyspace
from fdq.ops.topics import update_topic_config
from fdq.log import iter_window, log_buckets

from fdqtest import database_url, engine_errors, key_on_shard, log_bytes, scan, with_faults
from ophelpers import consume


def _log_ids(db, ts) -> list:
    r = ts.log.range()
    tr = db.create_transaction()
    return sorted(ts.log.unpack(kv.key)[1].to_bytes().hex() for kv in tr.snapshot.get_range(r.start, r.stop))


def test_retention_bytes_keeps_the_newest_entries(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4, retention_bytes=60_000)
    p = fdq.Producer(db)
    ids = []
    for i in range(10):
        ids += [r.id for r in p.push_many("t", [fdq.Envelope(b"x" * 1000, shard_key=f"k{j}") for j in range(20)])]
    ts = Keyspace().topic("t")
    deleted = sup.trim("t")
    kept = _log_ids(db, ts)
    assert deleted == 200 - len(kept) and 0 < len(kept) < 200
    assert len(kept) * 1000 <= 60_000                      # the bodies alone fit the budget
    assert kept == sorted(ids)[-len(kept):]                # oldest first: the newest stay
    assert sup.stats("t")["subscriptions"]["default"]["backlog"] == 200    # queues untouched
    assert sup.trim("t") == 0                              # re-running: nothing more


def test_trim_and_replay_cover_buckets_a_shrinking_reshard_left(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=8)
    p = fdq.Producer(db)
    old = [r.id for r in p.push_many("t", [fdq.Envelope(b"o", shard_key=f"k{j}") for j in range(40)])]
    sup.rebalance("t", shards=2)                           # log entries stay in buckets 0..7
    assert fdq.Producer(db).replay("t", 0) == 40           # replay reads every bucket
    ts = Keyspace().topic("t")
    assert set(old) <= set(_log_ids(db, ts))
    cutoff = 2 ** 62                                       # everything is older than this
    sup.trim("t", before_ms=cutoff)
    assert _log_ids(db, ts) == []


def _entries(db, ts) -> list:
    """[(position, key, value)] of the log entries, in log (versionstamp) order."""
    return sorted((k[-12:], k, v) for k, v in scan(db, ts.log.key()))


def _push_every_kind(db, topic: str, rounds: int = 2):
    p = fdq.Producer(db)
    for r in range(rounds):
        p.push_many(topic, [fdq.Envelope(b"p" * (10 + i), shard_key=f"k{i}") for i in range(30)])   # plain
        p.push_many(topic, [fdq.Envelope(b"u" * 20) for _ in range(10)])                            # unkeyed
        p.push(topic, b"id", msg_id=f"m{r}")
        p.push(topic, b"h", headers={"a": "b"})
        p.push(topic, b"d", delay=60)
        p.push(topic, b"L" * 250_000, shard_key="big")        # three body chunks
        p.push(topic, b"M" * 90_000 + b"m")                   # two, the last of one byte


@pytest.fixture
def coarse_estimate(monkeypatch):
    """FDB's ``get_estimated_range_size_bytes`` is sampled: 0 for a range under a few MB
    (fdb-semantics.md). The engine's is exact; this gives it FDB's coarseness and counts
    the calls."""
    calls = []
    real = engine_sqlite._ReadView.get_estimated_range_size_bytes

    def coarse(self, begin, end):
        calls.append((begin, end))
        size = real(self, begin, end).wait()
        return engine_sqlite.Future.ready(size if size >= 3_000_000 else 0)
    monkeypatch.setattr(engine_sqlite._ReadView, "get_estimated_range_size_bytes", coarse)
    return calls


def test_log_bytes_counts_every_kind_of_push_exactly(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4, extend=True)
    ts = Keyspace().topic("t")
    _push_every_kind(db, "t")
    sup.pause("t")
    _push_every_kind(db, "t", rounds=1)          # pending entries (routed later by play)
    sup.play("t")
    st = sup.stats("t")["counters"]
    assert st["log_bytes"] == log_bytes(db, ts) > 0
    # Trims of either kind subtract exactly what they delete.
    cut = fdq.log.Record.decode(_entries(db, ts)[45][2]).ts_ms     # (a push_many shares one)
    assert sup.trim("t", before_ms=cut) > 0
    assert sup.stats("t")["counters"]["log_bytes"] == log_bytes(db, ts)
    update_topic_config(db, ts, retention_bytes=log_bytes(db, ts) // 2)
    assert sup.trim("t") > 0
    assert sup.stats("t")["counters"]["log_bytes"] == log_bytes(db, ts)
    sup.trim("t", before_ms=2 ** 62)
    assert _entries(db, ts) == [] and sup.stats("t")["counters"]["log_bytes"] == 0


def test_trim_by_size_is_exact_and_needs_no_estimate(db, coarse_estimate):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4, retention_bytes=100_000)
    ts = Keyspace().topic("t")
    p = fdq.Producer(db)
    for i in range(12):
        p.push_many("t", [fdq.Envelope(b"x" * (500 + j), shard_key=f"k{j}") for j in range(20)])
    p.push("t", b"B" * 200_000)                     # chunked, among the oldest to go
    for i in range(4):
        p.push_many("t", [fdq.Envelope(b"y" * 700, shard_key=f"k{j}") for j in range(20)])
    before = _entries(db, ts)
    chunks = scan(db, ts.all_chunks.key())
    assert log_bytes(db, ts) > 300_000
    deleted = sup.trim("t")
    after = _entries(db, ts)
    size = log_bytes(db, ts)
    assert coarse_estimate == []                    # the counter alone decided
    assert deleted == len(before) - len(after) > 0
    assert after == before[-len(after):]            # the oldest went, the newest stay
    # Exactly as many as needed: the log fits, and would not with the last one deleted.
    pos, key, value = before[-len(after) - 1]
    last = len(key) + len(value) + sum(len(k) + len(v) for k, v in chunks
                                       if ts.all_chunks.unpack(k)[1].to_bytes() == pos)
    assert size <= 100_000 < size + last
    assert sup.stats("t")["counters"]["log_bytes"] == size
    assert sup.trim("t") == 0


def test_trim_under_fault_injection_keeps_the_counter_exact(tmp_path):
    url = database_url(tmp_path / "f.db")
    db = fdq.connect(url)
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=3, extend=True)
    ts = Keyspace().topic("t")
    _push_every_kind(db, "t", rounds=3)
    faulty = fdq.connect(with_faults(url, 0.3, 7))
    fs = fdq.Supervisor(faulty)
    budget = log_bytes(db, ts) // 3
    update_topic_config(db, ts, retention_bytes=budget)
    assert fs.trim("t") > 0
    assert sup.stats("t")["counters"]["log_bytes"] == log_bytes(db, ts) <= budget
    cut = fdq.log.Record.decode(_entries(db, ts)[-1][2]).ts_ms      # all but the last push
    assert fs.trim("t", before_ms=cut) > 0
    assert sup.stats("t")["counters"]["log_bytes"] == log_bytes(db, ts)


@pytest.mark.parametrize("how", ["age", "size"])
def test_a_trim_killed_mid_way_leaves_the_counter_exact_and_a_rerun_finishes(procs, db, how):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    ts = Keyspace().topic("t")
    p = fdq.Producer(db)
    for i in range(24):
        p.push_many("t", [fdq.Envelope(b"w" * 200, shard_key=f"k{i}-{j}") for j in range(500)])
    cut_ms = int(time.time() * 1000) + 1          # everything pushed so far is older
    while int(time.time() * 1000) <= cut_ms:      # (a ms) and what follows is not
        time.sleep(0.001)
    for i in range(2):
        p.push_many("t", [fdq.Envelope(b"n" * 200, shard_key=f"n{j}") for j in range(200)])
    total = len(_entries(db, ts))
    args = []
    if how == "age":
        args = ["--before-ms", cut_ms]
    else:
        budget = log_bytes(db, ts) // 10
        update_topic_config(db, ts, retention_bytes=budget)
    w = procs.start("trim", "trim1", *args)
    assert procs.readline(w, 60).strip() == "start"
    first = procs.readline(w, 60).strip()
    assert first.startswith("chunk "), first
    procs.kill9(w)                                   # mid-way: more chunks were to come
    left = len(_entries(db, ts))
    assert 400 < left < total, "the kill did not land mid-way"
    assert sup.stats("t")["counters"]["log_bytes"] == log_bytes(db, ts)
    w2 = procs.start("trim", "trim2", *args)
    procs.wait(w2, 120)
    assert sup.stats("t")["counters"]["log_bytes"] == log_bytes(db, ts)
    if how == "age":
        assert len(_entries(db, ts)) == 400
        assert all(fdq.log.Record.decode(v).ts_ms >= cut_ms for _p, _k, v in _entries(db, ts))
    else:
        assert log_bytes(db, ts) <= budget
        assert log_bytes(db, ts) > budget - 1000    # no more than needed (entries ~250 B)


def test_a_producer_clock_running_ahead_does_not_hold_back_trim_by_age(procs, db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)                  # one bucket: the skewed entry comes first
    ts = Keyspace().topic("t")
    w = procs.start("producer", "ahead", "--count", 1, "--batch", 1, "--skew-s", 3600)
    procs.wait(w, 60)
    p = fdq.Producer(db)
    old = [r.id for r in p.push_many("t", [fdq.Envelope(b"o%d" % i) for i in range(50)])]
    cut_ms = int(time.time() * 1000) + 1
    while int(time.time() * 1000) <= cut_ms:
        time.sleep(0.001)
    young = [r.id for r in p.push_many("t", [fdq.Envelope(b"y%d" % i) for i in range(5)])]
    assert sup.trim("t", before_ms=cut_ms) == 50     # every old one, past the skewed entry
    left = [(k[-12:].hex(), fdq.log.Record.decode(v)) for _p, k, v in _entries(db, ts)]
    assert [vs for vs, _r in left[1:]] == young      # the young ones stay
    assert left[0][1].ts_ms > cut_ms + 3_000_000     # and the one from an hour ahead
    assert not set(old) & {vs for vs, _r in left}
    assert sup.stats("t")["counters"]["log_bytes"] == log_bytes(db, ts)


def test_trim_by_size_drops_time_index_entries_of_deleted_entries(db, monkeypatch):
    """Index entries are written once a minute per producer: producers with clocks a
    minute apart write one each. Trim by size alone must drop the entries that point
    before the oldest entry left (they grew without bound), and windows still work."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    real = time.time
    base = real() - 3600
    ids = []
    for m in range(6):                               # six minutes, one producer each
        monkeypatch.setattr(time, "time", lambda m=m: base + 60 * m)
        ids.append([r.id for r in fdq.Producer(db).push_many(
            "t", [fdq.Envelope(b"q" * 300, shard_key=f"k{j}") for j in range(20)])])
    monkeypatch.setattr(time, "time", real)
    assert len(scan(db, ts.time_index.key())) == 6
    update_topic_config(db, ts, retention_bytes=log_bytes(db, ts) // 3)
    sup.trim("t")
    oldest = _entries(db, ts)[0][0]
    index = [ts.time_index.unpack(k)[1].to_bytes()[-12:] for k, _v in scan(db, ts.time_index.key())]
    assert 0 < len(index) < 6 and all(vs >= oldest for vs in index)
    assert index[0] == bytes.fromhex(ids[6 - len(index)][0])
    # A window read still finds what is left, from any start time.
    left = {bytes(k[-12:]).hex() for _p, k, _v in _entries(db, ts)}
    for start in (None, int(base * 1000), int((base + 60 * 5) * 1000)):
        got = {vs.to_bytes().hex() for vs, _b, _r in iter_window(db, ts, log_buckets(db, ts), start, None)}
        want = left if start is None or start <= base * 1000 else set(ids[5]) & left
        assert got >= want
    assert fdq.Supervisor(db).stats(ts.name)["counters"]["log_bytes"] == log_bytes(db, ts)


def test_a_size_trim_never_acts_on_a_size_another_trim_lowered_meanwhile(db):
    """Trim by size reads ``log_bytes`` by snapshot (pushes must not abort it): a trim by
    age committing between that read and its commit would make it delete more than
    needed. The two conflict (the ``trimmed`` counter): it retries with the new size."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    ka = key_on_shard(0, 2)
    kb = key_on_shard(1, 2)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(b"A" * 100, shard_key=ka) for _ in range(20)])     # older, bucket 0
    p.push_many("t", [fdq.Envelope(b"B" * 100, shard_key=kb) for _ in range(20)])     # bucket 1
    total = log_bytes(db, ts)
    budget = total * 3 // 4              # a quarter too much: some of bucket 0's entries go
    oldest = [(0, ts.log.unpack(k)[1]) for _p, k, _v in _entries(db, ts)[:20]]
    tr = db.create_transaction()
    deleted, _freed, _done = sv.trim_oldest_chunk(tr, ts, oldest, budget)   # not committed yet
    assert deleted > 0
    # Meanwhile a trim by age empties bucket 1: the log now fits without deleting anything.
    n, _f, _last, _d = sv.trim_bucket_chunk(db, ts, 1, 2 ** 62, CHUNK)
    assert n == 20 and log_bytes(db, ts) <= budget
    with pytest.raises(engine_errors()) as e:
        tr.commit().wait()
    assert e.value.code == 1020
    assert sv.trim_oldest_chunk(db, ts, oldest, budget)[0] == 0    # its retry deletes nothing
    assert len(_entries(db, ts)) == 20
    assert fdq.Supervisor(db).stats(ts.name)["counters"]["log_bytes"] == log_bytes(db, ts)


@pytest.mark.parametrize("how", ["age", "size"])
def test_a_trim_deletes_a_run_of_entries_as_one_range(db, how):
    """A trim deleted entry by entry, each with a read conflict key: a transaction's
    mutations and conflict ranges (what FDB's resolvers and logs carry) grew with every
    entry it trimmed. A run of consecutive entries is one clear and one conflict range:
    trimming ten times the entries costs the same."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    ts = Keyspace().topic("t")
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m" * 50) for _ in range(400)])
    entries = [(0, ts.log.unpack(k)[1]) for _p, k, _v in _entries(db, ts)]

    def cost(n):
        tr = db.create_transaction()
        if how == "age":
            deleted = sv.trim_bucket_chunk(tr, ts, 0, 2 ** 62, n)[0]
        else:
            deleted = sv.trim_oldest_chunk(tr, ts, entries[:n], 0)[0]
        assert deleted == n
        size = tr.get_approximate_size().wait()
        tr.cancel()
        return size
    small, large = cost(20), cost(400)
    assert large < small * 1.5, (small, large)
    sup.trim("t", before_ms=2 ** 62)
    assert _entries(db, ts) == [] and log_bytes(db, ts) == 0


def test_two_trims_of_one_run_conflict_and_the_counter_stays_exact(db):
    """Runs carry a read conflict range over what they clear: two trims of the same
    entries racing, one commits and the other retries and finds them gone."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    ts = Keyspace().topic("t")
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m" * 50) for _ in range(30)])
    tr = db.create_transaction()
    assert sv.trim_bucket_chunk(tr, ts, 0, 2 ** 62, 10)[0] == 10     # not committed yet
    assert sv.trim_bucket_chunk(db, ts, 0, 2 ** 62, 20)[0] == 20
    with pytest.raises(engine_errors()) as e:
        tr.commit().wait()
    assert e.value.code == 1020
    assert sv.trim_bucket_chunk(db, ts, 0, 2 ** 62, 10)[0] == 10      # its retry: the ten left
    assert _entries(db, ts) == []
    assert sup.stats("t")["counters"]["log_bytes"] == log_bytes(db, ts) == 0


@pytest.mark.parametrize("how", ["age", "size"])
def test_trim_keeps_messages_pushed_while_paused(db, how):
    """Retention deleted log entries still waiting in the pending area (pushed while
    paused): play then found no entry and dropped them, lost for good (inserted >
    routed forever). Big bodies too: their chunks are needed to route them."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4, retention_bytes=1000 if how == "size" else None)
    p = fdq.Producer(db)
    before = [r.id for r in p.push_many("t", [fdq.Envelope(b"o" * 300, shard_key=f"k{j}") for j in range(10)])]
    sup.pause("t")
    paused = [r.id for r in p.push_many("t", [fdq.Envelope(b"x" * 300, shard_key=f"k{j}") for j in range(10)])]
    big = b"B" * 250_000    # split into body chunks
    paused.append(p.push("t", big, shard_key="k0").id)
    sup.trim("t", before_ms=2 ** 62 if how == "age" else None)
    assert sup.play("t") == len(paused)
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (21, 21, 0)
    got = consume(db, 21, 30)
    assert sorted(i for i, _k, _b in got) == sorted(before + paused)
    assert [b for i, _k, b in got if i == paused[-1]] == [big]


def test_expiring_old_markers_does_not_conflict_with_pushes_meanwhile(db):
    """Trim expires push markers older than their window from a by-version index split
    in parts. A part shorter than the batch is read to its end: read with a conflict,
    every push appending to that part meanwhile made the expiry retry (under a steady
    stream, for long). Read by snapshot, with a conflict on each entry deleted, an
    expiry commits across pushes; a concurrent expiry of the same entries still
    conflicts."""
    p = fdq.Producer(db)
    for i in range(20):
        p.push("t", b"old %d" % i)
    ts = Keyspace().topic("t")
    tr = db.create_transaction()
    assert expire_markers_chunk(tr, ts, 1 << 62, 1000) == 20
    for i in range(20):
        p.push("t", b"new %d" % i)          # their markers land in the parts just read
    tr.commit().wait()                      # before: 1020
    assert len(scan(db, ts.marks_by_version.key())) == 20
    tr = db.create_transaction()
    assert expire_markers_chunk(tr, ts, 1 << 62, 1000) == 20
    assert expire_markers_chunk(db, ts, 1 << 62, 1000) == 20
    with pytest.raises(engine_errors()) as info:
        tr.commit().wait()
    assert info.value.code == 1020
    assert scan(db, ts.marks_by_version.key()) == []
