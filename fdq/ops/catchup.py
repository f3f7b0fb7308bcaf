"""A subscription's start point: the catch-up of a new subscription and a reset.

A subscription catching up (listed in its topic config's ``catchup``) delivers nothing.
``catch_up_chunk`` copies its start point (``deliver_policy``: all, last, by start time)
from the "all" log into its shard queues, the log entries older than its start boundary
only (pushes committed after it fanned out to it themselves), in resumable chunks (a
cursor per log bucket); any consumer or supervisor may finish it, and the chunk that
finds nothing left ends the catch-up.

A reset (``begin_reset``) sets a new boundary and marks the subscription catching up
again; its catch-up first purges the queued messages older than the boundary
(``purge_chunk``; leases and the DLQ are left alone), then copies the log from the new
start, skipping a message still queued (leased, or returned since the purge) where its
copy would go (``routing.target``: where every copy of it lands).
"""
from __future__ import annotations

import dataclasses

from . import membership
from .clock import read_clock
from ..config import CHUNK, SubscriptionConfig, TopicConfig
from .queue import in_shard
from ..engine import transactional
from ..keyspace import TopicSpace, Versionstamp, counter, stamp_of_value
from ..keyspace.codec import CHUNK_WRITE_BYTES, Record
from .log import buckets_in, position_for_time
from .routing import target
from .subscriptions import read_record, read_subscription, routing_refusal, write_record
from .topics import read_topic_config, stamp_subscription_start, write_topic_config

_DONE = b"done"       # a bucket's cursor, a shard's purge mark: finished
PURGE_SCAN = 2_000    # delayed entries one purge transaction scans


@transactional
def begin_reset(tr, ts: TopicSpace, sub: str, to_time_ms: int | None):
    """Start moving ``sub``'s start to ``to_time_ms`` (None: now). Sets a new boundary
    (this transaction's versionstamp) and marks the subscription catching up, which
    stops its delivery; ``purge_chunk`` then drops its queued messages older than the
    boundary and ``catch_up_chunk`` copies the log from the new start."""
    topic_config = read_topic_config(tr, ts)
    read_subscription(tr, ts, sub, topic_config=topic_config)
    if not topic_config.routing:
        raise routing_refusal(ts, topic_config, "reset it once it is playing again")
    record = read_record(tr, ts, sub)
    record["reset"] = {"to_time_ms": to_time_ms, "purged": False}
    write_record(tr, ts, sub, record)
    stamp_subscription_start(tr, ts, sub)
    if sub not in topic_config.catchup:
        write_topic_config(tr, ts, dataclasses.replace(topic_config, catchup=topic_config.catchup + (sub,)))


def _boundary(tr, ts: TopicSpace, sub: str) -> Versionstamp:
    """``sub``'s start boundary: the first position its catch-up does not copy."""
    return Versionstamp(stamp_of_value(tr[ts.sub_boundary_key(sub)]), 0)


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
    progress = 0
    for tag in membership.read_tags(tr, ts):
        for n in range(topic_config.shards):
            mark = ts.sub_purge_mark(sub, tag, n)
            state = tr[mark]
            if state == _DONE:
                continue
            shard = ts.shard(sub, tag, n)
            want = limit - progress
            rows = list(tr.get_range(shard.ready_range.start, shard.ready_key(end), limit=want))
            for kv in rows:
                del tr[kv.key]
                _clear_sub_chunks(tr, shard, shard.ready.unpack(kv.key)[0], kv.value)
            removed, delayed = len(rows), 0
            if len(rows) < want:
                r = shard.delayed_range
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
    rec = Record.decode(raw)
    if rec.nchunks:
        r = shard.chunks_range(vs, rec)
        tr.clear_range(r.start, r.stop)


