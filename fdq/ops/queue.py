"""The queue: the transactional functions that move messages through a shard's queues.

    ready --take (at most once / exactly once)--> gone
    ready --lease--> leased --ack--> gone
                            --nak / expire--> ready (same key: first in line) or delayed
                            --term / max_deliver--> dead-letter queue

A leased batch is one lease record per shard (``leased/<first vs>/<lease id>``, split in
parts of ``LEASE_RECORD_BYTES``), not a row per message: acking a whole batch deletes one
row. Settling or expiring part of a batch rewrites its record without those messages;
``in_progress()`` counts a touch on its own message inside the record (its siblings' ack
wait does not restart). A message's settle names its record's key (``Taken.lease_key``).

Consumers read the ready queue with snapshot range reads plus a read conflict on each
key they take, so pushes into the same shard never abort them; every consuming
transaction reads the shard record first (the owner-epoch fence).

A stored record that does not decode (a damaged value: ``CorruptValue``) is moved to the
dead-letter queue by the transaction that meets it, its bytes kept as stored and the
reason naming what failed to decode (``_dead_letter_undecodable``), and the read goes on:
one damaged record never stops its shard.

A message put back in a queue (a nak, an expiry) while the topic reshards goes where the
reshard puts it (:func:`~fdq.ops.routing.target`). The dead-letter queue's own
operations (list, redrive, purge) are :mod:`fdq.ops.dlq`'s.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import fdb.tuple as fdbtuple

from ..engine import transactional
from ..keyspace import (ShardSpace, StoredVersionstamp, TopicSpace, Versionstamp, counter, decode_counter,
                        position_of, vs_from_bytes)
from ..errors import CorruptValue
from ..keyspace.codec import (CHUNK_BYTES, LEASE_ENTRY_OVERHEAD, LEASE_RECORD_BYTES, LeaseRecord, Record,
                              decode_leases, encode_dead, encode_leases, has_chunks, lease_entries_hint)
from ..settlement import ACK, NAK, RELEASE, TERM, TOUCH, Action
from .topics import cached_topic_config, load_config
from .clock import due_base, read_clock
from .membership import check_owner, ensure_owner
from .routing import target

ONE, MINUS_ONE = counter(1), counter(-1)


@dataclass(slots=True)
class Taken:
    """A message taken from a shard: its key's versionstamp, decoded record, full body."""

    shard: ShardSpace
    vs: Versionstamp
    record: Record
    body: bytes
    raw: bytes          # the encoded record as stored
    lease_id: bytes | None = None
    lease_key: bytes | None = None      # the key of the lease record holding it
    delayed_key: bytes | None = None    # its delayed key, if this transaction promoted it


def _body(reader, shard: ShardSpace, vs, record: Record) -> bytes:
    if not record.nchunks:
        return record.body
    r = shard.chunks_range(vs, record)
    return b"".join(kv.value for kv in reader.get_range(r.start, r.stop))


def _clear_chunks(tr, shard: ShardSpace, vs, record: Record):
    if record.nchunks:
        r = shard.chunks_range(vs, record)
        tr.clear_range(r.start, r.stop)


def _add(tr, counters: dict):
    for key, n in counters.items():
        if n:
            tr.add(key, counter(n))


@transactional
def promote_due(tr, shard: ShardSpace, limit: int, promoted: dict | None = None, now: int | None = None) -> int | None:
    """Move delayed messages that are due (due <= the topic's clock, see
    ``clock.read_clock``; ``now``: the clock as the caller read it in this transaction)
    to the head of the ready queue. Returns the next due
    time still waiting, if any; ``promoted`` collects {12-byte stamp: delayed key}.
    A message whose ready key holds it already (a reset's copy of a message nak'd with
    a delay meanwhile) is one message: the delayed copy is dropped, counted done."""
    if now is None:
        now = read_clock(tr, shard.clock_key)
    r = shard.delayed_range
    due_now = []
    waiting = None
    for kv in tr.snapshot.get_range(r.start, r.stop, limit=limit + 1):
        due, vs = shard.delayed.unpack(kv.key)
        if due > now or len(due_now) >= limit:
            waiting = due
            break
        # not a snapshot: a copy written there meanwhile conflicts (futures on FDB)
        due_now.append((kv, vs, tr[shard.ready_key(vs)]))
    merged = 0
    for kv, vs, there in due_now:
        tr.add_read_conflict_key(kv.key)
        tr.clear(kv.key)
        if there != None:  # noqa: E711
            merged += 1
            continue
        tr[shard.ready_key(vs)] = kv.value
        if promoted is not None:
            promoted[vs.to_bytes()] = kv.key
    if due_now:
        tr.add(shard.stat("delayed"), counter(-len(due_now)))
    if merged:
        tr.add(shard.stat("done"), counter(merged))
    return waiting


