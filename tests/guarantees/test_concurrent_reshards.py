"""Two supervisors changing the shard count at once (the soak runs two): one's rebalance
to N is overtaken, between two of its chunks, by another that finishes the reshard to N
and then perhaps begins or completes one to M. The first must not go on moving queues by
N, nor finish M's reshard for it: messages moved by a count the topic no longer has sit
in a shard their key does not map to (delivered out of their key's order) or in one that
is gone (never delivered). It stops with a ConfigError instead (or, N finished by the
other, has nothing left to do), and every message is delivered once, in its key's
order."""
from __future__ import annotations

import collections

import pytest

import fdq
from fdq.keyspace import Keyspace
from fdq.ops.reshard import reshard_begin

from fdqtest import wait_for

KEYS = 8


def _push(p, start, count):
    envs = [fdq.Envelope(f"{i}".encode(), shard_key=f"k{i % KEYS}") for i in range(start, start + count)]
    return [r.id for r in p.push_many("t", envs)]


def _drain_in_order(db, ids):
    """Take everything (one consumer, at most once: delivery order is queue order) and
    check each key's messages come in push order."""
    got = []
    with fdq.Consumer(db, "t", subscription="default") as c:
        def more():
            got.extend(c.fetch(500, timeout=0.2))
            return len(got) >= len(ids)
        wait_for(more, 30, what=f"all {len(ids)} messages delivered (got {len(got)})")
        for m in got:
            m.ack()
    assert sorted(m.id for m in got) == sorted(ids)
    by_key = collections.defaultdict(list)
    for m in got:
        by_key[m.shard_key].append(int(m.body))
    for key, seq in by_key.items():
        assert seq == sorted(seq), f"key {key}: delivered out of push order: {seq}"


@pytest.mark.parametrize("then", [3, 6, None], ids=["other-count-finished", "other-count-begun", "same-count-finished"])
def test_a_rebalance_overtaken_by_another_count_stops(db, then):
    sup, other = fdq.Supervisor(db), fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    p = fdq.Producer(db)
    ids = _push(p, 0, 400)
    overtaken = []

    def progress(_n):
        if overtaken:
            return
        overtaken.append(True)
        other.rebalance("t")                    # finishes the reshard to 9 (and plays)
        if then == 3:
            other.rebalance("t", shards=then)   # a whole reshard to another count
        elif then == 6:
            reshard_begin(db, Keyspace().topic("t"), 6)     # another one begun, not finished yet

    if then is None:
        assert sup.rebalance("t", shards=9, progress=progress).shards == 9
    else:
        with pytest.raises(fdq.ConfigError, match="no longer being resharded to 9 shards"):
            sup.rebalance("t", shards=9, progress=progress)
    assert overtaken
    if then == 6:
        assert sup.config("t").resharding_to == 6, "the overtaken run finished another's reshard"
        other.rebalance("t")
    config = sup.config("t")
    assert (config.shards, config.resharding_to) == (then or 9, None)
    ids += _push(p, 400, 80)
    _drain_in_order(db, ids)
