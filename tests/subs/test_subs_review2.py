"""Second review of subscriptions: consumers of a subscription deleted and created again
under the same name while they run."""
import pytest

import fdq
from subs_helpers import FAST, drain, wait_for


def _refused(errors):
    return [e for e in errors if isinstance(e, fdq.ConfigError) and "ack_policy" in str(e)]


@pytest.mark.parametrize("new_policy", ["none"])
def test_consumer_does_not_rejoin_a_recreated_subscription_with_another_ack_policy(db, new_policy):
    """An at-least-once tail consumer of ``s`` sees ``s`` deleted and created again with
    ack_policy='none'. Rejoining it as it was (leasing in mind, taking in fact) lost the
    messages it took: they were removed from the queue but never handed to the handler.
    It must refuse to rejoin (reported), leaving every message to a fitting consumer."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    sup.create_subscription("t", "s")
    handled, errors = [], []
    c = fdq.tail(db, "t", lambda m: handled.append(m.id), subscription="s", acking=True,
                 config=fdq.ConsumerConfig(**FAST), on_error=errors.append)
    try:
        sup.delete_subscription("t", "s")
        sup.create_subscription("t", "s", fdq.SubscriptionConfig(ack_policy=new_policy))
        # the consumer noticed: it tried to rejoin (and was refused) or rejoined
        wait_for(lambda: _refused(errors) or sup.stats("t")["subscriptions"]["s"]["consumers"],
                 timeout=20, what="the consumer to rejoin or be refused")
        pushed = {r.id for r in fdq.Producer(db).push_many(
            "t", [fdq.Envelope(b"m%d" % i, shard_key=f"k{i}") for i in range(60)])}
        wait_for(lambda: _refused(errors) or sup.stats("t")["subscriptions"]["s"]["backlog"] == 0,
                 timeout=20, what="the refusal reported, or the messages taken")
    finally:
        c.shutdown()
    left = {m.id for m in drain(db, "t", "s", ack=False)}
    lost = pushed - left - set(handled)
    assert not lost, f"{len(lost)} of {len(pushed)} messages lost"
    assert _refused(errors) and not handled
