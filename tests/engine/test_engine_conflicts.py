"""Conformance: optimistic concurrency as FDB's resolver (docs/fdb-semantics.md §4)."""
from __future__ import annotations

import struct

import fdb.tuple
import pytest

from fdq.engine import StreamingMode   # the same values as fdb.StreamingMode
from enginehelpers import code_of, collect, commit_by_other, spawn, started


def setup(eng, **kv):
    tr = eng.db.create_transaction()
    for k, v in kv.items():
        tr[eng.k(k.encode())] = v
    tr.commit().wait()


def test_read_then_write_same_key_exactly_one_commits(eng):
    setup(eng, n=struct.pack("<q", 0))
    k = eng.k(b"n")
    t1, t2 = eng.db.create_transaction(), eng.db.create_transaction()
    for t in (t1, t2):
        n = struct.unpack("<q", bytes(t[k]))[0]
        t[k] = struct.pack("<q", n + 1)
    results = [code_of(lambda: t1.commit().wait()), code_of(lambda: t2.commit().wait())]
    assert results == [None, 1020]
    assert struct.unpack("<q", eng.db[k])[0] == 1


def test_write_skew_is_refused(eng):
    # invariant: at least one of x, y is on call
    setup(eng, x=b"1", y=b"1")
    x, y = eng.k(b"x"), eng.k(b"y")
    t1, t2 = eng.db.create_transaction(), eng.db.create_transaction()
    for t, mine in ((t1, x), (t2, y)):
        if t[x] == b"1" and t[y] == b"1":
            t[mine] = b"0"
    assert code_of(lambda: t1.commit().wait()) is None
    assert code_of(lambda: t2.commit().wait()) == 1020
    assert (eng.db[x], eng.db[y]) == (b"0", b"1")


def test_snapshot_reads_do_not_conflict(eng):
    setup(eng, a=b"1")
    t1 = eng.db.create_transaction()
    assert t1.snapshot[eng.k(b"a")] == b"1"
    list(t1.snapshot.get_range(eng.p, eng.end()))
    t1[eng.k(b"b")] = b"x"
    commit_by_other(eng, lambda t: t.set(eng.k(b"a"), b"2"))
    assert code_of(lambda: t1.commit().wait()) is None


def test_conflicts_are_range_based_not_value_based(eng):
    setup(eng, a=b"1")
    # rewriting the same value conflicts
    t1 = eng.db.create_transaction()
    t1[eng.k(b"a")].wait()
    t1[eng.k(b"z")] = b""
    commit_by_other(eng, lambda t: t.set(eng.k(b"a"), b"1"))
    assert code_of(lambda: t1.commit().wait()) == 1020
    # so does clearing an absent key that was read
    t1 = eng.db.create_transaction()
    assert t1[eng.k(b"nothing")] == None  # noqa: E711
    t1[eng.k(b"z")] = b""
    commit_by_other(eng, lambda t: t.clear(eng.k(b"nothing")))
    assert code_of(lambda: t1.commit().wait()) == 1020


def test_blind_writes_and_atomic_ops_never_conflict(eng):
    setup(eng, a=b"1")
    t1, t2 = eng.db.create_transaction(), eng.db.create_transaction()
    for t in (t1, t2):
        t.add(eng.k(b"n"), struct.pack("<q", 1))
        t[eng.k(b"a")] = b"blind"
        assert t.snapshot[eng.k(b"n")] != b"x"  # snapshot read of the key: still no conflict
    assert code_of(lambda: t1.commit().wait()) is None
    assert code_of(lambda: t2.commit().wait()) is None
    assert struct.unpack("<q", eng.db[eng.k(b"n")])[0] == 2


