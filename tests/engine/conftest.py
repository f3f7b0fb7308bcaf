"""Fixtures of the engine conformance suite.

Every test that takes ``eng`` runs on the engine of the pass (``tests/fdqtest.py``): the
embedded engine on the ``sqlite://`` pass; on the ``fdb`` pass, FoundationDB's official
binding over the libfdb_c stand-in (a fresh database per test), or a real cluster when
``FDQ_TEST_FDB_CLUSTER_FILE`` names its cluster file (keys under a fresh random prefix,
cleared afterwards). Tests only use the FDB Python API surface, so the same assertions
hold on all three (``FDQ_TEST_FDB=docker``: see ``tests/conftest.py``).
"""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import fdq
from fdqtest import FDB_CLUSTER_FILE, ON_FDB, STANDIN, database_url


class Engine:
    """One engine under test: ``db``, its ``url``, and a key prefix ``p`` owned by the test."""

    def __init__(self, name: str, url: str, prefix: bytes, tmp_path: Path, path=None):
        self.name = name
        self.url = url
        self.p = prefix
        self.tmp_path = tmp_path
        self.path = path
        self.db = fdq.connect(url, check_format=False)

    @property
    def embedded(self) -> bool:
        """The embedded engine's own API (``sqlite://``), not FDB's binding."""
        return self.name == "sqlite"

    @property
    def standin(self) -> bool:
        """FDB's binding over the libfdb_c stand-in (the embedded engine underneath)."""
        return self.name == "fdb" and STANDIN

    @property
    def KeySelector(self):
        """The engine's KeySelector class (FDB's binding accepts only its own)."""
        if self.embedded:
            from fdq.engine import KeySelector
            return KeySelector
        import fdb
        return fdb.KeySelector

    @property
    def Error(self):
        """The exception type engine errors arrive as on this engine."""
        if self.embedded:
            return fdq.EngineError
        import fdb
        return fdb.FDBError

    def k(self, *parts: bytes) -> bytes:
        return self.p + b"".join(parts)

    def end(self) -> bytes:
        """The end of this test's key range."""
        return self.p[:-1] + bytes([self.p[-1] + 1])

    def items(self, db=None) -> list[tuple[bytes, bytes]]:
        """The whole key range of this test, as plain (key, value) tuples."""
        tr = (db or self.db).create_transaction()
        return [(kv.key, kv.value) for kv in tr.get_range(self.p, self.end())]

    def fault_url(self, p: float, seed: int) -> str:
        """The same database with fault injection (the embedded engine's, also under the
        stand-in; not on a real cluster)."""
        if self.path is None:
            pytest.skip("fault injection is a feature of the embedded engine (or the libfdb_c stand-in)")
        return database_url(self.path, fault_injection=p, seed=seed)

    def open(self, url: str | None = None):
        return fdq.connect(url or self.url, check_format=False)


@pytest.fixture
def eng(tmp_path):
    if not ON_FDB:
        path = tmp_path / "engine.db"
        yield Engine("sqlite", database_url(path), b"t/", tmp_path, path)
        return
    if STANDIN:
        path = tmp_path / "engine.db"
        yield Engine("fdb", database_url(path), b"t/", tmp_path, path)
        return
    prefix = b"fdqtest/" + uuid.uuid4().hex.encode() + b"/"
    e = Engine("fdb", f"fdb://{FDB_CLUSTER_FILE}", prefix, tmp_path)
    yield e
    tr = e.db.create_transaction()
    tr.clear_range(e.p, e.end())
    tr.commit().wait()
