"""Topics: creating one that exists with another shard count, upgrading a topic that
holds plain messages, and what a caller may set in a topic's config (every option
checked, the topic's state never)."""
from __future__ import annotations

import re

import pytest

import fdq
from fdq.headers import DISPATCH_TAG

from fdqtest import collect, dump, log_records


def test_upgrade_keeps_plain_messages_readable(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(b"old-%d" % i, shard_key=f"k{i}") for i in range(10)])
    p.push("t", b"old-delayed", delay=0.3)
    with pytest.raises(fdq.InvalidHeader):
        p.push("t", b"x", headers={"a": 1})
    plain = fdq.Consumer(db, "t")           # a plain consumer is fine before the upgrade
    early = plain.fetch(3, timeout=2)
    for m in early:
        m.ack()
    plain.close()
    assert len(early) == 3

    cfg = sup.upgrade_extend("t")
    assert cfg.extend and sup.config("t").extend
    assert sup.upgrade_extend("t").extend                   # idempotent
    with pytest.raises(fdq.TopicNotFound):
        sup.upgrade_extend("nope")
    # One-way: creating it again as plain changes nothing; a consumer asking for a plain
    # topic is refused (one that does not ask follows the topic)
    assert sup.create_topic("t", shards=2).extend
    with pytest.raises(fdq.ConfigError, match="extend_support=False cannot consume it"):
        fdq.Consumer(db, "t", extend_support=False)

    p.push("t", b"new-tagged", headers={DISPATCH_TAG: "A", "h": 1})
    p.push("t", b"new-plain")
    got = collect(db, "t", 8 + 2, extend_support=True)      # untagged consumer: A falls back
    bodies = {m.body: m for m in got}
    assert set(bodies) | {m.body for m in early} == \
        {b"old-%d" % i for i in range(10)} | {b"old-delayed", b"new-tagged", b"new-plain"}
    old = [m for m in got if m.body.startswith(b"old")]
    assert len(old) == 8 and all(dict(m.headers) == {} and m.tag == "" for m in old)
    assert dict(bodies[b"new-tagged"].headers) == {DISPATCH_TAG: "A", "h": 1}
    assert bodies[b"new-tagged"].tag == "A"
    # The log still reads every message, old ones without a headers field at all.
    recs = log_records(db, "t")
    assert len(recs) == 13 and sum(1 for f in recs if len(f) > 3 and f[3]) == 1


