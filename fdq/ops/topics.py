"""Topics: the transactional functions that read, create, change and delete the
``config/topics/<topic>`` key every push reads, and a play's hold on pushes.

Every change of a topic's config bumps FoundationDB's ``\\xff/metadataVersion`` in its
transaction (:func:`write_topic_config`, :func:`delete_topic`): a reader that finds it
unchanged uses the config it read with it (:func:`cached_topic_config`). On a cluster that
saves every push a storage read of the one key all of a topic's pushes read (the metadata
version comes with the read version); its non-snapshot read still conflicts with any
config change, as the config key's read did."""
from __future__ import annotations

import dataclasses
import weakref

from ..config import SubscriptionConfig, TopicConfig, check_name
from ..engine import transactional
from ..errors import TopicExists, TopicHeld, TopicNotFound
from ..keyspace.format import ensure_format
from ..keyspace import METADATA_VERSION_KEY, Keyspace, TopicSpace, stamped_value
from ..keyspace.codec import encode_subscription, pack, unpack

HOLD_VERSIONS = 1_000_000   # a play's hold on pushes (play_chunk) lapses after ~1 s of versions
HOLD_WAIT_S = 0.002         # a push the hold refused (TopicHeld) tries again after this
_LAST = [None, None]     # (raw, TopicConfig) last decoded: consumers decode it per shard visit
_CACHED = weakref.WeakKeyDictionary()   # database -> {config key: (metadata version, TopicConfig or None)}
_BUMPED = weakref.WeakSet()             # transactions that bumped the metadata version (reading it there: 1036)
_ZERO_STAMP = b"\x00" * 14


def load_config(raw) -> TopicConfig | None:
    if raw == None:  # noqa: E711 - FDB's absent Value equals None
        return None
    raw = bytes(raw)
    last = _LAST    # one read of the pair: another thread may replace it meanwhile
    if last[0] == raw:
        return last[1]
    config = TopicConfig.from_dict(unpack(raw))     # frozen: safe to share
    globals()["_LAST"] = [raw, config]
    return config


@transactional
def read_topic_config(tr, ts: TopicSpace, *, snapshot: bool = False) -> TopicConfig:
    """The topic's config; a non-snapshot read makes the caller retry if it changes."""
    reader = tr.snapshot if snapshot else tr
    config = load_config(reader[ts.config_key])
    if config is None:
        raise TopicNotFound(f"topic {ts.name!r} does not exist")
    return config


def cached_topic_config(tr, ts: TopicSpace) -> TopicConfig | None:
    """The topic's config (None: no such topic), as a non-snapshot read of its key would
    give it, from this process's cache while the database's metadata version is the one
    it was read with. The metadata version's read is the conflict: a config change
    committed after this transaction's read version makes it retry."""
    if tr in _BUMPED:      # this transaction changed a config: read it (and its own writes)
        return load_config(tr[ts.config_key])
    mv = tr[METADATA_VERSION_KEY]
    if mv == None:  # noqa: E711 - never bumped: no config was ever written through FDQ
        return load_config(tr[ts.config_key])
    mv = bytes(mv)
    per_db = _CACHED.get(tr.db)
    if per_db is None:
        per_db = _CACHED.setdefault(tr.db, {})
    hit = per_db.get(ts.config_key)
    if hit is not None and hit[0] == mv:
        return hit[1]
    config = load_config(tr.snapshot[ts.config_key])
    per_db[ts.config_key] = (mv, config)
    return config


def bump_metadata_version(tr):
    """Mark a config change: readers' caches (:func:`cached_topic_config`) read again."""
    tr.set_versionstamped_value(METADATA_VERSION_KEY, _ZERO_STAMP)
    _BUMPED.add(tr)


def held(rv: int, held_at: int) -> bool:
    """Whether a hold from version ``held_at`` holds at read version ``rv``: not once
    ``HOLD_VERSIONS`` passed, nor if it is ahead (written in another database's
    versions: a copy or restore)."""
    return 0 <= rv - held_at < HOLD_VERSIONS


