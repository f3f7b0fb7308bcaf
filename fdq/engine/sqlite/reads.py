"""Reading in the embedded engine: the lazy range (FDB's ``FDBRange``), the read views a
transaction and its ``snapshot`` share, and the transaction's read path (``_Reads``): its
SQLite read snapshot at the read version, read-your-writes over its write map, key
selectors, and the read conflicts reads record (docs/fdb-semantics.md §1, §4, §5).
"""
from __future__ import annotations

import bisect
import sqlite3
from itertools import islice, starmap

from ...errors import EngineError
from ..futures import Future, Key, Value
from ..types import KeySelector, KeyValue, StreamingMode, key_bytes, strinc
from .mutations import _ATOMIC_OPS, _CLEAR, _SET, _VSVALUE, _apply_ops, _merge_ranges
from .store import MVCC_WINDOW_S, _clock, _version_at, sqlite_error

_RANGE_ASC = "SELECT key, value FROM kv WHERE key >= ? AND key < ? ORDER BY key ASC LIMIT ?"
_RANGE_DESC = "SELECT key, value FROM kv WHERE key >= ? AND key < ? ORDER BY key DESC LIMIT ?"
_NO_VERSION = b"\xff" * 10


# The byte limit of a range read's first batch on FDB, by streaming mode (None: none).
_FIRST_BATCH_BYTES = {StreamingMode.want_all: 80_000, StreamingMode.iterator: 4096, StreamingMode.exact: None,
                      StreamingMode.small: 256, StreamingMode.medium: 1000, StreamingMode.large: 4096,
                      StreamingMode.serial: 80_000}


