"""Found in the review of the session's diff (rv-diff9): each test failed before its fix."""
from __future__ import annotations

import pytest

import fdq


@pytest.mark.parametrize("mode", ["at-least-once", "at-most-once"])
def test_tail_of_an_ack_policy_none_subscription(run, sup, mode):
    """``fdq tail --subscription S`` where S has ack_policy='none' (fetch takes its
    messages: done when delivered, nothing to ack): at-most-once acked each taken
    message before printing it, which raised, so the batch fetched was lost unprinted
    (exit 1); at-least-once printed them, then failed acking them (exit 1). Both print
    every message and exit 0."""
    sup.create_topic("t", shards=1)
    sup.create_subscription("t", "s", fdq.SubscriptionConfig(ack_policy="none"))
    fdq.Producer(sup.db).push_many("t", [fdq.Envelope(b"m%d" % i) for i in range(5)])
    rows = [line for line in run("tail", "t", "--subscription", "s", "--count", "5", "--mode", mode,
                                 "--json").stdout.splitlines() if line]
    import json
    assert [json.loads(r)["body"] for r in rows] == ["m%d" % i for i in range(5)]
    assert sup.stats("t")["subscriptions"]["s"]["backlog"] == 0
