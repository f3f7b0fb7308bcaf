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
"""
from __future__ import annotations

import asyncio
import base64
import fcntl
import functools
import json
import logging
import random
import signal
import ssl
import struct
import termios
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import Consumer, ConsumerConfig, Maintenance, Producer, Supervisor, connect
from ..config import DEFAULT_SUBSCRIPTION, ProducerConfig, SubscriptionConfig, TopicConfig
from ..errors import ConfigError, FDQError, InvalidHeader, LeaseLost, MessageTooLarge, TopicNotFound
from ..settlement import Action, Settlement
from ..web import WebApp
from . import compress, protocol as p
from .auth import AuthFailed, AuthFile
from .authd import AuthServers
from .http import HTTPServer
from .loglimit import LogLimiter
from .lookupd import Registrar
from .quantile import Quantile
from .protocol import ProtocolError, fatal, nonfatal

log = logging.getLogger("fdq.broker")

INIT, SUBSCRIBED, CLOSING = "init", "subscribed", "closing"
NSQD_STATE = {INIT: 0, SUBSCRIBED: 3, CLOSING: 4}     # nsqd's client states in /stats
MAX_DELIVER = 0xFFFF           # NSQ never dead-letters: attempts is a uint16
# Topics the broker creates (on PUB, SUB or /topic/create) have no FDQ ``default``
# subscription: as on nsqd, messages go to channels only, and what is published before
# the first channel exists is kept in the topic's log, which that channel starts from
# (ensure_channel). A ``default`` subscription nobody reads would grow without bound.
NEW_TOPIC = TopicConfig(subs=())
FETCH_WAIT_S = 0.5
# A connection's publishes run concurrently (group-committed by the producer) and answer
# in order; past these many, or bytes, not yet committed it reads nothing more until some
# are (nsqd runs them one at a time): a client pipelining faster than the database
# commits cannot grow the broker's memory without bound.
MAX_PENDING_PUBLISHES = 256
MAX_PENDING_PUBLISH_BYTES = 32 << 20
# Past these many bytes written to a connection and not yet taken by its client, it gets
# no more messages until the client has read them down; if it reads nothing for a
# heartbeat interval it is closed (nsqd's writes time out after a heartbeat interval).
# Without it a client that stops reading but keeps sending NOPs had every message that
# timed out on it delivered to it again, into memory: the broker grew without bound.
WRITE_HIGH_WATER = 1 << 20
_TIOCOUTQ = getattr(termios, "TIOCOUTQ", None)
CLOSE_LINGER_S = 5.0           # a closed connection's unsent output is dropped after this


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


class ChannelStats:
    def __init__(self, percentiles: tuple = (), window_s: float = 600.0):
        self.e2e = Quantile(percentiles, window_s)
        self.message_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        self.published = {}        # topic -> messages published on this connection
        self.timeout_count = 0
        self.finish_count = 0


class Channel:
    """One (topic, channel, tag) served by this broker: a pull consumer and the
    connections subscribed to it."""

    def __init__(self, broker: "Broker", topic: str, name: str, tag: str | None, extend: bool):
        self.broker = broker
        self.topic = topic
        self.name = name
        self.tag = tag
        self.extend = extend
        self.consumer = None
        self.conns = []
        self.stats = broker.stats_for(topic, name)
        self.wake = asyncio.Event()
        self._rr = 0
        self._settles = []
        self._flushing = None
        self._task = None
        self.closed = False

    async def open(self):
        b = self.broker
        cfg = ConsumerConfig(ack_wait_s=b.options.limits.msg_timeout_ms / 1000, max_deliver=MAX_DELIVER,
                             maintenance=False)     # the broker's fdq.Maintenance does it
        kwargs = dict(subscription=self.name, config=cfg, create=False, batch_size=100)
        if self.extend:
            kwargs.update(extend_support=True, desired_tag=self.tag)
        new = await b.run(b.ensure_channel, self.topic, self.name, not self.name.endswith("#ephemeral"))
        if new is not None:     # an ephemeral channel: created and joined in one transaction
            kwargs.update(create=True, subscription_config=new, ephemeral=True)
        else:                   # refused before joining: a waiting ephemeral one would be deleted
            self._check_acknowledged((await b.run(b.supervisor.subscription, self.topic, self.name))["config"])
        try:
            self.consumer = await b.run(functools.partial(Consumer, b.db, self.topic, **kwargs))
        except ConfigError:
            if new is None or self.name not in (await b.run(b.supervisor.config, self.topic)).subs:
                raise
            # another broker created it meanwhile, with the start point of a later channel
            kwargs.update(create=False, subscription_config=None, ephemeral=False)
            self.consumer = await b.run(functools.partial(Consumer, b.db, self.topic, **kwargs))
        try:        # created again meanwhile: refused before anything is fetched
            self._check_acknowledged(self.consumer.sub_config)
        except ProtocolError:
            consumer, self.consumer = self.consumer, None
            await b.run(consumer.close)
            raise
        self._task = asyncio.get_running_loop().create_task(self._pump())

    def _check_acknowledged(self, config: SubscriptionConfig):
        """An NSQ channel is acknowledged (FIN/REQ/TOUCH). A subscription with ack_policy
        none takes its messages when fetched: FIN would fail, and what the broker hands
        back (no connection can take it, paused during a fetch) would be lost. A live
        channel's subscription created again with ack_policy none is refused by its
        consumer (it does not rejoin)."""
        if config.ack_policy == "none":
            raise fatal("E_BAD_CHANNEL", f"SUB channel {self.name!r} of topic {self.topic!r} has ack_policy "
                                         f"'none' (messages are taken when delivered, never acknowledged): "
                                         f"an NSQ channel is acknowledged with FIN/REQ/TOUCH; use a "
                                         f"subscription with ack_policy 'explicit'")

    def add(self, conn):
        self.conns.append(conn)
        self.wake.set()

    async def remove(self, conn):
        if conn in self.conns:
            self.conns.remove(conn)
        if not self.conns and not self.closed:
            await self.broker._drop_channel(self)

    async def close(self):
        self.closed = True
        self.wake.set()
        if self._task is not None:
            # let a fetch under way finish (bounded by FETCH_WAIT_S) so what it leased is
            # returned below, rather than left to expire
            done, _ = await asyncio.wait([self._task], timeout=FETCH_WAIT_S + 10)
            if not done:
                self._task.cancel()
        await self.flush()
        if self.consumer is not None:
            await self.broker.run(self.consumer.close)

    def _pick(self, batch: bool = True, max_timeout_ms: int | None = None):
        if (self.topic, self.name) in self.broker.paused:
            return None
        # A connection is served when a worthwhile batch fits (a quarter of its RDY, at
        # most 50) or it has nothing in flight: one lease transaction per FIN would
        # otherwise bound throughput at one message per transaction.
        ready = [c for c in self.conns
                 if c.capacity > 0 and (not batch or not c.in_flight or c.capacity >= min(50, max(1, c.rdy // 4)))
                 and (max_timeout_ms is None or c.ident.msg_timeout_ms <= max_timeout_ms)]
        if not ready:
            return None
        self._rr = (self._rr + 1) % len(ready)
        return ready[self._rr]

    async def _pump(self):
        b = self.broker
        while not self.closed:
            target = self._pick()
            if target is None:
                self.wake.clear()
                if self._pick() is None:
                    await self.wake.wait()
                continue
            n = min(target.capacity, 500)
            lease_ms = target.ident.msg_timeout_ms
            try:
                msgs = await b.run(functools.partial(self.consumer.fetch, n, FETCH_WAIT_S,
                                                     ack_wait_s=lease_ms / 1000))
            except Exception as e:      # keep serving: the consumer retries, leases expire
                log.warning("channel %s/%s: fetch failed: %s: %s", self.topic, self.name, type(e).__name__, e)
                await asyncio.sleep(0.2)
                continue
            if not msgs:
                continue
            if self.closed or (self.topic, self.name) in b.paused:
                rest = msgs      # paused while we fetched: back to the queue
            else:
                rest = target.deliver(msgs) if target.capacity > 0 else msgs
            while rest:
                # only to a connection whose msg_timeout fits in these leases: a longer
                # one would see them expire and be redelivered while it still holds them
                other = self._pick(batch=False, max_timeout_ms=lease_ms)
                if other is None:
                    break
                rest = other.deliver(rest)
            for m in rest:           # nobody can take it now: back to the queue at once, no attempt counted
                self.settle(None, m, "release")

    # -- settlements, committed in batches -----------------------------------------

    def settle(self, conn, m, action, arg=None, nsq_id: bytes = b""):
        self._settles.append((conn, m, action, arg, nsq_id))
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def flush(self):
        while self._flushing is not None:
            await asyncio.shield(self._flushing)

    async def _flush(self):
        try:
            while self._settles:
                batch, self._settles = self._settles, []
                items = [Settlement(m, Action(a), x) for _c, m, a, x, _i in batch]
                failed, why = [], ""
                try:
                    await self.broker.run(self.consumer.settle, items)
                except LeaseLost as e:
                    why = "lease lost"
                    lost = set(e.ids)
                    failed = [t for t in batch if t[1].id in lost]
                except FDQError as e:
                    why = str(e)
                    failed = batch
                for conn, _m, action, _x, nsq_id in failed:
                    if conn is not None:
                        code = {"ack": "E_FIN_FAILED", "nak": "E_REQ_FAILED", "touch": "E_TOUCH_FAILED"}[action]
                        verb = {"ack": "FIN", "nak": "REQ", "touch": "TOUCH"}[action]
                        conn.send_error(nonfatal(code, f"{verb} {nsq_id.decode()} failed {why}"))
        finally:
            self._flushing = None


def nsq_message_id(fdq_id: str) -> bytes:
    """The NSQ id of FDQ message ``fdq_id`` (12 bytes): its 16-character URL-safe base64
    (printable, no space). As nsqd's, a message keeps its id when it is requeued or
    redelivered (here on any broker), so clients can recognise a redelivery by it."""
    return base64.urlsafe_b64encode(bytes.fromhex(fdq_id))


class Conn:
    """One client connection."""

    def __init__(self, broker: "Broker", reader, writer):
        self.broker = broker
        self.reader = reader
        self.writer = writer
        lim = broker.options.limits
        self.parser = p.Parser(max_msg_size=lim.max_msg_size, max_body_size=lim.max_body_size,
                               max_req_timeout_ms=lim.max_req_timeout_ms)
        self.ident = p.Identity(heartbeat_interval_ms=lim.heartbeat_interval_ms, msg_timeout_ms=lim.msg_timeout_ms)
        self.state = INIT
        self.identified = False
        self.rdy = 0
        self.in_flight = {}        # nsq id -> (fdq Message, deadline)
        self.channel = None
        self.auth = None           # granted permissions (auth.Grant) once AUTH succeeded
        self._secret = b""         # AUTH's, to ask an auth server again when the grant expires
        self._out = asyncio.Queue()
        self._pending_publishes = 0    # publishes not yet committed (or failed), and their bytes
        self._pending_bytes = 0
        self._publish_room = asyncio.Event()
        self._codec = None         # compress.Deflate / compress.Snappy once negotiated
        self._obuf = []            # output buffer (message frames, then a flush)
        self._olen = 0
        self._flush_timer = None
        self._last_hb = time.monotonic()      # the first heartbeat one interval after connecting
        self._upgrading = False    # TLS handshake under way: nothing may be written
        self._drainer = None       # a task waiting for the client to read its backlog down
        self._blocked_since = None     # since when (monotonic) the client has taken nothing of it
        self._blocked_size = 0         # the backlog (bytes) when last seen
        self.closed = False
        self.remote = writer.get_extra_info("peername")
        self.connect_ts = int(time.time())
        self.message_count = 0
        self.finish_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        self.published = {}        # topic -> messages published on this connection

    def stats(self) -> dict:
        """nsqd's client stats fields."""
        host, port = (self.remote or ("", 0))[:2]
        return {"client_id": self.ident.client_id, "hostname": self.ident.hostname, "version": "V2",
                "remote_address": f"{host}:{port}", "state": NSQD_STATE[self.state],
                "ready_count": self.rdy, "in_flight_count": len(self.in_flight),
                "message_count": self.message_count, "finish_count": self.finish_count,
                "requeue_count": self.requeue_count, "connect_ts": self.connect_ts,
                "sample_rate": self.ident.sample_rate, "deflate": self.ident.deflate,
                "snappy": self.ident.snappy, "user_agent": self.ident.user_agent, "tls": self.ident.tls_v1,
                "authed": self.auth is not None, "msg_timeout": self.ident.msg_timeout_ms,
                "heartbeat_interval": self.ident.heartbeat_interval_ms, "name": self.ident.client_id,
                "timeout_count": self.timeout_count, "deferred_count": 0,
                "auth_identity": self.auth.identity if self.auth is not None else "", "auth_identity_url": self.auth.identity_url if self.auth is not None else "",
                "output_buffer_size": self.ident.output_buffer_size,
                "output_buffer_timeout": self.ident.output_buffer_timeout_ms,
                "pub_counts": [{"topic": t, "count": n} for t, n in sorted(self.published.items())],
                **self._tls_stats()}

    def _tls_stats(self) -> dict:
        obj = self.writer.get_extra_info("ssl_object") if self.ident.tls_v1 else None
        cipher = obj.cipher() if obj is not None else None
        return {"tls_cipher_suite": cipher[0] if cipher else "", "tls_version": obj.version() if obj else "",
                "tls_negotiated_protocol": (obj.selected_alpn_protocol() or "") if obj else "",
                "tls_negotiated_protocol_is_mutual": False}

    @property
    def capacity(self) -> int:
        if self.closed or self.state != SUBSCRIBED or self._drainer is not None:
            return 0
        return self.rdy - len(self.in_flight)

    # -- output ----------------------------------------------------------------------

    def _write(self, data: bytes):
        """Send ``data`` now, after whatever messages are buffered (nsqd flushes on every
        response, error and heartbeat)."""
        self._obuf.append(data)
        self._flush()

    def _write_messages(self, data: bytes):
        """Buffer message frames as nsqd's output buffer (IDENTIFY ``output_buffer_size``
        / ``output_buffer_timeout``): sent once the buffer is full, when the client can
        take no more (RDY reached), or when the timeout fires, whichever comes first."""
        self._obuf.append(data)
        self._olen += len(data)
        ident = self.ident
        if self._olen >= ident.output_buffer_size or ident.output_buffer_timeout_ms <= 0 or self.capacity <= 0:
            self._flush()
        elif self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(
                ident.output_buffer_timeout_ms / 1000, self._flush)

    def _flush(self):
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if not self._obuf:
            return
        data = self._obuf[0] if len(self._obuf) == 1 else b"".join(self._obuf)
        self._obuf.clear()
        self._olen = 0
        if self.closed or self.writer.is_closing():
            return
        if self._codec is not None:
            data = self._codec.compress(data)
        self.writer.write(data)
        if self._drainer is None:
            if self.writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                self._blocked_since, self._blocked_size = time.monotonic(), self._backlog()
                self._drainer = asyncio.get_running_loop().create_task(self._drain())

    def _backlog(self) -> int:
        """Bytes written to the connection and not yet taken by the client: asyncio's
        buffer plus, where the system tells (TIOCOUTQ), the socket's send queue. The
        kernel lets asyncio write again only once much of its queue is free, so the
        first alone does not show a client reading slowly but steadily."""
        transport = self.writer.transport
        size = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        if _TIOCOUTQ is not None and sock is not None:
            try:
                size += struct.unpack("i", fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[0]
            except (OSError, ValueError):
                pass
        return size

    async def _drain(self):
        """Wait until the client has read its backlog down, then serve it again."""
        try:
            await self.writer.drain()
        except Exception:       # the connection is lost: its reading loop closes it
            return
        finally:
            self._drainer = None
            self._blocked_since = None
        if self.channel is not None:
            self.channel.wake.set()

    def send_error(self, err: ProtocolError):
        self._out.put_nowait(err.frame())
        if err.fatal:
            self._out.put_nowait(None)
            # as nsqd, one line per client error that ends a connection (INFO here: a
            # client's mistake, not the broker's), rate-limited: any client can cause it
            self.broker.log_limiter.log(logging.INFO, f"fatal:{err.code}", "client %s: %s: closing",
                                        self.remote, p.clip(str(err)))

    def deliver(self, msgs: list) -> list:
        """Send as many of ``msgs`` as RDY allows; return the rest."""
        n = max(0, self.capacity)
        if n == 0:
            return msgs
        now = time.monotonic()
        deadline = now + self.ident.msg_timeout_ms / 1000
        ch = self.channel
        sample = self.ident.sample_rate
        ext = self.ident.extend_support and ch.extend
        in_flight = self.in_flight
        out = []
        head = p.MESSAGE_HEAD.pack
        for m in msgs[:n]:
            if sample and random.randrange(100) >= sample:
                ch.settle(None, m, "ack")       # nsqd drops unsampled messages for this client
                continue
            nsq_id = nsq_message_id(m.id)
            in_flight[nsq_id] = [m, deadline, now]    # message, deadline, delivered at
            if ext:
                out.append(p.message(m.insertion_time * 1_000_000, m.attempts, nsq_id, m.body,
                                     json.dumps(dict(m.headers), separators=(",", ":")).encode()))
            else:
                body = m.body
                out.append(head(len(body) + 30, p.FRAME_MESSAGE, m.insertion_time * 1_000_000,
                                min(m.attempts, 0xFFFF)) + nsq_id + body)
        if out:
            self.message_count += len(out)
            ch.stats.message_count += len(out)
            self._write_messages(b"".join(out))
        return msgs[n:]

    async def _responder(self):
        """Write responses in command order; a publish's response waits for its commit."""
        while True:
            item = await self._out.get()
            try:
                if item is None:
                    await self._close()
                    return
                if isinstance(item, bytes):
                    self._write(item)
                    continue
                try:
                    result = await item
                except ProtocolError as e:
                    self._write(e.frame())
                    if e.fatal:
                        await self._close()
                        return
                    continue
                except Exception as e:      # a publish failed as no handler expected
                    self._write(fatal("E_INTERNAL", "publish failed").frame())
                    self.broker.unexpected(self, "publish", e)
                    await self._close()
                    return
                self._write(result)
                if self.writer.transport.get_write_buffer_size() > 1 << 20:
                    await self.writer.drain()
            finally:
                self._out.task_done()

    # -- main loop -------------------------------------------------------------------

    async def run(self):
        responder = asyncio.get_running_loop().create_task(self._responder())
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeats())
        try:
            while not self.closed:
                hb = self.ident.heartbeat_interval_ms
                timeout = 2 * hb / 1000 if hb > 0 else None
                try:
                    data = await asyncio.wait_for(self.reader.read(65536), timeout)
                except asyncio.TimeoutError:
                    log.info("client %s missed two heartbeats: closing", self.remote)
                    break
                except (ConnectionError, ssl.SSLError, OSError):
                    break
                if not data or self.closed:     # closed meanwhile (a fatal error): read no more
                    break
                if self._codec is not None:
                    try:
                        data = self._codec.decompress(data)
                    except ValueError as e:
                        self.send_error(fatal("E_INVALID", str(e)))
                        break
                tls_gate = self.broker.options.limits.tls_required and not self.ident.tls_v1
                for item in self.parser.feed(data):
                    if isinstance(item, ProtocolError):
                        self.send_error(item)
                        if item.fatal:
                            break
                        continue
                    while self._publishes_full():
                        self._publish_room.clear()
                        await self._publish_room.wait()     # set as publishes finish
                    if self.closed:     # a publish's fatal error closed it meanwhile: run no more
                        break
                    try:
                        sync = _SYNC_HANDLERS.get(item.name)
                        if sync is not None and not tls_gate:
                            sync(self, item)        # FIN, REQ, TOUCH, RDY, NOP: no await
                        else:
                            await self._exec(item)
                    except ProtocolError as e:
                        self.send_error(e)
                        if e.fatal:
                            self.parser.dead = True     # as nsqd: nothing after it is executed
                            break
                    except Exception as e:      # a bug, or input no check foresaw: this connection ends
                        self.send_error(fatal("E_INTERNAL", f"{item.name.decode('utf-8', 'replace')} failed"))
                        self.parser.dead = True
                        self.broker.unexpected(self, f"{item.name.decode('utf-8', 'replace')}", e)
                        break
                if self.parser.dead:
                    break
                if self.closed:
                    break
            # let queued responses (and a fatal error frame) go out before closing
            if not self.closed:
                self._out.put_nowait(None)
                try:
                    await asyncio.wait_for(responder, 30)
                except (asyncio.TimeoutError, Exception):
                    pass
        finally:
            heartbeat.cancel()
            responder.cancel()
            await self._close()

    async def _close(self):
        if self.closed:
            return
        self.closed = True
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        ch = self.channel
        if ch is not None:
            for nsq_id, (m, _d, _t) in list(self.in_flight.items()):
                ch.settle(None, m, "nak", 0)    # requeued at once, as nsqd
            self.in_flight.clear()
            await ch.remove(self)
        try:
            self.writer.close()
            # close() waits for what is buffered to go out: to a client that reads
            # nothing (a frozen process) for ever, holding the socket and the buffer
            if self.writer.transport.get_write_buffer_size() > 0:
                asyncio.get_running_loop().call_later(CLOSE_LINGER_S, self.writer.transport.abort)
        except Exception:
            pass
        self.broker.conns.discard(self)

    async def _heartbeats(self):
        while not self.closed:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            hb = self.ident.heartbeat_interval_ms / 1000
            if self._blocked_since is not None:
                size = self._backlog()
                if size < self._blocked_size:         # it took some: progress
                    self._blocked_since = now
                self._blocked_size = size
                if hb > 0 and now - self._blocked_since > hb:
                    # as nsqd's write deadline: a client that took nothing for a heartbeat
                    # interval is dropped (abort: close would wait for the backlog to go
                    # out); the reading loop ends and its in-flight messages are requeued
                    log.info("client %s read nothing for %.0f s: closing", self.remote, now - self._blocked_since)
                    self.writer.transport.abort()
                    return
            if hb > 0 and now - self._last_hb >= hb and not self._upgrading:
                self._last_hb = now
                self._write(p.response(p.HEARTBEAT))
            expired = [k for k, (_m, d, _t) in self.in_flight.items() if d <= now]
            for k in expired:
                # timed out: back to the queue now, as nsqd requeues at msg_timeout (FDQ
                # would also redeliver it once its lease expires); frees the RDY slot
                m = self.in_flight.pop(k)[0]
                self.timeout_count += 1
                if self.channel is not None:
                    self.channel.stats.timeout_count += 1
                    self.channel.settle(None, m, "nak", 0)
            if expired and self.channel is not None:
                self.channel.wake.set()

    # -- commands --------------------------------------------------------------------

    async def _exec(self, cmd: p.Command):
        name = cmd.name
        handler = _HANDLERS.get(name)
        if handler is None:
            raise fatal("E_INVALID", f"invalid command {name.decode('utf-8', 'replace')}")
        lim = self.broker.options.limits
        if lim.tls_required and not self.ident.tls_v1 and name != b"IDENTIFY":
            raise fatal("E_INVALID", f"cannot {name.decode()} in current state (TLS required)")
        r = handler(self, cmd)
        if r is not None:
            await r

    def cmd_nop(self, cmd):
        return None

    async def cmd_identify(self, cmd):
        if self.state != INIT or self.identified:
            raise fatal("E_INVALID", "cannot IDENTIFY in current state")
        ident, resp = p.negotiate(cmd.identify, self.broker.options.limits)
        self.ident = ident
        self.identified = True
        await self._out.join()                # earlier responses first
        self._write(p.response(resp))
        if ident.tls_v1:
            await self.writer.drain()
            self._upgrading = True      # a heartbeat written now would go in clear, into the handshake
            try:
                await self.writer.start_tls(self.broker.ssl_context)
            except (ssl.SSLError, OSError, ConnectionError) as e:
                raise fatal("E_IDENTIFY_FAILED", f"TLS handshake failed: {e}") from None
            finally:
                self._upgrading = False
            self._write(p.response())
        if ident.snappy:
            self._codec = compress.Snappy()
            self._write(p.response())
        elif ident.deflate:
            self._codec = compress.Deflate(ident.deflate_level)
            self._write(p.response())

    async def cmd_auth(self, cmd):
        b = self.broker
        if self.state != INIT:
            raise fatal("E_INVALID", "cannot AUTH in current state")
        if b.auth is None:
            raise fatal("E_AUTH_DISABLED", "AUTH Disabled")
        if self.auth is not None:
            raise fatal("E_INVALID", "AUTH Already set")
        self._secret = cmd.body
        grant = await self._query_auth()
        if not grant.rules:
            raise fatal("E_UNAUTHORIZED", "AUTH No authorizations found")
        self.auth = grant
        body = json.dumps({"identity": grant.identity, "identity_url": grant.identity_url,
                           "permission_count": len(grant.rules)}).encode()
        self._out.put_nowait(p.response(body))

    async def _query_auth(self):
        """The grant of the connection's secret (an auth server is asked: in the executor)."""
        obj = self.writer.get_extra_info("ssl_object") if self.ident.tls_v1 else None
        cert = (obj.getpeercert() or {}) if obj is not None else {}
        cn = next((v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"), "")
        try:
            return await self.broker.run(self.broker.auth.query, self._secret, (self.remote or ("",))[0],
                                         bool(self.ident.tls_v1), cn)
        except AuthFailed:
            raise fatal("E_AUTH_FAILED", "AUTH failed") from None

    async def _check_auth(self, topic: str, channel: str | None, action: str, verb: str):
        """nsqd's CheckAuth: ``verb`` (SUB, PUB, ...) names the command in its errors; a
        grant past its ttl is asked for again."""
        b = self.broker
        if b.auth is None:
            return
        if self.auth is None:
            raise fatal("E_AUTH_FIRST", f"AUTH required before {verb}")
        if self.auth.expired():
            self.auth = await self._query_auth()
        if not self.auth.allows(topic, channel, action):
            raise fatal("E_UNAUTHORIZED", f"AUTH failed for {verb} on {p.go_quote(topic.encode())} "
                                          f"{p.go_quote((channel or '').encode())}")

    async def cmd_sub(self, cmd):
        if self.state != INIT:
            raise fatal("E_INVALID", "cannot SUB in current state")
        if self.ident.heartbeat_interval_ms <= 0:
            raise fatal("E_INVALID", "cannot SUB with heartbeats disabled")
        if len(cmd.params) < 2:
            raise fatal("E_INVALID", "SUB insufficient number of parameters")
        topic, channel = cmd.params[0], cmd.params[1]
        if not p.valid_name(topic):
            raise fatal("E_BAD_TOPIC", f"SUB topic name {p.go_quote(topic)} is not valid")
        if not p.valid_name(channel):
            raise fatal("E_BAD_CHANNEL", f"SUB channel name {p.go_quote(channel)} is not valid")
        topic, channel = topic.decode(), channel.decode()
        await self._check_auth(topic, channel, "subscribe", "SUB")
        try:
            ch = await self.broker.channel_for(topic, channel, self.ident)
        except ProtocolError:
            raise
        except FDQError as e:
            raise fatal("E_SUB_FAILED", f"SUB {topic}/{channel} failed: {e}") from None
        self.channel = ch
        self.state = SUBSCRIBED
        ch.add(self)
        self._out.put_nowait(p.response())

    def cmd_rdy(self, cmd):
        if self.state == CLOSING:
            return
        if self.state != SUBSCRIBED:
            raise fatal("E_INVALID", "cannot RDY in current state")
        count = p.parse_int(cmd.params[0], "RDY could not parse count") if cmd.params else 1
        mx = self.broker.options.limits.max_rdy_count
        if count < 0 or count > mx:
            shown = count if count < p.OVERFLOW else p.shown(cmd.params[0].lstrip(b"0"))
            raise fatal("E_INVALID", f"RDY count {shown} out of range 0-{mx}")
        self.rdy = count
        if self.capacity <= 0:
            self._flush()          # nsqd flushes a client that can take no more
        self.channel.wake.set()

    def _msg_id(self, cmd, verb, nparams):
        if self.state not in (SUBSCRIBED, CLOSING):
            raise fatal("E_INVALID", f"cannot {verb} in current state")
        if len(cmd.params) < nparams:
            raise fatal("E_INVALID", f"{verb} insufficient number of params")
        mid = cmd.params[0]
        if len(mid) != p.MSG_ID_LEN:
            raise fatal("E_INVALID", "Invalid Message ID")
        return mid

    def cmd_fin(self, cmd):
        mid = self._msg_id(cmd, "FIN", 1)
        entry = self.in_flight.pop(mid, None)
        if entry is None:
            raise nonfatal("E_FIN_FAILED", f"FIN {mid.decode('ascii', 'replace')} failed ID not in flight")
        self.finish_count += 1
        self.channel.stats.finish_count += 1
        self.channel.settle(self, entry[0], "ack", None, mid)
        e2e = self.channel.stats.e2e
        if e2e.percentiles:
            e2e.add(time.time_ns() - entry[0].insertion_time * 1_000_000)
        self.channel.wake.set()

    def cmd_req(self, cmd):
        mid = self._msg_id(cmd, "REQ", 2)
        ms = p.parse_int(cmd.params[1], "REQ could not parse timeout")
        mx = self.broker.options.limits.max_req_timeout_ms
        ms = min(max(ms, 0), mx)                 # nsqd clamps
        entry = self.in_flight.pop(mid, None)
        if entry is None:
            raise nonfatal("E_REQ_FAILED", f"REQ {mid.decode('ascii', 'replace')} failed ID not in flight")
        self.requeue_count += 1
        self.channel.stats.requeue_count += 1
        self.channel.settle(self, entry[0], "nak", ms / 1000, mid)
        self.channel.wake.set()

    def cmd_touch(self, cmd):
        mid = self._msg_id(cmd, "TOUCH", 1)
        entry = self.in_flight.get(mid)
        if entry is None:
            raise nonfatal("E_TOUCH_FAILED", f"TOUCH {mid.decode('ascii', 'replace')} failed ID not in flight")
        # as nsqd's Channel.TouchMessage: a message's total time on a client never
        # exceeds --max-msg-timeout; past it the message times out (and is requeued)
        lim = self.broker.options.limits
        entry[1] = min(time.monotonic() + self.ident.msg_timeout_ms / 1000,
                       entry[2] + lim.max_msg_timeout_ms / 1000)
        self.channel.settle(self, entry[0], "touch", None, mid)

    async def cmd_cls(self, cmd):
        if self.state != SUBSCRIBED:
            raise fatal("E_INVALID", "cannot CLS in current state")
        self.state = CLOSING
        self._out.put_nowait(p.response(p.CLOSE_WAIT))

    # -- publishing ------------------------------------------------------------------

    def _publish(self, topic: str, fn, code: str, verb: str, size: int):
        fut = self._run_publish(fn, size)

        async def result():
            try:
                r = await fut
            except (MessageTooLarge, InvalidHeader) as e:
                raise fatal("E_BAD_MESSAGE", f"{verb} failed {e}") from None
            except FDQError as e:
                raise fatal(code, f"{verb} failed {e}") from None
            self.broker.published += r
            self.published[topic] = self.published.get(topic, 0) + r
            return p.response()
        self._out.put_nowait(result())

    def _run_publish(self, fn, size: int):
        """Run a publish in the executor, counted as pending until it is done."""
        self._pending_publishes += 1
        self._pending_bytes += size
        fut = asyncio.get_running_loop().run_in_executor(self.broker.executor, fn)

        def done(_f):
            self._pending_publishes -= 1
            self._pending_bytes -= size
            if not self._publishes_full():
                self._publish_room.set()
        fut.add_done_callback(done)
        return fut

    def _publishes_full(self) -> bool:
        return self._pending_publishes >= MAX_PENDING_PUBLISHES or self._pending_bytes >= MAX_PENDING_PUBLISH_BYTES

    async def cmd_pub(self, cmd):
        topic = cmd.params[0].decode()
        await self._check_auth(topic, None, "publish", "PUB")
        body = cmd.body
        self._publish(topic, lambda: (self.broker.producer.push(topic, body), 1)[1], "E_PUB_FAILED", "PUB",
                      len(body))

    async def cmd_dpub(self, cmd):
        topic = cmd.params[0].decode()
        ms = p.parse_int(cmd.params[1], "DPUB could not parse timeout")    # the parser checked its range
        await self._check_auth(topic, None, "publish", "DPUB")
        body = cmd.body
        self._publish(topic, lambda: (self.broker.producer.push(topic, body, delay=ms / 1000), 1)[1],
                      "E_DPUB_FAILED", "DPUB", len(body))

    async def cmd_mpub(self, cmd):
        topic = cmd.params[0].decode()
        await self._check_auth(topic, None, "publish", "MPUB")
        bodies = cmd.bodies
        self._publish(topic, lambda: len(self.broker.producer.push_many(topic, bodies)), "E_MPUB_FAILED", "MPUB",
                      sum(map(len, bodies)))

    async def cmd_pub_ext(self, cmd):
        topic = cmd.params[0].decode()
        await self._check_auth(topic, None, "publish", "PUB_EXT")
        b = self.broker
        if not await b.is_extend(topic):
            raise nonfatal("E_EXT_NOT_SUPPORT", f"PUB_EXT topic {topic!r} has no extend support")
        headers, body = cmd.ext, cmd.body
        fut = self._run_publish(lambda: b.producer.push(topic, body, headers=headers or None), len(body))

        async def result():
            try:
                r = await fut
            except InvalidHeader as e:
                raise nonfatal("E_INVALID_JSON_HEADER", f"PUB_EXT failed {e}") from None
            except FDQError as e:
                raise fatal("E_PUB_FAILED", f"PUB_EXT failed {e}") from None
            b.published += 1
            self.published[topic] = self.published.get(topic, 0) + 1
            if r.trace_id is not None:
                return p.response(p.trace_response(r.id, r.trace_id, len(body)))
            return p.response()
        self._out.put_nowait(result())


_SYNC_HANDLERS = {b"NOP": Conn.cmd_nop, b"RDY": Conn.cmd_rdy, b"FIN": Conn.cmd_fin, b"REQ": Conn.cmd_req,
                  b"TOUCH": Conn.cmd_touch}
_HANDLERS = {
    b"NOP": Conn.cmd_nop, b"IDENTIFY": Conn.cmd_identify, b"AUTH": Conn.cmd_auth, b"SUB": Conn.cmd_sub,
    b"RDY": Conn.cmd_rdy, b"FIN": Conn.cmd_fin, b"REQ": Conn.cmd_req, b"TOUCH": Conn.cmd_touch,
    b"CLS": Conn.cmd_cls, b"PUB": Conn.cmd_pub, b"DPUB": Conn.cmd_dpub, b"MPUB": Conn.cmd_mpub,
    b"PUB_EXT": Conn.cmd_pub_ext,
}


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
