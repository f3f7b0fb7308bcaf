"""Review: reshard_chunk moves up to CHUNK (500) entries per transaction regardless of
their size: a shard holding ~125+ messages of 80 KB makes every chunk exceed the 10 MB
transaction limit (2101, not retryable); the rebalance fails and every rerun fails the
same way, leaving the topic resharding (nothing consumable). Pre-existing for the ready
and delayed areas; the leased area now moves lease records of up to 16 KB (or one
large message) each, 500 per chunk, too."""
from __future__ import annotations

import fdq
from fdq.keyspace.codec import shard_of


def test_reshard_of_a_backlog_of_large_messages_finishes(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    key = next(f"k{i}" for i in range(100) if shard_of(f"k{i}", 2) == 1)
    p = fdq.Producer(db)
    for _ in range(15):
        p.push_many("t", [fdq.Envelope(b"x" * 80_000, shard_key=key) for _ in range(10)])
    sup.rebalance("t", shards=2)
    assert sup.config("t").resharding_to is None and sup.config("t").shards == 2