def test_non_snapshot_read_of_an_atomic_key_conflicts(eng):
    setup(eng, n=struct.pack("<q", 1))
    t1 = eng.db.create_transaction()
    t1.add(eng.k(b"n"), struct.pack("<q", 1))
    t1[eng.k(b"n")].wait()  # pending atomic op: the stored value is read
    commit_by_other(eng, lambda t: t.add(eng.k(b"n"), struct.pack("<q", 1)))
    assert code_of(lambda: t1.commit().wait()) == 1020


def test_reading_own_write_adds_no_read_conflict(eng):
    t1 = eng.db.create_transaction()
    t1.get_read_version().wait()
    t1[eng.k(b"a")] = b"mine"
    assert t1[eng.k(b"a")] == b"mine"
    commit_by_other(eng, lambda t: t.set(eng.k(b"a"), b"theirs"))
    assert code_of(lambda: t1.commit().wait()) is None
    assert eng.db[eng.k(b"a")] == b"mine"


def test_read_only_transactions_never_conflict(eng):
    setup(eng, a=b"1")
    t1 = eng.db.create_transaction()
    t1[eng.k(b"a")].wait()
    commit_by_other(eng, lambda t: t.set(eng.k(b"a"), b"2"))
    assert code_of(lambda: t1.commit().wait()) is None
    assert t1.get_committed_version() == -1


def _range_reader(eng, limit, reverse=False):
    t = eng.db.create_transaction()
    rows = list(t.get_range(eng.k(b"a"), eng.k(b"z"), limit=limit, reverse=reverse))
    t[eng.k(b"other")] = b""
    return t, [kv.key for kv in rows]


@pytest.mark.parametrize("write,expected", [(b"b", 1020), (b"a", 1020), (b"b\x00", None), (b"d", None),
                                            (b"y", None)])
def test_range_read_stopped_at_its_limit_conflicts_only_on_what_it_read(eng, write, expected):
    setup(eng, a=b"", b=b"", c=b"", d=b"", e=b"")
    t1, got = _range_reader(eng, limit=2)
    assert got == [eng.k(b"a"), eng.k(b"b")]
    commit_by_other(eng, lambda t: t.set(eng.k(write), b"w"))
    assert code_of(lambda: t1.commit().wait()) == expected


@pytest.mark.parametrize("write,expected", [(b"d", 1020), (b"y", 1020), (b"c\xff", None), (b"\x00", None)])
def test_reverse_range_read_stopped_at_its_limit(eng, write, expected):
    setup(eng, a=b"", b=b"", c=b"", d=b"", e=b"")
    t1, got = _range_reader(eng, limit=2, reverse=True)
    assert got == [eng.k(b"e"), eng.k(b"d")]
    commit_by_other(eng, lambda t: t.set(eng.k(write), b"w"))
    assert code_of(lambda: t1.commit().wait()) == expected


@pytest.mark.parametrize("write,expected", [(b"y", 1020), (b"a\x00", 1020), (b"z", None)])
def test_short_range_read_conflicts_on_the_whole_range(eng, write, expected):
    setup(eng, a=b"", b=b"", c=b"")
    t1, got = _range_reader(eng, limit=10)
    assert len(got) == 3
    commit_by_other(eng, lambda t: t.set(eng.k(write), b"w"))
    assert code_of(lambda: t1.commit().wait()) == expected


