"""Every validation error of a subscription's configuration, each with its message."""
import dataclasses
from functools import partial

import pytest

import fdq

import fdqtest
from fdqtest import fast, wait_for


@pytest.mark.parametrize("options, message", [
    (dict(ack_policy="all"), "ack_policy must be one of explicit, none, not 'all'"),
    (dict(deliver_policy="first"), "deliver_policy must be one of all, new, last, by_start_time, not 'first'"),
    (dict(ack_wait_s=0), "ack_wait_s must be a number > 0, not 0"),
    (dict(ack_wait_s="1"), "ack_wait_s must be a number > 0, not '1'"),
    (dict(max_deliver=1.5), "max_deliver must be an integer > 0, not 1.5"),
    (dict(max_ack_pending=0), "max_ack_pending must be an integer > 0, not 0"),
    (dict(max_ack_pending=True), "max_ack_pending must be an integer > 0, not True"),
    (dict(backoff_s=5), "backoff_s must be a sequence of seconds, not 5"),
    (dict(backoff_s=(1, -1)), "backoff_s entries must be a number >= 0, not -1"),
    (dict(start_time_ms=-5, deliver_policy="by_start_time"), "start_time_ms must be epoch milliseconds"),
    (dict(filter_shard_key=""), "filter_shard_key must be a non-empty glob"),
    (dict(filter_headers={}), "filter_headers must be a non-empty dict"),
    (dict(filter_headers={"bad name": "x"}), "filter_headers: invalid header name 'bad name'"),
    (dict(filter_headers={"kind": 1}), "filter_headers: value of 'kind' must be a str, not 1"),
    (dict(ordered="yes"), "ordered must be True or False, not 'yes'"),
    (dict(ephemeral=1), "ephemeral must be True or False, not 1"),
    (dict(description="x" * 5000), "description must be a str of at most 4096 characters"),
    # options that need another name both
    (dict(start_time_ms=1000), "start_time_ms needs deliver_policy='by_start_time' (deliver_policy is 'all')"),
    (dict(deliver_policy="by_start_time"), "deliver_policy='by_start_time' needs start_time_ms"),
    (dict(ack_policy="none", ack_wait_s=5), "ack_wait_s needs ack_policy='explicit' (ack_policy is 'none'"),
    (dict(ack_policy="none", max_deliver=3), "max_deliver needs ack_policy='explicit'"),
    (dict(ack_policy="none", backoff_s=(1,)), "backoff_s needs ack_policy='explicit'"),
    (dict(ack_policy="none", max_ack_pending=10), "max_ack_pending needs ack_policy='explicit'"),
    (dict(ack_policy="none", ordered=True), "ordered=True needs ack_policy='explicit'"),
    (dict(backoff_s=(1, 2, 3), max_deliver=3),
     "backoff_s has 3 entries but max_deliver is 3: a message is redelivered at most max_deliver - 1 "
     "times, so backoff_s may have at most 2"),
])
def test_invalid_subscription_config(options, message):
    with pytest.raises(fdq.ConfigError) as e:
        fdq.SubscriptionConfig(**options)
    assert message in str(e.value)


