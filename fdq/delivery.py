"""Delivery: the transactional functions that move messages through a shard's queues.

    ready --take (at most once / exactly once)--> gone
    ready --lease--> leased --ack--> gone
                            --nak / expire--> ready (same key: first in line) or delayed
                            --term / max_deliver--> dead-letter queue

Consumers read the ready queue with snapshot range reads plus a read conflict on each
key they take, so pushes into the same shard never abort them; every consuming
transaction reads the shard record first (the owner-epoch fence).
"""
from __future__ import annotations

from dataclasses import dataclass

import fdb.tuple as fdbtuple

from .engine import transactional
from .keyspace import ShardSpace, TopicSpace, Versionstamp, counter, decode_counter, vs_from_bytes
from .keyspace.codec import Record, decode_dead, decode_lease, encode_dead, encode_lease, has_chunks
from .membership import ensure_owner, read_clock

ONE, MINUS_ONE = counter(1), counter(-1)


@dataclass
class Taken:
    """A message taken from a shard: its key's versionstamp, decoded record, full body."""

    shard: ShardSpace
    vs: Versionstamp
    record: Record
    body: bytes
    raw: bytes          # the encoded record as stored
    lease_id: bytes | None = None


def _body(reader, shard: ShardSpace, vs, record: Record) -> bytes:
    if not record.nchunks:
        return record.body
    r = shard.chunks[vs].range()
    return b"".join(kv.value for kv in reader.get_range(r.start, r.stop))


def _clear_chunks(tr, shard: ShardSpace, vs, record: Record):
    if record.nchunks:
        r = shard.chunks[vs].range()
        tr.clear_range(r.start, r.stop)


def _add(tr, counters: dict):
    for key, n in counters.items():
        if n:
            tr.add(key, counter(n))


@transactional
def promote_due(tr, shard: ShardSpace, limit: int) -> int | None:
    """Move delayed messages that are due (due <= the database clock, see
    ``membership.read_clock``) to the head of the ready queue. Returns the next due
    time still waiting, if any."""
    now = read_clock(tr, shard.clock_key)
    r = shard.delayed_range
    moved = 0
    for kv in tr.snapshot.get_range(r.start, r.stop, limit=limit + 1):
        due, vs = shard.delayed.unpack(kv.key)
        if due > now or moved >= limit:
            return due
        tr.add_read_conflict_key(kv.key)
        tr.clear(kv.key)
        tr[shard.ready_key(vs)] = kv.value
        moved += 1
    if moved:
        tr.add(shard.stat("delayed"), counter(-moved))
    return None


def _consumable(tr, ts: TopicSpace, sub: str | None = None) -> bool:
    """Paused or resharding topics deliver nothing, nor a paused subscription or one still
    catching up. A non-snapshot read: a pause that commits meanwhile makes this
    transaction conflict."""
    from .topic import load_config
    config = load_config(tr[ts.config_key])
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


def _held_keys(tr, shard: ShardSpace) -> set:
    """Shard keys with a message leased or delayed (waiting for redelivery or due)."""
    held = set()
    r = shard.leased.range()
    for kv in tr.snapshot.get_range(r.start, r.stop, limit=SCAN_LIMIT):
        held.add(Record.decode(decode_lease(kv.value)[0]).shard_key)
    r = shard.delayed.range()
    for kv in tr.snapshot.get_range(r.start, r.stop, limit=SCAN_LIMIT):
        held.add(Record.decode(kv.value).shard_key)
    held.discard(None)
    return held


