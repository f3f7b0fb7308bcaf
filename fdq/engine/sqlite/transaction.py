"""A transaction of the embedded engine: its state (one attempt's, reset by ``on_error``),
options, checks, writes into its write map (read-your-writes), and watches pending until
its commit. Its reads are :mod:`.reads`, its commit and retry :mod:`.commit`.
"""
from __future__ import annotations

import struct
from itertools import chain
from typing import TYPE_CHECKING

from ...errors import EngineError
from ..futures import Future
from ..types import (KEY_SIZE_LIMIT, SYSTEM_KEY_SIZE_LIMIT, TRANSACTION_SIZE_LIMIT, VALUE_SIZE_LIMIT, key_bytes,
                     strinc, value_bytes)
from .commit import _CLOSED_STATE_ERRORS, _Commit
from .mutations import _ATOMIC, _ATOMIC_OPS, _CLEAR, _SET, _VSVALUE, _merge_ranges
from .reads import _Reads, _ReadView, _Snapshot
from .store import _clock

if TYPE_CHECKING:
    from .database import Database

ENTRY_OVERHEAD_BYTES = 24  # FDB adds a few dozen bytes of struct overhead per entry

_U32 = struct.Struct("<I")
_METADATA_VERSION_KEY = b"\xff/metadataVersion"
_METADATA_VERSION_VALUE = b"\x00" * 14    # the only value it takes: a placeholder at offset 0

# The scalar state of a fresh attempt (``Transaction._reset_state``), set in one update.
_FRESH_STATE = {
    "_rv": None,
    "_rv_clock": None,
    "_sorted_keys": None,
    "_unreadable_n": 0,      # how many of _vs_keys _unreadable covers (built on a read)
    # Versionstamped values: their keys are unreadable until commit even if written again
    # later (their [k, k+\x00) ranges are in _unreadable).
    "_vs_values": 0,
    "_mutation_bytes": 0,
    "_mutations": 0,
    "_deferred": None,
    "_vs_future": None,
    "_vs_result": None,      # (stamp, error) once the commit has ended
    "_committed_version": None,
    "_state": "open",        # open | committing | committed | cancelled
    "_size_limit": TRANSACTION_SIZE_LIMIT,
    "_ryw_disabled": False,
    "_read_any": False,      # a read was made (read_your_writes_disable is refused after)
    "_snapshot_ryw": 0,      # see _reset_state
    "_system_keys": False,   # keys >= \xff readable (read or access_system_keys)
    "_write_system_keys": False,     # ... and writable (access_system_keys only)
    "_next_write_no_conflict": False,
    "_bypass_unreadable": False,
}


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


class Transaction(_Commit, _Reads, _ReadView):
    """As ``fdb.Transaction``. Created by ``db.create_transaction()``."""

    def __init__(self, db: Database):
        self.db = db
        self._conn = None
        self._reset_options()
        self._reset_state()

    def _reset_options(self):
        """The options that survive on_error, back to the database's defaults (as FDB's
        reset(), which clears every option)."""
        defaults = self.db._defaults
        if defaults:
            self._timeout_ms = defaults.get("timeout_ms", 0)
            self._retry_limit = defaults.get("retry_limit", -1)
            self._max_retry_delay_ms = defaults.get("max_retry_delay_ms", 1000)
        else:
            self._timeout_ms, self._retry_limit, self._max_retry_delay_ms = 0, -1, 1000
        self._created = _clock()
        self._retries = 0
        self._backoff = 0.01

    def _reset_state(self):
        if self._conn is not None:
            self._release()
        d = self.__dict__
        d.update(_FRESH_STATE)
        self._attempt = object()  # identifies this attempt: ranges must not outlive it
        self._db_values = {}     # key -> value read from this attempt's snapshot
        self._writes = {}
        self._clears = []        # merged [begin, end) cleared ranges
        self._clear_begins = []
        self._read_ranges = []
        self._write_ranges = []
        # (key as given: the stamp's 10-byte placeholder at offset, the offset in its last
        # 4 bytes; offset, value, clears before it, read version then)
        self._vs_keys = []
        self._clear_log = []     # every clear / clear_range in order (only read for _vs_keys)
        self._unreadable = []    # [begin, end) unreadable until commit (versionstamped keys)
        self._unreadable_by_head = {}   # the same ranges by the prefix every key in them has
        self._vs_value_keys = set()     # keys of versionstamped values, for point reads
        self._pending_watches = []
        defaults = self.db._defaults
        if defaults:
            self._size_limit = defaults.get("size_limit", TRANSACTION_SIZE_LIMIT)
            # Snapshot reads see own writes while this is >= 0 (enables minus disables,
            # from the database's default), as FDB's snapshotRywEnabled > 0.
            self._snapshot_ryw = defaults.get("snapshot_ryw", 0)

    @property
    def _tr(self) -> "Transaction":
        """The transaction the read views (``_ReadView``) read in: itself. A property,
        not an attribute: ``self._tr = self`` was a reference cycle, so every transaction
        waited for the cyclic GC to be freed (its read snapshot released, its pending
        watches failed), and the GC ran every few dozen transactions to free them."""
        return self

    @property
    def options(self) -> _TransactionOptions:
        return _TransactionOptions(self)

    @property
    def snapshot(self) -> "_Snapshot":
        return _Snapshot(self)

    def __del__(self):
        try:
            d = self.__dict__     # may be half set up (an __init__ that raised)
            if d.get("_conn") is not None:
                self._release()
            if d.get("_pending_watches"):
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
        if type(key) is bytes and type(value) is bytes and self._state == "open" \
                and not self._next_write_no_conflict and len(key) <= KEY_SIZE_LIMIT and key < b"\xff" \
                and 4 <= len(value) <= VALUE_SIZE_LIMIT:
            # The common case inline (a push stamps one value per message): a legal user
            # key, the placeholder inside the value; the same effects as the path below.
            n = len(value)
            offset = _U32.unpack_from(value, n - 4)[0]
            if offset + 14 <= n:
                writes = self._writes
                if key not in writes:
                    self._sorted_keys = None
                writes[key] = (_VSVALUE, (value[:-4], offset, []))
                r = (key, key + b"\x00")
                self._unreadable.append(r)
                self._vs_value_keys.add(key)
                self._vs_values += 1
                self._write_ranges.append(r)
                self._mutation_bytes += len(key) + n + ENTRY_OVERHEAD_BYTES
                self._mutations += 1
                return
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
        reads, writes = self._read_ranges, self._write_ranges
        return (self._mutation_bytes + sum(map(len, chain.from_iterable(reads)))
                + sum(map(len, chain.from_iterable(writes))) + ENTRY_OVERHEAD_BYTES * (len(reads) + len(writes)))

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
