"""Value codecs: messages, leases, dead letters, topic configs (msgpack).

A message record is a msgpack array ``[ts_ms, shard_key, msg_id, headers, body, attempts,
nchunks, replay_of]``; trailing defaults are dropped so a plain message costs a few bytes
over its body. Bodies over ``CHUNK_BYTES`` are split: the record keeps the chunk count and
the chunks live beside it (``.../chunks/<vs>/<i>``).
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import msgpack

CHUNK_BYTES = 90_000  # under FDB's 100,000-byte value limit, with room for the record
_DEFAULTS = (None, None, None, None, b"", 0, 0, None)
_local = threading.local()


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

    def encode(self) -> bytes:
        fields = [self.ts_ms, self.shard_key, self.msg_id, self.headers, self.body,
                  self.attempts, self.nchunks, self.replay_of]
        while len(fields) > 1 and fields[-1] == _DEFAULTS[len(fields) - 1]:
            fields.pop()
        return packer()(fields)

    @classmethod
    def decode(cls, raw) -> "Record":
        fields = msgpack.unpackb(bytes(raw), raw=False, use_list=True)
        return cls(*fields)


def has_chunks(raw: bytes) -> bool:
    """Whether an encoded record may have body chunks, without decoding it: a record of
    fewer than 7 fields (a msgpack fixarray 0x90-0x96) has none."""
    return not (0x90 <= raw[0] <= 0x96) and Record.decode(raw).nchunks > 0


def encode_lease(record: bytes, lease_id: bytes, consumer_id: str, ack_wait_ms: int,
                 touches: int = 0) -> bytes:
    return packer()([record, lease_id, consumer_id, ack_wait_ms, touches])


def decode_lease(raw):
    """-> (record bytes, lease_id, consumer_id, ack_wait_ms, touches)"""
    return tuple(msgpack.unpackb(bytes(raw), raw=False))


def encode_dead(record: bytes, reason: str, consumer_id: str | None) -> bytes:
    return packer()([record, reason, consumer_id])


def decode_dead(raw):
    """-> (record bytes, reason, consumer_id)"""
    return tuple(msgpack.unpackb(bytes(raw), raw=False))


def pack(obj) -> bytes:
    return packer()(obj)


def unpack(raw):
    return msgpack.unpackb(bytes(raw), raw=False)


def shard_of(shard_key: str, shards: int) -> int:
    """blake2b-64 of the UTF-8 shard key, mod the shard count (design §3)."""
    digest = hashlib.blake2b(shard_key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def split_body(body: bytes):
    """-> (inline body, [chunks]) with chunks only for bodies over CHUNK_BYTES."""
    if len(body) <= CHUNK_BYTES:
        return body, []
    return b"", [body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)]
