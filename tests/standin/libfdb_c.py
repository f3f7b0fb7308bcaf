"""A stand-in for FoundationDB's C client library, backed by FDQ's embedded engine.

FoundationDB's official Python binding (``fdb/impl.py``, unchanged) loads ``libfdb_c``
with ``ctypes.CDLL`` and calls about fifty ``fdb_*`` functions. :class:`Library` is what
that load returns here: every function the binding configures, with the C calling
conventions it expects, over a ``sqlite://`` database of FDQ's engine. FDQ's ``fdb://``
code path (``fdb.open``, the binding's ``Transaction``, ``Value``, ``FDBRange``,
``KeySelector``, futures and callbacks, ``fdb.transactional``, ``on_error``, options)
then runs for real on a machine where no FoundationDB client can be installed.

Conventions reproduced (bindings/c/foundationdb/fdb_c.h):

* functions that can fail synchronously return an error code (the binding's
  ``errcheck=check_error_code`` raises ``FDBError``); functions that start work return a
  future handle; destructors and mutations return nothing (their errors are deferred to
  the next read or the commit, as a real client defers them);
* results leave through out-parameters (``*present, **bytes, *length``; ``**KeyValue,
  *count, *more``) pointing into memory the future owns until
  ``fdb_future_release_memory`` or ``fdb_future_destroy``;
* a future's callback runs at once on the caller's thread when the future is ready, else
  on the thread that runs ``fdb_run_network`` (the binding's network thread).

Modes (``Library(ffi=..., network=..., strict=...)``, or ``$FDQ_STANDIN``, see
:func:`modes_from_env`):

* ``ffi``: every call goes through libffi. Each function is a real C function pointer (a
  ``CFUNCTYPE`` trampoline into Python), so ctypes applies the binding's own
  ``argtypes``, ``restype`` and ``errcheck`` exactly as it does for the real library.
  Without it, calls reach Python directly and the wrapper applies ``errcheck`` itself
  (ctypes would never run it on a Python object).
* ``network``: operations are executed on the network thread, in the order they were
  issued per process (as a real client's thread-safe layer queues everything onto its one
  network thread), and complete there; retry backoff is a timer on that thread. Without
  it, operations complete at once on the caller's thread.
* ``strict``: what a cluster does that a fast local engine would hide. A read whose
  result was not asked for (``get_*``, ``block_until_ready`` or a callback) before its
  transaction is reset, retried, cancelled or destroyed fails with
  ``transaction_cancelled`` (1025): on a cluster such a read is still in flight then, and
  FoundationDB's read-your-writes transaction cancels it. A commit first makes the
  transaction's reads final (a real commit waits for them). Any call after ``fork()`` or
  after ``fdb_stop_network`` fails with ``client_invalid_operation`` (2000), where a real
  client would hang. Memory of a released future is overwritten.

Recording: ``Library.recorder``, when set, is called with each committed attempt's
calls in order (mutations, conflicting reads, conflict ranges, options): what
``bench/hotspots.py`` reports on. None (the default) records nothing.

Which database a cluster file names: the stand-in serves a cluster file that carries a
``# standin {json}`` line after its connection string (``path``: the SQLite file;
optional ``fault_injection``, ``seed``, ``synchronous``: the engine's URL options). Any
other cluster file names a real cluster, which the stand-in cannot reach: its operations
never complete (a transaction timeout ends them with 1031), as with a real client whose
coordinators do not answer. :func:`write_cluster_file` writes one.

What it cannot show: everything a server decides stays the embedded engine's
(conflicts, versions, limits, watches, the 5-second rule), and there is no latency,
recovery, or data distribution. Reads are batched by rows, not bytes.
"""
from __future__ import annotations

import ctypes
import heapq
import itertools
import json
import os
import queue
import struct
import sys
import threading
import time
import traceback

from fdb import fdboptions

from fdq.engine import sqlite as engine
from fdq.errors import ERROR_NAMES, EngineError, MAYBE_COMMITTED, RETRYABLE, RETRYABLE_NOT_COMMITTED

MAX_API_VERSION = 730

# The descriptions fdb_get_error returns (flow/include/flow/error_definitions.h).
_ERRORS = {code: desc for code, (_name, desc) in ERROR_NAMES.items()}
_ERRORS.update({
    1102: "Future has been released",
    2015: "Future not ready",
    2008: "Action not possible before the network is configured",
    2009: "Network can be configured only once",
    2026: "Detected a deadlock in a callback called from the network thread",
    2104: "Cluster file not found",
    2201: "API version may be set only once",
    2203: "API version not supported",
    2210: "Exact mode requires a row limit",
})

_PREDICATES = {50000: RETRYABLE, 50001: MAYBE_COMMITTED, 50002: RETRYABLE_NOT_COMMITTED}


def _names_by_code(options: dict) -> dict:
    names = {}
    for name, spec in options.items():
        names.setdefault(spec[0], []).append(name)
    return names


_TR_OPTIONS = _names_by_code(fdboptions.TransactionOption)
_DB_OPTIONS = _names_by_code(fdboptions.DatabaseOption)
# Atomic operation codes -> the engine's method (``and`` and ``bit_and`` share a code).
_MUTATIONS = {code: next(n if hasattr(engine.Transaction, n) else "bit_" + n for n in names)
              for code, names in _names_by_code(fdboptions.MutationType).items()}
_MUTATION_NAMES = {code: names[0] for code, names in _names_by_code(fdboptions.MutationType).items()}
_STREAMING = {v[0]: k for k, v in fdboptions.StreamingMode.items()}

