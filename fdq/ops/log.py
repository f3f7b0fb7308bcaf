"""The "all" log's transactional reads: positions, times, buckets, bounded pages.

The log is spread over buckets (one per shard, ``log/<bucket>/<vs>``) so a cluster
spreads its writes; readers merge buckets by versionstamp, which is commit order. A
position is a message's 12 stamp bytes (``keyspace.position_of``), and positions compare
as those bytes. Each function here reads in the caller's transaction (or, given a
database, in one short retried transaction of its own); the loops over them (long scans,
windows) are :mod:`fdq.log`'s.
"""
from __future__ import annotations

import heapq

from ..engine import StreamingMode, transactional   # the same values as fdb.StreamingMode
from ..keyspace import STAMP_BYTES, TopicSpace, Versionstamp, position_of
from ..keyspace.codec import CHUNK_BYTES, Record
from ..keyspace.stamps import FIRST_VS

SLACK_MS = 60_000   # producers' clocks may disagree: start a time window this much earlier

def entry_bytes(ts: TopicSpace, bucket: int, record_len: int, nchunks: int = 0, chunk_bytes: int = 0,
                record=None) -> int:
    """A log entry's size as the topic's ``log_bytes`` counter counts it (what
    ``retention_bytes`` bounds): the bytes of its key and record, and of its body chunks'
    keys and values (``chunk_bytes``: the chunks' values together; ``record``: the
    entry's Record, which says where they are). The time index and pending keys are not
    counted. Push adds it, trim subtracts it when it deletes."""
    n = len(ts.log_prefix(bucket)) + STAMP_BYTES + record_len
    if nchunks:
        n += ts.chunk_keys_bytes(nchunks, record) + chunk_bytes
    return n


def chunks_bytes(last_chunk_len: int, nchunks: int) -> int:
    """The bytes of a body's ``nchunks`` chunks from its last one's length: a body is cut
    into ``CHUNK_BYTES`` pieces (``codec.split_body``), so only the last is shorter."""
    return (nchunks - 1) * CHUNK_BYTES + last_chunk_len if nchunks else 0

@transactional
def position_for_time(tr, ts: TopicSpace, t_ms: int | None) -> Versionstamp:
    """A log position at or before every message inserted at ``t_ms`` or later, from the
    sparse time index (the last index entry of a minute before ``t_ms - SLACK_MS``)."""
    if t_ms is None:
        return FIRST_VS
    minute = (t_ms - SLACK_MS) // 60000 * 60000
    r = ts.time_index.range()
    end = ts.time_index_key(minute)
    best = None
    for kv in tr.snapshot.get_range(r.start, end, limit=1, reverse=True):
        _m, vs = ts.time_index.unpack(kv.key)
        best = vs
    return best or FIRST_VS

@transactional
def read_heads(tr, ts: TopicSpace, buckets, cursors: dict, per_bucket: int) -> tuple:
    """``fdq.log.read_chunk``'s reads: up to ``per_bucket`` entries of each bucket after its
    cursor, and the buckets that have no more."""
    heads, exhausted = [], set()
    for b in buckets:
        space = ts.log[b]
        r = space.range()
        begin = ts.log_key(b, cursors[b]) + b"\x00" if cursors.get(b) is not None else r.start
        rows = list(tr.snapshot.get_range(begin, r.stop, limit=per_bucket))
        if len(rows) < per_bucket:
            exhausted.add(b)
        heads.append([(space.unpack(kv.key)[0], b, kv.value) for kv in rows])
    return heads, exhausted

@transactional
def chunked_body(tr, ts: TopicSpace, vs, record: Record, strict: bool) -> bytes | None:
    """The body of the log entry ``vs`` from its chunks (``strict``: None unless all
    ``record.nchunks`` of them are there: a trim may have deleted them)."""
    r = ts.chunks_range(vs, record)
    chunks = [kv.value for kv in tr.snapshot.get_range(r.start, r.stop)]
    if strict and len(chunks) != record.nchunks:
        return None
    return b"".join(chunks)

@transactional
def log_buckets(tr, ts: TopicSpace) -> list:
    """The bucket numbers that hold log entries, found by hopping from bucket to bucket
    (one bounded read per bucket): entries keep the bucket of the shard count they were
    pushed under, so a reshard can leave buckets beyond the current shard count."""
    return buckets_in(tr, ts)


def buckets_in(tr, ts: TopicSpace) -> list:
    """``log_buckets`` in the caller's transaction (snapshot reads)."""
    return buckets_of(tr.snapshot, ts.log)


def buckets_of(reader, space) -> list:
    """The buckets of a bucketed area ``space`` (``space/<bucket>/<vs>``: the log, the
    pending list) that hold entries, one bounded read per bucket (by ``reader``: a
    non-snapshot one holds a conflict on every gap, and every bucket's first entry)."""
    r = space.range()
    begin, out = r.start, []
    while True:
        rows = list(reader.get_range(begin, r.stop, limit=1))
        if not rows:
            return out
        b = space.unpack(rows[0].key)[0]
        out.append(b)
        begin = space[b].range().stop


