"""The dashboard as one object: ``WebApp.handle(method, path, query, headers, body)``
answers a request with ``(status, content_type, body)``; no sockets here.

``fdq web`` serves it with the standard library's threading HTTP server (``server.py``);
the broker mounts the same object under a path of its HTTP port (``HTTPServer.mount``).
``handle`` blocks (it calls ``Supervisor``): an asyncio caller runs it in an executor.

The JSON API (what the page polls; numbers as numbers, units in the names)::

    GET  api/info                                   what this server allows (no secret needed)
    GET  api/topics                                 one row per topic, with rates
    GET  api/topics/T                               settings, counters, subscriptions,
                                                    consumers, shard assignment, events
    GET  api/topics/T/history?since=MS              samples for the charts
    GET  api/topics/T/subscriptions/S/dlq?limit=N   dead letters
    POST api/topics/T/pause | play                  {}
    POST api/topics/T/rebalance                     {"shards": N}  (null: re-divide only)
    POST api/topics/T/subscriptions/S/pause | play  {}
    POST api/topics/T/subscriptions/S/dlq/redrive   {"ids": [...]}
    POST api/topics/T/subscriptions/S/dlq/purge     {"ids": [...]}

Errors are ``{"error": code, "message": text}`` naming the problem (``ERRORS``).
Everything is read and done through ``fdq.Supervisor``, as the CLI does.
"""
from __future__ import annotations

import html
import json
import logging
import re
from importlib import resources
from urllib.parse import unquote

from ..config import check_name
from ..errors import (AccessDenied, ConfigError, FDQError, InvalidName, SubscriptionNotFound, TopicExists,
                      TopicNotFound)
from ..supervisor import Supervisor
from . import rows
from .access import Access
from .history import History

log = logging.getLogger("fdq.web")

JSON = "application/json; charset=utf-8"
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}
MAX_DLQ_LIMIT = 1000

# exception -> (status, error code); the first that matches (subclasses first)
ERRORS = (
    (TopicNotFound, 404, "topic_not_found"),
    (SubscriptionNotFound, 404, "subscription_not_found"),
    (InvalidName, 400, "invalid_name"),
    (TopicExists, 409, "conflict"),
    (ConfigError, 400, "bad_request"),
    (FDQError, 500, "internal_error"),
)


