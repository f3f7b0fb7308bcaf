"""Conformance: order, ranges, key selectors, read-your-writes, clears, the Value type."""
from __future__ import annotations

import struct

import pytest

from fdq.engine import StreamingMode   # the same values as fdb.StreamingMode
from enginehelpers import code_of, commit_by_other

# Keys chosen to catch any order other than memcmp: NULs, 0xFF, prefixes of each other.
SUFFIXES = [b"", b"\x00", b"\x00\x00", b"\x00\xff", b"\x01", b"a", b"a\x00", b"ab", b"b",
            b"\x7f", b"\x80", b"\xfe", b"\xff", b"\xff\x00", b"\xff\xff"]


def fill(eng, suffixes=SUFFIXES):
    tr = eng.db.create_transaction()
    for i, s in enumerate(suffixes):
        tr[eng.k(s)] = b"v%d" % i
    tr.commit().wait()


def keys(rng):
    return [kv.key for kv in rng]


def test_order_is_memcmp_including_nul_and_ff(eng):
    fill(eng, list(reversed(SUFFIXES)))
    tr = eng.db.create_transaction()
    got = keys(tr.get_range(eng.p, eng.end()))
    assert got == sorted(eng.k(s) for s in SUFFIXES)
    assert got[0] == eng.p and got[1] == eng.p + b"\x00"
    assert got[-1] == eng.p + b"\xff\xff"
    assert keys(tr.get_range(eng.p, eng.end(), reverse=True)) == got[::-1]


def test_ranges_forward_reverse_limit(eng):
    fill(eng)
    srt = sorted(eng.k(s) for s in SUFFIXES)
    tr = eng.db.create_transaction()
    assert keys(tr.get_range(eng.p, eng.end(), limit=3)) == srt[:3]
    # reverse with a limit: the last rows, descending
    assert keys(tr.get_range(eng.p, eng.end(), limit=3, reverse=True)) == srt[::-1][:3]
    # [begin, end): begin included, end excluded
    assert keys(tr.get_range(eng.k(b"a"), eng.k(b"b"))) == [eng.k(b"a"), eng.k(b"a\x00"), eng.k(b"ab")]
    # slices, reverse slices, startswith
    assert keys(tr[eng.k(b"a"):eng.k(b"b")]) == keys(tr.get_range(eng.k(b"a"), eng.k(b"b")))
    assert keys(tr[eng.k(b"a"):eng.k(b"b"):-1]) == [eng.k(b"ab"), eng.k(b"a\x00"), eng.k(b"a")]
    assert keys(tr.get_range_startswith(eng.k(b"\xff"))) == [eng.k(b"\xff"), eng.k(b"\xff\x00"), eng.k(b"\xff\xff")]
    # begin >= end: empty, no error
    assert keys(tr.get_range(eng.k(b"b"), eng.k(b"a"))) == []
    assert keys(tr.get_range(eng.k(b"a"), eng.k(b"a"))) == []
    # limit 0 = unlimited; the result is re-iterable; KeyValue unpacks; values are bytes
    r = tr.get_range(eng.p, eng.end(), limit=0)
    assert keys(r) == srt and keys(r) == srt
    k, v = next(iter(r))
    assert (k, v) == (srt[0], b"v0") and type(v) is bytes
    assert len(r.to_list()) == len(srt)
    # as FDB's FDBRange and KeyValue: no len, no indexing, no equality by value
    with pytest.raises(TypeError):
        len(r)
    with pytest.raises(TypeError):
        r[0]
    kv = next(iter(r))
    with pytest.raises(TypeError):
        kv[0]
    assert kv != next(iter(tr.get_range(eng.p, eng.end())))
    # a large range comes back complete and in order across batches
    tr2 = eng.db.create_transaction()
    for i in range(3000):
        tr2[eng.k(b"big/%05d" % i)] = b"x"
    tr2.commit().wait()
    tr3 = eng.db.create_transaction()
    big = keys(tr3.get_range_startswith(eng.k(b"big/")))
    assert big == [eng.k(b"big/%05d" % i) for i in range(3000)]
    r = tr3.get_range_startswith(eng.k(b"big/"))
    assert keys(r) == big and keys(r) == big  # re-iterable past the first batch
    assert keys(tr3.get_range_startswith(eng.k(b"big/"), limit=2500)) == big[:2500]
    r = tr3.get_range_startswith(eng.k(b"big/"), limit=2100)   # past the first batches, then again
    assert keys(r) == big[:2100] and keys(r) == big[:2100]
    for limit, rev in ((2100, False), (1500, True), (5000, False), (3000, True)):
        r = tr3.get_range_startswith(eng.k(b"big/"), limit=limit, reverse=rev, streaming_mode=StreamingMode.want_all)
        want = (big[::-1] if rev else big)[:limit]
        assert keys(r) == want and keys(r) == want
    assert keys(tr3.get_range_startswith(eng.k(b"big/"), reverse=True)) == big[::-1]
    assert keys(tr3.get_range_startswith(eng.k(b"big/"), limit=1500, reverse=True)) == big[::-1][:1500]


