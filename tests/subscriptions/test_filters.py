"""Filters that can never match are refused before they drop a backlog (issue 21.2);
what an accepted filter drops is visible in stats."""
import pytest

import fdq
from fdq.headers import MAX_HEADER_BYTES

from fdqtest import fetch_ids


def test_a_header_filter_on_a_topic_without_headers_is_refused_and_creates_nothing(db):
    """A topic created without extend stores no headers: a header filter on it dropped
    every message as filtered (20 pushed, 0 delivered)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("orders", shards=2)
    with pytest.raises(fdq.ConfigError) as e:
        sup.create_subscription("orders", "eu", fdq.SubscriptionConfig(filter_headers={"region": "eu"}))
    text = str(e.value)
    assert "needs a topic with extend support" in text and "fdq topics upgrade orders --extend" in text
    assert sup.config("orders").subs == ("default",)
    # a consumer creating it (ephemeral or not) is refused alike
    with pytest.raises(fdq.ConfigError, match="needs a topic with extend support"):
        fdq.Consumer(db, "orders", subscription="eu#ephemeral",
                     subscription_config=fdq.SubscriptionConfig(filter_headers={"region": "eu"}))
    assert sup.config("orders").subs == ("default",)
    # once the topic has extend support the same filter is fine and delivers
    sup.upgrade_extend("orders")
    sup.create_subscription("orders", "eu", fdq.SubscriptionConfig(filter_headers={"region": "eu"}))
    r = fdq.Producer(db).push("orders", b"x", headers={"region": "eu"})
    assert fetch_ids(db, "orders", "eu", timeout=5, extend_support=True) == [r.id]


@pytest.mark.parametrize("headers, message", [
    ({"##region": "eu"}, "header '##region' can never be on a message"),
    ({"h" * 129: "x"}, "invalid header name"),
    ({"region": "x" * (MAX_HEADER_BYTES + 1)}, "the filter would drop every message"),
    ({"region": "\udcff"}, "is not valid Unicode"),
])
def test_a_header_filter_no_message_can_match_is_refused(db, headers, message):
    with pytest.raises(fdq.ConfigError, match=message):
        fdq.SubscriptionConfig(filter_headers=headers)


def test_reserved_header_names_may_be_filtered_on(db):
    """``##client_dispatch_tag`` is on tagged messages: a filter on it is no mistake."""
    sup = fdq.Supervisor(db)
    sup.create_topic("jobs", extend=True)
    sup.create_subscription("jobs", "gpu",
                            fdq.SubscriptionConfig(filter_headers={"##client_dispatch_tag": "gpu"}))
    p = fdq.Producer(db)
    r = p.push("jobs", b"g", headers={"##client_dispatch_tag": "gpu"})
    p.push("jobs", b"plain")
    ids = set()
    for tag in ("gpu", None):
        c = fdq.Consumer(db, "jobs", subscription="gpu", create=False, extend_support=True, desired_tag=tag)
        try:
            ms = c.fetch(10, timeout=1.0)
            c.ack_many(ms)
            ids |= {m.id for m in ms}
        finally:
            c.close()
    assert ids == {r.id}


def test_what_a_filter_drops_shows_in_stats(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, extend=True)
    sup.create_subscription("t", "eu", fdq.SubscriptionConfig(filter_shard_key="eu-*"))
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"1", shard_key="eu-1"), fdq.Envelope(b"2", shard_key="us-1"),
                                     fdq.Envelope(b"3")])
    assert len(fetch_ids(db, "t", "eu", timeout=0.5, extend_support=True)) == 1
    st = sup.stats("t")["subscriptions"]
    assert st["eu"]["filtered"] == 2 and st["eu"]["backlog"] == 0
    assert st["default"]["filtered"] == 0
