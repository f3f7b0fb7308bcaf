"""The embedded engine: FoundationDB's Python API on one SQLite file.

A stand-in for the subset of the ``fdb`` binding FDQ uses, with FDB's semantics, so code
that passes here does not break on a cluster (see ``shared/fdb-semantics.md``):

* keys are bytes in memcmp order (``kv``: ``BLOB PRIMARY KEY ... WITHOUT ROWID``);
* a transaction reads at a read version from a SQLite read snapshot it holds until it
  commits, resets or is dropped (at most 5 s, then ``transaction_too_old``); writes are
  buffered (read-your-writes) and applied at commit under SQLite's write lock;
* optimistic concurrency as FDB's resolver: non-snapshot reads record read conflict
  ranges, writes record write conflict ranges, and ``txlog`` keeps every commit's write
  ranges for 5 s of versions; a commit fails with ``not_committed`` (1020) if a commit
  after its read version wrote into one of its read ranges;
* versions advance ~1,000,000 per second of the machine's monotonic clock, strictly
  increase per commit and start at an arbitrary value; versionstamps are FDB's 10 bytes;
* FDB's limits (key, value, transaction size, watches), deferred as FDB defers them;
* watches fire after a commit changes the key, in any process on the machine;
* fault injection: retryable errors before commit, ``commit_unknown_result`` both after a
  real commit and instead of one (with a timeout set, ``transaction_timed_out`` after a
  real commit too), version jumps of 100,000,000 as an FDB recovery.
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import functools
import os
import random
import select
import sqlite3
import struct
import sys
import threading
import time
import weakref
from itertools import chain, islice, starmap

import msgpack

from ..errors import EngineError, is_retryable
from .futures import Future, Key, Value, VersionstampFuture
from .types import (DEFAULT_MAX_WATCHES, KEY_SIZE_LIMIT, SYSTEM_KEY_SIZE_LIMIT, TRANSACTION_SIZE_LIMIT,
                    VALUE_SIZE_LIMIT, KeySelector, KeyValue, StreamingMode, key_bytes, strinc, value_bytes)

# The engine's own clock: captured at import, so a process that skews ``time.time`` or
# patches ``time.monotonic`` (clock-skew tests) does not move database versions.
# CLOCK_MONOTONIC is one clock for every process of the machine.
_clock = time.monotonic
_sleep = time.sleep

VERSIONS_PER_SECOND = 1_000_000
MVCC_WINDOW_VERSIONS = 5_000_000
MVCC_WINDOW_S = 5.0
RECOVERY_JUMP_VERSIONS = 100_000_000

ENTRY_OVERHEAD_BYTES = 24  # FDB adds a few dozen bytes of struct overhead per entry

WATCH_POLL_S = 0.001  # cross-process watch latency without commit signals: about this, plus scheduling
WATCH_FALLBACK_POLL_S = 0.05  # with commit signals (inotify), the poll that remains: a safety net
CHECKPOINT_EVERY = 128  # commits of this process between WAL checkpoints (SQLite's own: 1,000 pages)
WAL_RESTART_FRAMES = 16384  # past this many WAL frames (~64 MB), force the WAL to restart
CHECKPOINT_BYTES = 4_000_000  # ... or after this many bytes of mutations (SQLite's 1,000 pages)
WATCH_LINGER_S = 2.0  # the poll thread outlives its last watch this long (re-arming is common)
LOCK_WAIT_S = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key BLOB PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS txlog (version INTEGER PRIMARY KEY, clock REAL NOT NULL,
                                  ranges BLOB NOT NULL);
"""

_SYNC_MODES = {"OFF", "NORMAL", "FULL", "EXTRA"}
_leaked_after_fork = []  # connections inherited over fork(): never touched, never closed
_stores = weakref.WeakSet()     # every _Store of this process (``_close_inherited_locks``)


def _close_inherited_locks():
    """In a forked child: close the parent's version clock lock descriptors. A flock
    lock belongs to the open file, which the child's copies keep open: had the parent
    been killed while holding it (mid-commit), it stayed held for as long as the child
    lived, and every process of the database waited on it. Closing (never unlocking:
    that would release the parent's lock) drops the child's share. No lock is taken:
    another thread of the parent may have held one at the fork."""
    for store in list(_stores):
        fds = [store.writer_fd] + list(store.fd_pool)
        store.writer_fd = -1
        store.fd_pool = []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


# ---------------------------------------------------------------------------------
# Atomic operations (Atomic.h), on bytes: existing value (None = absent) and param.


def _le_int(b: bytes, n: int) -> int:
    return int.from_bytes(b[:n].ljust(n, b"\x00"), "little")


def _op_add(old, p):
    if not old:
        return p
    n = len(p)
    return ((_le_int(old, n) + int.from_bytes(p, "little")) % (1 << (8 * n))).to_bytes(n, "little") if n else b""


def _bitwise(fn, empty_as_zero=False):
    def op(old, p):
        if old is None or (not old and not empty_as_zero):
            return p
        n = len(p)
        a = old[:n].ljust(n, b"\x00")
        return bytes(fn(x, y) for x, y in zip(a, p))
    return op


def _op_max(old, p):
    if not old:
        return p
    n = len(p)
    a = old[:n].ljust(n, b"\x00")
    return a if int.from_bytes(a, "little") > int.from_bytes(p, "little") else p


def _op_min(old, p):
    if old is None:
        return p
    n = len(p)
    a = old[:n].ljust(n, b"\x00")
    return a if int.from_bytes(a, "little") < int.from_bytes(p, "little") else p


def _op_byte_max(old, p):
    return p if old is None else max(old, p)


def _op_byte_min(old, p):
    return p if old is None else min(old, p)


def _op_append(old, p):
    if not old:
        return p
    return old + p if len(old) + len(p) <= VALUE_SIZE_LIMIT else old


def _op_compare_and_clear(old, p):
    return None if old is None or old == p else old


_ATOMIC = {
    "add": _op_add,
    "bit_and": _bitwise(lambda x, y: x & y, empty_as_zero=True),
    "bit_or": _bitwise(lambda x, y: x | y),
    "bit_xor": _bitwise(lambda x, y: x ^ y),
    "max": _op_max,
    "min": _op_min,
    "byte_max": _op_byte_max,
    "byte_min": _op_byte_min,
    "append_if_fits": _op_append,
    "compare_and_clear": _op_compare_and_clear,
}


def _sql_atomic(base, packed_ops):
    """SQL function: apply a transaction's atomic ops to the stored value at commit
    (one upsert statement for every atomic key). A cleared result is the INTEGER 0, which
    no stored value can be (values are BLOBs), and is deleted right after."""
    r = _apply_ops(base, msgpack.unpackb(packed_ops))
    return 0 if r is None else r


_ATOMIC_UPSERT = ("INSERT INTO kv (key, value) VALUES (?1, fdq_atomic(NULL, ?2)) "
                  "ON CONFLICT(key) DO UPDATE SET value = fdq_atomic(value, ?2)")


# A key's only atomic op is an add (counters: the common case): no ops to pack, and
# an absent key takes the operand as it is (_op_add(None, p) is p).
_ADD_UPSERT = ("INSERT INTO kv (key, value) VALUES (?1, ?2) "
               "ON CONFLICT(key) DO UPDATE SET value = fdq_add(value, ?2)")


def _apply_ops(base, ops):
    for name, param in ops:
        base = _ATOMIC[name](base, param)
    return base


# ---------------------------------------------------------------------------------
# Range sets: sorted, non-overlapping [begin, end) lists.


def _merge_ranges(ranges):
    out = []
    for b, e in sorted(ranges):
        if out and b <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([b, e])
    return out


def _overlaps(merged_begins, merged_ends, b, e) -> bool:
    j = bisect.bisect_right(merged_ends, b)
    return j < len(merged_begins) and merged_begins[j] < e


# ---------------------------------------------------------------------------------
# Per-process store: the SQLite connections of one Database.


