"""Core state changes (producer, membership, supervisor) found in an independent review:
long operations whose chunks could exceed FDB's 10 MB per transaction, ..."""
from __future__ import annotations

import os
import time

import fdq
from fdq.keyspace import Keyspace


SUBS = 9        # the default subscription and 8 more


def _fan_out_topic(db, name: str = "t"):
    s = fdq.Supervisor(db)
    s.create_topic(name, shards=2)
    for i in range(1, SUBS):
        s.create_subscription(name, f"s{i}")
    assert len(s.config(name).subs) == SUBS
    return s


def _drain_bodies(db, topic: str, sub: str, want: int, timeout: float = 30.0) -> list:
    c = fdq.Consumer(db, topic, subscription=sub, config=fdq.ConsumerConfig(ack_wait_s=600))
    got = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < want and time.monotonic() < deadline:
            for m in c.fetch(want - len(got), timeout=0.2):
                got.append(m.body)
                m.ack()
    finally:
        c.close()
    return got


def test_play_routes_a_big_message_after_smaller_ones_within_one_transaction_each(db):
    """A play chunk checked its byte budget (2 MB) only before each message, so a
    message a push had accepted (its copies for every subscription under 9 MB) routed
    after ~2 MB of others took the transaction past FDB's 10 MB: transaction_too_large,
    not retryable, the same chunk on every rerun: the topic could never be played."""
    s = _fan_out_topic(db)
    p = fdq.Producer(db)
    s.pause("t")
    small, big = os.urandom(222_000), os.urandom(900_000)
    p.push("t", small, shard_key="k")
    p.push("t", big, shard_key="k")
    assert s.play("t") == 2
    counters = s.stats("t")["counters"]
    assert (counters["inserted"], counters["routed"], counters["pending"]) == (2, 2, 0)
    assert not s.config("t").paused
    for sub in ("default", "s8"):
        assert _drain_bodies(db, "t", sub, 2) == [small, big]


def test_replay_of_a_big_message_after_smaller_ones_fits_its_transactions(db):
    """Same budget in a replay: a batch under 2 MB took one more message (its log copy
    and one per subscription) before checking, up to ~11 MB: the replay failed with
    transaction_too_large, and again on every rerun."""
    s = _fan_out_topic(db)
    p = fdq.Producer(db)
    start = int(time.time() * 1000) - 1
    small, big = os.urandom(199_000), os.urandom(900_000)
    p.push("t", small, shard_key="k")
    p.push("t", big, shard_key="k")
    assert _drain_bodies(db, "t", "s3", 2) == [small, big]
    assert p.replay("t", start) == 2
    assert _drain_bodies(db, "t", "s3", 2) == [small, big]
    assert fdq.Supervisor(db).stats("t")["subscriptions"]["s5"]["backlog"] == 4
