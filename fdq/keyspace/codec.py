"""Value codecs: messages, leases, dead letters, dedupe entries, push markers, pending
entries, replay progress, subscription records (msgpack).

A message record is a msgpack array ``[ts_ms, shard_key | home, msg_id, headers, body,
attempts, nchunks, replay_of, due]``; trailing defaults are dropped so a plain message costs
a few bytes over its body (and a record written before a field existed decodes with its
default). Slot 1 holds the shard key (a str), or for an unkeyed message its home shard (an
int: ``Record.home``, the shard its push chose, ``fdq.ops.routing``); msgpack writes an int
up to 127 in one byte, as nil. ``due``: a delayed message's due time (topic clock ms,
``membership.read_clock``), kept in its log entry so a copy made from the log (catch-up,
reset, replay, play) waits for it. Bodies over ``CHUNK_BYTES`` are split: the record keeps
the chunk count and the chunks live beside it (``.../chunks/<vs>/<i>``).

Every decoder here returns a value of the shape its writer wrote or raises
:class:`~fdq.errors.CorruptValue` (a damaged value: never msgpack's, ``ValueError``,
``TypeError``, ...): ``_decoding`` turns what goes wrong into it, and each checks the
decoded shape (list, field count, field types) where a wrong one would go on to fail
far from the read.
"""
from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass
from itertools import chain

import msgpack
from fdb.tuple import Versionstamp

from ..errors import CorruptValue
from .stamps import stamped_value, version_of

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
_DEFAULTS = (None, None, None, None, b"", 0, 0, None, None, None)
_NFIELDS = len(_DEFAULTS)
_local = threading.local()
# msgpack >= 1.0 (setup.cfg) decodes as this module wants by default (raw=False,
# use_list=True): calling it without keywords skips their parsing, about half of a small
# record's decode (0.63 -> 0.28 µs), which the consuming hot path pays per message.
_unpackb = msgpack.unpackb
# What decoding damaged bytes raises: msgpack's errors (ValueError subclasses and
# UnpackException), and what a well-formed value of the wrong shape makes the code
# after it raise.
_DECODE_ERRORS = (msgpack.UnpackException, ValueError, TypeError, IndexError, KeyError, AttributeError,
                  OverflowError, struct.error)


def _corrupt(what: str, raw, e: BaseException) -> CorruptValue:
    """The CorruptValue of a ``what`` whose ``raw`` bytes failed to decode with ``e``."""
    cause = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    try:
        raw = bytes(raw)
    except (TypeError, ValueError):
        raw = b""
    return CorruptValue(what, raw, cause[:300])


def _decoding(what: str, decode, raw):
    """``decode(raw)``, any decoding failure raised as CorruptValue naming ``what``."""
    try:
        return decode(raw)
    except _DECODE_ERRORS as e:
        raise _corrupt(what, raw, e) from None


class _Shape(ValueError):
    """A value decoded, but not to the shape its writer writes (raised inside the
    decoders, turned into CorruptValue)."""


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
    due: int | None = None      # topic clock ms a delayed message is due at
    expires: int | None = None  # topic clock ms from which it is never delivered (a TTL)
    home: int | None = None     # unkeyed: the shard its push chose (stored in shard_key's slot)

    def encode(self) -> bytes:
        slot = self.shard_key if self.shard_key is not None else self.home
        fields = [self.ts_ms, slot, self.msg_id, self.headers, self.body, self.attempts, self.nchunks,
                  self.replay_of, self.due, self.expires]
        while len(fields) > 1 and fields[-1] == _DEFAULTS[len(fields) - 1]:
            fields.pop()
        return packer()(fields)

    @classmethod
    def decode(cls, raw) -> "Record":
        """The record of ``raw``; CorruptValue if it is not one."""
        try:
            fields = _unpackb(raw if type(raw) is bytes else bytes(raw))
            if type(fields) is not list or not fields:
                raise _Shape(f"not a record: {type(fields).__name__}")
            if len(fields) > _NFIELDS:      # written by a newer version: its extra fields ignored
                del fields[_NFIELDS:]
            n = len(fields)
            # the first five fields (most records have no more) checked inline: a loop
            # over them doubled a small record's decode, which the consuming hot path pays
            if (type(fields[0]) is not int
                    or (n > 1 and type(fields[1]) not in _KEY_TYPES)
                    or (n > 2 and type(fields[2]) not in _STR_TYPES)
                    or (n > 3 and type(fields[3]) not in _MAP_TYPES)
                    or (n > 4 and type(fields[4]) is not bytes)
                    or (n > 5 and not all(map(_in, _SLOT_TYPES[5:], map(type, fields[5:]))))):
                raise _Shape("a field of the wrong type: " + ", ".join(type(v).__name__ for v in fields))
        except _DECODE_ERRORS as e:
            raise _corrupt("message record", raw, e) from None
        if len(fields) > 1 and type(fields[1]) is int:      # an unkeyed message's home
            home, fields[1] = fields[1], None
            return cls(*fields, home=home)
        return cls(*fields)


