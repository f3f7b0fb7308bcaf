"""Retention: trimming the "all" log by age, size and count, its time index, expiring
push markers and dedupe ids past their windows, and sweeping messages whose TTL ended.

``fdq.maintainer`` runs these in chunks continuously (the topic's consumers, one at a
time), ``Supervisor.trim`` on demand; each transaction at batch priority (FoundationDB's
ratekeeper throttles it first: maintenance yields to pushes and consumers). The log's size is
kept exactly in the ``log_bytes`` counter (push adds each entry's ``ops.log.entry_bytes``,
a trim subtracts what it deletes in the same transaction), so a trim killed mid-way
leaves it exact. No trim deletes a message not routed yet (``first_pending``: pushed
while paused, its log entry its only copy) nor any after it.
"""
from __future__ import annotations

from ..engine import transactional
from ..errors import CorruptValue
from ..keyspace import (INDEX_PARTS, ShardSpace, StoredVersionstamp, TopicSpace, Versionstamp, counter, position_of,
                        push_counters, stamp_of_value, version_of)
from ..keyspace.codec import Record, decode_dedupe, pack
from .topics import load_config
from .log import buckets_in, chunks_bytes, entry_bytes
from .queue import expire_ended
from .stats import push_counters as push_counters_of, topic_counter

# The time index holds an entry per minute of pushes; a trim by age drops those of
# minutes that end this long before its cutoff (a window start reads the index back
# ``log.SLACK_MS`` earlier, so keep a margin past it).
INDEX_KEEP_MS = 120_000


@transactional
def read_version(tr) -> int:
    return tr.get_read_version().wait()


@transactional
def trim_bucket_chunk(tr, ts: TopicSpace, bucket: int, before_ms: int, limit: int, after=None,
                      young_from: int | None = None) -> tuple:
    """Delete the log entries of ``bucket`` inserted before ``before_ms`` among the next
    ``limit`` after position ``after`` (None: its start), never one not yet routed
    (``first_pending``) nor any after it. -> (deleted, bytes freed, last position read,
    done). ``done`` at the bucket's end, or at the first entry inserted at or after
    ``before_ms`` and committed at or after version ``young_from``; an entry inserted
    "later" but committed before ``young_from`` is a producer clock running ahead: it is
    kept and the scan goes on (None: stop at the first entry not due). The bytes freed
    are subtracted from the ``log_bytes`` counter here.

    Entries are read by snapshot (pushes appending to the bucket do not abort a trim);
    the deleted ones go by runs (``_Runs``: one clear and one read conflict range per
    run of consecutive entries), so two trims never both delete (and subtract) one
    entry. At batch priority: maintenance yields to pushes and consumers."""
    tr.options.set_priority_batch()
    space = ts.log[bucket]
    r = space.range()
    begin = ts.log_key(bucket, after) + b"\x00" if after is not None else r.start
    pending = first_pending(tr, ts)
    deleted = freed = 0
    rows = list(tr.snapshot.get_range(begin, r.stop, limit=limit))
    last, done = after, len(rows) < limit
    runs = _Runs(tr)
    for kv in rows:
        vs = space.unpack(kv.key)[0]
        if pending is not None and vs >= pending:
            done = True
            break
        rec = Record.decode(kv.value)
        if rec.ts_ms >= before_ms:
            if young_from is None or version_of(vs) >= young_from:
                done = True
                break
            runs.end()      # a clock ahead: kept, and not a reason to keep what follows
            last = vs
            continue
        runs.add(kv.key)
        freed += _entry_bytes(tr, ts, bucket, vs, len(kv.value), rec)
        deleted += 1
        last = vs
    runs.end()
    _note_trimmed(tr, ts, deleted, freed)
    return deleted, freed, last, done


class _Runs:
    """Deletes runs of consecutive log entries of one bucket: each run (``add`` its keys
    in order, ``end`` it) is one ``clear_range`` with one read conflict range over it, so
    a concurrent trim of any of them makes one of the two retry (and find them gone).
    Pushes append after every entry committed, never inside a run: no conflict."""

    def __init__(self, tr):
        self.tr, self.first, self.last = tr, None, None

    def add(self, key: bytes):
        if self.first is None:
            self.first = key
        self.last = key

    def end(self):
        if self.first is not None:
            stop = self.last + b"\x00"
            self.tr.add_read_conflict_range(self.first, stop)
            self.tr.clear_range(self.first, stop)
            self.first = self.last = None


def _note_trimmed(tr, ts: TopicSpace, deleted: int, freed: int):
    """Subtract ``freed`` from ``log_bytes`` and count the entries deleted (``trimmed``)
    and their bytes (``trimmed_bytes``).
    ``trimmed`` is written by every trim that deletes and read with a conflict by trim by
    size: two trims are serialized, so the size one never acts on a ``log_bytes`` that
    another trim lowered since it read it (it would delete more than needed)."""
    if freed:
        tr.add(ts.push_stat(), push_counters(log_bytes=-freed))
        tr.add(ts.stat("trimmed_bytes"), counter(freed))
    if deleted:
        tr.add(ts.stat("trimmed"), counter(deleted))


