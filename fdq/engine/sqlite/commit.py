"""Committing in the embedded engine (``_Commit``, a part of ``Transaction``): the
conflict check against the commits after the read version, versionstamps, applying the
write map under SQLite's write lock and the version clock lock, fault injection, and the
end of an attempt: ``reset``, ``cancel``, ``on_error``/``prepare_retry``
(docs/fdb-semantics.md §3, §4, §7, §9).
"""
from __future__ import annotations

import fcntl
import random
import sqlite3
import threading
from itertools import chain

import msgpack

from ...errors import EngineError, is_retryable
from ..futures import Future, VersionstampFuture
from .mutations import _ATOMIC_OPS, _ATOMIC_UPSERT, _CLEAR, _SET, _add_upsert, _apply_ops, _merge_ranges, _overlaps
from .store import (CHECKPOINT_BYTES, CHECKPOINT_EVERY, MVCC_WINDOW_VERSIONS, RECOVERY_JUMP_VERSIONS, _LAST_VERSION,
                    _clock, _flock, _sleep, _version_at, sqlite_error)
from .watches import _managers_of

# States in which every use of a transaction fails with one error until reset().
_CLOSED_STATE_ERRORS = {"cancelled": 1025, "timed_out": 1031}

def _chunks(n: int):
    """``(start, size)`` pieces of n rows for multi-row statements: whole chunks of 64,
    then of 8, then one of the rest (1..7), so a connection caches at most 9 texts of a
    statement and a commit of n rows runs ~n/64 + 8 statements, not n."""
    i = 0
    for size in (64, 8):
        while n - i >= size:
            yield i, size
            i += size
    if i < n:
        yield i, n - i


def _write_rows(w, statements: dict, rows: list):
    """Write ``rows`` [(key, value)] in order with ``statements`` (rows per statement ->
    its text) in multi-row statements (``_chunks``): one statement of n rows costs less
    than n steps of one (``executemany``)."""
    if len(rows) == 1:
        w.execute(statements[1], rows[0])
        return
    for i, size in _chunks(len(rows)):
        w.execute(statements[size], list(chain.from_iterable(rows[i:i + size])))


_SIZES = (64, *range(1, 9))
# A later row of a key replaces an earlier one.
_UPSERT_ROWS = {n: "INSERT OR REPLACE INTO kv (key, value) VALUES " + ", ".join(["(?, ?)"] * n) for n in _SIZES}
# Keys are unique in a write map: no key twice in one statement.
_ADD_ROWS = {n: _add_upsert(n) for n in _SIZES}


# The future of every commit that succeeded: a ready future is immutable.
_COMMITTED = Future.ready(None)

_local = threading.local()


def _packb(obj) -> bytes:
    """``msgpack.packb(obj)`` with this thread's Packer (same bytes): ``packb`` builds a
    Packer and its 256 KiB buffer on every call, a cost on every commit."""
    pack = getattr(_local, "pack", None)
    if pack is None:
        pack = _local.pack = msgpack.Packer().pack
    return pack(obj)


def _pack_ranges(ranges) -> bytes:
    if len(ranges) > 1:
        ranges = _merge_ranges(ranges)
    flat = []
    for b, e in ranges:
        flat += (b, e)
    return _packb(flat)


