"""Value codecs: messages, leases, dead letters, topic configs (msgpack).

A message record is a msgpack array ``[ts_ms, shard_key | home, msg_id, headers, body,
attempts, nchunks, replay_of, due]``; trailing defaults are dropped so a plain message costs
a few bytes over its body (and a record written before a field existed decodes with its
default). Slot 1 holds the shard key (a str), or for an unkeyed message its home shard (an
int: ``Record.home``, the shard its push chose, ``fdq.ops.routing``); msgpack writes an int
up to 127 in one byte, as nil. ``due``: a delayed message's due time (database clock ms,
``membership.read_clock``), kept in its log entry so a copy made from the log (catch-up,
reset, replay, play) waits for it. Bodies over ``CHUNK_BYTES`` are split: the record keeps
the chunk count and the chunks live beside it (``.../chunks/<vs>/<i>``).
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import msgpack

CHUNK_BYTES = 90_000  # under FDB's 100,000-byte value limit, with room for the record
# A record (its inline body, headers, keys) is at most this big: a body that fits
# CHUNK_BYTES alone but not with the rest is chunked too. The room left under the value
# limit is for what wraps a record: a lease entry, a dead letter with its reason.
RECORD_BYTES = 92_000
# A chunk of a long operation (play, reshard, replay, DLQ redrive, a subscription's
# catch-up) stops once it has written about this much, whatever its message count:
# large messages must not take a chunk past FDB's 10 MB per transaction.
CHUNK_WRITE_BYTES = 2_000_000
# What routing one message to every subscription may write in one transaction (play
# routes a message pushed while paused alone if need be): under 10 MB with room for keys.
ROUTE_BYTES = 9_000_000
_DEFAULTS = (None, None, None, None, b"", 0, 0, None, None)
_NFIELDS = len(_DEFAULTS)
_local = threading.local()
# msgpack >= 1.0 (setup.cfg) decodes as this module wants by default (raw=False,
# use_list=True): calling it without keywords skips their parsing, about half of a small
# record's decode (0.63 -> 0.28 µs), which the consuming hot path pays per message.
_unpackb = msgpack.unpackb


def packer():
    """This thread's ``msgpack.packb(obj, use_bin_type=True)``, same bytes: ``packb``
    builds a Packer and its 256 KiB buffer on every call (~35 µs of a single push went
    to allocating and freeing them). One per thread: a Packer is not thread-safe."""
    pack_ = getattr(_local, "pack", None)
    if pack_ is None:
        pack_ = _local.pack = msgpack.Packer(use_bin_type=True).pack
    return pack_


@dataclass
class Record:
    ts_ms: int
    shard_key: str | None = None
    msg_id: str | None = None
    headers: dict | None = None
    body: bytes = b""
    attempts: int = 0
    nchunks: int = 0
    replay_of: str | None = None
    due: int | None = None      # database clock ms a delayed message is due at
    home: int | None = None     # unkeyed: the shard its push chose (stored in shard_key's slot)

    def encode(self) -> bytes:
        fields = [self.ts_ms, self.shard_key if self.shard_key is not None else self.home, self.msg_id, self.headers, self.body,
                  self.attempts, self.nchunks, self.replay_of, self.due]
        while len(fields) > 1 and fields[-1] == _DEFAULTS[len(fields) - 1]:
            fields.pop()
        return packer()(fields)

    @classmethod
    def decode(cls, raw) -> "Record":
        fields = _unpackb(raw if type(raw) is bytes else bytes(raw))
        if len(fields) > _NFIELDS:      # written by a newer version: its extra fields ignored
            del fields[_NFIELDS:]
        if len(fields) > 1 and type(fields[1]) is int:      # an unkeyed message's home
            home, fields[1] = fields[1], None
            return cls(*fields, home=home)
        return cls(*fields)


def has_chunks(raw: bytes) -> bool:
    """Whether an encoded record may have body chunks, without decoding it: a record of
    fewer than 7 fields (a msgpack fixarray 0x90-0x96) has none."""
    return not (0x90 <= raw[0] <= 0x96) and Record.decode(raw).nchunks > 0


# -- lease records ----------------------------------------------------------------------
#
# One record per leased batch (or part of one, see LEASE_RECORD_BYTES), under
# ``leased/<first vs>/<lease id>``: ``[2, lease_id, consumer_id, ack_wait_ms, vs_0, record_0,
# touches_0, vs_1, ...]`` (a flat msgpack array). ``vs_i`` is the message's 12-byte
# versionstamp, ``record_i`` its record as it was queued: this lease is delivery
# ``attempts + 1``. ``touches_i`` counts ``in_progress()`` calls of that message alone, so a
# touch restarts its own ack wait and not its siblings'.
#
# Format 1 (before batch records) kept one row per message under ``leased/<vs>``:
# ``[record, lease_id, consumer_id, ack_wait_ms, touches]`` with the attempt already
# counted in the record. Such a row still reads as a one-message batch (``bump`` 0).

LEASE_FORMAT = 2
# A batch's records are split into parts of about this many bytes each (a part holds at
# least one message, and one message's record always fits a value, as it did in a
# per-message lease row): under FDB's 100,000-byte value limit, and small enough that a
# partial settle (one FIN of a broker's batch) rewrites a few pages, not a whole batch.
LEASE_RECORD_BYTES = 16_000
LEASE_ENTRY_OVERHEAD = 24     # msgpack framing of one entry (vs, record, touches), rounded up


@dataclass
class LeaseRecord:
    """A decoded lease record: ``entries`` are ``[vs12, record, touches]`` lists; ``bump``
    is what a record's ``attempts`` lacks to count this delivery (1, or 0 for format 1)."""

    lease_id: bytes
    consumer_id: str
    ack_wait_ms: int
    entries: list
    bump: int = 1

    def encode(self) -> bytes:
        """Its value: format 2, or format 1 for a format-1 row (one message, its attempt
        counted in the record) being rewritten (a touch)."""
        if not self.bump:
            (_vs, record, touches), = self.entries
            return packer()([record, self.lease_id, self.consumer_id, self.ack_wait_ms, touches])
        flat = [LEASE_FORMAT, self.lease_id, self.consumer_id, self.ack_wait_ms]
        for e in self.entries:
            flat += e
        return packer()(flat)

    def delivered(self, entry) -> "Record":
        """The entry's record with this delivery counted in ``attempts``."""
        rec = Record.decode(entry[1])
        rec.attempts += self.bump
        return rec