# Bytes per range batch (bindings/c/fdb_c.cpp, fdb_transaction_get_range_impl): the
# iterator mode's progression by iteration, the fixed modes' sizes; want_all is read as
# serial; exact has no byte limit (its row limit alone). A batch holds the rows up to and
# including the one that reaches the limit.
_ITERATOR_BYTES = (4096, 6144, 9216, 13824, 20736, 31104, 46656, 69984, 80000, 120000)
_MODE_BYTES = {"small": 256, "medium": 1000, "large": 4096, "serial": 80000, "want_all": 80000, "exact": None}
_MIN_ROW_BYTES = 16     # the most rows a batch can hold: bytes / this

SERVED_MARK = "# standin "
TIMEOUT_OPTION = fdboptions.TransactionOption["timeout"][0]
DB_TIMEOUT_OPTION = fdboptions.DatabaseOption["transaction_timeout"][0]


def write_cluster_file(cluster_file, sqlite_path, **engine_options) -> str:
    """Write a cluster file the stand-in serves from ``sqlite_path`` (engine options:
    ``fault_injection``, ``seed``, ``synchronous``); returns its path."""
    settings = dict(engine_options, path=os.path.abspath(str(sqlite_path)))
    with open(cluster_file, "w") as f:
        f.write(f"standin:{os.urandom(4).hex()}@127.0.0.1:4500\n{SERVED_MARK}{json.dumps(settings)}\n")
    return str(cluster_file)


def modes_from_env(value: str | None = None) -> dict:
    """``$FDQ_STANDIN``: comma-separated words among ``ffi``, ``network``, ``strict``
    (``all`` for the three)."""
    words = {w.strip() for w in (value if value is not None else os.environ.get("FDQ_STANDIN", "")).split(",")
             if w.strip()}
    if "all" in words:
        words |= {"ffi", "network", "strict"}
    unknown = words - {"ffi", "network", "strict", "all", "on"}
    if unknown:
        raise ValueError(f"FDQ_STANDIN: unknown mode(s) {sorted(unknown)} (ffi, network, strict, all)")
    return {"ffi": "ffi" in words, "network": "network" in words, "strict": "strict" in words}


class _Err(Exception):
    """An FDB error code raised inside the stand-in."""

    def __init__(self, code: int):
        self.code = code


# -- futures -----------------------------------------------------------------------------

class _Future:
    """A future handle's state. ``kind`` decides which ``fdb_future_get_*`` reads it."""

    __slots__ = ("lib", "h", "kind", "done", "error", "result", "callbacks", "claimed", "final",
                 "doomed", "memory", "released", "lock", "engine_future")

    def __init__(self, lib, kind: str):
        self.lib = lib
        self.h = lib._new(self)
        self.kind = kind
        self.done = False
        self.error = 0
        self.result = None
        self.callbacks = []
        self.claimed = False    # its result was asked for (strict mode's "waited for")
        self.final = False      # its transaction committed: the result stays
        self.doomed = False     # strict mode: its transaction ended before anyone asked
        self.memory = None
        self.released = False
        self.lock = threading.Lock()
        self.engine_future = None

    def resolve(self, result=None, error: int = 0):
        with self.lock:
            if self.done:
                return
            if self.doomed:
                result, error = None, 1025
            self.result, self.error, self.done = result, error, True
            callbacks, self.callbacks = self.callbacks, []
        for cb, param in callbacks:
            self.lib._call_back(self, cb, param)

    def doom(self):
        """Strict mode: fail with 1025 as a read still in flight when its transaction
        ends (a completed one too: on a cluster it would not have completed yet)."""
        with self.lock:
            self.doomed = True
            if self.done:
                self.result, self.error = None, 1025


# -- transactions ------------------------------------------------------------------------

class _Transaction:
    __slots__ = ("db", "engine", "futures", "destroyed", "timeout_ms", "created", "deferred",
                 "vs_futures", "calls")

    def __init__(self, db):
        self.db = db
        self.engine = db.engine.create_transaction() if db.engine is not None else None
        self.futures = []       # read futures of this attempt (strict mode)
        self.destroyed = False
        self.timeout_ms = db.timeout_ms
        self.created = time.monotonic()
        self.deferred = 0       # an error of a void call, for the next read or commit
        self.vs_futures = []
        self.calls = []         # this attempt's calls, for Library.recorder


class _Database:
    __slots__ = ("engine", "timeout_ms", "cluster_file", "estimate_scale")

    def __init__(self, engine_db, cluster_file, estimate_scale=1):
        self.engine = engine_db   # None: a cluster the stand-in cannot reach
        self.timeout_ms = 0
        self.cluster_file = cluster_file
        self.estimate_scale = estimate_scale   # plays a database this many times larger


# -- reading the binding's arguments ------------------------------------------------------

def _bytes(p, n: int) -> bytes:
    """``n`` bytes at ``p``: an address (ffi mode) or the binding's own bytes (direct)."""
    if type(p) is bytes:
        return p if len(p) == n else p[:n]
    if not n or p is None:
        return b""
    return ctypes.string_at(p, n)


def _address(p) -> int:
    """The address an out-parameter points to: an int (ffi) or ``ctypes.byref(x)``."""
    if type(p) is int:
        return p
    obj = getattr(p, "_obj", None)
    if obj is not None:
        return ctypes.addressof(obj)
    raise TypeError(f"not a pointer: {p!r}")


def _handle(h) -> int:
    if isinstance(h, ctypes.c_void_p):
        return h.value or 0
    return h or 0


def _put(p, ctype, value):
    ctype.from_address(_address(p)).value = value


