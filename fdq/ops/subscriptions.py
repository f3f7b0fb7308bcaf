"""Subscriptions: the transactional functions that create, read, update, pause and
delete a subscription, a consumer's join and leave wrapped for ephemeral ones, and the
subscription's filter.

Storage. The topic config (``config/topics/<t>``, read by every push) lists the
subscriptions' names in ``subs`` (pushes fan out to each) and, in ``catchup``, those
still copying their start point from the "all" log (their consumers deliver nothing
until it is done). Each subscription's own record (its configuration, a reset under
way) lives beside it, in ``config/topics/<t>/subs/<sub>``, so pushes never decode
consumer settings; a topic's first subscriptions (``default``) get theirs with the
topic (``ops.topics.write_new_topic_config``).

The start boundary is exact. ``create_subscription`` adds the name to ``subs`` in a
transaction C that also stores C's own versionstamp (``.../subs/<sub>/boundary``). A push
reads the config key, so a push committed after C saw the new config (or conflicted
with C and retried) and fanned out to the new subscription; a push committed before C
did not. Log keys are versionstamps, i.e. commit order, so the catch-up
(``fdq.ops.catchup``) copies exactly the log entries older than C's versionstamp, and no
message is missed or copied twice.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json

from . import membership
from ..config import UPDATABLE_SUBSCRIPTION_FIELDS, SubscriptionConfig, TopicConfig, check_filters, check_name
from ..engine import transactional
from ..errors import ConfigError, SubscriptionNotFound
from ..keyspace import TopicSpace, stamp_of_value
from ..keyspace.codec import Record, decode_subscription, encode_subscription
from .topics import read_topic_config, write_subscription_record, write_topic_config


def is_ephemeral(name: str, config: SubscriptionConfig) -> bool:
    return config.ephemeral or name.endswith("#ephemeral")


def read_record(tr, ts: TopicSpace, sub: str) -> dict:
    """``sub``'s record (``{"config": ..., "reset": ...}``), read with a conflict."""
    return decode_subscription(tr[ts.sub_record_key(sub)])


def write_record(tr, ts: TopicSpace, sub: str, record: dict):
    tr[ts.sub_record_key(sub)] = encode_subscription(record)


@transactional
def read_subscription(tr, ts: TopicSpace, sub: str, *, snapshot: bool = False,
                      topic_config: TopicConfig | None = None) -> SubscriptionConfig:
    """The subscription's config; raises SubscriptionNotFound if the topic has none of
    that name (and TopicNotFound without the topic)."""
    reader = tr.snapshot if snapshot else tr
    config = topic_config or read_topic_config(tr, ts, snapshot=snapshot)
    if sub not in config.subs:
        raise SubscriptionNotFound(f"subscription {sub!r} of topic {ts.name!r} does not exist "
                                   f"(subscriptions: {', '.join(config.subs) or 'none'})")
    return SubscriptionConfig.from_dict(decode_subscription(reader[ts.sub_record_key(sub)])["config"])


@transactional
def subscription_info(tr, ts: TopicSpace, sub: str) -> dict:
    """{"config", "ephemeral", "catching_up", "paused", "start_position"} (the id of the
    first position after the start boundary). ``paused``: paused on its own
    (``set_subscription_paused``)."""
    topic_config = read_topic_config(tr, ts, snapshot=True)
    config = read_subscription(tr, ts, sub, snapshot=True, topic_config=topic_config)
    boundary = stamp_of_value(tr.snapshot[ts.sub_boundary_key(sub)]).hex() + "0000"
    return {"name": sub, "config": config, "ephemeral": is_ephemeral(sub, config),
            "catching_up": sub in topic_config.catchup, "paused": sub in topic_config.paused_subs,
            "start_position": boundary}


def diff_error(ts: TopicSpace, sub: str, stored: SubscriptionConfig, given: SubscriptionConfig) -> ConfigError:
    """The error for binding to ``sub`` with a config other than the one stored."""
    diffs = "; ".join(f"{f} (stored {a!r}, given {b!r})" for f, a, b in stored.differences(given))
    return ConfigError(f"subscription {sub!r} of topic {ts.name!r} exists with a different "
                       f"configuration: {diffs}. Change updatable fields "
                       f"({', '.join(UPDATABLE_SUBSCRIPTION_FIELDS)}) with update_subscription; "
                       f"others need a new subscription")