def check_hold(tr, ts: TopicSpace, config: TopicConfig):
    """Raise ``TopicHeld`` if a play holds the topic's pushes now (``held_at`` within
    ``HOLD_VERSIONS`` before this transaction's read version)."""
    if config.held_at is not None and held(tr.get_read_version().wait(), config.held_at):
        raise TopicHeld(f"topic {ts.name!r} is held by a play finishing: retry")


@transactional
def create_topic(tr, ks: Keyspace, name: str, config: TopicConfig, *, exist_ok: bool = True,
                 strict_shards: bool = False) -> TopicConfig:
    """Create a topic; re-running with the same config is a no-op. An existing topic
    with another shard count is an error when ``strict_shards`` (the caller asked for
    that count) or the count asked for is not the default; otherwise it is returned."""
    check_name(name)
    ensure_format(tr, ks)
    ts = ks.topic(name)
    existing = load_config(tr[ts.config_key])
    if existing is not None:
        if not exist_ok or (existing.shards != config.shards and (strict_shards or config.shards != TopicConfig().shards)):
            raise TopicExists(f"topic {name!r} already exists with {existing.shards} shards, not {config.shards}"
                              f" (change the count with rebalance)")
        return existing
    return write_new_topic_config(tr, ts, config)


def write_new_topic_config(tr, ts: TopicSpace, config: TopicConfig) -> TopicConfig:
    """Write the config of a topic that does not exist (in the caller's transaction) and
    a record of each of its subscriptions (``default``), with the defaults, starting at
    this transaction (nothing to catch up: the log is empty)."""
    write_topic_config(tr, ts, config)
    for sub in config.subs:
        write_subscription_record(tr, ts, sub, SubscriptionConfig())
    return config


def write_subscription_record(tr, ts: TopicSpace, sub: str, config: SubscriptionConfig):
    """Write a new subscription's record (its config) and its start boundary (this
    transaction's versionstamp: pushes committed after it fan out to ``sub``)."""
    tr[ts.sub_record_key(sub)] = encode_subscription({"config": config.as_dict()})
    stamp_subscription_start(tr, ts, sub)


def stamp_subscription_start(tr, ts: TopicSpace, sub: str):
    """Set ``sub``'s start boundary to this transaction's versionstamp, clearing what
    the catch-up of an earlier start left (cursors, purge marks)."""
    r = ts.sub_records[sub].range()
    tr.clear_range(r.start, r.stop)
    tr.set_versionstamped_value(ts.sub_boundary_key(sub), stamped_value())


@transactional
def write_topic_config(tr, ts: TopicSpace, config: TopicConfig):
    tr[ts.config_key] = pack(config.as_dict())
    bump_metadata_version(tr)


@transactional
def update_topic_config(tr, ts: TopicSpace, **changes) -> TopicConfig:
    """Change fields of a topic's config (pushes in flight retry with the new one)."""
    config = dataclasses.replace(read_topic_config(tr, ts), **changes)
    write_topic_config(tr, ts, config)
    return config


@transactional
def list_topics(tr, ks: Keyspace) -> list:
    """(name, config) of every topic, by name."""
    out = []
    r = ks.topic_names_range()
    for kv in tr.snapshot.get_range(r.start, r.stop):
        name = ks.unpack_topic_config_key(kv.key)
        if name is not None:
            out.append((name, load_config(kv.value)))
    return out


@transactional
def delete_topic(tr, ts: TopicSpace):
    """Delete a topic: its config, consumers, subscription records, queues, log and
    counters (range clears: one small transaction whatever it holds). Pushes in flight
    read the config (the metadata version): they retry and find no topic."""
    r = ts.config_space.range()
    tr.clear_range(r.start, r.stop)
    del tr[ts.config_key]
    bump_metadata_version(tr)
    r = ts.space.range()
    tr.clear_range(r.start, r.stop)
    for key in ts.maintenance_role_keys:     # its maintainer's role (meta/leaders)
        del tr[key]
