"""FoundationDB's Python binding as FDQ meets it, however it was loaded: the error and
transaction types it brings, its client in a forked process, its per-thread wait
semaphore after an interrupt, and its tuple layer without the client library.

``fdq.connect("fdb://...")`` loads the binding; so may the application (its own
``fdb.api_version`` and ``fdb.open``), and FDQ's functions then receive FDB's objects
all the same. Both the retry loop (:mod:`.retry`) and ``connect`` (:mod:`.connection`)
read what is learned here.
"""
from __future__ import annotations

import os
import sys
import types

import fdb

from ..errors import ClientForked, EngineError
from . import sqlite
from .futures import Value

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


def is_transaction(obj) -> bool:
    """True for a transaction (or its snapshot view) of either engine."""
    return isinstance(obj, _TRANSACTION_TYPES) or (_learn_fdb_types() and isinstance(obj, _TRANSACTION_TYPES))


def error_types() -> tuple:
    """The exception types engine errors arrive as (with a ``code``)."""
    _learn_fdb_types()
    return _ERROR_TYPES


def describe(e) -> str:
    """An engine error's description as text (FDB's binding gives bytes)."""
    d = getattr(e, "description", None)
    if isinstance(d, bytes):
        d = d.decode("utf-8", "replace")
    return d or ""


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
    if "fdb.impl" not in sys.modules and not hasattr(fdb, "impl"):
        fdb.impl = types.SimpleNamespace(Value=Value)


_tuple_layer_without_client()