def encode_leases(lease_id: bytes, consumer_id: str, ack_wait_ms: int, flat_entries: list) -> bytes:
    """A format-2 lease record of ``flat_entries`` ``[vs12, record, touches, ...]``."""
    return packer()([LEASE_FORMAT, lease_id, consumer_id, ack_wait_ms] + flat_entries)


def decode_leases(key: bytes, raw) -> LeaseRecord:
    """A lease record (either format); ``key`` is its key (a format-1 row's versionstamp
    is the key's last 12 bytes)."""
    v = _unpackb(bytes(raw))
    if v[0] == LEASE_FORMAT:
        return LeaseRecord(v[1], v[2], v[3], [v[i:i + 3] for i in range(4, len(v), 3)], 1)
    record, lease_id, consumer_id, ack_wait_ms, touches = v
    return LeaseRecord(lease_id, consumer_id, ack_wait_ms, [[bytes(key[-12:]), record, touches]], 0)


def encode_dead(record: bytes, reason: str, consumer_id: str | None) -> bytes:
    return packer()([record, reason, consumer_id])


def decode_dead(raw):
    """-> (record bytes, reason, consumer_id)"""
    return tuple(_unpackb(bytes(raw)))


def pack(obj) -> bytes:
    return packer()(obj)


def unpack(raw):
    return _unpackb(bytes(raw))


def shard_of(shard_key: str, shards: int) -> int:
    """blake2b-64 of the UTF-8 shard key, mod the shard count (design §3)."""
    digest = hashlib.blake2b(shard_key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def reshard_shard(rec: Record, vs, shards: int) -> int:
    """The shard a queued message moves to when the shard count changes to ``shards``:
    its shard key's, or (no key) one spread by its versionstamp."""
    if rec.shard_key is not None:
        return shard_of(rec.shard_key, shards)
    return int.from_bytes(vs.to_bytes()[-6:], "big") % shards


def split_body(body: bytes, force: bool = False):
    """-> (inline body, [chunks]) with chunks only for bodies over CHUNK_BYTES (or, with
    ``force``, for any non-empty body: one that fits alone but not with its record)."""
    if len(body) <= CHUNK_BYTES and not (force and body):
        return body, []
    return b"", [body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)]