class _Range:
    """As ``fdb.impl.FDBRange``: the first batch is read at call time; iteration reads
    the rest batch by batch and keeps no rows beyond the first batch (re-iterating reads
    again, at the same read version, as FDB's does). Read conflicts follow FDB's rule: a
    read that returned everything covers [begin, end); one stopped early (limit, or
    abandoned) covers up to the last row it read."""

    def __init__(self, tr, begin, end, limit, reverse, snapshot, mode=StreamingMode.iterator):
        self._tr = tr
        self._begin = begin
        self._end = end
        self._limit = limit
        self._reverse = reverse
        self._attempt = tr._attempt
        self._mode = mode
        self._ryw = tr._ryw(snapshot)
        # How far the read conflict reaches (None: a snapshot read): up from begin
        # (forward) or down from end (reverse), extended as rows are delivered.
        self._covered = None
        if not snapshot and begin < end:
            self._covered = begin if not reverse else end
        first = limit if 0 < limit < 1000 else 100
        if limit and mode in (StreamingMode.want_all, StreamingMode.exact):
            first = min(limit, 4096)   # the caller wants every row up to the limit: no slow start
        self._gen = self._batches(None, first, limit)
        self._done = False
        rows = self._first = []
        for batch in self._gen:
            if limit and len(rows) + len(batch) >= limit:
                rows.extend(batch[:limit - len(rows)])
                self._stopped()
                return
            rows.extend(batch)
            if len(rows) >= first:
                self._read_up_to(rows[-1].key)
                return
        self._exhausted()

    def _batches(self, after, first, wanted=0):
        """Lists of KeyValue in order, from after the key ``after`` (None: the start);
        ``wanted`` (0: all) bounds the rows read from the database for a limited read."""
        tr = self._tr
        b, e = self._begin, self._end
        if after is not None:
            if self._reverse:
                e = after
            else:
                b = after + b"\x00"
        if b >= e:
            return
        if not self._ryw or not (tr._writes or tr._clears) or tr._untouched(b, e):
            # Nothing of its own to merge (in this range): rows straight from each SQL
            # batch. A lease round writes to one shard, then reads the next one's ranges.
            yield from tr._db_batches(b, e, self._reverse, first, wanted)
            return
        rows = tr._merged_range(b, e, self._reverse)   # self._ryw: RYW is on
        n = first
        while True:
            chunk = list(islice(rows, n))
            if chunk:
                yield chunk
            if len(chunk) < n:
                return
            n = min(n * 4, 4096)

    def _read_up_to(self, key):
        c = self._covered
        if c is None or self._tr._attempt is not self._attempt:
            return
        if not self._reverse:
            end = key + b"\x00"
            if end > c:
                self._tr._add_read_conflict(c, end)
                self._covered = end
        elif key < c:
            self._tr._add_read_conflict(key, c)
            self._covered = key

    def _stopped(self):
        self._gen = None
        self._done = True
        if self._first:
            self._read_up_to(self._first[-1].key)

    def _exhausted(self):
        self._gen = None
        self._done = True  # the first batch was everything
        self._read_everything()

    def _read_everything(self):
        c = self._covered
        if c is None or self._tr._attempt is not self._attempt:
            return
        if not self._reverse:   # returned everything: the whole range
            self._tr._add_read_conflict(c, self._end)
            self._covered = self._end
        else:
            self._tr._add_read_conflict(self._begin, c)
            self._covered = self._begin

    def __iter__(self):
        first = self._first
        tr = self._tr
        if tr._state != "open" or tr._attempt is not self._attempt:
            # Committed, cancelled, reset...: FDB's range holds only its first batch,
            # which is byte-limited (often fewer rows than this one); any more is a
            # new read, which fails (2017 after commit).
            k = self._fdb_first_batch()
            yield from islice(first, k)
            if k < len(first) or not self._done:
                tr._check_use()
                raise EngineError(1025)
            return
        yield from first
        if self._done:
            return
        gen, self._gen = self._gen, None
        if gen is None:  # iterated before: read the rest again
            gen = self._batches(first[-1].key, 256, self._limit - len(first) if self._limit else 0)
        limit = self._limit
        count = len(first)
        while True:
            tr._check_use()
            if tr._attempt is not self._attempt:
                # reset() or on_error() since: FDB cancels the range's pending reads.
                raise EngineError(1025)
            batch = next(gen, None)
            if batch is None:
                self._read_everything()
                return
            if limit and count + len(batch) >= limit:
                batch = batch[:limit - count]
                self._read_up_to(batch[-1].key)
                yield from batch
                return
            count += len(batch)
            self._read_up_to(batch[-1].key)
            yield from batch

    def _fdb_first_batch(self) -> int:
        """How many of the first rows FDB's first batch holds: rows up to and including
        the one reaching its byte limit (fdb_c's get_range: 4,096 bytes for iterator
        mode, mode_bytes_array for the others; exact: the row limit alone)."""
        limit = _FIRST_BATCH_BYTES.get(self._mode, 4096)
        if limit is None:
            return len(self._first)
        total = 0
        for i, kv in enumerate(self._first):
            total += len(kv.key) + len(kv.value)
            if total >= limit:
                return i + 1
        return len(self._first)

    def to_list(self):
        return list(self)


