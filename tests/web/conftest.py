"""Fixtures of the dashboard's tests: a ``WebApp`` over the test's database, called the
way a server calls it (``api``)."""
from __future__ import annotations

import pytest

from fdq.web import WebApp

from webhelpers import TOKEN, Api


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
