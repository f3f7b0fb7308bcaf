"""Watches of the embedded engine: registered after commit, checked by one thread per
Database and process, woken by a commit signal (inotify on the clock file) from any
process, or polling where that is unavailable (docs/fdb-semantics.md §8).
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import select
import sqlite3
import struct
import threading
import time
import weakref
from typing import TYPE_CHECKING

from ..futures import Future
from .store import _CLOEXEC, _local_key, _side_file, open_watch_file, release_watch_file, sqlite_error

if TYPE_CHECKING:
    from .database import Database
    from .transaction import Transaction

WATCH_POLL_S = 0.001  # cross-process watch latency without commit signals: about this, plus scheduling
WATCH_FALLBACK_POLL_S = 0.05  # with commit signals (inotify), the poll that remains: a safety net
WATCH_LINGER_S = 2.0  # the poll thread outlives its last watch this long (re-arming is common)

_IN_MODIFY = 0x00000002
_IN_IGNORED = 0x00008000
_INOTIFY_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
_IN_NONBLOCK = os.O_NONBLOCK
_libc = None

_WATCH_CHECK = "SELECT (SELECT max(version) FROM txlog),"
_WATCH_VALUE = "(SELECT value FROM kv WHERE key = ?)"

_registry_lock = threading.Lock()
_local_managers = {}    # _local_key -> WeakSet of this process's _WatchManager


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
            fd = _libc.inotify_init1(_IN_NONBLOCK | _CLOEXEC)
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
        self.last = {}          # key -> its value in the last recorded check (signals only)
        self.recent = {}        # key -> when its last watch ended: still checked (``WATCH_LINGER_S``)
        self.verify = []        # (key, baseline) of the watches registered during a check
        self.own = {}           # key of ``last`` -> the last own unsignalled commit that wrote it
        self.dirty = None       # the last own unsignalled commit that may have written any key of ``last``
        self.local_key = _local_key(self.path)
        with _registry_lock:
            managers = _local_managers.get(self.local_key)
            if managers is None:
                managers = _local_managers[self.local_key] = weakref.WeakSet()
            managers.add(self)

    def register(self, key: bytes, baseline, future: Future, read_version: int | None = None):
        """``read_version``: that of the snapshot ``baseline`` was read from (the
        watching transaction's read version, never its commit version: see below).

        A new watch must be compared with its key's value after every commit the
        baseline did not see. Those with a commit signal still to come (or queued) wake
        the thread, whose next check takes its keys after this registration: no kick is
        needed for them. The others are those the thread's checks already consumed: a
        consumed signal is followed by a read that sees its commit. So the registration
        compares the baseline with the key's value in the last recorded check (``last``:
        the thread keeps checking a key for ``WATCH_LINGER_S`` after its last watch
        ended, as a consumer re-watches the same keys): equal, every commit that changed
        the key since is still to be signalled and no check is asked for; different, or
        a key the last check did not read, a check is asked for (a kick). By value: the
        baseline may be older than the last check (a lease round reads it at its start,
        and a push's add to the ``routed`` counter consumers watch, made with
        ``set_next_write_no_write_conflict_range``, does not conflict with it), and its
        value tells whether a commit in between changed the key. While a check is under
        way (``checking``: it took its keys before this watch and may consume signals of
        commits the baseline missed) the same comparison is made with that check's values
        when it records them (``verify``). An own commit that sent no signal fired the
        watches of the keys it wrote itself (``notify_commit``) and left ``last`` stale for
        those of them it holds (``own``: key -> that commit's version, until a check newer
        than it): a baseline read at or after that version is taken as the key's value in
        ``last``, an older one asks for a check, as does any watch while an own commit
        that may have written any key of ``last`` is newer than the last check (``dirty``).
        A thread lingering with no watch waits on ``cond``, not on signals, and leaves them
        queued: it is woken (no check asked for) to sleep on them again. Always a check:
        when the thread polls without signals or before its first check. The kick a
        consumer's re-armed watch used to cost (a pipe write, then a check taking the GIL
        from its worker, ~0.1 ms per lease round) found nothing in the common case."""
        with self.cond:
            self.watches.setdefault(key, []).append((baseline, future))
            self.count += 1
            future._on_cancel = functools.partial(self._cancelled, key)
            if self.thread is None:
                self.checking = self.lingering = False
                self.checked_version = self.dirty = None
                self.last, self.recent, self.verify, self.own = {}, {}, [], {}
                self.thread = threading.Thread(target=self._run, name="fdq-watches", daemon=True)
                self.thread.start()
            elif self.poke_w is None or self.checked_version is None:
                pass
            elif self.checking:
                self.verify.append((key, baseline))
                return
            elif self.dirty is not None:
                pass    # an own commit after the last check may have written it, unsignalled
            elif key in self.own:
                # Own commits since the last check wrote it and sent no signal (they fired
                # its watches themselves): a baseline read at or after the last of them
                # is its value now, as far as the signals tell (one still to come wakes
                # the thread, which compares); an older one may have missed it.
                if read_version is None or read_version < self.own[key]:
                    self._kick()
                    return
                del self.own[key]
                self.last[key] = baseline
                if self.lingering:
                    self.cond.notify()
                return
            elif key in self.last and self.last[key] == baseline:
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
        """Commit ``version`` of ``tr``, a transaction of this process, is visible. The
        watches of this process on keys ``tr`` wrote fire here, in the committing thread:
        a wake-up of the watch thread and a check less between a push and the consumer of
        the same process (an NSQ broker's PUB and its channel); a fire where the value did
        not change is allowed (docs/fdb-semantics.md §8). The other watched keys did not
        change: no kick (a signalled commit wakes the thread anyway), unless ``tr`` cleared
        ranges that were not searched for them (``_written_among``: over 256 keys), when
        the thread checks them all. An unsignalled commit leaves ``last`` stale for the
        keys of it that ``tr`` wrote (``own``, or every key: ``dirty``): ``register``
        then judges a new watch by its baseline's read version, or asks for a check, as
        no signal is to come for that commit."""
        fired = []
        with self.cond:
            if self.count:
                written, complete = tr._written_among(self.watches, version)
                ended = time.monotonic()
                for key in written:
                    lst = self.watches.pop(key, None)
                    if lst:
                        self.count -= len(lst)
                        self.recent[key] = ended
                        fired += [f for _b, f in lst]
                if not complete and self.count:
                    self._kick()
            if not signalled and self.last and self.poke_w is not None:
                written, complete = tr._written_among(self.last, version)
                if not complete:
                    self.dirty = version
                for key in written:
                    self.own[key] = version
        for f in fired:
            f._resolve(None)

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
        locked = signal is not None and open_watch_file(self.path, self.local_key, lock=True) is not None
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
                    if self.recent:     # keys watched lately: their values for ``register``
                        expired = time.monotonic() - WATCH_LINGER_S
                        for key, since in list(self.recent.items()):
                            if since < expired or key in self.watches:
                                del self.recent[key]
                            else:
                                keys.append(key)
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
                ended = time.monotonic()
                with self.cond:
                    if self.checking:
                        self.checked_version = version
                        self.checking = False
                        self.last = current
                        if self.verify:     # see register
                            own = self.own
                            stale = version is None or (self.dirty is not None and self.dirty > version)
                            if stale or any(key not in current or current[key] != baseline
                                            or own.get(key, -1) > version for key, baseline in self.verify):
                                self.kick = True
                            self.verify = []
                        if version is not None:
                            if self.own:
                                self.own = {k: v for k, v in self.own.items() if v > version}
                            if self.dirty is not None and self.dirty <= version:
                                self.dirty = None
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
                            self.recent[key] = ended
                for f in fired:
                    f._resolve(None)
        except sqlite3.Error as e:
            # The file failed (damaged, an I/O error): every watch fails with the cause,
            # as FDB fails watches with an error; the next one starts a new thread.
            err = sqlite_error(e, self.path)
            with self.cond:
                failed = [f for lst in self.watches.values() for _b, f in lst]
                self.watches.clear()
                self.count = 0
            for f in failed:
                f._resolve(None, err)
        finally:
            with self.cond:
                self._detach(poke_w)
            for fd in (poke_r, poke_w):
                if fd is not None:
                    os.close(fd)
            if signal is not None:
                signal.close()
            if locked:
                release_watch_file(self.local_key, lock=True)
            conn.close()

    def _detach(self, poke_w, keep_thread=False):
        """Under self.cond: forget this thread's pipe (a new thread may have its own)
        and, unless ``keep_thread``, the thread itself."""
        if poke_w is not None and self.poke_w == poke_w:
            self.poke_w = None
        if not keep_thread and self.thread is threading.current_thread():
            self.thread = None