def _select_ready(tr, shard: ShardSpace, limit: int, sel: Selection) -> list:
    """``_read_ready`` for a subscription with flow control, ordering or a filter.

    ``max_pending``: the shard's ``in_flight`` counter (snapshot) bounds the batch. Only
    the shard's owner raises it, in this fenced transaction, so the bound is exact.
    ``ordered``: messages whose key is held (leased or delayed, or taken earlier in this
    batch) are skipped without a read conflict; keys behind them still flow, within
    ``SCAN_LIMIT`` skipped entries. Filtered-out messages are removed and counted done."""
    if sel.max_pending is not None:
        limit = min(limit, sel.max_pending - decode_counter(tr.snapshot[shard.stat("in_flight")]))
        if limit <= 0:
            return []
    held = _held_keys(tr, shard) if sel.ordered else set()
    out, dropped, scanned = [], 0, 0
    r = shard.ready.range()
    begin, page_size = r.start, max(64, 4 * limit)
    while len(out) < limit and scanned < SCAN_LIMIT:
        page = list(tr.snapshot.get_range(begin, r.stop, limit=page_size))
        for kv in page:
            scanned += 1
            vs = vs_from_bytes(kv.key[-12:])
            rec = Record.decode(kv.value)
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
        if len(page) < page_size:
            break
        begin = page[-1].key + b"\x00"
    if dropped:
        _add(tr, {shard.stat("done"): dropped, shard.stat("filtered"): dropped})
    return out


def _read_ready(tr, shard: ShardSpace, limit: int, sel: Selection | None = None):
    promote_due(tr, shard, limit)
    if sel is not None:
        return _select_ready(tr, shard, limit, sel)
    r = shard.ready_range
    out = []
    snap = tr.snapshot
    for kv in snap.get_range(r.start, r.stop, limit=limit):
        vs = vs_from_bytes(kv.key[-12:])       # ready keys end in 0x33 + the 12-byte stamp
        rec = Record.decode(kv.value)
        out.append(Taken(shard, vs, rec, _body(snap, shard, vs, rec) if rec.nchunks else rec.body, kv.value))
    if out:
        # Conflict only on what we take: the head of the queue, first to last key taken
        # (one range, not a key each; nothing else was between them at our snapshot, and
        # a push commits above every key there).
        first = shard.ready_key(out[0].vs)
        tr.add_read_conflict_range(first, shard.ready_key(out[-1].vs) + b"\x00")
    return out


@transactional
def take_batch(tr, ts: TopicSpace, shard: ShardSpace, consumer_id: str, epoch: int, limit: int,
               *, finish: bool = True, sel: Selection | None = None) -> list:
    """Remove up to ``limit`` ready messages (at-most-once and exactly-once delivery).
    ``finish``: count them done (exactly-once counts in the caller's transaction)."""
    ensure_owner(tr, ts, shard.sub, (shard.tag, shard.n), consumer_id, epoch)
    if not _consumable(tr, ts, shard.sub):
        return []
    taken = _read_ready(tr, shard, limit, sel)
    for t in taken:
        tr.clear(shard.ready_key(t.vs))
        _clear_chunks(tr, shard, t.vs, t.record)
    if taken:
        k = len(taken)
        _add(tr, {shard.stat("emitted"): k, shard.stat("done"): k if finish else 0,
                  shard.stat("acked"): k if finish else 0,
                  ts.stat("emitted"): k, ts.stat("acked"): k if finish else 0})
    return taken


@transactional
def batch_taken(tr, ts: TopicSpace, shard: ShardSpace, consumer_id: str, epoch: int, vss: list) -> bool:
    """After ``commit_unknown_result`` on ``take_batch``: True if the messages ``vss``
    are gone from the ready queue while the shard is still ours at ``epoch`` (only its
    owner's take removes ready messages, so our commit did). Raises LeaseLost if the
    shard moved (then nobody can tell: at most once, the batch is dropped)."""
    ensure_owner(tr, ts, shard.sub, (shard.tag, shard.n), consumer_id, epoch)
    futures = [tr[shard.ready_key(vs)] for vs in vss]
    return all(f == None for f in futures)  # noqa: E711