def _consumable(tr, ts: TopicSpace, sub: str | None = None, config=None) -> bool:
    """Paused or resharding topics deliver nothing, nor a paused subscription or one still
    catching up. The config's read (the metadata version's, non-snapshot): a pause that
    commits meanwhile makes this transaction conflict. ``config``: the config as
    ``round_reads`` read it here."""
    if config is None:
        config = cached_topic_config(tr, ts)
    return (config is not None and config.routing and sub not in config.catchup
            and sub not in config.paused_subs)


@dataclass(frozen=True)
class Selection:
    """What a subscription's configuration changes in taking ready messages:
    ``max_pending`` (leased messages per shard), ``ordered`` (one message per shard key
    leased or waiting for redelivery at a time), ``match`` (the filter; others dropped)."""

    max_pending: int | None = None
    ordered: bool = False
    match: object = None


SCAN_LIMIT = 10_000   # ready entries one take may skip over (held keys) before giving up


def read_leases(reader, shard: ShardSpace, limit: int = 0) -> list:
    """[(key, LeaseRecord)] of the shard's lease records in key order, read through
    ``reader`` (a transaction: conflicts with any lease change of the shard; or its
    snapshot). ``limit``: records, 0 for all. A record that does not decode is
    (key, None): ``expire_leases`` dead-letters it (``scan_leases`` makes it due)."""
    r = shard.leased.range()
    return [(kv.key, _lease_record(kv.key, kv.value)) for kv in reader.get_range(r.start, r.stop, limit=limit)]


def _lease_record(key: bytes, raw) -> LeaseRecord | None:
    try:
        return decode_leases(key, raw)
    except CorruptValue:
        return None


def _shard_key(raw) -> str | None:
    """A stored record's shard key; None if it does not decode (dead-lettered where a
    lease or an expiry meets it)."""
    try:
        return Record.decode(raw).shard_key
    except CorruptValue:
        return None


def in_shard(tr, shard: ShardSpace, vs, cache: dict) -> bool:
    """Whether message ``vs`` is ready in ``shard`` (a point read, not a snapshot: a
    message taken, requeued or promoted to ready meanwhile conflicts) or leased there
    (the shard's lease records by snapshot, read once per transaction into ``cache``:
    consumers do not abort the caller; a lease settled meanwhile was that message's
    delivery). A writer putting a message back at its ready key (a reset's copy, a DLQ
    redrive) checks first: a second copy at the same key would count it routed twice (a
    backlog left for good). One delayed (a nak with a delay) is not looked for (keyed
    by due time): ``promote_due`` merges it with a ready copy."""
    if tr[shard.ready_key(vs)] != None:  # noqa: E711
        return True
    got = cache.get(shard)
    if got is None:
        got = cache[shard] = {e[0] for _key, lr in read_leases(tr.snapshot, shard) if lr is not None
                              for e in lr.entries}
    return vs.to_bytes() in got


def _held_keys(tr, shard: ShardSpace) -> set:
    """Shard keys with a message leased or delayed (waiting for redelivery or due)."""
    held = set()
    for _key, lr in read_leases(tr.snapshot, shard, SCAN_LIMIT):
        if lr is not None:
            for e in lr.entries:
                held.add(_shard_key(e[1]))
    r = shard.delayed.range()
    for kv in tr.snapshot.get_range(r.start, r.stop, limit=SCAN_LIMIT):
        held.add(_shard_key(kv.value))
    held.discard(None)
    return held



# Dead letters one taking transaction writes at most (their count, their records' bytes):
# a head of thousands of messages past max_deliver (or damaged) is moved over several
# transactions, none over FDB's 10 MB or 5 s (one that was retried for ever, the shard
# stuck). The batch then says more is there (``Batch.more``).
DEAD_PER_TX = 200
DEAD_BYTES_PER_TX = 2_000_000


class Batch(list):
    """The messages a take or lease took, and the dead letters it wrote on the way.
    ``more``: it stopped at the dead-letter budget, so the shard is not drained however
    few it took."""

    def __init__(self):
        super().__init__()
        self.more = False
        self.dead = self.dead_bytes = 0

    def spent(self, raw) -> bool:
        """Count one dead letter (``raw``: its record); whether the budget is spent
        (``more`` then)."""
        self.dead += 1
        self.dead_bytes += len(raw)
        self.more = self.dead >= DEAD_PER_TX or self.dead_bytes >= DEAD_BYTES_PER_TX
        return self.more