def test_key_selectors(eng):
    fill(eng, [b"a", b"c", b"e", b"g"])
    a, c, e, g = (eng.k(x) for x in (b"a", b"c", b"e", b"g"))
    tr = eng.db.create_transaction()
    gk = lambda sel: bytes(tr.get_key(sel).wait())  # noqa: E731
    assert gk(eng.KeySelector.first_greater_or_equal(c)) == c
    assert gk(eng.KeySelector.first_greater_or_equal(eng.k(b"b"))) == c
    assert gk(eng.KeySelector.first_greater_than(c)) == e
    assert gk(eng.KeySelector.last_less_than(c)) == a
    assert gk(eng.KeySelector.last_less_or_equal(c)) == c
    assert gk(eng.KeySelector.last_less_or_equal(eng.k(b"d"))) == c
    assert gk(eng.KeySelector.first_greater_or_equal(a) + 2) == e
    assert gk(eng.KeySelector.first_greater_than(g) - 1) == g
    # selectors as range bounds, as FDQ uses them
    assert keys(tr.get_range(eng.KeySelector.first_greater_than(a), eng.KeySelector.first_greater_than(e))) == [c, e]
    assert keys(tr.get_range(eng.KeySelector.last_less_or_equal(eng.k(b"d")), g)) == [c, e]


def test_read_your_writes(eng):
    fill(eng, [b"a", b"c", b"e", b"g", b"i"])
    tr = eng.db.create_transaction()
    tr[eng.k(b"b")] = b"new"
    tr[eng.k(b"c")] = b"over"
    del tr[eng.k(b"e")]
    assert tr[eng.k(b"b")] == b"new" and tr[eng.k(b"c")] == b"over"
    assert tr[eng.k(b"e")] == None  # noqa: E711
    assert tr.snapshot[eng.k(b"b")] == b"new"  # snapshot reads see own writes
    assert [(kv.key, kv.value) for kv in tr.get_range(eng.p, eng.end())] == [
        (eng.k(b"a"), b"v0"), (eng.k(b"b"), b"new"), (eng.k(b"c"), b"over"),
        (eng.k(b"g"), b"v3"), (eng.k(b"i"), b"v4")]
    # clear a range, then set inside it: only the new key is visible
    tr.clear_range(eng.k(b"b"), eng.k(b"h"))
    tr[eng.k(b"d")] = b"inside"
    assert keys(tr.get_range(eng.p, eng.end())) == [eng.k(b"a"), eng.k(b"d"), eng.k(b"i")]
    assert keys(tr.get_range(eng.p, eng.end(), reverse=True)) == [eng.k(b"i"), eng.k(b"d"), eng.k(b"a")]
    assert keys(tr.get_range(eng.p, eng.end(), limit=2, reverse=True)) == [eng.k(b"i"), eng.k(b"d")]
    assert tr[eng.k(b"g")] == None  # noqa: E711
    assert bytes(tr.get_key(eng.KeySelector.first_greater_than(eng.k(b"a"))).wait()) == eng.k(b"d")
    # atomic ops on unread keys are visible as their result
    tr.add(eng.k(b"n"), struct.pack("<q", 5))
    tr.add(eng.k(b"n"), struct.pack("<q", 7))
    assert struct.unpack("<q", bytes(tr[eng.k(b"n")]))[0] == 12
    tr.commit().wait()
    assert eng.items() == [(eng.k(b"a"), b"v0"), (eng.k(b"d"), b"inside"), (eng.k(b"i"), b"v4"),
                           (eng.k(b"n"), struct.pack("<q", 12))]