def _copy(tr, ts: TopicSpace, topic_config: TopicConfig, sub: str, vs, raw, routed: dict,
          leases: dict | None = None) -> int:
    """Copy a log entry into ``sub``'s shard queue (``routing.target``); with ``leases``
    (a reset: a cache for ``queue.in_shard``) not if it is queued there already:
    leased, or (a lease expired or nak'd since the purge) ready or delayed. Returns the
    bytes it wrote."""
    rec = Record.decode(raw)
    tag, n = target(rec, topic_config.shards)
    shard = ts.shard(sub, tag, n)
    if leases is not None and in_shard(tr, shard, vs, leases):
        return 0    # a reset leaves leases alone: the leased (or returned) copy is the one delivered
    if rec.due is not None and rec.due > read_clock(tr, ts.clock_key):
        # a delayed message not due yet: it waits for its due time as its first copies do
        tr[shard.delayed_key(rec.due, vs)] = bytes(raw)
        routed[shard.stat("delayed")] = routed.get(shard.stat("delayed"), 0) + 1
    else:
        tr[shard.ready_key(vs)] = bytes(raw)
    written = len(raw)
    if rec.nchunks:
        r = ts.chunks_range(vs, rec)
        for i, kv in enumerate(tr.snapshot.get_range(r.start, r.stop)):
            tr[shard.chunk_key(vs, i, rec)] = kv.value
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
        raise routing_refusal(ts, topic_config, f"subscription {sub!r} catches up once it is playing again")
    record = read_record(tr, ts, sub)
    config = SubscriptionConfig.from_dict(record["config"])
    reset = record.get("reset")
    if reset is not None and not reset.get("purged"):
        if purge_chunk(tr, ts, sub, limit):
            return 0
        reset["purged"] = True
        write_record(tr, ts, sub, record)
    end = _boundary(tr, ts, sub)
    if reset is not None:
        policy, min_ts = ("by_start_time" if reset["to_time_ms"] is not None else "new"), reset["to_time_ms"]
    else:
        policy, min_ts = config.deliver_policy, config.start_time_ms
    routed = {}
    leases = {} if reset is not None else None
    read = written = 0
    full = False
    if policy == "last":
        last = None
        for b in buckets_in(tr, ts):
            for kv in tr.snapshot.get_range(ts.log_bucket_range(b).start, ts.log_key(b, end), limit=1, reverse=True):
                vs = ts.log[b].unpack(kv.key)[0]
                if last is None or vs > last[0]:
                    last = (vs, kv.value)
        if last is not None:
            _copy(tr, ts, topic_config, sub, *last, routed, leases)
            read = 1
    elif policy in ("all", "by_start_time"):
        start = position_for_time(tr, ts, min_ts)
        for b in buckets_in(tr, ts):
            cursor = ts.sub_cursor_key(sub, b)
            raw = tr[cursor]
            if raw == _DONE:
                continue
            if raw != None:  # noqa: E711
                begin = ts.log_entry_key(b, bytes(raw)) + b"\x00"
            else:
                begin = ts.log_key(b, start)
            want = limit - read
            rows = list(tr.snapshot.get_range(begin, ts.log_key(b, end), limit=want))
            copied = 0
            for kv in rows:
                if written >= CHUNK_WRITE_BYTES:
                    full = True     # large messages: the rest in the next chunk
                    break
                vs = ts.log[b].unpack(kv.key)[0]
                if min_ts is None or Record.decode(kv.value).ts_ms >= min_ts:
                    written += _copy(tr, ts, topic_config, sub, vs, kv.value, routed, leases)
                copied += 1
            read += copied
            if full or copied == want:
                if copied:
                    tr[cursor] = ts.log[b].unpack(rows[copied - 1].key)[0].to_bytes()
                break
            tr[cursor] = _DONE
    for key, k in routed.items():
        tr.add(key, counter(k))
    if full or (read and read >= limit):
        return read
    # Done: deliver from now on. Rewriting the config makes in-flight pushes retry.
    record.pop("reset", None)
    write_record(tr, ts, sub, record)
    for space in (ts.sub_cursors(sub), ts.sub_purge_marks(sub)):
        r = space.range()
        tr.clear_range(r.start, r.stop)
    write_topic_config(tr, ts, dataclasses.replace(
        topic_config, catchup=tuple(s for s in topic_config.catchup if s != sub)))
    return read


def catch_up(db, ts: TopicSpace, sub: str, progress=None) -> int:
    """Run ``catch_up_chunk`` (``CHUNK`` at a time) until the subscription delivers:
    what a supervisor's create or reset, or a consumer finding its subscription catching
    up, runs. Returns messages copied."""
    total = 0
    while True:
        n = catch_up_chunk(db, ts, sub, CHUNK)
        if n < 0:
            return total
        total += n
        if progress and n:
            progress(n)