def _select_ready(tr, ts: TopicSpace, shard: ShardSpace, limit: int, sel: Selection, max_deliver: int,
                  consumer_id: str) -> list:
    """``_read_ready`` for a subscription with flow control, ordering or a filter.

    ``max_pending``: the shard's ``in_flight`` counter (snapshot) bounds the batch. Only
    the shard's owner raises it, in this fenced transaction, so the bound is exact.
    ``ordered``: messages whose key is held (leased or delayed, or taken earlier in this
    batch) are skipped without a read conflict; keys behind them still flow, within
    ``SCAN_LIMIT`` skipped entries. Filtered-out messages are removed and counted done;
    messages past ``max_deliver`` are dead-lettered (``_deliverable``)."""
    if sel.max_pending is not None:
        limit = min(limit, sel.max_pending - decode_counter(tr.snapshot[shard.stat("in_flight")]))
        if limit <= 0:
            return Batch()
    held = _held_keys(tr, shard) if sel.ordered else set()
    out, dropped, scanned = Batch(), 0, 0
    r = shard.ready.range()
    begin, page_size = r.start, max(64, 4 * limit)
    while len(out) < limit and scanned < SCAN_LIMIT and not out.more:
        page = list(tr.snapshot.get_range(begin, r.stop, limit=page_size))
        for kv in page:
            scanned += 1
            vs = vs_from_bytes(position_of(kv.key))
            rec = _deliverable(tr, ts, shard, kv, vs, max_deliver, consumer_id)
            if rec is None:
                if out.spent(kv.value):
                    break
                continue
            if sel.match is not None and not sel.match(rec):
                tr.add_read_conflict_key(kv.key)
                tr.clear(kv.key)
                _clear_chunks(tr, shard, vs, rec)
                dropped += 1
                continue
            if sel.ordered and rec.shard_key is not None:
                if rec.shard_key in held:
                    continue
                held.add(rec.shard_key)
            tr.add_read_conflict_key(kv.key)
            out.append(Taken(shard, vs, rec, _body(tr.snapshot, shard, vs, rec), kv.value))
            if len(out) >= limit:
                break
        if len(page) < page_size or out.more:
            break
        begin = page[-1].key + b"\x00"
    if dropped:
        _add(tr, {shard.stat("done"): dropped, shard.stat("filtered"): dropped})
    return out


def _read_ready(tr, ts: TopicSpace, shard: ShardSpace, limit: int, sel: Selection | None, max_deliver: int,
                consumer_id: str, now: int | None = None):
    promoted = {}
    promote_due(tr, shard, limit, promoted, now)
    if sel is not None:
        out = _select_ready(tr, ts, shard, limit, sel, max_deliver, consumer_id)
    else:
        out = _read_head(tr, ts, shard, limit, max_deliver, consumer_id)
    if promoted:
        for t in out:
            t.delayed_key = promoted.get(t.vs.to_bytes())
    return out


def _deliverable(tr, ts: TopicSpace, shard: ShardSpace, kv, vs, max_deliver: int, consumer_id: str):
    """The record of ready row ``kv`` if it may be delivered, else None, dead-lettered
    here in the taking transaction: one that does not decode (a raw dead letter, the
    reason naming what failed), or one that had ``max_deliver`` attempts already (put
    back by any path under a larger bound: a consumer of another config, a
    subscription's ``max_deliver`` lowered since), never delivered again."""
    try:
        rec = Record.decode(kv.value)
    except CorruptValue as e:
        _dead_letter_undecodable(tr, ts, shard, kv.key, vs, kv.value, e, consumer_id)
        return None
    if rec.expires is not None and expire_ended(tr, ts, shard, kv, vs, rec, consumer_id):
        return None
    if rec.attempts < max_deliver:
        return rec
    tr.add_read_conflict_key(kv.key)
    tr.clear(kv.key)
    _dead_letter(tr, ts, shard, vs, bytes(kv.value),
                 f"max_deliver ({max_deliver}) reached before delivery {rec.attempts + 1}", consumer_id)
    return None


def expire_ended(tr, ts: TopicSpace, shard: ShardSpace, kv, vs, rec: Record, consumer_id: str | None) -> bool:
    """Whether ready row ``kv``'s TTL ended (``Record.expires`` reached by the topic's
    clock); if so it is removed here, in the transaction that would have delivered it
    (or the maintenance's sweep, ``retention.expire_ready_chunk``):
    dropped (its chunks too) or dead-lettered, by the topic's ``ttl_action``, and
    counted ``expired``."""
    now = read_clock(tr, ts.clock_key)
    if now < rec.expires:
        return False
    tr.add_read_conflict_key(kv.key)
    tr.clear(kv.key)
    config = load_config(tr.snapshot[ts.config_key])
    if config is not None and config.ttl_action == "dead_letter":
        reason = f"ttl expired {(now - rec.expires) / 1000:.1f}s before delivery {rec.attempts + 1}"
        _dead_letter(tr, ts, shard, vs, bytes(kv.value), reason, consumer_id)
        _add(tr, {shard.stat("expired"): 1})
    else:
        _clear_chunks(tr, shard, vs, rec)
        _add(tr, {shard.stat("done"): 1, shard.stat("expired"): 1})
    return True


