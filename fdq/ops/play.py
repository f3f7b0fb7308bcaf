"""Play: routing what was pushed while a topic was paused (or resharding) to its
subscriptions' queues, in push order, then resuming the topic.

A push to a topic that is not routing writes its message to the "all" log and a
*pending* entry (``topic/<t>/all/pending/<bucket>/<vs>``, in its log bucket's part: no
single append point); ``play_chunk`` routes the oldest pending entries, a chunk per
transaction, merged across the buckets by versionstamp at its one read version as the
log reader merges the log (``ops.log.merged_heads``), and resumes the topic in the
transaction that finds none left (holding pushes for a moment first, so a steady push
stream cannot starve that transaction).
"""
from __future__ import annotations

import dataclasses

from ..config import TopicConfig
from ..engine import transactional
from ..keyspace import TopicSpace, counter, push_counters
from ..keyspace.codec import CHUNK_BYTES, Record, decode_pending
from .clock import read_clock
from .log import merged_heads
from .push import fits
from .routing import target
from .topics import held, read_topic_config, write_topic_config


def route_existing(tr, ts: TopicSpace, config: TopicConfig, vs, raw: bytes, clock: int) -> int:
    """Route a logged message (complete versionstamp ``vs``, record ``raw``) to every
    subscription's shard (``routing.target``): delayed until its record's due time if it
    is still ahead of ``clock``, else ready. Returns the bytes it wrote."""
    rec = Record.decode(raw)
    due = rec.due if rec.due is not None and rec.due > clock else None
    tag, n = target(rec, config.shards)
    chunks = []
    if rec.nchunks:
        r = ts.chunks_range(vs, rec)
        chunks = [kv.value for kv in tr.snapshot.get_range(r.start, r.stop)]
    for sub in config.subs:
        shard = ts.shard(sub, tag, n)
        if due is not None:
            tr[shard.delayed_key(due, vs)] = raw
            tr.add(shard.stat("delayed"), counter(1))
        else:
            tr[shard.ready_key(vs)] = raw
        for i, c in enumerate(chunks):
            tr[shard.chunk_key(vs, i, rec)] = c
        tr.add(shard.stat("routed"), counter(1))
    tr.add(ts.push_stat(n), push_counters(routed=1))
    return len(config.subs) * (len(raw) + sum(map(len, chunks)))


@transactional
def play_chunk(tr, ts: TopicSpace, limit: int, hold: int | None = None) -> tuple:
    """Route up to ``limit`` messages (or ``CHUNK_WRITE_BYTES`` of them) pushed while
    paused (or resharding), in order. Returns ``(routed, done, hold)``; the caller
    passes ``hold`` back. Does nothing while a reshard is still moving queues.

    The topic resumes (and a finished reshard's drain ends) in the transaction that
    finds nothing left pending, so no push routes before an older pending one. Under
    a steady stream of pushes that transaction would conflict with every push landing
    in the pending area and never commit, so first the topic is *held*: a chunk that
    reaches the end records ``held_at`` (its read version), and pushes from then on
    wait (``fdq.errors.TopicHeld``) instead of writing. The next chunk routes what
    landed before the hold and resumes, unless the hold is gone (a pause or another
    play since: done, the pause stands) or older than ``HOLD_VERSIONS`` (a play that
    died: pushes went on, hold again)."""
    config = read_topic_config(tr, ts)
    if resharding(config):
        return 0, True, None
    clock = read_clock(tr, ts.clock_key)
    r = ts.pending.range()
    moved = written = 0
    last = {}       # bucket -> the last key this chunk routed there
    entries, unread = merged_heads(tr, ts.pending, limit)
    full = False
    for vs, bucket, key, value in entries:
        raw = tr.snapshot[ts.log_key(decode_pending(value), vs)]
        if raw != None:  # noqa: E711 - trimmed meanwhile: nothing to route
            # Over the budget with this message (its copies, chunks at most CHUNK_BYTES
            # each): the next chunk routes it. A push accepted it alone under ROUTE_BYTES,
            # not on top of ~CHUNK_WRITE_BYTES of others (FDB's limit is 10 MB).
            more = len(config.subs) * (len(raw) + Record.decode(raw).nchunks * CHUNK_BYTES)
            if written and not fits(written, more):
                full = True
                break
            written += route_existing(tr, ts, config, vs, bytes(raw), clock)
        last[bucket] = key
        moved += 1
    for bucket, key in last.items():
        # what it routed conflicts with another play routing it (whichever way this
        # chunk ends); later pushes do not. Before the clears: as FDB's RYW, a read
        # conflict skips keys the transaction already cleared. (Merged in stamp order,
        # what it routed of each bucket is that bucket's head.)
        begin = ts.pending[bucket].range().start
        tr.add_read_conflict_range(begin, key + b"\x00")
        tr.clear_range(begin, key + b"\x00")
    if unread or full:
        return moved, False, hold
    if not last and config.routing and config.held_at is None:
        return 0, True, None                # running, nothing pending: no hold, no write
    rv = tr.get_read_version().wait()
    if config.held_at is None and hold is not None:
        return moved, True, None            # paused since the hold (or resumed by another play)
    if config.held_at is None or not held(rv, config.held_at):
        write_topic_config(tr, ts, dataclasses.replace(config, held_at=rv))
        return moved, False, rv
    # Held: no push wrote the pending area since the hold committed (each one read the
    # config before it, or conflicts with the hold's write), so reading all of it
    # conflicts only with what this chunk missed.
    tr.add_read_conflict_range(r.start, r.stop)
    changes = {"held_at": None}
    if config.resharding_to is not None:     # drained: route pushes again
        changes["resharding_to"] = None
    if config.paused:
        changes["paused"] = False
    write_topic_config(tr, ts, dataclasses.replace(config, **changes))
    return moved, True, None


def resharding(config: TopicConfig) -> bool:
    """Whether a shard-count change is moving queues (``reshard_begin`` until
    ``reshard_finish``). After the finish, ``resharding_to == shards`` while the
    messages pushed meanwhile (the pending area) are routed: pushes still go there, so
    none overtakes an older message of its key."""
    return config.resharding_to is not None and config.resharding_to != config.shards
