"""Engines: ``connect(url)``, ``transactional`` and the one retry loop (``transact``),
the only code that knows which engine is underneath. The queue code sees FoundationDB's
Python API either way: the embedded engine (:mod:`fdq.engine.sqlite`) or FoundationDB's
own binding.

* :mod:`.connection`: URLs and ``connect``;
* :mod:`.retry`: ``transact``, ``transactional``, ``run_within``;
* :mod:`.binding`: FoundationDB's binding as FDQ meets it (its types, fork, interrupts);
* :mod:`.types`: the API's plain types and limits (``KeySelector``, ``KeyValue``, ...).
"""
from __future__ import annotations

from .binding import after_interrupt, check_process, describe, error_types, is_transaction
from .connection import API_VERSION, connect, default_url
from .retry import Again, Attempt, Done, retry_or_raise, run_within, transact, transactional
from .types import KeySelector, KeyValue, StreamingMode, strinc

__all__ = ["connect", "default_url", "transact", "Attempt", "Done", "Again", "transactional", "run_within",
           "retry_or_raise", "error_types", "is_transaction", "check_process", "after_interrupt", "describe",
           "KeySelector", "KeyValue", "StreamingMode", "strinc", "API_VERSION"]
