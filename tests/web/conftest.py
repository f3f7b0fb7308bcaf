"""Fixtures of the dashboard's tests: a ``WebApp`` over a fresh database, called the way
a server calls it (``api``), and consumer processes killed by PID at teardown."""
from __future__ import annotations

import pytest

import fdq
from fdq.web import WebApp

from webhelpers import TOKEN, Api, Workers


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


@pytest.fixture
def workers(tmp_path, db_url):
    w = Workers(tmp_path, db_url)
    yield w
    w.cleanup()
