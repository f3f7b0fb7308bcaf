"""Many distinct dispatch tags: every tag has a shard per shard number, and a consumer
keeps a watch on each drained shard it owns, so a topic with hundreds of tags gives
one consumer thousands of watches. Closing it cancels them all."""
from __future__ import annotations

import time

import fdq
from fdq.headers import DISPATCH_TAG

from fdqtest import wait_for

TAGS = 600          # x 16 shards: 9,616 shards owned by the one consumer


def test_consumer_owning_thousands_of_tag_shards_closes_promptly(db):
    fdq.Supervisor(db).create_topic("t", shards=16, extend=True)
    p = fdq.Producer(db)
    for i in range(0, TAGS, 300):
        p.push_many("t", [fdq.Envelope(b"m%d" % j, headers={DISPATCH_TAG: f"tag{j}"})
                          for j in range(i, i + 300)])
    c = fdq.Consumer(db, "t", extend_support=True, on_error=lambda e: None,
                     config=fdq.ConsumerConfig(heartbeat_interval_s=0.5, poll_interval_s=0.1))
    try:
        assert len(c.owned_shards) == (TAGS + 1) * 16
        got = set()

        def step():
            for m in c.fetch(500, timeout=0.5):
                got.add(m.body)
                m.ack()
            return len(got) == TAGS
        wait_for(step, 120, f"{TAGS} messages of {TAGS} tags")
    finally:
        t0 = time.monotonic()
        c.close()
        took = time.monotonic() - t0
    # Cancelling a watch scanned every watch (quadratic): 24 s for 8,016 watches, ~50 s
    # here, on an idle 2-core machine; ~2 s now.
    assert took < 12, f"close took {took:.1f}s"
