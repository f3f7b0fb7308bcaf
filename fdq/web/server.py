"""``fdq web``: the dashboard (``app.WebApp``) on the standard library's threading HTTP
server. No dependency: the page is a few static files and a JSON API it polls, which
``http.server`` serves well for the handful of people looking at one queue; the broker
serves the same app from its own asyncio HTTP server (``HTTPServer.mount``).
"""
from __future__ import annotations

import logging
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from ..broker.server import split_address
from .. import connect
from .app import WebApp

log = logging.getLogger("fdq.web")
MAX_BODY_BYTES = 1 << 20        # an action's JSON (a list of ids) is far smaller
DEFAULT_ADDRESS = "127.0.0.1:4180"

# The page loads nothing from elsewhere and runs no inline script: say so to the browser.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class _Handler(BaseHTTPRequestHandler):
    server_version = "fdq-web"
    protocol_version = "HTTP/1.1"
    app: WebApp = None          # set on the subclass ``WebServer`` makes

    def _answer(self):
        url = urlsplit(self.path)
        length = self.headers.get("Content-Length", "0").strip() or "0"
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            self._send(413 if length.isdigit() else 400, "application/json; charset=utf-8",
                       b'{"error":"bad_request","message":"the request body is too large or its length is bad"}')
            self.close_connection = True
            return
        body = self.rfile.read(int(length)) if int(length) else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            status, ctype, out = self.app.handle(self.command, url.path, parse_qs(url.query, keep_blank_values=True),
                                                 headers, body)
        except Exception:       # noqa: BLE001 - a bug answers 500 and is logged; the server goes on
            log.exception("%s %s failed", self.command, self.path)
            status, ctype, out = 500, "application/json; charset=utf-8", \
                b'{"error":"internal_error","message":"the server failed; see its log"}'
        self._send(status, ctype, out)

    def _send(self, status: int, ctype: str, body: bytes):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in SECURITY_HEADERS.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = _answer

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)


class WebServer:
    """``fdq web``'s server: ``WebServer(app, host, port)``, ``start()`` (a thread;
    returns the port, resolved when 0), ``close()``."""

    def __init__(self, app: WebApp, host: str = "127.0.0.1", port: int = 4180):
        handler = type("Handler", (_Handler,), {"app": app})
        self.app = app
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = None

    def start(self) -> int:
        self.app.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="fdq-web", daemon=True)
        self._thread.start()
        return self.port

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.app.close()


def run(url: str | None, address: str = DEFAULT_ADDRESS, *, write_token: str | None = None,
        sample_interval_s: float = 1.0, history_s: float = 600.0, ready=None):
    """Serve the dashboard until SIGTERM or SIGINT (blocking; ``fdq web`` calls this).
    ``ready(host, port)`` is called once listening. Returns the signal that stopped it."""
    host, port = split_address(address)
    app = WebApp(connect(url), write_token=write_token, sample_interval_s=sample_interval_s,
                 history_s=history_s)
    server = WebServer(app, host, port)
    stop = threading.Event()
    stopped_by = []

    def on_signal(sig, _frame):
        stopped_by.append(sig)
        stop.set()
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        if ready is not None:
            ready(host, server.port)
        while not stop.wait(1.0):
            pass
    finally:
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return stopped_by[0] if stopped_by else None


__all__ = ["WebServer", "run", "DEFAULT_ADDRESS", "SECURITY_HEADERS"]
