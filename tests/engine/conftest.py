"""Fixtures of the engine conformance suite.

Every test that takes ``eng`` runs on the embedded engine (a fresh database in
``tmp_path``) and, when ``FDQ_TEST_FDB_CLUSTER_FILE`` names a cluster file, unchanged on
FoundationDB (keys under a fresh random prefix, cleared afterwards). Tests only use the
FDB Python API surface, so the same assertions hold on both. ``FDQ_TEST_FDB=docker``
instead starts docker/docker-compose.yml for the session with testcontainers (Docker and
FoundationDB's client library needed; not run on the machine this was written on).
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

import fdq

FDB_ENV = "FDQ_TEST_FDB_CLUSTER_FILE"
HOW_TO_ENABLE_FDB = (f"set {FDB_ENV}=/path/to/fdb.cluster (e.g. the cluster of docker/"
                     "docker-compose.yml), or FDQ_TEST_FDB=docker to start that one with testcontainers, "
                     "to run this case on FoundationDB")


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


FDB_DOCKER_ENV = "FDQ_TEST_FDB"
DOCKER_DIR = Path(__file__).resolve().parents[2] / "docker"
FDB_START_S = 180


def _wait_available(compose) -> None:
    """Until the compose file's server says the database is available (its fdb-init
    service configures it on first start), at most FDB_START_S."""
    import time
    deadline = time.monotonic() + FDB_START_S
    status = ""
    while time.monotonic() < deadline:
        try:
            status, _err, _rc = compose.exec_in_container(
                ["fdbcli", "-C", "/var/fdb/fdb.cluster", "--timeout", "5", "--exec", "status minimal"], "fdb")
        except Exception as e:  # not up yet: exec fails until the container runs
            status = str(e)
        if "is available" in status:
            return
        time.sleep(1)
    raise RuntimeError(f"FoundationDB from {DOCKER_DIR / 'docker-compose.yml'} not available after "
                       f"{FDB_START_S} s: {status.strip()[-300:]}")


@pytest.fixture(scope="session")
def fdb_cluster_file():
    """The cluster file of the FoundationDB the ``fdb`` cases run on, or None."""
    path = os.environ.get(FDB_ENV)
    if path or os.environ.get(FDB_DOCKER_ENV) != "docker":
        yield path or None
        return
    from testcontainers.compose import DockerCompose
    compose = DockerCompose(DOCKER_DIR, compose_file_name="docker-compose.yml", wait=False)
    try:
        compose.start()
    except Exception as e:
        detail = getattr(e, "stderr", None) or b""
        raise RuntimeError(f"{FDB_DOCKER_ENV}=docker: could not start {DOCKER_DIR / 'docker-compose.yml'} "
                           f"({e}; {detail.decode(errors='replace').strip()[-300:]})") from e
    try:
        _wait_available(compose)
        yield str(DOCKER_DIR / "fdb.cluster")
    finally:
        compose.stop(down=True)


@pytest.fixture(params=["sqlite", "fdb"])
def eng(request, tmp_path):
    if request.param == "fdb":
        path = request.getfixturevalue("fdb_cluster_file")
        url = f"fdb://{path}" if path else None
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