def _entry_bytes(tr, ts: TopicSpace, bucket: int, vs, value_bytes: int, rec: Record) -> int:
    """Delete the body chunks of log entry ``vs`` (its record ``rec``; its key goes with
    its run, ``_Runs``) and return the entry's bytes (``ops.log.entry_bytes``)."""
    size = 0
    nchunks = rec.nchunks
    if nchunks:
        last = tr.snapshot[ts.chunk_key(vs, nchunks - 1, rec)]
        size = chunks_bytes(len(last) if last != None else 0, nchunks)   # noqa: E711
        cr = ts.chunks_range(vs, rec)
        tr.clear_range(cr.start, cr.stop)
    return entry_bytes(ts, bucket, value_bytes, nchunks, size, rec)


@transactional
def trim_oldest_chunk(tr, ts: TopicSpace, entries: list, max_bytes: int | None,
                      max_messages: int | None = None) -> tuple:
    """Delete the oldest of ``entries`` [(bucket, vs)] (the log's oldest, in log order:
    each bucket's are consecutive in it) while the log is over ``max_bytes`` by its
    ``log_bytes`` counter or over ``max_messages`` entries (``inserted - trimmed``; None:
    no such limit), never one not yet routed nor any after it. -> (deleted, bytes freed,
    done). An entry already gone (a concurrent trim) is skipped. ``log_bytes`` and
    ``inserted`` are read by snapshot (concurrent pushes do not abort a trim),
    ``trimmed`` with a conflict (a concurrent trim does); the bytes freed are subtracted
    from the counter here. Each bucket's deleted entries go as one run (``_Runs``). At
    batch priority."""
    tr.options.set_priority_batch()
    tr.add_read_conflict_key(ts.stat("trimmed"))    # any other trim's commit (``_note_trimmed``)
    sums = push_counters_of(tr.snapshot, ts)
    size = sums["log_bytes"]
    count = sums["inserted"] - topic_counter(tr.snapshot, ts, "trimmed") if max_messages is not None else 0
    pending = first_pending(tr, ts)
    raws = [tr.snapshot[ts.log_key(b, vs)] for b, vs in entries]    # (futures on FDB)
    deleted = freed = 0
    done = False
    runs = {}
    for (bucket, vs), raw in zip(entries, raws):
        over = ((max_bytes is not None and size - freed > max_bytes)
                or (max_messages is not None and count - deleted > max_messages))
        if not over or (pending is not None and vs >= pending):
            done = True
            break
        if raw == None:  # noqa: E711 - deleted meanwhile
            continue
        runs.setdefault(bucket, _Runs(tr)).add(ts.log_key(bucket, vs))
        freed += _entry_bytes(tr, ts, bucket, vs, len(raw), Record.decode(raw))
        deleted += 1
    for run in runs.values():
        run.end()
    _note_trimmed(tr, ts, deleted, freed)
    return deleted, freed, done


