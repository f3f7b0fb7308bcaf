"""Looking at messages without consuming them: ``Supervisor.peek`` and ``get``.

Each is one read-only transaction of snapshot reads: it writes nothing and takes no
read conflict, so it never aborts a consumer or a push (nor is aborted by them), and
at one read version a message is seen once, in the one place it is.

``peek`` reads the first entries of each of a subscription's shards' ready, delayed
and leased areas (and its DLQ): ``limit`` per shard and state, merged by message id
(push order), the first ``limit`` kept; from a time, from the log position the time
index gives for it, less those inserted before it. ``get`` finds one message: its log entry
(one point read per log bucket) and, per subscription, where it is, looking only
where a message can be: its shard's ready key and DLQ key (point reads), its shard's
lease records (as many as the shard has in flight) and delayed area (at most
``DELAYED_SCAN`` entries: past that, ``delayed_unsearched``); never a scan of a backlog.
"""
from __future__ import annotations

import heapq

from ..engine import transactional
from ..errors import CorruptValue, TopicNotFound
from ..keyspace import TopicSpace, Versionstamp, vs_from_bytes
from ..keyspace.codec import LeaseRecord, Record, decode_leases
from .clock import base_at
from .dlq import dead_entry, read_now
from .log import buckets_in, position_for_time
from .membership import read_tags
from .routing import target
from .topics import load_config

STATES = ("ready", "delayed", "in_flight", "dead")
# The entries of a shard's delayed area ``get`` looks through for one message (keyed by
# due time: no point read finds it).
DELAYED_SCAN = 10_000
# Entries ``peek`` with a start time skips per shard and state at most (inserted before it,
# between the time index's entry and the time).
SKIP_LIMIT = 10_000


def shards_of(config, tags: list) -> list:
    """(tag, n) of every shard a subscription may hold messages in (a growing
    reshard's new ones too)."""
    return [(tag, n) for tag in tags for n in range(max(config.shards, config.resharding_to or 0))]


def _config(snap, ts: TopicSpace):
    config = load_config(snap[ts.config_key])
    if config is None:
        raise TopicNotFound(f"topic {ts.name!r} does not exist")
    return config


def _record(raw) -> Record | None:
    try:
        return Record.decode(raw)
    except CorruptValue:
        return None


def _body(snap, ts: TopicSpace, sub: str, vs, rec: Record) -> bytes:
    if not rec.nchunks:
        return rec.body
    r = ts.sub_chunks_range(sub, vs, rec)
    return b"".join(kv.value for kv in snap.get_range(r.start, r.stop))


def _entry(snap, ts: TopicSpace, sub: str, state: str, tag: str, n: int | None, vs, raw, **extra) -> dict:
    """A peeked message: its record's fields (``raw`` True and its bytes as ``body`` if
    it does not decode)."""
    rec = _record(raw)
    out = {"vs": vs, "state": state, "tag": tag, "shard": n}
    if rec is None:
        out.update(raw=True, inserted_ms=None, attempts=None, shard_key=None, msg_id=None, headers=None,
                   replay_of=None, body=bytes(raw))
    else:
        out.update(raw=False, inserted_ms=rec.ts_ms, attempts=rec.attempts, shard_key=rec.shard_key,
                   msg_id=rec.msg_id, headers=rec.headers, replay_of=rec.replay_of,
                   body=_body(snap, ts, sub, vs, rec))
    out.update(extra)
    return out


def _lease_entries(snap, shard):
    """(vs, record bytes, LeaseRecord) of the shard's leased messages, record by record
    (a record that does not decode: its first message, its bytes, None)."""
    r = shard.leased.range()
    for kv in snap.get_range(r.start, r.stop):
        try:
            lr = decode_leases(kv.key, kv.value)
        except CorruptValue:
            yield shard.leased.unpack(kv.key)[0], bytes(kv.value), None
            continue
        for vs12, rec, _touches in lr.entries:
            yield vs_from_bytes(vs12), rec, lr


