"""The embedded engine's ``Database``: FDB's ``Database`` API over one SQLite file (its
options, its per-process store and watch thread, the auto-transaction conveniences).
"""
from __future__ import annotations

import os
import random
import sqlite3
import threading
import urllib.parse

from ...errors import ConnectError, DatabaseCorrupt, EngineError
from ..types import DEFAULT_MAX_WATCHES, StreamingMode
from .mutations import _ATOMIC
from .store import LOCK_WAIT_S, _SCHEMA, _SYNC_MODES, _Store, _clock, _leaked_after_fork, sqlite_error
from .transaction import Transaction
from .watches import _WatchManager


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


_COLUMNS = {"kv": ["key", "value"], "txlog": ["version", "clock", "ranges"]}


def _probe(path: str) -> bool:
    """Look at an existing file read-only: -> whether it is an initialized FDQ database
    (its tables, a first version in ``txlog``, WAL); False for a new or empty one (no
    tables: nothing of anyone's to lose). Raises ConnectError, having changed nothing,
    for a file that is not SQLite or holds another application's tables.

    Only SQLite opens the file: its locks on it are POSIX locks, which belong to the
    process and all go when any descriptor of the file is closed. Reading its header
    with ``open()`` here dropped those of this process's other connections, and another
    process closing its last connection then deleted the WAL under them (they read a
    stale snapshot for ever after)."""
    try:
        if os.stat(path).st_size == 0:
            return False
    except FileNotFoundError:
        return False
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=LOCK_WAIT_S)
    try:
        return _probe_tables(path, conn)
    except sqlite3.Error as e:
        err = sqlite_error(e, path)
        if isinstance(err, DatabaseCorrupt) and err.cause == "file is not a database":
            raise ConnectError(f"{path!r} is not an SQLite database (FDQ's embedded engine keeps its own "
                               "SQLite file): choose another path") from None
        if isinstance(err, DatabaseCorrupt):
            raise err from e
        raise   # locked, cannot open, ...: the caller says it cannot open the file
    finally:
        conn.close()


def _probe_tables(path: str, conn: sqlite3.Connection) -> bool:
    """``_probe``'s look at the schema, on its read-only connection."""
    objects = conn.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite~_%' ESCAPE '~' "
                           "ORDER BY name").fetchall()
    if not objects:
        return False
    ours = {name for kind, name in objects if kind == "table" and name in _COLUMNS
            and [c[1] for c in conn.execute(f"PRAGMA table_info({name})")] == _COLUMNS[name]}
    foreign = [name if kind == "table" else f"{kind} {name}" for kind, name in objects if name not in ours]
    if foreign:
        raise ConnectError(f"{path!r} is an SQLite database of another application (tables: "
                           f"{', '.join(foreign)}): FDQ keeps its own file; choose another path")
    return (len(ours) == len(_COLUMNS) and conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            and conn.execute("SELECT 1 FROM txlog LIMIT 1").fetchone() is not None)


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
        """Make the file an FDQ database, unless it is one already: an initialized file
        is opened with no write at all (no wait for another process's write lock), and
        a file that is not FDQ's is refused before anything in it changes."""
        if _probe(self._path):
            return
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
        if store is None or store.forked:
            with self._init_lock:
                store = self._store
                if store is None or store.forked:
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
