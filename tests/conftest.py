"""Fixtures shared by every test directory: a fresh embedded database per test."""
from __future__ import annotations

import pytest

import fdq


@pytest.fixture
def db_url(tmp_path):
    """The URL of a fresh embedded database in the test's own directory."""
    return f"sqlite://{tmp_path / 'fdq.db'}"


@pytest.fixture
def db(db_url):
    return fdq.connect(db_url)
