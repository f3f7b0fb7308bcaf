"""Helpers of the dashboard's tests (``tests/web`` is on ``sys.path``): the API called as
a server calls it, ``fdq web`` in its own process, HTTP requests."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from fdq.web import WebApp
from fdqtest import readline_within

HERE = Path(__file__).parent
TOKEN = "s3cret-token"


class Api:
    """``api.get(path)`` / ``api.post(path, body, token=...)`` -> (status, JSON) through
    ``WebApp.handle``, as the HTTP servers call it."""

    def __init__(self, app: WebApp):
        self.app = app

    def call(self, method, path, body=None, token=None, headers=None, query=None):
        h = dict(headers or {})
        if token is not None:
            h["authorization"] = f"Bearer {token}"
        raw = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        status, ctype, out = self.app.handle(method, path, query or {}, h, raw)
        assert ctype.startswith("application/json"), (status, ctype)
        return status, json.loads(out)

    def get(self, path, **kw):
        return self.call("GET", path, **kw)

    def post(self, path, body=None, token=TOKEN, **kw):
        return self.call("POST", path, body if body is not None else {}, token=token, **kw)

    def ok(self, path, **kw):
        status, data = self.get(path, **kw)
        assert status == 200, (path, status, data)
        return data


FDQ = Path(sys.executable).parent / "fdq"


def request(url, method="GET", body=None, headers=None):
    """(status, headers, parsed JSON or raw bytes) of one HTTP request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, hdrs, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, e.headers, e.read()
    ctype = hdrs.get("Content-Type", "")
    return status, hdrs, json.loads(raw) if ctype.startswith("application/json") else raw


def env_for(url):
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME", "FDQ_WEB_WRITE_TOKEN")}
    env["FDQ_URL"] = url
    return env


def start_web(url, *args):
    """``fdq web`` on a free port; returns (process, base URL) once it says it serves."""
    assert FDQ.exists(), f"no console script at {FDQ}: pip install -e . first"
    proc = subprocess.Popen([str(FDQ), "web", "--http-address", "127.0.0.1:0", *args], env=env_for(url),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    proc.stdout = proc.stderr          # readline_within reads .stdout
    line = readline_within(proc, 60, "fdq web's ready line")
    m = re.search(r"serving (http://127\.0\.0\.1:\d+/)", line)
    assert m, f"unexpected first line from fdq web: {line!r}"
    return proc, m.group(1)