def _read_head(tr, ts: TopicSpace, shard: ShardSpace, limit: int, max_deliver: int, consumer_id: str):
    """Up to ``limit`` deliverable messages from the head of the ready queue; the ones
    dead-lettered on the way (``_deliverable``, ``_dead_letter_undecodable``) do not
    count, the read goes on past them."""
    r = shard.ready_range
    out = Batch()
    append = out.append
    snap = tr.snapshot
    begin = r.start
    while True:
        want = limit - len(out)
        n = 0
        for kv in snap.get_range(begin, r.stop, limit=want):
            n += 1
            # Ready keys end in 0x33 + the 12-byte stamp their push's commit completed.
            vs = StoredVersionstamp(position_of(kv.key))
            rec = _deliverable(tr, ts, shard, kv, vs, max_deliver, consumer_id)
            if rec is None:
                if out.spent(kv.value):
                    break
                continue
            append(Taken(shard, vs, rec, rec.body if not rec.nchunks else _body(snap, shard, vs, rec), kv.value))
        if out.more or n < want or len(out) >= limit:
            break
        begin = kv.key + b"\x00"
    if out:
        # Conflict only on what we take: the head of the queue, first to last key taken
        # (one range, not a key each; nothing else was between them at our snapshot but
        # what was dead-lettered, and a push commits above every key there).
        first = shard.ready_key(out[0].vs)
        tr.add_read_conflict_range(first, shard.ready_key(out[-1].vs) + b"\x00")
    return out


class RoundReads(NamedTuple):
    """What every shard of a round reads first (``round_reads``)."""

    records: dict       # shard -> its record's read (a future), for the fence
    config: object      # the topic config (decoded), None if the topic is gone
    now: int            # the topic's clock


def round_reads(tr, ts: TopicSpace, shards, prior: RoundReads | None = None) -> RoundReads:
    """The reads each of ``shards`` [ShardSpace] of one round needs before its queues,
    issued at once: every shard record (the owner-epoch fence, non-snapshot) as a future
    before any is waited for, so on FDB they travel together (a round over k shards was
    ~2k+2 round trips one after another), then the topic config (cached behind the
    metadata version, read non-snapshot: a pause or reshard meanwhile conflicts) and its
    clock (snapshot), once per round, not once per shard. ``prior``: this round's earlier
    reads: only the records are read (the caller's next shards). On the embedded engine
    a read is ready when issued: nothing is added."""
    records = {shard: tr[shard.record] for shard in shards}
    if prior is not None:
        return prior._replace(records=records)
    clock = tr.snapshot[ts.clock_key]
    return RoundReads(records, cached_topic_config(tr, ts), decode_counter(clock))


def _fence(tr, ts: TopicSpace, shard: ShardSpace, consumer_id: str, epoch: int, reads: RoundReads | None):
    """A taking transaction's first step on ``shard``: the owner-epoch fence (raises
    ``LeaseLost``), then whether the topic delivers (None if not), else the topic's
    clock."""
    if reads is None:
        reads = round_reads(tr, ts, (shard,))
    check_owner(reads.records[shard], ts, shard.sub, (shard.tag, shard.n), consumer_id, epoch)
    if not _consumable(tr, ts, shard.sub, reads.config):
        return None
    return reads.now


@transactional
def take_batch(tr, ts: TopicSpace, shard: ShardSpace, consumer_id: str, epoch: int, limit: int,
               *, max_deliver: int, finish: bool = True, sel: Selection | None = None,
               reads: RoundReads | None = None) -> list:
    """Remove up to ``limit`` ready messages (at-most-once and exactly-once delivery).
    ``finish``: count them done (exactly-once counts in the caller's transaction). A
    message whose failed attempts reached ``max_deliver`` is dead-lettered instead.
    ``reads``: the round's ``round_reads`` (else read here)."""
    now = _fence(tr, ts, shard, consumer_id, epoch, reads)
    if now is None:
        return Batch()
    taken = _read_ready(tr, ts, shard, limit, sel, max_deliver, consumer_id, now)
    if taken and sel is None:
        # The head of the queue, first to last key: ``_read_ready`` read it all and holds
        # a read conflict on it, so one range clear removes exactly what it took.
        tr.clear_range(shard.ready_key(taken[0].vs), shard.ready_key(taken[-1].vs) + b"\x00")
        for t in taken:
            if t.record.nchunks:
                _clear_chunks(tr, shard, t.vs, t.record)
    else:
        for t in taken:
            tr.clear(shard.ready_key(t.vs))
            _clear_chunks(tr, shard, t.vs, t.record)
    if taken:
        k = len(taken)
        _add(tr, {shard.stat("emitted"): k, shard.stat("done"): k if finish else 0,
                  shard.stat("acked"): k if finish else 0,
                  ts.stat("emitted", shard.n): k, ts.stat("acked", shard.n): k if finish else 0})
    return taken


def mark_take(tr, ts: TopicSpace, sub: str, consumer_id: str, attempt: bytes):
    """In a transaction that took messages (at most once): record its ``attempt`` id
    (a blind write nobody else reads), so ``take_committed`` can tell after
    ``commit_unknown_result`` whether it committed, even once the shards moved."""
    tr[ts.take_marker_key(sub, consumer_id)] = attempt