@pytest.mark.parametrize("mode", ["iterator", "want_all"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("nth,expected", [(1099, 1020), (1300, None)])
def test_long_range_read_stopped_at_its_limit(eng, mode, reverse, nth, expected):
    # Past the first batches: a limited read covers the rows it returned, in either
    # streaming mode (want_all reads up to the limit at once, iterator in growing batches).
    tr = eng.db.create_transaction()
    for i in range(1500):
        tr[eng.k(b"r/%05d" % i)] = b""
    tr.commit().wait()
    t1 = eng.db.create_transaction()
    rows = list(t1.get_range(eng.k(b"r/"), eng.k(b"r0"), limit=1200, reverse=reverse,
                             streaming_mode=getattr(StreamingMode, mode)))
    assert len(rows) == 1200
    t1[eng.k(b"other")] = b""
    i = nth if not reverse else 1499 - nth
    commit_by_other(eng, lambda t: t.set(eng.k(b"r/%05d" % i), b"w"))
    assert code_of(lambda: t1.commit().wait()) == expected


def test_explicit_conflict_ranges(eng):
    # add_read_conflict_key: as if read at the transaction's read version. (Without a
    # read version yet, commit would fetch one after the other commit: no conflict.)
    t1 = eng.db.create_transaction()
    t1.get_read_version().wait()
    t1.add_read_conflict_key(eng.k(b"r"))
    t1[eng.k(b"other")] = b""
    commit_by_other(eng, lambda t: t.set(eng.k(b"r"), b""))
    assert code_of(lambda: t1.commit().wait()) == 1020
    t1 = eng.db.create_transaction()
    t1.add_read_conflict_key(eng.k(b"r"))
    t1[eng.k(b"other")] = b""
    commit_by_other(eng, lambda t: t.set(eng.k(b"r"), b""))
    assert code_of(lambda: t1.commit().wait()) is None
    # add_write_conflict_range: readers of the range conflict although nothing was written
    t1 = eng.db.create_transaction()
    list(t1.get_range(eng.k(b"m"), eng.k(b"n")))
    t1[eng.k(b"other")] = b""
    commit_by_other(eng, lambda t: t.add_write_conflict_range(eng.k(b"m1"), eng.k(b"m2")))
    assert code_of(lambda: t1.commit().wait()) == 1020
    assert eng.db[eng.k(b"m1")] is None
    # an inverted conflict range raises 2005 at once
    assert code_of(lambda: eng.db.create_transaction().add_read_conflict_range(eng.k(b"b"), eng.k(b"a"))) == 2005


@pytest.mark.slow
def test_atomic_adds_from_8_processes_lose_nothing_and_never_conflict(eng):
    key = eng.k(b"counter")
    procs = [spawn("add", eng.url, key=key.hex(), n=60) for _ in range(8)]
    results = [collect(p) for p in procs]
    assert struct.unpack("<q", eng.db[key])[0] == 8 * 60
    assert [r["errors"] for r in results] == [{}] * 8  # not one retry


@pytest.mark.slow
def test_bank_transfers_keep_the_total_across_processes_under_fault_injection(eng):
    accounts, total, workers, n = 10, 10 * 1000, 4, 40
    tr = eng.db.create_transaction()
    for i in range(accounts):
        tr[eng.k(b"acct/%03d" % i)] = struct.pack("<q", 1000)
    tr.commit().wait()
    procs = [spawn("bank", eng.fault_url(0.1, w + 1), prefix=eng.p.hex(), seed=w, worker=w, n=n,
                   accounts=accounts, total=total) for w in range(workers)]
    results = [collect(p) for p in procs]
    balances = [struct.unpack("<q", v)[0] for k, v in eng.items() if k.startswith(eng.k(b"acct/"))]
    marks = [k for k, _ in eng.items() if k.startswith(eng.k(b"mark/"))]
    assert sum(balances) == total and min(balances) >= 0
    assert len(marks) == workers * n  # every transfer applied once, 1021s included
    # every attempt saw the invariant (serializable reads), and faults really happened
    assert sum(r["bad_sums"] for r in results) == 0
    errors = {}
    for r in results:
        for code, c in r["errors"].items():
            errors[code] = errors.get(code, 0) + c
    assert errors.get("1021", 0) > 0, errors


@pytest.mark.parametrize("other_commit", ["none", "unrelated", "same_key"])
def test_conflict_across_processes_with_and_without_commits_since_the_read(eng, other_commit):
    # A read-then-write transaction whose read version is still the latest commit has
    # nothing to check (the engine skips its conflict query then); one that another
    # process wrote under since its read must fail with 1020, one with only unrelated
    # commits since must commit.
    # (The other process must commit within 5 s of the read: on a loaded machine its start
    # can take longer, and the commit then fails 1007, as FDB's would. Such a round tells
    # nothing: it is run again.)
    k = eng.k(b"k")
    for _round in range(5):
        setup(eng, k=b"0", other=b"0")
        tr = eng.db.create_transaction()
        assert tr[k] == b"0"
        if other_commit != "none":
            key = k if other_commit == "same_key" else eng.k(b"other")
            assert collect(spawn("set", eng.url, key=key.hex(), value=b"9".hex())) == {"ok": True}
        tr[k] = b"1"
        tr.add(eng.k(b"count"), struct.pack("<q", 1))
        code = code_of(lambda: tr.commit().wait())
        if code != 1007:
            break
    assert code == (1020 if other_commit == "same_key" else None)
    assert eng.db[k] == {"none": b"1", "unrelated": b"1", "same_key": b"9"}[other_commit]


def test_add_after_clears_and_sets_in_one_transaction(eng):
    # add() has an inline path for a key the transaction has not touched; after a
    # clear_range over the key or a set of it, it folds into a plain value.
    a, b, c = eng.k(b"a"), eng.k(b"b"), eng.k(b"c")
    setup(eng, a=struct.pack("<q", 5), b=struct.pack("<q", 5), c=struct.pack("<q", 5))
    tr = eng.db.create_transaction()
    tr.clear_range(a, b)
    tr.add(a, struct.pack("<q", 2))          # the cleared value counts as 0
    tr[b] = struct.pack("<q", 10)
    tr.add(b, struct.pack("<q", 2))
    tr.add(c, struct.pack("<q", 2))
    tr.add(c, struct.pack("<q", 3))          # chained on the stored value
    assert tr[a] == struct.pack("<q", 2) and tr[b] == struct.pack("<q", 12)
    tr.commit().wait()
    assert [struct.unpack("<q", eng.db[x])[0] for x in (a, b, c)] == [2, 12, 10]


# -- §4 RYW: parts of a read this transaction already set or cleared add no read conflict.
# RYWImpl::updateConflictMap inserts a read conflict only where the write map is
# unmodified or holds a dependent (atomic) operation; addReadConflictRange goes through
# it too. A conflict the engine adds there and FDB does not is one FDQ could rely on.

@pytest.mark.parametrize("write", ["set", "clear", "clear_range"])
def test_add_read_conflict_on_a_key_already_written_adds_nothing(eng, write):
    k = eng.k(b"a")
    commit_by_other(eng, lambda t: t.set(k, b"0"))
    t1 = started(eng)
    {"set": lambda: t1.set(k, b"1"), "clear": lambda: t1.clear(k),
     "clear_range": lambda: t1.clear_range(eng.k(b"a"), eng.k(b"b"))}[write]()
    t1.add_read_conflict_key(k)
    t1.add_read_conflict_range(eng.k(b"a"), eng.k(b"a\x00"))
    commit_by_other(eng, lambda t: t.set(k, b"2"))
    assert code_of(lambda: t1.commit().wait()) is None


def test_add_read_conflict_before_the_write_or_on_an_atomic_key_conflicts(eng):
    k = eng.k(b"a")
    t1 = started(eng)
    t1.add_read_conflict_key(k)     # recorded while the key is unmodified
    t1.set(k, b"1")
    commit_by_other(eng, lambda t: t.set(k, b"2"))
    assert code_of(lambda: t1.commit().wait()) == 1020
    t2 = started(eng)
    t2.add(k, b"\x01")              # a dependent operation: still conflicts
    t2.add_read_conflict_key(k)
    commit_by_other(eng, lambda t: t.set(k, b"3"))
    assert code_of(lambda: t2.commit().wait()) == 1020


def test_reads_inside_an_own_cleared_range_add_no_read_conflict(eng):
    commit_by_other(eng, lambda t: t.set(eng.k(b"c"), b"0"))
    t1 = started(eng)
    t1.clear_range(eng.k(b"a"), eng.k(b"m"))
    assert t1[eng.k(b"c")] == None  # noqa: E711
    assert list(t1.get_range(eng.k(b"a"), eng.k(b"m"))) == []
    assert t1.get_key(eng.KeySelector.first_greater_or_equal(eng.k(b"b"))) >= eng.k(b"m")
    commit_by_other(eng, lambda t: t.set(eng.k(b"c"), b"1"))
    assert code_of(lambda: t1.commit().wait()) is None


@pytest.mark.parametrize("write,expected", [(b"b", None), (b"d", None), (b"c", 1020), (b"e", 1020)])
def test_a_range_read_conflicts_only_on_keys_it_did_not_write(eng, write, expected):
    t1 = started(eng)
    t1[eng.k(b"b")] = b"mine"
    t1.clear(eng.k(b"d"))
    t1.add(eng.k(b"e"), b"\x01")   # atomic: the read depends on the stored value
    assert [kv.key for kv in t1.get_range(eng.k(b"a"), eng.k(b"z"))] == [eng.k(b"b"), eng.k(b"e")]
    commit_by_other(eng, lambda t: t.set(eng.k(write), b"theirs"))
    assert code_of(lambda: t1.commit().wait()) == expected


# -- §1 next_write_no_write_conflict_range: every write consumes it at its start
# (RYW set, clear and atomicOp call getAndResetWriteConflictDisabled first), a
# versionstamped key included, so it never carries over to the write after.

def test_a_versionstamped_key_consumes_next_write_no_write_conflict_range(eng):
    k = eng.k(b"k")
    reader = started(eng)
    reader[k].wait()
    reader[eng.k(b"r")] = b""
    tr = eng.db.create_transaction()
    tr.options.set_next_write_no_write_conflict_range()
    tr.set_versionstamped_key(fdb.tuple.pack_with_versionstamp((fdb.tuple.Versionstamp(),), prefix=eng.k(b"v")), b"")
    tr[k] = b"1"            # has its write conflict: the option went to the stamped key
    tr.commit().wait()
    assert code_of(lambda: reader.commit().wait()) == 1020


def test_unconsumed_reads_still_conflict(eng):
    """§4: ranges are recorded when reads complete and commit waits for pending reads."""
    for read in (lambda t: t[eng.k(b"a")], lambda t: t.get_range(eng.k(b"a"), eng.k(b"b")),
                 lambda t: t.get_key(eng.KeySelector.first_greater_or_equal(eng.k(b"a")))):
        tr = started(eng)
        read(tr)
        tr[eng.k(b"w")] = b""
        commit_by_other(eng, lambda t: t.set(eng.k(b"a"), b"1"))
        assert code_of(lambda: tr.commit().wait()) == 1020


# -- §1 get_range_split_points / get_estimated_range_size_bytes add no conflicts; split
# points past the legal key space are key_outside_legal_range (RYW getRangeSplitPoints
# checks getMaxReadKey(); getEstimatedRangeSizeBytes checks nothing).

def test_size_estimates_and_split_points_add_no_conflicts(eng):
    commit_by_other(eng, lambda t: [t.set(eng.k(b"s/%03d" % i), b"x" * 100) for i in range(100)])
    tr = started(eng)
    tr.get_estimated_range_size_bytes(eng.p, eng.end()).wait()
    list(tr.get_range_split_points(eng.p, eng.end(), 1000).wait())
    tr[eng.k(b"w")] = b""
    commit_by_other(eng, lambda t: t.set(eng.k(b"s/000"), b"changed"))
    assert code_of(lambda: tr.commit().wait()) is None
    tr = eng.db.create_transaction()
    assert code_of(lambda: tr.get_range_split_points(eng.p, b"\xff\x01", 1000).wait()) == 2004
    assert code_of(lambda: tr.get_estimated_range_size_bytes(eng.p, b"\xff\x01").wait()) is None