def routing_refusal(ts: TopicSpace, config: TopicConfig, what: str) -> ConfigError:
    """The error for a subscription change refused while the topic routes nothing."""
    return ConfigError(f"topic {ts.name!r} is {'paused' if config.paused else 'resharding'}: {what}")


# -- create / delete / update ------------------------------------------------------------

@transactional
def create_subscription(tr, ts: TopicSpace, sub: str, config: SubscriptionConfig | None, *,
                        exist_ok: bool = True) -> bool:
    """Add ``sub`` to the topic: pushes committed after this transaction fan out to it;
    its start point (``deliver_policy``) is copied later by ``catchup.catch_up_chunk``.
    Binding to an existing subscription with the same config (or ``config=None``:
    defaults for a new one, whatever is stored for an existing one) is a no-op that
    returns False; with a different one an error listing the differing fields. Returns
    True if created."""
    check_name(sub, "subscription")
    topic_config = read_topic_config(tr, ts)
    if sub in topic_config.subs:
        stored = read_subscription(tr, ts, sub, topic_config=topic_config)
        if config is not None and stored != config:
            raise diff_error(ts, sub, stored, config)
        if not exist_ok:
            raise ConfigError(f"subscription {sub!r} of topic {ts.name!r} already exists")
        return False
    config = config if config is not None else SubscriptionConfig()
    check_filters(ts.name, sub, config, topic_config)
    if not topic_config.routing:
        raise routing_refusal(ts, topic_config, "subscriptions can be created once it is playing again")
    write_subscription_record(tr, ts, sub, config)
    catchup = topic_config.catchup + ((sub,) if config.deliver_policy != "new" else ())
    write_topic_config(tr, ts, dataclasses.replace(topic_config, subs=topic_config.subs + (sub,), catchup=catchup))
    return True


@transactional
def delete_subscription(tr, ts: TopicSpace, sub: str) -> bool:
    """Remove ``sub`` and all its state (queues, leases, DLQ, counters, consumers, shard
    records, its record); nothing else. Range clears: one small transaction whatever the
    backlog. Returns False if it did not exist."""
    topic_config = read_topic_config(tr, ts)
    if sub not in topic_config.subs:
        return False
    write_topic_config(tr, ts, dataclasses.replace(
        topic_config, subs=tuple(s for s in topic_config.subs if s != sub),
        catchup=tuple(s for s in topic_config.catchup if s != sub),
        paused_subs=tuple(s for s in topic_config.paused_subs if s != sub)))
    for space in (ts.subs[sub], ts.consumers[sub], ts.heartbeats[sub], ts.shard_records[sub], ts.sub_records[sub]):
        r = space.range()
        tr.clear_range(r.start, r.stop)
    del tr[ts.sub_record_key(sub)]
    del tr[ts.assignment_key(sub)]
    return True


@transactional
def update_subscription(tr, ts: TopicSpace, sub: str, **changes) -> SubscriptionConfig:
    """Change updatable fields (``UPDATABLE_SUBSCRIPTION_FIELDS``); consumers pick the
    new values up at their next heartbeat."""
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(SubscriptionConfig)})
    if unknown:
        raise ConfigError(f"unknown subscription option(s): {', '.join(unknown)}")
    fixed = sorted(set(changes) - set(UPDATABLE_SUBSCRIPTION_FIELDS))
    if fixed:
        raise ConfigError(f"cannot update {', '.join(fixed)} of subscription {sub!r}: only "
                          f"{', '.join(UPDATABLE_SUBSCRIPTION_FIELDS)} may change (create a new "
                          "subscription, or reset it for a new start point)")
    config = dataclasses.replace(read_subscription(tr, ts, sub), **changes)
    record = read_record(tr, ts, sub)
    record["config"] = config.as_dict()
    write_record(tr, ts, sub, record)
    return config