@transactional
def take_committed(tr, ts: TopicSpace, sub: str, consumer_id: str, attempt: bytes) -> bool:
    """Whether the take transaction that recorded ``attempt`` (``mark_take``) committed."""
    raw = tr[ts.take_marker_key(sub, consumer_id)]
    return raw != None and bytes(raw) == attempt  # noqa: E711


@transactional
def batch_leased(tr, shard: ShardSpace, keys, lease_id: bytes) -> bool:
    """After ``commit_unknown_result`` on ``lease_batch``: True if the lease records
    ``keys`` (``Taken.lease_key`` of its messages) exist under ``lease_id`` (a random id
    per attempt series, part of the key: our commit wrote them)."""
    futures = [(k, tr[k]) for k in keys]
    return all(f != None and decode_leases(k, f).lease_id == lease_id for k, f in futures)  # noqa: E711


@transactional
def lease_batch(tr, ts: TopicSpace, shard: ShardSpace, consumer_id: str, epoch: int, limit: int,
                lease_id: bytes, ack_wait_ms: int, *, max_deliver: int, sel: Selection | None = None,
                reads: RoundReads | None = None) -> list:
    """Lease up to ``limit`` ready messages (at-least-once): they move into one lease
    record (several if their records exceed ``LEASE_RECORD_BYTES``) under ``lease_id``,
    with the consumer and its ack wait; each delivery counts ``attempts + 1``. A message
    delivered ``max_deliver`` times already is dead-lettered instead: never delivered
    past it, whatever put it back. ``reads``: the round's ``round_reads`` (else read
    here)."""
    now = _fence(tr, ts, shard, consumer_id, epoch, reads)
    if now is None:
        return Batch()
    taken = _read_ready(tr, ts, shard, limit, sel, max_deliver, consumer_id, now)
    if not taken:
        return taken
    if sel is None:
        # The head of the queue, first to last key: ``_read_ready`` read it all and holds
        # a read conflict on it, so one range clear removes exactly what it took.
        tr.clear_range(shard.ready_key(taken[0].vs), shard.ready_key(taken[-1].vs) + b"\x00")
    else:
        for t in taken:
            tr.clear(shard.ready_key(t.vs))
    packed_id = fdbtuple.pack((lease_id,))
    budget = LEASE_RECORD_BYTES - 64 - len(consumer_id)
    flat, size, key = [], 0, None
    for t in taken:
        t.record.attempts += 1      # what the handler sees; the record keeps its queued bytes
        t.lease_id = lease_id
        vs12 = t.vs.to_bytes()
        n = len(t.raw) + LEASE_ENTRY_OVERHEAD
        if flat and size + n > budget:
            tr[key] = encode_leases(lease_id, consumer_id, ack_wait_ms, flat)
            flat, size = [], 0
        if not flat:
            key = shard.lease_key(vs12, packed_id)
        t.lease_key = key
        flat += (vs12, t.raw, 0)
        size += n
    tr[key] = encode_leases(lease_id, consumer_id, ack_wait_ms, flat)
    k = len(taken)
    _add(tr, {shard.stat("emitted"): k, shard.stat("in_flight"): k, ts.stat("emitted", shard.n): k})
    return taken


MAX_REASON_CHARS = 1000    # a dead letter's reason is cut to this (a record plus it fits a value)


def _dead_value(tr, shard: ShardSpace, record_raw: bytes, reason: str, consumer_id: str | None,
                raw: bool = False) -> bytes:
    """A dead letter's value, stamped with when (the database clock and this
    transaction's read version: a snapshot read, no conflict): ``--older-than`` ages."""
    return encode_dead(record_raw, reason, consumer_id, read_clock(tr, shard.clock_key),
                       tr.get_read_version().wait(), raw)


def _dead_letter(tr, ts: TopicSpace, shard: ShardSpace, vs, record_raw: bytes, reason: str,
                 consumer_id: str | None, raw: bool = False):
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[:MAX_REASON_CHARS - 1] + "…"
    tr[ts.dlq_key(shard.sub, vs)] = _dead_value(tr, shard, record_raw, reason, consumer_id, raw)
    # Chunks of large bodies stay in the subscription's chunk area with the DLQ entry.
    _add(tr, {shard.stat("done"): 1, shard.stat("dead"): 1, ts.sub_stat(shard.sub, "dead"): 1})


def _dead_letter_undecodable(tr, ts: TopicSpace, shard: ShardSpace, key: bytes, vs, raw, e: CorruptValue,
                             consumer_id: str | None):
    """A queued row (at ``key``) whose record does not decode: to the DLQ in this
    transaction, its bytes as stored (a raw dead letter: listed, never redriven), the
    reason naming what failed; the caller's read goes on. Its body chunks, if it had
    any, stay in the subscription's chunk area with it, as any dead letter's."""
    tr.add_read_conflict_key(key)
    tr.clear(key)
    _dead_letter(tr, ts, shard, vs, bytes(raw), f"undecodable {e.what}: {e.cause}", consumer_id, raw=True)