class _ReadView:
    """Reads shared by Transaction and its snapshot view."""

    _snap = False

    def get(self, key) -> Value:
        tr = self._tr
        try:
            key = key_bytes(key)
            tr._check_read(key, self._snap)
            v = tr._get(key, self._snap)
        except EngineError as e:
            return Value(None, e)
        return Value(v)

    def get_key(self, selector) -> Key:
        tr = self._tr
        try:
            if not isinstance(selector, KeySelector) and not hasattr(selector, "or_equal"):
                raise TypeError("get_key takes a KeySelector")
            tr._check_use()
            if key_bytes(selector.key) > tr._max_key():
                raise EngineError(2004)     # as FDB's getKey; resolving off the end is clamped
            return Key(tr._resolve(selector, self._snap))
        except EngineError as e:
            return Key(None, e)

    def get_range(self, begin, end, limit=0, reverse=False, streaming_mode=StreamingMode.iterator):
        tr = self._tr
        tr._check_use()
        limit = int(limit or 0)
        if limit < 0:
            raise EngineError(2006, "limit must be >= 0")
        b = tr._range_bound(begin, b"", self._snap)
        e = tr._range_bound(end, tr._max_key(), self._snap)
        if tr._ryw(self._snap):
            tr._check_read_range(b, e)
        tr._read_any = True
        return _Range(tr, b, e, limit, bool(reverse), self._snap, streaming_mode)

    def get_range_startswith(self, prefix, *args, **kwargs):
        prefix = key_bytes(prefix)
        return self.get_range(prefix, strinc(prefix), *args, **kwargs)

    def get_read_version(self) -> Future:
        tr = self._tr
        try:
            tr._check_use()
            tr._ensure_snapshot()
            return Future.ready(tr._rv)
        except EngineError as e:
            return Future.ready(None, e)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self.get_range(key.start, key.stop, reverse=(key.step == -1))
        return self.get(key)

    def get_estimated_range_size_bytes(self, begin, end) -> Future:
        tr = self._tr
        tr._conn_for_metadata()
        b, e = key_bytes(begin), key_bytes(end)
        row = tr._query("SELECT count(*), coalesce(sum(length(key) + length(value)), 0) "
                        "FROM kv WHERE key >= ? AND key < ?", (b, e), one=True)
        return Future.ready(int(row[1]))

    def get_range_split_points(self, begin, end, chunk_size) -> Future:
        if begin is None or end is None:
            raise Exception("begin and end must be keys")
        chunk_size = int(chunk_size)
        if chunk_size <= 0:
            raise Exception("chunk_size must be positive")
        tr = self._tr
        b, e = key_bytes(begin), key_bytes(end)
        tr._conn_for_metadata()
        if b > tr._max_key() or e > tr._max_key():
            return Future.ready(None, EngineError(2004))     # as FDB's getRangeSplitPoints
        points = [b]
        # Average row size from a sample, then step by whole chunks of rows in C.
        sample = tr._query("SELECT avg(length(key) + length(value)) FROM "
                           "(SELECT key, value FROM kv WHERE key >= ? AND key < ? LIMIT 1000)",
                           (b, e), one=True)[0]
        if sample:
            step = max(1, int(chunk_size // max(sample, 1)))
            cur = b
            while True:
                row = tr._query("SELECT key FROM kv WHERE key > ? AND key < ? ORDER BY key "
                                "LIMIT 1 OFFSET ?", (cur, e, step - 1), one=True)
                if row is None:
                    break
                cur = row[0]
                points.append(cur)
        if points[-1] != e:
            points.append(e)
        return Future.ready(points)


class _Snapshot(_ReadView):
    """``tr.snapshot``: the same reads, recording no read conflicts."""

    _snap = True

    def __init__(self, tr):
        self._tr = tr

    @property
    def db(self):
        return self._tr.db

    @property
    def options(self):
        return self._tr.options


class _Reads:
    """The read path of :class:`~fdq.engine.sqlite.transaction.Transaction` (a part of
    that class: its state is set up there, in ``_reset_state``)."""

    # -- snapshot management -------------------------------------------------------

    def _release(self):
        conn = getattr(self, "_conn", None)
        if conn is not None:
            self._conn = None
            store = self.db._store
            if store is not None and not store.forked:
                store.release_reader(conn)

    def _ensure_snapshot(self):
        if self._conn is None:
            if self._rv is not None:
                # The snapshot was released (too old): FDB fails such reads.
                raise EngineError(1007)
            db = self.db
            if db._fault_p and db._fault(0.1):
                # A storage read failing as FDB's can (retryable, not committed): the
                # attempt's first read, so an attempt sees one at most.
                raise EngineError(db._rng.choice((1009, 1037)))
            store = db._get_store()
            try:
                conn = store.acquire_reader()
            except sqlite3.Error as e:
                raise sqlite_error(e, db._path) from e
            until = self._created + self._timeout_ms / 1000 if self._timeout_ms else None
            try:
                last, last_clock, now = store.begin_snapshot(conn, until)
            except BaseException as e:
                store.release_reader(conn)
                if isinstance(e, sqlite3.Error):
                    raise sqlite_error(e, db._path) from e
                raise
            self._conn = conn
            self._rv = _version_at(last, last_clock, now)
            self._rv_clock = now
        elif _clock() - self._rv_clock > MVCC_WINDOW_S or (
                self.db._fault_p and self.db._get_store().recovered_after(self._rv)):
            self._release()
            raise EngineError(1007)
        return self._conn

    def _conn_for_metadata(self):
        self._check_use()
        return self._ensure_snapshot()

    def _query(self, sql: str, args, one: bool = False):
        """Rows of ``sql`` in this attempt's snapshot (the first, or None, if ``one``);
        SQLite's failures (a damaged file, an I/O error) as engine errors naming the file."""
        conn = self._ensure_snapshot()
        try:
            cursor = conn.execute(sql, args)
            return cursor.fetchone() if one else cursor.fetchall()
        except sqlite3.Error as e:
            raise sqlite_error(e, self.db._path) from e

    # -- read checks ---------------------------------------------------------------

    def _ryw(self, snap) -> bool:
        """Whether a read sees this transaction's writes: RYW on and, for a snapshot
        read, snapshot RYW on. Otherwise it reads the database alone (FDB's RYW sends
        it to the native transaction), unreadable versionstamped keys included."""
        return not self._ryw_disabled and not (snap and self._snapshot_ryw < 0)

    def _check_read(self, key, snap=False):
        self._check_use()
        if key >= self._max_key() and key != b"\xff/metadataVersion":
            raise EngineError(2004)
        self._read_any = True
        if (self._vs_keys or self._vs_values) and not self._bypass_unreadable and self._ryw(snap):
            if key in self._vs_value_keys:
                raise EngineError(1036)
            self._unreadable_ranges()
            # By prefix: a transaction of n versionstamped keys and n point reads (a
            # push_many of msg_ids reads each id's dedupe entry) is not O(n^2); the
            # keys of versionstamped values are the set above (each its own prefix).
            for head, ranges in self._unreadable_by_head.items():
                if key.startswith(head):
                    for b, e in ranges:
                        if b <= key < e:
                            raise EngineError(1036)

    def _check_read_range(self, b, e):
        if (self._vs_keys or self._vs_values) and not self._bypass_unreadable:
            for ub, ue in self._unreadable_ranges():
                if ub < e and b < ue:
                    raise EngineError(1036)

    def _unreadable_ranges(self) -> list:
        """Every key a versionstamped key of this transaction could become (from the
        read version it had when set), unreadable until commit. Built when a read
        needs it (most transactions that set them never read afterwards)."""
        vs = self._vs_keys
        if self._unreadable_n < len(vs):
            by_head = self._unreadable_by_head
            for key, offset, _value, _clears, rv in islice(vs, self._unreadable_n, None):
                head, tail = key[:offset], key[offset + 10:-4]
                r = (head + (rv or 0).to_bytes(8, "big") + b"\x00\x00" + tail, head + _NO_VERSION + tail + b"\x00")
                self._unreadable.append(r)
                by_head.setdefault(head, []).append(r)
            self._unreadable_n = len(vs)
        return self._unreadable

    def _range_bound(self, k, default, snap):
        if k is None:
            return default
        if isinstance(k, KeySelector) or hasattr(k, "or_equal"):
            if key_bytes(k.key) > self._max_key():
                raise EngineError(2004)
            return self._resolve(k, snap)
        k = key_bytes(k)
        if k > self._max_key():
            raise EngineError(2004)
        return k

    # -- reads ---------------------------------------------------------------------

    def _db_get(self, key):
        # One snapshot per attempt, so a key read again (a topic's config, its clock,
        # once per shard a consumer visits) has the same value: no second query. As
        # FDB's RYW cache, such a read needs no storage read, so it does not fail
        # with transaction_too_old past the 5 s (the commit still does).
        try:
            return self._db_values[key]
        except KeyError:
            pass
        row = self._query("SELECT value FROM kv WHERE key = ?", (key,), one=True)
        v = self._db_values[key] = None if row is None else row[0]
        return v

    def _untouched(self, b, e) -> bool:
        """No write or clear of this transaction falls in [b, e): a range read there
        is the snapshot's rows as they are."""
        if self._writes:
            if self._sorted_keys is None:
                self._sorted_keys = sorted(self._writes)
            sk = self._sorted_keys
            i = bisect.bisect_left(sk, b)
            if i < len(sk) and sk[i] < e:
                return False
        if self._clears:
            i = bisect.bisect_left(self._clear_begins, e) - 1
            if i >= 0 and self._clears[i][1] > b:
                return False
        return True

    def _add_read_conflict(self, b, e):
        """Record [b, e) as read, less the keys this transaction already set or cleared:
        as FDB's RYW (updateConflictMap), only unmodified keys and keys with pending
        atomic ops (which depend on the stored value) add a read conflict. Reads and
        add_read_conflict_* alike; a write after the read does not take it back."""
        if b >= e:
            return
        ranges = self._read_ranges
        if len(e) == len(b) + 1 and e[-1] == 0 and e.startswith(b) and not self._ryw_disabled:
            # One key (add_read_conflict_key, per message in a lease or purge batch):
            # no sorting of the written keys, which change between such calls.
            entry = self._writes.get(b)
            if entry is not None:
                if entry[0] in (_SET, _CLEAR):
                    return
            elif self._clears and self._in_clears(b):
                return
            ranges.append([b, e])
            return
        if self._ryw_disabled or not (self._writes or self._clears) or self._untouched(b, e):
            pieces = ((b, e),)
        else:
            modified = []
            clears = self._clears
            if clears:
                i = max(0, bisect.bisect_right(self._clear_begins, b) - 1)
                while i < len(clears) and clears[i][0] < e:
                    cb, ce = clears[i]
                    if ce > b:
                        modified.append([max(cb, b), min(ce, e)])
                    i += 1
            if self._writes:
                if self._sorted_keys is None:
                    self._sorted_keys = sorted(self._writes)
                sk = self._sorted_keys
                writes = self._writes
                for k in sk[bisect.bisect_left(sk, b):bisect.bisect_left(sk, e)]:
                    if writes[k][0] in (_SET, _CLEAR):
                        modified.append([k, k + b"\x00"])
            pieces = []
            cur = b
            for mb, me in _merge_ranges(modified):
                if mb > cur:
                    pieces.append((cur, mb))
                cur = max(cur, me)
            if cur < e:
                pieces.append((cur, e))
        for pb, pe in pieces:
            last = ranges[-1] if ranges else None
            if last is not None and last[1] == pb:
                last[1] = pe     # a range read's next batch: one range, not one per batch
            elif last is not None and last[0] == pe:
                last[0] = pb
            else:
                ranges.append([pb, pe])

    def _in_clears(self, key):
        i = bisect.bisect_right(self._clear_begins, key) - 1
        if i >= 0 and key < self._clears[i][1]:
            return self._clears[i]
        return None

    def _entry_value(self, key, entry, db_value=...):
        kind, data = entry
        if kind == _SET:
            return data
        if kind == _CLEAR:
            return None
        if kind == _VSVALUE:
            if self._bypass_unreadable:
                return None
            raise EngineError(1036)
        if db_value is ...:
            db_value = self._db_get(key)
        return _apply_ops(db_value, data)

    def _get(self, key, snap):
        ryw = self._ryw(snap)
        entry = self._writes.get(key) if ryw else None
        if entry is not None:
            # As FDB's RYW: a key this transaction set or cleared adds no read
            # conflict; one with pending atomic ops (dependent on the stored value) does.
            if entry[0] == _ATOMIC_OPS and not snap:
                self._read_ranges.append([key, key + b"\x00"])
            return self._entry_value(key, entry)
        if ryw and self._clears and self._in_clears(key):
            return None     # cleared by this transaction: no read conflict either
        if not snap:
            self._read_ranges.append([key, key + b"\x00"])
        return self._db_get(key)

    def _db_batches(self, b, e, reverse, first, wanted=0):
        """Rows of the snapshot in [b, e) as lists of KeyValue, one list per SQL batch
        (only when the transaction has no writes or clears to merge). ``wanted`` (0:
        all): a limited read's rows still to return; no SQL batch reads beyond them."""
        batch = max(1, min(first, 4096))
        lo, hi = b, e
        q = _RANGE_DESC if reverse else _RANGE_ASC
        while lo < hi:
            n = min(batch, wanted) if wanted else batch
            rows = self._query(q, (lo, hi, n))
            if rows:
                yield list(starmap(KeyValue, rows))
            if len(rows) < n:
                return
            if wanted:
                wanted -= n
                if wanted <= 0:
                    return
            if reverse:
                hi = rows[-1][0]
            else:
                lo = rows[-1][0] + b"\x00"
            batch = min(batch * 4, 4096)

    def _db_iter(self, b, e, reverse, skip_clears):
        """Rows of the snapshot in [b, e), skipping this transaction's cleared ranges."""
        batch = 64
        lo, hi = b, e
        q = ("SELECT key, value FROM kv WHERE key >= ? AND key < ? ORDER BY key %s LIMIT ?"
             % ("DESC" if reverse else "ASC"))
        while lo < hi:
            # Every batch reads at the read version: 1007 once it is over 5 s old, as a
            # storage server answers an iteration that outlives the MVCC window.
            rows = self._query(q, (lo, hi, batch))
            for k, v in rows:
                if skip_clears and self._clears:
                    c = self._in_clears(k)
                    if c is not None:  # seek past the cleared range
                        if reverse:
                            hi = c[0]
                        else:
                            lo = c[1]
                        break
                yield k, v
            else:
                if len(rows) < batch:
                    return
                if reverse:
                    hi = rows[-1][0]
                else:
                    lo = rows[-1][0] + b"\x00"
                batch = min(batch * 4, 4096)
                continue

    def _merged_range(self, b, e, reverse, ryw=True):
        ryw = ryw and not self._ryw_disabled
        writes = self._writes if ryw else {}
        if writes:
            if self._sorted_keys is None:
                self._sorted_keys = sorted(writes)
            sk = self._sorted_keys
            i, j = bisect.bisect_left(sk, b), bisect.bisect_left(sk, e)
            wkeys = sk[i:j]
            if reverse:
                wkeys.reverse()
        else:
            wkeys = []
        dbit = self._db_iter(b, e, reverse, ryw and bool(self._clears))
        wi = 0
        nw = len(wkeys)
        for k, v in dbit:
            while wi < nw and (wkeys[wi] < k if not reverse else wkeys[wi] > k):
                wk = wkeys[wi]
                wi += 1
                wv = self._entry_value(wk, writes[wk])
                if wv is not None:
                    yield KeyValue(wk, wv)
            if wi < nw and wkeys[wi] == k:
                wi += 1
                wv = self._entry_value(k, writes[k], v)
                if wv is not None:
                    yield KeyValue(k, wv)
            else:
                yield KeyValue(k, v)
        while wi < nw:
            wk = wkeys[wi]
            wi += 1
            wv = self._entry_value(wk, writes[wk])
            if wv is not None:
                yield KeyValue(wk, wv)

    def _resolve(self, sel, snap) -> bytes:
        """Resolve a key selector (FDB's rule), adding the span it read as a conflict."""
        key = key_bytes(sel.key)
        offset = sel.offset
        top = self._max_key()
        ryw = self._ryw(snap)
        self._read_any = True
        if offset >= 1:
            start = key + b"\x00" if sel.or_equal else key
            start = min(start, top)
            rows = []
            if start < top:  # stop after `offset` rows, not at the end of the key space
                for kv in self._merged_range(start, top, False, ryw):
                    rows.append(kv)
                    if len(rows) >= offset:
                        break
            result = rows[offset - 1].key if len(rows) >= offset else top
            if not snap:
                self._add_read_conflict(min(key, result), max(start, result + b"\x00") if result != top else top)
        else:
            stop = key + b"\x00" if sel.or_equal else key
            stop = min(stop, top)
            n = 1 - offset
            rows = []
            for kv in self._merged_range(b"", stop, True, ryw):
                rows.append(kv)
                if len(rows) >= n:
                    break
            result = rows[n - 1].key if len(rows) >= n else b""
            if not snap:
                self._add_read_conflict(result, max(stop, result + b"\x00"))
        if (self._vs_keys or self._vs_values) and not self._bypass_unreadable and ryw:
            # As a range read: resolving across keys this transaction's versionstamped
            # writes may become is accessed_unreadable (FDB's RYW iterator).
            if offset >= 1:
                self._check_read_range(start, result + b"\x00" if result != top else top)
            else:
                self._check_read_range(result, stop)
        return result
