"""Second review of the embedded engine against FDB's semantics (shared/fdb-semantics.md):
the divergences it found, each case failing on the engine before its fix, then the
bullets that had no test (marked as such; they passed as written). Sources are FoundationDB release-7.3
(fdbclient/ReadYourWrites.actor.cpp unless named) and the Python binding (fdb/impl.py)."""
from __future__ import annotations

import time

import pytest

from enginehelpers import code_of, wait_ready


def _other(eng, fn):
    tr = eng.db.create_transaction()
    fn(tr)
    tr.commit().wait()


def _started(eng):
    """A transaction whose read version is fixed (later commits are after it)."""
    tr = eng.db.create_transaction()
    tr.get_read_version().wait()
    return tr


# -- §4 RYW: parts of a read this transaction already set or cleared add no read conflict.
# RYWImpl::updateConflictMap inserts a read conflict only where the write map is
# unmodified or holds a dependent (atomic) operation; addReadConflictRange goes through
# it too. A conflict the engine adds there and FDB does not is one FDQ could rely on.

@pytest.mark.parametrize("write", ["set", "clear", "clear_range"])
def test_add_read_conflict_on_a_key_already_written_adds_nothing(eng, write):
    k = eng.k(b"a")
    _other(eng, lambda t: t.set(k, b"0"))
    t1 = _started(eng)
    {"set": lambda: t1.set(k, b"1"), "clear": lambda: t1.clear(k),
     "clear_range": lambda: t1.clear_range(eng.k(b"a"), eng.k(b"b"))}[write]()
    t1.add_read_conflict_key(k)
    t1.add_read_conflict_range(eng.k(b"a"), eng.k(b"a\x00"))
    _other(eng, lambda t: t.set(k, b"2"))
    assert code_of(lambda: t1.commit().wait()) is None


def test_add_read_conflict_before_the_write_or_on_an_atomic_key_conflicts(eng):
    k = eng.k(b"a")
    t1 = _started(eng)
    t1.add_read_conflict_key(k)     # recorded while the key is unmodified
    t1.set(k, b"1")
    _other(eng, lambda t: t.set(k, b"2"))
    assert code_of(lambda: t1.commit().wait()) == 1020
    t2 = _started(eng)
    t2.add(k, b"\x01")              # a dependent operation: still conflicts
    t2.add_read_conflict_key(k)
    _other(eng, lambda t: t.set(k, b"3"))
    assert code_of(lambda: t2.commit().wait()) == 1020


def test_reads_inside_an_own_cleared_range_add_no_read_conflict(eng):
    _other(eng, lambda t: t.set(eng.k(b"c"), b"0"))
    t1 = _started(eng)
    t1.clear_range(eng.k(b"a"), eng.k(b"m"))
    assert t1[eng.k(b"c")] == None  # noqa: E711
    assert list(t1.get_range(eng.k(b"a"), eng.k(b"m"))) == []
    assert t1.get_key(eng.KeySelector.first_greater_or_equal(eng.k(b"b"))) >= eng.k(b"m")
    _other(eng, lambda t: t.set(eng.k(b"c"), b"1"))
    assert code_of(lambda: t1.commit().wait()) is None


@pytest.mark.parametrize("write,expected", [(b"b", None), (b"d", None), (b"c", 1020), (b"e", 1020)])
def test_a_range_read_conflicts_only_on_keys_it_did_not_write(eng, write, expected):
    t1 = _started(eng)
    t1[eng.k(b"b")] = b"mine"
    t1.clear(eng.k(b"d"))
    t1.add(eng.k(b"e"), b"\x01")   # atomic: the read depends on the stored value
    assert [kv.key for kv in t1.get_range(eng.k(b"a"), eng.k(b"z"))] == [eng.k(b"b"), eng.k(b"e")]
    _other(eng, lambda t: t.set(eng.k(write), b"theirs"))
    assert code_of(lambda: t1.commit().wait()) == expected


