"""An NSQ client's SUB to a channel whose subscription has ack_policy='none'."""
import fdq
from fdqtest import wait_for


def test_sub_to_an_ack_policy_none_channel_is_refused_and_loses_nothing(broker, raw):
    """An NSQ channel is always acknowledged (FIN/REQ/TOUCH), but a subscription made
    with ack_policy='none' (API or CLI) takes its messages when fetched: the broker
    served it, every FIN answered E_FIN_FAILED, and what it handed back (no connection
    could take it, paused during a fetch) was lost. SUB is refused with a fatal
    E_BAD_CHANNEL naming the reason, and no message of the channel is taken."""
    db = fdq.connect(broker.url)
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    sup.create_subscription("t", "fire", fdq.SubscriptionConfig(ack_policy="none"))
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i) for i in range(3)])
    c = raw()
    c.identify(heartbeat_interval=30000)
    c.send(b"SUB t fire\n")
    err = c.error()
    assert err.startswith("E_BAD_CHANNEL") and "ack_policy" in err, err
    assert c.closed()
    assert sup.stats("t")["subscriptions"]["fire"]["backlog"] == 3
    # a library consumer still gets all of them
    got = []
    with fdq.Consumer(db, "t", subscription="fire") as cons:
        wait_for(lambda: got.extend(cons.fetch(10, 0.5)) or len(got) == 3, 30, "the 3 messages")
    assert sorted(m.body for m in got) == [b"m0", b"m1", b"m2"]


def test_sub_refused_leaves_a_waiting_ephemeral_subscription_alone(broker, raw):
    """An ephemeral subscription created without a consumer waits for its first: the
    refused SUB must not join it (its leave, the last member's, would delete it and its
    messages)."""
    db = fdq.connect(broker.url)
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    sup.create_subscription("t", "fire#ephemeral", fdq.SubscriptionConfig(ack_policy="none"), ephemeral=True)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i) for i in range(3)])
    c = raw()
    c.identify(heartbeat_interval=30000)
    c.send(b"SUB t fire#ephemeral\n")
    err = c.error()
    assert err.startswith("E_BAD_CHANNEL") and "ack_policy" in err, err
    assert c.closed()
    assert sup.stats("t")["subscriptions"]["fire#ephemeral"]["backlog"] == 3
