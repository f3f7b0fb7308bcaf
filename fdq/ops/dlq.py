"""The dead-letter queue: list, redrive and purge a subscription's dead letters.

Messages get there from the queue (:mod:`fdq.ops.queue`: ``term``, ``max_deliver``
reached, a handler that cannot commit), one entry per message under its versionstamp
(``codec.encode_dead``: the record as delivered, the reason, the consumer); a large
body's chunks stay in the subscription's chunk area beside it. A redrive puts a dead
letter back where its push put it (:func:`~fdq.ops.routing.target`), attempts reset,
unless a copy is queued there already.

A record that did not decode was dead-lettered as it was stored (a raw dead letter,
``queue._dead_letter_undecodable``): listed with its bytes as its body, purged as any
other, never redriven (a redrive that meets one stops with an FDQError naming it).
"""
from __future__ import annotations

from ..engine import transactional
from ..errors import CorruptValue, FDQError
from ..keyspace import TopicSpace, counter, decode_counter, message_id
from ..keyspace.codec import CHUNK_WRITE_BYTES, Record, decode_dead, has_chunks
from .clock import heartbeat_age, read_clock
from .topics import read_topic_config
from .queue import in_shard
from .routing import target


_ONE, _MINUS_ONE = counter(1), counter(-1)


def _undecodable(value) -> tuple:
    """``decode_dead`` of a dead letter's ``value``: (record bytes, reason, consumer_id,
    raw, dead_ms, dead_version); a value that does not decode itself is a raw one of its
    own bytes, of no known time (None, None)."""
    try:
        return decode_dead(value)
    except CorruptValue as e:
        return bytes(value), f"undecodable {e.what}: {e.cause}", None, True, None, None


def read_now(tr, ts: TopicSpace) -> tuple:
    """What ages are measured against (``clock.heartbeat_age``): (the database clock,
    the read version of its last advance or None, this transaction's read version);
    snapshot reads."""
    clock_version = tr.snapshot[ts.clock_version_key]
    return (read_clock(tr, ts.clock_key), None if clock_version == None else decode_counter(clock_version),  # noqa: E711
            tr.get_read_version().wait())


def dead_age_s(fields: tuple, now: tuple) -> float | None:
    """Seconds since a dead letter (its ``_undecodable`` fields) was dead-lettered, as
    ``clock.heartbeat_age`` times a heartbeat (the database clock, then versions); None
    for a value that does not decode."""
    return heartbeat_age(fields[4], fields[5], *now)


def _older(fields: tuple, now: tuple, older_than_s: float | None) -> bool:
    if older_than_s is None:
        return True
    age = dead_age_s(fields, now)
    return age is not None and age >= older_than_s


@transactional
def dlq_list(tr, ts: TopicSpace, sub: str, limit: int = 100, after: bytes | None = None) -> list:
    """[(vs, Record, reason, consumer_id, key, raw, age_s)] of the DLQ, oldest first
    (snapshot reads); each record's ``body`` is the whole body (a large one's chunks
    joined); ``age_s``: ``dead_age_s``. A raw dead letter (``raw`` True: a record that
    did not decode) is a Record of its bytes as ``body``, ``ts_ms`` 0, its reason saying
    what failed to decode."""
    space = ts.dlq(sub)
    r = space.range()
    begin = after + b"\x00" if after else r.start
    now = read_now(tr, ts)
    return [dead_entry(tr, ts, sub, kv.key, kv.value, now)
            for kv in tr.snapshot.get_range(begin, r.stop, limit=limit)]


def dead_entry(tr, ts: TopicSpace, sub: str, key: bytes, value, now: tuple) -> tuple:
    """One ``dlq_list`` entry of the dead letter at ``key`` (snapshot reads)."""
    fields = _undecodable(value)
    raw, reason, cid, undecodable = fields[:4]
    vs = ts.dlq_vs(sub, key)
    age = dead_age_s(fields, now)
    if undecodable:
        return vs, Record(0, body=raw), reason, cid, key, True, age
    rec = Record.decode(raw)
    if rec.nchunks:     # the chunks stay in the subscription's chunk area (queue._dead_letter)
        c = ts.sub_chunks_range(sub, vs, rec)
        rec.body = b"".join(c.value for c in tr.snapshot.get_range(c.start, c.stop))
    return vs, rec, reason, cid, key, False, age