# -- §1 options / §6 system keys: READ_SYSTEM_KEYS sets readSystemKeys only;
# ACCESS_SYSTEM_KEYS sets both (RYW setOptionImpl); set/clear/atomicOp check
# getMaxWriteKey(), which is normalKeys.end unless writeSystemKeys.

def test_read_system_keys_does_not_allow_writes(eng):
    tr = eng.db.create_transaction()
    tr.options.set_read_system_keys()
    tr[b"\xff/fdq-review-not-written"].wait()            # reads are allowed
    list(tr.get_range(b"\xff", b"\xff\x00", limit=1))
    tr.set(b"\xff/fdq-review-not-written", b"")
    assert code_of(lambda: tr.commit().wait()) == 2004
    for write in (lambda t: t.clear(b"\xff/fdq-review-not-written"),
                  lambda t: t.clear_range(b"\xff/fdq-review-not-written", b"\xff/fdq-review-not-writteo"),
                  lambda t: t.add(b"\xff/fdq-review-not-written", b"\x01"),
                  lambda t: t.add_write_conflict_key(b"\xff/fdq-review-not-written")):
        tr = eng.db.create_transaction()
        tr.options.set_read_system_keys()
        assert code_of(lambda: (write(tr), tr.commit().wait())) == 2004


# -- §1 read_your_writes_disable "before any read/write": RYW setOptionImpl throws
# client_invalid_operation (2000) if reads are pending, the cache or the write map is
# not empty; ThreadSafeTransaction::setOption defers it (deferredError): the next read
# or the commit raises it.

@pytest.mark.parametrize("first", ["read", "write"])
def test_read_your_writes_disable_after_a_read_or_write_fails(eng, first):
    tr = eng.db.create_transaction()
    if first == "read":
        tr[eng.k(b"a")].wait()
    else:
        tr[eng.k(b"a")] = b"1"
    at_once = code_of(lambda: tr.options.set_read_your_writes_disable())
    assert at_once in (None, 2000)
    assert 2000 in (at_once, code_of(lambda: tr.commit().wait()))


# -- §1 snapshot RYW: with snapshot RYW disabled (disables outnumber enables) snapshot
# reads go straight to the database (RYWImpl::read with snapshot and
# snapshotRywEnabled <= 0: no write map), for get, get_key and get_range alike, and
# so never meet this transaction's unreadable versionstamped keys (§3). The database
# option sets the default (ReadYourWritesTransactionOptions::reset copies
# DatabaseContext::snapshotRywEnabled).

def test_snapshot_reads_with_snapshot_ryw_disabled_miss_own_writes(eng):
    a, b = eng.k(b"a"), eng.k(b"b")
    _other(eng, lambda t: t.set(b, b"stored"))
    tr = eng.db.create_transaction()
    tr[a] = b"mine"
    tr[b] = b"mine"
    tr.options.set_snapshot_ryw_disable()
    assert tr.snapshot[a] == None  # noqa: E711
    assert tr.snapshot[b] == b"stored"
    assert [(kv.key, kv.value) for kv in tr.snapshot.get_range(a, eng.end())] == [(b, b"stored")]
    assert tr.snapshot.get_key(eng.KeySelector.first_greater_or_equal(a)) == b
    assert tr[a] == b"mine"                                 # non-snapshot reads still see them
    assert [kv.key for kv in tr.get_range(a, eng.end())] == [a, b]
    tr.options.set_snapshot_ryw_enable()
    assert tr.snapshot[a] == b"mine"
    assert [kv.value for kv in tr.snapshot.get_range(a, eng.end())] == [b"mine", b"mine"]