_RECORD_PAD = [None, None, None, None, b"", 0, 0, None]   # a record's dropped trailing defaults
_NONE = type(None)
_in = frozenset.__contains__
_KEY_TYPES, _STR_TYPES, _MAP_TYPES = (str, int, _NONE), (str, _NONE), (dict, _NONE)
# The types each record field may have (``Record.decode`` checks them): ts_ms,
# shard_key | home, msg_id, headers, body, attempts, nchunks, replay_of, due, expires.
_SLOT_TYPES = (frozenset({int}), frozenset({str, int, _NONE}), frozenset({str, _NONE}), frozenset({dict, _NONE}),
               frozenset({bytes}), frozenset({int}), frozenset({int}), frozenset({str, _NONE}),
               frozenset({int, _NONE}), frozenset({int, _NONE}))


def decode_columns(raws) -> tuple:
    """Records ``raws`` (a non-empty list) decoded column by column: ``(ts_ms, shard_key,
    msg_id, headers, body, nchunks, replay_of)`` sequences (``shard_key`` None for an
    unkeyed message; ``nchunks`` None when no record has chunks), for bulk readers."""
    # The batch's records in one msgpack call: concatenated under one array header,
    # each record a tuple; then column-wise in C (zip stops at the shortest record).
    # CorruptValue if any of them is not a record (callers then decode them one by one).
    try:
        recs = _unpackb(b"".join(chain((b"\xdd" + len(raws).to_bytes(4, "big"),), raws)), use_list=False)
        if set(map(type, recs)) != {tuple} or not all(recs):
            raise _Shape("not a list of records")
    except _DECODE_ERRORS as e:
        raise _corrupt("message records", b"", e) from None
    cols = list(zip(*recs))
    if len(cols) < 5:   # a record drops trailing default fields; most keep the first five
        pad = _RECORD_PAD
        recs = [r if len(r) >= 5 else r + tuple(pad[len(r):5]) for r in recs]
        cols = list(zip(*recs))
    tss, sks, mids, hds, bodies = cols[:5]
    del cols
    if not (set(map(type, tss)) <= {int} and set(map(type, bodies)) <= {bytes}
            and set(map(type, sks)) <= _SLOT_TYPES[1] and set(map(type, mids)) <= _SLOT_TYPES[2]
            and set(map(type, hds)) <= _SLOT_TYPES[3]):
        raise CorruptValue("message records", b"", "a field of the wrong type")
    if int in set(map(type, sks)):   # an unkeyed message's slot holds its home (Record.home)
        sks = [None if type(k) is int else k for k in sks]
    top = max(map(len, recs))
    nchunks = [r[6] if len(r) > 6 else 0 for r in recs] if top > 6 else None
    reps = [r[7] if len(r) > 7 else None for r in recs] if top > 7 else [None] * len(recs)
    if (nchunks is not None and not set(map(type, nchunks)) <= {int}) or not set(map(type, reps)) <= _SLOT_TYPES[7]:
        raise CorruptValue("message records", b"", "a field of the wrong type")
    return tss, sks, mids, hds, bodies, nchunks, reps


def has_chunks(raw: bytes) -> bool:
    """Whether an encoded record may have body chunks, without decoding it: a record of
    fewer than 7 fields (a msgpack fixarray 0x90-0x96) has none."""
    if not raw:
        raise CorruptValue("message record", raw, "empty")
    return not (0x90 <= raw[0] <= 0x96) and Record.decode(raw).nchunks > 0


# -- lease records ----------------------------------------------------------------------
#
# One record per leased batch (or part of one, see LEASE_RECORD_BYTES), under
# ``leased/<first vs>/<lease id>``: ``[2, lease_id, consumer_id, ack_wait_ms, vs_0, record_0,
# touches_0, vs_1, ...]`` (a flat msgpack array). ``vs_i`` is the message's 12-byte
# versionstamp, ``record_i`` its record as it was queued: this lease is delivery
# ``attempts + 1``. ``touches_i`` counts ``in_progress()`` calls of that message alone, so a
# touch restarts its own ack wait and not its siblings'.

LEASE_FORMAT = 2
# A batch's records are split into parts of about this many bytes each (a part holds at
# least one message, and one message's record always fits a value, as it did in a
# per-message lease row): under FDB's 100,000-byte value limit, and small enough that a
# partial settle (one FIN of a broker's batch) rewrites a few pages, not a whole batch.
LEASE_RECORD_BYTES = 16_000
LEASE_ENTRY_OVERHEAD = 24     # msgpack framing of one entry (vs, record, touches), rounded up