class KeyValueStruct(ctypes.Structure):
    # As fdb_c.h's FDBKeyValue (and the binding's KeyValueStruct): packed to 4 bytes.
    _fields_ = [("key", ctypes.c_void_p), ("key_length", ctypes.c_int),
                ("value", ctypes.c_void_p), ("value_length", ctypes.c_int)]
    _pack_ = 4


class KeyStruct(ctypes.Structure):
    _fields_ = [("key", ctypes.c_void_p), ("key_length", ctypes.c_int)]
    _pack_ = 4


_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_interrupts = threading.local()   # ffi mode: an interrupt raised inside a trampoline

# The C signature of every function the binding configures: (restype, argtypes). Used
# only by ffi mode's trampolines, which take pointers as addresses.
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class Library:
    """What ``ctypes.CDLL("libfdb_c.so")`` returns under the stand-in."""

    def __init__(self, *, ffi: bool = False, network: bool = False, strict: bool = False,
                 max_api_version: int = MAX_API_VERSION):
        self._ffi, self._network, self._strict = ffi, network, strict
        self._max_api = max_api_version
        self._pid = None        # the process that set up the network (a child of it cannot use it)
        self._api = None
        self._setup = False
        self._running = False
        self._stopped = False
        self._thread_ident = None
        self._queue = queue.SimpleQueue()
        self._timers = []
        self._timer_lock = threading.Lock()
        self._handles = {}
        self._ids = itertools.count(0x7f0000001000, 16)
        self._functions = {}
        self._error_strings = {}
        self.internal_errors = []   # exceptions inside the stand-in itself (a test bug)
        # recorder(calls): called with each committed attempt's mutations, reads, conflict
        # ranges and options in order (bench/hotspots.py), tuples such as ("set", key,
        # value_bytes), ("atomic", key, op, param_bytes), ("clear_range", b, e),
        # ("read", b, e) (a conflicting read's range), ("conflict", "read"|"write", b, e)
        self.recorder = None

    # -- the CDLL surface ---------------------------------------------------------------

    def __getattr__(self, name):
        if not name.startswith("fdb_"):
            raise AttributeError(name)
        impl = getattr(type(self), "_" + name, None)
        if impl is None:
            raise AttributeError(f"libfdb_c stand-in: no function {name}")
        f = self._functions.get(name)
        if f is None:
            f = self._functions[name] = (_FfiFunction if self._ffi else _DirectFunction)(self, name, impl)
        return f

    # -- handles ------------------------------------------------------------------------

    def _new(self, obj) -> int:
        """A handle for ``obj``, as the pointer the binding keeps."""
        h = next(self._ids)
        self._handles[h] = obj
        return h

    def _get(self, h, kind):
        obj = self._handles.get(_handle(h))
        if not isinstance(obj, kind):
            raise _Err(2000)
        return obj

    def _check_process(self):
        if self._strict and ((self._pid is not None and os.getpid() != self._pid) or self._stopped):
            # A real client hangs here (its network thread is not in this process, or
            # stopped); fail loudly instead. A library loaded before a fork, whose network
            # was not set up yet, works in the child (PySpark's daemon forks its workers).
            raise _Err(2000)

    # -- the network thread -------------------------------------------------------------

    def _submit(self, fut: _Future | None, fn, tr: _Transaction | None = None):
        """Run ``fn()`` for ``fut`` now (inline) or on the network thread, in order."""
        if tr is not None and tr.db.engine is None:
            self._hang(fut, tr)
            return
        if self._network and threading.get_ident() != self._thread_ident:
            self._queue.put((fut, fn, tr))
        else:
            self._execute(fut, fn, tr)

    def _execute(self, fut, fn, tr):
        if tr is not None and tr.destroyed:
            if fut is not None:
                fut.resolve(None, 1025)
            return
        try:
            result = fn()
        except _Err as e:
            if fut is not None:
                fut.resolve(None, e.code)
            elif tr is not None and not tr.deferred:
                tr.deferred = e.code
            return
        except EngineError as e:
            if fut is not None:
                fut.resolve(None, e.code)
            elif tr is not None and not tr.deferred:
                tr.deferred = e.code
            return
        except Exception as e:     # noqa: BLE001 - a bug of the stand-in or a TypeError of the engine
            self.internal_errors.append(e)
            traceback.print_exc()
            if fut is not None:
                fut.resolve(None, 4100)
            return
        if fut is not None and result is not _PENDING:
            fut.resolve(result)

    def _hang(self, fut, tr):
        """An operation of a database the stand-in cannot reach: pending until the
        transaction's timeout (1031), as on a client whose coordinators never answer."""
        if fut is None or not tr.timeout_ms:
            return
        self._after(max(0.0, tr.created + tr.timeout_ms / 1000 - time.monotonic()),
                    lambda: fut.resolve(None, 1031))

    def _after(self, delay: float, fn):
        if not self._network:
            time.sleep(delay)
            fn()
            return
        with self._timer_lock:
            heapq.heappush(self._timers, (time.monotonic() + delay, next(self._ids), fn))
        self._queue.put(None)   # wake the loop to see the new deadline

    def _call_back(self, fut, cb, param):
        """Run a future's callback: at once if on the network thread (or no network
        mode), else queued for the network thread."""
        if self._network and self._running and threading.get_ident() != self._thread_ident:
            self._queue.put((None, lambda: self._invoke(cb, fut.h, param), None))
        else:
            self._invoke(cb, fut.h, param)

    @staticmethod
    def _invoke(cb, h, param):
        if callable(cb) and not isinstance(cb, ctypes._CFuncPtr):
            cb(h, param)          # the stand-in's own (block_until_ready)
            return
        if type(cb) is not int:
            cb = ctypes.cast(cb, ctypes.c_void_p).value
        _CALLBACK(cb)(h, param)   # the binding's callback, called as C calls it

    # -- API version, errors, network ----------------------------------------------------

    def _fdb_get_max_api_version(self):
        return self._max_api

    def _fdb_select_api_version_impl(self, runtime, header):
        if header > self._max_api or runtime > self._max_api:
            return 2203
        if self._api is not None and self._api != runtime:
            return 2201
        self._api = runtime
        return 0

    def _fdb_get_error(self, code):
        return _ERRORS.get(code, "Unknown error").encode()

    def _fdb_error_predicate(self, predicate, code):
        return int(code in _PREDICATES.get(predicate, ()))

    def _fdb_network_set_option(self, option, param, length):
        return 0

    def _fdb_setup_network(self):
        if self._setup:
            return 2009
        self._setup = True
        self._pid = os.getpid()
        return 0

    def _fdb_run_network(self):
        if not self._setup:
            return 2008
        self._thread_ident = threading.get_ident()
        self._running = True
        try:
            self._loop()
        finally:
            self._running = False
        return 0

    def _loop(self):
        while True:
            timeout = None
            with self._timer_lock:
                while self._timers and self._timers[0][0] <= time.monotonic():
                    _due, _n, fn = heapq.heappop(self._timers)
                    self._timer_lock.release()
                    try:
                        self._run_guarded(fn)
                    finally:
                        self._timer_lock.acquire()
                if self._timers:
                    timeout = max(0.0, self._timers[0][0] - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                continue
            if item is None:
                continue
            if item == "stop":
                return
            fut, fn, tr = item
            self._execute(fut, fn, tr)

    def _run_guarded(self, fn):
        try:
            fn()
        except Exception as e:     # noqa: BLE001
            self.internal_errors.append(e)
            traceback.print_exc()

    def _fdb_stop_network(self):
        if not self._setup:
            return 2008
        self._stopped = True
        self._queue.put("stop")
        return 0

    # -- futures ------------------------------------------------------------------------

    def _fdb_future_destroy(self, f):
        fut = self._handles.pop(_handle(f), None)
        if isinstance(fut, _Future):
            if not fut.done:
                # As FDB: destroying a future cancels its operation (a watch stops counting).
                _cancel_engine(fut)
                fut.resolve(None, 1101)
            fut.memory = None

    def _fdb_future_release_memory(self, f):
        fut = self._handles.get(_handle(f))
        if isinstance(fut, _Future) and fut.memory is not None:
            if self._strict:
                for buf in fut.memory:
                    ctypes.memset(buf, 0xDD, ctypes.sizeof(buf))
            fut.released = True

    def _fdb_future_cancel(self, f):
        fut = self._handles.get(_handle(f))
        if isinstance(fut, _Future) and not fut.done:
            _cancel_engine(fut)
            fut.resolve(None, 1101)

    def _fdb_future_is_ready(self, f):
        fut = self._handles.get(_handle(f))
        return int(isinstance(fut, _Future) and fut.done)

    def _fdb_future_block_until_ready(self, f):
        fut = self._get(f, _Future)
        fut.claimed = True
        if fut.done:
            return 0
        if self._network and threading.get_ident() == self._thread_ident:
            return 2026
        done = threading.Event()
        with fut.lock:
            if not fut.done:
                fut.callbacks.append((lambda _h, _p: done.set(), None))
            else:
                done.set()
        done.wait()
        return 0

    def _fdb_future_set_callback(self, f, cb, param):
        fut = self._get(f, _Future)
        fut.claimed = True
        with fut.lock:
            if not fut.done:
                fut.callbacks.append((cb, param))
                return 0
        self._invoke(cb, fut.h, param)
        return 0

    def _result(self, f, kind=None):
        fut = self._get(f, _Future)
        fut.claimed = True
        if not fut.done:
            raise _Err(2015 if self._strict else 2000)    # future_not_set
        if fut.error:
            raise _Err(fut.error)
        if fut.released:
            raise _Err(1102)
        if kind is not None and fut.kind not in kind:
            raise _Err(2000)
        return fut

    def _fdb_future_get_error(self, f):
        fut = self._get(f, _Future)
        fut.claimed = True
        if not fut.done:
            return 2015
        return fut.error

    def _fdb_future_get_int64(self, f, out):
        fut = self._result(f, ("int64",))
        _put(out, ctypes.c_int64, fut.result)
        return 0

    def _fdb_future_get_uint64(self, f, out):
        fut = self._result(f, ("int64",))
        _put(out, ctypes.c_uint64, fut.result)
        return 0

    def _keep(self, fut, data: bytes):
        buf = ctypes.create_string_buffer(data, len(data) or 1)
        fut.memory = (fut.memory or ()) + (buf,)
        return ctypes.addressof(buf)

    def _fdb_future_get_key(self, f, out_key, out_length):
        fut = self._result(f, ("key",))
        if fut.memory is None:
            self._keep(fut, fut.result)
        _put(out_key, ctypes.c_void_p, ctypes.addressof(fut.memory[0]))
        _put(out_length, ctypes.c_int, len(fut.result))
        return 0

    def _fdb_future_get_value(self, f, out_present, out_value, out_length):
        fut = self._result(f, ("value",))
        value = fut.result
        _put(out_present, ctypes.c_int, int(value is not None))
        if value is None:
            _put(out_value, ctypes.c_void_p, None)
            _put(out_length, ctypes.c_int, 0)
            return 0
        if fut.memory is None:
            self._keep(fut, value)
        _put(out_value, ctypes.c_void_p, ctypes.addressof(fut.memory[0]))
        _put(out_length, ctypes.c_int, len(value))
        return 0

    def _fdb_future_get_keyvalue_array(self, f, out_kvs, out_count, out_more):
        fut = self._result(f, ("kvs",))
        rows, more = fut.result
        if fut.memory is None:
            data = b"".join(k + v for k, v in rows)
            base = self._keep(fut, data)
            array = (KeyValueStruct * max(1, len(rows)))()
            at = base
            for i, (k, v) in enumerate(rows):
                array[i].key, array[i].key_length = at, len(k)
                at += len(k)
                array[i].value, array[i].value_length = at, len(v)
                at += len(v)
            fut.memory = fut.memory + (array,)
        _put(out_kvs, ctypes.c_void_p, ctypes.addressof(fut.memory[1]))
        _put(out_count, ctypes.c_int, len(rows))
        _put(out_more, ctypes.c_int, int(more))
        return 0

    def _fdb_future_get_key_array(self, f, out_keys, out_count):
        fut = self._result(f, ("keys",))
        keys = fut.result
        if fut.memory is None:
            base = self._keep(fut, b"".join(keys))
            array = (KeyStruct * max(1, len(keys)))()
            at = base
            for i, k in enumerate(keys):
                array[i].key, array[i].key_length = at, len(k)
                at += len(k)
            fut.memory = fut.memory + (array,)
        _put(out_keys, ctypes.c_void_p, ctypes.addressof(fut.memory[1]))
        _put(out_count, ctypes.c_int, len(keys))
        return 0

    def _fdb_future_get_string_array(self, f, out_strings, out_count):
        fut = self._result(f, ("strings",))
        array = (ctypes.c_char_p * max(1, len(fut.result)))(*fut.result)
        fut.memory = (array,)
        _put(out_strings, ctypes.c_void_p, ctypes.addressof(array))
        _put(out_count, ctypes.c_int, len(fut.result))
        return 0

    # -- databases ----------------------------------------------------------------------

    def _fdb_create_database(self, cluster_file, out):
        self._check_process()
        path = _cstring(cluster_file) or os.environ.get("FDB_CLUSTER_FILE") or "/etc/foundationdb/fdb.cluster"
        try:
            with open(path) as fh:
                lines = fh.read().splitlines()
        except OSError:
            return 2104
        settings = None
        for line in lines[1:]:
            if line.startswith(SERVED_MARK):
                settings = json.loads(line[len(SERVED_MARK):])
        engine_db, scale = None, 1
        if settings is not None:
            settings = dict(settings)
            scale = settings.pop("estimate_scale", 1)
            engine_db = engine.Database(settings.pop("path"), **settings)
        _put(out, ctypes.c_void_p, self._new(_Database(engine_db, path, scale)))
        return 0

    def _fdb_database_destroy(self, d):
        self._handles.pop(_handle(d), None)

    def _fdb_database_set_option(self, d, option, param, length):
        self._check_process()
        db = self._get(d, _Database)
        value = _bytes(param, length)
        if option == DB_TIMEOUT_OPTION:
            db.timeout_ms = struct.unpack("<q", value)[0]
        if db.engine is not None:
            _apply_option(db.engine.options, _DB_OPTIONS, option, value)
        return 0

    def _fdb_database_open_tenant(self, d, name, length, out):
        return 2000   # tenants are not part of FDQ's subset

    def _fdb_database_create_transaction(self, d, out):
        self._check_process()
        db = self._get(d, _Database)
        _put(out, ctypes.c_void_p, self._new(_Transaction(db)))
        return 0

    def _fdb_database_get_client_status(self, d):
        fut = _Future(self, "key")
        fut.resolve(b"{}")
        return fut.h

    def _fdb_tenant_destroy(self, t):
        self._handles.pop(_handle(t), None)

    def _fdb_tenant_get_id(self, t):
        return self._failed("int64", 2000)

    def _fdb_tenant_create_transaction(self, t, out):
        return 2000

    # -- transactions -------------------------------------------------------------------

    def _tr(self, t) -> _Transaction:
        self._check_process()
        return self._get(t, _Transaction)

    def _future_op(self, t, kind, fn, read=True):
        """A future for ``fn(tr)``, run in order with the transaction's other calls."""
        tr = self._tr(t)
        fut = _Future(self, kind)
        if read:
            tr.futures.append(fut)

        def run():
            if tr.deferred:
                raise _Err(tr.deferred)
            return fn(tr)
        self._submit(fut, run, tr)
        return fut.h

    def _void_op(self, t, fn):
        tr = self._tr(t)
        self._submit(None, lambda: fn(tr), tr)

    def _end_attempt(self, tr: _Transaction):
        """At the call that ends an attempt (reset, on_error, cancel, destroy), on the
        caller's thread: in strict mode, the attempt's reads nobody asked for fail."""
        if self._strict:
            for fut in tr.futures:
                if not fut.claimed and not fut.final:
                    fut.doom()
        tr.futures = []

    def _record(self, tr: _Transaction, *call):
        if self.recorder is not None:
            tr.calls.append(call)

    def _settle_versionstamps(self, tr):
        still = []
        for fut in tr.vs_futures:
            ef = fut.engine_future
            if ef.is_ready():
                try:
                    fut.resolve(bytes(ef.value))
                except EngineError as e:
                    fut.resolve(None, e.code)
            else:
                still.append(fut)
        tr.vs_futures = still

    def _fdb_transaction_destroy(self, t):
        tr = self._handles.pop(_handle(t), None)
        if not isinstance(tr, _Transaction):
            return
        self._end_attempt(tr)

        def destroy():
            tr.destroyed = True
            if tr.engine is not None:
                tr.engine.cancel()
                self._settle_versionstamps(tr)
            for fut in tr.vs_futures:
                fut.resolve(None, 1025)
            tr.vs_futures = []
        if self._network and threading.get_ident() != self._thread_ident and tr.db.engine is not None:
            self._queue.put((None, destroy, None))
        else:
            destroy()

    def _fdb_transaction_cancel(self, t):
        def cancel(tr):
            tr.calls = []
            tr.engine.cancel()
            self._settle_versionstamps(tr)
        self._end_attempt(self._tr(t))
        self._void_op(t, cancel)

    def _fdb_transaction_reset(self, t):
        def reset(tr):
            tr.calls = []
            tr.engine.reset()
            tr.deferred = 0
            self._settle_versionstamps(tr)
        tr = self._tr(t)
        self._end_attempt(tr)
        tr.timeout_ms, tr.created = tr.db.timeout_ms, time.monotonic()
        self._void_op(t, reset)

    def _fdb_transaction_set_read_version(self, t, version):
        def defer(tr):
            raise _Err(2000)   # not part of FDQ's subset: the engine picks read versions
        self._void_op(t, defer)

    def _fdb_transaction_get_read_version(self, t):
        return self._future_op(t, "int64", lambda tr: tr.engine.get_read_version().wait())

    def _fdb_transaction_get(self, t, key, length, snapshot):
        key = _bytes(key, length)

        def get(tr):
            view = tr.engine.snapshot if snapshot else tr.engine
            if not snapshot:
                self._record(tr, "read", key, key + b"\x00")
            return view.get(key).value
        return self._future_op(t, "value", get)

    def _fdb_transaction_get_key(self, t, key, length, or_equal, offset, snapshot):
        selector = engine.KeySelector(_bytes(key, length), bool(or_equal), offset)

        def get_key(tr):
            view = tr.engine.snapshot if snapshot else tr.engine
            return bytes(view.get_key(selector).value)
        return self._future_op(t, "key", get_key)

    def _fdb_transaction_get_range(self, t, bkey, blen, bor, boff, ekey, elen, eor, eoff, limit,
                                   target_bytes, mode, iteration, snapshot, reverse):
        begin = _selector(_bytes(bkey, blen), bor, boff)
        end = _selector(_bytes(ekey, elen), eor, eoff)
        name = _STREAMING.get(mode)
        if name is None:
            return self._failed("kvs", 2006)
        if name == "exact" and limit <= 0:
            return self._failed("kvs", 2210)
        if name == "iterator":
            max_bytes = _ITERATOR_BYTES[min(max(iteration, 1), len(_ITERATOR_BYTES)) - 1]
        else:
            max_bytes = _MODE_BYTES[name]
        reverse = bool(reverse)
        want_all = engine.StreamingMode.want_all

        def get_range(tr):
            """One batch. Its rows are found by a snapshot read (no conflict), cut at
            the byte limit, then read again with exactly that row limit when the read
            conflicts: its conflict range ends at the last row delivered, as FDB's."""
            if max_bytes is None:
                view = tr.engine.snapshot if snapshot else tr.engine
                got = [(kv.key, kv.value) for kv in view.get_range(begin, end, limit=limit, reverse=reverse,
                                                                     streaming_mode=want_all)]
                return got, False
            peek_rows = max_bytes // _MIN_ROW_BYTES
            if limit > 0:
                peek_rows = min(peek_rows, limit)
            peek = tr.engine.snapshot.get_range(begin, end, limit=peek_rows, reverse=reverse,
                                                streaming_mode=want_all)
            got, size = [], 0
            for kv in peek:
                got.append((kv.key, kv.value))
                size += len(kv.key) + len(kv.value)
                if size >= max_bytes:
                    break
            more = len(got) == peek_rows or size >= max_bytes
            if limit > 0 and len(got) >= limit:
                more = False
            if not snapshot:
                # cut by bytes: exactly the rows found; else as asked (an exhausted read
                # conflicts on the whole range)
                got = [(kv.key, kv.value) for kv in
                       tr.engine.get_range(begin, end, limit=len(got) if more else max(limit, 0),
                                           reverse=reverse, streaming_mode=want_all)]
                if self.recorder is not None:
                    b, e = (getattr(x, "key", x) for x in (begin, end))
                    if got and (more or 0 < limit <= len(got)):
                        b, e = (got[-1][0], e) if reverse else (b, got[-1][0] + b"\x00")
                    self._record(tr, "read", b, e)
            return got, more
        return self._future_op(t, "kvs", get_range)

    def _failed(self, kind, code):
        fut = _Future(self, kind)
        fut.resolve(None, code)
        return fut.h

    def _fdb_transaction_get_estimated_range_size_bytes(self, t, bkey, blen, ekey, elen):
        b, e = _bytes(bkey, blen), _bytes(ekey, elen)
        return self._future_op(t, "int64", lambda tr: tr.db.estimate_scale *
                               tr.engine.get_estimated_range_size_bytes(b, e).wait())

    def _fdb_transaction_get_range_split_points(self, t, bkey, blen, ekey, elen, chunk_size):
        b, e = _bytes(bkey, blen), _bytes(ekey, elen)
        if chunk_size <= 0:
            # what a chunk size past the binding's 32-bit C int arrives as
            return self._failed("keys", 2000)
        return self._future_op(t, "keys", lambda tr: tr.engine.get_range_split_points(
            b, e, max(1, chunk_size // tr.db.estimate_scale)).wait())

    def _fdb_transaction_get_addresses_for_key(self, t, key, length):
        return self._future_op(t, "strings", lambda tr: [b"127.0.0.1:4500"])

    def _fdb_transaction_add_conflict_range(self, t, bkey, blen, ekey, elen, kind):
        b, e = _bytes(bkey, blen), _bytes(ekey, elen)
        if b > e:
            return 2005    # validated at the call, as fdb_c does; applied in order
        if kind not in (0, 1):
            return 2006

        def add(tr):
            self._record(tr, "conflict", "write" if kind else "read", b, e)
            (tr.engine.add_read_conflict_range if kind == 0 else tr.engine.add_write_conflict_range)(b, e)
        self._void_op(t, add)
        return 0

    def _fdb_transaction_set_option(self, t, option, param, length):
        value = _bytes(param, length)
        tr = self._tr(t)
        if option == TIMEOUT_OPTION:
            tr.timeout_ms = struct.unpack("<q", value)[0]
        if tr.db.engine is None:
            return 0
        def apply(tr):
            self._record(tr, "option", _TR_OPTIONS.get(option, [str(option)])[0])
            _apply_option(tr.engine.options, _TR_OPTIONS, option, value)
        self._void_op(t, apply)
        return 0

    def _fdb_transaction_atomic_op(self, t, key, klen, param, plen, code):
        key, param = _bytes(key, klen), _bytes(param, plen)
        method = _MUTATIONS.get(code)

        def atomic(tr):
            if method is None:
                raise _Err(2000)   # deferred, as a real client defers an unknown mutation type
            self._record(tr, "atomic", key, _MUTATION_NAMES[code], len(param))
            getattr(tr.engine, method)(key, param)
        self._void_op(t, atomic)

    def _fdb_transaction_set(self, t, key, klen, value, vlen):
        key, value = _bytes(key, klen), _bytes(value, vlen)

        def set_(tr):
            self._record(tr, "set", key, len(value))
            tr.engine.set(key, value)
        self._void_op(t, set_)

    def _fdb_transaction_clear(self, t, key, klen):
        key = _bytes(key, klen)

        def clear(tr):
            self._record(tr, "clear", key)
            tr.engine.clear(key)
        self._void_op(t, clear)

    def _fdb_transaction_clear_range(self, t, bkey, blen, ekey, elen):
        b, e = _bytes(bkey, blen), _bytes(ekey, elen)

        def clear_range(tr):
            self._record(tr, "clear_range", b, e)
            tr.engine.clear_range(b, e)
        self._void_op(t, clear_range)

    def _fdb_transaction_watch(self, t, key, klen):
        key = _bytes(key, klen)
        tr = self._tr(t)
        fut = _Future(self, "void")

        def watch():
            if tr.deferred:
                raise _Err(tr.deferred)
            ef = fut.engine_future = tr.engine.watch(key)
            ef.on_ready(lambda f: self._settle_engine(fut, f))
            return _PENDING
        self._submit(fut, watch, tr)
        return fut.h

    def _settle_engine(self, fut, ef):
        try:
            ef.wait()
        except EngineError as e:
            fut.resolve(None, e.code)
            return
        fut.resolve(None)

    def _fdb_transaction_commit(self, t):
        def commit(tr):
            try:
                if tr.deferred:
                    tr.engine.cancel()
                    raise _Err(tr.deferred)
                tr.engine.commit().wait()
                if self.recorder is not None:
                    self.recorder(tr.calls)
            finally:
                tr.calls = []
                self._settle_versionstamps(tr)
        for fut in self._tr(t).futures:
            fut.final = True   # a real commit waits for the transaction's reads
        return self._future_op(t, "void", commit, read=False)

    def _fdb_transaction_get_committed_version(self, t, out):
        tr = self._tr(t)
        _put(out, ctypes.c_int64, tr.engine.get_committed_version() if tr.engine is not None else -1)
        return 0

    def _fdb_transaction_get_approximate_size(self, t):
        return self._future_op(t, "int64", lambda tr: tr.engine.get_approximate_size().wait())

    def _fdb_transaction_get_versionstamp(self, t):
        tr = self._tr(t)
        fut = _Future(self, "key")

        def stamp():
            fut.engine_future = tr.engine.get_versionstamp()
            tr.vs_futures.append(fut)
            self._settle_versionstamps(tr)
            return _PENDING
        self._submit(fut, stamp, tr)
        return fut.h

    def _fdb_transaction_on_error(self, t, code):
        tr = self._tr(t)
        fut = _Future(self, "void")
        self._end_attempt(tr)
        if tr.db.engine is None:
            # Nothing reached a server: retry at once (the timeout, which spans retries,
            # ends it), or re-raise what cannot be retried.
            fut.resolve(None, 0 if code in RETRYABLE else code)
            return fut.h

        def on_error():
            tr.calls = []
            f, delay = tr.engine.prepare_retry(code)
            tr.deferred = 0
            self._settle_versionstamps(tr)
            try:
                f.wait()
            except EngineError as e:
                fut.resolve(None, e.code)
                return _PENDING
            if delay > 0:
                self._after(delay, lambda: fut.resolve(None))
            else:
                fut.resolve(None)
            return _PENDING
        self._submit(fut, on_error, tr)
        return fut.h


_PENDING = object()   # an operation whose future resolves later (watch, versionstamp, backoff)


def _cancel_engine(fut):
    """Cancel the engine future behind ``fut`` (a watch's; a versionstamp's cannot be)."""
    ef = fut.engine_future
    if isinstance(ef, engine.Future):
        ef.cancel()


def _cstring(p):
    if p is None:
        return None
    if type(p) is bytes:
        return p.decode()
    return ctypes.string_at(p).decode()


def _selector(key: bytes, or_equal, offset):
    """The engine's bound for a selector: plain keys stay plain (the binding sends every
    range bound as a selector; as selectors the engine would conflict on the spans they
    resolve across, wider than FDB's)."""
    if offset == 1 and not or_equal:
        return key                       # first_greater_or_equal(key)
    if offset == 1 and or_equal:
        return key + b"\x00"             # first_greater_than(key)
    return engine.KeySelector(key, bool(or_equal), offset)


def _apply_option(options, names: dict, code: int, value: bytes):
    """Call the engine's ``set_<name>`` for an option code; options the engine does not
    model (tracing, priorities, ...) are accepted, as a cluster accepts them."""
    for name in names.get(code, ()):
        setter = getattr(options, "set_" + name, None)
        if setter is None:
            continue
        spec = (fdboptions.TransactionOption.get(name) or fdboptions.DatabaseOption.get(name))
        kind = spec[2] if spec else type(None)
        if kind is int:
            setter(struct.unpack("<q", value)[0])
        elif kind in (str, bytes):
            setter(value)
        else:
            setter()
        return


# -- the two ways a call reaches Python ------------------------------------------------------

class _Function:
    """One ``fdb_*`` function: the binding sets ``argtypes``, ``restype`` and
    ``errcheck`` on it, as on a ctypes function of the real library."""

    def __init__(self, lib: Library, name: str, impl):
        self.lib, self.__name__, self._impl = lib, name, impl
        self.argtypes = None
        self.restype = ctypes.c_int
        self.errcheck = None

    def _call(self, *args):
        """The Python body, never raising (a C function cannot): stand-in errors become
        their code where the function returns one."""
        try:
            return self._impl(self.lib, *args)
        except _Err as e:
            code = e.code
        except Exception as e:     # noqa: BLE001 - a bug of the stand-in: never pass it as success
            self.lib.internal_errors.append(e)
            traceback.print_exc()
            code = 4100
        if self.restype in (ctypes.c_int, int):
            return code
        if self.restype is ctypes.c_void_p:           # a future: a failed one
            return self.lib._failed("void", code)
        sys.stderr.write(f"libfdb_c stand-in: {self.__name__} failed with {code} "
                         f"({_ERRORS.get(code, 'unknown')}); a void C call cannot report it\n")
        return None


class _DirectFunction(_Function):
    """Called from Python with Python objects; applies ``errcheck`` as ctypes would."""

    def __call__(self, *args):
        result = self._call(*args)
        if self.errcheck is not None:
            return self.errcheck(result, self, args)
        return result


_POINTERISH = (ctypes.c_void_p, ctypes.c_char_p)


def _c_arg(t):
    if t in _POINTERISH or (isinstance(t, type) and issubclass(t, ctypes._Pointer)):
        return ctypes.c_void_p
    return t


# The signatures of the two functions ``fdb.api_version`` calls before ``init_c_api``
# configures the rest (ctypes' defaults then: int arguments, an int result).
_UNCONFIGURED = {"fdb_select_api_version_impl": [ctypes.c_int, ctypes.c_int], "fdb_get_max_api_version": []}


class _FfiFunction(_Function):
    """A real C function pointer: a ``CFUNCTYPE`` trampoline into the Python body,
    called through a ctypes foreign function built from the binding's own ``argtypes``
    and ``restype`` (so ctypes converts the arguments and applies ``errcheck``)."""

    def __init__(self, lib, name, impl):
        self._built = None
        super().__init__(lib, name, impl)

    def __setattr__(self, name, value):
        if name in ("argtypes", "restype", "errcheck"):
            self.__dict__["_built"] = None    # rebuilt at the next call
        object.__setattr__(self, name, value)

    def __call__(self, *args):
        built = self._built
        if built is None:
            built = self._built = self._build()
        result = built[0](*args)
        interrupt = _interrupts.__dict__.pop("pending", None)
        if interrupt is not None:
            # Raised in the trampoline (a signal handler's KeyboardInterrupt, run by the
            # interpreter there): ctypes would print and drop it. It surfaces here, when
            # the C call returns, as it does after a real library's call.
            raise interrupt
        return result

    def _build(self):
        restype = self.restype
        c_res = {int: ctypes.c_int, ctypes.c_char_p: ctypes.c_void_p}.get(restype, restype)
        argtypes = list(self.argtypes if self.argtypes is not None else _UNCONFIGURED[self.__name__])
        proto = ctypes.CFUNCTYPE(c_res, *[_c_arg(t) for t in argtypes])
        lib = self.lib

        def body(*raw):
            try:
                result = self._call(*raw)
            except BaseException as e:     # noqa: BLE001 - see __call__
                _interrupts.pending = e
                return None if c_res is None else 0
            if restype is ctypes.c_char_p and result is not None:
                buf = lib._error_strings.get(result)
                if buf is None:
                    buf = lib._error_strings[result] = ctypes.create_string_buffer(result)
                return ctypes.addressof(buf)
            return result
        trampoline = proto(body)
        foreign = ctypes.CFUNCTYPE(c_res, *argtypes)(ctypes.cast(trampoline, ctypes.c_void_p).value)
        foreign.restype = restype
        if self.errcheck is not None:
            foreign.errcheck = self.errcheck
        return foreign, trampoline     # the trampoline must outlive every call
