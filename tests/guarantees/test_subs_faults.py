"""Subscription state changes survive fault injection: retryable errors before commit
and commit_unknown_result after a real commit (each function is safe to re-run)."""
from functools import partial

import pytest

import fdq

import fdqtest
from fdqtest import database_url, fast


# The subscription tests' consumer: FAST with slower polls and lease checks.
SUBS_FAST = fast(lease_check_interval_s=0.2, poll_interval_s=0.1)
# Everything a subscription delivers until it stays empty for idle_s (acked, unless settle=None).
drain = partial(fdqtest.drain, idle_s=1.0, batch=500, settle="ack_many", create=False, config=SUBS_FAST)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_create_catch_up_reset_delete_under_faults(tmp_path, seed):
    db = fdq.connect(database_url(tmp_path / "f.db", fault_injection=0.2, seed=seed))
    clean = fdq.connect(database_url(tmp_path / "f.db"))   # consumers read without faults
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=3)
    p = fdq.Producer(db)
    first = [r.id for r in p.push_many("t", [fdq.Envelope(f"{i}".encode(), shard_key=f"k{i}") for i in range(1200)])]
    sup.create_subscription("t", "s")            # catch-up: 3 chunks of 500, faults in each
    second = [r.id for r in p.push_many("t", [fdq.Envelope(b"x") for _ in range(50)])]
    got = [m.id for m in drain(clean, "t", "s", idle_s=0.5)]
    assert sorted(got) == sorted(first + second)
    sup.reset("t", "s", 0)
    got = [m.id for m in drain(clean, "t", "s", idle_s=0.5)]
    assert sorted(got) == sorted(first + second)
    st = sup.stats("t")["subscriptions"]["s"]
    assert st["backlog"] == 0 and st["in_flight"] == 0
    sup.update_subscription("t", "s", description="still here")
    sup.delete_subscription("t", "s")
    assert sup.config("t").subs == ("default",)
    assert sup.stats("t")["subscriptions"]["default"]["backlog"] == len(first + second)
