"""Registration with nsqlookupd (``--lookupd-tcp-address``), as nsqd 1.3.0 does it, so
that NSQ clients discovering producers through ``nsqlookupd`` (``Reader(
lookupd_http_addresses=...)``, nsqadmin) find FDQ brokers.

nsqlookupd's TCP protocol V1 (nsqlookupd ``lookup_protocol_v1.go``): the magic
``"  V1"``, then ``IDENTIFY\\n`` + 4-byte big-endian length + JSON (``version``,
``tcp_port``, ``http_port``, ``hostname``, ``broadcast_address``), then
``REGISTER <topic> [<channel>]\\n`` / ``UNREGISTER ...`` / ``PING\\n``; every answer is
a 4-byte length and its data (``OK``, a JSON document, or an error text such as
``E_BAD_TOPIC ...``, after which lookupd closes the connection).

FDQ's brokers are stateless peers of one database: every broker registers every
topic of the database, and each of its subscriptions as a channel, read through the
public API every ``interval`` seconds and diffed against what the lookupd was told
(REGISTER what is new, UNREGISTER what is gone). A PING every 15 s; a failed
exchange closes the connection, and the next connect (back-off 1 s doubling to 15 s)
runs IDENTIFY and every REGISTER again (nsqd's ``connectCallback``). As nsqd, nothing
is unregistered at exit: lookupd drops a producer whose connection closes. FDQ's names
are NSQ's (``fdq.config.check_name``), so lookupd accepts every one.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct

log = logging.getLogger("fdq.broker.lookupd")

MAGIC_V1 = b"  V1"
PING_INTERVAL_S = 15.0
DIAL_TIMEOUT_S = 1.0
ANSWER_TIMEOUT_S = 5.0
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 15.0
MAX_ANSWER = 1 << 20


def registrations(topics) -> set:
    """What a broker registers for ``[(topic, TopicConfig)]``: ``(topic, "")`` for each
    topic and ``(topic, subscription)`` for each of its subscriptions."""
    out = set()
    for name, config in topics:
        out.add((name, ""))
        out.update((name, sub) for sub in config.subs)
    return out


def command(verb: str, topic: str, channel: str = "") -> bytes:
    return (" ".join(x for x in (verb, topic, channel) if x) + "\n").encode()


class LookupdError(Exception):
    """An error answer, a closed connection or a timeout: the connection is dropped."""


class LookupPeer:
    """One nsqlookupd: a connection kept up (IDENTIFY, then the registrations), told of
    every change of ``Registrar.wanted``, PINGed every 15 s."""

    def __init__(self, registrar: "Registrar", address: str):
        self.registrar = registrar
        self.address = address
        host, _, port = address.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.reader = self.writer = None
        self.registered = set()
        self.info = None              # lookupd's answer to IDENTIFY

    async def _connect(self):
        self.reader, self.writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port), DIAL_TIMEOUT_S)
        self.writer.write(MAGIC_V1)
        body = json.dumps(self.registrar.identity).encode()
        self.info = json.loads(await self._exchange(b"IDENTIFY\n" + struct.pack(">I", len(body)) + body))
        self.registered = set()
        log.info("lookupd %s: connected (%s)", self.address, self.info.get("version"))

    async def _exchange(self, data: bytes) -> bytes:
        self.writer.write(data)
        try:
            await self.writer.drain()
            head = await asyncio.wait_for(self.reader.readexactly(4), ANSWER_TIMEOUT_S)
            size = struct.unpack(">I", head)[0]
            if size > MAX_ANSWER:
                raise LookupdError(f"answer of {size} bytes")
            answer = await asyncio.wait_for(self.reader.readexactly(size), ANSWER_TIMEOUT_S)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, OSError) as e:
            raise LookupdError(f"{data.split(b' ')[0].strip().decode(errors='replace')}: "
                               f"{type(e).__name__} {e}") from None
        if answer.startswith(b"E_"):
            raise LookupdError(answer.decode(errors="replace"))
        return answer

    async def sync(self):
        """REGISTER what is wanted and not yet registered, UNREGISTER what is no longer."""
        wanted = self.registrar.wanted
        # channels go before their topic's UNREGISTER, topics before their channels' REGISTER
        for topic, channel in sorted(self.registered - wanted, key=lambda r: (r[0], r[1] == "")):
            await self._exchange(command("UNREGISTER", topic, channel))
            self.registered.discard((topic, channel))
        for topic, channel in sorted(wanted - self.registered):
            await self._exchange(command("REGISTER", topic, channel))
            self.registered.add((topic, channel))

    def _close(self):
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None
        self.registered = set()

    async def run(self):
        backoff = BACKOFF_MIN_S
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self._connect()
                backoff = BACKOFF_MIN_S
                next_ping = loop.time() + PING_INTERVAL_S
                while True:
                    changed = self.registrar.changed    # taken before sync: a change meanwhile sets it
                    if self.registered != self.registrar.wanted:
                        await self.sync()
                    try:
                        await asyncio.wait_for(changed.wait(), max(0.0, next_ping - loop.time()))
                    except asyncio.TimeoutError:
                        pass
                    if loop.time() >= next_ping:
                        await self._exchange(b"PING\n")
                        next_ping = loop.time() + PING_INTERVAL_S
            except (LookupdError, OSError, asyncio.TimeoutError, ValueError) as e:
                self.registrar.log_limiter.warning(f"lookupd:{self.address}", "lookupd %s: %s (retrying in %gs)",
                                                   self.address, e, backoff)
            finally:
                self._close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)


class Registrar:
    """The broker's registrations with every ``--lookupd-tcp-address``: ``start()`` once
    the broker listens, ``close()`` at exit."""

    def __init__(self, broker, addresses, *, tcp_port: int, http_port: int, interval: float = 5.0):
        o = broker.options
        self.broker = broker
        self.interval = interval
        self.log_limiter = broker.log_limiter
        self.identity = {"version": o.limits.version, "tcp_port": tcp_port, "http_port": http_port,
                         "hostname": socket.gethostname(), "broadcast_address": o.broadcast_address}
        self.wanted = set()
        self.changed = asyncio.Event()   # set (and replaced by a new one) when wanted changes
        self.peers = [LookupPeer(self, a) for a in addresses]
        self._tasks = []

    async def _list(self):
        """Read the topics and subscriptions; on a change, wake every peer."""
        try:
            wanted = registrations(await self.broker.run(self.broker.supervisor.topics))
        except Exception as e:      # noqa: BLE001 - the database may be briefly unreachable: retried
            self.log_limiter.warning("lookupd:topics", "lookupd: cannot list the topics: %s: %s",
                                     type(e).__name__, e)
            return
        if wanted != self.wanted:
            self.wanted = wanted
            old, self.changed = self.changed, asyncio.Event()
            old.set()

    async def _refresh(self):
        while True:
            await asyncio.sleep(self.interval)
            await self._list()

    async def start(self):
        await self._list()                # the first IDENTIFY is followed by every REGISTER
        self._tasks = [asyncio.create_task(self._refresh())] + \
            [asyncio.create_task(p.run()) for p in self.peers]

    async def close(self):
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for p in self.peers:
            p._close()


__all__ = ["Registrar", "LookupPeer", "registrations"]