def test_config_is_frozen_keyword_only_and_round_trips():
    c = fdq.SubscriptionConfig(backoff_s=[1, 2], max_deliver=5, filter_headers={"b": "1", "a": "2"},
                               deliver_policy="by_start_time", start_time_ms=12)
    assert c.backoff_s == (1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_deliver = 3
    with pytest.raises(TypeError):
        fdq.SubscriptionConfig("none")
    assert fdq.SubscriptionConfig.from_dict(c.as_dict()) == c
    with pytest.raises(fdq.ConfigError, match="unknown subscription option.*max_inflight"):
        fdq.SubscriptionConfig.from_dict({"max_inflight": 3})


def test_binding_errors(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "s", fdq.SubscriptionConfig(max_ack_pending=10, ordered=True))
    # Same config: a no-op. Different: every differing field listed.
    sup.create_subscription("t", "s", fdq.SubscriptionConfig(max_ack_pending=10, ordered=True))
    with pytest.raises(fdq.ConfigError) as e:
        sup.create_subscription("t", "s", fdq.SubscriptionConfig(max_ack_pending=20))
    msg = str(e.value)
    assert "subscription 's' of topic 't' exists with a different configuration" in msg
    assert "max_ack_pending (stored 10, given 20)" in msg and "ordered (stored True, given False)" in msg
    assert "update_subscription" in msg
    with pytest.raises(fdq.ConfigError, match=r"ordered \(stored True, given False\)"):
        fdq.Consumer(db, "t", subscription="s", subscription_config=fdq.SubscriptionConfig(max_ack_pending=10))
    # Per-consumer settings are not subscription fields: they never conflict.
    c = fdq.Consumer(db, "t", subscription="s", config=fdq.ConsumerConfig(ack_wait_s=3.0, max_concurrency=2))
    assert c.config.ack_wait_s == 3.0
    c.close()
    # ... unless the subscription sets its redelivery policy: then it applies to all.
    sup.update_subscription("t", "s", ack_wait_s=9.0)
    c = fdq.Consumer(db, "t", subscription="s", config=fdq.ConsumerConfig(ack_wait_s=3.0))
    assert c.config.ack_wait_s == 9.0
    c.close()


def test_unknown_and_invalid_subscriptions(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    with pytest.raises(fdq.SubscriptionNotFound, match=r"subscription 'nope' of topic 't' does not exist \(subscriptions: default\)"):
        fdq.tail(db, "t", lambda m: None, subscription="nope", create=False)
    with pytest.raises(fdq.SubscriptionNotFound, match="'nope'"):
        sup.delete_subscription("t", "nope")
    with pytest.raises(fdq.SubscriptionNotFound):
        sup.update_subscription("t", "nope", description="x")
    with pytest.raises(fdq.SubscriptionNotFound):
        sup.reset("t", "nope", 0)
    for bad in ("", "a b", "x" * 65, "a#ephemeral#ephemeral", "é"):
        with pytest.raises(fdq.InvalidName, match="invalid subscription name"):
            sup.create_subscription("t", bad)
        with pytest.raises(fdq.InvalidName, match="invalid subscription name"):
            fdq.Consumer(db, "t", subscription=bad)
    with pytest.raises(fdq.TopicNotFound):
        sup.create_subscription("missing", "s")
    with pytest.raises(fdq.ConfigError, match="unknown subscription option"):
        sup.update_subscription("t", "default", colour="red")
    with pytest.raises(fdq.ConfigError, match="config must be a fdq.SubscriptionConfig"):
        sup.create_subscription("t", "s", config=42)
    # with create (the default), tail creates an unknown subscription
    c = fdq.tail(db, "t", lambda m: None, subscription="fresh")
    c.shutdown()
    assert "fresh" in sup.config("t").subs


def test_create_refused_while_paused(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.pause("t")
    with pytest.raises(fdq.ConfigError, match="topic 't' is paused: subscriptions can be created once it is playing"):
        sup.create_subscription("t", "s")
    sup.play("t")
    sup.create_subscription("t", "s")


def test_delete_removes_its_state_and_nothing_else(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "gone", fdq.SubscriptionConfig(max_ack_pending=5))
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(f"{i}".encode(), shard_key=f"k{i}") for i in range(20)])
    c = fdq.Consumer(db, "t", subscription="gone")
    ms = c.fetch(3, timeout=1)
    ms[0].term("to the DLQ")
    c.close()

    def dump():
        tr = db.create_transaction()
        rows = {bytes(kv.key): bytes(kv.value) for kv in tr.snapshot.get_range(b"", b"\xff")}
        tr.cancel()
        return rows
    before = dump()
    sup.delete_subscription("t", "gone")
    after = dump()
    ks = sup.keyspace.topic("t")
    removed = set(before) - set(after)
    assert removed and all(b"gone" in k for k in removed)
    changed = {k for k in after if before.get(k) != after[k]}
    assert changed == {ks.config_key}                # the topic config lost "gone", nothing else
    assert not [k for k in after if b"gone" in k]
    assert sup.config("t").subs == ("default",)
    assert sup.stats("t")["subscriptions"]["default"]["backlog"] == 20


# The subscription tests' consumer: FAST with slower polls and lease checks.
SUBS_FAST = fast(lease_check_interval_s=0.2, poll_interval_s=0.1)


# Everything a subscription delivers until it stays empty for idle_s (acked, unless settle=None).
drain = partial(fdqtest.drain, idle_s=1.0, batch=500, settle="ack_many", create=False, config=SUBS_FAST)


def _refused(errors):
    return [e for e in errors if isinstance(e, fdq.ConfigError) and "ack_policy" in str(e)]


@pytest.mark.parametrize("race", [False, True])
def test_consumer_does_not_rejoin_a_recreated_subscription_with_another_ack_policy(db, race):
    """An at-least-once tail consumer of ``s`` sees ``s`` deleted and created again with
    ack_policy='none'. Rejoining it as it was (leasing in mind, taking in fact) lost the
    messages it took: they were removed from the queue but never handed to the handler.
    It must refuse to rejoin (reported), leaving every message to a fitting consumer."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    sup.create_subscription("t", "s")
    handled, errors = [], []
    c = fdq.tail(db, "t", lambda m: handled.append(m.id), subscription="s", acking=True,
                 config=SUBS_FAST, on_error=errors.append)
    try:
        sup.delete_subscription("t", "s")
        sup.create_subscription("t", "s", fdq.SubscriptionConfig(ack_policy="none"))
        if race:
            # The deletion and creation commit between the consumer's heartbeat and its
            # config check of the same round: the check must not adopt the new policy
            # (the next heartbeat's rejoin would then find nothing changed).
            import time
            with pytest.raises(fdq.ConfigError, match="ack_policy"):
                c._member.observe_subscriptions(time.monotonic())
            assert c.sub_config.ack_policy == "explicit"
        # the consumer noticed: it tried to rejoin (and was refused) or rejoined
        wait_for(lambda: _refused(errors) or sup.stats("t")["subscriptions"]["s"]["consumers"],
                 timeout=20, what="the consumer to rejoin or be refused")
        pushed = {r.id for r in fdq.Producer(db).push_many(
            "t", [fdq.Envelope(b"m%d" % i, shard_key=f"k{i}") for i in range(60)])}
        wait_for(lambda: _refused(errors) or sup.stats("t")["subscriptions"]["s"]["backlog"] == 0,
                 timeout=20, what="the refusal reported, or the messages taken")
    finally:
        c.shutdown()
    left = {m.id for m in drain(db, "t", "s", settle=None)}
    lost = pushed - left - set(handled)
    assert not lost, f"{len(lost)} of {len(pushed)} messages lost"
    assert _refused(errors) and not handled


def test_consumer_of_a_deleted_topic_reports_it_and_names_its_creation_again(db, caplog):
    """A consumer whose topic is deleted reports TopicNotFound (as one whose subscription
    is deleted reports SubscriptionNotFound), and when a push creates the topic again it
    joins the new topic, as a consumer joins a subscription created again. It logged
    "was declared a zombie: joining again" at every heartbeat while the topic was gone,
    and again when it joined the new one: misleading, as no peer had declared it
    anything. It says the topic was created again."""
    import logging
    caplog.set_level(logging.WARNING, logger="fdq.consumer")
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    handled, errors = [], []
    c = fdq.tail(db, "t", lambda m: handled.append(m.body), acking=True,
                 config=SUBS_FAST, on_error=errors.append)
    try:
        fdq.Producer(db).push("t", b"old")
        wait_for(lambda: handled == [b"old"], timeout=20, what="the first message")
        sup.delete_topic("t")
        wait_for(lambda: [e for e in errors if isinstance(e, fdq.TopicNotFound)], timeout=20,
                 what="TopicNotFound reported")
        fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i, shard_key=f"k{i}") for i in range(20)])
        wait_for(lambda: len(handled) == 21, timeout=20, what="the new topic's messages")
    finally:
        c.shutdown()
    assert sorted(handled[1:]) == sorted(b"m%d" % i for i in range(20))
    text = [r.getMessage() for r in caplog.records]
    assert not [t for t in text if "declared a zombie" in t], text
    assert [t for t in text if "topic 't' was created again" in t], text
