"""promote_due returned early at the first delayed message not yet due without
subtracting the ones it had already moved: the shard's ``delayed`` counter drifted
upward (stats showed delayed messages that did not exist; found in review)."""
from __future__ import annotations

import time

import fdq

from qhelpers import sub_stats

FAST = dict(heartbeat_interval_s=0.2, zombie_timeout_s=1.5, poll_interval_s=0.05, lease_check_interval_s=0.05)


def test_delayed_counter_exact_when_only_some_are_due(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    p.push("t", b"soon", delay=0.2)
    p.push("t", b"later", delay=600)
    with fdq.Consumer(db, "t", config=fdq.ConsumerConfig(**FAST)) as c:
        got = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            got = c.fetch(10, timeout=0.2)
        assert [m.body for m in got] == [b"soon"]
        c.ack_many(got)
        assert sub_stats(db, "t")["delayed"] == 1       # only "later" is delayed
