"""FoundationDB's API types and limits that are plain values, the same on every engine:
``KeySelector``, ``KeyValue``, ``StreamingMode``, ``strinc``, how a key or value is
taken (bytes, or ``as_foundationdb_key``/``as_foundationdb_value``), and the size limits
of keys, values, transactions and watches (``docs/fdb-semantics.md``, §1 and §6).
"""
from __future__ import annotations

KEY_SIZE_LIMIT = 10_000
SYSTEM_KEY_SIZE_LIMIT = 30_000      # keys starting with \xff
VALUE_SIZE_LIMIT = 100_000
TRANSACTION_SIZE_LIMIT = 10_000_000
DEFAULT_MAX_WATCHES = 10_000        # per Database


def key_bytes(k) -> bytes:
    """A key as FDB's keyToBytes takes it: as_foundationdb_key() if it has one, then
    bytes or TypeError (bytearray and memoryview too)."""
    if type(k) is bytes:
        return k
    f = getattr(k, "as_foundationdb_key", None)
    if f is not None:
        k = f()
    if not isinstance(k, bytes):
        raise TypeError(f"Key must be of type bytes, not {type(k).__name__}")
    return bytes(k)


def value_bytes(v) -> bytes:
    """A value as FDB's valueToBytes takes it (see ``key_bytes``)."""
    if type(v) is bytes:
        return v
    f = getattr(v, "as_foundationdb_value", None)
    if f is not None:
        v = f()
    if not isinstance(v, bytes):
        raise TypeError(f"Value must be of type bytes, not {type(v).__name__}")
    return bytes(v)


def strinc(key: bytes) -> bytes:
    """The first key after every key starting with ``key`` (FDB's strinc)."""
    key = key.rstrip(b"\xff")
    if not key:
        raise ValueError("Key must contain at least one byte not equal to 0xFF")
    return key[:-1] + bytes([key[-1] + 1])


class KeySelector:
    """As ``fdb.KeySelector``: the last key < key (<= if or_equal), then offset keys on."""

    __slots__ = ("key", "or_equal", "offset")

    def __init__(self, key, or_equal, offset):
        self.key = key
        self.or_equal = or_equal
        self.offset = offset

    def __add__(self, offset):
        return KeySelector(self.key, self.or_equal, self.offset + offset)

    def __sub__(self, offset):
        return KeySelector(self.key, self.or_equal, self.offset - offset)

    @classmethod
    def last_less_than(cls, key):
        return cls(key, False, 0)

    @classmethod
    def last_less_or_equal(cls, key):
        return cls(key, True, 0)

    @classmethod
    def first_greater_than(cls, key):
        return cls(key, True, 1)

    @classmethod
    def first_greater_or_equal(cls, key):
        return cls(key, False, 1)

    def __repr__(self):
        return f"KeySelector({self.key!r}, {self.or_equal!r}, {self.offset!r})"


class KeyValue:
    """As ``fdb.KeyValue``: ``.key``, ``.value`` (plain bytes), ``k, v = kv``."""

    __slots__ = ("key", "value")

    def __init__(self, key, value):
        self.key = key
        self.value = value

    def __iter__(self):
        yield self.key
        yield self.value

    def __repr__(self):
        return f"{self.key!r}: {self.value!r}"


class StreamingMode:
    want_all = -2
    iterator = -1
    exact = 0
    small = 1
    medium = 2
    large = 3
    serial = 4
