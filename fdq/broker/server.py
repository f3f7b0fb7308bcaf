"""The NSQ-compatible broker: nsqd's TCP protocol V2 over asyncio, translated to FDQ
calls. It holds no queue state of its own (only what is in flight on its connections),
so several broker processes can serve one database.

Mapping: topic = FDQ topic; channel = FDQ subscription. Each broker process runs one
pull-style ``fdq.Consumer`` per (topic, channel, desired tag) it serves and dispatches
its messages to the channel's connections by RDY. A message is leased for the
receiving connection's ``msg_timeout``; FIN = ack, REQ = nak(delay), TOUCH =
in_progress. Engine calls run in a thread pool; the event loop never blocks on them.

As nsqd: a message that times out on its connection (``msg_timeout``, extended by
TOUCH but never past ``--max-msg-timeout`` from its delivery) is requeued at once;
message frames go through the connection's output buffer (IDENTIFY
``output_buffer_size`` / ``output_buffer_timeout``), flushed when full, when the
client reaches its RDY, on the timeout, and before any response, error or heartbeat;
``deflate`` or ``snappy`` (``compress.py``) wrap the stream after IDENTIFY.

This module is the broker as a whole (its options, the listeners, the channels and
connections it serves, ``serve``/``run``); ``conn.py`` is one client connection,
``channel.py`` one channel, ``http.py`` the HTTP API.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import Maintenance, Producer, Supervisor, connect
from ..config import DEFAULT_SUBSCRIPTION, ProducerConfig, SubscriptionConfig, TopicConfig
from ..errors import ConfigError, FDQError, TopicNotFound
from ..web import WebApp
from . import compress, protocol as p
from .auth import AuthFile
from .authd import AuthServers
from .http import HTTPServer
from .loglimit import LogLimiter
from .lookupd import Registrar
from .protocol import fatal
from .channel import Channel, ChannelStats
from .conn import Conn

log = logging.getLogger("fdq.broker")

# Topics the broker creates (on PUB, SUB or /topic/create) have no FDQ ``default``
# subscription: as on nsqd, messages go to channels only, and what is published before
# the first channel exists is kept in the topic's log, which that channel starts from
# (ensure_channel). A ``default`` subscription nobody reads would grow without bound.
NEW_TOPIC = TopicConfig(subs=())


@dataclass
class BrokerOptions:
    """The broker's flags (nsqd's names): limits, TLS, auth."""

    limits: p.Limits = field(default_factory=p.Limits)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_required: bool = False
    auth_file: str | None = None
    threads: int = 64
    e2e_percentiles: tuple = ()      # --e2e-processing-latency-percentile (quantiles in (0, 1])
    e2e_window_s: float = 600.0      # --e2e-processing-latency-window-time
    broadcast_address: str = "127.0.0.1"   # --broadcast-address: the host others reach this broker at
    broadcast_tcp_port: int | None = None  # --broadcast-tcp-port / --broadcast-http-port: None, the bound ports
    broadcast_http_port: int | None = None
    lookupd_tcp_addresses: tuple = ()      # --lookupd-tcp-address: nsqlookupds to register with (lookupd.py)
    https_address: str | None = None       # --https-address: the HTTP API over TLS (--tls-cert/--tls-key)
    auth_http_addresses: tuple = ()        # --auth-http-address: nsqd's auth servers (authd.py)
    web_path: str | None = None      # --web-path: serve the web dashboard (fdq.web) there
    web_write_token: str | None = None   # --web-write-token: actions from the dashboard with it
    metrics_database: str = "leader"     # --metrics-database: leader | always | never (fdq.metrics)
    metrics_leader_timeout_s: float = 10.0   # --metrics-leader-timeout (fdq.metrics.LEADER_TIMEOUT_S)
    maintenance: bool = True         # --no-maintenance: take no part in the topics' retention (fdq.Maintenance)


class Broker:
    """Serves nsqd's TCP protocol (and, with ``http.py``, its HTTP API) over one FDQ
    database. ``await start(host, port)``, ``await close()``."""

    def __init__(self, db, options: BrokerOptions | None = None):
        self.db = db
        self.options = options or BrokerOptions()
        self.executor = ThreadPoolExecutor(self.options.threads, thread_name_prefix="fdq-broker")
        self.producer = Producer(db, config=ProducerConfig(auto_create=NEW_TOPIC))
        self.supervisor = Supervisor(db)
        self.channels = {}
        self.channel_stats = {}      # (topic, channel) -> ChannelStats
        self.conns = set()
        self.published = 0
        self.start_time = int(time.time())
        self.server = None
        self.ssl_context = None
        self.auth = None
        self._channel_locks = {}
        self.paused = set()          # (topic, channel) paused on this broker
        self.maintenance = None      # fdq.Maintenance, from start()
        self.tcp_port = None
        self.log_limiter = LogLimiter(log)
        lim = self.options.limits
        if self.options.tls_cert:
            if not self.options.tls_key:
                raise ConfigError("--tls-cert needs --tls-key")
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(self.options.tls_cert, self.options.tls_key)
            self.ssl_context = ctx
            lim.tls = True
            lim.tls_required = self.options.tls_required
        if self.options.auth_file and self.options.auth_http_addresses:
            raise ConfigError("--auth-file and --auth-http-address exclude each other: use one")
        if self.options.auth_file:
            self.auth = AuthFile.load(self.options.auth_file)
            lim.auth_required = True
        elif self.options.auth_http_addresses:
            self.auth = AuthServers(self.options.auth_http_addresses)
            lim.auth_required = True
        if not compress.SNAPPY_AVAILABLE:
            lim.snappy = False
        for q in self.options.e2e_percentiles:
            if not 0 < q <= 1:
                raise ConfigError(f"e2e processing latency percentile must be in (0, 1], not {q}")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def start(self, host: str = "127.0.0.1", port: int = 4150) -> int:
        self.server = await asyncio.start_server(self._accept, host, port, limit=1 << 20)
        self.tcp_port = self.server.sockets[0].getsockname()[1]
        if self.options.maintenance and self.maintenance is None:     # every topic's retention, TTL
            self.maintenance = Maintenance(self.db)
        return self.tcp_port

    async def _accept(self, reader, writer):
        conn = Conn(self, reader, writer)
        conn.task = asyncio.current_task()
        self.conns.add(conn)
        try:
            await conn.run()
        except asyncio.CancelledError:
            await conn._close()
        except Exception as e:
            self.unexpected(conn, "connection", e)
            await conn._close()

    def unexpected(self, conn, where: str, e: BaseException):
        """An exception no handler expected, on ``conn``: one WARNING line (the traceback
        at DEBUG), at most one a second per kind of failure: any client can cause
        them, and must not be able to flood the log."""
        self.log_limiter.warning(f"{where}:{type(e).__name__}", "client %s: %s failed: %s: %s",
                                 conn.remote, where, type(e).__name__, p.clip(str(e)))
        log.debug("client %s: %s failed", conn.remote, where, exc_info=e)

    def ensure_topic(self, topic: str):
        try:
            return self.supervisor.config(topic)
        except TopicNotFound:
            self.supervisor.create_topic(topic, subs=NEW_TOPIC.subs)
            return self.supervisor.config(topic)

    def ensure_channel(self, topic: str, channel: str, create: bool = True) -> SubscriptionConfig | None:
        """Create the channel's subscription if it is new. As nsqd, where a topic
        buffers messages until its first channel exists, the topic's first channel
        (other than FDQ's ``default``) starts from every message still in the topic's
        log; later channels get messages published from their creation on.
        ``create=False``: return the config a new channel gets (None if it exists), for
        the consumer that creates it and joins it at once (an ephemeral channel: one
        created by a broker killed before its consumer joined would never be deleted)."""
        config = self.ensure_topic(topic)
        if channel in config.subs:
            return None
        first = not [s for s in config.subs if s != DEFAULT_SUBSCRIPTION]
        sub = SubscriptionConfig(deliver_policy="all" if first else "new")
        if not create:
            return sub
        try:
            self.supervisor.create_subscription(topic, channel, sub, ephemeral=channel.endswith("#ephemeral"))
        except ConfigError:
            if channel not in self.supervisor.config(topic).subs:   # not a race with another broker
                raise

    def stats_for(self, topic: str, channel: str) -> ChannelStats:
        """The channel's counters on this broker (kept across its connections coming
        and going, as nsqd's; shared by the channel's tags)."""
        st = self.channel_stats.get((topic, channel))
        if st is None:
            o = self.options
            st = self.channel_stats[(topic, channel)] = ChannelStats(o.e2e_percentiles, o.e2e_window_s)
        return st

    async def is_extend(self, topic: str) -> bool:
        try:
            return (await self.run(self.supervisor.config, topic)).extend
        except FDQError:
            return False

    async def channel_for(self, topic: str, channel: str, ident: p.Identity) -> Channel:
        extend = await self.is_extend(topic)
        # youzan's subscribe rules for extend topics
        if extend and not ident.extend_support:
            raise fatal("E_SUB_EXTEND_NEED", f"topic {topic!r} is an extend topic: IDENTIFY with extend_support")
        if ident.extend_support and not extend:
            raise fatal("E_EXT_NOT_SUPPORT", f"topic {topic!r} has no extend support: IDENTIFY without extend_support")
        tag = ident.desired_tag if extend else None
        key = (topic, channel, tag)
        lock = self._channel_locks.setdefault(key, asyncio.Lock())
        async with lock:
            ch = self.channels.get(key)
            if ch is None or ch.closed:
                ch = Channel(self, topic, channel, tag, extend)
                await ch.open()
                self.channels[key] = ch
            return ch

    async def _drop_channel(self, ch: Channel):
        key = (ch.topic, ch.name, ch.tag)
        lock = self._channel_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if ch.conns or ch.closed:
                return
            if self.channels.get(key) is ch:
                del self.channels[key]
            await ch.close()

    def set_channel_paused(self, topic: str, channel: str, paused: bool):
        """Hold (or resume) dispatch of a channel's messages to this broker's clients."""
        if paused:
            self.paused.add((topic, channel))
        else:
            self.paused.discard((topic, channel))
        for (t, c, _tag), ch in self.channels.items():
            if (t, c) == (topic, channel):
                ch.wake.set()

    def paused_channels(self, topic: str) -> set:
        return {c for t, c in self.paused if t == topic}

    async def drop_channel_conns(self, topic: str, channel: str | None = None):
        """Close this broker's connections to a channel, or to every channel of the
        topic (before it is deleted: as nsqd, its clients are disconnected)."""
        for (t, c, _tag), ch in list(self.channels.items()):
            if t == topic and channel in (None, c):
                for conn in list(ch.conns):
                    await conn._close()

    async def close(self):
        """Stop accepting; close connections (their in-flight messages go back to the
        queue at once); leave every subscription; nothing accepted is lost."""
        if self.server is not None:
            self.server.close()
        conns = list(self.conns)
        for conn in conns:
            await conn._close()
        tasks = [c.task for c in conns if getattr(c, "task", None) is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        for ch in list(self.channels.values()):
            await ch.close()
        self.channels.clear()
        if self.maintenance is not None:
            await self.run(self.maintenance.close)
        self.executor.shutdown(wait=True)


async def serve(url: str, tcp_address: str = "127.0.0.1:4150", http_address: str | None = "127.0.0.1:4151",
                options: BrokerOptions | None = None, ready=None):
    """Run a broker until SIGTERM/SIGINT. ``ready(tcp_port, http_port, https_port)`` is called
    once listening (None for an address not served). Returns the signal that stopped it."""
    db = connect(url)
    broker = Broker(db, options)
    host, port = split_address(tcp_address)
    tcp_port = await broker.start(host, port)
    http_port = None
    http_server = None
    if http_address:
        hhost, hport = split_address(http_address)
        http_server = HTTPServer(broker)
        http_port = await http_server.start(hhost, hport)
    https_port = None
    if broker.options.https_address:
        if broker.ssl_context is None:
            raise ConfigError("--https-address needs --tls-cert and --tls-key")
        http_server = http_server or HTTPServer(broker)
        https_port = await http_server.start(*split_address(broker.options.https_address), broker.ssl_context)
    web = None
    if http_server is not None and broker.options.web_path:
        web = WebApp(db, write_token=broker.options.web_write_token, auth=broker.auth,
                     base=broker.options.web_path,
                     enable_hint="fdq broker --web-write-token TOKEN, or --auth-file with admin secrets").start()
        http_server.mount(broker.options.web_path, web)
    registrar = None
    o = broker.options
    if o.lookupd_tcp_addresses:
        registrar = Registrar(broker, o.lookupd_tcp_addresses, tcp_port=o.broadcast_tcp_port or tcp_port,
                              http_port=o.broadcast_http_port or http_port or 0)
        await registrar.start()
    stop = asyncio.Event()
    stopped_by = []
    loop = asyncio.get_running_loop()

    def on_signal(sig):
        stopped_by.append(sig)
        stop.set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    log.info("fdq broker: TCP on %s:%d, HTTP on %s", host, tcp_port, http_port)
    if ready is not None:
        ready(tcp_port, http_port, https_port)
    await stop.wait()
    if registrar is not None:
        await registrar.close()
    if http_server is not None:
        await http_server.close()
    if web is not None:
        web.close()
    await broker.close()
    return stopped_by[0] if stopped_by else None


def split_address(addr: str) -> tuple:
    host, _, port = addr.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or len(port) > 5:
        raise ConfigError(f"address must be host:port, not {addr!r}")
    return host.strip("[]"), int(port)


def run(url: str, tcp_address: str = "127.0.0.1:4150", http_address: str | None = "127.0.0.1:4151",
        options: BrokerOptions | None = None, ready=None):
    """Blocking entry point (``fdq broker`` calls this). Returns the signal that stopped it."""
    return asyncio.run(serve(url, tcp_address, http_address, options, ready))


__all__ = ["Broker", "BrokerOptions", "Channel", "Conn", "serve", "run", "split_address"]