@transactional
def trim_time_index_before(tr, ts: TopicSpace, before_ms: int):
    """Drop the time index's entries of the minutes that end ``INDEX_KEEP_MS`` before
    ``before_ms`` (after a trim by age to ``before_ms``). Pushes add entries blind: no
    conflict with them."""
    tr.options.set_priority_batch()
    r = ts.time_index.range()
    tr.clear_range(r.start, ts.time_index_key(before_ms // 60000 * 60000 - INDEX_KEEP_MS))


@transactional
def trim_index_chunk(tr, ts: TopicSpace, limit: int) -> tuple:
    """Delete time index entries (in minute order) that point before the log's oldest
    entry, up to the first that does not. -> (deleted, done). Deleting an index entry is
    always safe (a window then starts earlier, ``log.position_for_time``); keeping them
    would grow the index without bound under retention by size alone."""
    tr.options.set_priority_batch()
    oldest = None
    for b in buckets_in(tr, ts):
        br = ts.log_bucket_range(b)
        for kv in tr.snapshot.get_range(br.start, br.stop, limit=1):
            vs = ts.log[b].unpack(kv.key)[0]
            oldest = vs if oldest is None or vs < oldest else oldest
    if oldest is None:      # an empty log: whatever is committed later is after this version
        rv = tr.get_read_version().wait()
        oldest = Versionstamp(rv.to_bytes(8, "big") + b"\x00\x00", 0)
    r = ts.time_index.range()
    rows = list(tr.snapshot.get_range(r.start, r.stop, limit=limit))   # (pushes add index
    for n, kv in enumerate(rows):                                       # entries: no conflict)
        if ts.time_index.unpack(kv.key)[1] >= oldest:
            return n, True
        del tr[kv.key]
    return len(rows), len(rows) < limit


def first_pending(tr, ts: TopicSpace):
    """The oldest message pushed while paused or resharding and not routed yet (its log
    entry is its only copy: retention must keep it and every later one), or None. Not a
    snapshot: a play routing it, or a push adding the first one of a bucket (its
    pending part: the head of each is read), conflicts."""
    r = ts.pending.range()
    begin, first = r.start, None
    while True:     # one read per bucket: its head (its oldest), then on past the bucket
        rows = list(tr.get_range(begin, r.stop, limit=1))
        if not rows:
            return first
        bucket, vs = ts.pending.unpack(rows[0].key)
        first = vs if first is None or vs < first else first
        begin = ts.pending[bucket].range().stop


@transactional
def expire_markers_chunk(tr, ts: TopicSpace, older_than_version: int, limit: int) -> int:
    """Delete up to ``limit`` push markers (and their split parts) committed before
    version ``older_than_version``, with their by-version index entries. Returns the
    index entries deleted (``limit``: maybe more to do)."""
    tr.options.set_priority_batch()
    def expire(txid: bytes, vs) -> bool:
        key = ts.marker_key(txid)
        current = tr[key]
        if current != None and stamp_of_value(current) == vs.tr_version:  # noqa: E711
            del tr[key]
            r = ts.marker_parts_range(txid)
            tr.clear_range(r.start, r.stop)
        return True
    return _expire(tr, ts.marker_index, older_than_version, limit, expire)


@transactional
def expire_dedupe_chunk(tr, ts: TopicSpace, older_than_version: int, limit: int,
                        keep_after_ms: int, keep_before_ms: int) -> int:
    """Delete up to ``limit`` dedupe ids whose first push committed before version
    ``older_than_version``, with their by-version index entries; an id pushed again
    since keeps its newer entry. An entry whose producer time is in ``[keep_after_ms,
    keep_before_ms)`` stops the run, kept: old by versions but young by the clock is a
    version jump, not age; a time past ``keep_before_ms`` is a producer's clock ahead
    (kept, it would stop the cleanup of every later entry while that clock is ahead).
    Returns the index entries deleted (``limit``: maybe more to do)."""
    tr.options.set_priority_batch()
    def expire(msg_id: bytes, vs) -> bool:
        key = ts.dedupe_key(msg_id.decode())
        current = tr[key]
        if current != None:  # noqa: E711
            entry = decode_dedupe(current)
            if entry.vs.tr_version == vs.tr_version:
                if keep_after_ms <= entry.ts_ms < keep_before_ms:
                    return False
                del tr[key]
        return True
    return _expire(tr, ts.dedupe_index, older_than_version, limit, expire)


def _expire(tr, index_part, older_than_version: int, limit: int, expire) -> int:
    """Walk each part of a by-version index (``index_part(p)``, ``INDEX_PARTS`` of them)
    from its oldest entry: for each one committed before ``older_than_version``,
    ``expire(its value, its versionstamp)`` deletes what it points to (False: keep it,
    stop that part here), then the index entry goes. Returns the entries deleted, at
    most ``limit``: less means every part is done. The index is read by snapshot, with a
    conflict on each entry deleted (a concurrent expiry of it retries): a read to the end
    of a short part conflicted with every push appending there."""
    n = 0
    for p in range(INDEX_PARTS):
        index = index_part(p)
        r = index.range()
        for kv in tr.snapshot.get_range(r.start, r.stop, limit=limit - n):
            vs = index.unpack(kv.key)[0]
            if version_of(vs) >= older_than_version or not expire(bytes(kv.value), vs):
                break
            tr.add_read_conflict_key(kv.key)
            del tr[kv.key]
            n += 1
        if n >= limit:
            return n
    return n


@transactional
def record_maintenance_pass(tr, ts: TopicSpace, holder: str, removed: int, behind: bool) -> bool:
    """Note a maintainer's pass (``fdq.maintainer``): its holder, the read version it
    ended at (its age in ``stats``), what it removed (log entries, expired messages) and whether it stopped
    with more to do. Not on a deleted topic (returns False)."""
    if load_config(tr.snapshot[ts.config_key]) is None:
        return False
    tr[ts.maintenance_key] = pack({"holder": holder, "version": tr.get_read_version().wait(),
                                   "removed": removed, "behind": behind})
    return True



@transactional
def expire_ready_chunk(tr, ts: TopicSpace, shard: ShardSpace, limit: int) -> int:
    """Remove the messages whose TTL ended among the first ``limit`` of ``shard``'s ready
    queue (``queue.expire_ended``: dropped or dead-lettered, as a take would), so the
    queues of a subscription nobody consumes shrink too. Read by snapshot, a conflict on
    each row removed (a take of it retries, or this does). Returns how many."""
    tr.options.set_priority_batch()
    n = 0
    r = shard.ready_range
    for kv in tr.snapshot.get_range(r.start, r.stop, limit=limit):
        try:
            rec = Record.decode(kv.value)
        except CorruptValue:        # a take dead-letters it
            continue
        if rec.expires is not None and expire_ended(tr, ts, shard, kv, StoredVersionstamp(position_of(kv.key)),
                                                    rec, None):
            n += 1
    return n
