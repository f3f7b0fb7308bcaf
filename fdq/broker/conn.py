"""One NSQ client connection: nsqd's TCP protocol V2 (IDENTIFY, AUTH, SUB, RDY, FIN, REQ,
TOUCH, PUB, MPUB, DPUB, PUB_EXT), its output buffer and compression, its in-flight
messages and their timeouts."""
from __future__ import annotations

import asyncio
import base64
import fcntl
import json
import logging
import random
import ssl
import struct
import termios
import time
from typing import TYPE_CHECKING

from .. import aio
from ..errors import FDQError, InvalidHeader, MessageTooLarge
from . import compress, protocol as p
from .auth import AuthFailed
from .protocol import ProtocolError, fatal, nonfatal

if TYPE_CHECKING:
    from .server import Broker

log = logging.getLogger("fdq.broker")

INIT, SUBSCRIBED, CLOSING = "init", "subscribed", "closing"
NSQD_STATE = {INIT: 0, SUBSCRIBED: 3, CLOSING: 4}     # nsqd's client states in /stats
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
        self._last_read = self._last_hb       # when the reading loop last began to wait for the client
        self._in_read = False                 # the reading loop awaits the client
        self._missed_heartbeats = False       # ... and waited past two heartbeat intervals: ended
        self._reader_task = None
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
        take no more (RDY reached), or when the timeout fires, whichever comes first.
        As nsqd, ``output_buffer_timeout`` -1 (0 here) only turns the timer off: the
        buffer still fills; unbuffered is ``output_buffer_size`` -1 (a 1-byte buffer)."""
        self._obuf.append(data)
        self._olen += len(data)
        ident = self.ident
        if self._olen >= ident.output_buffer_size or self.capacity <= 0:
            self._flush()
        elif self._flush_timer is None and ident.output_buffer_timeout_ms > 0:
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
        self._reader_task = asyncio.current_task()
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeats())
        try:
            while not self.closed:
                # (no asyncio.wait_for per read: a task and a timer per read cost the
                # loop ~10% of its time under one-at-a-time PUBs; ``_heartbeats`` ends
                # a read that waits past two heartbeat intervals)
                self._last_read = time.monotonic()
                self._in_read = True
                try:
                    data = await self.reader.read(65536)
                except asyncio.CancelledError:
                    if not self._missed_heartbeats:
                        raise
                    uncancel = getattr(self._reader_task, "uncancel", None)     # (3.11+)
                    if uncancel is not None:
                        uncancel()
                    log.info("client %s missed two heartbeats: closing", self.remote)
                    break
                except (ConnectionError, ssl.SSLError, OSError):
                    break
                finally:
                    self._in_read = False
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
            if hb > 0 and self._in_read and now - self._last_read > 2 * hb:
                # nothing from the client for two heartbeat intervals (nsqd's read deadline)
                self._missed_heartbeats = True
                self._reader_task.cancel()
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

    def _publish(self, topic: str, fut, code: str, verb: str, size: int, count: int = 1):
        """Answer publish ``fut`` (its ``count`` messages, ``size`` bytes) in command
        order, OK once it is committed; its failure is fatal."""
        self._track_publish(fut, size)

        async def result():
            try:
                await fut
            except (MessageTooLarge, InvalidHeader) as e:
                raise fatal("E_BAD_MESSAGE", f"{verb} failed {e}") from None
            except FDQError as e:
                raise fatal(code, f"{verb} failed {e}") from None
            self.broker.published += count
            self.published[topic] = self.published.get(topic, 0) + count
            return p.response()
        self._out.put_nowait(result())

    def _push(self, topic: str, body: bytes, **kwargs):
        """A push queued with every other connection's (``fdq.aio.push``: the producer's
        group commit, one commit for all that is queued, resolved on this loop): a task,
        so this connection reads on while it commits."""
        return asyncio.get_running_loop().create_task(aio.push(self.broker.producer, topic, body, **kwargs))

    def _track_publish(self, fut, size: int):
        """Count publish ``fut`` as pending until it is done."""
        self._pending_publishes += 1
        self._pending_bytes += size

        def done(_f):
            self._pending_publishes -= 1
            self._pending_bytes -= size
            if not self._publishes_full():
                self._publish_room.set()
        fut.add_done_callback(done)

    def _publishes_full(self) -> bool:
        return self._pending_publishes >= MAX_PENDING_PUBLISHES or self._pending_bytes >= MAX_PENDING_PUBLISH_BYTES

    async def cmd_pub(self, cmd):
        topic = cmd.params[0].decode()
        await self._check_auth(topic, None, "publish", "PUB")
        body = cmd.body
        self._publish(topic, self._push(topic, body), "E_PUB_FAILED", "PUB", len(body))

    async def cmd_dpub(self, cmd):
        topic = cmd.params[0].decode()
        ms = p.parse_int(cmd.params[1], "DPUB could not parse timeout")    # the parser checked its range
        await self._check_auth(topic, None, "publish", "DPUB")
        body = cmd.body
        self._publish(topic, self._push(topic, body, delay=ms / 1000), "E_DPUB_FAILED", "DPUB", len(body))

    async def cmd_mpub(self, cmd):
        topic = cmd.params[0].decode()
        await self._check_auth(topic, None, "publish", "MPUB")
        bodies = cmd.bodies
        # one transaction, all or none (push_many), in the executor
        b = self.broker
        fut = asyncio.get_running_loop().run_in_executor(b.executor, b.producer.push_many, topic, bodies)
        self._publish(topic, fut, "E_MPUB_FAILED", "MPUB", sum(map(len, bodies)), len(bodies))

    async def cmd_pub_ext(self, cmd):
        topic = cmd.params[0].decode()
        await self._check_auth(topic, None, "publish", "PUB_EXT")
        b = self.broker
        if not await b.is_extend(topic):
            raise nonfatal("E_EXT_NOT_SUPPORT", f"PUB_EXT topic {topic!r} has no extend support")
        headers, body = cmd.ext, cmd.body
        fut = self._push(topic, body, headers=headers or None)
        self._track_publish(fut, len(body))

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
