"""Fixtures of the dashboard's tests: a ``WebApp`` over a fresh database, called the way
a server calls it (``api``), and consumer processes killed by PID at teardown."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import fdq
from fdq.web import WebApp
from fdqtest import kill_all, wait_for  # noqa: F401 - re-exported to this directory's tests

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


@pytest.fixture
def app(db):
    """A dashboard with the write token ``TOKEN``; its sampler is not started (tests
    sample with ``app.history.sample_all()`` when they mean to)."""
    a = WebApp(db, write_token=TOKEN, sample_interval_s=0.2, history_s=60)
    yield a
    a.close()


@pytest.fixture
def api(app):
    return Api(app)


@pytest.fixture
def sup(db):
    return fdq.Supervisor(db)


class Workers:
    """Consumer processes (``worker.py``), each logging to its own file; all SIGKILLed
    at teardown."""

    def __init__(self, tmp_path, url):
        self.tmp_path, self.url = tmp_path, url
        self.procs = {}

    def start(self, cid, topic="orders", **options):
        log = self.tmp_path / f"{cid}.log"
        args = [sys.executable, str(HERE / "worker.py"), self.url, topic, cid, str(log)]
        for k, v in options.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        self.procs[cid] = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        return self.procs[cid]

    def lines(self, cid):
        path = self.tmp_path / f"{cid}.log"
        return path.read_text().splitlines() if path.exists() else []

    def cleanup(self):
        kill_all(list(self.procs.values()))


@pytest.fixture
def workers(tmp_path, db_url):
    w = Workers(tmp_path, db_url)
    yield w
    w.cleanup()
