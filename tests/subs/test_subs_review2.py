"""Second review of subscriptions: consumers of a subscription deleted and created again
under the same name while they run."""
import pytest
from functools import partial

import fdq
import fdqtest
from fdqtest import fast, wait_for

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
                c._observe_subscriptions(time.monotonic())
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


def test_assignment_racing_a_deletion_leaves_no_shard_records(db):
    """A consumer's membership round (``assign_new_tags``, ``assign_shards``) that runs
    just after its subscription's deletion wrote an owner-less record for every shard
    (and the assignment counter): state of a deleted subscription left for good."""
    from fdq import membership
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4, extend=True)
    sup.create_subscription("t", "s")
    fdq.Producer(db).push("t", b"x", headers={"##client_dispatch_tag": "g"})
    ts = sup.keyspace.topic("t")
    sup.delete_subscription("t", "s")
    membership.assign_new_tags(db, ts, "s")
    membership.assign_shards(db, ts, "s")
    tr = db.create_transaction()
    r = ts.shard_records["s"].range()
    left = list(tr.get_range(r.start, r.stop))
    counter = tr[ts.assignment_key("s")].wait()
    tr.cancel()
    assert not left, f"{len(left)} shard records of the deleted subscription"
    assert counter == None  # noqa: E711 - FDB's absent Value


def test_ack_many_of_unleased_messages_is_a_clear_error(db):
    """``ack_many`` of messages a subscription with ack_policy='none' delivered (taken, not
    leased) raised a bare TypeError from the engine; ``Message.ack`` says why."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "n", fdq.SubscriptionConfig(ack_policy="none"))
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"x") for _ in range(3)])
    c = fdq.Consumer(db, "t", subscription="n", config=SUBS_FAST)
    try:
        ms = wait_for(lambda: c.fetch(10, timeout=0.2), timeout=20, what="messages")
        with pytest.raises(fdq.FDQError, match="is not leased: ack needs at-least-once delivery"):
            c.ack_many(ms)
    finally:
        c.close()


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