def test_snapshot_reads_with_snapshot_ryw_disabled_ignore_own_versionstamped_keys(eng):
    import fdb.tuple
    tr = eng.db.create_transaction()
    tr.get_read_version().wait()
    tr.set_versionstamped_key(fdb.tuple.pack_with_versionstamp((fdb.tuple.Versionstamp(),), prefix=eng.k(b"v")), b"x")
    assert code_of(lambda: list(tr.snapshot.get_range(eng.p, eng.end()))) == 1036
    tr.options.set_snapshot_ryw_disable()
    assert list(tr.snapshot.get_range(eng.p, eng.end())) == []
    assert code_of(lambda: list(tr.get_range(eng.p, eng.end()))) == 1036


def test_the_database_snapshot_ryw_option_sets_the_default(eng):
    a = eng.k(b"a")
    eng.db.options.set_snapshot_ryw_disable()
    try:
        tr = eng.db.create_transaction()
        tr[a] = b"mine"
        assert tr.snapshot[a] == None  # noqa: E711
        tr.options.set_snapshot_ryw_enable()
        assert tr.snapshot[a] == b"mine"
    finally:
        eng.db.options.set_snapshot_ryw_enable()
    tr = eng.db.create_transaction()
    tr[a] = b"mine"
    assert tr.snapshot[a] == b"mine"


# -- §1 next_write_no_write_conflict_range: every write consumes it at its start
# (RYW set, clear and atomicOp call getAndResetWriteConflictDisabled first), a
# versionstamped key included, so it never carries over to the write after.

def test_a_versionstamped_key_consumes_next_write_no_write_conflict_range(eng):
    import fdb.tuple
    k = eng.k(b"k")
    reader = _started(eng)
    reader[k].wait()
    reader[eng.k(b"r")] = b""
    tr = eng.db.create_transaction()
    tr.options.set_next_write_no_write_conflict_range()
    tr.set_versionstamped_key(fdb.tuple.pack_with_versionstamp((fdb.tuple.Versionstamp(),), prefix=eng.k(b"v")), b"")
    tr[k] = b"1"            # has its write conflict: the option went to the stamped key
    tr.commit().wait()
    assert code_of(lambda: reader.commit().wait()) == 1020


# -- §6 key selectors past the legal key space: RYW getKey and getRange return
# key_outside_legal_range when the selector's key is above getMaxReadKey() (a selector
# resolving off the end is clamped to \xff; one *written* past it is an error).

def test_a_key_selector_past_the_legal_key_space_is_refused(eng):
    KS = eng.KeySelector
    tr = eng.db.create_transaction()
    assert code_of(lambda: tr.get_key(KS.first_greater_or_equal(b"\xff\x01")).wait()) == 2004
    assert code_of(lambda: tr.snapshot.get_key(KS.last_less_than(b"\xff\x01")).wait()) == 2004
    assert code_of(lambda: list(tr.get_range(KS.first_greater_or_equal(eng.p), KS.first_greater_or_equal(b"\xff\x01")))) == 2004
    # at exactly \xff, or resolving past the last key: clamped, no error
    assert tr.get_key(KS.first_greater_or_equal(b"\xff")) == b"\xff"
    assert tr.get_key(KS.first_greater_than(b"\xfe\xff\xff")) == b"\xff"
    assert tr.get_key(KS.last_less_than(b"")) == b""
    tr = eng.db.create_transaction()
    tr.options.set_read_system_keys()
    assert code_of(lambda: tr.get_key(KS.first_greater_or_equal(b"\xff\x01")).wait()) is None


# -- Bullets that had no test; each passed on the engine when written.