class _Commit:
    """The commit and retry of :class:`~fdq.engine.sqlite.transaction.Transaction` (a part
    of that class: its state is set up there, in ``_reset_state``)."""

    def commit(self) -> Future:
        try:
            self._commit()
        except EngineError as e:
            return Future.ready(None, e)
        return _COMMITTED

    def _commit(self):
        if self._state != "open" or self._deferred is not None or self._timeout_ms:
            self._check_use()
        self._state = "committing"
        read_only = not self._writes and not self._clears and not self._vs_keys and not self._write_ranges
        if read_only:
            self._release()
            self._committed_version = -1
            self._end_versionstamp(None, EngineError(2021))
            for key, base, f in self._take_pending():
                self._register_watch(key, base, f)
            self._state = "committed"
            return
        try:
            size = self._approximate_size()
            if size > self._size_limit:
                raise EngineError(2101, f"Transaction exceeds byte limit ({self._size_limit:,} bytes; "
                                        f"this one is ~{size:,})")
            db = self.db
            faults = db._fault_p
            if faults and db._fault():
                # 1021 here: a commit_unknown_result that did not apply (the other
                # kind, after a real commit, is below): on FDB it may be either.
                raise EngineError(db._rng.choice((1020, 1020, 1007, 1037, 1021, 1021)))
            store = db._get_store()
            has_reads = bool(self._read_ranges)
            if has_reads and self._rv is None:
                self._ensure_snapshot()
            rv = self._rv
            if self._conn is not None:
                self._release()
            jump = faults and db._fault(0.05)
            until = self._created + self._timeout_ms / 1000 if self._timeout_ms else None
            lock = store.write_lock
            if until is None:
                lock.acquire()
            elif not lock.acquire(timeout=max(0.0, until - _clock())):
                raise EngineError(1031)
            try:
                store.begin_immediate(until)
                try:
                    if until is None:
                        fcntl.flock(store.writer_fd, fcntl.LOCK_EX)
                    else:
                        _flock(store.writer_fd, fcntl.LOCK_EX, until)
                except BaseException:
                    store.writer.execute("ROLLBACK")
                    raise
                try:
                    version = self._apply(store, rv, has_reads, jump)
                    store.writer.execute("COMMIT")
                    if jump:
                        store.note_recovery(version)
                except BaseException:
                    if store.writer.in_transaction:
                        store.writer.execute("ROLLBACK")
                    raise
                finally:
                    fcntl.flock(store.writer_fd, fcntl.LOCK_UN)
                store.commits_since_checkpoint += 1
                store.bytes_since_checkpoint += self._mutation_bytes
                if (store.commits_since_checkpoint >= CHECKPOINT_EVERY
                        or store.bytes_since_checkpoint >= CHECKPOINT_BYTES):
                    store.commits_since_checkpoint = store.bytes_since_checkpoint = 0
                    store.request_checkpoint()
            finally:
                lock.release()
        except EngineError as e:
            self._fail(e)
            raise
        except sqlite3.Error as e:
            err = sqlite_error(e, self.db._path)
            self._fail(err)
            raise err from e
        signalled = store.signal_commit()
        for mgr in _managers_of(store):
            mgr.notify_commit(self, version, signalled)
        if faults and db._fault():
            # After a real commit: the caller cannot know. As FDB, a failed commit
            # for this transaction's futures: no stamp (2020), the watches fail with
            # the error, no committed version. With a timeout set, it may as well be
            # that timeout (1031) firing while the commit was in flight, which FDB
            # reports the same way (and every later use then fails with 1031).
            timed_out = self._timeout_ms and db._chance(0.5)
            err = EngineError(1031 if timed_out else 1021)
            self._fail(err)
            if timed_out:
                self._state = "timed_out"
            raise err
        self._committed_version = version
        self._end_versionstamp(version.to_bytes(8, "big") + b"\x00\x00", None)
        self._state = "committed"
        watches = self._take_pending() if self._pending_watches else ()
        for key, base, f in watches:
            if not f.is_ready():
                self._register_watch(key, base, f)

    def _fail(self, err):
        self._state = "failed"
        self._release()
        self._end_versionstamp(None, EngineError(2020))
        if self._pending_watches:
            for key, base, f in self._take_pending():
                f._resolve(None, err)

    def _written_among(self, keys, version: int) -> tuple:
        """-> (the keys of ``keys``, a dict or set, this transaction wrote or cleared,
        committed at ``version``; complete). Its versionstamped keys count as stored; a
        key holding this commit's stamp where it wrote more stamped keys than ``keys``
        has is counted without looking closer (a watch may fire spuriously). Not
        complete: clear ranges against over 256 keys (a search each) were not looked at."""
        writes = self._writes
        if len(writes) < len(keys):
            found = [k for k in writes if k in keys]
        else:
            found = [k for k in keys if k in writes]
        complete = True
        if self._clears:
            if len(keys) > 256:
                complete = False
            else:
                found += [k for k in keys if k not in writes and self._in_clears(k)]
        vs = self._vs_keys
        if vs:
            stamp = version.to_bytes(8, "big") + b"\x00\x00"
            if len(vs) <= len(keys):
                stored = [key[:offset] + stamp + key[offset + 10:-4] for key, offset, *_ in vs]
                found += [k for k in stored if k in keys and k not in found]
            else:
                found += [k for k in keys if stamp in k and k not in found]
        return found, complete

    def _register_watch(self, key, baseline, f):
        if f.is_ready():
            return
        # The baseline was read at the read version, even in a writing transaction: a
        # write meanwhile without a write conflict range (a push's add to ``routed``)
        # did not conflict with the watch's read, so the commit version does not cover it.
        self.db._watch_manager().register(key, baseline, f, self._rv)

    def _apply(self, store, rv, has_reads, jump) -> int:
        w = store.writer
        now = _clock()
        bump = RECOVERY_JUMP_VERSIONS if jump else 0
        last, last_clock = w.execute(_LAST_VERSION).fetchone()
        version = max(last + 1, _version_at(last, last_clock, now) + 1) + bump
        stamp = version.to_bytes(8, "big") + b"\x00\x00"
        write_ranges = self._write_ranges
        vs_sets = []
        if self._vs_keys:
            # Conflict ranges: one per key prefix, from its lowest stamped key to its
            # highest. Every key between them starts with that prefix and this commit's
            # unique stamp, so the range adds no conflict with another transaction's
            # writes (only keys no one else can have written), and the txlog row that
            # every later conflict check reads stays small.
            spans = {}
            clear_log = self._clear_log
            n_log = len(clear_log)
            append = vs_sets.append
            for key, offset, value, n_clears, _rv in self._vs_keys:
                head = key[:offset]
                tail = key[offset + 10:-4]
                # Within one prefix, keys order as their tails (the stamp is the same).
                span = spans.get(head)
                if span is None:
                    spans[head] = [tail, tail]
                elif tail < span[0]:
                    span[0] = tail
                elif tail > span[1]:
                    span[1] = tail
                k = head + stamp + tail
                # FDB applies mutations in order: a clear issued after it removes it.
                if n_clears == n_log or not any(b <= k < e for b, e in clear_log[n_clears:]):
                    append((k, value))
            write_ranges = write_ranges + [(head + stamp + lo, head + stamp + hi + b"\x00")
                                           for head, (lo, hi) in spans.items()]
        w.execute("INSERT INTO txlog VALUES (?, ?, ?)", (version, now, _pack_ranges(write_ranges)))
        if has_reads:
            if rv < version - MVCC_WINDOW_VERSIONS:
                raise EngineError(1007)
            if last > rv:   # else no commit since the read version: nothing to check
                self._check_conflicts(w, rv, version)
        for b, e in self._clears:
            w.execute("DELETE FROM kv WHERE key >= ? AND key < ?", (b, e))
        sets, dels, atomics, adds = [], [], [], []
        may_clear = []
        for key, (kind, data) in self._writes.items():
            if kind == _SET:
                sets.append((key, data))
            elif kind == _CLEAR:
                dels.append((key,))
            elif kind == _ATOMIC_OPS:
                if len(data) == 1 and data[0][0] == "add":
                    adds.append((key, data[0][1]))
                    continue
                atomics.append((key, _packb(data)))
                if any(op == "compare_and_clear" for op, _ in data):
                    may_clear.append((key,))
            else:  # versionstamped value, then any atomic ops on it
                body, off, ops = data
                v = body[:off] + stamp + body[off + 10:]
                if ops:
                    v = _apply_ops(v, ops)
                if v is None:
                    dels.append((key,))
                else:
                    sets.append((key, v))
        sets.extend(vs_sets)
        if dels:
            w.executemany("DELETE FROM kv WHERE key = ?", dels)
        if sets:
            _write_rows(w, _UPSERT_ROWS, sets)
        if adds:
            _write_rows(w, _ADD_ROWS, adds)
        if atomics:
            w.executemany(_ATOMIC_UPSERT, atomics)
            if may_clear:
                w.executemany("DELETE FROM kv WHERE key = ? AND typeof(value) = 'integer'", may_clear)
        store.commits_since_prune += 1
        if store.commits_since_prune >= 256:
            store.commits_since_prune = 0
            w.execute("DELETE FROM txlog WHERE version < ?", (version - MVCC_WINDOW_VERSIONS - 1,))
        return version

    def _check_conflicts(self, w, rv, version):
        rows = w.execute("SELECT ranges FROM txlog WHERE version > ? AND version < ?",
                         (rv, version)).fetchall()
        if not rows:
            return
        merged = _merge_ranges(self._read_ranges)
        begins = [r[0] for r in merged]
        ends = [r[1] for r in merged]
        for (blob,) in rows:
            flat = msgpack.unpackb(blob)
            for i in range(0, len(flat), 2):
                if _overlaps(begins, ends, flat[i], flat[i + 1]):
                    raise EngineError(1020)

    # -- lifecycle -----------------------------------------------------------------

    def get_committed_version(self) -> int:
        # As FDB (NativeAPI's committedVersion starts at invalidVersion): -1 until a
        # successful commit, and after a failed or read-only one; never an error.
        return -1 if self._committed_version is None else self._committed_version

    def get_versionstamp(self) -> VersionstampFuture:
        if self._state != "open":
            # As FDB: ask before commit(); afterwards it is used_during_commit until reset().
            f = VersionstampFuture()
            f._resolve(None, EngineError(_CLOSED_STATE_ERRORS.get(self._state, 2017)))
            return f
        if self._vs_future is None:
            self._vs_future = VersionstampFuture()
            if self._vs_result is not None:
                self._vs_future._resolve(*self._vs_result)
        return self._vs_future

    def _end_versionstamp(self, stamp, error):
        self._vs_result = (stamp, error)
        if self._vs_future is not None:
            self._vs_future._resolve(stamp, error)

    def _abandon(self, code):
        """As FDB's RYW reset (and its timeout): the watches and the versionstamp
        future this attempt left pending fail with ``code`` (1025 reset, retry or
        cancel; 1031 timeout), so no one waits on them forever. A versionstamp the
        attempt's commit already settled stays as it is."""
        watches = self._take_pending() if self._pending_watches else ()
        if watches:
            err = EngineError(code)
            for _k, _b, f in watches:
                f._resolve(None, err)
        if self._vs_result is None and self._vs_future is not None:
            self._end_versionstamp(None, EngineError(code))

    def reset(self):
        self._abandon(1025)
        self._reset_state()
        self._reset_options()

    def cancel(self):
        self._abandon(1025)
        self._release()
        self._state = "cancelled"

    def on_error(self, error) -> Future:
        """As FDB: back off and reset for a retryable error, else re-raise it."""
        f, delay = self.prepare_retry(error)
        if delay > 0:
            _sleep(delay)
        return f

    def prepare_retry(self, error) -> tuple:
        """``on_error`` without its wait: ``(future, delay_s)``. A retryable error resets
        the transaction at once and the future is ready after ``delay_s`` of backoff, which
        the caller waits out (``on_error`` sleeps; a client with an event loop, such as
        the ``libfdb_c`` stand-in of the tests, sets a timer)."""
        if isinstance(error, EngineError):
            code, err = error.code, error
        elif isinstance(error, int):
            code, err = error, EngineError(error)
        else:
            raise error  # as FDB's binding: anything but its error type or a code is re-raised
        if self._state in _CLOSED_STATE_ERRORS:
            return Future.ready(None, EngineError(_CLOSED_STATE_ERRORS[self._state])), 0.0
        if self._timeout_ms and (_clock() - self._created) * 1000 > self._timeout_ms:
            self._abandon(1031)
            self.cancel()
            self._state = "timed_out"
            return Future.ready(None, EngineError(1031)), 0.0
        if not is_retryable(err) or (0 <= self._retry_limit <= self._retries):
            self.cancel()
            return Future.ready(None, err), 0.0
        max_delay = self._max_retry_delay_ms / 1000.0
        if code in (1007, 1009):
            delay = min(0.01, max_delay)
        else:
            delay = min(self._backoff, max_delay) * random.random()
            self._backoff = min(self._backoff * 2, max_delay)
        keep = (self._timeout_ms, self._retry_limit, self._max_retry_delay_ms, self._created,
                self._retries + 1, self._backoff)
        self._abandon(1025)
        self._reset_state()
        (self._timeout_ms, self._retry_limit, self._max_retry_delay_ms, self._created,
         self._retries, self._backoff) = keep
        return Future.ready(None), delay