@transactional
def batch_leased(tr, shard: ShardSpace, vss: list, lease_id: bytes) -> bool:
    """After ``commit_unknown_result`` on ``lease_batch``: True if the messages ``vss``
    are leased under ``lease_id`` (a random id per attempt series: our commit did it)."""
    futures = [tr[shard.leased_key(vs)] for vs in vss]
    return all(f != None and decode_lease(f)[1] == lease_id for f in futures)  # noqa: E711


@transactional
def lease_batch(tr, ts: TopicSpace, shard: ShardSpace, consumer_id: str, epoch: int, limit: int,
                lease_id: bytes, ack_wait_ms: int, *, sel: Selection | None = None) -> list:
    """Lease up to ``limit`` ready messages (at-least-once): each moves to ``leased``
    with ``attempts + 1``, the lease id and its ack wait."""
    ensure_owner(tr, ts, shard.sub, (shard.tag, shard.n), consumer_id, epoch)
    if not _consumable(tr, ts, shard.sub):
        return []
    taken = _read_ready(tr, shard, limit, sel)
    for t in taken:
        t.record.attempts += 1
        t.lease_id = lease_id
        tr.clear(shard.ready_key(t.vs))
        tr[shard.leased_key(t.vs)] = encode_lease(t.record.encode(), lease_id, consumer_id, ack_wait_ms)
    if taken:
        k = len(taken)
        _add(tr, {shard.stat("emitted"): k, shard.stat("in_flight"): k, ts.stat("emitted"): k})
    return taken


def _check_lease(tr, shard: ShardSpace, vs, lease_id: bytes):
    """The lease record if ``lease_id`` still holds it (non-snapshot: conflicts with an
    expiry or another settle), else None."""
    raw = tr[shard.leased_key(vs)]
    if raw == None:  # noqa: E711
        return None
    lease = decode_lease(raw)
    return lease if lease[1] == lease_id else None


def _dead_letter(tr, ts: TopicSpace, shard: ShardSpace, vs, record_raw: bytes, reason: str,
                 consumer_id: str | None):
    tr[ts.dlq(shard.sub).pack((vs,))] = encode_dead(record_raw, reason, consumer_id)
    # Chunks of large bodies stay in the subscription's chunk area with the DLQ entry.
    _add(tr, {shard.stat("done"): 1, shard.stat("dead"): 1, ts.sub_stat(shard.sub, "dead"): 1})


def _requeue(tr, shard: ShardSpace, vs, record_raw: bytes, delay_ms: int):
    if delay_ms > 0:
        due = read_clock(tr, shard.clock_key) + delay_ms
        tr[shard.delayed_key(due, vs)] = record_raw
        tr.add(shard.stat("delayed"), ONE)
    else:
        tr[shard.ready_key(vs)] = record_raw   # its original key: first in line again
    tr.add(shard.stat("requeued"), ONE)


def _read_leases(tr, items) -> dict:
    """{leased key: lease record bytes or None} for settle ``items``, non-snapshot (a
    conflict with an expiry or another settle). Per shard one range read from the first
    key to the last instead of a point read per message: a batch's leases are neighbours
    (it took the head of the ready queue). Other leases in between are read too, up to a
    bound; keys past it get point reads."""
    by_shard = {}
    for shard, vs, _l, _a, _x in items:
        by_shard.setdefault(shard.leased_prefix, []).append(shard.leased_key(vs))
    found = {}
    for keys in by_shard.values():
        if len(keys) > 1:
            keys.sort()
            limit = 2 * len(keys) + 16
            n, last = 0, None
            for kv in tr.get_range(keys[0], keys[-1] + b"\x00", limit=limit):
                found[kv.key] = kv.value
                n += 1
                last = kv.key
            covered = keys[-1] if n < limit else last     # the range read saw every key up to here
            rest = [k for k in keys if k > covered]
            for k in keys:
                if k <= covered and k not in found:
                    found[k] = None
        else:
            rest = keys
        for k, f in [(k, tr[k]) for k in rest]:
            found[k] = None if f == None else bytes(f)  # noqa: E711
    return found


