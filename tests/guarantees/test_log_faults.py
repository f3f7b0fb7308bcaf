"""Reading the "all" log survives retryable engine errors (found by the chaos test: a
replay on a fault-injecting connection died of ``process_behind``, 1037, raised by a
log read that ran in a bare transaction, with no retry)."""
from __future__ import annotations

import time

import pytest

import fdq
from fdq import log
from fdq.keyspace import Keyspace

from fdqtest import replay_counts, with_faults


def _fill(db, n=300):
    fdq.Supervisor(db).create_topic("t", shards=4)
    p = fdq.Producer(db)
    envs = [fdq.Envelope(b"m%d" % i, shard_key=f"k{i % 5}") for i in range(n - 1)]
    envs.append(fdq.Envelope(b"big" * 60_000, shard_key="k0"))     # a body split across keys
    return [r.id for r in p.push_many("t", envs)]


@pytest.mark.parametrize("seed", [1, 5, 6])    # seeds that injected a read error into the replay's log reads
def test_replay_on_a_faulty_connection(db, url, seed):
    ids = _fill(db)
    faulty = fdq.connect(with_faults(url, 0.5, seed))
    assert fdq.Producer(faulty).replay("t", 0) == len(ids)
    st = fdq.Supervisor(db).stats("t")["counters"]
    assert st["inserted"] == 2 * len(ids)


def test_log_reads_on_a_faulty_connection(db, url):
    ids = _fill(db)
    faulty = fdq.connect(with_faults(url, 0.2, 4))
    ts = Keyspace().topic("t")
    for _ in range(5):     # each read faces injected errors many times over
        got = [fdq.keyspace.message_id(vs) for vs, _b, _r in log.iter_window(faulty, ts, log.log_buckets(faulty, ts),
                                                                             None, None, chunk=50)]
        assert got == ids
        last = log.last_positions(faulty, ts)
        assert max(last.values()).hex() == ids[-1]
        cursors, n = log.advance_positions(faulty, ts, {}, 10_000)
        assert n == len(ids) and cursors == last
        assert log.position_for_time(faulty, ts, 0) is not None and log.position_after_time(faulty, ts, 0) is not None
        rows = sum(len(keys) for b in log.log_buckets(faulty, ts)
                   for keys, _raws in log.scan_entries(faulty, ts, *log.bucket_range(ts, b), batch=16))
        assert rows == len(ids)
        rec_vs = [(vs, r) for vs, _b, r in log.iter_window(db, ts, 4, None, None) if r.nchunks]
        assert [log.body_of(faulty, ts, vs, r, strict=True) for vs, r in rec_vs] == [b"big" * 60_000]


def test_stats_and_trim_on_a_faulty_connection(db, url):
    """stats (a snapshot of counters and point reads) and trim (its read version and
    size estimate) are reads too."""
    ids = _fill(db)
    faulty = fdq.connect(with_faults(url, 0.5, 2))
    sup = fdq.Supervisor(faulty)
    for _ in range(20):
        assert sup.stats("t")["counters"]["inserted"] == len(ids)
    fdq.Supervisor(db).play("t")
    assert sup.trim("t", before_ms=0) == 0


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
    counts = replay_counts(db, "t")
    assert set(counts) == set(ids) and set(counts.values()) == {1}


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
