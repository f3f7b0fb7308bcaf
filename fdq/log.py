"""Reading the "all" log: loops of short transactions over :mod:`fdq.ops.log`'s reads.

Its buckets are merged by versionstamp, from a position or a time. Each read is a bounded
snapshot range read in its own short transaction, so a long scan never holds a read
version for more than a moment; each is ``transactional`` (retried on a retryable error,
as FDB's ``future_version`` or ``process_behind``), so one such error never fails a scan.

An entry whose record does not decode (a damaged value, ``CorruptValue``) is skipped,
with one warning per topic at most every ``WARN_EVERY_S`` (``_skipped``): a scan reads on.
"""
from __future__ import annotations

import heapq
import logging
import threading
import time

from .errors import CorruptValue
from .keyspace import TopicSpace, Versionstamp, message_id, position_of
from .keyspace.codec import Record, decode_columns
from .ops.log import chunked_body, read_heads, scan_page, position_for_time
# Re-exported at their old names until the wrap-up (callers import them from here).
from .ops.log import (SLACK_MS, advance_positions, after_key, bucket_range, buckets_in,  # noqa: F401
                      chunks_bytes, entry_bytes, entry_key, last_positions, log_buckets, position_after_time,
                      vs_before)


log = logging.getLogger("fdq.log")
WARN_EVERY_S = 10.0     # undecodable entries skipped: one warning per topic at most this often
_warned = {}            # topic -> monotonic time of its last warning
_warned_lock = threading.Lock()


def _skipped(ts: TopicSpace, n: int, vs, e: CorruptValue):
    """``n`` undecodable log entries of ``ts`` skipped (the first at ``vs``, failing with
    ``e``): one warning line, at most every ``WARN_EVERY_S`` per topic."""
    now = time.monotonic()
    with _warned_lock:
        last = _warned.get(ts.name)
        if last is not None and now - last < WARN_EVERY_S:
            return
        _warned[ts.name] = now
    at = f" (the first at {message_id(vs)})" if vs is not None else ""
    log.warning("topic %s: skipped %d log entr%s that do not decode%s: %s", ts.name, n, "y" if n == 1 else "ies",
                at, e)