class _Store:
    def __init__(self, path: str, synchronous: str):
        self.path = path
        self.synchronous = synchronous
        self.pid = os.getpid()
        self.write_lock = threading.Lock()
        self.pool_lock = threading.Lock()
        self.pool = []
        # Opened with the normal busy timeout (opening can meet a transient lock when many
        # processes start at once), then 0: begin_immediate does its own waiting.
        self.writer = self._open()
        self.writer.execute("PRAGMA busy_timeout=0")
        # No checkpoint inside COMMIT: SQLite's automatic one runs in the COMMIT that
        # crosses its threshold, with the version clock lock held, so every reader and
        # writer of every process waited for its fsyncs (10-15 ms, more under load:
        # the p99 of a push and of end-to-end latency). Transaction._commit asks for a
        # PASSIVE checkpoint every CHECKPOINT_EVERY commits, run by request_checkpoint's
        # thread, off every transaction's path.
        self.writer.execute("PRAGMA wal_autocheckpoint=0")
        self.commits_since_checkpoint = 0
        self.bytes_since_checkpoint = 0
        self.ckpt_cond = threading.Condition()
        self.ckpt_due = False
        self.ckpt_thread = None
        self.commits_since_prune = 0
        # The version clock lock (flock on a side file, so it also orders threads of
        # one process): a writer holds it exclusively from reading the clock for its
        # commit version until COMMIT; a reader holds it shared while it reads the clock
        # for its read version and opens its snapshot. So a commit that a snapshot does
        # not see always gets a version above that snapshot's read version.
        self.clock_path = _side_file(path, "-fdqclock")
        self.writer_fd = os.open(self.clock_path, os.O_RDWR | os.O_CREAT, 0o644)
        self.fd_pool = []
        self.watchers_fd = None     # the probe's descriptor (``others_watch``); never closed
        self.local_key = _local_key(path)   # this process's watch managers of the file
        _stores.add(self)

    def _open(self, timeout: float = LOCK_WAIT_S) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=timeout)
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        conn.create_function("fdq_atomic", 2, _sql_atomic, deterministic=True)
        conn.create_function("fdq_add", 2, _op_add, deterministic=True)
        return conn

    def acquire_reader(self) -> sqlite3.Connection:
        with self.pool_lock:
            if self.pool:
                return self.pool.pop()
        return self._open()

    def release_reader(self, conn: sqlite3.Connection):
        try:
            conn.execute("COMMIT")
        except sqlite3.Error:
            conn.close()
            return
        with self.pool_lock:
            if len(self.pool) < 16:
                self.pool.append(conn)
                return
        conn.close()

    def begin_snapshot(self, conn: sqlite3.Connection, until: float | None = None):
        """Open a read snapshot on ``conn``; -> (last commit version, its clock, now).
        ``until``: the transaction's timeout (``_flock``)."""
        with self.pool_lock:
            fd = self.fd_pool.pop() if self.fd_pool else None
        if fd is None:
            fd = os.open(self.clock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _flock(fd, fcntl.LOCK_SH, until)
            try:
                now = _clock()
                conn.execute("BEGIN")
                version, clock = conn.execute(_LAST_VERSION).fetchone()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            with self.pool_lock:
                self.fd_pool.append(fd)
        return version, clock, now

    # Fault injection's recoveries (version jumps): the last one's version, 8 bytes at
    # this offset of the clock file, written under the version clock lock. A read at
    # a read version below it fails with 1007, as storage has moved past it on FDB.
    # Read by Databases with fault injection only (the check costs a syscall per read).
    _RECOVERY_AT = 8

    def note_recovery(self, version: int):
        try:
            os.pwrite(self.writer_fd, version.to_bytes(8, "big"), self._RECOVERY_AT)
        except OSError:
            pass

    def recovered_after(self, read_version: int) -> bool:
        try:
            got = os.pread(self.writer_fd, 8, self._RECOVERY_AT)
        except OSError:
            return False
        return len(got) == 8 and int.from_bytes(got, "big") > read_version

    def signal_commit(self) -> bool:
        """Tell watchers in other processes that a commit is visible: one byte written
        to the clock file after COMMIT, which inotify reports to them (``_CommitSignal``);
        -> whether it was written. Not when no other process sleeps on the signal
        (``others_watch``): the watch threads of this process hear of the commit from
        ``_WatchManager.notify_commit`` instead, without a wake when it changes none of
        their keys (a consumer's own lease and settle commits woke its watch thread for a
        check each). A failure only costs latency: watchers also poll."""
        if not self.others_watch():
            return False
        try:
            os.pwrite(self.writer_fd, b"\0", 0)
        except OSError:
            return False
        return True

    def others_watch(self) -> bool:
        """Whether another process holds its watcher lock (``_hold_watcher_lock``): a
        POSIX record lock, which F_GETLK reports only when another process holds it.
        True when that cannot be told."""
        if _FLOCK is None:
            return True
        try:
            if self.watchers_fd is None:
                self.watchers_fd = os.open(_side_file(self.path, _WATCHERS_SUFFIX), os.O_RDWR | os.O_CREAT | _IN_CLOEXEC,
                                           0o644)
            got = fcntl.fcntl(self.watchers_fd, fcntl.F_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
            return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK
        except (OSError, struct.error):
            return True

    def request_checkpoint(self):
        """Run a PASSIVE checkpoint soon, in this store's checkpoint thread. Not in the
        committing thread: a checkpoint copies WAL pages and fsyncs the database file,
        7-45 ms on this VM, which made it the p99 of a push and of end-to-end latency
        when it ran inside the commit of whichever transaction crossed the threshold
        (bench/RESULTS.md, Queue: "Wake"). The thread runs on its own connection without
        the version clock lock or ``write_lock``: readers and writers of every process
        go on meanwhile (the GIL is released inside SQLite)."""
        with self.ckpt_cond:
            self.ckpt_due = True
            if self.ckpt_thread is None:
                self.ckpt_thread = threading.Thread(target=self._checkpoint_loop, name="fdq-checkpoint",
                                                    daemon=True)
                self.ckpt_thread.start()
            self.ckpt_cond.notify()

    def _checkpoint_loop(self):
        conn = None
        try:
            conn = self._open()
            conn.execute("PRAGMA busy_timeout=0")
            while True:
                with self.ckpt_cond:
                    if not self.ckpt_due:
                        self.ckpt_cond.wait(WATCH_LINGER_S)
                    if not self.ckpt_due:   # idle: exit (a Database is never closed)
                        self.ckpt_thread = None
                        return
                    self.ckpt_due = False
                try:
                    _busy, frames, _done = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    if frames >= WAL_RESTART_FRAMES:
                        self.restart_wal(conn)
                except sqlite3.Error:
                    pass    # busy: the next one catches up
        except BaseException:
            with self.ckpt_cond:
                self.ckpt_thread = None
            raise
        finally:
            if conn is not None:
                conn.close()

    def restart_wal(self, conn: sqlite3.Connection):
        """Checkpoint starvation guard. A PASSIVE checkpoint cannot restart the WAL while
        readers keep opening snapshots on its frames, so under steady reads it grows
        without bound. Past WAL_RESTART_FRAMES (the checkpoint thread, right after a
        PASSIVE one: little is left to copy): hold the version clock lock (no snapshot
        opens or commits meanwhile, in any process) and RESTART without waiting: if a
        reader is still in flight it fails at once and the next checkpoint tries again.
        Everyone pauses for this one (5-15 ms here), so it is rare: ~64 MB of WAL.
        RESTART, not TRUNCATE: truncating the file (and growing it again, commit by
        commit) cost 30-75 ms under the lock; the file is reused from its start.

        The lock is taken on a descriptor of its own: flock locks belong to an open file
        description, so on ``writer_fd`` a commit of another thread of this process would
        take it "again" at once, and the unlock here would release it in the middle of
        that commit (a snapshot opened then could miss a commit below its read version)."""
        fd = os.open(self.clock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchall()
            finally:
                # Unlocked, not only closed: a child forked meanwhile shares the open
                # file, and closing would leave the lock held while it lives.
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def begin_immediate(self, until: float | None = None):
        """Take SQLite's write lock. Spins with short sleeps (SQLite's own busy
        handler sleeps 1 ms, 2 ms, 5 ms, ... which caps a 2-process write rate).
        ``until``: the transaction's timeout (``_clock()`` time): waiting past it is
        ``transaction_timed_out``, as FDB's timeout bounds a commit."""
        deadline = None
        delay = 0.00005
        if until is not None and _clock() > until:
            raise EngineError(1031)
        while True:
            try:
                self.writer.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) and "busy" not in str(e):
                    raise
            now = _clock()
            if until is not None and now > until:
                raise EngineError(1031)
            if deadline is None:
                deadline = now + LOCK_WAIT_S
            elif now > deadline:
                raise EngineError(1038, "database is locked by another process for over "
                                        f"{LOCK_WAIT_S:.0f} s")
            _sleep(delay)
            delay = min(delay * 2, 0.002)


def _flock(fd: int, mode: int, until: float | None):
    """Take the version clock lock. ``until`` (``_clock()`` time, a transaction's
    timeout): waiting past it is ``transaction_timed_out`` (1031), as FDB's timeout
    bounds every wait, so a process stopped while it holds the lock (SIGSTOP, a frozen
    container) does not hang transactions that set one. Without a timeout, a plain
    blocking wait (as FDB without one waits for an unavailable cluster)."""
    if until is None:
        fcntl.flock(fd, mode)
        return
    delay = 0.00005
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if _clock() > until:
            raise EngineError(1031)
        _sleep(delay)
        delay = min(delay * 2, 0.002)


_U32 = struct.Struct("<I")
_METADATA_VERSION_KEY = b"\xff/metadataVersion"
_METADATA_VERSION_VALUE = b"\x00" * 14    # the only value it takes: a placeholder at offset 0
_NO_VERSION = b"\xff" * 10

def _upsert(w, rows: list):
    """Write ``rows`` [(key, value)] in order (a later row of a key replaces an earlier
    one), in multi-row statements where they fill one."""
    i, n = 0, len(rows)
    for size in _UPSERT_SIZES:
        if n - i >= size:
            sql = _UPSERT_ROWS[size]
            while n - i >= size:
                w.execute(sql, list(chain.from_iterable(rows[i:i + size])))
                i += size
    if i < n:
        w.executemany(_UPSERT, rows[i:] if i else rows)


_LAST_VERSION = "SELECT version, clock FROM txlog ORDER BY version DESC LIMIT 1"
_WATCH_CHECK = "SELECT (SELECT max(version) FROM txlog),"
_WATCH_VALUE = "(SELECT value FROM kv WHERE key = ?)"
_UPSERT = "INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)"
# Rows per multi-row upsert (_upsert): one statement of n rows costs less than n runs of
# _UPSERT; two sizes keep the connection's statement cache small.
_UPSERT_SIZES = (64, 8)
_UPSERT_ROWS = {n: "INSERT OR REPLACE INTO kv (key, value) VALUES " + ", ".join(["(?, ?)"] * n)
                for n in _UPSERT_SIZES}
_RANGE_ASC = "SELECT key, value FROM kv WHERE key >= ? AND key < ? ORDER BY key ASC LIMIT ?"
_RANGE_DESC = "SELECT key, value FROM kv WHERE key >= ? AND key < ? ORDER BY key DESC LIMIT ?"


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


def _version_at(last: int, last_clock: float, now: float) -> int:
    elapsed = now - last_clock
    return last + int(elapsed * VERSIONS_PER_SECOND) if elapsed > 0 else last


# ---------------------------------------------------------------------------------
# Watches


_IN_MODIFY = 0x00000002
_IN_IGNORED = 0x00008000
_INOTIFY_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = getattr(os, "O_CLOEXEC", 0o2000000)
_libc = None


# Which processes sleep on the commit signal: each holds a POSIX read lock on
# "<database>-fdqwatch" while a watch thread of it does (``_hold_watcher_lock``), so a
# commit signals only when another process watches (``_Store.others_watch``). POSIX
# record locks belong to the process and all of its locks on a file go when it closes
# any descriptor of that file: one descriptor per process and file, counted, and the
# probe's own descriptor is never closed. A process killed loses its lock with it.
_WATCHERS_SUFFIX = "-fdqwatch"
# struct flock as Linux lays it out on 64-bit (short, short, off_t, off_t, pid_t): the
# F_GETLK probe; elsewhere commits always signal.
_FLOCK = struct.Struct("hhqqi4x") if sys.platform.startswith("linux") and struct.calcsize("P") == 8 else None
_registry_lock = threading.Lock()
_held = {}          # _local_key -> [descriptor, holders]
_local_managers = {}    # _local_key -> WeakSet of this process's _WatchManager


def _side_file(path: str, suffix: str) -> str:
    """The engine's file ``suffix`` beside the database: named after its real path, as
    SQLite names its WAL (it follows a symlink to the file), so processes that open the
    database by different names share the version clock lock and the watch signals."""
    return os.path.realpath(path) + suffix


def _local_key(path: str):
    return os.getpid(), os.path.realpath(path)


def _hold_watcher_lock(path: str) -> bool:
    key = _local_key(path)
    with _registry_lock:
        held = _held.get(key)
        if held is None:
            try:
                fd = os.open(_side_file(path, _WATCHERS_SUFFIX), os.O_RDWR | os.O_CREAT | _IN_CLOEXEC, 0o644)
            except OSError:
                return False
            try:
                fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            held = _held[key] = [fd, 0]
        held[1] += 1
        return True


def _release_watcher_lock(path: str):
    key = _local_key(path)
    with _registry_lock:
        held = _held.get(key)
        if held is not None:
            held[1] -= 1
            if not held[1]:
                del _held[key]
                os.close(held[0])


def _managers_of(store) -> list:
    with _registry_lock:
        managers = _local_managers.get(store.local_key)
        return list(managers) if managers else []


class _CommitSignal:
    """inotify (Linux; ctypes, the stdlib has none) on the database's clock file, to
    which every commit of this engine writes a byte once it is visible
    (``_Store.signal_commit``): a watch thread sleeps until a commit happened in any
    process instead of polling ``data_version`` every millisecond. ``open`` returns None
    where inotify is unavailable (another OS, no ``libc``, out of inotify instances or
    watches): the caller polls as before."""

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def open(cls, path: str):
        global _libc
        if os.environ.get("FDQ_ENGINE_NO_INOTIFY"):    # tests: force the fallback poll
            return None
        try:
            if _libc is None:
                _libc = ctypes.CDLL(None, use_errno=True)
                _libc.inotify_init1.argtypes = [ctypes.c_int]
                _libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
            fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        except (OSError, AttributeError):
            return None
        if fd < 0:
            return None
        if _libc.inotify_add_watch(fd, os.fsencode(path), _IN_MODIFY) < 0:
            os.close(fd)
            return None
        return cls(fd)

    def drain(self) -> bool:
        """Read the pending events; False if the watch is gone (the file was deleted
        or moved: the caller falls back to polling)."""
        # One read takes every event queued (16 bytes each); one that comes after it
        # is a commit after it, which the next poll() reports: no second read (a
        # syscall and an exception per wake) to find the queue empty.
        ok = True
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return ok
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                return False
            i = 0
            while i + 16 <= len(data):
                _wd, mask, _cookie, n = _INOTIFY_EVENT.unpack_from(data, i)
                if mask & _IN_IGNORED:
                    ok = False
                i += 16 + n
            return ok

    def close(self):
        os.close(self.fd)


class _WatchManager:
    """Watches registered after commit; one thread per Database and process re-reads
    the watched keys when ``PRAGMA data_version`` (changes on any other connection's
    commit) moved. It sleeps until a commit signal (``_CommitSignal``: any process's
    commit; commits of this process also kick it directly) or, as a safety net, the
    fallback poll; without inotify it polls every WATCH_POLL_S as before. A watch fires
    at the latest when the check after its key's change runs, never misses it (the
    signal comes after the commit is visible; the baseline is compared at registration
    too), and may fire spuriously, as in FDB."""

    def __init__(self, db: "Database"):
        self.db_ref = weakref.ref(db)
        self.path = db._path
        self.clock_path = _side_file(db._path, "-fdqclock")
        self.cond = threading.Condition()
        self.watches = {}  # key -> list of (baseline, future)
        self.count = 0
        self.thread = None
        self.kick = False
        self.poke_w = None  # write end of the pipe that wakes the thread's poll()
        self.sleeping = False   # the thread is in (or about to enter) that poll()
        self.lingering = False  # the thread waits on ``cond`` with no watch (not on signals)
        self.checking = False   # a check has taken its keys and not yet recorded its version
        self.checked_version = None  # the last commit in the last recorded check's snapshot
        self.unverified = None  # lowest read version of the watches registered during a check
        self.unsignaled = None  # the last own commit that sent no signal (``notify_commit``)
        with _registry_lock:
            key = _local_key(self.path)
            managers = _local_managers.get(key)
            if managers is None:
                managers = _local_managers[key] = weakref.WeakSet()
            managers.add(self)

    def register(self, key: bytes, baseline, future: Future, read_version: int | None = None):
        """``read_version``: that of the snapshot ``baseline`` was read from, if any.

        A new watch must be compared with its key's value after every commit the
        baseline did not see. Those with a commit signal still to come (or queued) wake
        the thread, whose next check takes its keys after this registration: no kick is
        needed for them. The others are those the thread's checks already consumed: a
        consumed signal is followed by a read that sees its commit, so they are all at
        most ``checked_version``, and the registration asks for a check (a kick) unless
        ``checked_version <= read_version`` (the baseline saw them all). While a check
        is under way (``checking``: it took its keys before this watch and may consume
        signals of commits the baseline missed) the same test is made when it records
        its version (``unverified``). A thread lingering with no watch waits on
        ``cond``, not on signals, and leaves them queued: it is woken (no check asked
        for) to sleep on them again. Always a check: when the thread polls without
        signals, before its first check, or without a read version (a baseline from the
        transaction's own writes alone). The kick a consumer's re-armed watch used to
        cost (a pipe write, then a check taking the GIL from its worker, ~0.1 ms per
        lease round) found nothing in the common case."""
        with self.cond:
            self.watches.setdefault(key, []).append((baseline, future))
            self.count += 1
            future._on_cancel = functools.partial(self._cancelled, key)
            if self.thread is None:
                self.checking = self.lingering = False
                self.checked_version = self.unverified = None
                self.thread = threading.Thread(target=self._run, name="fdq-watches", daemon=True)
                self.thread.start()
            elif read_version is None or self.poke_w is None or self.checked_version is None:
                pass
            elif self.unsignaled is not None and self.unsignaled > read_version:
                pass    # a commit of this process the baseline missed sent no signal
            elif self.checking:
                if self.unverified is None or read_version < self.unverified:
                    self.unverified = read_version
                return
            elif self.checked_version <= read_version:
                if self.lingering:
                    self.cond.notify()
                return
            self._kick()

    def _cancelled(self, key, future):
        """Forget a cancelled watch: looked up by its key (a consumer closing with
        thousands of watches, one per shard of each dispatch tag, cancels them all)."""
        with self.cond:
            lst = self.watches.get(key)
            for item in lst or ():
                if item[1] is future:
                    lst.remove(item)
                    self.count -= 1
                    if not lst:
                        del self.watches[key]
                    return

    def notify_commit(self, tr: "Transaction", version: int, signalled: bool):
        """Commit ``version`` of ``tr``, a transaction of this process, is visible.
        Polling (or before the thread sleeps on signals): a kick saves the poll
        interval. Signalled: the signal wakes the thread (a kick as well was a second
        check). Not signalled (no other process watches): the thread is kicked only if
        ``tr`` wrote one of its keys, and the version is kept for ``register``: a watch
        whose baseline missed this commit is checked (no signal is to come for it)."""
        if signalled and self.poke_w is not None:
            return
        with self.cond:
            if self.poke_w is None:
                if self.count:
                    self._kick()
                return
            if self.unsignaled is None or version > self.unsignaled:
                self.unsignaled = version
            if self.count and tr._writes_any(self.watches):
                self._kick()

    def _kick(self):   # under self.cond
        self.kick = True
        self.cond.notify()
        if self.sleeping and self.poke_w is not None:
            try:
                os.write(self.poke_w, b"\0")
            except OSError:     # full (a wake is pending anyway) or closed
                pass

    def _sleep(self, signal, poller, poke_r, timeout: float):
        """Until a commit signal, a kick or ``timeout``; -> the signal, or None if it
        broke (then the caller polls)."""
        try:
            ready = [fd for fd, _ev in poller.poll(timeout * 1000)]
        except OSError:
            signal.close()
            return None
        if poke_r in ready:
            try:
                os.read(poke_r, 4096)
            except OSError:
                pass
        if signal.fd in ready and not signal.drain():
            signal.close()
            return None
        return signal

    def _run(self):
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        signal = _CommitSignal.open(self.clock_path)
        # Held while this thread lives: other processes' commits signal while it does.
        # Taken after the signal is open and before the first check, so a commit that
        # found no lock is visible to that check.
        locked = signal is not None and _hold_watcher_lock(self.path)
        if signal is not None and not locked:
            signal.close()      # no one would signal it: poll
            signal = None
        poke_r = poke_w = poller = None
        if signal is not None:
            poke_r, poke_w = os.pipe()
            os.set_blocking(poke_r, False)
            os.set_blocking(poke_w, False)
            poller = select.poll()
            poller.register(signal.fd, select.POLLIN)
            poller.register(poke_r, select.POLLIN)
            with self.cond:
                self.poke_w = poke_w
        last_dv = None
        queries = {}    # number of keys -> the check's SQL
        try:
            while True:
                with self.cond:
                    if not self.watches:
                        # A consumer re-arms a fired watch within milliseconds: keep the
                        # thread and its connection (opening one costs up to tens of ms
                        # on a loaded host) rather than exit and start again.
                        if not self.kick:
                            self.lingering = True
                            try:
                                self.cond.wait(WATCH_LINGER_S)
                            finally:
                                self.lingering = False
                        if not self.watches:
                            self._detach(poke_w)
                            return
                    if signal is None and not self.kick:
                        self.cond.wait(WATCH_POLL_S)
                    sleep = self.sleeping = signal is not None and not self.kick
                if sleep:
                    signal = self._sleep(signal, poller, poke_r, WATCH_FALLBACK_POLL_S)
                    if signal is None:
                        with self.cond:
                            self._detach(poke_w, keep_thread=True)
                with self.cond:
                    self.sleeping = False
                    kicked, self.kick = self.kick, False
                    keys = list(self.watches)
                    self.checking = signal is not None
                if signal is None:  # polling: most polls find no commit
                    dv = conn.execute("PRAGMA data_version").fetchone()[0]
                    if dv == last_dv and not kicked:
                        continue
                    last_dv = dv
                # One statement per 500 keys, and one row: the last commit version in
                # its snapshot, then each key's value a column (a scalar subquery). Few
                # SQLite calls: each step (one per row, plus the reset) releases and
                # retakes the GIL, which a busy thread of this process (a consumer's
                # worker) holds until its own next SQLite call or the switch interval;
                # at one check per commit of any process the handoffs (16 rows: 18 of
                # them) cost more than the queries.
                current = {}
                version = None
                for i in range(0, len(keys), 500):
                    chunk = keys[i:i + 500]
                    q = queries.get(len(chunk))
                    if q is None:
                        q = queries[len(chunk)] = _WATCH_CHECK + ",".join([_WATCH_VALUE] * len(chunk))
                    row = conn.execute(q, chunk).fetchone()
                    # Each chunk its own snapshot: the oldest bounds what the check saw.
                    if version is None or (row[0] is not None and row[0] < version):
                        version = row[0]
                    current.update(zip(chunk, row[1:]))
                fired = []
                with self.cond:
                    if self.checking:
                        self.checked_version = version
                        self.checking = False
                        if self.unverified is not None:     # see register
                            if version is None or version > self.unverified:
                                self.kick = True
                            self.unverified = None
                    watches = self.watches
                    for key in keys:
                        lst = watches.get(key)
                        if not lst:
                            continue
                        now = current.get(key)
                        if len(lst) == 1 and lst[0][0] == now and not lst[0][1].is_ready():
                            continue    # the common case, unchanged: no lists built
                        keep = [(b, f) for b, f in lst if b == now and not f.is_ready()]
                        fired += [f for b, f in lst if b != now]
                        self.count -= len(lst) - len(keep)
                        if keep:
                            self.watches[key] = keep
                        else:
                            del self.watches[key]
                for f in fired:
                    f._resolve(None)
        finally:
            with self.cond:
                self._detach(poke_w)
            for fd in (poke_r, poke_w):
                if fd is not None:
                    os.close(fd)
            if signal is not None:
                signal.close()
            if locked:
                _release_watcher_lock(self.path)
            conn.close()

    def _detach(self, poke_w, keep_thread=False):
        """Under self.cond: forget this thread's pipe (a new thread may have its own)
        and, unless ``keep_thread``, the thread itself."""
        if poke_w is not None and self.poke_w == poke_w:
            self.poke_w = None
        if not keep_thread and self.thread is threading.current_thread():
            self.thread = None


# ---------------------------------------------------------------------------------
# Options


class _TransactionOptions:
    def __init__(self, tr: "Transaction"):
        self._tr = tr

    def set_timeout(self, ms):
        self._tr._timeout_ms = int(ms)

    def set_retry_limit(self, n):
        self._tr._retry_limit = int(n)

    def set_max_retry_delay(self, ms):
        self._tr._max_retry_delay_ms = int(ms)

    def set_size_limit(self, n):
        n = int(n)
        if not 32 <= n <= TRANSACTION_SIZE_LIMIT:
            raise EngineError(2006, f"size_limit must be 32..{TRANSACTION_SIZE_LIMIT}")
        self._tr._size_limit = n

    def set_read_your_writes_disable(self):
        tr = self._tr
        if tr._read_any or tr._writes or tr._clears or tr._write_ranges:
            # As FDB: only before any read or write; the error is deferred to the next
            # read or the commit (ThreadSafeTransaction::setOption), the option unset.
            tr._defer(2000, "read_your_writes_disable must be set before any read or write")
            return
        tr._ryw_disabled = True

    def set_snapshot_ryw_disable(self):
        self._tr._snapshot_ryw -= 1

    def set_snapshot_ryw_enable(self):
        self._tr._snapshot_ryw += 1

    def set_access_system_keys(self):
        self._tr._system_keys = True
        self._tr._write_system_keys = True

    def set_read_system_keys(self):
        self._tr._system_keys = True     # reads only (FDB's readSystemKeys)

    def set_next_write_no_write_conflict_range(self):
        self._tr._next_write_no_conflict = True

    def set_bypass_unreadable(self):
        self._tr._bypass_unreadable = True

    def set_automatic_idempotency(self):
        pass  # commit_unknown_result is injected only by fault injection here

    def _noop(self, *args):
        pass

    # Options that change scheduling or tracing on a cluster and nothing here.
    set_priority_batch = set_priority_system_immediate = set_causal_read_risky = _noop
    set_causal_write_risky = set_lock_aware = set_read_lock_aware = _noop
    set_debug_transaction_identifier = set_log_transaction = set_tag = set_auto_throttle_tag = _noop
    set_read_priority_low = set_read_priority_normal = set_read_priority_high = _noop
    set_use_grv_cache = set_report_conflicting_keys = set_transaction_logging_max_field_length = _noop


class _DatabaseOptions:
    def __init__(self, db: "Database"):
        self._db = db

    def set_transaction_timeout(self, ms):
        self._db._defaults["timeout_ms"] = int(ms)

    def set_transaction_retry_limit(self, n):
        self._db._defaults["retry_limit"] = int(n)

    def set_transaction_max_retry_delay(self, ms):
        self._db._defaults["max_retry_delay_ms"] = int(ms)

    def set_transaction_size_limit(self, n):
        self._db._defaults["size_limit"] = int(n)

    def set_max_watches(self, n):
        n = int(n)
        if not 0 <= n <= 1_000_000:
            raise EngineError(2006, "max_watches must be 0..1,000,000")
        self._db._max_watches = n

    def _noop(self, *args):
        pass

    set_location_cache_size = set_datacenter_id = set_machine_id = _noop
    set_transaction_causal_read_risky = set_transaction_logging_max_field_length = _noop
    def set_snapshot_ryw_enable(self):
        self._db._defaults["snapshot_ryw"] = self._db._defaults.get("snapshot_ryw", 0) + 1

    def set_snapshot_ryw_disable(self):
        self._db._defaults["snapshot_ryw"] = self._db._defaults.get("snapshot_ryw", 0) - 1


# ---------------------------------------------------------------------------------
# Database


class Database:
    """An embedded database: FDB's ``Database`` API over one SQLite file.

    Open it with ``fdq.connect("sqlite:///path.db")``. Safe to share between threads and
    between processes (each opens the file; a forked child reopens its connections).
    """

    def __init__(self, path: str, *, synchronous: str = "NORMAL",
                 fault_injection: float = 0.0, seed: int | None = None):
        synchronous = synchronous.upper()
        if synchronous not in _SYNC_MODES:
            raise ValueError(f"synchronous must be one of {sorted(_SYNC_MODES)}")
        if not 0.0 <= fault_injection <= 1.0:
            raise ValueError("fault_injection must be a probability in [0, 1]")
        self._path = path
        self._synchronous = synchronous
        self._fault_p = fault_injection
        self._seed = seed
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._defaults = {}
        self._max_watches = DEFAULT_MAX_WATCHES
        self._pending_watch_n = 0   # watches of open transactions (``Transaction.watch``)
        # Reentrant: Transaction.__del__ takes it, and the cyclic GC can run it inside
        # watch() on the thread that holds it.
        self._pending_lock = threading.RLock()
        self.options = _DatabaseOptions(self)
        self._init_lock = threading.Lock()
        self._store = None
        self._watches = None
        self._init_file()

    def _init_file(self):
        conn = sqlite3.connect(self._path, isolation_level=None, timeout=LOCK_WAIT_S)
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise sqlite3.OperationalError(f"cannot enable WAL (journal_mode={mode})")
            conn.executescript(_SCHEMA)
            conn.execute("BEGIN IMMEDIATE")
            if conn.execute("SELECT 1 FROM txlog LIMIT 1").fetchone() is None:
                # Versions start at an arbitrary value: code must not take them for time.
                start = random.SystemRandom().randrange(10**9, 10**13)
                conn.execute("INSERT INTO txlog VALUES (?, ?, ?)", (start, _clock(), b""))
            conn.execute("COMMIT")
        finally:
            conn.close()

    @property
    def path(self) -> str:
        return self._path

    def _get_store(self) -> _Store:
        store = self._store
        if store is None or store.pid != os.getpid():
            with self._init_lock:
                store = self._store
                if store is None or store.pid != os.getpid():
                    if store is not None:  # forked: never use or close the parent's
                        _leaked_after_fork.append(store)
                        self._watches = None
                        self._pending_watch_n = 0   # the parent's transactions'
                    store = self._store = _Store(self._path, self._synchronous)
        return store

    def _watch_manager(self) -> _WatchManager:
        self._get_store()
        if self._watches is None:
            with self._init_lock:
                if self._watches is None:
                    self._watches = _WatchManager(self)
        return self._watches

    def _fault(self, p_scale: float = 1.0) -> bool:
        if not self._fault_p:
            return False
        with self._rng_lock:
            return self._rng.random() < self._fault_p * p_scale

    def _chance(self, p: float) -> bool:
        """A draw of the fault injection's generator (reproducible for a seed)."""
        with self._rng_lock:
            return self._rng.random() < p

    def create_transaction(self) -> "Transaction":
        return Transaction(self)

    # Auto-transaction conveniences, as FDB's Database.
    def _auto(self, fn):
        tr = self.create_transaction()
        while True:
            try:
                result = fn(tr)
                tr.commit().wait()
                return result
            except EngineError as e:
                tr.on_error(e).wait()

    def get(self, key):
        return self._auto(lambda tr: tr.get(key).value)

    __getitem__ = None  # set below (slices need a function)

    def set(self, key, value):
        self._auto(lambda tr: tr.set(key, value))

    __setitem__ = set

    def clear(self, key):
        self._auto(lambda tr: tr.clear(key))

    __delitem__ = None

    def get_range(self, begin, end, limit=0, reverse=False, streaming_mode=StreamingMode.want_all):
        return self._auto(lambda tr: list(tr.get_range(begin, end, limit, reverse)))

    def get_range_startswith(self, prefix, *args, **kwargs):
        return self._auto(lambda tr: list(tr.get_range_startswith(prefix, *args, **kwargs)))

    def get_key(self, selector):
        return self._auto(lambda tr: tr.get_key(selector).value)

    def clear_range(self, begin, end):
        self._auto(lambda tr: tr.clear_range(begin, end))

    def clear_range_startswith(self, prefix):
        self._auto(lambda tr: tr.clear_range_startswith(prefix))

    def watch(self, key):
        holder = []

        def body(tr):
            holder[:] = [tr.watch(key)]
        self._auto(body)
        return holder[0]

    def __repr__(self):
        return f"<fdq embedded Database {self._path!r}>"


def _db_getitem(self, key):
    if isinstance(key, slice):
        return self.get_range(key.start, key.stop, reverse=key.step == -1)
    return self.get(key)


def _db_delitem(self, key):
    if isinstance(key, slice):
        return self.clear_range(key.start, key.stop)
    return self.clear(key)


Database.__getitem__ = _db_getitem
Database.__delitem__ = _db_delitem

for _name in _ATOMIC:
    def _make(name):
        def op(self, key, param):
            self._auto(lambda tr: getattr(tr, name)(key, param))
        op.__name__ = name
        return op
    setattr(Database, _name, _make(_name))
    if not _name.startswith(("bit_", "byte_")) and _name not in ("append_if_fits", "compare_and_clear"):
        setattr(Database, "bit_" + _name, getattr(Database, _name))


# ---------------------------------------------------------------------------------
# Transactions

_SET, _CLEAR, _ATOMIC_OPS, _VSVALUE = 0, 1, 2, 3
# States in which every use of a transaction fails with one error until reset().
_CLOSED_STATE_ERRORS = {"cancelled": 1025, "timed_out": 1031}


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
        conn = tr._conn_for_metadata()
        b, e = key_bytes(begin), key_bytes(end)
        row = conn.execute("SELECT count(*), coalesce(sum(length(key) + length(value)), 0) "
                           "FROM kv WHERE key >= ? AND key < ?", (b, e)).fetchone()
        return Future.ready(int(row[1]))

    def get_range_split_points(self, begin, end, chunk_size) -> Future:
        if begin is None or end is None:
            raise Exception("begin and end must be keys")
        chunk_size = int(chunk_size)
        if chunk_size <= 0:
            raise Exception("chunk_size must be positive")
        tr = self._tr
        b, e = key_bytes(begin), key_bytes(end)
        conn = tr._conn_for_metadata()
        if b > tr._max_key() or e > tr._max_key():
            return Future.ready(None, EngineError(2004))     # as FDB's getRangeSplitPoints
        points = [b]
        # Average row size from a sample, then step by whole chunks of rows in C.
        sample = conn.execute("SELECT avg(length(key) + length(value)) FROM "
                              "(SELECT key, value FROM kv WHERE key >= ? AND key < ? LIMIT 1000)",
                              (b, e)).fetchone()[0]
        if sample:
            step = max(1, int(chunk_size // max(sample, 1)))
            cur = b
            while True:
                row = conn.execute("SELECT key FROM kv WHERE key > ? AND key < ? ORDER BY key "
                                   "LIMIT 1 OFFSET ?", (cur, e, step - 1)).fetchone()
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


class Transaction(_ReadView):
    """As ``fdb.Transaction``. Created by ``db.create_transaction()``."""

    def __init__(self, db: Database):
        self.db = db
        self._tr = self
        self._conn = None
        self._reset_options()
        self._reset_state()

    def _reset_options(self):
        """The options that survive on_error, back to the database's defaults (as FDB's
        reset(), which clears every option)."""
        defaults = self.db._defaults
        self._timeout_ms = defaults.get("timeout_ms", 0)
        self._retry_limit = defaults.get("retry_limit", -1)
        self._max_retry_delay_ms = defaults.get("max_retry_delay_ms", 1000)
        self._created = _clock()
        self._retries = 0
        self._backoff = 0.01

    def _reset_state(self):
        self._attempt = object()  # identifies this attempt: ranges must not outlive it
        self._release()
        self._rv = None
        self._rv_clock = None
        self._db_values = {}     # key -> value read from this attempt's snapshot
        self._writes = {}
        self._sorted_keys = None
        self._clears = []        # merged [begin, end) cleared ranges
        self._clear_begins = []
        self._read_ranges = []
        self._write_ranges = []
        # (key as given: the stamp's 10-byte placeholder at offset, the offset in its last
        # 4 bytes; offset, value, clears before it, read version then)
        self._vs_keys = []
        self._clear_log = []     # every clear / clear_range in order (only read for _vs_keys)
        self._unreadable = []    # [begin, end) unreadable until commit (versionstamped keys)
        self._unreadable_n = 0   # how many of _vs_keys _unreadable covers (built on a read)
        self._unreadable_by_head = {}   # the same ranges by the prefix every key in them has
        # Keys of versionstamped values: unreadable until commit even if written again
        # later (their [k, k+\x00) ranges are in _unreadable).
        self._vs_values = 0
        self._vs_value_keys = set()     # their keys, for point reads (one lookup, not a scan)
        self._mutation_bytes = 0
        self._mutations = 0
        self._deferred = None
        self._pending_watches = []
        self._vs_future = None
        self._vs_result = None   # (stamp, error) once the commit has ended
        self._committed_version = None
        self._state = "open"    # open | committing | committed | cancelled
        self._size_limit = self.db._defaults.get("size_limit", TRANSACTION_SIZE_LIMIT)
        self._ryw_disabled = False
        self._read_any = False   # a read was made (read_your_writes_disable is refused after)
        # Snapshot reads see own writes while this is >= 0 (enables minus disables,
        # from the database's default), as FDB's snapshotRywEnabled > 0.
        self._snapshot_ryw = self.db._defaults.get("snapshot_ryw", 0)
        self._system_keys = False        # keys >= \xff readable (read or access_system_keys)
        self._write_system_keys = False  # ... and writable (access_system_keys only)
        self._next_write_no_conflict = False
        self._bypass_unreadable = False

    @property
    def options(self) -> _TransactionOptions:
        return _TransactionOptions(self)

    @property
    def snapshot(self) -> "_Snapshot":
        return _Snapshot(self)

    def __del__(self):
        try:
            self._release()
            if getattr(self, "_pending_watches", None):
                for _key_, _base, f in self._take_pending():
                    f._resolve(None, EngineError(1025))
        except Exception:
            pass

    def _take_pending(self) -> list:
        """This transaction's pending watches, which stop counting toward the
        Database's limit (``watch``): registered, failed or abandoned by the caller."""
        watches, self._pending_watches = self._pending_watches, []
        if watches:
            db = self.db
            with db._pending_lock:
                db._pending_watch_n -= len(watches)
        return watches

    # -- snapshot management -------------------------------------------------------

    def _release(self):
        conn = getattr(self, "_conn", None)
        if conn is not None:
            self._conn = None
            store = self.db._store
            if store is not None and store.pid == os.getpid():
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
            conn = store.acquire_reader()
            until = self._created + self._timeout_ms / 1000 if self._timeout_ms else None
            try:
                last, last_clock, now = store.begin_snapshot(conn, until)
            except BaseException:
                store.release_reader(conn)
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

    # -- checks --------------------------------------------------------------------

    def _check_use(self):
        if self._state != "open":
            raise EngineError(_CLOSED_STATE_ERRORS.get(self._state, 2017))
        if self._timeout_ms and (_clock() - self._created) * 1000 > self._timeout_ms:
            # As FDB: every later use (on_error included) fails with 1031 until reset().
            self._release()
            self._state = "timed_out"
            self._abandon(1031)
            raise EngineError(1031)
        if self._deferred is not None:
            raise self._deferred

    def _max_key(self):
        return b"\xff\xff" if self._system_keys else b"\xff"

    def _max_write_key(self):
        return b"\xff\xff" if self._write_system_keys else b"\xff"

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

    def _defer(self, code, message):
        if self._deferred is None:
            self._deferred = EngineError(code, message)

    def _check_write_key(self, key, clear=False):
        if key == _METADATA_VERSION_KEY and not clear:
            self._defer(2000, "the metadata version key takes only set_versionstamped_value")
            return False
        limit = SYSTEM_KEY_SIZE_LIMIT if key.startswith(b"\xff") else KEY_SIZE_LIMIT
        if len(key) > limit:
            self._defer(2102, f"Key length {len(key):,} exceeds limit ({limit:,} bytes)")
            return False
        if key >= b"\xff" and not self._write_system_keys:
            self._defer(2004, "Key outside legal range (keys >= b'\\xff' need access_system_keys)")
            return False
        return True

    def _check_value(self, value):
        if len(value) > VALUE_SIZE_LIMIT:
            self._defer(2103, f"Value length {len(value):,} exceeds limit ({VALUE_SIZE_LIMIT:,} bytes)")
            return False
        return True

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
        conn = self._ensure_snapshot()
        row = conn.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
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
            rows = self._ensure_snapshot().execute(q, (lo, hi, n)).fetchall()
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
            rows = self._ensure_snapshot().execute(q, (lo, hi, batch)).fetchall()
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

    # -- writes --------------------------------------------------------------------

    def _note_write(self, key, end=None):
        if self._next_write_no_conflict:
            self._next_write_no_conflict = False
            return
        self._write_ranges.append((key, end if end is not None else key + b"\x00"))

    def _put(self, key, entry):
        if key not in self._writes:
            self._sorted_keys = None
        self._writes[key] = entry

    def set(self, key, value):
        if type(key) is bytes and type(value) is bytes and len(key) <= KEY_SIZE_LIMIT \
                and len(value) <= VALUE_SIZE_LIMIT and key < b"\xff" and self._state == "open" \
                and not self._next_write_no_conflict and not self._pending_watches:
            # The common case inline (batched writes spend their time here): a legal
            # user key and value; the same effects as the general path below.
            writes = self._writes
            if key not in writes:
                self._sorted_keys = None
            writes[key] = (_SET, value)
            self._write_ranges.append((key, key + b"\x00"))
            self._mutation_bytes += len(key) + len(value) + ENTRY_OVERHEAD_BYTES
            self._mutations += 1
            return
        self._check_writable()
        key, value = key_bytes(key), value_bytes(value)
        if self._check_write_key(key) & self._check_value(value):
            self._put(key, (_SET, value))
            self._note_write(key)
            self._mutation_bytes += len(key) + len(value) + ENTRY_OVERHEAD_BYTES
            self._mutations += 1
            if self._pending_watches:
                self._touch_watches(key)

    __setitem__ = set

    def clear(self, key):
        if type(key) is bytes and len(key) <= KEY_SIZE_LIMIT and key < b"\xff" and self._state == "open" \
                and not self._next_write_no_conflict and not self._pending_watches and not self._vs_keys:
            # The common case inline (consumers clear a key per message): the same effects
            # as the general path below.
            writes = self._writes
            if key not in writes:
                self._sorted_keys = None
            writes[key] = (_CLEAR, None)
            self._write_ranges.append((key, key + b"\x00"))
            self._mutation_bytes += len(key) + ENTRY_OVERHEAD_BYTES
            self._mutations += 1
            return
        self._check_writable()
        key = key_bytes(key)
        if len(key) > KEY_SIZE_LIMIT and not key.startswith(b"\xff"):
            self._next_write_no_conflict = False   # still takes the option, as FDB
            return  # clearing an oversized key is a no-op, as FDB
        if not self._check_write_key(key, clear=True):
            return
        self._put(key, (_CLEAR, None))
        if self._vs_keys:
            self._clear_log.append((key, key + b"\x00"))
        self._note_write(key)
        self._mutation_bytes += len(key) + ENTRY_OVERHEAD_BYTES
        self._mutations += 1
        if self._pending_watches:
            self._touch_watches(key)

    def clear_range(self, begin, end):
        self._check_writable()
        b = b"" if begin is None else key_bytes(begin)
        e = self._max_write_key() if end is None else key_bytes(end)
        if b > e:
            self._defer(2005, "clear_range: begin key is larger than end key")
            return
        if e > self._max_write_key():
            self._defer(2004, "clear_range end outside legal range")
            return
        if b == e:
            self._next_write_no_conflict = False   # still takes the option, as FDB
            return
        if self._writes:
            for k in [k for k in self._writes if b <= k < e]:
                del self._writes[k]
            self._sorted_keys = None
        if self._vs_keys:
            self._clear_log.append((b, e))
        self._clears = _merge_ranges(self._clears + [[b, e]])
        self._clear_begins = [c[0] for c in self._clears]
        self._note_write(b, e)
        self._mutation_bytes += len(b) + len(e) + ENTRY_OVERHEAD_BYTES
        self._mutations += 1
        if self._pending_watches:
            for wk, _b, _f in self._pending_watches:
                if b <= wk < e:
                    self._touch_watches(wk)

    def clear_range_startswith(self, prefix):
        prefix = key_bytes(prefix)
        self.clear_range(prefix, strinc(prefix))

    def __delitem__(self, key):
        if isinstance(key, slice):
            self.clear_range(key.start, key.stop)
        else:
            self.clear(key)

    def _atomic(self, name, key, param):
        self._check_writable()
        key, param = key_bytes(key), value_bytes(param)
        if not (self._check_write_key(key) & self._check_value(param)):
            return
        entry = self._writes.get(key)
        if entry is not None and entry[0] == _ATOMIC_OPS:
            entry[1].append((name, param))
        elif entry is not None and entry[0] == _VSVALUE:
            entry[1][2].append((name, param))   # on the stamped value, at commit
        elif (entry is not None and entry[0] in (_SET, _CLEAR)) or (
                entry is None and self._clears and self._in_clears(key)):
            # The base value is known in the transaction: the result is a plain set.
            r = _ATOMIC[name](entry[1] if entry is not None else None, param)
            self._put(key, (_SET, r) if r is not None else (_CLEAR, None))
        else:
            self._put(key, (_ATOMIC_OPS, [(name, param)]))
        self._note_write(key)
        self._mutation_bytes += len(key) + len(param) + ENTRY_OVERHEAD_BYTES
        self._mutations += 1
        if self._pending_watches:
            self._touch_watches(key)

    def add(self, key, param):
        if type(key) is bytes and type(param) is bytes and len(key) <= KEY_SIZE_LIMIT \
                and len(param) <= VALUE_SIZE_LIMIT and key < b"\xff" and self._state == "open" \
                and not self._next_write_no_conflict and not self._pending_watches:
            # The common case inline (a push adds to 3 counters): a legal user key and
            # parameter; the same effects as the general path (_atomic).
            writes = self._writes
            entry = writes.get(key)
            if entry is None and not self._clears:
                self._sorted_keys = None
                writes[key] = (_ATOMIC_OPS, [("add", param)])
            elif entry is not None and entry[0] == _ATOMIC_OPS:
                entry[1].append(("add", param))
            else:
                self._atomic("add", key, param)
                return
            self._write_ranges.append((key, key + b"\x00"))
            self._mutation_bytes += len(key) + len(param) + ENTRY_OVERHEAD_BYTES
            self._mutations += 1
            return
        self._atomic("add", key, param)

    def bit_and(self, key, param):
        self._atomic("bit_and", key, param)

    def bit_or(self, key, param):
        self._atomic("bit_or", key, param)

    def bit_xor(self, key, param):
        self._atomic("bit_xor", key, param)

    def max(self, key, param):
        self._atomic("max", key, param)

    def min(self, key, param):
        self._atomic("min", key, param)

    def byte_max(self, key, param):
        self._atomic("byte_max", key, param)

    def byte_min(self, key, param):
        self._atomic("byte_min", key, param)

    def append_if_fits(self, key, param):
        self._atomic("append_if_fits", key, param)

    def compare_and_clear(self, key, param):
        self._atomic("compare_and_clear", key, param)

    bit_add, bit_max, bit_min = add, max, min

    def _placeholder_offset(self, data: bytes, what: str):
        if len(data) < 4:
            self._defer(2000, f"versionstamped {what} is shorter than its 4-byte offset")
            return None
        offset = struct.unpack("<I", data[-4:])[0]
        if offset + 10 > len(data) - 4:
            self._defer(2000, f"versionstamp offset {offset} is outside the {what}")
            return None
        return offset

    def set_versionstamped_key(self, key, value):
        if type(key) is bytes and type(value) is bytes and self._state == "open" \
                and not self._next_write_no_conflict:
            # The common case inline (a push writes two per message): a legal user key
            # with its placeholder inside; the same effects as the general path below.
            # The key is kept whole, split at its stamp when the commit writes it.
            n = len(key)
            if 14 <= n <= KEY_SIZE_LIMIT and len(value) <= VALUE_SIZE_LIMIT and key < b"\xff":
                offset = _U32.unpack_from(key, n - 4)[0]
                if offset + 14 <= n:
                    self._vs_keys.append((key, offset, value, len(self._clear_log), self._rv))
                    self._mutation_bytes += n + len(value) + ENTRY_OVERHEAD_BYTES
                    self._mutations += 1
                    return
        self._check_writable()
        # As FDB: the option is taken by this write (it has no client-side conflict
        # range to drop), not left for the next one.
        self._next_write_no_conflict = False
        key, value = key_bytes(key), value_bytes(value)
        offset = self._placeholder_offset(key, "key")
        if offset is None or not self._check_value(value):
            return
        # As FDB: the size limit counts the key as given, its 4-byte offset included.
        if not self._check_write_key(key):
            return
        if not self._check_write_key(key[:-4]):
            return
        # Unreadable until commit: every key the stamp could produce (_unreadable_ranges).
        self._vs_keys.append((key, offset, value, len(self._clear_log), self._rv))
        self._mutation_bytes += len(key) + len(value) + ENTRY_OVERHEAD_BYTES
        self._mutations += 1

    def set_versionstamped_value(self, key, value):
        self._check_writable()
        key, value = key_bytes(key), value_bytes(value)
        offset = self._placeholder_offset(value, "value")
        if offset is None:
            return
        if key == _METADATA_VERSION_KEY:
            if value != _METADATA_VERSION_VALUE:
                self._defer(2000, "the metadata version key takes only a versionstamped value of 14 zero bytes")
                return
        elif not self._check_write_key(key):
            return
        body = value[:-4]
        # As FDB: the size limit counts the value as given, its 4-byte offset included.
        if not self._check_value(value):
            return
        self._put(key, (_VSVALUE, (body, offset, [])))
        self._unreadable.append((key, key + b"\x00"))
        self._vs_value_keys.add(key)
        self._vs_values += 1
        self._note_write(key)
        self._mutation_bytes += len(key) + len(value) + ENTRY_OVERHEAD_BYTES
        self._mutations += 1

    def add_read_conflict_range(self, begin, end):
        self._check_use()
        b, e = key_bytes(begin), key_bytes(end)
        if b > e:
            raise EngineError(2005)
        if e > self._max_key() and (b != _METADATA_VERSION_KEY or e != _METADATA_VERSION_KEY + b"\x00"):
            raise EngineError(2004)
        self._add_read_conflict(b, e)

    def add_read_conflict_key(self, key):
        key = key_bytes(key)
        self.add_read_conflict_range(key, key + b"\x00")

    def add_write_conflict_range(self, begin, end):
        self._check_writable()
        b, e = key_bytes(begin), key_bytes(end)
        if b > e:
            raise EngineError(2005)
        if e > self._max_write_key():
            raise EngineError(2004)
        if b < e:
            self._write_ranges.append((b, e))

    def add_write_conflict_key(self, key):
        key = key_bytes(key)
        self.add_write_conflict_range(key, key + b"\x00")

    def _check_writable(self):
        if self._state != "open":
            raise EngineError(_CLOSED_STATE_ERRORS.get(self._state, 2017))

    def get_approximate_size(self) -> Future:
        return Future.ready(self._approximate_size())

    def _approximate_size(self) -> int:
        conflicts = sum(len(b) + len(e) + ENTRY_OVERHEAD_BYTES for b, e in self._read_ranges)
        conflicts += sum(len(b) + len(e) + ENTRY_OVERHEAD_BYTES for b, e in self._write_ranges)
        return self._mutation_bytes + conflicts

    # -- watches -------------------------------------------------------------------

    def watch(self, key) -> Future:
        f = Future()
        try:
            self._check_use()
            key = key_bytes(key)
            if self._ryw_disabled:
                raise EngineError(1034)
            if key >= self._max_key() and key != _METADATA_VERSION_KEY:
                raise EngineError(2004)
            if len(key) > (SYSTEM_KEY_SIZE_LIMIT if key.startswith(b"\xff") else KEY_SIZE_LIMIT):
                raise EngineError(2102)
            mgr = self.db._watch_manager()
            baseline = self._get(key, False)
            # As FDB: a watch counts toward the Database's limit from this call, pending
            # in any of its transactions or registered after a commit.
            db = self.db
            with db._pending_lock:
                if mgr.count + db._pending_watch_n >= db._max_watches:
                    raise EngineError(1032, f"Too many watches currently set (limit "
                                            f"{db._max_watches:,} per database)")
                db._pending_watch_n += 1
        except EngineError as e:
            f._resolve(None, e)
            return f
        self._pending_watches.append((key, baseline, f))
        return f

    def _touch_watches(self, key):
        entry = self._writes.get(key)
        for wk, base, f in self._pending_watches:
            if wk == key and not f.is_ready():
                if entry is None or entry[0] != _SET or entry[1] != base:
                    f._resolve(None)

    # -- commit --------------------------------------------------------------------

    def commit(self) -> Future:
        try:
            self._commit()
        except EngineError as e:
            return Future.ready(None, e)
        return Future.ready(None)

    def _commit(self):
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
            if db._fault():
                # 1021 here: a commit_unknown_result that did not apply (the other
                # kind, after a real commit, is below): on FDB it may be either.
                raise EngineError(db._rng.choice((1020, 1020, 1007, 1037, 1021, 1021)))
            store = db._get_store()
            has_reads = bool(self._read_ranges)
            if has_reads and self._rv is None:
                self._ensure_snapshot()
            rv = self._rv
            self._release()
            jump = db._fault(0.05)
            until = self._created + self._timeout_ms / 1000 if self._timeout_ms else None
            lock = store.write_lock
            if until is None:
                lock.acquire()
            elif not lock.acquire(timeout=max(0.0, until - _clock())):
                raise EngineError(1031)
            try:
                store.begin_immediate(until)
                try:
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
            err = EngineError(4100, f"SQLite: {e}")
            self._fail(err)
            raise err from e
        signalled = store.signal_commit()
        for mgr in _managers_of(store):
            mgr.notify_commit(self, version, signalled)
        if db._fault():
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

    def _writes_any(self, keys) -> bool:
        """Whether this transaction's mutations may have changed one of ``keys``."""
        if self._vs_keys or len(keys) > 256:
            return True
        writes = self._writes
        clears = self._clears
        for k in keys:
            if k in writes or (clears and self._in_clears(k)):
                return True
        return False

    def _register_watch(self, key, baseline, f):
        if f.is_ready():
            return
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
        if len(sets) == 1:
            w.execute(_UPSERT, sets[0])
        elif sets:
            _upsert(w, sets)
        if adds:
            w.executemany(_ADD_UPSERT, adds)
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
