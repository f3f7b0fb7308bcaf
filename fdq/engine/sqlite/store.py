"""The embedded engine's per-process store: the SQLite connections of one Database, its
version clock (a lock on a side file that orders every commit version above the read
versions of the snapshots it did not see), WAL checkpoints off the commit path, and what a
forked child must not inherit.
"""
from __future__ import annotations

import fcntl
import os
import sqlite3
import struct
import sys
import threading
import time
import weakref

from ...errors import DatabaseCorrupt, EngineError
from .mutations import _op_add, _sql_atomic

# The engine's own clock: captured at import, so a process that skews ``time.time`` or
# patches ``time.monotonic`` (clock-skew tests) does not move database versions.
# CLOCK_MONOTONIC is one clock for every process of the machine.
_clock = time.monotonic
_sleep = time.sleep

VERSIONS_PER_SECOND = 1_000_000
MVCC_WINDOW_VERSIONS = 5_000_000
MVCC_WINDOW_S = 5.0
RECOVERY_JUMP_VERSIONS = 100_000_000

CHECKPOINT_EVERY = 128  # commits of this process between WAL checkpoints (SQLite's own: 1,000 pages)
WAL_RESTART_FRAMES = 16384  # past this many WAL frames (~64 MB), force the WAL to restart
CHECKPOINT_BYTES = 4_000_000  # ... or after this many bytes of mutations (SQLite's 1,000 pages)
CHECKPOINT_LINGER_S = 2.0  # the checkpoint thread outlives its last request this long
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
    """In a forked child: close the parent's version clock lock descriptors (and its
    watcher files', ``open_watch_file``: the child starts its own). A flock
    lock belongs to the open file, which the child's copies keep open: had the parent
    been killed while holding it (mid-commit), it stayed held for as long as the child
    lived, and every process of the database waited on it. Closing (never unlocking:
    that would release the parent's lock) drops the child's share. No lock is taken:
    another thread of the parent may have held one at the fork."""
    global _watch_files_lock
    _watch_files_lock = threading.Lock()    # (another thread of the parent may have held it)
    for fd, _users, _lockers in _watch_files.values():
        try:
            os.close(fd)        # (the child holds none of the parent's POSIX locks)
        except OSError:
            pass
    _watch_files.clear()
    _released_later.clear()
    for store in list(_stores):
        store.forked = True
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


def _release_store_fds(pid: int, writer_fd: int, fd_pool: list, watch_key):
    """A collected store's descriptors: its clock descriptors closed, its use of the
    watcher file given back, in the process that opened them (a forked child closed
    its copies at the fork)."""
    if os.getpid() != pid:
        return
    for fd in [writer_fd, *fd_pool]:
        try:
            os.close(fd)
        except OSError:
            pass
    fd_pool.clear()
    if watch_key is not None:
        release_watch_file(watch_key)


_watch_files = {}       # _local_key -> [descriptor, users, lockers] (``open_watch_file``)
_watch_files_lock = threading.Lock()
_released_later = []    # (key, lock) given back while the registry was busy (``release_watch_file``)


def open_watch_file(path: str, key, lock: bool = False):
    """This process's descriptor of ``path``'s watcher file, one more use of it (the
    stores' probe, ``others_watch``; ``lock``: a watch thread, holding the shared read
    lock that announces it); None if it cannot be opened (or locked). One descriptor per
    file and process, closed once nothing uses it: closing any descriptor of the file
    drops every POSIX lock of the process on it."""
    with _watch_files_lock:
        _release_pending()
        entry = _watch_files.get(key)
        if entry is None:
            try:
                fd = os.open(_side_file(path, _WATCHERS_SUFFIX), os.O_RDWR | os.O_CREAT | _CLOEXEC, 0o644)
            except OSError:
                return None
            entry = _watch_files[key] = [fd, 0, 0]
        if lock and not entry[2]:
            try:
                fcntl.lockf(entry[0], fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                if not entry[1]:
                    del _watch_files[key]
                    os.close(entry[0])
                return None
        entry[1] += 1
        entry[2] += lock
        return entry[0]


def release_watch_file(key, lock: bool = False):
    """Give back a use of ``open_watch_file``. A store's finalizer may run it inside the
    registry's critical section (the cyclic GC runs anywhere): then it is queued and
    done by the next call."""
    if not _watch_files_lock.acquire(blocking=False):
        _released_later.append((key, lock))
        return
    try:
        _release_pending()
        _release(key, lock)
    finally:
        _watch_files_lock.release()


def _release_pending():
    while _released_later:
        _release(*_released_later.pop())


def _release(key, lock: bool):
    entry = _watch_files.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if lock:
        entry[2] -= 1
        if not entry[2] and entry[1]:
            try:
                fcntl.lockf(entry[0], fcntl.LOCK_UN)
            except OSError:
                pass
    if not entry[1]:
        del _watch_files[key]
        os.close(entry[0])


# Which processes sleep on the commit signal: each holds a POSIX read lock on
# "<database>-fdqwatch" while a watch thread of it does (``open_watch_file``),
# so a commit signals only when another process watches (``_Store.others_watch``). POSIX
# record locks belong to the process and all of its locks on a file go when it closes
# any descriptor of that file: one descriptor per process and file, counted
# (``open_watch_file``), shared by the probe and the lock. A process killed loses its
# lock with it.
_WATCHERS_SUFFIX = "-fdqwatch"
# struct flock as Linux lays it out on 64-bit (short, short, off_t, off_t, pid_t): the
# F_GETLK probe; elsewhere commits always signal.
_FLOCK = struct.Struct("hhqqi4x") if sys.platform.startswith("linux") and struct.calcsize("P") == 8 else None
_PROBE = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0) if _FLOCK is not None else None
_CLOEXEC = getattr(os, "O_CLOEXEC", 0o2000000)