def test_ryw_over_an_atomic_op_on_a_stored_value(eng):
    tr = eng.db.create_transaction()
    tr[eng.k(b"n")] = struct.pack("<q", 100)
    tr.commit().wait()
    tr = eng.db.create_transaction()
    tr.add(eng.k(b"n"), struct.pack("<q", 1))
    assert [(kv.key, kv.value) for kv in tr.get_range(eng.p, eng.end())] == [(eng.k(b"n"), struct.pack("<q", 101))]
    tr.commit().wait()


def test_clears(eng):
    fill(eng, [b"a", b"b", b"c", b"d", b"e", b"x1", b"x2", b"y"])
    tr = eng.db.create_transaction()
    tr.clear(eng.k(b"a"))
    del tr[eng.k(b"b")]
    tr.clear(eng.k(b"zz-absent"))  # clearing an absent key is fine
    del tr[eng.k(b"c"):eng.k(b"e")]  # [c, e): e stays
    tr.clear_range_startswith(eng.k(b"x"))
    tr.clear_range(eng.k(b"q"), eng.k(b"q"))  # empty range: no-op
    tr.commit().wait()
    assert [k for k, _ in eng.items()] == [eng.k(b"e"), eng.k(b"y")]
    # an inverted clear_range returns at once; the error (2005) is deferred to the commit
    tr = eng.db.create_transaction()
    assert tr.clear_range(eng.k(b"y"), eng.k(b"a")) is None
    assert code_of(lambda: tr.commit().wait()) == 2005


def test_value_type_quirks(eng):
    tr = eng.db.create_transaction()
    tr[eng.k(b"present")] = b"\x01\x00\x00\x00\x00\x00\x00\x00"
    tr.commit().wait()
    tr = eng.db.create_transaction()
    absent = tr[eng.k(b"absent")]
    assert absent == None  # noqa: E711
    assert absent is not None  # a Value future, never None itself
    assert not absent.present()
    assert absent.value is None
    with pytest.raises(TypeError):
        bytes(absent)
    with pytest.raises(TypeError):
        bool(absent)
    v = tr.get(eng.k(b"present"))
    assert v.present() and isinstance(v, bytes) and v.wait() is v
    assert v == b"\x01" + b"\x00" * 7 and len(v) == 8 and v[0] == 1 and v.startswith(b"\x01")
    assert struct.unpack("<q", bytes(v))[0] == 1 and struct.unpack("<q", v.value)[0] == 1
    with pytest.raises(TypeError):
        struct.unpack("<q", v)  # no buffer protocol: use bytes(v) or v.value
    # keys and values must be bytes: str is refused at once
    with pytest.raises(TypeError):
        tr["str-key"] = b"x"
    with pytest.raises(TypeError):
        tr.set(eng.k(b"k"), "str-value")
    # the database's auto-transaction get returns plain bytes / None
    assert eng.db[eng.k(b"absent")] is None
    assert eng.db[eng.k(b"present")] == b"\x01" + b"\x00" * 7