@dataclass
class LeaseRecord:
    """A decoded lease record: ``entries`` are ``[vs12, record, touches]`` lists. ``bump``
    is always 1 (what a record's ``attempts`` lacks to count this delivery); it goes once
    no caller passes it."""

    lease_id: bytes
    consumer_id: str
    ack_wait_ms: int
    entries: list
    bump: int = 1

    def encode(self) -> bytes:
        flat = [LEASE_FORMAT, self.lease_id, self.consumer_id, self.ack_wait_ms]
        for e in self.entries:
            flat += e
        return packer()(flat)

    def delivered(self, entry) -> "Record":
        """The entry's record with this delivery counted in ``attempts``."""
        rec = Record.decode(entry[1])
        rec.attempts += 1
        return rec


def encode_leases(lease_id: bytes, consumer_id: str, ack_wait_ms: int, flat_entries: list) -> bytes:
    """A lease record of ``flat_entries`` ``[vs12, record, touches, ...]``."""
    return packer()([LEASE_FORMAT, lease_id, consumer_id, ack_wait_ms] + flat_entries)


def decode_leases(key: bytes, raw) -> LeaseRecord:
    """A lease record (``key``: its key, unused: the record holds its stamps)."""
    try:
        v = _unpackb(bytes(raw))
        if (type(v) is not list or len(v) < 7 or (len(v) - 4) % 3 or v[0] != LEASE_FORMAT
                or type(v[1]) is not bytes or type(v[2]) is not str or type(v[3]) is not int
                or set(map(type, v[4::3])) != {bytes} or set(map(len, v[4::3])) != {12}
                or set(map(type, v[5::3])) != {bytes} or set(map(type, v[6::3])) != {int}):
            raise _Shape("not a lease record")
    except _DECODE_ERRORS as e:
        raise _corrupt("lease record", raw, e) from None
    return LeaseRecord(v[1], v[2], v[3], [v[i:i + 3] for i in range(4, len(v), 3)])


def lease_entries_hint(raw) -> int:
    """How many messages a lease record that does not decode held, as far as its array
    header still says (0 if that is damaged too, or claims more entries than its bytes
    could hold: at least ``LEASE_ENTRY_OVERHEAD`` + 13 bytes each)."""
    unpacker = msgpack.Unpacker()
    unpacker.feed(bytes(raw))
    try:
        n = unpacker.read_array_header()
    except _DECODE_ERRORS:
        return 0
    if n < 7 or (n - 4) % 3 or (n - 4) // 3 * (LEASE_ENTRY_OVERHEAD + 13) > len(raw):
        return 0
    return (n - 4) // 3


def encode_dead(record: bytes, reason: str, consumer_id: str | None, dead_ms: int, dead_version: int,
                raw: bool = False) -> bytes:
    """A dead letter: the record as delivered, or with ``raw`` the bytes of a record
    that did not decode, as they were stored (kept for inspection, never redriven);
    when: ``dead_ms`` the database clock (``clock.read_clock``) and ``dead_version`` the
    read version of the transaction that dead-lettered it (its age as a heartbeat's:
    ``clock.heartbeat_age``)."""
    return packer()([record, reason, consumer_id, raw, dead_ms, dead_version])


def decode_dead(raw):
    """-> (record bytes, reason, consumer_id, raw: whether the record bytes are an
    undecodable record's, dead_ms, dead_version) (``encode_dead``)"""
    try:
        v = _unpackb(bytes(raw))
        if (type(v) is not list or len(v) != 6 or type(v[0]) is not bytes or type(v[1]) is not str
                or type(v[2]) not in (str, _NONE) or type(v[3]) is not bool
                or type(v[4]) is not int or type(v[5]) is not int):
            raise _Shape("not a dead letter")
    except _DECODE_ERRORS as e:
        raise _corrupt("dead letter", raw, e) from None
    return tuple(v)


# -- push side: dedupe entries, markers, pending entries -------------------------------

_DEDUPE = struct.Struct(">HqI")      # after the stamp: user version, ts_ms, shard


@dataclass(frozen=True)
class DedupeEntry:
    """A user ``msg_id``'s dedupe entry: the first push's message (its 12-byte ``vs``),
    its producer time ``ts_ms`` and its ``shard``."""

    vs: Versionstamp
    ts_ms: int
    shard: int

    @property
    def version(self) -> int:
        """The commit version of the first push."""
        return version_of(self.vs)


def encode_dedupe(uv: int, ts_ms: int, shard: int) -> bytes:
    """The dedupe entry of message ``uv`` of this transaction, for
    ``set_versionstamped_value``: stamp ‖ uv ‖ ts_ms ‖ shard."""
    return stamped_value(_DEDUPE.pack(uv, ts_ms, shard))


