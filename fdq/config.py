"""Configuration: names, topic configs, consumer configs. Frozen, keyword-only
dataclasses, validated in one place; defaults live here once."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .errors import ConfigError, InvalidName
from .headers import check_filter_name, check_filter_value

NAME_RE = re.compile(r"^[.a-zA-Z0-9_-]{1,64}(#ephemeral)?$")
DEFAULT_SUBSCRIPTION = "default"


def check_name(name, what: str = "topic") -> str:
    """Topic and subscription names follow NSQ's rule: ``^[.a-zA-Z0-9_-]{1,64}(#ephemeral)?$``."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidName(f"invalid {what} name {name!r}: use 1-64 characters of "
                          "[.a-zA-Z0-9_-], optionally ending in #ephemeral")
    return name


REPLAY_ID_RE = re.compile(r"[.a-zA-Z0-9_:-]{1,128}")


def default_replay_id(start_ms: int | None, end_ms: int | None) -> str:
    """A replay's id when the caller gives none: its window."""
    return f"{start_ms}:{'open' if end_ms is None else end_ms}"


def check_replay_id(replay_id) -> str:
    """A replay id: 1-128 characters of ``[.a-zA-Z0-9_:-]``, not ``done`` (the name of
    a finished replay's record, ``keyspace.REPLAY_DONE``)."""
    if not isinstance(replay_id, str) or not REPLAY_ID_RE.fullmatch(replay_id) or replay_id == "done":
        raise ConfigError(f"invalid replay id {replay_id!r}: use 1-128 characters of [.a-zA-Z0-9_:-]")
    return replay_id


# A long operation (play, reshard, replay, trim, a subscription's catch-up or reset, DLQ
# redrive and purge) runs in transactions of at most this many messages each (and
# ``keyspace.codec.CHUNK_WRITE_BYTES`` of writes).
CHUNK = 500


MAX_INT = 2**63 - 1                  # counts are stored as 64-bit integers
MAX_SECONDS = 100 * 365 * 86400      # durations: their millisecond deadlines stay 64-bit


def shown(value, width: int = 80) -> str:
    """``repr(value)`` for an error message: at most ``width`` characters, and an int
    too long for Python to print (over 4,300 digits: ValueError) by its size."""
    if isinstance(value, int) and value.bit_length() > 1000:
        return f"<an integer of {value.bit_length():,} bits>"
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _positive(name, value, *, allow_none=False, integer=False, zero=False):
    if value is None and allow_none:
        return
    ok_type = int if integer else (int, float)
    if (isinstance(value, bool) or not isinstance(value, ok_type) or value != value or value < 0
            or (value == 0 and not zero)):
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{name} must be {kind} {'>=' if zero else '>'} 0, not {shown(value)}")
    if value > (MAX_INT if integer else MAX_SECONDS):     # (infinity too)
        bound = f"{MAX_INT:,}" if integer else f"{MAX_SECONDS:,} s (100 years)"
        raise ConfigError(f"{name} must be at most {bound}, not {shown(value)}")


def _at_least(name, value, minimum):
    """An interval below ``minimum`` makes a loop of it spin (a hot loop, false alarms)."""
    if value is not None and value < minimum:
        raise ConfigError(f"{name} must be at least {minimum} s, not {shown(value)}")