def dead_letter_taken(tr, ts: TopicSpace, taken: Taken, reason: str, consumer_id: str):
    """Exactly-once ``term()``: dead-letter a message ``take_batch`` took in this
    transaction (and counted acked): its DLQ entry with this delivery counted, its body
    chunks written back beside it (the take cleared them), acked counted back, dead
    counted (done stays: a dead letter is done)."""
    shard, rec = taken.shard, Record.decode(taken.raw)
    rec.attempts += 1
    for i in range(rec.nchunks):
        tr[shard.chunk_key(taken.vs, i, rec)] = taken.body[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES]
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[:MAX_REASON_CHARS - 1] + "…"
    tr[ts.dlq_key(shard.sub, taken.vs)] = _dead_value(tr, shard, rec.encode(), reason, consumer_id)
    _add(tr, {shard.stat("acked"): -1, ts.stat("acked", shard.n): -1, shard.stat("dead"): 1, ts.sub_stat(shard.sub, "dead"): 1})


def _requeue(tr, ts: TopicSpace, shard: ShardSpace, vs, record_raw: bytes, delay_ms: int):
    """Back to ``shard``'s ready queue (its original key) or, with a delay, its delayed
    area. While the topic is resharding, to the shard the reshard moves it to instead
    (``routing.target`` for the new count): a reshard may have passed this shard's ready
    and delayed areas already (and removes the shard when the count shrinks). The topic
    config is read non-snapshot, so a reshard that begins or ends meanwhile makes this
    transaction conflict."""
    config = cached_topic_config(tr, ts)
    if config is not None and config.resharding_to is not None:
        _tag, n = target(Record.decode(record_raw), config.resharding_to)
        if n != shard.n:
            dst = ts.shard(shard.sub, shard.tag, n)
            tr.add(shard.stat("routed"), MINUS_ONE)
            tr.add(dst.stat("routed"), ONE)
            shard = dst
    if delay_ms > 0:
        due = due_base(tr, ts.clock_key, ts.clock_version_key) + delay_ms
        tr[shard.delayed_key(due, vs)] = record_raw
        tr.add(shard.stat("delayed"), ONE)
    else:
        tr[shard.ready_key(vs)] = record_raw   # its original key: first in line again
    tr.add(shard.stat("requeued"), ONE)


def _clear_entry_chunks(tr, shard: ShardSpace, vs, raw):
    """Delete the body chunks of a settled lease entry's record ``raw`` (of one that does
    not decode: whatever chunks its message has)."""
    try:
        if not has_chunks(raw):
            return
        ranges = [shard.chunks_range(vs, Record.decode(raw))]
    except CorruptValue:
        ranges = shard.any_chunks_ranges(vs)
    for r in ranges:
        tr.clear_range(r.start, r.stop)


def _put_record(tr, key: bytes, lr: LeaseRecord, gone: set):
    """Write back a lease record without the entries whose vs is in ``gone`` (delete it
    if none is left)."""
    lr.entries = [e for e in lr.entries if e[0] not in gone]
    if lr.entries:
        tr[key] = lr.encode()
    else:
        del tr[key]


class SettleRow(NamedTuple):
    """One settlement as ``settle`` applies it: the leased message (its shard, its key's
    versionstamp, the lease id and the key of the lease record holding it), the
    :class:`~fdq.settlement.Action`, and ``arg``: a ``NAK``'s delay in seconds, a
    ``TERM``'s reason (else None); ``reason``: a ``NAK``'s, how the attempt ended
    ("failed: ValueError: ...", "not settled (consumer closed)"; None: "nak'd"), kept in
    the dead letter's reason if it was the last."""

    shard: ShardSpace
    vs: Versionstamp
    lease_id: bytes
    lease_key: bytes
    action: Action
    arg: object = None
    reason: str | None = None


def _acks_all(lr: LeaseRecord, rows: list) -> bool:
    """Whether ``rows`` ack every message of lease record ``lr``, each once (the common
    case: a handler returned for each message of its batch)."""
    if len(rows) != len(lr.entries):
        return False
    for row in rows:
        if row.action is not ACK or row.lease_id != lr.lease_id:
            return False
    return {row.vs.to_bytes() for row in rows} == {e[0] for e in lr.entries}


