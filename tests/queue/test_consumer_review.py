"""Consumer-side guarantees found wanting in review: each test failed before its fix."""
from __future__ import annotations

import fdq
from fdq.errors import LeaseLost

from qhelpers import sub_stats, wait_for

FAST = dict(heartbeat_interval_s=0.2, zombie_timeout_s=1.5, poll_interval_s=0.05, lease_check_interval_s=0.05)


def test_close_returns_only_its_own_leases(db):
    """A consumer that took over a shard observes the leases another live consumer still
    holds there (to expire them after their ack wait). Closing it must return only the
    leases it took itself: naking the other's would redeliver them long before their ack
    wait, while their holder is still working on them (and its ack then fails)."""
    fdq.Supervisor(db).create_topic("t", shards=2)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(20)])
    holder = fdq.Consumer(db, "t", consumer_id="holder", config=fdq.ConsumerConfig(ack_wait_s=600, **FAST))
    try:
        held = []
        wait_for(lambda: held.extend(holder.fetch(100, timeout=0.2)) or len(held) == 20, 30,
                 what="the holder leasing every message")
        joiner = fdq.Consumer(db, "t", consumer_id="joiner", config=fdq.ConsumerConfig(ack_wait_s=600, **FAST))
        try:
            [(tag, n)] = joiner.owned_shards
            there = sum(1 for m in held if m.shard == n)
            assert there > 0
            # The joiner's lease check has seen the holder's leases on its shard.
            wait_for(lambda: len(joiner._leases) == there, 30, what="the joiner observing the held leases")
        finally:
            joiner.close()
        assert sub_stats(db, "t")["in_flight"] == 20, "the joiner's close returned the holder's leases"
        try:
            holder.ack_many(held)
        except LeaseLost as e:
            raise AssertionError(f"leases returned under their holder: {e}") from None
        s = sub_stats(db, "t")
        assert (s["backlog"], s["in_flight"]) == (0, 0)
    finally:
        holder.close()