@transactional
def set_subscription_paused(tr, ts: TopicSpace, sub: str, paused: bool) -> bool:
    """Pause (or resume) delivery to one subscription: its consumers take nothing while
    pushes keep filling its queues. In the topic config every consuming transaction
    reads, so a pause fences deliveries in flight as a topic pause does. Returns the
    previous state; re-running is a no-op."""
    topic_config = read_topic_config(tr, ts)
    if sub not in topic_config.subs:
        raise SubscriptionNotFound(f"subscription {sub!r} of topic {ts.name!r} does not exist")
    was = sub in topic_config.paused_subs
    if was != paused:
        rest = tuple(s for s in topic_config.paused_subs if s != sub)
        write_topic_config(tr, ts, dataclasses.replace(
            topic_config, paused_subs=rest + ((sub,) if paused else ())))
    return was


# -- the filter -----------------------------------------------------------------------

def matcher(config: SubscriptionConfig):
    """A predicate on a Record for the subscription's filter, or None (no filter)."""
    glob, headers = config.filter_shard_key, config.filter_headers
    if glob is None and headers is None:
        return None

    def match(rec: Record) -> bool:
        if glob is not None and (rec.shard_key is None or not fnmatch.fnmatchcase(rec.shard_key, glob)):
            return False
        if headers is not None:
            have = rec.headers or {}
            return all(k in have and header_text(have[k]) == v for k, v in headers.items())
        return True
    return match


def header_text(value) -> str:
    """What a header filter's value is compared with: a string header's own text, any
    other value's compact JSON text (``true``, ``null``, ``3``, ``1.5``, ``[1,"a"]``,
    ``{"x":1}``): how ``fdq push --header`` spells the values it parses."""
    if type(value) is str:
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# -- members: membership's join / leave / zombie, for ephemeral subscriptions too ------------

def _reap_if_empty(tr, ts: TopicSpace, sub: str) -> bool:
    topic_config = read_topic_config(tr, ts)
    if sub not in topic_config.subs:
        return False
    if not is_ephemeral(sub, read_subscription(tr, ts, sub, topic_config=topic_config)):
        return False
    if membership.read_members(tr, ts, sub, snapshot=False):
        return False    # a member is left (or joined meanwhile: the read conflicts)
    return delete_subscription(tr, ts, sub)


@transactional
def join(tr, ts: TopicSpace, sub: str, consumer_id: str, record: dict,
         expect: SubscriptionConfig | None = None) -> dict:
    """``membership.join``, refused if the subscription is gone (an ephemeral one may be
    deleted by its last member leaving just now: the topic-config read conflicts), or,
    with ``expect``, if its config is no longer that (ConfigError: read it again)."""
    config = read_subscription(tr, ts, sub)
    if expect is not None and config != expect:
        raise ConfigError(f"subscription {sub!r} of topic {ts.name!r} changed while joining it")
    return membership.join(tr, ts, sub, consumer_id, record)


@transactional
def create_and_join(tr, ts: TopicSpace, sub: str, config: SubscriptionConfig | None, consumer_id: str,
                    record: dict) -> dict:
    """``create_subscription`` (or bind to the existing one) and ``join`` it, in one
    transaction: how a consumer creates an ephemeral subscription, which so never
    exists without a member for a reaper to find dead."""
    create_subscription(tr, ts, sub, config)
    return membership.join(tr, ts, sub, consumer_id, record)


@transactional
def leave(tr, ts: TopicSpace, sub: str, consumer_id: str, incarnation=None) -> bool:
    """``membership.leave``; an ephemeral subscription left without members is deleted
    in the same transaction. Returns True if it was deleted."""
    membership.leave(tr, ts, sub, consumer_id, incarnation)
    return _reap_if_empty(tr, ts, sub)


@transactional
def declare_zombie(tr, ts: TopicSpace, sub: str, consumer_id: str, observed_hb: int) -> bool:
    """``membership.declare_zombie``, deleting an ephemeral subscription it leaves empty."""
    if not membership.declare_zombie(tr, ts, sub, consumer_id, observed_hb):
        return False
    _reap_if_empty(tr, ts, sub)
    return True
