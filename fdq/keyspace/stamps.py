"""Versionstamps as FDQ stores them: in keys (a message's position), in values (a
marker's or a dedupe entry's commit), and as message ids.

A stamped key ends with the tuple layer's Versionstamp: its code (0x33) and 12 bytes (the
commit's 10-byte stamp, then the message's 2-byte index in its transaction), so keys sort
by commit order and a key's last 12 bytes are the message's position (:func:`position_of`).
A stamped value starts with the commit's 10 bytes (:func:`stamped_value`).
"""
from __future__ import annotations

import struct

from fdb.tuple import Versionstamp

VS_CODE = b"\x33"   # the tuple layer's code of a Versionstamp
STAMP_BYTES = 13    # a stamped key's tuple-layer Versionstamp: its code and 12 bytes
# FDB's commit versions advance about this much per second (a recovery jumps ahead).
VERSIONS_PER_S = 1_000_000

FIRST_VS = Versionstamp(b"\x00" * 10, 0)    # at or before every position

_VS_PLACEHOLDER = VS_CODE + b"\xff" * 10
_INCOMPLETE = b"\xff" * 10
_VALUE_PLACEHOLDER = b"\x00" * 10     # a stamped value's stamp, before the commit fills it in
_OFFSET0 = struct.pack("<I", 0)       # ... at offset 0


def vs_key(prefix: bytes, user_version: int, suffix: bytes = b"") -> bytes:
    """``prefix`` + an incomplete tuple-layer Versionstamp + ``suffix``, with the 4-byte
    offset ``set_versionstamped_key`` wants: what ``pack_with_versionstamp`` builds, without
    re-encoding the prefix for every message."""
    return (prefix + _VS_PLACEHOLDER + user_version.to_bytes(2, "big") + suffix
            + struct.pack("<I", len(prefix) + 1))


def vs_key_parts(prefix: bytes) -> tuple:
    """``(head, offset)`` such that ``head + user_version.to_bytes(2, "big") + offset`` is
    ``vs_key(prefix, user_version)``: for writing many stamped keys under one prefix."""
    return prefix + _VS_PLACEHOLDER, struct.pack("<I", len(prefix) + 1)


def stamped_value(payload: bytes = b"") -> bytes:
    """A value for ``set_versionstamped_value``: the commit's 10-byte stamp, then ``payload``."""
    return _VALUE_PLACEHOLDER + payload + _OFFSET0


def stamp_of_value(raw) -> bytes:
    """The 10-byte commit stamp a ``stamped_value`` starts with (a dedupe entry's, a marker's)."""
    return bytes(raw[:10])


def position_of(key) -> bytes:
    """The position (12 bytes: stamp and index) of a key that ends with a Versionstamp."""
    return bytes(key[-12:])


class StoredVersionstamp(Versionstamp):
    """A complete Versionstamp read from a key, keeping its 12 bytes: the consuming hot
    path builds several keys and an id from each message's stamp (``to_bytes`` packs a
    struct every time). Equal to, hashes as, and packs as a plain ``Versionstamp``."""

    __slots__ = ("_bytes",)

    def __init__(self, raw: bytes):
        # Only the bytes: the parts are computed when asked (comparisons, hashing, some
        # supervisor paths), which the consuming hot path never does.
        self._bytes = raw

    @property
    def tr_version(self):
        return self._bytes[:10]

    @property
    def user_version(self):
        return (self._bytes[10] << 8) | self._bytes[11]

    def to_bytes(self):
        return self._bytes


def vs_from_bytes(raw: bytes) -> Versionstamp:
    """The complete Versionstamp of 12 stored bytes (a key's last 12, after 0x33)."""
    if type(raw) is not bytes:
        raw = bytes(raw)
    if len(raw) != 12 or raw[:10] == _INCOMPLETE:
        return Versionstamp.from_bytes(raw)
    return StoredVersionstamp(raw)


def version_of(vs: Versionstamp) -> int:
    """The commit version in a Versionstamp (its first 8 bytes)."""
    return int.from_bytes(vs.tr_version[:8], "big")


def message_id(vs: Versionstamp) -> str:
    """A message's printable id: 24 hex digits of its 12-byte versionstamp."""
    return vs.to_bytes().hex()


def parse_message_id(mid: str) -> Versionstamp:
    try:
        raw = bytes.fromhex(mid)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != 12:
        raise ValueError(f"invalid message id {mid!r}: expected 24 hex digits")
    return Versionstamp.from_bytes(raw)
