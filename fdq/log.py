"""Reading the "all" log: its buckets merged by versionstamp, from a position or a time.

The log is spread over buckets (one per shard) so a cluster spreads its writes; readers
merge buckets by versionstamp, which is commit order. Each read is a bounded snapshot
range read in its own short transaction, so a long scan never holds a read version
for more than a moment.
"""
from __future__ import annotations

import heapq

from .keyspace import TopicSpace, Versionstamp
from .keyspace.codec import Record

SLACK_MS = 60_000   # producers' clocks may disagree: start a time window this much earlier


def _first_vs():
    return Versionstamp(b"\x00" * 10, 0)


def position_for_time(db, ts: TopicSpace, t_ms: int | None) -> Versionstamp:
    """A log position at or before every message inserted at ``t_ms`` or later, from the
    sparse time index (the last index entry of a minute before ``t_ms - SLACK_MS``)."""
    if t_ms is None:
        return _first_vs()
    minute = (t_ms - SLACK_MS) // 60000 * 60000
    tr = db.create_transaction()
    r = ts.time_index.range()
    end = ts.time_index.pack((minute,))
    best = None
    for kv in tr.snapshot.get_range(r.start, end, limit=1, reverse=True):
        _m, vs = ts.time_index.unpack(kv.key)
        best = vs
    return best or _first_vs()


def read_chunk(db, ts: TopicSpace, buckets: int, cursors: dict, limit: int):
    """Up to ``limit`` log entries after the per-bucket ``cursors`` {bucket: vs or None
    (from the start)}, merged by versionstamp: [(vs, bucket, Record, raw)]. Advances
    ``cursors``. Returns [] at the end of the log."""
    tr = db.create_transaction()
    per_bucket = max(16, limit // max(1, buckets) * 2)
    heads = []
    exhausted = set()
    for b in range(buckets):
        space = ts.log[b]
        r = space.range()
        begin = space.pack((cursors[b],)) + b"\x00" if cursors.get(b) is not None else r.start
        rows = list(tr.snapshot.get_range(begin, r.stop, limit=per_bucket))
        if len(rows) < per_bucket:
            exhausted.add(b)
        heads.append([(space.unpack(kv.key)[0], b, kv.value) for kv in rows])
    # Entries are safe to emit only up to the smallest "last read" key of the buckets
    # that still have more: beyond it another bucket may hold an earlier one.
    bound = None
    for b, rows in enumerate(heads):
        if b not in exhausted and rows:
            last = rows[-1][0]
            bound = last if bound is None or last < bound else bound
    merged = heapq.merge(*heads, key=lambda x: x[0])
    out = []
    for vs, b, raw in merged:
        if bound is not None and vs > bound:
            break
        out.append((vs, b, Record.decode(raw), raw))
        cursors[b] = vs
        if len(out) >= limit:
            break
    return out


def body_of(db, ts: TopicSpace, vs, record: Record) -> bytes:
    if not record.nchunks:
        return record.body
    tr = db.create_transaction()
    r = ts.all_chunks[vs].range()
    return b"".join(kv.value for kv in tr.snapshot.get_range(r.start, r.stop))


def iter_window(db, ts: TopicSpace, buckets: int, start_ms: int | None, end_ms: int | None,
                chunk: int = 1000):
    """Yield (vs, bucket, Record) of messages inserted in ``[start_ms, end_ms)``, in log
    order. Stops once entries are past ``end_ms + SLACK_MS``."""
    start_vs = position_for_time(db, ts, start_ms)
    cursors = {b: (start_vs if start_ms is not None else None) for b in range(buckets)}
    while True:
        rows = read_chunk(db, ts, buckets, cursors, chunk)
        if not rows:
            return
        for vs, b, rec, _raw in rows:
            if end_ms is not None and rec.ts_ms >= end_ms + SLACK_MS:
                return
            if (start_ms is None or rec.ts_ms >= start_ms) and (end_ms is None or rec.ts_ms < end_ms):
                yield vs, b, rec