def decode_dedupe(raw) -> DedupeEntry:
    def decode(raw):
        raw = bytes(raw)
        if len(raw) != 10 + _DEDUPE.size:
            raise _Shape(f"{len(raw)} bytes")
        _uv, ts_ms, shard = _DEDUPE.unpack_from(raw, 10)
        return DedupeEntry(Versionstamp.from_bytes(raw[:12]), ts_ms, shard)
    return _decoding("dedupe entry", decode, raw)


# A marker holds its transaction's results: over this, its payload is split into parts
# at marks/<txid>/<i> (FDB's value limit is 100,000 bytes); its value then starts with
# _SPLIT (a byte msgpack never uses) and the part count.
MARKER_PART_BYTES = 90_000
_SPLIT = b"\xc1"


def encode_marker(results) -> tuple:
    """A push marker of ``results``: ``(value, parts)``, the value for
    ``set_versionstamped_value`` (stamp ‖ payload, or stamp ‖ split mark ‖ part count ‖
    first part) and the further parts (values of ``marker_part_key(txid, 1..)``)."""
    payload = pack(results)
    if len(payload) <= MARKER_PART_BYTES:
        return stamped_value(payload), []
    parts = [payload[i:i + MARKER_PART_BYTES] for i in range(0, len(payload), MARKER_PART_BYTES)]
    return stamped_value(_SPLIT + len(parts).to_bytes(4, "big") + parts[0]), parts[1:]


def decode_marker(raw, rest=None) -> tuple:
    """``(stamp, results)`` of a marker's value; ``rest()`` returns its further parts'
    values, read only if the marker is split."""
    raw = bytes(raw)
    if len(raw) < 11:
        raise CorruptValue("push marker", raw, f"{len(raw)} bytes")
    stamp, payload = raw[:10], raw[10:]
    if payload[:1] == _SPLIT:
        payload = payload[5:] + b"".join(bytes(v) for v in rest())
    return stamp, _decoding("push marker", _unpackb, payload)


def encode_pending(n: int) -> bytes:
    """A pending entry (a message pushed while paused): its log bucket ``n``. (Its
    second slot, once a delay, is None: the record keeps ``due``.)"""
    return pack([n, None])


def decode_pending(raw) -> int:
    """The log bucket of a pending entry."""
    v = _decoding("pending entry", unpack, raw)
    n = v[0] if type(v) is list and v else v
    if type(n) is not int:
        raise CorruptValue("pending entry", raw, f"holds a {type(n).__name__}, not a bucket number")
    return n


# -- replay progress, subscription records -----------------------------------------------

def encode_replay(state: dict) -> bytes:
    """A replay run's progress: {start, end, stop, after, count, owner}."""
    return pack(state)


def decode_replay(raw) -> dict | None:
    return None if raw is None or raw == None else _decode_dict("replay progress", raw)  # noqa: E711 - FDB's absent Value


def _decode_dict(what: str, raw) -> dict:
    v = _decoding(what, unpack, raw)
    if type(v) is not dict:
        raise CorruptValue(what, raw, f"a {type(v).__name__}, not a map")
    return v


def encode_leader(holder: str, timeout_s: float) -> bytes:
    """The holder of a database-wide role (``fdq.ops.leaders``) and the timeout it
    advertises (how long its beat may stand still before another takes over)."""
    return pack({"holder": holder, "timeout_s": timeout_s})


def decode_leader(raw) -> dict | None:
    return None if raw is None or raw == None else _decode_dict("leader record", raw)  # noqa: E711 - FDB's absent Value


def encode_subscription(record: dict) -> bytes:
    """A subscription's record: its config and start point."""
    return pack(record)


def decode_subscription(raw) -> dict | None:
    if raw is None or raw == None:  # noqa: E711 - FDB's absent Value
        return None
    v = _decode_dict("subscription record", raw)
    if type(v.get("config")) is not dict:
        raise CorruptValue("subscription record", raw, "no config map")
    return v


def pack(obj) -> bytes:
    return packer()(obj)


def unpack(raw):
    """A stored msgpack value; CorruptValue if it does not decode."""
    try:
        return _unpackb(bytes(raw))
    except _DECODE_ERRORS as e:
        raise _corrupt("stored value", raw, e) from None


def shard_of(shard_key: str, shards: int) -> int:
    """blake2b-64 of the UTF-8 shard key, mod the shard count (docs/design.md §3)."""
    digest = hashlib.blake2b(shard_key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def split_body(body: bytes, force: bool = False):
    """-> (inline body, [chunks]) with chunks only for bodies over CHUNK_BYTES (or, with
    ``force``, for any non-empty body: one that fits alone but not with its record)."""
    if len(body) <= CHUNK_BYTES and not (force and body):
        return body, []
    return b"", [body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)]
