"""nsqd's HTTP API over asyncio (HTTP/1.1, keep-alive), plus ``/metrics``.

``/metrics`` is Prometheus's (text, or OpenMetrics when the scraper asks for it) from
prometheus_client (the ``metrics`` extra; 501 without it): ``fdq.metrics``'s collector
of the database (by default only the broker holding the metrics leadership exports the
database-wide families: ``--metrics-database``), this process's figures (CPU, memory,
file descriptors, Python's garbage collector) and the broker's own (connections,
messages published, clients per channel).

Errors are ``{"message": "..."}`` with nsqd's messages and status codes
(``MISSING_ARG_TOPIC`` 400, ``TOPIC_NOT_FOUND`` 404, ``MSG_TOO_BIG`` 413, ...).
With ``--auth-file`` every endpoint but ``/ping`` needs the secret in the
``X-NSQ-Auth-Secret`` header (``AUTH_REQUIRED`` 401 / ``AUTH_FAILED`` 403 otherwise).
"""
from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import resource
import socket
import struct
from urllib.parse import parse_qs, urlsplit

from ..errors import FDQError, InvalidHeader, InvalidName, MessageTooLarge, TopicNotFound
from ..headers import validate_headers
from . import protocol as p, quantile

try:
    from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import choose_encoder
    from .. import metrics as fdq_metrics
except ImportError:     # without the metrics extra: /metrics answers 501, naming it
    fdq_metrics = None

log = logging.getLogger("fdq.broker.http")
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 413: "Request Entity Too Large", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 501: "Not Implemented"}
MAX_HEADER_BYTES = 64 * 1024
_MAX_LENGTH = (1 << 63) - 1     # Go's server parses Content-Length as a 63-bit number


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        self.status = status
        self.message = message
        super().__init__(message)


class Head:
    """A request's line and headers (``parse_head``): ``length`` of its body, or
    ``chunked``."""

    __slots__ = ("method", "target", "version", "path", "query", "headers", "length", "chunked")

    def __init__(self, method, target, version, path, query, headers, length, chunked):
        self.method = method
        self.target = target
        self.version = version
        self.path = path
        self.query = query
        self.headers = headers
        self.length = length
        self.chunked = chunked


def parse_head(raw: bytes, limit: int) -> Head:
    """The line and headers of one request (``raw``: up to and with the blank line), read
    as Go's server (nsqd's) reads them: ``HTTPError`` 431 past ``MAX_HEADER_BYTES``;
    400 ``INVALID_REQUEST`` for a Content-Length that is not a 63-bit number (Go's "bad
    Content-Length") or a target that is not a URL; 413 for a body over ``limit``
    (``MSG_TOO_BIG`` on /pub and /pub_ext, whose body is one message; else
    ``BODY_TOO_BIG``)."""
    if len(raw) > MAX_HEADER_BYTES:
        raise HTTPError(431, "HEADER_TOO_BIG")
    lines = raw.decode("latin-1").split("\r\n")
    method, target, version = (lines[0].split(" ") + ["", "", ""])[:3]
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    try:
        url = urlsplit(target)
    except ValueError:
        raise HTTPError(400, "INVALID_REQUEST") from None
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    length = 0
    if not chunked:
        text = headers.get("content-length", "0").strip() or "0"
        digits = text.lstrip("0")
        if not (text.isascii() and text.isdigit()) or len(digits) > 19 or int(digits or "0") > _MAX_LENGTH:
            raise HTTPError(400, "INVALID_REQUEST")
        length = int(digits or "0")
    if length > limit:
        raise HTTPError(413, "MSG_TOO_BIG" if url.path in ("/pub", "/pub_ext") else "BODY_TOO_BIG")
    return Head(method.upper(), target, version, url.path, parse_qs(url.query, keep_blank_values=True), headers,
                length, chunked)