def _in_flight(snap, ts, sub, tag, n, vs, raw, lr: LeaseRecord | None, now) -> dict:
    e = _entry(snap, ts, sub, "in_flight", tag, n, vs, raw, leased_by=lr and lr.consumer_id,
               ack_wait_s=lr and lr.ack_wait_ms / 1000)
    if lr is not None and e["attempts"] is not None:
        e["attempts"] += lr.bump        # this delivery counts
    return e


def _delayed(snap, ts, sub, tag, n, due, vs, raw, now) -> dict:
    return _entry(snap, ts, sub, "delayed", tag, n, vs, raw, due_ms=due, due_in_s=(due - base_at(*now)) / 1000)


def _dead(tr, ts, sub, key, value, now) -> dict:
    vs, rec, reason, cid, _key, raw, age = dead_entry(tr, ts, sub, key, value, now)
    return {"vs": vs, "state": "dead", "tag": None, "shard": None, "raw": raw,
            "inserted_ms": None if raw else rec.ts_ms, "attempts": None if raw else rec.attempts,
            "shard_key": rec.shard_key, "msg_id": rec.msg_id, "headers": rec.headers,
            "replay_of": rec.replay_of, "body": rec.body, "reason": reason, "consumer": cid, "dead_age_s": age}


def _pages(snap, begin: bytes, end: bytes, page: int):
    """The key-values of ``[begin, end)``, read ``page`` at a time as they are used."""
    while True:
        rows = list(snap.get_range(begin, end, limit=page))
        yield from rows
        if len(rows) < page:
            return
        begin = rows[-1].key + b"\x00"


def _first(entries, limit: int, keep) -> list:
    """The first ``limit`` of ``entries`` that ``keep`` keeps, looking at no more than
    ``limit + SKIP_LIMIT`` of them."""
    out = []
    for i, e in enumerate(entries):
        if keep(e):
            out.append(e)
            if len(out) >= limit:
                break
        if i >= limit + SKIP_LIMIT:
            break
    return out


@transactional
def peek(tr, ts: TopicSpace, sub: str, states, limit: int, from_ms: int | None = None) -> list:
    """The first ``limit`` messages of subscription ``sub`` in ``states`` (of
    ``STATES``), by message id (per shard: the first ``limit`` ready, in flight and dead
    by id, the ``limit`` delayed due soonest), inserted at ``from_ms`` or later if given
    (from the log position of the time index's entry before it: ``position_for_time``):
    dicts of ``_entry``'s keys plus, for a delayed one ``due_ms`` (database clock) and
    ``due_in_s`` (counted from ``clock.due_base``, as due times are); leased: ``leased_by``,
    ``ack_wait_s`` (attempts counting this delivery); dead: ``reason``, ``consumer``, ``dead_age_s``. Snapshot reads only."""
    snap = tr.snapshot
    config = _config(snap, ts)
    now = read_now(tr, ts)
    start = position_for_time(tr, ts, from_ms) if from_ms is not None else None

    def keep(e) -> bool:
        return start is None or (e["vs"] >= start and (e["inserted_ms"] is None or e["inserted_ms"] >= from_ms))
    page = min(limit, 1000) + 1
    per_state = []
    for tag, n in shards_of(config, read_tags(tr, ts)):
        shard = ts.shard(sub, tag, n)
        if "ready" in states:
            r = shard.ready_range
            begin = shard.ready_key(start) if start is not None else r.start
            per_state.append(_first((_entry(snap, ts, sub, "ready", tag, n, shard.ready.unpack(kv.key)[0], kv.value)
                                     for kv in _pages(snap, begin, r.stop, page)), limit, keep))
        if "delayed" in states:
            r = shard.delayed_range
            got = _first((_delayed(snap, ts, sub, tag, n, *shard.delayed.unpack(kv.key), kv.value, now)
                          for kv in _pages(snap, r.start, r.stop, page)), limit, keep)
            per_state.append(sorted(got, key=lambda e: e["vs"]))
        if "in_flight" in states:
            got = _first((_in_flight(snap, ts, sub, tag, n, vs, raw, lr, now)
                          for vs, raw, lr in _lease_entries(snap, shard)), limit, keep)
            per_state.append(sorted(got, key=lambda e: e["vs"]))
    if "dead" in states:
        r = ts.dlq(sub).range()
        begin = ts.dlq_key(sub, start) if start is not None else r.start
        per_state.append(_first((_dead(tr, ts, sub, kv.key, kv.value, now) for kv in _pages(snap, begin, r.stop, page)),
                                limit, keep))
    return list(heapq.merge(*per_state, key=lambda e: e["vs"]))[:limit]


