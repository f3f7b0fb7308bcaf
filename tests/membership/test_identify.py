"""Consumers identify: extend topic × consumer matrix (Consumer and tail)."""
from __future__ import annotations

import inspect

import pytest

import fdq

from fdqtest import wait_for


@pytest.fixture
def topics(db):
    s = fdq.Supervisor(db)
    s.create_topic("ext", shards=2, extend=True)
    s.create_topic("plain", shards=2)
    return s


def _consumers(sup, topic):
    return sup.stats(topic)["subscriptions"]["default"]["consumers"]


@pytest.mark.parametrize("topic,extend_support,desired_tag,error", [
    ("ext", True, None, None),
    ("ext", True, "A", None),
    ("ext", None, None, None),              # extend_support follows the topic unless given
    ("ext", None, "A", None),
    ("ext", False, None, "has extend support: extend_support=False cannot consume it"),
    ("ext", False, "A", "has extend support: extend_support=False cannot consume it"),
    ("plain", None, None, None),
    ("plain", False, None, None),
    ("plain", False, "A", None),            # desired_tag ignored on a plain topic
    ("plain", True, None, "has no extend support"),
    ("plain", True, "A", "has no extend support"),
])
@pytest.mark.parametrize("api", ["Consumer", "tail"])
def test_identify_matrix(db, topics, topic, extend_support, desired_tag, error, api):
    def make():
        if api == "Consumer":
            return fdq.Consumer(db, topic, extend_support=extend_support, desired_tag=desired_tag)
        return fdq.tail(db, topic, lambda m: None, extend_support=extend_support, desired_tag=desired_tag)
    if error:
        with pytest.raises(fdq.ConfigError, match=error):
            make()
        assert _consumers(topics, topic) == []        # never joined
        return
    c = make()
    try:
        (rec,) = _consumers(topics, topic)
        expected_tag = desired_tag if topic == "ext" else None
        assert c.desired_tag == expected_tag and rec["tag"] == expected_tag
        tagged = topic == "ext" and desired_tag is not None
        assert c.owned_shards == ([] if tagged else [("", 0), ("", 1)])   # untagged shards: untagged only
    finally:
        c.close()


def test_tagged_consumer_owns_no_untagged_shard(db, topics):
    a = fdq.Consumer(db, "ext", extend_support=True, desired_tag="A")
    try:
        assert a.owned_shards == []
        fdq.Producer(db).push("ext", b"u")
        assert a.fetch(10, timeout=0.3) == []
    finally:
        a.close()


def test_desired_tag_on_plain_topic_is_a_normal_consumer(db, topics):
    c = fdq.Consumer(db, "plain", desired_tag="A",
                     config=fdq.ConsumerConfig(heartbeat_interval_s=0.1))
    try:
        fdq.Producer(db).push("plain", b"u")
        got = wait_for(lambda: c.fetch(10, timeout=0.2), 20, "the plain consumer to get the message")
        assert [m.body for m in got] == [b"u"] and got[0].tag == "" and dict(got[0].headers) == {}
    finally:
        c.close()


def test_tail_says_what_it_takes():
    """``fdq.tail``'s signature names every argument (``**kwargs`` hid
    ``extend_support``, ``desired_tag`` and ``on_error`` from help() and editors)."""
    params = inspect.signature(fdq.tail).parameters
    assert {"extend_support", "desired_tag", "on_error", "subscription_config", "ephemeral"} <= set(params)
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params.values())
