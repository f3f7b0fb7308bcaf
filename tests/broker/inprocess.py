"""The broker without sockets, for the broker tests: a writer that collects what a
connection writes, and a connection (or an HTTP request) fed bytes through an asyncio
StreamReader, on a ``Broker`` that is not listening."""
from __future__ import annotations

import asyncio

from fdq.broker.conn import Conn


class Writer:
    """What Conn and the HTTP server use of an asyncio StreamWriter (and of its
    transport), collecting what is written."""

    def __init__(self):
        self.data = bytearray()
        self.transport = self
        self.closing = False

    def write(self, data):
        self.data += data

    def is_closing(self):
        return self.closing

    def close(self):
        self.closing = True

    abort = close

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 4711) if name == "peername" else default

    def get_write_buffer_size(self):
        return 0

    async def drain(self):
        pass

    async def start_tls(self, context):
        raise OSError("no TLS in this test")


def reader_of(data: bytes) -> asyncio.StreamReader:
    """A StreamReader holding ``data``, then the end of the stream (in a running loop)."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def run_conn(broker, data: bytes, timeout: float = 20) -> tuple:
    """Serve ``data`` (then EOF) on a new connection of ``broker``: (bytes written, Conn)."""
    writer = Writer()
    conn = Conn(broker, reader_of(data), writer)
    broker.conns.add(conn)
    await asyncio.wait_for(conn.run(), timeout)
    return bytes(writer.data), conn