def merged_heads(tr, space, limit: int) -> tuple:
    """The first ``limit`` entries of a bucketed area ``space`` (``space/<bucket>/<vs>``)
    in versionstamp order (commit order) across its buckets, read at this transaction's
    one read version (snapshot): [(vs, bucket, key, value)], and whether more entries
    follow them. As ``fdq.log.read_chunk``: an entry is taken only up to the smallest
    last key read of a bucket that has more (another bucket may hold an earlier one);
    anything committed after the read version has a later stamp, so the merged order is
    gap-free."""
    buckets = buckets_of(tr.snapshot, space)
    per_bucket = max(16, limit // max(1, len(buckets)) * 2)
    heads, bound, more = [], None, False
    for b in buckets:
        r = space[b].range()
        rows = list(tr.snapshot.get_range(r.start, r.stop, limit=per_bucket))
        if len(rows) == per_bucket:
            last = space.unpack(rows[-1].key)[1]
            bound = last if bound is None or last < bound else bound
            more = True
        heads.append([(space.unpack(kv.key)[1], b, kv.key, kv.value) for kv in rows])
    out = []
    for entry in heapq.merge(*heads, key=lambda e: e[0]):
        if len(out) >= limit or (bound is not None and entry[0] > bound):
            return out, True
        out.append(entry)
    return out, more


def bucket_range(ts: TopicSpace, bucket: int) -> tuple:
    """[begin, end) keys of one bucket."""
    r = ts.log[bucket].range()
    return r.start, r.stop


def entry_key(ts: TopicSpace, bucket: int, vs12: bytes) -> bytes:
    """The key of the entry at position ``vs12`` (12 bytes) in ``bucket``."""
    return ts.log_entry_key(bucket, vs12)


def after_key(ts: TopicSpace, bucket: int, vs12: bytes | None) -> bytes:
    """The first key after position ``vs12`` in ``bucket`` (its start for None)."""
    if vs12 is None:
        return bucket_range(ts, bucket)[0]
    return entry_key(ts, bucket, vs12) + b"\x00"


def vs_before(vs12: bytes) -> bytes | None:
    """The position just before ``vs12`` (positions are 96-bit big-endian numbers)."""
    n = int.from_bytes(vs12, "big")
    return (n - 1).to_bytes(12, "big") if n else None


@transactional
def position_after_time(tr, ts: TopicSpace, t_ms: int | None) -> bytes | None:
    """A position (12 bytes) at or after every message inserted before ``t_ms``: the
    first time index entry of a minute at or after ``t_ms + SLACK_MS`` (the bound
    ``iter_window`` stops at), or None (the end of the log)."""
    if t_ms is None:
        return None
    minute = -(-(t_ms + SLACK_MS) // 60000) * 60000
    r = ts.time_index.range()
    for kv in tr.snapshot.get_range(ts.time_index_key(minute), r.stop, limit=1):
        return position_of(kv.key)
    return None


@transactional
def last_positions(tr, ts: TopicSpace) -> dict:
    """{bucket: position of its last entry}, read in one transaction (buckets included):
    exactly the entries committed at one version are at or before these positions."""
    out = {}
    for b in buckets_in(tr, ts):
        begin, end = bucket_range(ts, b)
        for kv in tr.snapshot.get_range(begin, end, limit=1, reverse=True):
            out[b] = position_of(kv.key)
    return out


@transactional
def advance_positions(tr, ts: TopicSpace, cursors: dict, limit: int) -> tuple:
    """Move the per-bucket ``cursors`` {bucket: last read position or None} forward over
    at most ``limit`` entries in log (versionstamp) order, in one snapshot: returns
    (new cursors, how many entries they pass). Buckets not in ``cursors`` are read from
    their start. No entry is decoded."""
    buckets = sorted(set(buckets_in(tr, ts)) | set(cursors))
    per_bucket = max(16, limit // max(1, len(buckets)) * 2)
    heads, exhausted = [], set()
    for b in buckets:
        begin, end = after_key(ts, b, cursors.get(b)), bucket_range(ts, b)[1]
        rows = [position_of(kv.key) for kv in tr.snapshot.get_range(begin, end, limit=per_bucket)]
        if len(rows) < per_bucket:
            exhausted.add(b)
        heads.append([(vs, b) for vs in rows])
    bound = None   # as read_chunk: past the smallest last key of an unfinished bucket,
    for b, rows in zip(buckets, heads):   # another bucket may hold an earlier entry
        if b not in exhausted and rows:
            bound = rows[-1][0] if bound is None or rows[-1][0] < bound else bound
    out, n = dict(cursors), 0
    for vs, b in heapq.merge(*heads):
        if n >= limit or (bound is not None and vs > bound):
            break
        out[b] = vs
        n += 1
    return out, n

@transactional
def scan_page(tr, begin: bytes, end: bytes, limit: int) -> list:
    """Up to ``limit`` log entries in ``[begin, end)`` (snapshot, read whole)."""
    return list(tr.snapshot.get_range(begin, end, limit=limit, streaming_mode=StreamingMode.want_all))
