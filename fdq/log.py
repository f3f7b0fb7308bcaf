"""Reading the "all" log: its buckets merged by versionstamp, from a position or a time.

The log is spread over buckets (one per shard) so a cluster spreads its writes; readers
merge buckets by versionstamp, which is commit order. Each read is a bounded snapshot
range read in its own short transaction, so a long scan never holds a read version
for more than a moment; each is ``transactional`` (retried on a retryable error, as
FDB's ``future_version`` or ``process_behind``), so one such error never fails a scan.
"""
from __future__ import annotations

import heapq
from itertools import chain

import fdb.tuple as fdbtuple
import msgpack

from .engine import StreamingMode, transactional   # the same values as fdb.StreamingMode
from .keyspace import STAMP_BYTES, TopicSpace, Versionstamp, position_of
from .keyspace.stamps import FIRST_VS
from .keyspace.codec import CHUNK_BYTES, Record

SLACK_MS = 60_000   # producers' clocks may disagree: start a time window this much earlier


_CHUNK_INDEX_BYTES = [len(fdbtuple.pack((i,))) for i in range(256)]


def entry_bytes(ts: TopicSpace, bucket: int, record_len: int, nchunks: int = 0, chunk_bytes: int = 0) -> int:
    """A log entry's size as the topic's ``log_bytes`` counter counts it (what
    ``retention_bytes`` bounds): the bytes of its key and record, and of its body chunks'
    keys and values (``chunk_bytes``: the chunks' values together). The time index and
    pending keys are not counted. Push adds it, trim subtracts it when it deletes."""
    n = len(ts.log_prefix(bucket)) + STAMP_BYTES + record_len
    if nchunks:
        idx = sum(_CHUNK_INDEX_BYTES[i] if i < 256 else len(fdbtuple.pack((i,))) for i in range(nchunks))
        n += nchunks * (len(ts.all_chunks.key()) + STAMP_BYTES) + idx + chunk_bytes
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