@transactional
def settle(tr, ts: TopicSpace, rows: list, max_deliver: int) -> list:
    """Apply settlements ``rows`` [SettleRow] in one transaction: ``ACK``; ``NAK`` (arg:
    delay s; to the DLQ after max_deliver attempts); ``TERM`` (arg: reason); ``TOUCH``
    (restarts that message's ack wait only); ``RELEASE`` (back to ready uncounted: leased
    but never handed to a handler). Each lease record named is read once (non-snapshot:
    a conflict with an expiry or another settle of it) and written back once, or deleted
    when its last message is settled: a whole batch acked is one delete. Returns the rows
    whose lease was lost; a retry after ``commit_unknown_result`` finds what the first
    attempt settled gone (lost), so nothing is applied twice."""
    by_key = {}
    for row in rows:
        group = by_key.get(row.lease_key)
        if group is None:
            group = by_key[row.lease_key] = []
        group.append(row)
    futures = [(key, tr[key]) for key in by_key]
    lost = []
    acked = {}      # counters summed per transaction: one atomic op per key, not per message
    for key, raw in futures:
        group = by_key[key]
        if raw == None:  # noqa: E711
            lost += group
            continue
        lr = _lease_record(key, raw)
        if lr is None:      # does not decode: its expiry dead-letters it (``expire_leases``)
            lost += group
            continue
        shard = group[0].shard
        if _acks_all(lr, group):
            del tr[key]
            for e in lr.entries:
                _clear_entry_chunks(tr, shard, vs_from_bytes(e[0]), e[1])
            acked[shard] = acked.get(shard, 0) + len(group)
            continue
        index = {e[0]: e for e in lr.entries}
        gone, touched = set(), False
        for row in group:
            vs, action = row.vs, row.action
            vs12 = vs.to_bytes()
            entry = index.get(vs12) if lr.lease_id == row.lease_id and vs12 not in gone else None
            if entry is None:
                lost.append(row)
                continue
            if action is TOUCH:
                entry[2] += 1
                touched = True
                continue
            gone.add(vs12)
            if action is ACK:
                _clear_entry_chunks(tr, shard, vs, entry[1])
                acked[shard] = acked.get(shard, 0) + 1
                continue
            tr.add(shard.stat("in_flight"), MINUS_ONE)
            if action is RELEASE:    # never handed to a handler: back, no attempt counted
                _requeue(tr, ts, shard, vs, entry[1], 0)
                continue
            try:
                rec = lr.delivered(entry)
            except CorruptValue as e:
                _dead_letter(tr, ts, shard, vs, entry[1], f"undecodable {e.what}: {e.cause}", lr.consumer_id, raw=True)
                continue
            if action is TERM:
                _dead_letter(tr, ts, shard, vs, rec.encode(), f"terminated: {row.arg}", lr.consumer_id)
            elif action is NAK:
                if rec.attempts >= max_deliver:
                    ended = row.reason or "nak'd"
                    _dead_letter(tr, ts, shard, vs, rec.encode(),
                                 f"max_deliver ({max_deliver}) reached: last attempt {ended}", lr.consumer_id)
                else:
                    _requeue(tr, ts, shard, vs, rec.encode(), int((row.arg or 0) * 1000))
            else:
                raise ValueError(f"unknown settlement action {action!r}")
        if gone or touched:
            _put_record(tr, key, lr, gone)
    for shard, n in acked.items():
        _add(tr, {shard.stat("in_flight"): -n, shard.stat("done"): n, shard.stat("acked"): n,
                  ts.stat("acked", shard.n): n})
    return lost


@transactional
def scan_leases(tr, shard: ShardSpace, limit: int = 10_000) -> list:
    """[(lease record key, vs, lease_id, touches, ack_wait_ms)] of every message leased
    in the shard, from up to ``limit`` records (snapshot)."""
    out = []
    for key, lr in read_leases(tr.snapshot, shard, limit):
        if lr is None:      # does not decode: due at once, its expiry dead-letters it
            out.append((key, shard.leased.unpack(key)[0], None, 0, 0))
            continue
        for vs12, _rec, touches in lr.entries:
            out.append((key, vs_from_bytes(vs12), lr.lease_id, touches, lr.ack_wait_ms))
    return out


@transactional
def scan_shards_leases(tr, shards: dict, limit: int = 10_000) -> dict:
    """{shard id: ``scan_leases`` of that shard} for ``shards`` {shard id: ShardSpace},
    all at one read version, in one (read-only, snapshot) transaction: a lease check of
    a consumer owning 16 shards was 16 transactions every check interval."""
    return {shard_id: scan_leases(tr, shard, limit) for shard_id, shard in shards.items()}


class Expiry(enum.Enum):
    """What ``expire_leases`` did with one expiring message."""

    REQUEUED = "requeued"   # back to ready (or delayed by its backoff)
    DEAD = "dead"           # max_deliver reached: to the dead-letter queue
    CHANGED = "changed"     # settled, touched or expired meanwhile: left alone


