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


def pytest_terminal_summary(terminalreporter):
    """One line for the FoundationDB copies of the engine tests (skipped without a
    cluster), every other skip with its reason."""
    skipped = terminalreporter.stats.get("skipped", [])
    fdb, other = [], []
    for r in skipped:
        reason = r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
        (fdb if "FDQ_TEST_FDB_CLUSTER_FILE" in reason else other).append((r.nodeid, reason))
    if fdb:
        terminalreporter.write_line(f"{len(fdb)} FoundationDB cases skipped: {fdb[0][1]}")
    for nodeid, reason in other:
        terminalreporter.write_line(f"SKIPPED {nodeid}: {reason}")


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (``-n 2 --dist loadgroup``), every Spark test runs on one
    worker: their session-scoped Spark session (a JVM) then starts once."""
    for item in items:
        if "/tests/spark/" in str(item.path):
            item.add_marker(pytest.mark.xdist_group("spark"))
