"""Helpers shared by every test directory (``tests/`` is on ``sys.path`` through its
conftest): the engine a test runs on, and bounded waiting on a condition.

The suite runs twice (``make test``): on the embedded engine (``sqlite://``), and with
``FDQ_TEST_ENGINE=fdb`` on ``fdb://`` through FoundationDB's official Python binding over
the libfdb_c stand-in of ``tests/standin`` (or, with ``FDQ_TEST_FDB_CLUSTER_FILE``, on a
real cluster). Tests name their databases with :func:`database_url`, never a URL scheme.
"""
from __future__ import annotations

import os
import time
import zlib

import pytest

ENGINE = os.environ.get("FDQ_TEST_ENGINE", "sqlite")
if ENGINE not in ("sqlite", "fdb"):
    raise RuntimeError(f"FDQ_TEST_ENGINE={ENGINE!r}: expected sqlite or fdb")
DOCKER_CLUSTER_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docker",
                                   "fdb.cluster")
# A real cluster for the fdb pass: FDQ_TEST_FDB_CLUSTER_FILE, or FDQ_TEST_FDB=docker (the
# server of docker/docker-compose.yml, started by tests/conftest.py with testcontainers).
FDB_CLUSTER_FILE = os.environ.get("FDQ_TEST_FDB_CLUSTER_FILE") or (
    DOCKER_CLUSTER_FILE if os.environ.get("FDQ_TEST_FDB") == "docker" else None)
ON_FDB = ENGINE == "fdb"
STANDIN = ON_FDB and FDB_CLUSTER_FILE is None

embedded_only = pytest.mark.skipif(ON_FDB, reason="about the embedded engine itself (sqlite:// only)")


def database_url(path, **options) -> str:
    """The URL of the test database stored at ``path`` (a file in the test's tmp_path).

    ``options`` are the embedded engine's (``fault_injection``, ``seed``,
    ``synchronous``). On the fdb pass the URL is ``fdb://`` a cluster file beside
    ``path`` that the libfdb_c stand-in serves from ``path`` (the same database for every
    option set); on a real cluster, that cluster (options skip the test)."""
    path = os.path.abspath(str(path))
    if not ON_FDB:
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"sqlite://{path}" + (f"?{query}" if query else "")
    if FDB_CLUSTER_FILE is not None:
        if options:
            pytest.skip(f"engine options {options} need the embedded engine or the libfdb_c stand-in")
        return f"fdb://{FDB_CLUSTER_FILE}"
    from standin import write_cluster_file
    tag = "" if not options else "-%08x" % zlib.crc32(repr(sorted(options.items())).encode())
    cluster = f"{path}{tag}.cluster"
    if not os.path.exists(cluster):
        write_cluster_file(cluster, path, **options)
    return f"fdb://{cluster}"


def wait_for(cond, timeout: float = 60.0, what: str = "condition", interval: float = 0.05):
    """Poll ``cond()`` until it returns a truthy value (returned); fail the test naming
    ``what`` after ``timeout`` seconds. Tests wait for conditions, never for fixed sleeps."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def readline_within(proc, timeout: float = 60.0, what: str = "a line"):
    """The next line of ``proc.stdout`` (a pipe), failing the test if none comes within
    ``timeout`` seconds (a child stuck before it prints must not hang the run). Returns
    what ``readline()`` returns (empty at end of output)."""
    import selectors
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"timed out after {timeout}s waiting for {what} from pid {proc.pid}")
    return proc.stdout.readline()


def kill_all(procs, timeout: float = 30.0):
    """SIGKILL (and reap) every process of ``procs`` still running: a ``finally`` for
    tests that start processes, so a failure or a timeout leaves none behind."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            try:
                p.wait(timeout)
            except Exception:       # noqa: BLE001 - reaping is best effort; the kill was sent
                pass


def with_faults(url: str, p: float, seed: int | None = None) -> str:
    """The database of ``url`` (a :func:`database_url`) with the embedded engine's fault
    injection at probability ``p`` (also under the libfdb_c stand-in)."""
    options = {"fault_injection": p} if seed is None else {"fault_injection": p, "seed": seed}
    if url.startswith("sqlite://"):
        return url + "?" + "&".join(f"{k}={v}" for k, v in options.items())
    if not STANDIN:
        pytest.skip("fault injection needs the embedded engine or the libfdb_c stand-in")
    import json
    from standin.libfdb_c import SERVED_MARK
    with open(url[len("fdb://"):]) as f:
        settings = json.loads(next(l for l in f.read().splitlines() if l.startswith(SERVED_MARK))[len(SERVED_MARK):])
    return database_url(settings.pop("path"), **{**settings, **options})


def engine_errors() -> tuple:
    """What a raw engine call (``tr.commit().wait()``) raises on this pass: the embedded
    engine's EngineError, or ``fdb.FDBError`` (FDQ translates only what leaves its own
    functions)."""
    from fdq.engine import error_types
    return error_types()


def read_version(db) -> int:
    """A fresh read version of ``db`` (its transaction is kept until the read is waited
    for: FDB cancels the pending reads of a transaction it destroys)."""
    tr = db.create_transaction()
    return tr.get_read_version().wait()


def read(db, key, snapshot: bool = True):
    """The value at ``key`` now (bytes, or None if absent), in a transaction of its own
    kept until the read is waited for."""
    tr = db.create_transaction()
    return (tr.snapshot if snapshot else tr)[key].wait().value