def read_chunk(db, ts: TopicSpace, buckets, cursors: dict, limit: int):
    """Up to ``limit`` log entries after the per-bucket ``cursors`` {bucket: vs or None
    (from the start)}, merged by versionstamp: [(vs, bucket, Record, raw)]. ``buckets``:
    the bucket numbers (``log_buckets``), or a count for ``range(count)``. Advances
    ``cursors`` (past undecodable entries too: skipped, ``_skipped``). Returns [] at the
    end of the log."""
    buckets = range(buckets) if isinstance(buckets, int) else list(buckets)
    per_bucket = max(16, limit // max(1, len(buckets)) * 2)
    while True:
        heads, exhausted = read_heads(db, ts, buckets, cursors, per_bucket)
        # Entries are safe to emit only up to the smallest "last read" key of the buckets
        # that still have more: beyond it another bucket may hold an earlier one.
        bound = None
        for b, rows in zip(buckets, heads):
            if b not in exhausted and rows:
                last = rows[-1][0]
                bound = last if bound is None or last < bound else bound
        merged = heapq.merge(*heads, key=lambda x: x[0])
        out, bad, first_bad = [], 0, None
        for vs, b, raw in merged:
            if bound is not None and vs > bound:
                break
            cursors[b] = vs
            try:
                out.append((vs, b, Record.decode(raw), raw))
            except CorruptValue as e:
                if not bad:
                    first_bad = (vs, e)
                bad += 1
                continue
            if len(out) >= limit:
                break
        if bad:
            _skipped(ts, bad, *first_bad)
        if out or not bad:     # a chunk of only undecodable entries is not the end: read on
            return out

def body_of(db, ts: TopicSpace, vs, record: Record, *, strict: bool = False) -> bytes | None:
    """The body of the log entry ``record`` at ``vs``, its chunks read in a new
    transaction. A trim may have deleted them since the record was read: with
    ``strict``, None then (not a partial or empty body)."""
    if not record.nchunks:
        return record.body     # (no transaction: this is most entries)
    return chunked_body(db, ts, vs, record, strict)

def iter_window(db, ts: TopicSpace, buckets, start_ms: int | None, end_ms: int | None,
                chunk: int = 1000):
    """Yield (vs, bucket, Record) of messages inserted in ``[start_ms, end_ms)``, in log
    order. Stops once entries are past ``end_ms + SLACK_MS``. ``buckets``: as
    ``read_chunk``'s (``log_buckets(db, ts)`` finds every bucket a reshard left)."""
    start_vs = position_for_time(db, ts, start_ms)
    buckets = range(buckets) if isinstance(buckets, int) else list(buckets)
    cursors = {b: (start_vs if start_ms is not None else None) for b in buckets}
    while True:
        rows = read_chunk(db, ts, buckets, cursors, chunk)
        if not rows:
            return
        for vs, b, rec, _raw in rows:
            if end_ms is not None and rec.ts_ms >= end_ms + SLACK_MS:
                return
            if (start_ms is None or rec.ts_ms >= start_ms) and (end_ms is None or rec.ts_ms < end_ms):
                yield vs, b, rec

SCAN_BYTES = 8_000_000   # about this much per scan batch: records go up to ~92 KB each


def scan_entries(db, ts: TopicSpace, begin: bytes, end: bytes, batch: int = 4096,
                 max_bytes: int = SCAN_BYTES):
    """Yield (keys, raw records) of the log entries in ``[begin, end)`` (one bucket or
    several), two lists of at most ``batch`` each and about ``max_bytes`` (the first
    batch is of at most 64 entries; the next ones are sized by the entries read so far),
    each batch read in its own short snapshot transaction."""
    limit, nbytes, nrows = min(batch, 64), 0, 0
    while begin < end:
        kvs = scan_page(db, begin, end, limit)
        if kvs:
            keys, raws = [kv.key for kv in kvs], [kv.value for kv in kvs]
            yield keys, raws
            nrows += len(kvs)
            nbytes += sum(map(len, raws)) + len(keys) * len(keys[0])
        if len(kvs) < limit:
            return
        begin = kvs[-1].key + b"\x00"
        limit = max(1, min(batch, max_bytes * nrows // max(1, nbytes)))

_EMPTY_COLUMNS = ("vs", "ts_ms", "shard_key", "headers", "body", "msg_id", "replay_of")


def _decodable(ts: TopicSpace, keys, raws) -> tuple:
    """(keys, raws) of the entries whose record decodes; the others skipped (``_skipped``)."""
    good_keys, good_raws, bad, first = [], [], 0, None
    for k, r in zip(keys, raws):
        try:
            Record.decode(r)
        except CorruptValue as e:
            if not bad:
                first = (Versionstamp.from_bytes(position_of(k)), e)
            bad += 1
            continue
        good_keys.append(k)
        good_raws.append(r)
    if bad:
        _skipped(ts, bad, *first)
    return good_keys, good_raws


def decode_entries(db, ts: TopicSpace, keys, raws, start_ms=None, end_ms=None, shard_keys=None) -> dict:
    """Columns of the log entries (``keys``, ``raws``: their keys and raw records, as
    ``scan_entries`` yields them) inserted in ``[start_ms, end_ms)`` (and with a shard
    key in ``shard_keys``, a set, when given): {"ts_ms", "shard_key", "headers", "body",
    "msg_id", "replay_of"} sequences (headers as dicts or None) and "vs": the entries'
    positions (the message ids), 12 bytes each, joined. Bodies split into chunks are
    read back whole; an entry whose chunks a trim deleted since ``raws`` were read is
    left out (it is no longer in the log), never returned with an empty body."""
    if not raws:
        return {c: b"" if c == "vs" else [] for c in _EMPTY_COLUMNS}
    try:
        tss, sks, mids, hds, bodies, nchunks, reps = decode_columns(raws)
    except CorruptValue:    # one at least does not decode: those are skipped (``_skipped``)
        keys, raws = _decodable(ts, keys, raws)
        if not raws:
            return {c: b"" if c == "vs" else [] for c in _EMPTY_COLUMNS}
        tss, sks, mids, hds, bodies, nchunks, reps = decode_columns(raws)
    n = len(tss)
    keep = None
    if (start_ms is not None and min(tss) < start_ms) or (end_ms is not None and max(tss) >= end_ms):
        keep = [i for i, t in enumerate(tss)
                if (start_ms is None or t >= start_ms) and (end_ms is None or t < end_ms)]
    if shard_keys is not None:
        keep = [i for i in (range(n) if keep is None else keep) if sks[i] in shard_keys]
    if keep is not None:
        tss, sks, mids, hds, bodies, reps, keys, raws = (
            [col[i] for i in keep] for col in (tss, sks, mids, hds, bodies, reps, keys, raws))
        if nchunks is not None:
            nchunks = [nchunks[i] for i in keep]
    if nchunks is not None and any(nchunks):
        bodies = list(bodies)
        for i, nc in enumerate(nchunks):
            if nc:
                vs = Versionstamp.from_bytes(position_of(keys[i]))
                bodies[i] = body_of(db, ts, vs, Record.decode(raws[i]), strict=True)   # (its chunks' part)
        if None in bodies:   # trimmed since its record was read: it is gone, not empty
            keep = [i for i, b in enumerate(bodies) if b is not None]
            tss, sks, mids, hds, bodies, reps, keys = (
                [col[i] for i in keep] for col in (tss, sks, mids, hds, bodies, reps, keys))
    return {"vs": b"".join(map(position_of, keys)), "ts_ms": tss, "shard_key": sks,
            "headers": hds, "body": bodies, "msg_id": mids, "replay_of": reps}
