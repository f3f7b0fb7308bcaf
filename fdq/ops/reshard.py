"""Resharding: changing a topic's shard count while it keeps accepting pushes.

``reshard_begin`` sends pushes to the pending area (as a pause does) and fences every
shard's owner off; ``reshard_chunk`` moves each queue area (ready, delayed, leased) of
each old shard, a chunk at a time, to its messages' new shards (``routing.target``: a
keyed message by its key, an unkeyed one to its home, where every copy of it goes),
keys (versionstamps) kept, so each new shard's queue stays in push order per shard key; ``fold_shard_counters``
keeps the counters of shards that go away; ``reshard_finish`` adopts the new count, and
``fdq.ops.play`` then routes what was pushed meanwhile. Every step is safe to re-run.
``queued_messages`` counts, from counters, what the queues hold when a reshard begins;
``Rebalanced`` is what ``Supervisor.rebalance`` reports.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ..engine import transactional
from ..config import TopicConfig
from ..errors import ConfigError
from ..keyspace import TopicSpace, counter, decode_counter
from ..keyspace.codec import CHUNK_WRITE_BYTES, LeaseRecord, Record, decode_leases, pack
from .membership import assign_shards, read_owners, read_tags
from .play import resharding
from .routing import target
from .stats import SHARD_COUNTERS, shard_counters
from .topics import read_topic_config, write_topic_config

AREAS = ("ready", "delayed", "leased")    # a shard's queue areas, as reshard_chunk moves them


@dataclasses.dataclass(frozen=True)
class Rebalanced:
    """What ``Supervisor.rebalance`` did. ``config``: the topic's config as stored when it
    returned (``shards``: its shard count now); ``from_shards``: the count before;
    ``queued``: the messages its subscriptions' queues held (ready, delayed, in flight;
    from counters) when the reshard began, 0 when the count did not change; ``moved``:
    the messages this call moved to another shard. Each message moves at most once, so
    ``moved <= queued`` and, with no settlement meanwhile, the other ``queued - moved``
    kept their shard."""

    config: TopicConfig
    from_shards: int
    queued: int = 0
    moved: int = 0

    @property
    def shards(self) -> int:
        return self.config.shards


class ReshardChunk(NamedTuple):
    """What one ``reshard_chunk`` did: ``read`` entries (a lease record is one),
    ``last`` key read, ``done`` with the area; ``messages`` read (a lease record's every
    message), ``moves`` {new shard: messages moved there}."""

    read: int
    last: bytes | None
    done: bool
    messages: int
    moves: dict


@transactional
def queued_messages(tr, ts: TopicSpace) -> int:
    """The messages the topic's queues hold (ready, delayed, in flight; every
    subscription, tag and shard, the new count's shards too while resharding): routed
    minus done, from counters, never a scan (snapshot reads)."""
    config = read_topic_config(tr, ts, snapshot=True)
    tags = read_tags(tr, ts)
    return sum(c["backlog"] for sub in config.subs
               for c in shard_counters(tr.snapshot, ts, sub, config, tags).values())


@transactional
def reshard_begin(tr, ts: TopicSpace, shards: int) -> TopicConfig:
    """Start changing the shard count: pushes go to the pending area; every shard's
    owner is fenced off (epoch bump, no owner) until ``reshard_finish``."""
    config = read_topic_config(tr, ts)
    if shards == config.shards and config.resharding_to in (None, shards):
        return config       # nothing to move (or moved: its pending area left to route)
    if config.resharding_to not in (None, shards):
        raise ConfigError(f"topic {ts.name!r} is already being resharded to {config.resharding_to} shards: finish "
                          f"that first (fdq rebalance {ts.name}, without --shards; Supervisor.rebalance), "
                          "then change the count")
    config = dataclasses.replace(config, resharding_to=shards)
    write_topic_config(tr, ts, config)
    for sub in config.subs:
        for (tag, n), (_owner, epoch) in read_owners(tr, ts, sub, snapshot=False).items():
            tr[ts.shard(sub, tag, n).record] = pack([None, epoch + 1])
        tr.add(ts.assignment_key(sub), counter(1))
    return config


@transactional
def reshard_chunk(tr, ts: TopicSpace, sub: str, tag: str, old_n: int, area: str, new_shards: int,
                  limit: int, after: bytes | None = None) -> ReshardChunk:
    """Move the entries of one queue area (ready, delayed, leased) of shard ``(tag,
    old_n)`` whose new shard differs, reading up to ``limit`` entries (lease records)
    or ``CHUNK_WRITE_BYTES`` of them after the key ``after``. Keys keep their
    versionstamp, so each new shard's queue stays in push order per shard key. Returns
    ``(entries read, last key read, done)``: entries that stay put are skipped by the
    next chunk's ``after``, so a long run of them cannot loop forever.

    Only while the topic reshards to ``new_shards`` (``_moving_to``): a run overtaken
    by another moves nothing."""
    if not _moving_to(tr, ts, new_shards):
        return ReshardChunk(0, None, True, 0, {})
    src = ts.shard(sub, tag, old_n)
    space = getattr(src, area)
    r = space.range()
    begin = after + b"\x00" if after is not None else r.start
    read = size = messages = 0
    last = None
    moves = {}      # new shard n -> messages moved there
    for kv in tr.get_range(begin, r.stop, limit=limit):
        if size >= CHUNK_WRITE_BYTES:
            break       # what it moved, written again elsewhere: under FDB's 10 MB per transaction
        read += 1
        last = kv.key
        size += len(kv.key) + len(kv.value)
        if area == "leased":
            messages += _reshard_lease_record(tr, ts, src, kv.key, kv.value, new_shards, moves)
            continue
        messages += 1
        parts = space.unpack(kv.key)
        new_n = target(Record.decode(kv.value), new_shards)[1]
        if new_n == old_n:
            continue
        tr[getattr(ts.shard(sub, tag, new_n), area).pack(parts)] = kv.value
        del tr[kv.key]
        moves[new_n] = moves.get(new_n, 0) + 1
    for new_n, k in moves.items():
        dst = ts.shard(sub, tag, new_n)
        tr.add(src.stat("routed"), counter(-k))
        tr.add(dst.stat("routed"), counter(k))
        if area != "ready":
            name = "in_flight" if area == "leased" else "delayed"
            tr.add(src.stat(name), counter(-k))
            tr.add(dst.stat(name), counter(k))
    return ReshardChunk(read, last, read < limit and size < CHUNK_WRITE_BYTES, messages, moves)


def _reshard_lease_record(tr, ts: TopicSpace, src, key: bytes, raw, new_shards: int, moves: dict) -> int:
    """Split lease record ``key`` of shard ``src`` by its messages' new shards: those
    that move go to a record under the same key suffix (lease id and first stamp) in
    their new shard, merged with one already there (a part of the same record moved by
    an earlier reshard: disjoint messages of one batch, so the merge is no larger than
    the batch's record was); the rest stay."""
    lr = decode_leases(key, raw)
    groups = {}
    for e in lr.entries:
        n = target(Record.decode(e[1]), new_shards)[1]
        groups.setdefault(n, []).append(e)
    if list(groups) == [src.n]:
        return len(lr.entries)
    suffix = key[len(src.leased_prefix):]
    for n, entries in groups.items():
        if n == src.n:
            continue
        dst = ts.shard(src.sub, src.tag, n)
        dkey = dst.leased_prefix + suffix
        there = tr[dkey]
        if there != None:  # noqa: E711
            entries = sorted(decode_leases(dkey, there).entries + entries)
        tr[dkey] = LeaseRecord(lr.lease_id, lr.consumer_id, lr.ack_wait_ms, entries, lr.bump).encode()
        moves[n] = moves.get(n, 0) + len(groups[n])
    stay = groups.get(src.n)
    if stay:
        tr[key] = LeaseRecord(lr.lease_id, lr.consumer_id, lr.ack_wait_ms, stay, lr.bump).encode()
    else:
        del tr[key]
    return len(lr.entries)


@transactional
def fold_shard_counters(tr, ts: TopicSpace, sub: str, tag: str, old_n: int, new_shards: int) -> dict:
    """Move the counters of shard ``(tag, old_n)``, which a reshard to ``new_shards``
    removes (its queues already moved), into shard ``old_n % new_shards``: the
    subscription's stats sum its shards' counters, so its emitted, acked, done... must
    not vanish with the shard (backlog = routed - done stays as it was). Safe to
    re-run: a folded shard's counters are 0. Returns what it moved. Only while the
    topic reshards to ``new_shards`` (``_moving_to``)."""
    if old_n < new_shards or not _moving_to(tr, ts, new_shards):
        return {}
    src, dst = ts.shard(sub, tag, old_n), ts.shard(sub, tag, old_n % new_shards)
    values = {name: decode_counter(tr[src.stat(name)]) for name in SHARD_COUNTERS + ("filtered",)}
    moved = {name: v for name, v in values.items() if v}
    for name, v in moved.items():
        tr.add(src.stat(name), counter(-v))
        tr.add(dst.stat(name), counter(v))
    return moved


def _moving_to(tr, ts: TopicSpace, shards: int) -> bool:
    """Whether the topic's queues are being moved to ``shards`` shards (its config read
    with a conflict); False if another run finished that reshard meanwhile (nothing left
    to move). Raises ConfigError if another run changed the count meanwhile: moving on
    by this one would put messages in shards their keys no longer map to (delivered
    out of their key's order) or in shards that are gone (never delivered)."""
    config = read_topic_config(tr, ts)
    if config.resharding_to == shards and resharding(config):
        return True
    if config.shards == shards and not resharding(config):
        return False
    raise _overtaken(ts, config, shards)


def _overtaken(ts: TopicSpace, config: TopicConfig, shards: int) -> ConfigError:
    return ConfigError(f"topic {ts.name!r} is no longer being resharded to {shards} shards: another rebalance "
                       f"changed the count meanwhile (it has {config.shards} shards, resharding to "
                       f"{config.resharding_to}); this run stopped")


@transactional
def reshard_finish(tr, ts: TopicSpace, shards: int | None = None) -> TopicConfig:
    """Adopt the new shard count. A playing topic keeps ``resharding_to`` (now equal
    to ``shards``) until ``play_chunk`` has routed what was pushed meanwhile, so pushes
    keep going to the pending area after the older ones; a paused one routes nothing
    until its play anyway. ``shards``: the count the caller moved the queues for; a
    reshard to another (begun by another run meanwhile) is not finished (ConfigError)."""
    config = read_topic_config(tr, ts)
    if shards is not None and config.resharding_to not in (None, shards):
        raise _overtaken(ts, config, shards)
    if not resharding(config):
        if config.paused and config.resharding_to is not None:    # paused while draining:
            config = dataclasses.replace(config, resharding_to=None)  # its play routes them
            write_topic_config(tr, ts, config)
        return config
    config = dataclasses.replace(config, shards=config.resharding_to,
                                 resharding_to=None if config.paused else config.resharding_to)
    write_topic_config(tr, ts, config)
    for sub in config.subs:
        assign_shards(tr, ts, sub)
    for sub in config.catchup:
        # A reset's purge marks shards it finished; the reshard moved messages it had
        # not purged yet into them: it scans every shard again (safe, it is idempotent).
        r = ts.sub_purge_marks(sub).range()
        tr.clear_range(r.start, r.stop)
    return config