@transactional
def expire_leases(tr, ts: TopicSpace, shard: ShardSpace, consumer_id: str, epoch: int, key: bytes,
                  lease_id: bytes, expiring: list, max_deliver: int, backoff_s: tuple = ()) -> dict:
    """Redeliver messages of lease record ``key`` that the shard's owner observed
    unchanged for their ack wait, ``expiring`` [(vs, touches)]: each back to ready (or
    delayed by the ``backoff_s`` entry for its attempts), or to the DLQ after
    ``max_deliver`` attempts; the record keeps the others. Fenced by shard ownership. A
    message settled, touched or expired meanwhile (a retry after
    ``commit_unknown_result`` included) is left alone. Returns {vs: Expiry}."""
    ensure_owner(tr, ts, shard.sub, (shard.tag, shard.n), consumer_id, epoch)
    raw = tr[key]
    try:
        lr = decode_leases(key, raw) if raw != None else None  # noqa: E711
    except CorruptValue as e:   # the whole record to the DLQ, under its first message's id
        del tr[key]
        _dead_letter(tr, ts, shard, shard.leased.unpack(key)[0], bytes(raw), f"undecodable {e.what}: {e.cause}",
                     None, raw=True)
        tr.add(shard.stat("in_flight"), counter(-lease_entries_hint(raw)))   # as far as its header says
        return {vs: Expiry.DEAD for vs, _t in expiring}
    index = {e[0]: e for e in lr.entries} if lr is not None and lr.lease_id == lease_id else {}
    out, gone = {}, set()
    for vs, touches in expiring:
        entry = index.get(vs.to_bytes())
        if entry is None or entry[2] != touches or entry[0] in gone:
            out[vs] = Expiry.CHANGED
            continue
        gone.add(entry[0])
        tr.add(shard.stat("in_flight"), MINUS_ONE)
        try:
            rec = lr.delivered(entry)
        except CorruptValue as e:
            _dead_letter(tr, ts, shard, vs, entry[1], f"undecodable {e.what}: {e.cause}", lr.consumer_id, raw=True)
            out[vs] = Expiry.DEAD
            continue
        if rec.attempts >= max_deliver:
            _dead_letter(tr, ts, shard, vs, rec.encode(),
                         f"max_deliver ({max_deliver}) reached: lease expired after {lr.ack_wait_ms / 1000:g} s",
                         lr.consumer_id)
            out[vs] = Expiry.DEAD
            continue
        attempts = rec.attempts
        delay = backoff_s[min(attempts, len(backoff_s)) - 1] if backoff_s and attempts else 0
        _requeue(tr, ts, shard, vs, rec.encode(), int(delay * 1000))
        out[vs] = Expiry.REQUEUED
    if gone:
        _put_record(tr, key, lr, gone)
    return out


class Fate(enum.Enum):
    """What ``fail_in_place`` did with the message whose handler failed."""

    GONE = "gone"       # not at its ready key any more (taken, or failed in place meanwhile)
    RETRY = "retry"     # its attempt counted (now or by an earlier attempt): stays first in line
    DEAD = "dead"       # max_deliver reached: to the dead-letter queue


@transactional
def fail_in_place(tr, ts: TopicSpace, shard: ShardSpace, consumer_id: str, epoch: int, vs,
                  max_deliver: int, reason: str, seen_attempts: int | None = None,
                  delayed_key: bytes | None = None) -> Fate:
    """Exactly-once: a handler failed on the message at the head of the queue. Count
    the attempt on its ready record; after ``max_deliver`` attempts, dead-letter it.
    ``seen_attempts``: the record's attempts when the failed handler got it; a record
    counted past that already (a retry after ``commit_unknown_result`` whose first
    attempt committed) is left alone: the attempt counts once. ``delayed_key``: the
    message's delayed key if the failed transaction promoted it (``Taken.delayed_key``):
    that promotion was discarded with the transaction, so it is promoted here."""
    ensure_owner(tr, ts, shard.sub, (shard.tag, shard.n), consumer_id, epoch)
    key = shard.ready_key(vs)
    raw = tr[key]
    if raw == None and delayed_key is not None:  # noqa: E711
        raw = tr[delayed_key]
        if raw != None:  # noqa: E711
            del tr[delayed_key]
            tr.add(shard.stat("delayed"), MINUS_ONE)
            tr[key] = raw
    if raw == None:  # noqa: E711
        return Fate.GONE
    try:
        rec = Record.decode(raw)
    except CorruptValue as e:
        _dead_letter_undecodable(tr, ts, shard, key, vs, raw, e, consumer_id)
        return Fate.DEAD
    if seen_attempts is not None and rec.attempts != seen_attempts:
        return Fate.RETRY
    rec.attempts += 1
    if rec.attempts >= max_deliver:
        del tr[key]
        _dead_letter(tr, ts, shard, vs, rec.encode(), reason, consumer_id)
        return Fate.DEAD
    tr[key] = rec.encode()
    return Fate.RETRY


__all__ = ["Taken", "Batch", "Selection", "SettleRow", "RoundReads", "round_reads", "Expiry", "Fate", "MAX_REASON_CHARS", "SCAN_LIMIT",
           "promote_due", "read_leases", "in_shard", "take_batch", "mark_take", "take_committed", "batch_leased",
           "lease_batch", "dead_letter_taken", "settle", "scan_leases", "scan_shards_leases", "expire_leases",
           "fail_in_place"]