@transactional
def dlq_older(tr, ts: TopicSpace, sub: str, older_than_s: float, limit: int, after: bytes | None = None) -> tuple:
    """The dead letters dead-lettered at least ``older_than_s`` ago among the next
    ``limit`` after DLQ key ``after`` (snapshot reads: the caller moves them with
    ``dlq_redrive_ids`` / ``dlq_purge_ids``, which read each again). Dead letters are
    in message order, not by age: a caller goes through the whole DLQ. Returns
    ``([vs], next after)``, next None at the end."""
    r = ts.dlq(sub).range()
    begin = after + b"\x00" if after else r.start
    now = read_now(tr, ts)
    rows = list(tr.snapshot.get_range(begin, r.stop, limit=limit))
    vss = [ts.dlq_vs(sub, kv.key) for kv in rows if _older(_undecodable(kv.value), now, older_than_s)]
    return vss, (rows[-1].key if len(rows) == limit else None)


def _redrive_shards(tr, ts: TopicSpace) -> int:
    """The shard count a redrive routes by: the topic config's as this transaction reads
    it (not snapshot: a reshard beginning or ending meanwhile conflicts), the new count
    while a reshard runs, as ``_requeue``: the reshard may have passed the old shard
    already, or remove it."""
    config = read_topic_config(tr, ts)
    return config.resharding_to if config.resharding_to is not None else config.shards


def _redrive_entry(tr, ts: TopicSpace, sub: str, shards: int, key: bytes, value: bytes, queued: dict):
    """Move one dead letter (its DLQ ``key`` and stored ``value``) back to its shard's
    ready queue, attempts reset; one queued there already (``in_shard``: a reset rewound
    the subscription over it) is only removed from the DLQ, as that copy delivers it.
    Where: ``routing.target``, as every copy (an unkeyed one looked in the shard of its
    versionstamp, not its push's, and was queued twice)."""
    vs = ts.dlq_vs(sub, key)
    raw, _reason, _cid, undecodable = _undecodable(value)[:4]
    if undecodable:
        raise FDQError(f"dead letter {message_id(vs)} of {ts.name}/{sub} holds undecodable bytes (not a "
                       f"message: nothing to redrive): read its bytes with fdq dlq list --json, purge it "
                       f"(Supervisor.dlq_purge_ids), then redrive the others")
    rec = Record.decode(raw)
    rec.attempts = 0
    shard = ts.shard(sub, *target(rec, shards))
    del tr[key]
    tr.add(ts.sub_stat(sub, "dead"), _MINUS_ONE)
    if in_shard(tr, shard, vs, queued):
        return      # counted routed once already
    tr[shard.ready_key(vs)] = rec.encode()
    tr.add(shard.stat("routed"), _ONE)


@transactional
def dlq_redrive_chunk(tr, ts: TopicSpace, sub: str, limit: int) -> tuple:
    """Move up to ``limit`` dead letters (or ``CHUNK_WRITE_BYTES`` of them) back to their
    shard's ready queue (``_redrive_entry``). Resumable: each chunk removes what it moved.
    Returns ``(moved, done)``. The shard count is read in this transaction
    (``_redrive_shards``)."""
    shards = _redrive_shards(tr, ts)
    r = ts.dlq(sub).range()
    moved = written = 0
    queued = {}
    for kv in tr.get_range(r.start, r.stop, limit=limit):
        if written >= CHUNK_WRITE_BYTES:
            return moved, False
        written += len(kv.value)
        _redrive_entry(tr, ts, sub, shards, kv.key, kv.value, queued)
        moved += 1
    return moved, moved < limit


