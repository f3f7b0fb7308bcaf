"""Fixtures of the engine conformance suite.

Every test that takes ``eng`` runs on the embedded engine (a fresh database in
``tmp_path``) and, when ``FDQ_TEST_FDB_CLUSTER_FILE`` names a cluster file, unchanged on
FoundationDB (keys under a fresh random prefix, cleared afterwards). Tests only use the
FDB Python API surface, so the same assertions hold on both.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

import fdq

FDB_ENV = "FDQ_TEST_FDB_CLUSTER_FILE"
HOW_TO_ENABLE_FDB = (f"set {FDB_ENV}=/path/to/fdb.cluster (e.g. the cluster of docker/"
                     "docker-compose.yml) to run this case on FoundationDB")


class Engine:
    """One engine under test: ``db``, its ``url``, and a key prefix ``p`` owned by the test."""

    def __init__(self, name: str, url: str, prefix: bytes, tmp_path: Path):
        self.name = name
        self.url = url
        self.p = prefix
        self.tmp_path = tmp_path
        self.db = fdq.connect(url, check_format=False)

    @property
    def embedded(self) -> bool:
        return self.name == "sqlite"

    @property
    def KeySelector(self):
        """The engine's KeySelector class (FDB's binding accepts only its own)."""
        if self.embedded:
            from fdq.engine import KeySelector
            return KeySelector
        import fdb
        return fdb.KeySelector

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
        """The same database with fault injection (embedded engine only)."""
        if not self.embedded:
            pytest.skip("fault injection is a feature of the embedded engine's URL")
        return f"{self.url}?fault_injection={p}&seed={seed}"

    def open(self, url: str | None = None):
        return fdq.connect(url or self.url, check_format=False)


def _fdb_url():
    path = os.environ.get(FDB_ENV)
    return f"fdb://{path}" if path else None


@pytest.fixture(params=["sqlite", "fdb"])
def eng(request, tmp_path):
    if request.param == "fdb":
        url = _fdb_url()
        if url is None:
            pytest.skip(HOW_TO_ENABLE_FDB)
        prefix = b"fdqtest/" + uuid.uuid4().hex.encode() + b"/"
        e = Engine("fdb", url, prefix, tmp_path)
        yield e
        tr = e.db.create_transaction()
        tr.clear_range(e.p, e.end())
        tr.commit().wait()
    else:
        yield Engine("sqlite", f"sqlite://{tmp_path / 'engine.db'}", b"t/", tmp_path)
