"""Second review of the embedded engine against FDB's semantics (shared/fdb-semantics.md):
each case failed on the engine before its fix. Sources are FoundationDB release-7.3
(fdbclient/ReadYourWrites.actor.cpp unless named) and the Python binding (fdb/impl.py)."""
from __future__ import annotations

import pytest

from enginehelpers import code_of


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