@transactional
def dlq_redrive_ids(tr, ts: TopicSpace, sub: str, vss: list, older_than_s: float | None = None) -> tuple:
    """Move the dead letters of ``vss`` (versionstamps) back to their shards' ready
    queues (``_redrive_entry``), skipping those not in the DLQ (redriven or purged
    meanwhile: the read conflicts with a concurrent one) and, with ``older_than_s``,
    those dead-lettered less than that long ago (``dead_age_s``: one redriven and dead
    again meanwhile), until ``CHUNK_WRITE_BYTES`` of them. Returns ``(moved,
    looked_at)``: the caller goes on with ``vss[looked_at:]``."""
    shards = _redrive_shards(tr, ts)
    moved = written = looked = 0
    queued = {}
    now = read_now(tr, ts) if older_than_s is not None else None
    for vs in vss:
        if written >= CHUNK_WRITE_BYTES:
            break
        looked += 1
        key = ts.dlq_key(sub, vs)
        value = tr[key]
        if value == None or not _older(_undecodable(value), now, older_than_s):  # noqa: E711
            continue
        value = bytes(value)
        written += len(value)
        _redrive_entry(tr, ts, sub, shards, key, value, queued)
        moved += 1
    return moved, looked


@transactional
def dlq_purge_ids(tr, ts: TopicSpace, sub: str, vss: list, older_than_s: float | None = None) -> int:
    """Delete the dead letters of ``vss`` (versionstamps), with the body chunks a large
    one keeps, skipping those not in the DLQ and, with ``older_than_s``, those
    dead-lettered less than that long ago. Returns how many."""
    n = 0
    now = read_now(tr, ts) if older_than_s is not None else None
    for vs in vss:
        key = ts.dlq_key(sub, vs)
        value = tr[key]
        if value == None or not _older(_undecodable(value), now, older_than_s):  # noqa: E711
            continue
        for c in _chunk_ranges(ts, sub, vs, value):
            tr.clear_range(c.start, c.stop)
        del tr[key]
        n += 1
    if n:
        tr.add(ts.sub_stat(sub, "dead"), counter(-n))
    return n


@transactional
def dlq_purge_chunk(tr, ts: TopicSpace, sub: str, limit: int) -> int:
    """Delete up to ``limit`` dead letters, oldest first, with the body chunks a large
    one keeps in the subscription's chunk area. Returns how many."""
    space = ts.dlq(sub)
    r = space.range()
    n = 0
    last = None
    for kv in tr.get_range(r.start, r.stop, limit=limit):
        last = kv.key
        n += 1
        for c in _chunk_ranges(ts, sub, ts.dlq_vs(sub, kv.key), kv.value):
            tr.clear_range(c.start, c.stop)
    if last is not None:
        tr.clear_range(r.start, last + b"\x00")
        tr.add(ts.sub_stat(sub, "dead"), counter(-n))
    return n


def _chunk_ranges(ts: TopicSpace, sub: str, vs, value) -> list:
    """Where the body chunks a dead letter ``vs`` (its ``value``) may keep beside it are:
    none, its record's (``keyspace.chunk_part``), or, a raw one, every part."""
    raw, _reason, _cid, undecodable = _undecodable(value)[:4]
    if undecodable:
        return ts.sub_any_chunks_ranges(sub, vs)
    try:
        if not has_chunks(raw):
            return []
        return [ts.sub_chunks_range(sub, vs, Record.decode(raw))]
    except CorruptValue:
        return ts.sub_any_chunks_ranges(sub, vs)


def dlq_size(reader, ts: TopicSpace, sub: str) -> int:
    """How many dead letters ``sub`` holds (its counter, through ``reader``)."""
    return decode_counter(reader[ts.sub_stat(sub, "dead")])


__all__ = ["read_now", "dead_age_s", "dead_entry", "dlq_older", "dlq_list", "dlq_redrive_chunk", "dlq_redrive_ids", "dlq_purge_ids", "dlq_purge_chunk", "dlq_size"]