def test_the_timeout_spans_retries_and_only_three_options_survive_on_error(eng):
    """§1/§5: only timeout, retry limit and max retry delay are persistent (RYW
    resetRyow re-applies persistentOptions); the timeout counts from creation or
    reset(), not from on_error (creationTime is set by reset() only)."""
    k = eng.k(b"a")
    _other(eng, lambda t: t.set(k, b"stored"))
    tr = eng.db.create_transaction()
    tr.options.set_size_limit(100)
    tr.options.set_snapshot_ryw_disable()
    tr.options.set_read_system_keys()
    tr[k] = b"mine"
    assert tr.snapshot[k] == b"stored"
    tr.on_error(1020).wait()
    assert code_of(lambda: tr[b"\xff/x"].wait()) == 2004     # system keys are off again
    tr[k] = b"x" * 200
    assert tr.snapshot[k] == b"x" * 200     # snapshot RYW is back on
    tr.commit().wait()                      # the 100-byte size limit is gone too
    tr = eng.db.create_transaction()
    tr.options.set_retry_limit(1)
    tr.on_error(1020).wait()
    assert code_of(lambda: tr.on_error(1020).wait()) == 1020  # the retry limit survived
    tr.reset()                              # ... and reset() clears it
    t0 = time.monotonic()
    tr.options.set_timeout(1000)
    tr.options.set_max_retry_delay(5)
    while time.monotonic() - t0 < 0.4:
        tr.on_error(1020).wait()            # retries do not restart the clock
    while time.monotonic() - t0 < 1.1:
        time.sleep(0.01)
    assert code_of(lambda: tr[k].wait()) == 1031


def test_after_on_error_re_raises_the_transaction_is_cancelled_until_reset(eng):
    """§7: after any re-raise RYW sends transaction_cancelled to resetPromise: every
    later use fails with 1025 until reset()."""
    tr = eng.db.create_transaction()
    assert code_of(lambda: tr.on_error(2101).wait()) == 2101
    assert code_of(lambda: tr[eng.k(b"a")].wait()) == 1025
    assert code_of(lambda: tr.commit().wait()) == 1025
    assert code_of(lambda: tr.on_error(1020).wait()) == 1025
    tr.reset()
    assert tr[eng.k(b"a")] == None  # noqa: E711


def test_unconsumed_reads_still_conflict(eng):
    """§4: ranges are recorded when reads complete and commit waits for pending reads."""
    for read in (lambda t: t[eng.k(b"a")], lambda t: t.get_range(eng.k(b"a"), eng.k(b"b")),
                 lambda t: t.get_key(eng.KeySelector.first_greater_or_equal(eng.k(b"a")))):
        tr = _started(eng)
        read(tr)
        tr[eng.k(b"w")] = b""
        _other(eng, lambda t: t.set(eng.k(b"a"), b"1"))
        assert code_of(lambda: tr.commit().wait()) == 1020


def test_a_watch_ignores_other_transactions_until_its_commit(eng):
    """§8: before commit other transactions' changes are ignored; once committed it
    compares with its baseline, so a change made meanwhile fires it at once. A watch
    set after its own write waits for the next change. (With a write, this commit
    would fail: a watch reads its key, §4.)"""
    k = eng.k(b"w")
    tr = eng.db.create_transaction()
    f = tr.watch(k)
    _other(eng, lambda t: t.set(k, b"theirs"))
    assert not wait_ready(f, 0.3)
    tr.commit().wait()                      # read-only: registered at its read version
    assert wait_ready(f, 20) and f.wait() is None
    tr = eng.db.create_transaction()
    tr[k] = b"mine"
    f = tr.watch(k)
    tr.commit().wait()
    assert not wait_ready(f, 0.3)           # its own value is the baseline
    _other(eng, lambda t: t.set(k, b"next"))
    assert wait_ready(f, 20) and f.wait() is None


def test_any_own_atomic_op_fires_a_pending_watch(eng):
    """§8: the transaction's own later write fires it; any atomic op counts (RYW
    triggers watches on every atomicOp, whatever the result)."""
    k = eng.k(b"w")
    _other(eng, lambda t: t.set(k, b"\x00"))
    tr = eng.db.create_transaction()
    f = tr.watch(k)
    tr.add(k, b"\x00")                      # adds zero: same value, still fires
    assert wait_ready(f, 5) and f.wait() is None