def test_create_topic_existing_with_another_shard_count(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    assert sup.create_topic("t").shards == 4            # no count asked: the topic as it is
    assert sup.create_topic("t", shards=4).shards == 4  # same count: no-op
    with pytest.raises(fdq.TopicExists, match=r"already exists with 4 shards, not 16 \(change"):
        sup.create_topic("t", shards=16)                # the default count, asked for explicitly
    assert sup.config("t").shards == 4


BAD_OPTIONS = [
    ("shards", [0, -1, 4097, 1.5, "16", True]),
    ("hash", ["md5", None, 3]),
    ("extend", ["yes", 1, None]),
    ("max_backlog", [0, -5, 2.5, "10", True, 2**63]),
    ("dedupe_window_s", [-1, float("nan"), float("inf"), "120", None]),
    ("retention_s", [0, -1, float("nan"), "60"]),
    ("retention_bytes", [0, 1.5, "1000"]),
    ("max_message_bytes", [0, (8 << 20) + 1, "1", None]),
    ("subs", ["default", [1], ("a", "a"), ("bad name",), None, {"a": 1}]),
]


@pytest.mark.parametrize("field,bad", [(f, v) for f, values in BAD_OPTIONS for v in values],
                         ids=lambda x: repr(x)[:20])
def test_every_topic_option_refuses_a_wrong_type_or_range_changing_nothing(db, field, bad):
    """``subs="default"`` made subscriptions d,e,f,a,u,l,t and ``extend="yes"`` was
    stored; each bad value is a ConfigError naming the option, nothing written."""
    sup = fdq.Supervisor(db)
    sup.create_topic("kept", shards=2)
    before = dump(db)
    with pytest.raises(fdq.ConfigError, match=field):
        sup.create_topic("orders", **{field: bad})
    with pytest.raises(fdq.ConfigError, match=field):
        fdq.TopicConfig(**{field: bad})
    if field in fdq.config.UPDATABLE_TOPIC_FIELDS:
        with pytest.raises(fdq.ConfigError, match=field):
            sup.update_topic("kept", **{field: bad})
    assert dump(db) == before


STATE = [("paused", ["no", True], "Supervisor.pause('orders')"),
         ("resharding_to", [3, None], "Supervisor.rebalance('orders', shards=N)"),
         ("catchup", ["x", ("default",)], "Supervisor.create_subscription('orders', subscription) or "
                                          "Supervisor.reset('orders', subscription)"),
         ("paused_subs", ["ab", ("default",)], "Supervisor.pause_subscription('orders', subscription)"),
         ("held_at", [5, None], "Supervisor.play('orders')")]


@pytest.mark.parametrize("field,value,verb", [(f, v, verb) for f, values, verb in STATE for v in values],
                         ids=lambda x: repr(x)[:20])
def test_topic_state_is_not_an_option_and_the_error_names_the_verb(db, field, value, verb):
    """``paused="no"`` left the topic paused, ``resharding_to=3`` stuck resharding: the
    topic's state is changed by its own operations only, well-formed or not (create,
    update, a producer's auto_create), and the error says which one to use."""
    sup = fdq.Supervisor(db)
    sup.create_topic("orders", shards=2)
    before = dump(db)
    message = f"^'{field}' is topic state, not an option: use {re.escape(verb)}"
    with pytest.raises(fdq.ConfigError, match=message):
        sup.create_topic("orders", **{field: value})
    with pytest.raises(fdq.ConfigError, match=message.replace("orders", "new")):
        sup.create_topic("new", **{field: value})
    with pytest.raises(fdq.ConfigError, match=message):
        sup.update_topic("orders", **{field: value})
    assert dump(db) == before
    if value is not None and not isinstance(value, str):   # well-formed state, built by hand
        built = fdq.TopicConfig(**{field: value})
        with pytest.raises(fdq.ConfigError, match=f"^'{field}' is topic state, not an option"):
            fdq.ProducerConfig(auto_create=built)


def test_topic_state_of_the_wrong_type_is_refused_where_it_is_built(db):
    """What the operations write is checked as what callers give: a wrong type or a
    subscription the topic does not have is a ConfigError, never stored."""
    for bad in (dict(paused="no"), dict(resharding_to=0), dict(resharding_to=True), dict(held_at=-1),
                dict(held_at="5"), dict(catchup="x"), dict(catchup=("nope",)), dict(paused_subs=("nope",)),
                dict(paused_subs=("default", "default"))):
        with pytest.raises(fdq.ConfigError):
            fdq.TopicConfig(**bad)


def test_update_topic_names_how_to_change_what_is_fixed_at_creation(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("orders", shards=2)
    for field, value, how in (("shards", 4, "Supervisor.rebalance('orders', shards=N)"),
                              ("extend", True, "Supervisor.upgrade_extend('orders')"),
                              ("subs", ("a",), "Supervisor.create_subscription('orders', subscription)"),
                              ("bogus", 1, "unknown topic option 'bogus'")):
        with pytest.raises(fdq.ConfigError, match=re.escape(how)):
            sup.update_topic("orders", **{field: value})
    with pytest.raises(fdq.ConfigError, match=re.escape("unknown topic option 'bogus' (options: dedupe_window_s")):
        sup.create_topic("new", bogus=1)


def test_a_topic_created_with_its_subscriptions_starts_with_them(db):
    """``subs`` at creation is an option (the broker creates NSQ topics with none):
    a list is taken as the tuple it is stored as."""
    sup = fdq.Supervisor(db)
    assert sup.create_topic("nsq", subs=[]).subs == ()
    assert sup.create_topic("two", subs=["a", "b"]).subs == ("a", "b")
    assert [s["name"] for s in sup.subscriptions("two")] == ["a", "b"]
