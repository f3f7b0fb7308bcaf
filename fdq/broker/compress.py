"""Stream compression of a broker connection, as nsqd negotiates it in IDENTIFY:
``deflate`` (raw DEFLATE, stdlib zlib, sync-flushed after each write) and ``snappy``
(the snappy *framing* format: a stream identifier, then chunks ``[type][3-byte LE
length][masked CRC32C][data]``, as Go's ``snappy.NewWriter``/``NewReader``).

Snappy uses cramjam (maintained, Rust-backed, no system library; python-snappy 0.7
is itself a wrapper of it): ``cramjam.snappy.compress``/``decompress`` produce and
check whole framed streams, CRC32C included; this module only cuts the incoming byte
stream at chunk boundaries and drops the repeated stream identifier on the way out.
Both codecs raise ``ValueError`` on a corrupt stream."""
from __future__ import annotations

import zlib

try:
    import cramjam
except ImportError:          # snappy is then not offered in IDENTIFY
    cramjam = None

SNAPPY_AVAILABLE = cramjam is not None
STREAM_ID = b"\xff\x06\x00\x00sNaPpY"
_MAX_CHUNK = 65536 + 4 + 4 + 32      # a chunk's data: 64 KiB uncompressed at most, plus CRC


class Deflate:
    def __init__(self, level: int):
        self._c = zlib.compressobj(level, zlib.DEFLATED, -15)
        self._d = zlib.decompressobj(-15)

    def compress(self, data: bytes) -> bytes:
        return self._c.compress(data) + self._c.flush(zlib.Z_SYNC_FLUSH)

    def decompress(self, data: bytes) -> bytes:
        try:
            return self._d.decompress(data)
        except zlib.error as e:
            raise ValueError(f"bad deflate stream: {e}") from None


class Snappy:
    def __init__(self):
        if cramjam is None:
            raise RuntimeError("snappy needs the cramjam package")
        self._sent_id = False
        self._in = bytearray()
        self._seen_id = False

    def compress(self, data: bytes) -> bytes:
        out = bytes(cramjam.snappy.compress(data))
        if self._sent_id:
            return out[len(STREAM_ID):]       # one stream identifier per stream
        self._sent_id = True
        return out

    def decompress(self, data: bytes) -> bytes:
        """The bytes of every complete chunk received so far; partial chunks wait."""
        buf = self._in
        buf += data
        if not self._seen_id:
            if len(buf) < len(STREAM_ID):
                return b""
            if bytes(buf[:len(STREAM_ID)]) != STREAM_ID:
                raise ValueError("bad snappy stream: no stream identifier")
            del buf[:len(STREAM_ID)]
            self._seen_id = True
        pos = 0
        while pos + 4 <= len(buf):
            n = int.from_bytes(buf[pos + 1:pos + 4], "little")
            if n > _MAX_CHUNK:
                raise ValueError(f"bad snappy stream: chunk of {n} bytes")
            if pos + 4 + n > len(buf):
                break
            pos += 4 + n
        if pos == 0:
            return b""
        chunks = bytes(buf[:pos])
        del buf[:pos]
        try:
            return bytes(cramjam.snappy.decompress(STREAM_ID + chunks))
        except Exception as e:       # cramjam.DecompressionError: corrupt chunk or CRC
            raise ValueError(f"bad snappy stream: {e}") from None


__all__ = ["Deflate", "Snappy", "SNAPPY_AVAILABLE"]
