"""Fixtures shared by every test directory: a fresh database per test, on the engine
of this pass (``tests/fdqtest.py``: ``sqlite://``, or ``fdb://`` through FoundationDB's
binding over the libfdb_c stand-in, installed when fdqtest is imported), its supervisor,
worker processes reaped at teardown, a dump of its key space. A directory's conftest
keeps only what is its own."""
from __future__ import annotations

import os

import pytest

import fdqtest  # first: on the fdb pass it installs the libfdb_c stand-in

import fdq  # noqa: E402


FDB_START_S = 180


@pytest.fixture(scope="session", autouse=True)
def _docker_cluster():
    """``FDQ_TEST_FDB=docker``: the FoundationDB server of docker/docker-compose.yml for
    the session, started with testcontainers (Docker and FoundationDB's client library
    needed; not run on the machine this was written on)."""
    if not (fdqtest.ON_FDB and os.environ.get("FDQ_TEST_FDB") == "docker"):
        yield
        return
    import time
    from testcontainers.compose import DockerCompose
    docker_dir = os.path.dirname(fdqtest.DOCKER_CLUSTER_FILE)
    compose = DockerCompose(docker_dir, compose_file_name="docker-compose.yml", wait=False)
    compose.start()
    try:
        deadline, status = time.monotonic() + FDB_START_S, ""
        while "is available" not in status:
            if time.monotonic() > deadline:
                raise RuntimeError(f"FoundationDB of {docker_dir}/docker-compose.yml not available after "
                                   f"{FDB_START_S} s: {status.strip()[-300:]}")
            try:
                status = compose.exec_in_container(
                    ["fdbcli", "-C", "/var/fdb/fdb.cluster", "--timeout", "5", "--exec", "status minimal"], "fdb")[0]
            except Exception as e:  # noqa: BLE001 - not up yet: exec fails until the container runs
                status = str(e)
                time.sleep(1)
        yield
    finally:
        compose.stop(down=True)


@pytest.fixture(autouse=True)
def _empty_real_cluster():
    """On a real cluster every test's database is that one cluster: each test starts from
    an empty FDQ layout (run the pass with one worker: -n 0)."""
    if fdqtest.ON_FDB and not fdqtest.STANDIN:
        from fdq.keyspace import Keyspace
        from fdq.ops.topics import bump_metadata_version
        db = fdq.connect(f"fdb://{fdqtest.FDB_CLUSTER_FILE}", check_format=False)
        tr, r = db.create_transaction(), Keyspace().root.range()
        tr.clear_range(r.start, r.stop)
        bump_metadata_version(tr)        # the configs cached behind it are gone too
        tr.commit().wait()
    yield


@pytest.fixture
def db_path(tmp_path):
    """Where the test's database is stored (its own directory)."""
    return tmp_path / "fdq.db"


@pytest.fixture
def db_url(db_path):
    """The URL of a fresh database in the test's own directory."""
    return fdqtest.database_url(db_path)


@pytest.fixture
def url(db_url):
    """The same as ``db_url``."""
    return db_url


@pytest.fixture
def db(db_url):
    return fdq.connect(db_url)


@pytest.fixture
def sup(db):
    return fdq.Supervisor(db)


@pytest.fixture
def procs(tmp_path, db_url):
    """Worker processes (``tests/workers``) on the test's database, killed at teardown."""
    ps = fdqtest.Procs(tmp_path, db_url)
    yield ps
    ps.cleanup()


@pytest.fixture
def workers(procs):
    """The same as ``procs`` (tests of consumer processes name it so)."""
    return procs


@pytest.fixture
def dump(db):
    """``dump()``: every key and value of the test's database (to prove a refused
    operation wrote nothing)."""
    return lambda: fdqtest.dump(db)


def pytest_report_header(config):
    if fdqtest.STANDIN:
        return "engine: fdb:// through FoundationDB's binding over the libfdb_c stand-in (FDQ_STANDIN=%s)" % (
            os.environ["FDQ_STANDIN"])
    if fdqtest.ON_FDB:
        return f"engine: fdb:// on the cluster of {fdqtest.FDB_CLUSTER_FILE}"
    return "engine: sqlite:// (the embedded engine)"


def pytest_terminal_summary(terminalreporter):
    """Every skip with its reason, grouped by reason."""
    skipped = terminalreporter.stats.get("skipped", [])
    by_reason = {}
    for r in skipped:
        reason = r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
        by_reason.setdefault(reason, []).append(r.nodeid)
    for reason, ids in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        terminalreporter.write_line(f"{len(ids)} skipped: {reason}")
        for nodeid in ids[:3]:
            terminalreporter.write_line(f"    {nodeid}")


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (``-n 2 --dist loadgroup``), every Spark test runs on one
    worker: their session-scoped Spark session (a JVM) then starts once."""
    for item in items:
        if "/tests/spark/" in str(item.path):
            item.add_marker(pytest.mark.xdist_group("spark"))