class Request:
    def __init__(self, method, path, query, headers, body, version="HTTP/1.1"):
        self.method = method
        self.version = version
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body

    def arg(self, name, default=None):
        v = self.query.get(name)
        return v[0] if v else default


def _memory() -> dict:
    """nsqd's ``memory`` stats (Go runtime fields), from what CPython has: the process's
    resident set for the heap sizes, the garbage collector's counts for the GC fields."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        pass
    counts = gc.get_count()
    return {"heap_objects": sum(counts), "heap_idle_bytes": 0, "heap_in_use_bytes": rss,
            "heap_released_bytes": 0, "gc_pause_usec_100": 0, "gc_pause_usec_99": 0, "gc_pause_usec_95": 0,
            "next_gc_bytes": 0, "gc_total_runs": sum(g["collections"] for g in gc.get_stats())}


class HTTPServer:
    def __init__(self, broker):
        self.broker = broker
        self.server = None
        self.port = None
        self._routes = {
            "/ping": self.ping, "/info": self.info, "/stats": self.stats, "/metrics": self.metrics,
            "/pub": self.pub, "/mpub": self.mpub, "/pub_ext": self.pub_ext,
            "/topic/create": self.topic_create, "/topic/delete": self.topic_delete,
            "/topic/empty": self.topic_empty, "/topic/pause": self.topic_pause,
            "/topic/unpause": self.topic_unpause,
            "/channel/create": self.channel_create, "/channel/delete": self.channel_delete,
            "/channel/empty": self.channel_empty, "/channel/pause": self.channel_pause,
            "/channel/unpause": self.channel_unpause,
        }
        self._mounts = {}       # path prefix -> app (mount)
        self._registry = None   # /metrics' (made at start: the broker takes part in the leadership)
        self._collector = None

    async def start(self, host="127.0.0.1", port=4151) -> int:
        self.server = await asyncio.start_server(self._serve, host, port)
        self.port = self.server.sockets[0].getsockname()[1]
        self._metrics_registry()
        return self.port

    async def close(self):
        if self.server is not None:
            self.server.close()
        if self._collector is not None:
            await self.run(self._collector.close)       # gives the metrics leadership up

    def mount(self, prefix: str, app):
        """Serve ``app`` under ``prefix`` (e.g. the web dashboard at ``/web/``): a request
        for the prefix or below goes to ``app.handle(method, path, query, headers, body)``,
        ``path`` relative to the prefix, run in the broker's executor (it may block), and
        its ``(status, content_type, body)`` is the answer. The app applies the broker's
        AUTH itself (``fdq.web.access``): give it ``broker.auth``."""
        self._mounts["/" + prefix.strip("/")] = app

    # -- HTTP/1.1 framing --------------------------------------------------------------

    async def _serve(self, reader, writer):
        try:
            while True:
                req = await self._read_request(reader, writer)
                if req is None:
                    break
                status, ctype, body = await self._dispatch(req)
                # HTTP/1.0 closes unless asked to keep alive (monitoring probes such as
                # check_http read a 1.0 answer until the connection closes)
                conn = req.headers.get("connection", "").lower()
                keep = conn == "keep-alive" if req.version.upper() == "HTTP/1.0" else conn != "close"
                head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nContent-Type: {ctype}\r\n"
                        f"Content-Length: {len(body)}\r\nX-Nsq-Content-Type: nsq; version=1.0\r\n"
                        f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n")
                writer.write(head.encode() + body)
                await writer.drain()
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    async def _read_request(self, reader, writer):
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        except asyncio.LimitOverrunError:       # no end of the headers within the reader's limit
            await self._refuse(writer, 431, "HEADER_TOO_BIG")
            return None
        limit = self.broker.options.limits.max_body_size
        try:
            head = parse_head(raw, limit)
        except HTTPError as e:
            await self._refuse(writer, e.status, e.message)
            return None
        n, headers = head.length, head.headers
        if (n or head.chunked) and headers.get("expect", "").lower() == "100-continue":
            # as Go's server: without it curl waits a second before sending a body > 1 MiB
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        if head.chunked:
            body = await self._read_chunked(reader, writer, limit)
            if body is None:
                return None
        else:
            body = await reader.readexactly(n) if n else b""
        return Request(head.method, head.path, head.query, headers, body, head.version)

    @staticmethod
    async def _refuse(writer, status: int, message: str):
        """Answer a request whose body cannot be read, and close the connection."""
        body = json.dumps({"message": message}).encode()
        writer.write(f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
                     f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()

    async def _read_chunked(self, reader, writer, limit: int):
        """A ``Transfer-Encoding: chunked`` body (what clients send when they do not know
        its length), at most ``limit`` bytes; None (answered and to be closed) if bad."""
        parts, total = [], 0
        while True:
            line = await reader.readuntil(b"\r\n")
            size = line.split(b";", 1)[0].strip()
            try:
                n = int(size, 16)
            except ValueError:
                n = -1
            if n < 0 or not size.isalnum():
                await self._refuse(writer, 400, "INVALID_REQUEST")
                return None
            total += n
            if total > limit:
                await self._refuse(writer, 413, "BODY_TOO_BIG")
                return None
            if n == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":     # trailers
                    pass
                return b"".join(parts)
            parts.append(await reader.readexactly(n))
            if await reader.readexactly(2) != b"\r\n":
                await self._refuse(writer, 400, "INVALID_REQUEST")
                return None

    async def _dispatch(self, req: Request):
        for prefix, app in self._mounts.items():
            if req.path == prefix or req.path.startswith(prefix + "/"):
                return await self.run(app.handle, req.method, req.path[len(prefix):], req.query, req.headers,
                                      req.body)
        handler = self._routes.get(req.path)
        try:
            if handler is None:
                raise HTTPError(404, "NOT_FOUND")
            if req.path != "/ping":
                self._check_auth(req)
            out = await handler(req)
        except HTTPError as e:
            return e.status, "application/json; charset=utf-8", json.dumps({"message": e.message}).encode()
        except InvalidName as e:
            return 400, "application/json; charset=utf-8", json.dumps({"message": "INVALID_TOPIC",
                                                                       "detail": str(e)}).encode()
        except TopicNotFound:
            return 404, "application/json; charset=utf-8", b'{"message":"TOPIC_NOT_FOUND"}'
        except FDQError as e:
            log.warning("%s failed: %s", req.path, e)
            return 500, "application/json; charset=utf-8", json.dumps({"message": "INTERNAL_ERROR",
                                                                       "detail": str(e)}).encode()
        except Exception as e:      # a bug, or input no check foresaw: one line, not a traceback
            self.broker.log_limiter.warning(f"http:{req.path}:{type(e).__name__}", "HTTP %s failed: %s: %s",
                                            p.clip(req.path), type(e).__name__, p.clip(str(e)))
            log.debug("HTTP %s failed", req.path, exc_info=e)
            return 500, "application/json; charset=utf-8", json.dumps({"message": "INTERNAL_ERROR"}).encode()
        if isinstance(out, tuple):
            return out
        if isinstance(out, (dict, list)):
            return 200, "application/json; charset=utf-8", json.dumps(out).encode()
        return 200, "text/plain; charset=utf-8", out if isinstance(out, bytes) else str(out).encode()

    def _check_auth(self, req: Request):
        auth = self.broker.auth
        if auth is None:
            return
        secret = req.headers.get("x-nsq-auth-secret")
        if not secret:
            raise HTTPError(401, "AUTH_REQUIRED")
        grant = auth.lookup(secret.encode())
        if grant is None:
            raise HTTPError(403, "AUTH_FAILED")
        topic, channel = req.arg("topic"), req.arg("channel")
        action = "publish" if req.path in ("/pub", "/mpub", "/pub_ext") else \
            "admin" if req.path.startswith(("/topic/", "/channel/")) else None
        if action and topic is not None and not grant.allows(topic, channel, action):
            raise HTTPError(403, "AUTH_UNAUTHORIZED")

    # -- helpers -----------------------------------------------------------------------

    async def run(self, fn, *args, **kwargs):
        return await self.broker.run(functools.partial(fn, *args, **kwargs))

    @staticmethod
    def _post(req):
        if req.method != "POST":
            raise HTTPError(405, "METHOD_NOT_ALLOWED")

    @staticmethod
    def _topic(req, invalid=(400, "INVALID_TOPIC")) -> str:
        """The ``topic`` argument; a name that is not valid is ``invalid`` (status, code)."""
        topic = req.arg("topic")
        if topic is None:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        if not p.valid_name(topic.encode()):
            raise HTTPError(*invalid)
        return topic

    @staticmethod
    def _topic_channel(req) -> tuple:
        """The topic and channel of a /channel/ endpoint, checked as nsqd's
        ``GetTopicChannelArgs`` (its codes: INVALID_ARG_TOPIC, INVALID_ARG_CHANNEL)."""
        topic = req.arg("topic")
        if topic is None:
            raise HTTPError(400, "MISSING_ARG_TOPIC")
        if not p.valid_name(topic.encode()):
            raise HTTPError(400, "INVALID_ARG_TOPIC")
        ch = req.arg("channel")
        if ch is None:
            raise HTTPError(400, "MISSING_ARG_CHANNEL")
        if not p.valid_name(ch.encode()):
            raise HTTPError(400, "INVALID_ARG_CHANNEL")
        return topic, ch

    @classmethod
    def _any_topic(cls, req) -> str:
        """The topic of /topic/delete, /topic/pause, /topic/unpause: nsqd checks only that
        it is given (a name that cannot exist is TOPIC_NOT_FOUND)."""
        return cls._topic(req, invalid=(404, "TOPIC_NOT_FOUND"))

    async def _existing(self, topic):
        try:
            return await self.run(self.broker.supervisor.config, topic)
        except TopicNotFound:
            raise HTTPError(404, "TOPIC_NOT_FOUND") from None

    # -- endpoints ---------------------------------------------------------------------

    async def ping(self, req):
        return b"OK"

    async def info(self, req):
        b = self.broker
        return {"version": b.options.limits.version, "broadcast_address": b.options.broadcast_address,
                "hostname": socket.gethostname(), "http_port": self.port, "tcp_port": b.tcp_port,
                "start_time": b.start_time}

    def _check_size(self, body: bytes):
        if not body:
            raise HTTPError(400, "MSG_EMPTY")
        if len(body) > self.broker.options.limits.max_msg_size:
            raise HTTPError(413, "MSG_TOO_BIG")

    async def _push(self, fn, *args, **kwargs):
        try:
            return await self.run(fn, *args, **kwargs)
        except MessageTooLarge:
            raise HTTPError(413, "MSG_TOO_BIG") from None
        except InvalidHeader as e:
            raise HTTPError(400, f"INVALID_HEADER: {e}") from None

    async def pub(self, req):
        self._post(req)
        self._check_size(req.body)          # before the topic, as nsqd
        topic = self._topic(req)
        delay = None
        if req.arg("defer") is not None:
            try:
                ms = int(req.arg("defer"))
            except ValueError:
                raise HTTPError(400, "INVALID_DEFER") from None
            if ms < 0 or ms > self.broker.options.limits.max_req_timeout_ms:
                raise HTTPError(400, "INVALID_DEFER")
            delay = ms / 1000
        await self._push(self.broker.producer.push, topic, req.body, delay=delay)
        self.broker.published += 1
        return b"OK"

    async def mpub(self, req):
        self._post(req)
        topic = self._topic(req)
        lim = self.broker.options.limits
        # as nsqd: binary unless absent, "false" or "0"; a bad binary body is 413 with
        # the TCP MPUB's code less "E_" (BAD_BODY, BAD_MESSAGE)
        if req.arg("binary") not in (None, "false", "0"):
            body = req.body
            if len(body) < 4:
                raise HTTPError(413, "BAD_BODY")
            n = struct.unpack_from(">i", body)[0]
            if n <= 0:
                raise HTTPError(413, "BAD_BODY")
            pos, msgs = 4, []
            for _ in range(n):
                if pos + 4 > len(body):
                    raise HTTPError(413, "BAD_MESSAGE")
                size = struct.unpack_from(">i", body, pos)[0]
                pos += 4
                if size <= 0 or size > lim.max_msg_size or pos + size > len(body):
                    raise HTTPError(413, "BAD_MESSAGE")
                msgs.append(body[pos:pos + size])
                pos += size
        else:
            msgs = [m for m in req.body.split(b"\n") if m]
            for m in msgs:
                if len(m) > lim.max_msg_size:
                    raise HTTPError(413, "MSG_TOO_BIG")
        if not msgs:            # nsqd: empty lines are skipped, and none at all is OK
            await self.run(self.broker.ensure_topic, topic)
            return b"OK"
        await self._push(self.broker.producer.push_many, topic, msgs)
        self.broker.published += len(msgs)
        return b"OK"

    async def pub_ext(self, req):
        """youzan's /pub_ext: the JSON header in ``ext`` (query) and/or ``X-Nsqext-<name>``
        request headers."""
        self._post(req)
        topic = self._topic(req)
        self._check_size(req.body)
        config = await self._existing(topic)
        if not config.extend:
            raise HTTPError(400, "E_EXT_NOT_SUPPORT")
        headers = {}
        if req.arg("ext"):
            try:
                headers = p.loads_json(req.arg("ext"))
            except ValueError:
                raise HTTPError(400, "E_INVALID_JSON_HEADER") from None
            if not isinstance(headers, dict):
                raise HTTPError(400, "E_INVALID_JSON_HEADER")
        for k, v in req.headers.items():
            if k.startswith("x-nsqext-"):
                headers[k[len("x-nsqext-"):]] = v
        try:
            headers = validate_headers(headers) if headers else None
        except InvalidHeader as e:
            raise HTTPError(400, f"E_INVALID_JSON_HEADER: {e}") from None
        r = await self._push(self.broker.producer.push, topic, req.body, headers=headers)
        self.broker.published += 1
        if r.trace_id is not None:
            return {"status": "OK", "id": r.id, "trace_id": r.trace_id, "queue_offset": r.position}
        return b"OK"

    async def topic_create(self, req):
        self._post(req)
        topic = self._topic(req)
        extend = req.arg("extend") in ("true", "1")
        b = self.broker
        try:
            config = await self.run(b.ensure_topic, topic)
        except FDQError as e:
            raise HTTPError(400, f"INVALID_TOPIC: {e}") from None
        if extend and not config.extend:
            await self.run(b.supervisor.upgrade_extend, topic)
        return b""

    async def topic_delete(self, req):
        self._post(req)
        topic = self._any_topic(req)
        await self._existing(topic)
        # its channels' clients here would otherwise stay connected to consumers of a
        # deleted topic, and a new SUB to the same channel would join their dead channel
        await self.broker.drop_channel_conns(topic)
        await self.run(self.broker.supervisor.delete_topic, topic)
        return b""

    async def topic_empty(self, req):
        """FDQ topics keep no buffer of their own: emptying a topic empties each of its channels."""
        self._post(req)
        topic = self._topic(req)
        config = await self._existing(topic)
        for sub in config.subs:
            await self.run(self.broker.supervisor.reset, topic, sub)
        return b""

    async def topic_pause(self, req):
        self._post(req)
        topic = self._any_topic(req)
        await self._existing(topic)
        await self.run(self.broker.supervisor.pause, topic)
        return b""

    async def topic_unpause(self, req):
        self._post(req)
        topic = self._any_topic(req)
        await self._existing(topic)
        await self.run(self.broker.supervisor.play, topic)
        return b""

    async def _channel_exists(self, req):
        topic, channel = self._topic_channel(req)
        config = await self._existing(topic)
        if channel not in config.subs:
            raise HTTPError(404, "CHANNEL_NOT_FOUND")
        return topic, channel

    async def channel_create(self, req):
        self._post(req)
        topic, channel = self._topic_channel(req)
        await self.run(self.broker.ensure_channel, topic, channel)
        return b""

    async def channel_delete(self, req):
        self._post(req)
        topic, channel = await self._channel_exists(req)
        await self.broker.drop_channel_conns(topic, channel)
        await self.run(self.broker.supervisor.delete_subscription, topic, channel)
        return b""

    async def channel_empty(self, req):
        self._post(req)
        topic, channel = await self._channel_exists(req)
        await self.run(self.broker.supervisor.reset, topic, channel)
        return b""

    async def channel_pause(self, req):
        self._post(req)
        topic, channel = await self._channel_exists(req)
        # In the database (every broker's consumers stop), and at once on this broker.
        await self.run(self.broker.supervisor.pause_subscription, topic, channel)
        self.broker.set_channel_paused(topic, channel, True)
        return b""

    async def channel_unpause(self, req):
        self._post(req)
        topic, channel = await self._channel_exists(req)
        await self.run(self.broker.supervisor.play_subscription, topic, channel)
        self.broker.set_channel_paused(topic, channel, False)
        return b""

    # -- stats -------------------------------------------------------------------------

    async def _collect(self, topic_filter=None, channel_filter=None) -> list:
        b = self.broker
        names = [n for n, _c in await self.run(b.supervisor.topics)]
        out = []
        for name in names:
            if topic_filter and name != topic_filter:
                continue
            try:
                st = await self.run(b.supervisor.stats, name)
            except FDQError:
                continue
            cfg = st["config"]
            paused_channels = b.paused_channels(name)
            channels = []
            topic_e2e = []
            pct = b.options.e2e_percentiles
            for sub, s in st["subscriptions"].items():
                if channel_filter and sub != channel_filter:
                    continue
                local = [ch for (t, c, _tag), ch in b.channels.items() if t == name and c == sub]
                clients = []
                for ch in local:
                    for conn in ch.conns:
                        clients.append(conn.stats())
                cst = b.channel_stats.get((name, sub))
                e2e = [cst.e2e.samples()] if cst is not None else []
                topic_e2e += e2e
                channels.append({
                    "channel_name": sub, "depth": s["backlog"], "backend_depth": 0,
                    "in_flight_count": s["in_flight"], "deferred_count": s["delayed"],
                    "message_count": s["emitted"], "requeue_count": cst.requeue_count if cst else 0,
                    "timeout_count": cst.timeout_count if cst else 0,
                    "client_count": len(clients), "clients": clients,
                    "paused": sub in paused_channels or s.get("paused", False),
                    "acked_count": s["acked"], "dlq_count": s["dlq"], "consumer_count": len(s["consumers"]),
                    "e2e_processing_latency": quantile.result(pct, e2e),
                })
            depth = st["counters"]["pending"]
            out.append({"topic_name": name, "channels": channels, "depth": depth, "backend_depth": 0,
                        "message_count": st["counters"]["inserted"],
                        "message_bytes": st["counters"]["inserted_bytes"],
                        "paused": bool(cfg.get("paused")), "extend": bool(cfg.get("extend")),
                        "e2e_processing_latency": quantile.result(pct, topic_e2e)})
        return out

    async def stats(self, req):
        # as nsqd: the channel filter applies within the topic filter only
        topics = await self._collect(req.arg("topic"), req.arg("channel") if req.arg("topic") else None)
        b = self.broker
        if req.arg("include_clients") == "false":          # nsqd's include_clients / include_mem
            for t in topics:
                for c in t["channels"]:
                    c["clients"] = []
        data = {"version": b.options.limits.version, "health": "OK", "start_time": b.start_time,
                "topics": topics, "memory": _memory() if req.arg("include_mem") != "false" else None,
                "producers": [c.stats() for c in b.conns if c.published]
                if req.arg("include_clients") != "false" else []}
        if data["memory"] is None:
            del data["memory"]                                # nsqd: "memory,omitempty"
        if req.arg("format") == "json":
            return data
        lines = [f"nsqd v{b.options.limits.version} (fdq broker)", f"start_time {b.start_time}", "",
                 "Health: OK", "", f"Topics ({len(topics)}):"]
        for t in topics:
            lines.append(f"   [{t['topic_name']:<15}] depth: {t['depth']:<5} msgs: {t['message_count']:<8}"
                         f"{' (paused)' if t['paused'] else ''}")
            for c in t["channels"]:
                lines.append(f"      [{c['channel_name']:<25}] depth: {c['depth']:<5} inflt: "
                             f"{c['in_flight_count']:<4} def: {c['deferred_count']:<4} msgs: {c['message_count']:<8}"
                             f" re-q: {c['requeue_count']:<4} timeout: {c['timeout_count']:<4}"
                             f"{' (paused)' if c['paused'] else ''}")
                for cl in c["clients"]:
                    lines.append(f"        [V2 {cl['client_id']:<20}] state: {cl['state']} "
                                 f"inflt: {cl['in_flight_count']:<4} "
                                 f"rdy: {cl['ready_count']:<4} fin: {cl['finish_count']:<8}")
        return ("\n".join(lines) + "\n").encode()

    async def metrics(self, req):
        """Prometheus's exposition (text 0.0.4, or OpenMetrics if the Accept header asks
        for it), read in the executor (the database collector may read the database)."""
        registry = self._metrics_registry()
        if registry is None:
            return (501, "text/plain; charset=utf-8",
                    b"/metrics needs the prometheus_client package: pip install 'fdq-queue[metrics]'\n")
        encoder, content_type = choose_encoder(req.headers.get("accept", ""))
        return 200, content_type, await self.run(encoder, registry)

    def _metrics_registry(self):
        """/metrics' registry (None without prometheus_client), made once."""
        if self._registry is None and fdq_metrics is not None:
            b = self.broker
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
            registry.register(BrokerCollector(b))
            mode = {"leader": "leader", "always": True, "never": False}[b.options.metrics_database]
            self._collector = fdq_metrics.register(b.db, registry, database_metrics=mode,
                                                   leader_timeout_s=b.options.metrics_leader_timeout_s)
            self._registry = registry
        return self._registry


class BrokerCollector:
    """This broker's own figures: open connections, messages published through it,
    client connections per channel. (Read from the scrape's thread: each read is one
    atomic copy of the loop's containers.)"""

    def __init__(self, broker):
        self.broker = broker

    def collect(self):
        b = self.broker
        yield GaugeMetricFamily("fdq_broker_connections", "Open client connections (TCP) on this broker",
                                value=len(b.conns))
        yield CounterMetricFamily("fdq_broker_published_messages", "Messages published through this broker",
                                  value=b.published)
        clients = GaugeMetricFamily("fdq_broker_channel_clients",
                                    "Client connections subscribed to the channel on this broker",
                                    labels=["topic", "channel"])
        counts = {}
        for (topic, channel, _tag), ch in list(b.channels.items()):
            counts[(topic, channel)] = counts.get((topic, channel), 0) + len(ch.conns)
        for (topic, channel), n in sorted(counts.items()):
            clients.add_metric([topic, channel], n)
        yield clients


__all__ = ["HTTPServer"]