def test_committed_version_is_minus_one_after_a_failed_commit(eng):
    """§1: get_committed_version() is -1 unless the last commit succeeded with writes."""
    tr = _started(eng)
    tr[eng.k(b"a")].wait()
    tr[eng.k(b"w")] = b""
    _other(eng, lambda t: t.set(eng.k(b"a"), b"1"))
    assert code_of(lambda: tr.commit().wait()) == 1020
    assert tr.get_committed_version() == -1
    tr.reset()
    tr[eng.k(b"w")] = b""
    tr.commit().wait()
    assert tr.get_committed_version() > 0


# -- §1 keys and values must be bytes: fdb.impl.keyToBytes / valueToBytes take
# as_foundationdb_key/value() if present, then refuse anything that is not bytes
# (TypeError at once): bytearray and memoryview included.

@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_bytearray_and_memoryview_keys_and_values_are_refused(eng, kind):
    k, v = eng.k(b"a"), b"v"
    tr = eng.db.create_transaction()
    for call in (lambda: tr.set(kind(k), v), lambda: tr.set(k, kind(v)), lambda: tr.get(kind(k)),
                 lambda: tr.clear(kind(k)), lambda: tr.add(k, kind(b"\x01")), lambda: tr.watch(kind(k)),
                 lambda: tr.add_read_conflict_key(kind(k))):
        with pytest.raises(TypeError):
            call()
    tr[k] = v                          # bytes, and a Value read back, are fine
    tr[eng.k(b"b")] = tr[k]
    tr.commit().wait()
    assert eng.db[eng.k(b"b")] == v


# -- §2 a lazy FDBRange does not outlive its transaction: FDBRange keeps only its
# first batch (requested at call time); each further batch is a new read, which after
# commit fails with used_during_commit 2017. The first batch is byte-limited
# (bindings/c/fdb_c.cpp, fdb_transaction_get_range_impl: iterator mode starts at 4,096
# bytes; small 256, medium 1,000, large 4,096, serial and want_all 80,000; exact:
# the row limit alone).

def test_a_lazy_range_returned_from_a_transactional_function_fails_past_its_first_batch(eng):
    import fdq
    _other(eng, lambda t: [t.set(eng.k(b"r/%02d" % i), b"x" * 300) for i in range(20)])

    @fdq.transactional
    def lazy(tr, **kw):
        tr[eng.k(b"w")] = b""
        return tr.get_range(eng.k(b"r/"), eng.k(b"r0"), **kw)

    rows = []
    assert code_of(lambda: [rows.append(kv.key) for kv in lazy(eng.db)]) == 2017
    assert 0 < len(rows) < 20           # 6,000 bytes: more than the first 4,096
    assert len(list(lazy(eng.db, limit=5))) == 5       # 1,500 bytes: one batch, no read after
    assert len(list(lazy(eng.db, streaming_mode=fdq.engine.StreamingMode.exact, limit=20))) == 20
    assert code_of(lambda: list(lazy(eng.db, streaming_mode=fdq.engine.StreamingMode.small))) == 2017


# -- §1 get_range_split_points / get_estimated_range_size_bytes add no conflicts; split
# points past the legal key space are key_outside_legal_range (RYW getRangeSplitPoints
# checks getMaxReadKey(); getEstimatedRangeSizeBytes checks nothing).

def test_size_estimates_and_split_points_add_no_conflicts(eng):
    _other(eng, lambda t: [t.set(eng.k(b"s/%03d" % i), b"x" * 100) for i in range(100)])
    tr = _started(eng)
    tr.get_estimated_range_size_bytes(eng.p, eng.end()).wait()
    list(tr.get_range_split_points(eng.p, eng.end(), 1000).wait())
    tr[eng.k(b"w")] = b""
    _other(eng, lambda t: t.set(eng.k(b"s/000"), b"changed"))
    assert code_of(lambda: tr.commit().wait()) is None
    tr = eng.db.create_transaction()
    assert code_of(lambda: tr.get_range_split_points(eng.p, b"\xff\x01", 1000).wait()) == 2004
    assert code_of(lambda: tr.get_estimated_range_size_bytes(eng.p, b"\xff\x01").wait()) is None
