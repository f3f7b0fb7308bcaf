"""Conformance: atomic operations (docs/fdb-semantics.md §3), on every code path:
applied at commit to a stored value, folded into the transaction's own set, and read
back inside the transaction."""
from __future__ import annotations

import pytest

from enginehelpers import code_of

BIG = b"\x01" * 99_999
ABSENT = None

# (op, existing value or ABSENT, param, expected result or ABSENT)
CASES = [
    ("add", ABSENT, b"\x01\x00", b"\x01\x00"),
    ("add", b"", b"\x05\x00", b"\x05\x00"),                      # empty acts as absent
    ("add", b"\xff\x00", b"\x01\x00", b"\x00\x01"),              # little-endian carry
    ("add", b"\xff\xff", b"\x01\x00", b"\x00\x00"),              # overflow wraps
    ("add", b"\x01\x00\x00\x01", b"\x01\x00", b"\x02\x00"),      # existing truncated to len(param)
    ("add", b"\x01", b"\x01\x00\x00\x00", b"\x02\x00\x00\x00"),  # existing zero-padded
    ("bit_and", ABSENT, b"\x0f", b"\x0f"),
    ("bit_and", b"", b"\xff\xff", b"\x00\x00"),                  # empty acts as zero
    ("bit_and", b"\xf0\xf0", b"\xff\x0f", b"\xf0\x00"),
    ("bit_and", b"\xff\xff\xff", b"\x0f", b"\x0f"),
    ("bit_or", ABSENT, b"\x01", b"\x01"),
    ("bit_or", b"\x0f\x00", b"\xf0\x01", b"\xff\x01"),
    ("bit_or", b"", b"\x01", b"\x01"),
    ("bit_xor", b"\xff", b"\xff", b"\x00"),
    ("bit_xor", ABSENT, b"\x02", b"\x02"),
    ("max", ABSENT, b"\x02\x00", b"\x02\x00"),
    ("max", b"\x01\x00", b"\x02\x00", b"\x02\x00"),
    ("max", b"\x00\x01", b"\xff\x00", b"\x00\x01"),              # unsigned little-endian
    ("max", b"\x05\x00\x09", b"\x06", b"\x06"),                  # compared at len(param)
    ("max", b"\x07\x00\x09", b"\x06", b"\x07"),                  # winner stored at that length
    ("max", b"", b"\x03", b"\x03"),
    ("min", ABSENT, b"\x02\x00", b"\x02\x00"),
    ("min", b"\x02\x00", b"\x01\x00", b"\x01\x00"),
    ("min", b"\x00\x01", b"\xff\x00", b"\xff\x00"),
    ("min", b"\x07\x00\x09", b"\x08", b"\x07"),
    ("min", b"", b"\x05", b"\x00"),                              # empty acts as zero
    ("byte_max", ABSENT, b"a", b"a"),
    ("byte_max", b"abc", b"abd", b"abd"),
    ("byte_max", b"b", b"abc", b"b"),                            # lexicographic, whole string
    ("byte_min", b"b", b"abc", b"abc"),
    ("byte_min", b"", b"a", b""),
    ("append_if_fits", ABSENT, b"ab", b"ab"),
    ("append_if_fits", b"ab", b"cd", b"abcd"),
    ("append_if_fits", b"", b"x", b"x"),
    ("append_if_fits", BIG, b"\x02\x02", BIG),                   # would exceed 100,000 B: unchanged
    ("append_if_fits", BIG, b"\x02", BIG + b"\x02"),             # exactly 100,000 B fits
    ("compare_and_clear", ABSENT, b"x", ABSENT),
    ("compare_and_clear", b"x", b"x", ABSENT),
    ("compare_and_clear", b"x", b"y", b"x"),
    ("compare_and_clear", b"\x00CLEAR", b"y", b"\x00CLEAR"),   # any stored bytes survive a mismatch
    ("append_if_fits", b"\x00CLE", b"AR", b"\x00CLEAR"),
]


def _ids():
    return [f"{op}-{i}" for i, (op, *_r) in enumerate(CASES)]


def _read(eng, key):
    tr = eng.db.create_transaction()
    return tr[key].value


@pytest.mark.parametrize("op,existing,param,expected", CASES, ids=_ids())
def test_atomic_op(eng, op, existing, param, expected):
    k_db, k_tr, k_ryw = eng.k(b"db"), eng.k(b"tr"), eng.k(b"ryw")
    # 1. applied at commit to a stored value
    if existing is not None:
        tr = eng.db.create_transaction()
        tr[k_db] = existing
        tr[k_ryw] = existing
        tr.commit().wait()
    tr = eng.db.create_transaction()
    getattr(tr, op)(k_db, param)
    tr.commit().wait()
    assert _read(eng, k_db) == expected
    # 2. folded into a value set (or cleared) earlier in the same transaction
    tr = eng.db.create_transaction()
    if existing is None:
        tr.clear(k_tr)
    else:
        tr[k_tr] = existing
    getattr(tr, op)(k_tr, param)
    assert tr[k_tr].value == expected
    tr.commit().wait()
    assert _read(eng, k_tr) == expected
    # 3. a stored value read back inside the transaction after the op
    tr = eng.db.create_transaction()
    getattr(tr, op)(k_ryw, param)
    assert tr[k_ryw].value == expected
    assert [kv.value for kv in tr.get_range(k_ryw, k_ryw + b"\x00")] == ([] if expected is None else [expected])
    tr.commit().wait()
    assert _read(eng, k_ryw) == expected


def test_atomic_ops_chain_in_one_transaction(eng):
    k = eng.k(b"n")
    tr = eng.db.create_transaction()
    tr[k] = (10).to_bytes(8, "little")
    tr.commit().wait()
    tr = eng.db.create_transaction()
    tr.add(k, (5).to_bytes(8, "little"))
    tr.max(k, (12).to_bytes(8, "little"))
    tr.add(k, (1).to_bytes(8, "little"))
    tr.min(k, (100).to_bytes(8, "little"))
    tr.commit().wait()
    assert _read(eng, k) == (16).to_bytes(8, "little")


def test_compare_and_clear_then_other_ops_in_one_transaction(eng):
    k = eng.k(b"c")
    eng.db[k] = b"\x00CLE"
    tr = eng.db.create_transaction()
    tr.compare_and_clear(k, b"nope")
    tr.append_if_fits(k, b"AR")
    tr.commit().wait()
    assert _read(eng, k) == b"\x00CLEAR"
    tr = eng.db.create_transaction()
    tr.compare_and_clear(k, b"\x00CLEAR")
    tr.add(k, b"\x01")
    tr.commit().wait()
    assert _read(eng, k) == b"\x01"


def test_atomic_param_over_value_limit_is_deferred(eng):
    tr = eng.db.create_transaction()
    assert tr.append_if_fits(eng.k(b"a"), b"x" * 100_001) is None
    assert code_of(lambda: tr.commit().wait()) == 2103