def read_chunk(db, ts: TopicSpace, buckets, cursors: dict, limit: int):
    """Up to ``limit`` log entries after the per-bucket ``cursors`` {bucket: vs or None
    (from the start)}, merged by versionstamp: [(vs, bucket, Record, raw)]. ``buckets``:
    the bucket numbers (``log_buckets``), or a count for ``range(count)``. Advances
    ``cursors``. Returns [] at the end of the log."""
    buckets = range(buckets) if isinstance(buckets, int) else list(buckets)
    per_bucket = max(16, limit // max(1, len(buckets)) * 2)
    heads, exhausted = _read_heads(db, ts, buckets, cursors, per_bucket)
    # Entries are safe to emit only up to the smallest "last read" key of the buckets
    # that still have more: beyond it another bucket may hold an earlier one.
    bound = None
    for b, rows in zip(buckets, heads):
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


@transactional
def _read_heads(tr, ts: TopicSpace, buckets, cursors: dict, per_bucket: int) -> tuple:
    """``read_chunk``'s reads: up to ``per_bucket`` entries of each bucket after its
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


def body_of(db, ts: TopicSpace, vs, record: Record, *, strict: bool = False) -> bytes | None:
    """The body of the log entry ``record`` at ``vs``, its chunks read in a new
    transaction. A trim may have deleted them since the record was read: with
    ``strict``, None then (not a partial or empty body)."""
    if not record.nchunks:
        return record.body     # (no transaction: this is most entries)
    return _chunked_body(db, ts, vs, record, strict)


@transactional
def _chunked_body(tr, ts: TopicSpace, vs, record: Record, strict: bool) -> bytes | None:
    r = ts.chunks_range(vs)
    chunks = [kv.value for kv in tr.snapshot.get_range(r.start, r.stop)]
    if strict and len(chunks) != record.nchunks:
        return None
    return b"".join(chunks)


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


# -- Raw, columnar access for bulk readers (Spark) ---------------------------------------
#
# A log key is ``log.pack((bucket, vs))``: the bucket's prefix, then the tuple layer's
# Versionstamp code (0x33) and the 12 stamp bytes, so a key's last 12 bytes are the
# message's position (its id is their hex) and positions compare as those bytes.

_RECORD_PAD = [None, None, None, None, b"", 0, 0, None]   # a record's dropped trailing defaults


@transactional
def log_buckets(tr, ts: TopicSpace) -> list:
    """The bucket numbers that hold log entries, found by hopping from bucket to bucket
    (one bounded read per bucket): entries keep the bucket of the shard count they were
    pushed under, so a reshard can leave buckets beyond the current shard count."""
    return buckets_in(tr, ts)


def buckets_in(tr, ts: TopicSpace) -> list:
    """``log_buckets`` in the caller's transaction (snapshot reads)."""
    r = ts.log.range()
    begin, out = r.start, []
    while True:
        rows = list(tr.snapshot.get_range(begin, r.stop, limit=1))
        if not rows:
            return out
        b = ts.log.unpack(rows[0].key)[0]
        out.append(b)
        begin = ts.log[b].range().stop


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


SCAN_BYTES = 8_000_000   # about this much per scan batch: records go up to ~92 KB each


def scan_entries(db, ts: TopicSpace, begin: bytes, end: bytes, batch: int = 4096,
                 max_bytes: int = SCAN_BYTES):
    """Yield (keys, raw records) of the log entries in ``[begin, end)`` (one bucket or
    several), two lists of at most ``batch`` each and about ``max_bytes`` (the first
    batch is of at most 64 entries; the next ones are sized by the entries read so far),
    each batch read in its own short snapshot transaction."""
    limit, nbytes, nrows = min(batch, 64), 0, 0
    while begin < end:
        kvs = _scan_page(db, begin, end, limit)
        if kvs:
            keys, raws = [kv.key for kv in kvs], [kv.value for kv in kvs]
            yield keys, raws
            nrows += len(kvs)
            nbytes += sum(map(len, raws)) + len(keys) * len(keys[0])
        if len(kvs) < limit:
            return
        begin = kvs[-1].key + b"\x00"
        limit = max(1, min(batch, max_bytes * nrows // max(1, nbytes)))


@transactional
def _scan_page(tr, begin: bytes, end: bytes, limit: int) -> list:
    return list(tr.snapshot.get_range(begin, end, limit=limit, streaming_mode=StreamingMode.want_all))


_EMPTY_COLUMNS = ("vs", "ts_ms", "shard_key", "headers", "body", "msg_id", "replay_of")


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
    # The batch's records in one msgpack call: concatenated under one array header,
    # each record a tuple; then column-wise in C (zip stops at the shortest record).
    recs = msgpack.unpackb(b"".join(chain((b"\xdd" + len(raws).to_bytes(4, "big"),), raws)),
                           raw=False, use_list=False)
    cols = list(zip(*recs))
    if len(cols) < 5:   # a record drops trailing default fields; most keep the first five
        pad = _RECORD_PAD
        recs = [r if len(r) >= 5 else r + tuple(pad[len(r):5]) for r in recs]
        cols = list(zip(*recs))
    tss, sks, mids, hds, bodies = cols[:5]
    del cols
    if int in set(map(type, sks)):   # an unkeyed message's slot holds its home (Record.home)
        sks = [None if type(k) is int else k for k in sks]
    n = len(recs)
    top = max(map(len, recs))
    nchunks = [r[6] if len(r) > 6 else 0 for r in recs] if top > 6 else None
    reps = [r[7] if len(r) > 7 else None for r in recs] if top > 7 else [None] * n
    keep = None
    if (start_ms is not None and min(tss) < start_ms) or (end_ms is not None and max(tss) >= end_ms):
        keep = [i for i, t in enumerate(tss)
                if (start_ms is None or t >= start_ms) and (end_ms is None or t < end_ms)]
    if shard_keys is not None:
        keep = [i for i in (range(n) if keep is None else keep) if sks[i] in shard_keys]
    if keep is not None:
        tss, sks, mids, hds, bodies, reps, keys = (
            [col[i] for i in keep] for col in (tss, sks, mids, hds, bodies, reps, keys))
        if nchunks is not None:
            nchunks = [nchunks[i] for i in keep]
    if nchunks is not None and any(nchunks):
        bodies = list(bodies)
        for i, nc in enumerate(nchunks):
            if nc:
                vs = Versionstamp.from_bytes(position_of(keys[i]))
                bodies[i] = body_of(db, ts, vs, Record(tss[i], nchunks=nc), strict=True)
        if None in bodies:   # trimmed since its record was read: it is gone, not empty
            keep = [i for i, b in enumerate(bodies) if b is not None]
            tss, sks, mids, hds, bodies, reps, keys = (
                [col[i] for i in keep] for col in (tss, sks, mids, hds, bodies, reps, keys))
    return {"vs": b"".join(map(position_of, keys)), "ts_ms": tss, "shard_key": sks,
            "headers": hds, "body": bodies, "msg_id": mids, "replay_of": reps}