@transactional
def settle(tr, ts: TopicSpace, items: list, max_deliver: int) -> list:
    """Apply settlements [(shard, vs, lease_id, action, arg)] in one transaction:
    ``ack``; ``nak`` (arg: delay s; to the DLQ after max_deliver attempts); ``term``
    (arg: reason); ``touch``. Returns the items whose lease was lost."""
    lost = []
    acked = {}      # counters summed per transaction: one atomic op per key, not per message
    leases = _read_leases(tr, items)
    for shard, vs, lease_id, action, arg in items:
        key = shard.leased_key(vs)
        raw = leases.get(key)
        lease = decode_lease(raw) if raw is not None else None
        if lease is None or lease[1] != lease_id:
            lost.append((shard, vs, lease_id, action, arg))
            continue
        record_raw, _lid, cid, ack_wait_ms, touches = lease
        if action == "touch":
            tr[key] = leases[key] = encode_lease(record_raw, lease_id, cid, ack_wait_ms, touches + 1)
            continue
        del tr[key]
        leases[key] = None
        if action == "ack":
            if has_chunks(record_raw):
                _clear_chunks(tr, shard, vs, Record.decode(record_raw))
            acked[shard] = acked.get(shard, 0) + 1
            continue
        tr.add(shard.stat("in_flight"), MINUS_ONE)
        if action == "term":
            _dead_letter(tr, ts, shard, vs, record_raw, f"terminated: {arg}", cid)
        elif action == "nak":
            if Record.decode(record_raw).attempts >= max_deliver:
                _dead_letter(tr, ts, shard, vs, record_raw,
                             f"max_deliver ({max_deliver}) reached: last attempt nak'd", cid)
            else:
                _requeue(tr, shard, vs, record_raw, int((arg or 0) * 1000))
        else:
            raise ValueError(f"unknown settlement {action!r}")
    total = 0
    for shard, n in acked.items():
        _add(tr, {shard.stat("in_flight"): -n, shard.stat("done"): n, shard.stat("acked"): n})
        total += n
    if total:
        tr.add(ts.stat("acked"), counter(total))
    return lost


@transactional
def scan_leases(tr, shard: ShardSpace, limit: int = 10_000) -> list:
    """[(vs, lease_id, touches, ack_wait_ms)] of the shard's leases (snapshot)."""
    r = shard.leased.range()
    out = []
    for kv in tr.snapshot.get_range(r.start, r.stop, limit=limit):
        _rec, lease_id, _cid, ack_wait_ms, touches = decode_lease(kv.value)
        out.append((shard.leased.unpack(kv.key)[0], lease_id, touches, ack_wait_ms))
    return out


@transactional
def expire_lease(tr, ts: TopicSpace, shard: ShardSpace, consumer_id: str, epoch: int, vs,
                 lease_id: bytes, touches: int, max_deliver: int, backoff_s: tuple = ()) -> str:
    """Redeliver a lease its owner observed unchanged for its ack wait: back to ready
    (or delayed by the ``backoff_s`` entry for its attempts), or to the DLQ after
    ``max_deliver`` attempts. Fenced by shard ownership. Returns what happened."""
    ensure_owner(tr, ts, shard.sub, (shard.tag, shard.n), consumer_id, epoch)
    lease = _check_lease(tr, shard, vs, lease_id)
    if lease is None or lease[4] != touches:
        return "changed"
    record_raw, _lid, cid, _w, _t = lease
    del tr[shard.leased_key(vs)]
    tr.add(shard.stat("in_flight"), MINUS_ONE)
    attempts = Record.decode(record_raw).attempts
    if attempts >= max_deliver:
        _dead_letter(tr, ts, shard, vs, record_raw,
                     f"max_deliver ({max_deliver}) reached: lease expired", cid)
        return "dead"
    delay = backoff_s[min(attempts, len(backoff_s)) - 1] if backoff_s and attempts else 0
    _requeue(tr, shard, vs, record_raw, int(delay * 1000))
    return "requeued"


