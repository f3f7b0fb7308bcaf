"""A consumer's configuration: intervals too short to run on are refused (a loop of a
microsecond spins and raises false stall alarms), and the stall alarm says how long
in figures that show it."""
from __future__ import annotations

import re

import pytest

import fdq
from fdq.keyspace import Keyspace
from fdq.keyspace.codec import pack

from fdqtest import wait_for

INTERVALS = [("heartbeat_interval_s", 0.01), ("lease_check_interval_s", 0.01), ("ack_wait_s", 0.01),
             ("poll_interval_s", 0.001)]


@pytest.mark.parametrize("name,minimum", INTERVALS)
def test_an_interval_below_its_minimum_is_refused_naming_it(name, minimum):
    """1e-6 s was accepted for each: the membership loop then ran hot and reported
    ``ConsumerStalled`` on a healthy consumer."""
    for bad in (1e-6, minimum / 2):
        with pytest.raises(fdq.ConfigError, match=rf"^{name} must be at least {minimum} s, not {bad!r}$"):
            fdq.ConsumerConfig(**{name: bad})
    assert getattr(fdq.ConsumerConfig(**{name: minimum}), name) == minimum


def test_a_fetch_lease_below_the_minimum_is_refused(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    with fdq.Consumer(db, "t") as c:
        with pytest.raises(fdq.ConfigError, match="ack_wait_s must be at least 0.01 s"):
            c.fetch(1, timeout=0.1, ack_wait_s=1e-6)


def test_the_stall_alarm_of_the_shortest_heartbeat_shows_how_long(db):
    """With a 10 ms heartbeat the alarm (past 3 heartbeats: 30 ms) read "for 0.0s". The
    stall: the only shard's record names an owner that is no member (no live consumer
    owns it, so neither is on standby) and nothing re-assigns it."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    cfg = fdq.ConsumerConfig(heartbeat_interval_s=0.01, zombie_timeout_s=30.0, lease_check_interval_s=0.01,
                             poll_interval_s=0.05)
    errors = {"a": [], "b": []}
    a = fdq.Consumer(db, "t", config=cfg, consumer_id="a", on_error=errors["a"].append)
    b = fdq.Consumer(db, "t", config=cfg, consumer_id="b", on_error=errors["b"].append)
    try:
        tr = db.create_transaction()
        tr[Keyspace().topic("t").shard_records["default"].pack(("", 0))] = pack(["ghost", 99])
        tr.commit().wait()
        stalls = lambda: [e for es in errors.values() for e in es if isinstance(e, fdq.ConsumerStalled)]  # noqa: E731
        stall = wait_for(stalls, timeout=20, what="the stall alarm of a consumer owning no shard")[0]
        shown = re.search(r" for (\d+\.\d+)s \(over 3 heartbeats\)$", str(stall))
        assert shown and float(shown[1]) >= 0.03, str(stall)
    finally:
        a.close()
        b.close()


def test_a_subscriptions_lease_below_the_consumers_minimum_is_refused_at_the_subscription(db):
    """A subscription's ``ack_wait_s`` overrides its consumers': 0.005 s was accepted
    there, then every consumer of the subscription failed to start, and a live one's
    heartbeat failed, on the consumer's minimum. Refused where it is set."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    with pytest.raises(fdq.ConfigError, match=r"^ack_wait_s must be at least 0.01 s, not 0.005$"):
        fdq.SubscriptionConfig(ack_wait_s=0.005)
    sup.create_subscription("t", "s", fdq.SubscriptionConfig(ack_wait_s=0.01))
    with pytest.raises(fdq.ConfigError, match="ack_wait_s must be at least 0.01 s"):
        sup.update_subscription("t", "s", ack_wait_s=0.005)
    with fdq.Consumer(db, "t", subscription="s") as c:
        assert c.config.ack_wait_s == 0.01
