"""A nak committed during a reshard, after the reshard's pass over that shard's
ready area and before its pass over the leased area, requeues the message into the old
shard's ready queue, which the reshard never visits again: with fewer shards the old
shard is gone and the message was never delivered (lost, found in review). A requeue
now goes to the shard the reshard moves the message to, ready or delayed."""
from __future__ import annotations

import pytest

import fdq
from fdq import supervisor as sv
from fdq.keyspace import Keyspace
from fdq.keyspace.codec import shard_of

from fdqtest import sub_stats


@pytest.mark.parametrize("delay", [None, 0.2])
def test_nak_during_reshard_is_not_stranded_in_a_removed_shard(db, delay):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    key = next(f"k{i}" for i in range(100) if shard_of(f"k{i}", 2) == 1)
    [pushed] = fdq.Producer(db).push_many("t", [fdq.Envelope(b"x", shard_key=key)])
    c = fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=600))
    got = []
    for _ in range(50):
        got += c.fetch(1, timeout=0.2)
        if got:
            break
    [m] = got
    ts = Keyspace().topic("t")
    sv.reshard_begin(db, ts, 1)
    for n in range(2):
        sv.reshard_chunk(db, ts, "default", "", n, "ready", 1, 500)
    m.nak(delay)                              # the handler gives up meanwhile
    for n in range(2):
        for area in ("delayed", "leased"):
            sv.reshard_chunk(db, ts, "default", "", n, area, 1, 500)
    sv.reshard_finish(db, ts)
    sup.play("t")
    back = []
    for _ in range(50):
        back += c.fetch(10, timeout=0.2)
        if back:
            break
    c.close()
    assert [b.id for b in back] == [pushed.id], f"message stranded; stats {sub_stats(db, 't')}"