@transactional
def get(tr, ts: TopicSpace, vs: Versionstamp) -> dict:
    """Message ``vs``: ``{"log": (bucket, Record with its whole body) or None (trimmed,
    or no such message), "pending": pushed while paused and not yet routed,
    "subscriptions": {sub: [places]}}``: a place is a ``peek`` entry (ready, delayed,
    in_flight, dead; usually one, more only while a copy is being moved); none found:
    done (acked, taken, filtered, expired) or not yet queued there (``catching_up``).
    ``delayed_unsearched`` lists the subscriptions whose delayed area was too large to
    search (``DELAYED_SCAN``). Snapshot reads only."""
    snap = tr.snapshot
    config = _config(snap, ts)
    now = read_now(tr, ts)
    log = None
    for b in buckets_in(tr, ts):
        raw = snap[ts.log_key(b, vs)]
        if raw != None:  # noqa: E711
            rec = _record(raw)
            if rec is not None and rec.nchunks:
                r = ts.chunks_range(vs, rec)
                rec.body = b"".join(kv.value for kv in snap.get_range(r.start, r.stop))
            log = (b, rec if rec is not None else Record(0, body=bytes(raw)), rec is None)
            break
    pending = log is not None and snap[ts.pending_key(log[0], vs)] != None  # noqa: E711
    if log is not None and not log[2]:
        # where a copy can be: its shard under the shard count (both, while resharding)
        counts = {config.shards, config.resharding_to or config.shards}
        where = sorted({target(log[1], c) for c in counts})
    else:   # no record to route by: every shard
        where = shards_of(config, read_tags(tr, ts))
    subs, unsearched = {}, []
    for sub in config.subs:
        places = []
        for tag, n in where:
            shard = ts.shard(sub, tag, n)
            raw = snap[shard.ready_key(vs)]
            if raw != None:  # noqa: E711
                places.append(_entry(snap, ts, sub, "ready", tag, n, vs, raw))
            for lvs, lraw, lr in _lease_entries(snap, shard):
                if lvs == vs:
                    places.append(_in_flight(snap, ts, sub, tag, n, vs, lraw, lr, now))
            rows = list(snap.get_range(shard.delayed_range.start, shard.delayed_range.stop, limit=DELAYED_SCAN + 1))
            if len(rows) > DELAYED_SCAN and sub not in unsearched:
                unsearched.append(sub)
            for kv in rows[:DELAYED_SCAN]:
                due, dvs = shard.delayed.unpack(kv.key)
                if dvs == vs:
                    places.append(_delayed(snap, ts, sub, tag, n, due, vs, kv.value, now))
        key = ts.dlq_key(sub, vs)
        value = snap[key]
        if value != None:  # noqa: E711
            places.append(_dead(tr, ts, sub, key, value, now))
        subs[sub] = {"places": places, "catching_up": sub in config.catchup}
    return {"log": log, "pending": pending, "subscriptions": subs, "delayed_unsearched": unsearched}


__all__ = ["STATES", "DELAYED_SCAN", "SKIP_LIMIT", "shards_of", "peek", "get"]
