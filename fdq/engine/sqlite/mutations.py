"""How the embedded engine holds a transaction's mutations: the kinds of entry in its
write map, FoundationDB's atomic operations on bytes (``Atomic.h``; docs/fdb-semantics.md
§3), also as the SQL functions a commit applies them with, and range sets (sorted,
non-overlapping ``[begin, end)`` lists) for clears and conflict ranges.
"""
from __future__ import annotations

import bisect

import msgpack

from ..types import VALUE_SIZE_LIMIT

# A write map entry: (kind, data). _SET: the value; _CLEAR: None; _ATOMIC_OPS: a list of
# (op name, param) on the stored value; _VSVALUE: (value, stamp offset, atomic ops after it).
_SET, _CLEAR, _ATOMIC_OPS, _VSVALUE = 0, 1, 2, 3


# ---------------------------------------------------------------------------------
# Atomic operations, on bytes: existing value (None = absent) and param.


def _le_int(b: bytes, n: int) -> int:
    return int.from_bytes(b[:n].ljust(n, b"\x00"), "little")


def _op_add(old, p):
    if not old:
        return p
    n = len(p)
    return ((_le_int(old, n) + int.from_bytes(p, "little")) % (1 << (8 * n))).to_bytes(n, "little") if n else b""


def _bitwise(fn, empty_as_zero=False):
    def op(old, p):
        if old is None or (not old and not empty_as_zero):
            return p
        n = len(p)
        a = old[:n].ljust(n, b"\x00")
        return bytes(fn(x, y) for x, y in zip(a, p))
    return op


def _op_max(old, p):
    if not old:
        return p
    n = len(p)
    a = old[:n].ljust(n, b"\x00")
    return a if int.from_bytes(a, "little") > int.from_bytes(p, "little") else p


def _op_min(old, p):
    if old is None:
        return p
    n = len(p)
    a = old[:n].ljust(n, b"\x00")
    return a if int.from_bytes(a, "little") < int.from_bytes(p, "little") else p


def _op_byte_max(old, p):
    return p if old is None else max(old, p)


def _op_byte_min(old, p):
    return p if old is None else min(old, p)


def _op_append(old, p):
    if not old:
        return p
    return old + p if len(old) + len(p) <= VALUE_SIZE_LIMIT else old


def _op_compare_and_clear(old, p):
    return None if old is None or old == p else old


_ATOMIC = {
    "add": _op_add,
    "bit_and": _bitwise(lambda x, y: x & y, empty_as_zero=True),
    "bit_or": _bitwise(lambda x, y: x | y),
    "bit_xor": _bitwise(lambda x, y: x ^ y),
    "max": _op_max,
    "min": _op_min,
    "byte_max": _op_byte_max,
    "byte_min": _op_byte_min,
    "append_if_fits": _op_append,
    "compare_and_clear": _op_compare_and_clear,
}


def _sql_atomic(base, packed_ops):
    """SQL function: apply a transaction's atomic ops to the stored value at commit
    (one upsert statement for every atomic key). A cleared result is the INTEGER 0, which
    no stored value can be (values are BLOBs), and is deleted right after."""
    r = _apply_ops(base, msgpack.unpackb(packed_ops))
    return 0 if r is None else r


_ATOMIC_UPSERT = ("INSERT INTO kv (key, value) VALUES (?1, fdq_atomic(NULL, ?2)) "
                  "ON CONFLICT(key) DO UPDATE SET value = fdq_atomic(value, ?2)")


# Keys whose only atomic op is an add (counters: the common case), n rows in one
# statement: no ops to pack, and an absent key takes the operand as it is
# (_op_add(None, p) is p).
def _add_upsert(n: int) -> str:
    return ("INSERT INTO kv (key, value) VALUES " + ", ".join(["(?, ?)"] * n)
            + " ON CONFLICT(key) DO UPDATE SET value = fdq_add(value, excluded.value)")


def _apply_ops(base, ops):
    for name, param in ops:
        base = _ATOMIC[name](base, param)
    return base


# ---------------------------------------------------------------------------------
# Range sets


def _merge_ranges(ranges):
    out = []
    for b, e in sorted(ranges):
        if out and b <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([b, e])
    return out


def _overlaps(merged_begins, merged_ends, b, e) -> bool:
    j = bisect.bisect_right(merged_ends, b)
    return j < len(merged_begins) and merged_begins[j] < e
