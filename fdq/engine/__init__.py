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

from ..errors import ConnectError, EngineError
from . import sqlite
from .futures import Value
from .sqlite import KeySelector, KeyValue, StreamingMode, strinc

__all__ = ["connect", "transactional", "run_within", "retry_or_raise", "error_types", "is_transaction", "default_url", "KeySelector", "KeyValue",
           "StreamingMode", "strinc", "API_VERSION"]

# 7.3 is FoundationDB's current production line; 730 brings 4-byte versionstamp
# offsets (used by fdb.tuple.pack_with_versionstamp) and the transactional-generator
# check; the 8.0 binding accepts it with libfdb_c >= 8.0.
API_VERSION = 730

_ERROR_TYPES: tuple = (EngineError,)
_TRANSACTION_TYPES: tuple = (sqlite._ReadView,)


def _install_tuple_shim():
    """``fdb.tuple`` packs Versionstamps by checking ``isinstance(x, fdb.impl.Value)``;
    ``fdb.impl`` loads libfdb_c at import. Without the client library, give it the
    embedded engine's Value so the tuple layer works (the real module replaces the shim
    when ``fdb://`` is opened)."""
    import fdb

    if "fdb.impl" not in sys.modules:
        shim = types.ModuleType("fdb.impl")
        shim.Value = Value
        shim._fdq_shim = True
        sys.modules["fdb.impl"] = shim
        fdb.impl = shim


_install_tuple_shim()


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
        from ..keyspace import Keyspace, ensure_format
        ensure_format(db, Keyspace(), write=False)
    return db


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
    global _ERROR_TYPES, _TRANSACTION_TYPES
    cluster_file = (parts.netloc + parts.path) or None
    if cluster_file and not os.access(cluster_file, os.R_OK):
        raise ConnectError(f"{url!r}: cluster file {cluster_file!r} is not readable")
    import fdb

    impl = sys.modules.get("fdb.impl")
    if impl is not None and getattr(impl, "_fdq_shim", False):
        del sys.modules["fdb.impl"]
        del fdb.impl
    try:
        fdb.api_version(API_VERSION)
    except Exception as e:
        _install_tuple_shim()
        raise ConnectError(
            f"{url!r}: the FoundationDB client library (libfdb_c) cannot be loaded ({e}). "
            "Install the FoundationDB clients package for your platform (foundationdb-clients "
            "7.3 or newer: .deb/.rpm from FoundationDB's releases), or use sqlite:///path.db"
        ) from None
    try:
        db = fdb.open(cluster_file)
    except fdb.FDBError as e:
        raise ConnectError(f"{url!r}: {e.description} (code {e.code})") from None
    _ERROR_TYPES = (EngineError, fdb.FDBError)
    _TRANSACTION_TYPES = (sqlite._ReadView, fdb.impl.TransactionRead)
    return db


def is_transaction(obj) -> bool:
    """True for a transaction (or its snapshot view) of either engine."""
    return isinstance(obj, _TRANSACTION_TYPES)


def error_types() -> tuple:
    """The exception types engine errors arrive as (with a ``code``)."""
    return _ERROR_TYPES


def _translate(e):
    """An FDB error leaving FDQ becomes an EngineError with the same code."""
    if isinstance(e, EngineError):
        return e
    return EngineError(e.code, getattr(e, "description", None))


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
            if isinstance(target, _TRANSACTION_TYPES):
                return _no_generator(func(*args, **kwargs))
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
    tr = db.create_transaction()
    tr.options.set_timeout(int(timeout_ms))
    while True:
        try:
            result = _no_generator(func(tr, *args, **kwargs))
            tr.commit().wait()
            return result
        except _ERROR_TYPES as e:
            retry_or_raise(tr, e)
