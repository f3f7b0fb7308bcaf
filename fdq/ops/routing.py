"""Where a message goes: one rule for every place that puts a message in a shard.

A keyed message's shard is ``blake2b-64(shard key) mod shards`` (docs/design.md §3). An unkeyed
message's is its *home* mod ``shards``: the shard its push chose, kept in its record
(``Record.home``). Push picks homes in runs of ``STICKY_RUN`` messages on one shard from a
random start (Kafka's sticky partitioner, KIP-480): even over time, and a batch touches a
few shards' key ranges instead of every one of them.

Every copy made later (play, catch-up, reset, DLQ redrive, reshard, requeue) goes through
:func:`target`, so a copy lands where the original is: a reset's or a redrive's
"is it already queued?" check looks in the right shard, and a reshard that shrinks and
grows again sends a message back to its home.
"""
from __future__ import annotations

import random

from ..headers import dispatch_tag
from ..keyspace.codec import Record, shard_of

# Unkeyed messages of one transaction: runs of this many on one shard.
STICKY_RUN = 100


def spread_start() -> int:
    """A push transaction's random start for :func:`home_for` (drawn once, before its
    retry loop: a retried transaction routes as its first attempt did)."""
    return random.randrange(1 << 30)


def home_for(spread: int, uv: int, shards: int) -> int:
    """The shard an unkeyed push picks for its message ``uv`` (its index in the
    transaction): runs of ``STICKY_RUN`` on one shard from the random start ``spread``."""
    return (spread + uv // STICKY_RUN) % shards


def shard_for(shard_key: str | None, shards: int, home: int | None = None) -> int:
    """A message's shard among ``shards``: blake2b-64 of its key mod ``shards``;
    unkeyed, ``home % shards``."""
    if shard_key is not None:
        return shard_of(shard_key, shards)
    return home % shards


def target(rec: Record, shards: int) -> tuple:
    """``(dispatch tag, shard)`` of a stored message among ``shards``: for play,
    catch-up, reset, redrive, reshard and requeue."""
    return dispatch_tag(rec.headers), shard_for(rec.shard_key, shards, rec.home)