@transactional
def fail_in_place(tr, ts: TopicSpace, shard: ShardSpace, consumer_id: str, epoch: int, vs,
                  max_deliver: int, reason: str) -> str:
    """Exactly-once: a handler failed on the message at the head of the queue. Count
    the attempt on its ready record; after ``max_deliver`` attempts, dead-letter it."""
    ensure_owner(tr, ts, shard.sub, (shard.tag, shard.n), consumer_id, epoch)
    key = shard.ready_key(vs)
    raw = tr[key]
    if raw == None:  # noqa: E711
        return "gone"
    rec = Record.decode(raw)
    rec.attempts += 1
    if rec.attempts >= max_deliver:
        del tr[key]
        _dead_letter(tr, ts, shard, vs, rec.encode(), reason, consumer_id)
        return "dead"
    tr[key] = rec.encode()
    return "retry"


# -- dead-letter queue ---------------------------------------------------------------

@transactional
def dlq_list(tr, ts: TopicSpace, sub: str, limit: int = 100, after: bytes | None = None) -> list:
    """[(vs, Record, reason, consumer_id, key)] of the DLQ, oldest first; each
    record's ``body`` is the whole body (a large one's chunks joined)."""
    space = ts.dlq(sub)
    r = space.range()
    begin = after + b"\x00" if after else r.start
    out = []
    for kv in tr.snapshot.get_range(begin, r.stop, limit=limit):
        raw, reason, cid = decode_dead(kv.value)
        vs = space.unpack(kv.key)[0]
        rec = Record.decode(raw)
        if rec.nchunks:     # the chunks stay in the subscription's chunk area (_dead_letter)
            c = ts.subs[sub]["chunks"][vs].range()
            rec.body = b"".join(c.value for c in tr.snapshot.get_range(c.start, c.stop))
        out.append((vs, rec, reason, cid, kv.key))
    return out


@transactional
def dlq_redrive_chunk(tr, ts: TopicSpace, sub: str, config, limit: int) -> int:
    """Move up to ``limit`` dead letters back to their shard's ready queue (attempts
    reset). Resumable: each chunk removes what it moved."""
    from .keyspace.codec import shard_of
    space = ts.dlq(sub)
    r = space.range()
    moved = 0
    for kv in tr.get_range(r.start, r.stop, limit=limit):
        vs = space.unpack(kv.key)[0]
        raw, _reason, _cid = decode_dead(kv.value)
        rec = Record.decode(raw)
        rec.attempts = 0
        n = shard_of(rec.shard_key, config.shards) if rec.shard_key is not None else \
            int.from_bytes(vs.to_bytes()[-4:], "big") % config.shards
        from .headers import dispatch_tag
        shard = ts.shard(sub, dispatch_tag(rec.headers), n)
        tr[shard.ready_key(vs)] = rec.encode()
        del tr[kv.key]
        _add(tr, {shard.stat("routed"): 1, ts.sub_stat(sub, "dead"): -1})
        moved += 1
    return moved


@transactional
def dlq_purge_chunk(tr, ts: TopicSpace, sub: str, limit: int) -> int:
    space = ts.dlq(sub)
    r = space.range()
    n = 0
    last = None
    for kv in tr.get_range(r.start, r.stop, limit=limit):
        last = kv.key
        n += 1
    if last is not None:
        tr.clear_range(r.start, last + b"\x00")
        tr.add(ts.sub_stat(sub, "dead"), counter(-n))
    return n


def dlq_size(reader, ts: TopicSpace, sub: str) -> int:
    return decode_counter(reader[ts.sub_stat(sub, "dead")])


__all__ = ["Taken", "Selection", "take_batch", "batch_taken", "batch_leased", "lease_batch", "settle",
           "scan_leases", "expire_lease",
           "promote_due", "fail_in_place", "dlq_list", "dlq_redrive_chunk", "dlq_purge_chunk",
           "dlq_size", "fdbtuple"]
