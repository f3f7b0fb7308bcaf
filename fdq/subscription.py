"""Subscriptions: the transactional functions that create, catch up, reset, update and
delete a subscription, and the ephemeral-subscription lifecycle.

Storage. The topic config (``config/topics/<t>``, read by every push) lists the
subscriptions' names in ``subs`` (pushes fan out to each) and, in ``catchup``, those
still copying their start point from the "all" log (their consumers deliver nothing
until it is done). Each subscription's own configuration lives beside it, in
``config/topics/<t>/subs/<sub>``, so pushes never decode consumer settings; a topic's
first subscriptions (``default``) get theirs with the topic (``topic.write_new_topic_config``).

The start boundary is exact. ``create_subscription`` adds the name to ``subs`` in a
transaction C that also stores C's own versionstamp (``.../subs/<sub>/boundary``). A push
reads the config key, so a push committed after C saw the new config (or conflicted
with C and retried) and fanned out to the new subscription; a push committed before C
did not. Log keys are versionstamps, i.e. commit order, so the catch-up copies exactly
the log entries older than C's versionstamp, keyed by their own versionstamp (the shard
queues stay in push order), and no message is missed or copied twice. The catch-up runs
in resumable chunks (a cursor per log bucket); any consumer or supervisor may finish it.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import time

from . import delivery, membership
from .config import (CHUNK, DEFAULT_SUBSCRIPTION, UPDATABLE_SUBSCRIPTION_FIELDS, SubscriptionConfig,
                     TopicConfig, check_name)
from .engine import transactional
from .errors import ConfigError, SubscriptionNotFound
from .headers import dispatch_tag
from .keyspace import TopicSpace, Versionstamp, counter
from .keyspace.codec import CHUNK_WRITE_BYTES, Record, pack, shard_of, unpack
from .log import SLACK_MS
from .ops.topics import read_topic_config, stamp_subscription_start, write_subscription_record, write_topic_config

_DONE = b"done"


def is_ephemeral(name: str, config: SubscriptionConfig) -> bool:
    return config.ephemeral or name.endswith("#ephemeral")


# -- records ----------------------------------------------------------------------------

def _cursors(ts: TopicSpace, sub: str):
    return ts.sub_records[sub]["cursor"]


def _load(raw) -> dict | None:
    if raw == None:  # noqa: E711 - FDB's absent Value equals None
        return None
    return unpack(raw)


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
    return SubscriptionConfig.from_dict(_load(reader[ts.sub_record_key(sub)])["config"])


@transactional
def subscription_info(tr, ts: TopicSpace, sub: str) -> dict:
    """{"config", "ephemeral", "catching_up", "paused", "start_position"} (the id of the
    first position after the start boundary). ``paused``: paused on its own
    (``set_subscription_paused``)."""
    topic_config = read_topic_config(tr, ts, snapshot=True)
    config = read_subscription(tr, ts, sub, snapshot=True, topic_config=topic_config)
    raw = tr.snapshot[ts.sub_boundary_key(sub)]
    boundary = bytes(raw)[:10].hex() + "0000"
    return {"name": sub, "config": config, "ephemeral": is_ephemeral(sub, config),
            "catching_up": sub in topic_config.catchup, "paused": sub in topic_config.paused_subs,
            "start_position": boundary}


def _diff_error(ts, sub, stored: SubscriptionConfig, given: SubscriptionConfig) -> ConfigError:
    diffs = "; ".join(f"{f} (stored {a!r}, given {b!r})" for f, a, b in stored.differences(given))
    return ConfigError(f"subscription {sub!r} of topic {ts.name!r} exists with a different "
                       f"configuration: {diffs}. Change updatable fields "
                       f"({', '.join(UPDATABLE_SUBSCRIPTION_FIELDS)}) with update_subscription; "
                       f"others need a new subscription")


# -- create / delete / update ------------------------------------------------------------

@transactional
def create_subscription(tr, ts: TopicSpace, sub: str, config: SubscriptionConfig | None, *,
                        exist_ok: bool = True) -> bool:
    """Add ``sub`` to the topic: pushes committed after this transaction fan out to it;
    its start point (``deliver_policy``) is copied later by ``catch_up_chunk``. Binding
    to an existing subscription with the same config (or ``config=None``: defaults for
    a new one, whatever is stored for an existing one) is a no-op that returns False;
    with a different one an error listing the differing fields. Returns True if created."""
    check_name(sub, "subscription")
    topic_config = read_topic_config(tr, ts)
    if sub in topic_config.subs:
        stored = read_subscription(tr, ts, sub, topic_config=topic_config)
        if config is not None and stored != config:
            raise _diff_error(ts, sub, stored, config)
        if not exist_ok:
            raise ConfigError(f"subscription {sub!r} of topic {ts.name!r} already exists")
        return False
    config = config if config is not None else SubscriptionConfig()
    if not topic_config.routing:
        raise ConfigError(f"topic {ts.name!r} is {'paused' if topic_config.paused else 'resharding'}: "
                          "subscriptions can be created once it is playing again")
    write_subscription_record(tr, ts, sub, config)
    catchup = topic_config.catchup + ((sub,) if config.deliver_policy != "new" else ())
    new = dataclasses.replace(topic_config, subs=topic_config.subs + (sub,), catchup=catchup)
    write_topic_config(tr, ts, new)
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
    for space in (ts.subs[sub], ts.consumers[sub], ts.shard_records[sub], ts.sub_records[sub]):
        r = space.range()
        tr.clear_range(r.start, r.stop)
    del tr[ts.sub_record_key(sub)]
    del tr[ts.assignment_key(sub)]
    return True


@transactional
def update_subscription(tr, ts: TopicSpace, sub: str, **changes) -> SubscriptionConfig:
    """Change updatable fields (``UPDATABLE_SUBSCRIPTION_FIELDS``); consumers pick the
    new values up at their next heartbeat."""
    fixed = sorted(set(changes) - set(UPDATABLE_SUBSCRIPTION_FIELDS))
    if fixed:
        raise ConfigError(f"cannot update {', '.join(fixed)} of subscription {sub!r}: only "
                          f"{', '.join(UPDATABLE_SUBSCRIPTION_FIELDS)} may change (create a new "
                          "subscription, or reset it for a new start point)")
    config = dataclasses.replace(read_subscription(tr, ts, sub), **changes)
    rec = _load(tr[ts.sub_record_key(sub)])
    rec["config"] = config.as_dict()
    tr[ts.sub_record_key(sub)] = pack(rec)
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


# -- start points: catch-up and reset ----------------------------------------------------

@transactional
def begin_reset(tr, ts: TopicSpace, sub: str, to_time_ms: int | None):
    """Start moving ``sub``'s start to ``to_time_ms`` (None: now). Sets a new boundary
    (this transaction's versionstamp) and marks the subscription catching up, which
    stops its delivery; ``purge_chunk`` then drops its queued messages older than the
    boundary and ``catch_up_chunk`` copies the log from the new start."""
    topic_config = read_topic_config(tr, ts)
    read_subscription(tr, ts, sub, topic_config=topic_config)
    if not topic_config.routing:
        raise ConfigError(f"topic {ts.name!r} is {'paused' if topic_config.paused else 'resharding'}: "
                          "reset it once it is playing again")
    rec = _load(tr[ts.sub_record_key(sub)])
    rec["reset"] = {"to_time_ms": to_time_ms, "purged": False}
    tr[ts.sub_record_key(sub)] = pack(rec)
    stamp_subscription_start(tr, ts, sub)
    if sub not in topic_config.catchup:
        write_topic_config(tr, ts, dataclasses.replace(topic_config, catchup=topic_config.catchup + (sub,)))


def _boundary(tr, ts, sub) -> Versionstamp:
    raw = tr[ts.sub_boundary_key(sub)]
    if raw == None:  # noqa: E711
        raise SubscriptionNotFound(f"subscription {sub!r} of topic {ts.name!r} has no start boundary")
    return Versionstamp(bytes(raw)[:10], 0)


PURGE_SCAN = 2_000    # delayed entries one purge transaction scans


@transactional
def purge_chunk(tr, ts: TopicSpace, sub: str, limit: int) -> int:
    """Reset, step 2: remove up to ``limit`` ready or delayed messages of ``sub`` older
    than its boundary (leases and the DLQ stay), shard by shard, resumable (a marker per
    shard: the last delayed key scanned, or done). Returns the entries removed or
    scanned; 0 once every shard is done. Ready reads are not snapshots (a nak returning
    an older message meanwhile conflicts); delayed entries are keyed by due time, so
    they are scanned in pages, taking a read conflict on each key removed."""
    topic_config = read_topic_config(tr, ts)
    if sub not in topic_config.catchup:
        return 0
    end = _boundary(tr, ts, sub)
    marks = ts.sub_records[sub]["purge"]
    progress = 0
    for tag in membership.read_tags(tr, ts):
        for n in range(topic_config.shards):
            mark = marks.pack((tag, n))
            state = tr[mark]
            if state == _DONE:
                continue
            shard = ts.shard(sub, tag, n)
            want = limit - progress
            rows = list(tr.get_range(shard.ready.range().start, shard.ready_key(end), limit=want))
            for kv in rows:
                del tr[kv.key]
                _clear_sub_chunks(tr, shard, shard.ready.unpack(kv.key)[0], kv.value)
            removed, delayed = len(rows), 0
            if len(rows) < want:
                r = shard.delayed.range()
                begin = bytes(state) + b"\x00" if state != None else r.start  # noqa: E711
                page = list(tr.snapshot.get_range(begin, r.stop, limit=PURGE_SCAN))
                for kv in page:
                    _due, vs = shard.delayed.unpack(kv.key)
                    if vs < end:
                        tr.add_read_conflict_key(kv.key)
                        del tr[kv.key]
                        _clear_sub_chunks(tr, shard, vs, kv.value)
                        delayed += 1
                tr[mark] = _DONE if len(page) < PURGE_SCAN else page[-1].key
                progress += len(page)
            if removed + delayed:
                tr.add(shard.stat("done"), counter(removed + delayed))
            if delayed:
                tr.add(shard.stat("delayed"), counter(-delayed))
            progress += removed + (1 if len(rows) < want else 0)
            if progress >= limit:
                return progress
    return progress


def _clear_sub_chunks(tr, shard, vs, raw):
    if Record.decode(raw).nchunks:
        r = shard.chunks[vs].range()
        tr.clear_range(r.start, r.stop)


def _buckets(tr, ts: TopicSpace) -> list:
    """The "all" log's buckets that hold entries (a bucket per shard number ever used)."""
    out = []
    start, stop = ts.log.range().start, ts.log.range().stop
    while True:
        rows = list(tr.snapshot.get_range(start, stop, limit=1))
        if not rows:
            return out
        b = ts.log.unpack(rows[0].key)[0]
        out.append(b)
        start = ts.log[b].range().stop


def _position_for_time(tr, ts: TopicSpace, t_ms: int) -> Versionstamp | None:
    """As ``fdq.log.position_for_time``, inside ``tr``."""
    minute = (t_ms - SLACK_MS) // 60000 * 60000
    for kv in tr.snapshot.get_range(ts.time_index.range().start, ts.time_index.pack((minute,)),
                                    limit=1, reverse=True):
        return ts.time_index.unpack(kv.key)[1]
    return None


def _copy(tr, ts: TopicSpace, topic_config: TopicConfig, sub: str, bucket: int, vs, raw, routed: dict,
          leases: dict | None = None):
    """Copy a log entry into ``sub``'s shard queue; with ``leases`` (a reset: a cache for
    ``delivery.in_shard``) not if it is queued there already: leased, or (a lease
    expired or nak'd since the purge) ready or delayed."""
    rec = Record.decode(raw)
    tag = dispatch_tag(rec.headers)
    n = shard_of(rec.shard_key, topic_config.shards) if rec.shard_key is not None else bucket % topic_config.shards
    shard = ts.shard(sub, tag, n)
    if leases is not None and delivery.in_shard(tr, shard, vs, leases):
        return 0    # a reset leaves leases alone: the leased (or returned) copy is the one delivered
    if rec.due is not None and rec.due > membership.read_clock(tr, ts.clock_key):
        # a delayed message not due yet: it waits for its due time as its first copies do
        tr[shard.delayed_key(rec.due, vs)] = bytes(raw)
        routed[shard.stat("delayed")] = routed.get(shard.stat("delayed"), 0) + 1
    else:
        tr[shard.ready_key(vs)] = bytes(raw)
    written = len(raw)
    if rec.nchunks:
        r = ts.all_chunks[vs].range()
        for i, kv in enumerate(tr.snapshot.get_range(r.start, r.stop)):
            tr[shard.chunks.pack((vs, i))] = kv.value
            written += len(kv.value)
    routed[shard.stat("routed")] = routed.get(shard.stat("routed"), 0) + 1
    return written


@transactional
def catch_up_chunk(tr, ts: TopicSpace, sub: str, limit: int) -> int:
    """Copy up to ``limit`` messages of ``sub``'s start point (log entries older than
    its boundary) into its shard queues; when none are left, end the catch-up (its
    consumers start delivering). Returns how many were read; -1 once done (or if
    ``sub`` is not catching up). Resumable and safe to run from several processes:
    the per-bucket cursors are read without snapshot, so two runners conflict."""
    topic_config = read_topic_config(tr, ts)
    if sub not in topic_config.catchup:
        return -1
    if not topic_config.routing:
        raise ConfigError(f"topic {ts.name!r} is {'paused' if topic_config.paused else 'resharding'}: "
                          f"subscription {sub!r} catches up once it is playing again")
    rec = _load(tr[ts.sub_record_key(sub)])
    config = SubscriptionConfig.from_dict(rec["config"])
    reset = rec.get("reset")
    if reset is not None and not reset.get("purged"):
        if purge_chunk(tr, ts, sub, limit):
            return 0
        reset["purged"] = True
        tr[ts.sub_record_key(sub)] = pack(rec)
    end = _boundary(tr, ts, sub)
    if reset is not None:
        policy, min_ts = ("by_start_time" if reset["to_time_ms"] is not None else "new"), reset["to_time_ms"]
    else:
        policy, min_ts = config.deliver_policy, config.start_time_ms
    cursors = _cursors(ts, sub)
    routed = {}
    leases = {} if reset is not None else None
    read = written = 0
    full = False
    if policy == "last":
        last = None
        for b in _buckets(tr, ts):
            for kv in tr.snapshot.get_range(ts.log[b].range().start, ts.log_key(b, end), limit=1, reverse=True):
                vs = ts.log[b].unpack(kv.key)[0]
                if last is None or vs > last[1]:
                    last = (b, vs, kv.value)
        if last is not None:
            _copy(tr, ts, topic_config, sub, *last, routed, leases)
            read = 1
    elif policy in ("all", "by_start_time"):
        start = _position_for_time(tr, ts, min_ts) if min_ts is not None else None
        for b in _buckets(tr, ts):
            raw = tr[cursors.pack((b,))]
            if raw == _DONE:
                continue
            space = ts.log[b]
            if raw != None:  # noqa: E711
                begin = space.pack((Versionstamp.from_bytes(bytes(raw)),)) + b"\x00"
            elif start is not None:
                begin = space.pack((start,))
            else:
                begin = space.range().start
            want = limit - read
            rows = list(tr.snapshot.get_range(begin, ts.log_key(b, end), limit=want))
            copied = 0
            for kv in rows:
                if written >= CHUNK_WRITE_BYTES:
                    full = True     # large messages: the rest in the next chunk
                    break
                vs = space.unpack(kv.key)[0]
                if min_ts is None or Record.decode(kv.value).ts_ms >= min_ts:
                    written += _copy(tr, ts, topic_config, sub, b, vs, kv.value, routed, leases)
                copied += 1
            read += copied
            if full or copied == want:
                if copied:
                    tr[cursors.pack((b,))] = space.unpack(rows[copied - 1].key)[0].to_bytes()
                break
            tr[cursors.pack((b,))] = _DONE
    for key, k in routed.items():
        tr.add(key, counter(k))
    if full or (read and read >= limit):
        return read
    # Done: deliver from now on. Rewriting the config makes in-flight pushes retry.
    rec.pop("reset", None)
    tr[ts.sub_record_key(sub)] = pack(rec)
    for space in (cursors, ts.sub_records[sub]["purge"]):
        r = space.range()
        tr.clear_range(r.start, r.stop)
    write_topic_config(tr, ts, dataclasses.replace(
        topic_config, catchup=tuple(s for s in topic_config.catchup if s != sub)))
    return read


def catch_up(db, ts: TopicSpace, sub: str, progress=None) -> int:
    """Run ``catch_up_chunk`` until the subscription delivers. Returns messages copied."""
    total = 0
    while True:
        n = catch_up_chunk(db, ts, sub, CHUNK)
        if n < 0:
            return total
        total += n
        if progress and n:
            progress(n)


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


# -- ephemeral lifecycle ------------------------------------------------------------------

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
def join(tr, ts: TopicSpace, sub: str, consumer_id: str, record: dict, topic_config,
         expect: SubscriptionConfig | None = None) -> dict:
    """``membership.join``, refused if the subscription is gone (an ephemeral one may be
    deleted by its last member leaving just now: the topic-config read conflicts), or,
    with ``expect``, if its config is no longer that (ConfigError: read it again)."""
    config = read_subscription(tr, ts, sub)
    if expect is not None and config != expect:
        raise ConfigError(f"subscription {sub!r} of topic {ts.name!r} changed while joining it")
    return membership.join(tr, ts, sub, consumer_id, record, topic_config)


@transactional
def create_and_join(tr, ts: TopicSpace, sub: str, config: SubscriptionConfig | None, consumer_id: str,
                    record: dict) -> dict:
    """``create_subscription`` (or bind to the existing one) and ``join`` it, in one
    transaction: how a consumer creates an ephemeral subscription, which so never
    exists without a member for a reaper to find dead."""
    create_subscription(tr, ts, sub, config)
    return membership.join(tr, ts, sub, consumer_id, record, read_topic_config(tr, ts))


@transactional
def leave(tr, ts: TopicSpace, sub: str, consumer_id: str, topic_config, incarnation=None) -> bool:
    """``membership.leave``; an ephemeral subscription left without members is deleted
    in the same transaction. Returns True if it was deleted."""
    membership.leave(tr, ts, sub, consumer_id, topic_config, incarnation)
    return _reap_if_empty(tr, ts, sub)


@transactional
def declare_zombie(tr, ts: TopicSpace, sub: str, consumer_id: str, observed_hb: int, topic_config) -> bool:
    """``membership.declare_zombie``, deleting an ephemeral subscription it leaves empty."""
    if not membership.declare_zombie(tr, ts, sub, consumer_id, observed_hb, topic_config):
        return False
    _reap_if_empty(tr, ts, sub)
    return True


class Reaper:
    """Watches the members of a topic's ephemeral subscriptions for zombies (heartbeat
    counter unchanged for ``zombie_after_s`` on this host's monotonic clock), so a
    subscription whose last consumer was killed is deleted even with no peer left to
    notice. Consumers of the topic run one in their heartbeat; ``Supervisor.reap`` too."""

    def __init__(self, zombie_after_s: float):
        self.zombie_after_s = zombie_after_s
        self.longest_timeout_s = zombie_after_s   # the longest timeout a member advertised
        self._seen = {}          # (sub, cid) -> (hb, since)

    def observe(self, db, ts: TopicSpace, topic_config, now: float, skip: str | None = None) -> list:
        """One observation; returns the subscriptions deleted."""
        deleted = []
        live = set()
        for sub in topic_config.subs:
            if sub == skip:
                continue
            # Read each time (one snapshot read): a subscription deleted and created
            # again under its name may have changed from durable to ephemeral.
            try:
                eph = is_ephemeral(sub, read_subscription(db, ts, sub, snapshot=True, topic_config=topic_config))
            except SubscriptionNotFound:
                continue
            if not eph:
                continue
            members = membership.read_members(db, ts, sub)
            seen_at = max(now, time.monotonic())    # first seen after the read (see Consumer._observe_peers)
            for cid, m in members.items():
                live.add((sub, cid))
                self.longest_timeout_s = max(self.longest_timeout_s, _advertised_timeout(m["record"]))
                seen = self._seen.get((sub, cid))
                if seen is None or seen[0] != m["hb"]:
                    self._seen[(sub, cid)] = (m["hb"], seen_at)
                elif now - seen[1] >= max(self.zombie_after_s, _advertised_timeout(m["record"])):
                    self._seen.pop((sub, cid), None)
                    if declare_zombie(db, ts, sub, cid, seen[0], topic_config) and \
                            sub not in read_topic_config(db, ts, snapshot=True).subs:
                        deleted.append(sub)
        for key in [k for k in self._seen if k not in live]:
            del self._seen[key]
        return deleted


def _advertised_timeout(record: dict) -> float:
    """The zombie timeout a member advertises in its record (it heartbeats at its own
    interval), 0 if it advertises none."""
    t = record.get("zombie_after_s")
    return t if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0


def effective_consumer_config(consumer_config, config: SubscriptionConfig):
    """The consumer's config with the subscription's redelivery policy, where set."""
    changes = {k: getattr(config, k) for k in ("ack_wait_s", "max_deliver", "backoff_s")
               if getattr(config, k) is not None}
    return dataclasses.replace(consumer_config, **changes) if changes else consumer_config


__all__ = ["read_subscription", "subscription_info", "create_subscription", "delete_subscription",
           "update_subscription", "begin_reset", "purge_chunk", "catch_up_chunk", "catch_up",
           "matcher", "create_and_join", "join", "leave", "declare_zombie", "Reaper", "effective_consumer_config",
           "is_ephemeral", "DEFAULT_SUBSCRIPTION"]
