"""The embedded engine: FoundationDB's Python API on one SQLite file.

A stand-in for the subset of the ``fdb`` binding FDQ uses, with FDB's semantics, so code
that passes here does not break on a cluster (``docs/fdb-semantics.md``):

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

Modules, by concern: :mod:`.store` (SQLite connections, the version clock, checkpoints),
:mod:`.watches`, :mod:`.database` (``Database`` and its options), :mod:`.reads` (ranges,
read views, the read path), :mod:`.transaction` (state, options, writes),
:mod:`.commit` (conflicts, versionstamps, apply, ``on_error``), :mod:`.mutations` (write
map entries, atomic ops, range sets). This package exports what other code uses: the
tests' libfdb_c stand-in, the tests and the benchmarks patch some of these classes.
Module constants (``WATCH_FALLBACK_POLL_S``, ...) are not re-exported: patch them in the
module that reads them.
"""
from __future__ import annotations

from ..futures import Future
from ..types import (DEFAULT_MAX_WATCHES, KEY_SIZE_LIMIT, SYSTEM_KEY_SIZE_LIMIT, TRANSACTION_SIZE_LIMIT,
                     VALUE_SIZE_LIMIT, KeySelector, KeyValue, StreamingMode, strinc)
from .database import Database
from .reads import _Range, _ReadView, _Snapshot
from .store import _Store
from .transaction import Transaction
from .watches import _CommitSignal, _WatchManager

__all__ = ["Database", "Transaction", "Future", "KeySelector", "KeyValue", "StreamingMode", "strinc",
           "KEY_SIZE_LIMIT", "SYSTEM_KEY_SIZE_LIMIT", "VALUE_SIZE_LIMIT", "TRANSACTION_SIZE_LIMIT",
           "DEFAULT_MAX_WATCHES", "_Range", "_ReadView", "_Snapshot", "_Store", "_WatchManager", "_CommitSignal"]