def _names(field: str, value) -> tuple:
    """A tuple of distinct subscription names (a list is taken; a str is not a list of names)."""
    if not isinstance(value, (tuple, list)):
        raise ConfigError(f"{field} must be a tuple of subscription names, not {shown(value)}")
    for sub in value:
        if not isinstance(sub, str) or not NAME_RE.fullmatch(sub):
            raise ConfigError(f"{field} must be a tuple of subscription names: {shown(sub)} is not one "
                              "(1-64 characters of [.a-zA-Z0-9_-], optionally ending in #ephemeral)")
    if len(set(value)) != len(value):
        raise ConfigError(f"{field} names a subscription twice: {tuple(value)}")
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class TopicConfig:
    """A topic's stored configuration (``config/topics/<topic>``).

    ``shards``: fixed virtual shards, shared by the topic's subscriptions.
    ``max_backlog``: optional cap on a subscription's backlog (messages pushed while paused or
    resharding count for every subscription); pushes beyond it fail with
    ``BacklogFull``. Checked against a snapshot of the counters, so concurrent producers
    may overshoot it by at most their in-flight batches.
    ``dedupe_window_s``: how long a user ``msg_id`` is remembered, at least: an id is a
    duplicate while its first push is within the window by database versions or by the
    producers' clock, so a version jump (an FDB recovery) cannot shorten it; ``trim``
    removes entries past it.
    ``retention_s`` / ``retention_bytes``: what ``trim`` keeps of the "all" log. The log's
    size (``retention_bytes``, ``stats()["counters"]["log_bytes"]``) is the bytes of its
    entries' keys and records and of their body chunks' keys and values (not the time
    index), kept exactly in a counter: push adds by atomic add, trim subtracts in the
    transaction that deletes (``fdq.log.entry_bytes``). ``retention_messages``: the most
    entries the log keeps (its oldest go first; ``inserted - trimmed`` counts them).
    Retention is enforced continuously by the topic's consumers (``fdq.maintainer``:
    one process at a time) and by ``trim``.
    ``ttl_s``: the time to live of a message pushed without its own (``push(ttl=)``;
    None: none); a message whose TTL ended is never delivered: ``ttl_action`` "drop"
    removes it (counted ``expired``), "dead_letter" moves it to the DLQ, in the
    transaction that would have delivered it. A TTL ends by the topic's clock (as
    delays): late, never early.
    ``max_message_bytes``: the largest body (split into chunks above 90,000 bytes); a
    push also refuses a body whose copies (the log's, one per subscription) exceed
    ``fdq.keyspace.codec.ROUTE_BYTES`` (9 MB: they are written in one transaction).
    ``subs``: the topic's subscriptions (names), at creation those it starts with.

    The fields of ``TOPIC_STATE`` (``paused``, ``resharding_to``, ``catchup``,
    ``paused_subs``, ``held_at``) are the topic's state, stored with its options and
    changed only by the operations that own them (``Supervisor.pause`` ...): never an
    option of ``create_topic``/``update_topic``/``ProducerConfig.auto_create``
    (``check_topic_options``). Every field is checked here, state included, so nothing
    a caller or an operation writes can be of the wrong type or out of range.
    """

    shards: int = 16
    hash: str = "blake2b-64"
    extend: bool = False
    paused: bool = False
    max_backlog: int | None = None
    dedupe_window_s: float = 120.0
    retention_s: float | None = None
    retention_bytes: int | None = None
    retention_messages: int | None = None
    ttl_s: float | None = None
    ttl_action: str = "drop"
    max_message_bytes: int = 1 << 20
    subs: tuple = (DEFAULT_SUBSCRIPTION,)
    resharding_to: int | None = None   # set while a shard-count change is in progress (== shards:
                                       # moved, routing what was pushed meanwhile)
    catchup: tuple = ()                # subscriptions copying their start from the log
    paused_subs: tuple = ()            # subscriptions paused on their own (NSQ channel pause)
    held_at: int | None = None         # a play's last step: the version from which pushes
                                       # wait a moment (``fdq.ops.play.play_chunk``)

    def __post_init__(self):
        if isinstance(self.shards, int) and self.shards > 4096:    # before _positive's int64 bound
            raise ConfigError(f"shards must be at most 4096, not {shown(self.shards)}")
        _positive("shards", self.shards, integer=True)
        if self.hash != "blake2b-64":
            raise ConfigError(f"unknown shard hash {self.hash!r} (known: blake2b-64)")
        _positive("max_backlog", self.max_backlog, allow_none=True, integer=True)
        _positive("dedupe_window_s", self.dedupe_window_s, zero=True)
        _positive("retention_s", self.retention_s, allow_none=True)
        _positive("retention_bytes", self.retention_bytes, allow_none=True, integer=True)
        _positive("retention_messages", self.retention_messages, allow_none=True, integer=True)
        _positive("ttl_s", self.ttl_s, allow_none=True)
        if self.ttl_action not in TTL_ACTIONS:
            raise ConfigError(f"ttl_action must be one of {', '.join(TTL_ACTIONS)}, not {shown(self.ttl_action)}")
        _positive("max_message_bytes", self.max_message_bytes, integer=True)
        if self.max_message_bytes > 8 << 20:
            raise ConfigError("max_message_bytes must be at most 8 MiB (a transaction is 10 MB)")
        for name in ("extend", "paused"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, not {shown(getattr(self, name))}")
        for name in ("subs", "catchup", "paused_subs"):
            object.__setattr__(self, name, _names(name, getattr(self, name)))
        for name in ("catchup", "paused_subs"):
            stray = [sub for sub in getattr(self, name) if sub not in self.subs]
            if stray:
                raise ConfigError(f"{name} names {stray[0]!r}, not one of the topic's subscriptions {self.subs}")
        if self.resharding_to is not None:
            if isinstance(self.resharding_to, bool) or not isinstance(self.resharding_to, int) \
                    or not 1 <= self.resharding_to <= 4096:
                raise ConfigError(f"resharding_to must be a shard count (1 to 4096) or None, not {shown(self.resharding_to)}")
        if self.held_at is not None:
            if isinstance(self.held_at, bool) or not isinstance(self.held_at, int) or not 0 <= self.held_at <= MAX_INT:
                raise ConfigError(f"held_at must be a database version or None, not {shown(self.held_at)}")

    @property
    def routing(self) -> bool:
        """Whether pushes go to the subscriptions' queues now (not paused, not resharding)."""
        return not self.paused and self.resharding_to is None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["subs"] = list(self.subs)
        d["catchup"] = list(self.catchup)
        d["paused_subs"] = list(self.paused_subs)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TopicConfig":
        d = dict(d)
        d["subs"] = tuple(d.get("subs", (DEFAULT_SUBSCRIPTION,)))
        d["catchup"] = tuple(d.get("catchup", ()))
        d["paused_subs"] = tuple(d.get("paused_subs", ()))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# TopicConfig's fields that are the topic's state -> the operation that changes it
# ({t}: the topic's name); and the options fixed at creation -> how to change them.
TOPIC_STATE = {
    "paused": "Supervisor.pause({t}) (Supervisor.play({t}) resumes)",
    "resharding_to": "Supervisor.rebalance({t}, shards=N)",
    "catchup": "Supervisor.create_subscription({t}, subscription) or Supervisor.reset({t}, subscription)",
    "paused_subs": "Supervisor.pause_subscription({t}, subscription)",
    "held_at": "Supervisor.play({t})",
}
TOPIC_FIXED = {
    "shards": "change the count with Supervisor.rebalance({t}, shards=N)",
    "extend": "add it with Supervisor.upgrade_extend({t}), one-way",
    "subs": "use Supervisor.create_subscription({t}, subscription) or Supervisor.delete_subscription",
    "hash": "it is fixed when the topic is created",
}


def check_topic_options(topic: str | None, options, *, update: bool = False):
    """Refuse what a caller may not set in a topic's config: its state (each naming the
    operation that changes it), an unknown option, and with ``update`` an option fixed
    at creation (``UPDATABLE_TOPIC_FIELDS`` may change). ``options``: names, or a
    ``TopicConfig`` (its state must be the default)."""
    if isinstance(options, TopicConfig):
        default = TopicConfig()
        options = [name for name in TOPIC_STATE if getattr(options, name) != getattr(default, name)]
    t = repr(topic) if topic is not None else "topic"
    known = {f.name for f in dataclasses.fields(TopicConfig)}
    for name in sorted(options):
        if name in TOPIC_STATE:
            raise ConfigError(f"{name!r} is topic state, not an option: use {TOPIC_STATE[name].format(t=t)}")
        if name not in known:
            settable = UPDATABLE_TOPIC_FIELDS if update else sorted(known - set(TOPIC_STATE))
            raise ConfigError(f"unknown topic option {name!r} (options: {', '.join(settable)})")
    fixed = sorted(set(options) - set(UPDATABLE_TOPIC_FIELDS)) if update else []
    if fixed:
        how = "; ".join(f"{name}: {TOPIC_FIXED[name].format(t=t)}" for name in fixed)
        raise ConfigError(f"topic option(s) {', '.join(fixed)} cannot be updated ({how}); updatable: "
                          f"{', '.join(UPDATABLE_TOPIC_FIELDS)}")


# ConsumerConfig's lower bounds, seconds.
MIN_INTERVALS = {"ack_wait_s": 0.01, "heartbeat_interval_s": 0.01, "lease_check_interval_s": 0.01,
                 "poll_interval_s": 0.001}


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig:
    """How one consumer behaves (per consumer, never stored with the subscription).

    ``ack_wait_s``: lease length; an unacked message is redelivered after it.
    ``max_deliver``: deliveries before a message goes to the dead-letter queue.
    ``backoff_s``: nak delays by attempt (the last repeats); () = redeliver at once.
    ``heartbeat_interval_s`` / ``zombie_timeout_s``: liveness; a consumer whose heartbeat
    counter stays unchanged for the timeout (on the observer's monotonic clock) is a zombie.
    ``max_concurrency``: handlers running at once in this consumer, never two of one shard
    number at once (so never two of one shard key, whatever their dispatch tags). Two
    consumers may run a key's messages at once only when they are of different tags
    (tag dispatch gives each tag's shards to the consumers wanting it).
    ``poll_interval_s``: the longest a consumer sleeps without a watch firing.
    ``lease_check_interval_s``: how often a consumer checks its shards' leases and
    advances the topic's clock that delays are due by (``membership.read_clock``): a
    delay ends at most about this much late, never early.
    ``maintenance``: take part in the topic's maintenance (``fdq.maintainer``: its
    retention, one process at a time, taken over after the holder's beat stood still
    for this consumer's zombie timeout); False: never.
    Lower bounds (``MIN_INTERVALS``): 0.01 s for ``ack_wait_s``, ``heartbeat_interval_s``
    and ``lease_check_interval_s``, 0.001 s for ``poll_interval_s``; below them a
    consumer's loops spin and its stall alarm fires on a healthy consumer.
    """

    ack_wait_s: float = 30.0
    max_deliver: int = 5
    backoff_s: tuple = ()
    heartbeat_interval_s: float = 1.0
    zombie_timeout_s: float | None = None
    max_concurrency: int = 1
    poll_interval_s: float = 0.5
    lease_check_interval_s: float = 0.25
    maintenance: bool = True

    def __post_init__(self):
        _positive("ack_wait_s", self.ack_wait_s)
        if not isinstance(self.maintenance, bool):
            raise ConfigError(f"maintenance must be True or False, not {shown(self.maintenance)}")
        _positive("max_deliver", self.max_deliver, integer=True)
        if not isinstance(self.backoff_s, (tuple, list)):
            raise ConfigError(f"backoff_s must be a sequence of seconds, not {self.backoff_s!r}")
        for b in self.backoff_s:
            _positive("backoff_s entries", b, zero=True)
        object.__setattr__(self, "backoff_s", tuple(self.backoff_s))
        _positive("heartbeat_interval_s", self.heartbeat_interval_s)
        _positive("zombie_timeout_s", self.zombie_timeout_s, allow_none=True)
        if self.zombie_timeout_s is not None and self.zombie_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(f"zombie_timeout_s ({self.zombie_timeout_s}) must exceed "
                              f"heartbeat_interval_s ({self.heartbeat_interval_s})")
        _positive("max_concurrency", self.max_concurrency, integer=True)
        _positive("poll_interval_s", self.poll_interval_s)
        _positive("lease_check_interval_s", self.lease_check_interval_s)
        for name, minimum in MIN_INTERVALS.items():
            _at_least(name, getattr(self, name), minimum)

    @property
    def zombie_after_s(self) -> float:
        """The zombie timeout: default 3 heartbeats."""
        return self.zombie_timeout_s if self.zombie_timeout_s is not None else 3 * self.heartbeat_interval_s

    def backoff_for(self, attempts: int) -> float:
        if not self.backoff_s:
            return 0.0
        return self.backoff_s[min(max(attempts - 1, 0), len(self.backoff_s) - 1)]


@dataclass(frozen=True, kw_only=True)
class ProducerConfig:
    """``linger_ms``: how long a group commit waits for more concurrent pushes (0: take
    what is queued, once the callers the previous commit released have queued again or a
    fifth of a commit has passed). ``max_batch``: messages per commit.
    ``auto_create``: a push to a missing topic creates it (``True``: with the default
    ``TopicConfig()``; a ``TopicConfig``: with that one) or raises ``TopicNotFound``
    (``False``)."""

    linger_ms: float = 0.0
    max_batch: int = 1000
    auto_create: bool | TopicConfig = True

    def __post_init__(self):
        _positive("linger_ms", self.linger_ms, zero=True)
        _positive("max_batch", self.max_batch, integer=True)
        if self.max_batch > 1 << 16:
            raise ConfigError(f"max_batch must be at most 65,536 (messages per transaction), not {shown(self.max_batch)}")
        if not isinstance(self.auto_create, (bool, TopicConfig)):
            raise ConfigError(f"auto_create must be True, False or a TopicConfig, not {self.auto_create!r}")
        if isinstance(self.auto_create, TopicConfig):
            check_topic_options(None, self.auto_create)


ACK_POLICIES = ("explicit", "none")
DELIVER_POLICIES = ("all", "new", "last", "by_start_time")
# Fields an explicit ``update_subscription`` may change; the others fix what the
# subscription is (its start, its filter, its delivery contract) and need a new one.
UPDATABLE_SUBSCRIPTION_FIELDS = ("description", "ack_wait_s", "max_deliver", "backoff_s",
                                 "max_ack_pending")
# Fields ``Supervisor.update_topic`` may change (retention and limits); the others fix
# what the topic is (shards: rebalance; extend: upgrade) or are its state.
UPDATABLE_TOPIC_FIELDS = ("max_backlog", "dedupe_window_s", "retention_s", "retention_bytes", "retention_messages",
                          "ttl_s", "ttl_action", "max_message_bytes")
# What becomes of a message whose TTL ended before its delivery (TopicConfig.ttl_action).
TTL_ACTIONS = ("drop", "dead_letter")


@dataclass(frozen=True, kw_only=True)
class SubscriptionConfig:
    """A subscription's stored configuration (``config/topics/<topic>/subs/<sub>``),
    shared by all its consumers.

    ``ack_policy``: ``"explicit"`` (messages are leased until acked) or ``"none"`` (a
    message counts as done when delivered: consumers take it at most once, or inside
    their transaction in exactly-once mode).
    ``ack_wait_s`` / ``max_deliver`` / ``backoff_s``: the redelivery policy of every
    consumer of the subscription. ``None`` (the default) leaves each to the consumer's
    own ``ConsumerConfig`` (as NSQ clients set their timeout per connection); a value
    set here overrides it for all consumers.
    ``max_ack_pending``: flow control, per shard: no shard of the subscription ever has
    more than this many leased (delivered, unsettled) messages. A consumer stops
    leasing from a shard at the limit until acks free room, so a subscription has at
    most ``shards x max_ack_pending`` (per dispatch tag) in flight. Checked in the
    leasing transaction against the shard's own ``in_flight`` counter, which only the
    shard's fenced owner increases: exact, with no counter shared by shards.
    ``deliver_policy``: where a new subscription starts: ``"all"`` (every message still
    in the topic's "all" log), ``"new"`` (messages pushed after it is created),
    ``"last"`` (the last message pushed before, then the new ones), ``"by_start_time"``
    (messages inserted at ``start_time_ms`` or later, epoch ms, producers' clock).
    ``filter_shard_key`` (an ``fnmatch`` glob) / ``filter_headers`` ({name: value}, all
    must match; a string header matches its own text, any other value its compact JSON
    text: ``true``, ``null``, ``3``, ``[1,"a"]``): only matching messages are delivered;
    others are dropped (counted as done and ``filtered``) when a consumer reaches them. A message without a shard key
    never matches a shard-key filter.
    ``ordered``: while a message of shard key K is leased or waits for redelivery, later
    messages of K are held back (other keys flow); see ``fdq.ops.queue``.
    ``ephemeral``: deleted when its last consumer leaves or becomes a zombie (also
    implied by a name ending ``#ephemeral``).
    ``description``: free text, at most 4096 characters.
    """

    ack_policy: str = "explicit"
    ack_wait_s: float | None = None
    max_deliver: int | None = None
    backoff_s: tuple | None = None
    max_ack_pending: int | None = None
    deliver_policy: str = "all"
    start_time_ms: int | None = None
    filter_shard_key: str | None = None
    filter_headers: dict | None = None
    ordered: bool = False
    ephemeral: bool = False
    description: str = ""

    def __post_init__(self):
        if self.ack_policy not in ACK_POLICIES:
            raise ConfigError(f"ack_policy must be one of {', '.join(ACK_POLICIES)}, not {self.ack_policy!r}")
        if self.deliver_policy not in DELIVER_POLICIES:
            raise ConfigError(f"deliver_policy must be one of {', '.join(DELIVER_POLICIES)}, "
                              f"not {self.deliver_policy!r}")
        _positive("ack_wait_s", self.ack_wait_s, allow_none=True)
        _at_least("ack_wait_s", self.ack_wait_s, MIN_INTERVALS["ack_wait_s"])   # (its consumers' minimum)
        _positive("max_deliver", self.max_deliver, allow_none=True, integer=True)
        _positive("max_ack_pending", self.max_ack_pending, allow_none=True, integer=True)
        if self.backoff_s is not None:
            if not isinstance(self.backoff_s, (tuple, list)):
                raise ConfigError(f"backoff_s must be a sequence of seconds, not {self.backoff_s!r}")
            for b in self.backoff_s:
                _positive("backoff_s entries", b, zero=True)
            object.__setattr__(self, "backoff_s", tuple(self.backoff_s))
        if self.start_time_ms is not None:
            if isinstance(self.start_time_ms, bool) or not isinstance(self.start_time_ms, int) \
                    or self.start_time_ms < 0:
                raise ConfigError(f"start_time_ms must be epoch milliseconds (an integer >= 0), "
                                  f"not {self.start_time_ms!r}")
        if self.filter_shard_key is not None and (not isinstance(self.filter_shard_key, str)
                                                  or not self.filter_shard_key):
            raise ConfigError(f"filter_shard_key must be a non-empty glob, not {self.filter_shard_key!r}")
        if self.filter_headers is not None:
            if not isinstance(self.filter_headers, dict) or not self.filter_headers:
                raise ConfigError(f"filter_headers must be a non-empty dict {{name: value}}, "
                                  f"not {self.filter_headers!r}")
            for k, v in self.filter_headers.items():
                check_filter_value(check_filter_name(k), v)
            object.__setattr__(self, "filter_headers", dict(sorted(self.filter_headers.items())))
        for name in ("ordered", "ephemeral"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, not {getattr(self, name)!r}")
        if not isinstance(self.description, str) or len(self.description) > 4096:
            raise ConfigError("description must be a str of at most 4096 characters")
        # Options that need another: each error names both.
        if self.start_time_ms is not None and self.deliver_policy != "by_start_time":
            raise ConfigError(f"start_time_ms needs deliver_policy='by_start_time' "
                              f"(deliver_policy is {self.deliver_policy!r})")
        if self.deliver_policy == "by_start_time" and self.start_time_ms is None:
            raise ConfigError("deliver_policy='by_start_time' needs start_time_ms")
        if self.ack_policy == "none":
            for name in ("ack_wait_s", "max_deliver", "backoff_s", "max_ack_pending"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name} needs ack_policy='explicit' (ack_policy is 'none': "
                                      "nothing is leased or redelivered)")
            if self.ordered:
                raise ConfigError("ordered=True needs ack_policy='explicit' (ack_policy is 'none': "
                                  "nothing is redelivered, so nothing is held back)")
        if self.backoff_s and self.max_deliver is not None and len(self.backoff_s) >= self.max_deliver:
            raise ConfigError(f"backoff_s has {len(self.backoff_s)} entries but max_deliver is "
                              f"{self.max_deliver}: a message is redelivered at most max_deliver - 1 "
                              f"times, so backoff_s may have at most {self.max_deliver - 1}")

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d["backoff_s"] is not None:
            d["backoff_s"] = list(d["backoff_s"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SubscriptionConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown subscription option(s): {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(known))})")
        return cls(**d)

    def differences(self, other: "SubscriptionConfig") -> list:
        """[(field, self's value, other's value)] of the fields that differ."""
        return [(f.name, getattr(self, f.name), getattr(other, f.name))
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def effective_consumer_config(consumer_config: ConsumerConfig, config: SubscriptionConfig) -> ConsumerConfig:
    """The consumer's config with the subscription's redelivery policy, where set."""
    changes = {k: getattr(config, k) for k in ("ack_wait_s", "max_deliver", "backoff_s")
               if getattr(config, k) is not None}
    return dataclasses.replace(consumer_config, **changes) if changes else consumer_config


def check_filters(topic: str, sub: str, config: SubscriptionConfig, topic_config: TopicConfig):
    """Refuse a filter that this topic's messages can never match, so it would drop
    (count as ``filtered``) every message: a header filter on a topic that stores no
    headers (no extend support). The other filters that can match nothing are refused by
    ``SubscriptionConfig`` itself (unknown ``##`` names, values over a message's header
    limit); a shard-key glob stays allowed (it never matches a message pushed without a
    shard key, as documented; its drops show as ``filtered`` in stats)."""
    if config.filter_headers is not None and not topic_config.extend:
        raise ConfigError(f"subscription {sub!r} of {topic!r}: a header filter needs a topic with extend "
                          f"support (topic {topic!r} stores no headers, so the filter would drop every "
                          f"message); run fdq topics upgrade {topic} --extend (Supervisor.upgrade_extend) "
                          "first, or create the topic with --extend")


__all__ = ["TopicConfig", "ConsumerConfig", "ProducerConfig", "SubscriptionConfig",
           "UPDATABLE_SUBSCRIPTION_FIELDS", "UPDATABLE_TOPIC_FIELDS", "TOPIC_STATE", "check_topic_options",
           "check_name", "check_filters", "check_replay_id", "default_replay_id", "shown", "NAME_RE",
           "DEFAULT_SUBSCRIPTION", "CHUNK", "effective_consumer_config", "TTL_ACTIONS"]
