"""Retention of the "all" log by size and by age, across buckets a reshard left behind;
queued messages are untouched, and replay reads every bucket."""
from __future__ import annotations

import fdq
from fdq.keyspace import Keyspace


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