class HTTPError(FDQError):
    """A request the API cannot take (unknown path, wrong method, bad JSON); answered
    by ``handle``, never raised out of it."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


_T = r"api/topics/(?P<topic>[^/]+)"
_S = _T + r"/subscriptions/(?P<sub>[^/]+)"
ROUTES = [(re.compile(pattern + r"\Z"), methods) for pattern, methods in (
    (r"api/info", {"GET": "info"}),
    (r"api/topics", {"GET": "topics"}),
    (_T, {"GET": "topic"}),
    (_T + r"/history", {"GET": "history"}),
    (_T + r"/(?P<action>pause|play)", {"POST": "topic_action"}),
    (_T + r"/rebalance", {"POST": "rebalance"}),
    (_S + r"/(?P<action>pause|play)", {"POST": "subscription_action"}),
    (_S + r"/dlq", {"GET": "dlq"}),
    (_S + r"/dlq/(?P<action>redrive|purge)", {"POST": "dlq_action"}),
)]


class WebApp:
    """The dashboard over one database.

    ``write_token``: actions need it (None: read-only). ``auth``: a broker's
    ``AuthFile`` (``access.py``). ``base``: the path it is served under ("/", or the
    broker's "/web/"). ``sample_interval_s`` / ``history_s``: the charts' samples.
    ``enable_hint``: how to start the server so it takes actions (said when it refuses).
    ``start()`` begins sampling, ``close()`` ends it.

    Example::

        app = WebApp(fdq.connect(url), write_token="s3cret")
        app.start()
        status, ctype, body = app.handle("GET", "/api/topics", {}, {}, b"")
    """

    def __init__(self, db, *, write_token: str | None = None, auth=None, base: str = "/",
                 sample_interval_s: float = 1.0, history_s: float = 600.0,
                 enable_hint: str = "fdq web --write-token TOKEN"):
        if not sample_interval_s > 0:
            raise ConfigError(f"sample interval must be > 0 seconds, not {sample_interval_s!r}")
        if not history_s >= sample_interval_s:
            raise ConfigError(f"history ({history_s!r} s) must be at least one sample interval "
                              f"({sample_interval_s!r} s)")
        self.supervisor = Supervisor(db)
        self.access = Access(write_token, auth, enable_hint=enable_hint)
        self.history = History(self.supervisor, interval_s=sample_interval_s, keep_s=history_s)
        self.base = "/" + base.strip("/") + "/" if base.strip("/") else "/"
        self._static = {p.name: p for p in resources.files(__package__).joinpath("static").iterdir()
                        if p.is_file() and any(p.name.endswith(ext) for ext in STATIC_TYPES)}

    def start(self):
        self.history.start()
        return self

    def close(self):
        self.history.close()

    # -- the one entry point ----------------------------------------------------------

    def handle(self, method: str, path: str, query: dict, headers: dict, body: bytes) -> tuple:
        """Answer one request. ``path`` is relative to ``base`` (with or without its
        leading "/"), still percent-encoded; ``query``: ``{name: [values]}``;
        ``headers``: lower-case names. Returns ``(status, content_type, body bytes)``."""
        path = path.lstrip("/")
        try:
            if not path.startswith("api/"):
                return self._static_file(method, path)
            handler, args = self._route(method, path)
            if handler != self._info:         # what the page needs to ask for a secret
                self.access.check_read(headers)
            return 200, JSON, _dump(handler(query=query, headers=headers, body=body, **args))
        except HTTPError as e:
            return e.status, JSON, _error(e.code, str(e))
        except AccessDenied as e:
            return 401 if e.code == "auth_required" else 403, JSON, _error(e.code, str(e))
        except FDQError as e:
            for cls, status, code in ERRORS:
                if isinstance(e, cls):
                    if status == 500:
                        log.warning("%s %s failed: %s", method, path, e)
                    return status, JSON, _error(code, str(e))
            raise

    def _route(self, method: str, path: str):
        for pattern, methods in ROUTES:
            m = pattern.match(path)
            if m is None:
                continue
            name = methods.get(method)
            if name is None:
                raise HTTPError(405, "method_not_allowed",
                                f"{method} is not allowed on /{path} (use {', '.join(methods)})")
            args = {k: unquote(v) for k, v in m.groupdict().items()}
            for k, what in (("topic", "topic"), ("sub", "subscription")):
                if k in args:
                    check_name(args[k], what)       # InvalidName: 400, naming it
            return getattr(self, "_" + name), args
        raise HTTPError(404, "not_found", f"no such API endpoint: /{path}")

    def _static_file(self, method: str, path: str) -> tuple:
        if method not in ("GET", "HEAD"):
            raise HTTPError(405, "method_not_allowed", f"{method} is not allowed on /{path} (use GET)")
        if path in ("", "index.html"):
            page = self._static["index.html"].read_text(encoding="utf-8")
            return 200, STATIC_TYPES[".html"], page.replace("{{base}}", html.escape(self.base)).encode()
        name = path[len("static/"):] if path.startswith("static/") else None
        if name not in self._static:
            raise HTTPError(404, "not_found", f"no such page: /{path}")
        p = self._static[name]
        return 200, STATIC_TYPES[p.suffix], p.read_bytes()

    # -- reads ---------------------------------------------------------------------------

    def _info(self, **_):
        return {"writable": self.access.writable, "access": self.access.mode, "base": self.base,
                "sample_interval_s": self.history.interval_s, "history_s": self.history.keep_s}

    def _topics(self, **_):
        out = []
        for name, _config in self.supervisor.topics():
            try:
                out.append(rows.topic_summary(self.supervisor.stats(name), self.history.rates(name)))
            except TopicNotFound:       # deleted since it was listed
                continue
        return {"topics": out}

    def _topic(self, topic, **_):
        detail = rows.topic_detail(self.supervisor.stats(topic), self.history.rates(topic))
        detail["events"] = self.history.events(topic)
        return detail

    def _history(self, topic, query, **_):
        self.supervisor.config(topic)          # TopicNotFound
        since = _int_arg(query, "since", None, minimum=0)
        return {"topic": topic, "interval_s": self.history.interval_s,
                "samples": self.history.samples(topic, since)}

    def _dlq(self, topic, sub, query, **_):
        limit = _int_arg(query, "limit", 100, minimum=1, maximum=MAX_DLQ_LIMIT)
        dead = self.supervisor.dlq_list(topic, sub, limit)
        total = self.supervisor.stats(topic)["subscriptions"][sub]["dlq"]
        return {"topic": topic, "subscription": sub, "total": total, "dead_letters": [rows.dlq_row(d) for d in dead]}

    # -- actions -------------------------------------------------------------------------

    def _topic_action(self, topic, action, headers, body, **_):
        self.access.check_write(headers, topic)
        _json_body(body)
        if action == "pause":
            self.supervisor.pause(topic)
            return {"ok": True, "message": f"paused topic {topic!r}: pushes are kept, nothing is delivered"}
        routed = self.supervisor.play(topic)
        return {"ok": True, "routed": routed,
                "message": f"resumed topic {topic!r} ({routed:,} pushed while paused routed)"}

    def _rebalance(self, topic, headers, body, **_):
        self.access.check_write(headers, topic)
        shards = _json_body(body).get("shards")
        if shards is not None and (isinstance(shards, bool) or not isinstance(shards, int)):
            raise ConfigError(f"shards must be a whole number of shards (or null), not {shards!r}")
        self.supervisor.config(topic)          # TopicNotFound before anything changes
        config = self.supervisor.rebalance(topic, shards=shards)
        what = f"to {config.shards} shards" if shards is not None else "among its live consumers"
        return {"ok": True, "shards": config.shards, "message": f"rebalanced topic {topic!r} {what}"}

    def _subscription_action(self, topic, sub, action, headers, body, **_):
        self.access.check_write(headers, topic, sub)
        _json_body(body)
        if action == "pause":
            was = self.supervisor.pause_subscription(topic, sub)
            message = f"subscription {sub!r} of {topic!r} " + ("was paused already" if was else "paused")
        else:
            was = self.supervisor.play_subscription(topic, sub)
            message = f"subscription {sub!r} of {topic!r} " + ("resumed" if was else "was not paused")
        return {"ok": True, "message": message}

    def _dlq_action(self, topic, sub, action, headers, body, **_):
        self.access.check_write(headers, topic, sub)
        ids = _json_body(body).get("ids")
        if not isinstance(ids, list) or not ids:
            raise ConfigError(f"{action} needs \"ids\": a non-empty list of dead letter ids, not {ids!r}")
        if action == "redrive":
            n = self.supervisor.dlq_redrive_ids(topic, sub, ids)
            verb = "redrove"
        else:
            n = self.supervisor.dlq_purge_ids(topic, sub, ids)
            verb = "purged"
        gone = len(set(ids)) - n
        note = f" ({gone} no longer in the dead-letter queue)" if gone else ""
        return {"ok": True, action + ("d" if action == "purge" else "n"): n,
                "message": f"{verb} {n} dead letter{'s' if n != 1 else ''} of {topic!r}/{sub!r}{note}"}


def _dump(data) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def _error(code: str, message: str) -> bytes:
    return _dump({"error": code, "message": message})


def _json_body(body: bytes) -> dict:
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except ValueError as e:
        raise HTTPError(400, "bad_request", f"the request body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "bad_request", f"the request body must be a JSON object, not {type(data).__name__}")
    return data


def _int_arg(query: dict, name: str, default, *, minimum: int, maximum: int | None = None):
    values = query.get(name)
    if not values:
        return default
    try:
        n = int(values[0])
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, not {values[0]!r}") from None
    if n < minimum or (maximum is not None and n > maximum):
        bound = f"from {minimum} to {maximum}" if maximum is not None else f"at least {minimum}"
        raise ConfigError(f"{name} must be {bound}, not {n}")
    return n


__all__ = ["WebApp", "ROUTES", "ERRORS"]