def test_after_commit_the_transaction_is_done_until_reset(eng):
    tr = eng.db.create_transaction()
    tr[eng.k(b"a")] = b"1"
    for i in range(1000):
        tr[eng.k(b"r/%04d" % i)] = b""
    tr.commit().wait()
    # a range does not outlive its attempt: it neither truncates nor reads at a new version
    # (embedded only: FDB's FDBRange asks the reset transaction for its next batch, which
    # reads at a new read version without an error)
    t2 = eng.db.create_transaction()
    it = iter(t2.get_range_startswith(eng.k(b"r/")))
    next(it)
    t2.reset()
    if eng.embedded:
        assert code_of(lambda: list(it)) is not None
    assert code_of(lambda: tr[eng.k(b"a")].wait()) == 2017
    if eng.embedded:
        assert code_of(lambda: tr.set(eng.k(b"a"), b"2")) == 2017
    else:       # FDB's binding: a write returns nothing; its error waits for the next read
        tr.set(eng.k(b"a"), b"2")
        assert code_of(lambda: tr[eng.k(b"a")].wait()) == 2017
    tr.reset()
    assert tr[eng.k(b"a")] == b"1"


def test_range_split_points_and_estimated_size(eng):
    tr = eng.db.create_transaction()
    for i in range(2000):
        tr[eng.k(b"s/%05d" % i)] = b"x" * 100
    tr.commit().wait()
    b, e = eng.k(b"s/"), eng.k(b"s0")
    tr = eng.db.create_transaction()
    points = list(tr.get_range_split_points(b, e, 20_000).wait())
    assert points[0] == b and points[-1] == e and points == sorted(set(points))
    size = tr.get_estimated_range_size_bytes(b, e).wait()
    assert size >= 0
    if eng.embedded:  # exact here; FDB samples and is only good above ~3 MB
        assert 2000 * 100 <= size <= 2000 * 200
        chunks = [len(list(tr.get_range(lo, hi))) for lo, hi in zip(points, points[1:])]
        assert sum(chunks) == 2000 and len(chunks) >= 8 and max(chunks) <= 250
    with pytest.raises(Exception) as ei:     # FDB's binding raises its own error type
        tr.get_range_split_points(b, e, 0)
    assert not isinstance(ei.value, (TypeError, AttributeError, NameError)), ei.value   # not a wrong call
    if eng.embedded:
        assert "chunk_size must be positive" in str(ei.value)


@pytest.mark.parametrize("reverse", [False, True])
def test_range_reads_beside_and_across_own_writes_and_clears(eng, reverse):
    """A transaction with writes and clears elsewhere reads an untouched range as stored
    (the embedded engine skips its merge there), and still merges where they fall: at a
    range's edges, inside it, a clear ending exactly at its start or beginning at its end."""
    fill(eng, [b"a1", b"a2", b"b1", b"b2", b"c1", b"c2", b"d1"])
    tr = eng.db.create_transaction()
    tr[eng.k(b"a3")] = b"new"          # in [a, b)
    tr.clear_range(eng.k(b"c"), eng.k(b"c2"))   # clears c1
    tr.clear_range(eng.k(b"a\xff"), eng.k(b"b"))    # ends where [b, c) starts
    tr.clear_range(eng.k(b"c\xff"), eng.k(b"d1"))  # begins after [c, c\xff)

    def rng(b, e, **kw):
        return keys(tr.get_range(eng.k(b), eng.k(e), reverse=reverse, **kw))

    def want(*s):
        out = [eng.k(x) for x in s]
        return out[::-1] if reverse else out
    assert rng(b"b", b"c") == want(b"b1", b"b2")               # untouched
    assert rng(b"b", b"c", limit=1) == want(b"b1", b"b2")[:1]
    assert rng(b"a", b"b") == want(b"a1", b"a2", b"a3")        # own write inside
    assert rng(b"c", b"d") == want(b"c2")                      # own clear inside
    assert rng(b"d", b"e") == want(b"d1")                      # a clear ends at d1
    tr[eng.k(b"b3")] = b"later"                                # a write after the first read
    assert rng(b"b", b"c") == want(b"b1", b"b2", b"b3")
    assert keys(tr.snapshot.get_range(eng.k(b"b"), eng.k(b"c"))) == [eng.k(b"b1"), eng.k(b"b2"), eng.k(b"b3")]


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
    commit_by_other(eng, lambda t: t.set(b, b"stored"))
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
