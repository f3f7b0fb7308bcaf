"""Engines: ``connect(url)`` and ``transactional``, the only code that knows which
engine is underneath. The queue code sees FoundationDB's Python API either way.

* ``sqlite:///abs/path.db`` (or ``sqlite:rel/path.db``): the embedded engine
  (:mod:`fdq.engine.sqlite`). Query options: ``synchronous=NORMAL|FULL|OFF|EXTRA``,
  ``fault_injection=P``, ``seed=N``.
* ``fdb://`` or ``fdb:///path/to/fdb.cluster``: FoundationDB's own ``Database`` from the
  official binding at API version 730 (see ``API_VERSION``).
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import types
import urllib.parse

from ..errors import ClientForked, ConnectError, EngineError
from . import sqlite
from .futures import Value
from .sqlite import KeySelector, KeyValue, StreamingMode, strinc

__all__ = ["connect", "transactional", "run_within", "retry_or_raise", "error_types", "is_transaction",
           "check_process", "after_interrupt", "describe", "default_url", "KeySelector", "KeyValue", "StreamingMode", "strinc",
           "API_VERSION"]

# 7.3 is FoundationDB's current production line: FDQ asks for API 730 and pins the
# `foundationdb` binding to 7.3.x (setup.cfg), which loads libfdb_c 7.3 (the 8.0 binding
# refuses a 7.3 library). An application that selected an API version itself before FDQ
# connects is accepted from MIN_API_VERSION (get_range_split_points, 4-byte versionstamp
# offsets and the transactional-generator check are all older).
API_VERSION = 730
MIN_API_VERSION = 710
CLIENT_PACKAGE = "foundationdb-clients 7.3.x (.deb/.rpm from github.com/apple/foundationdb/releases)"
CONNECT_TIMEOUT_S = 10.0

# The types engine errors and transactions arrive as: the embedded engine's, and FDB's
# once its binding is loaded (by fdq.connect or by the application: see _learn_fdb_types).
_ERROR_TYPES: tuple = (EngineError,)
_TRANSACTION_TYPES: tuple = (sqlite._ReadView,)
_fdb_impl = None
_client_forked = False   # this process was forked after its FDB client's network started


def _learn_fdb_types() -> bool:
    """Add FDB's error and transaction types once its binding is loaded, however it was
    loaded (``fdq.connect("fdb://...")``, or the application's own ``fdb.api_version``
    and ``fdb.open``). True if they were just added."""
    global _ERROR_TYPES, _TRANSACTION_TYPES, _fdb_impl
    impl = sys.modules.get("fdb.impl")
    if impl is None or impl is _fdb_impl or not hasattr(impl, "TransactionRead"):
        return False
    _fdb_impl = impl
    _ERROR_TYPES = (EngineError, impl.FDBError)
    _TRANSACTION_TYPES = (sqlite._ReadView, impl.TransactionRead)
    return True


def _note_fork():
    global _client_forked
    impl = sys.modules.get("fdb.impl")
    if impl is not None and getattr(impl, "_network_thread", None) is not None:
        _client_forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_note_fork)


def check_process(db):
    """Raise ClientForked for an FDB ``db`` in a process forked after its client started:
    FoundationDB's client has one network thread, which a forked child does not have, so
    any call would hang there. The embedded engine reopens its file after a fork."""
    if _client_forked and not isinstance(db, sqlite.Database):
        raise ClientForked(
            f"this process ({os.getpid()}) was forked after its FoundationDB client started: "
            "the client cannot be used here. Start worker processes with the 'spawn' method "
            "(multiprocessing.get_context('spawn')), or connect only after forking")


def after_interrupt():
    """Call where FDQ catches an exception that is not an ``Exception`` (KeyboardInterrupt,
    a signal handler's) before this thread uses the database again. FoundationDB's
    binding waits for a future on a per-thread semaphore, released by the future's
    callback, and replaces it only after an ``Exception``: an interrupt leaves the
    callback to release it later, and the thread's next wait could then return before
    its own future is ready (``future_not_set``, 2015). The next wait makes a fresh one."""
    impl = _fdb_impl
    if impl is not None:
        impl._thread_local_storage.__dict__.pop("future_block_semaphore", None)


def _tuple_layer_without_client():
    """``fdb.tuple`` packs a Versionstamp after checking ``isinstance(x, fdb.impl.Value)``,
    and ``fdb.impl`` loads libfdb_c when imported. Where that module is not loaded, give
    the ``fdb`` package an ``impl`` attribute holding only ``Value`` (the embedded
    engine's): the tuple layer then works without the client library. Nothing is put in
    ``sys.modules``, so ``import fdb.impl`` (``fdb.api_version``, by FDQ or by the
    application) still loads the real module, which replaces the attribute."""
    import fdb

    if "fdb.impl" not in sys.modules and not hasattr(fdb, "impl"):
        fdb.impl = types.SimpleNamespace(Value=Value)


_tuple_layer_without_client()


def default_url() -> str:
    """``$FDQ_URL``, else the embedded engine at ``$FDQ_HOME/fdq.db`` (``FDQ_HOME``
    defaults to ``$XDG_DATA_HOME/fdq``, i.e. ``~/.local/share/fdq``)."""
    url = os.environ.get("FDQ_URL")
    if url:
        return url
    home = os.environ.get("FDQ_HOME") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "fdq")
    return "sqlite://" + os.path.abspath(os.path.join(home, "fdq.db"))


def connect(url: str | None = None, *, check_format: bool = True):
    """Open the database named by ``url`` (default: :func:`default_url`).

    Returns FDB's ``Database`` for ``fdb://`` and the embedded engine's for
    ``sqlite://``. Checks FDQ's layout version (``meta/format`` under the
    default root; written on first use) unless ``check_format=False``. Raises
    :class:`fdq.errors.ConnectError` naming the URL and the cause, and
    :class:`fdq.errors.FormatError` for a database of a newer layout.
    """
    if url is None:
        url = default_url()
        if url.startswith("sqlite://") and not os.environ.get("FDQ_URL"):
            os.makedirs(os.path.dirname(urllib.parse.urlsplit(url).path), exist_ok=True)
    if not isinstance(url, str):
        raise ConnectError(f"database URL must be a string, not {type(url).__name__}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "sqlite":
        db = _connect_sqlite(url, parts)
    elif parts.scheme == "fdb":
        db = _connect_fdb(url, parts)
    else:
        raise ConnectError(f"{url!r}: unknown scheme {parts.scheme!r} "
                           "(use sqlite:///path/to/file.db or fdb:///path/to/fdb.cluster)")
    if check_format:
        _check_format(db, url, parts)
    return db


def _check_format(db, url, parts):
    """The layout check of ``connect``, bounded: an unreachable cluster answers nothing."""
    from ..keyspace import Keyspace, ensure_format
    try:
        run_within(db, int(CONNECT_TIMEOUT_S * 1000), ensure_format, Keyspace(), write=False)
    except EngineError as e:
        if e.code != 1031:
            raise
        where = (f"cluster file {(parts.netloc + parts.path) or 'the default'}"
                 if parts.scheme == "fdb" else "its file")
        raise ConnectError(f"{url!r}: no answer within {CONNECT_TIMEOUT_S:g} s ({where}): is the "
                           "database running and reachable from here?") from None


def _connect_sqlite(url, parts):
    path = parts.netloc + parts.path if parts.netloc else parts.path
    if not path:
        raise ConnectError(f"{url!r}: no database file path (sqlite:///path/to/file.db)")
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    options = {}
    known = {"synchronous": str, "fault_injection": float, "seed": int}
    for name, values in query.items():
        if name not in known:
            raise ConnectError(f"{url!r}: unknown option {name!r} (known: {', '.join(known)})")
        try:
            options[name] = known[name](values[-1])
        except ValueError:
            raise ConnectError(f"{url!r}: option {name}={values[-1]!r} is not a valid "
                               f"{known[name].__name__}") from None
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ConnectError(f"{url!r}: directory {directory!r} does not exist")
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        raise ConnectError(f"{url!r}: {path!r} is not readable and writable")
    try:
        return sqlite.Database(path, **options)
    except ValueError as e:
        raise ConnectError(f"{url!r}: {e}") from None
    except Exception as e:  # sqlite3.DatabaseError: not a database, locked, ...
        raise ConnectError(f"{url!r}: cannot open {path!r}: {e}") from None


def _connect_fdb(url, parts):
    cluster_file = (parts.netloc + parts.path) or None
    if parts.query:
        names = ", ".join(sorted(urllib.parse.parse_qs(parts.query, keep_blank_values=True)))
        raise ConnectError(f"{url!r}: unknown option(s) {names} (fdb:// takes none: the cluster "
                           "file names the cluster)")
    if cluster_file and not os.access(cluster_file, os.R_OK):
        raise ConnectError(f"{url!r}: cluster file {cluster_file!r} is not readable")
    import fdb

    _select_api_version(fdb, url)
    try:
        db = fdb.open(cluster_file)
    except fdb.FDBError as e:
        raise ConnectError(f"{url!r}: {describe(e)} (code {e.code})") from None
    _learn_fdb_types()
    return db


def _select_api_version(fdb, url):
    """``fdb.api_version(API_VERSION)``, or accept the version the application chose."""
    if fdb.is_api_version_selected():
        chosen = fdb.get_api_version()
        if chosen < MIN_API_VERSION:
            raise ConnectError(f"{url!r}: the application selected FoundationDB API version {chosen} "
                               f"(fdb.api_version); FDQ needs {MIN_API_VERSION} to {API_VERSION}")
        return
    try:
        fdb.api_version(API_VERSION)
    except Exception as e:
        binding = getattr(fdb, "__version__", "?")
        raise ConnectError(
            f"{url!r}: the FoundationDB client library (libfdb_c) cannot be used with the "
            f"'foundationdb' Python package {binding} at API version {API_VERSION} ({e}). "
            f"Install {CLIENT_PACKAGE} with the Python package 'foundationdb>=7.3,<7.4', or use "
            "sqlite:///path.db") from None


def describe(e) -> str:
    """An engine error's description as text (FDB's binding gives bytes)."""
    d = getattr(e, "description", None)
    if isinstance(d, bytes):
        d = d.decode("utf-8", "replace")
    return d or ""


def is_transaction(obj) -> bool:
    """True for a transaction (or its snapshot view) of either engine."""
    return isinstance(obj, _TRANSACTION_TYPES) or (_learn_fdb_types() and isinstance(obj, _TRANSACTION_TYPES))


def error_types() -> tuple:
    """The exception types engine errors arrive as (with a ``code``)."""
    _learn_fdb_types()
    return _ERROR_TYPES


def _translate(e):
    """An FDB error leaving FDQ becomes an EngineError with the same code."""
    if isinstance(e, EngineError):
        return e
    return EngineError(e.code, describe(e) or None)


def retry_or_raise(tr, e):
    """The body of a hand-written retry loop: ``tr.on_error(e)`` (backoff and reset) or
    raise the final error as an EngineError."""
    try:
        tr.on_error(e.code).wait()
    except _ERROR_TYPES as final:
        raise _translate(final) from (None if final is e else e)


def _no_generator(result):
    # As fdb.transactional at API >= 630: a lazy result would outlive its transaction.
    if inspect.isgenerator(result):
        raise ValueError("Generators can not be wrapped with fdq.transactional")
    return result


def transactional(func=None, *, parameter: str = "tr"):
    """As ``fdb.transactional``: called with a database, run ``func`` in a new
    transaction, commit, and retry through ``tr.on_error``; called with a transaction
    (or its snapshot), run inside it without committing.

    The transaction must be passed positionally. Generators are refused (a lazy result
    would outlive its transaction). Errors leave as :class:`fdq.errors.EngineError`.
    """
    def decorate(func):
        if inspect.isgeneratorfunction(func):
            raise ValueError("Generators can not be wrapped with fdq.transactional")
        unwrapped = inspect.unwrap(func)
        index = inspect.getfullargspec(unwrapped).args.index(parameter)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            target = args[index]
            if is_transaction(target):
                return _no_generator(func(*args, **kwargs))
            check_process(target)
            largs = list(args)
            tr = largs[index] = target.create_transaction()
            while True:
                try:
                    result = _no_generator(func(*largs, **kwargs))
                    tr.commit().wait()
                    return result
                except _ERROR_TYPES as e:
                    retry_or_raise(tr, e)
        return wrapper

    return decorate(func) if func is not None else decorate


def run_within(db, timeout_ms: int, func, *args, **kwargs):
    """Run ``func(tr, *args, **kwargs)`` in a new transaction and commit, retrying as
    ``transactional`` does, but for at most ``timeout_ms`` in all (the transaction's
    timeout option, kept across retries): past it, ``EngineError`` 1031
    (transaction_timed_out). For work that may be given up, such as a leaving
    consumer's goodbye, whose effect others reach anyway by timeouts."""
    _learn_fdb_types()
    check_process(db)
    tr = db.create_transaction()
    tr.options.set_timeout(int(timeout_ms))
    while True:
        try:
            result = _no_generator(func(tr, *args, **kwargs))
            tr.commit().wait()
            return result
        except _ERROR_TYPES as e:
            retry_or_raise(tr, e)