_LAST_VERSION = "SELECT version, clock FROM txlog ORDER BY version DESC LIMIT 1"


# SQLite's result codes of a damaged file (by ``sqlite3.Error.sqlite_errorname``, Python
# 3.11+), and the codes of its message texts for Python 3.10, which lacks the name.
_DAMAGED = ("SQLITE_CORRUPT", "SQLITE_NOTADB")
_KINDS = {"database disk image is malformed": "SQLITE_CORRUPT", "file is not a database": "SQLITE_NOTADB",
          "database or disk is full": "SQLITE_FULL", "disk I/O error": "SQLITE_IOERR"}


def sqlite_error(e: sqlite3.Error, path: str) -> EngineError:
    """The engine error for a failure of SQLite on the database file ``path``, its cause
    kept: a damaged file is :class:`~fdq.errors.DatabaseCorrupt`; a full disk, an I/O
    error or anything else is ``internal_error`` (4100) saying what SQLite said, and
    where. Never retryable: none of them goes away by trying again at once."""
    name = getattr(e, "sqlite_errorname", None) or _KINDS.get(str(e), "")
    if name.startswith(_DAMAGED):
        return DatabaseCorrupt(path, str(e))
    if name == "SQLITE_FULL":
        return EngineError(4100, f"SQLite: database or disk is full, writing {path!r}: free space on its disk; "
                                 "the transaction was not committed")
    if name.startswith("SQLITE_IOERR"):
        return EngineError(4100, f"SQLite: disk I/O error ({name}) on {path!r}: check the disk and the "
                                 "system log")
    return EngineError(4100, f"SQLite: {e}" + (f" ({name})" if name else "") + f" on {path!r}")


def _side_file(path: str, suffix: str) -> str:
    """The engine's file ``suffix`` beside the database: named after its real path, as
    SQLite names its WAL (it follows a symlink to the file), so processes that open the
    database by different names share the version clock lock and the watch signals."""
    return os.path.realpath(path) + suffix


def _local_key(path: str):
    return os.getpid(), os.path.realpath(path)


class _Store:
    def __init__(self, path: str, synchronous: str):
        self.path = path
        self.synchronous = synchronous
        self.pid = os.getpid()
        # Set in a forked child (``_close_inherited_locks``): the parent's store, never
        # used there. A flag, not a ``getpid()`` on every use: that is a system call.
        self.forked = False
        self.write_lock = threading.Lock()
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
        self.local_key = _local_key(path)   # this process's watch managers of the file
        # the probe's descriptor (``others_watch``), shared with this process's other users
        self.watchers_fd = open_watch_file(path, self.local_key) if _FLOCK is not None else None
        _stores.add(self)
        # Its descriptors go with it (a process that connects to a database again and
        # again must not keep every store's); flock locks belong to each descriptor, so
        # closing one leaves the others' locks alone.
        weakref.finalize(self, _release_store_fds, self.pid, self.writer_fd, self.fd_pool,
                         self.local_key if self.watchers_fd is not None else None).atexit = False

    def _open(self, timeout: float = LOCK_WAIT_S) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=timeout)
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        conn.create_function("fdq_atomic", 2, _sql_atomic, deterministic=True)
        conn.create_function("fdq_add", 2, _op_add, deterministic=True)
        return conn

    # The pools of read connections and of clock file descriptors: lists popped and
    # appended without a lock (each a single operation under the GIL).

    def acquire_reader(self) -> sqlite3.Connection:
        try:
            return self.pool.pop()
        except IndexError:
            return self._open()

    def release_reader(self, conn: sqlite3.Connection):
        try:
            conn.execute("COMMIT")
        except sqlite3.Error:
            conn.close()
            return
        if len(self.pool) < 16:
            self.pool.append(conn)
            return
        conn.close()

    def begin_snapshot(self, conn: sqlite3.Connection, until: float | None = None):
        """Open a read snapshot on ``conn``; -> (last commit version, its clock, now).
        ``until``: the transaction's timeout (``_flock``)."""
        fd_pool = self.fd_pool
        try:
            fd = fd_pool.pop()
        except IndexError:
            fd = os.open(self.clock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if until is None:
                fcntl.flock(fd, fcntl.LOCK_SH)
            else:
                _flock(fd, fcntl.LOCK_SH, until)
            try:
                now = _clock()
                conn.execute("BEGIN")
                version, clock = conn.execute(_LAST_VERSION).fetchone()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            fd_pool.append(fd)
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
        """Whether another process holds its watcher lock (``open_watch_file``): a
        POSIX record lock, which F_GETLK reports only when another process holds it.
        True when that cannot be told."""
        if self.watchers_fd is None:
            return True
        try:
            got = fcntl.fcntl(self.watchers_fd, fcntl.F_GETLK, _PROBE)
            return _FLOCK.unpack_from(got)[0] != fcntl.F_UNLCK
        except (OSError, struct.error):
            return True

    def request_checkpoint(self):
        """Run a PASSIVE checkpoint soon, in this store's checkpoint thread. Not in the
        committing thread: a checkpoint copies WAL pages and fsyncs the database file,
        7-45 ms on this VM, which made it the p99 of a push and of end-to-end latency
        when it ran inside the commit of whichever transaction crossed the threshold. The
        thread runs on its own connection without the version clock lock or
        ``write_lock``: readers and writers of every process go on meanwhile (the GIL is
        released inside SQLite)."""
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
                        self.ckpt_cond.wait(CHECKPOINT_LINGER_S)
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


def _version_at(last: int, last_clock: float, now: float) -> int:
    elapsed = now - last_clock
    return last + int(elapsed * VERSIONS_PER_SECOND) if elapsed > 0 else last
