"""Fixtures for the queue tests: a database per test and worker processes that are
always reaped (killed by PID at teardown)."""
from __future__ import annotations

import pytest

import fdq

from fdqtest import database_url
from qhelpers import Procs


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "fdq.db"


@pytest.fixture
def url(db_path):
    return database_url(db_path)


@pytest.fixture
def db(url):
    return fdq.connect(url)


@pytest.fixture
def procs(tmp_path, url):
    ps = Procs(tmp_path, url)
    yield ps
    ps.cleanup()
