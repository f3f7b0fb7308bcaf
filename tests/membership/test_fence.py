"""The owner-epoch fence on its own, deterministically: a transaction a consumer began
while it owned a shard cannot commit once the shard moved, even when nobody has touched
the messages it took. (In the multi-process SIGSTOP test of test_kill9.py the new owner
usually takes the same messages first, so the per-key read conflicts alone abort the
stale commit: that test passes with ``ensure_owner`` removed. Here only the fence can.)
Real engine; the membership steps a takeover commits, called in their order."""
from __future__ import annotations

import os
import time

import pytest

import fdq
from fdq.ops import membership
from fdq.ops import queue
from fdq.keyspace import Keyspace

from fdqtest import engine_errors, sub_stats


def _owner(db, ts):
    return membership.read_owners(db, ts, "default")[("", 0)]


@pytest.mark.parametrize("how", ["take", "lease"])
@pytest.mark.parametrize("moved_by", ["zombie", "replacement"])
def test_a_transaction_begun_before_the_shard_moved_cannot_commit(db, how, moved_by):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    ids = [r.id for r in fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i, shard_key="k")
                                                          for i in range(5)])]
    ts = Keyspace().topic("t")
    membership.join(db, ts, "default", "a", {"id": "a", "incarnation": "a-1"})
    owner, epoch = _owner(db, ts)
    assert owner == "a"
    shard = ts.shard("default", "", 0)

    # a's transaction takes the head of the queue; a stalls before its commit
    stale = db.create_transaction()
    if how == "take":
        taken = queue.take_batch(stale, ts, shard, "a", epoch, 2, max_deliver=5)
    else:
        taken = queue.lease_batch(stale, ts, shard, "a", epoch, 2, os.urandom(12), 30_000, max_deliver=5)
    assert [t.record.body for t in taken] == [b"m0", b"m1"]

    # meanwhile the shard moves: a is declared a zombie (b owns it now), or a
    # replacement instance joins under a's id (same owner id, new epoch)
    if moved_by == "zombie":
        membership.join(db, ts, "default", "b", {"id": "b"})
        hb = membership.read_members(db, ts, "default")["a"]["hb"]
        assert membership.declare_zombie(db, ts, "default", "a", hb)
        assert _owner(db, ts) == ("b", epoch + 1)
    else:
        membership.join(db, ts, "default", "a", {"id": "a", "incarnation": "a-2"})
        assert _owner(db, ts) == ("a", epoch + 1)
    # nobody touched m0 and m1: only the fence can stop the stale commit
    assert sub_stats(db, "t")["backlog"] == 5

    with pytest.raises(engine_errors()) as e:
        stale.commit().wait()
    assert e.value.code == 1020          # the shard record it read changed: a conflict
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["emitted"]) == (5, 0, 0)

    # the stale consumer's retry finds it is no longer the owner it was
    retry = db.create_transaction()
    with pytest.raises(fdq.LeaseLost):
        queue.take_batch(retry, ts, shard, "a", epoch, 2, max_deliver=5)
    retry.cancel()

    # the new owner gets every message, in push order
    new_owner, new_epoch = _owner(db, ts)
    got = queue.take_batch(db, ts, shard, new_owner, new_epoch, 10, max_deliver=5)
    assert [fdq.keyspace.message_id(t.vs) for t in got] == ids


def test_a_consumer_id_joining_again_fences_off_its_earlier_instance(db):
    """A consumer started with the ``consumer_id`` of one still running (a replacement
    for an instance that looked dead: a stable pod name, a partition) shared its
    identity: both owned every shard with the same epochs, so the earlier instance
    kept taking messages from shards it no longer solely owned (the fence checks the
    owner id and epoch only), and closing it removed the replacement's membership."""
    fdq.Supervisor(db).create_topic("t", shards=4)
    cfg = fdq.ConsumerConfig(ack_wait_s=600)
    old = fdq.Consumer(db, "t", consumer_id="w", config=cfg)
    assert len(old.owned_shards) == 4
    new = fdq.Consumer(db, "t", consumer_id="w", config=cfg)
    ts = Keyspace().topic("t")
    try:
        assert len(new.owned_shards) == 4
        deadline = time.monotonic() + 10
        while old.owned_shards and time.monotonic() < deadline:
            time.sleep(0.05)
        assert old.owned_shards == []
        fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i, shard_key=f"k{i}") for i in range(20)])
        assert old.fetch(20, timeout=0.5) == []
        old.close()         # leaves nothing of the replacement's membership
        assert set(membership.read_members(db, ts, "default")) == {"w"}
        assert {o for o, _e in membership.read_owners(db, ts, "default").values()} == {"w"}
        got = []
        deadline = time.monotonic() + 20
        while len(got) < 20 and time.monotonic() < deadline:
            for m in new.fetch(20, timeout=0.2):
                got.append(m.body)
                m.ack()
        assert sorted(got) == sorted(b"%d" % i for i in range(20))
    finally:
        old.close()
        new.close()
