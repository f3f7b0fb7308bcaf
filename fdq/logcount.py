"""Counting an older topic's log: gives a topic an older FDQ created (its config's
``log_bytes_counted`` False, ``TopicConfig``) an exact ``log_bytes`` counter, while
pushes and trims go on.

Push adds each entry's bytes (``fdq.log.entry_bytes``) to ``log_bytes`` by atomic add on
every topic; trim subtracts what it deletes only where the counter holds it. The count
splits the log at one commit, ``count_begin``'s, which clears the counter and records
its versionstamp (the *stamp*); log keys are versionstamped, so every entry is on one
side of it:

* an entry committed after the stamp: its push added it to the cleared counter;
* an entry committed before it: ``count_chunk`` adds it, per bucket in log order up to
  the stamp, a chunk at a time, advancing the bucket's cursor in the same transaction (a
  retry after ``commit_unknown_result``, or a second run at once, reads the cursor
  again: nothing is counted twice);
* a trim deleting an entry subtracts it only if the counter holds it (``holds_entry``):
  committed after the stamp, or at or before its bucket's cursor. The chunk reads its
  entries with a conflict and the trim reads the cursor with one, so they serialize.

``count_finish`` sets ``log_bytes_counted`` and removes the count's state once every
bucket is counted up to the stamp. Killed anywhere, a rerun resumes from the cursors.
"""
from __future__ import annotations

import dataclasses
import struct

from .engine import transactional
from .keyspace import TopicSpace, Versionstamp, counter
from .keyspace.codec import Record, pack, unpack
from .log import buckets_in, chunks_bytes, entry_bytes
from .topic import read_topic_config, write_topic_config

_STAMP_PLACEHOLDER = b"\x00" * 10 + struct.pack("<I", 0)    # set_versionstamped_value: stamp at 0


def _stamp_key(ts: TopicSpace) -> bytes:
    return ts.log_count.pack(("stamp",))


def _cursor_key(ts: TopicSpace, bucket: int) -> bytes:
    return ts.log_count["cursor"].pack((bucket,))


def _stamp(tr, ts: TopicSpace):
    """The stamp (10 bytes) of the count in progress, or None. With a conflict: a count
    beginning or finishing meanwhile makes the caller retry."""
    raw = tr[_stamp_key(ts)]
    return None if raw == None else bytes(raw)[:10]  # noqa: E711


def _cursor(tr, ts: TopicSpace, bucket: int) -> tuple:
    """``(last key counted or None, done)`` of ``bucket``, with a conflict."""
    raw = tr[_cursor_key(ts, bucket)]
    return (None, False) if raw == None else tuple(unpack(bytes(raw)))  # noqa: E711


def _end_key(ts: TopicSpace, bucket: int, stamp: bytes) -> bytes:
    """The first key of ``bucket`` at or after the stamp: the count ends before it."""
    return ts.log_key(bucket, Versionstamp(stamp, 0))


@transactional
def count_begin(tr, ts: TopicSpace) -> bool:
    """Start counting the log of a topic without an exact ``log_bytes`` (clear the
    counter, record the stamp), or find the count a killed run left (then nothing
    changes). False if the topic has an exact counter already."""
    if read_topic_config(tr, ts).log_bytes_counted:
        return False
    if _stamp(tr, ts) is None:
        tr.clear(ts.stat("log_bytes"))
        r = ts.log_count.range()
        tr.clear_range(r.start, r.stop)
        tr.set_versionstamped_value(_stamp_key(ts), _STAMP_PLACEHOLDER)
    return True


@transactional
def count_chunk(tr, ts: TopicSpace, bucket: int, limit: int) -> tuple:
    """Add to ``log_bytes`` the bytes of up to ``limit`` entries of ``bucket`` committed
    before the stamp, past the bucket's cursor, and advance it. -> (entries counted,
    done). Done at once if no count is in progress (another run finished it)."""
    stamp = _stamp(tr, ts)
    if stamp is None:
        return 0, True
    last, done = _cursor(tr, ts, bucket)
    if done:
        return 0, True
    begin = last + b"\x00" if last is not None else ts.log[bucket].range().start
    # with a conflict: a trim deleting one of them meanwhile makes one of the two retry
    rows = list(tr.get_range(begin, _end_key(ts, bucket, stamp), limit=limit))
    size = 0
    for kv in rows:
        nchunks = Record.decode(kv.value).nchunks
        body = 0
        if nchunks:
            vs = ts.log[bucket].unpack(kv.key)[0]
            tail = tr.snapshot[ts.all_chunks.pack((vs, nchunks - 1))]
            body = chunks_bytes(len(tail) if tail != None else 0, nchunks)   # noqa: E711
        size += entry_bytes(ts, bucket, len(kv.value), nchunks, body)
    if size:
        tr.add(ts.stat("log_bytes"), counter(size))
    done = len(rows) < limit
    tr[_cursor_key(ts, bucket)] = pack([bytes(rows[-1].key) if rows else last, done])
    return len(rows), done


@transactional
def count_finish(tr, ts: TopicSpace) -> bool:
    """Mark the counter exact (``log_bytes_counted``) and remove the count's state if
    every bucket is counted up to the stamp. False if one is not (count it, then call
    again); True too if no count is in progress and the topic's counter is exact."""
    stamp = _stamp(tr, ts)
    config = read_topic_config(tr, ts)
    if stamp is None:
        return config.log_bytes_counted
    for b in buckets_in(tr, ts):
        last, done = _cursor(tr, ts, b)
        if done:
            continue
        begin = last + b"\x00" if last is not None else ts.log[b].range().start
        if list(tr.get_range(begin, _end_key(ts, b, stamp), limit=1)):
            return False
    write_topic_config(tr, ts, dataclasses.replace(config, log_bytes_counted=True))
    r = ts.log_count.range()
    tr.clear_range(r.start, r.stop)
    return True


def holds_entry(tr, ts: TopicSpace):
    """For a trim deleting log entries in transaction ``tr``: a function ``(bucket,
    key) -> bool``, whether the ``log_bytes`` counter holds that entry's bytes (the trim
    subtracts them then). The stamp and cursors are read with a conflict (a count's
    chunks, beginning and finish serialize with the trim), the config by snapshot."""
    stamp = _stamp(tr, ts)
    if stamp is None:
        counted = read_topic_config(tr, ts, snapshot=True).log_bytes_counted
        return lambda bucket, key: counted
    cursors = {}

    def holds(bucket: int, key: bytes) -> bool:
        if ts.log[bucket].unpack(key)[0].tr_version > stamp:
            return True         # committed after the count began: its push added it
        if bucket not in cursors:
            cursors[bucket] = _cursor(tr, ts, bucket)
        last, done = cursors[bucket]
        return done or (last is not None and key <= last)
    return holds
