"""``fdq.connect``: bad URLs give ConnectError naming the URL and the cause; a database
of a newer layout is refused with FormatError; a connection dropped leaves no open
descriptor behind."""
from __future__ import annotations

import ctypes.util
import gc
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import fdb.tuple
import pytest

import fdq
from fdq.keyspace import Keyspace
from fdq.keyspace.format import FORMAT_VERSION, ensure_format
from fdqtest import ON_FDB, wait_for

FDQ = Path(sys.executable).parent / "fdq"


@pytest.mark.parametrize("url,cause", [
    ("mysql://localhost/db", "unknown scheme"),
    ("sqlite:///no/such/directory/x.db", "does not exist"),
    ("sqlite://", "no database file path"),
    ("sqlite:///{tmp}/x.db?frobnicate=1", "unknown option 'frobnicate'"),
    ("sqlite:///{tmp}/x.db?fault_injection=lots", "not a valid float"),
    ("sqlite:///{tmp}/x.db?fault_injection=2", "probability"),
    ("sqlite:///{tmp}/x.db?synchronous=SOMETIMES", "synchronous"),
    ("fdb:///no/such/fdb.cluster", "not readable"),
])
def test_bad_urls(tmp_path, url, cause):
    url = url.replace("/{tmp}", str(tmp_path))
    with pytest.raises(fdq.ConnectError) as info:
        fdq.connect(url)
    assert url in str(info.value) and cause in str(info.value)
    assert isinstance(info.value, fdq.FDQError)


def test_not_a_database_file(tmp_path):
    path = tmp_path / "garbage.db"
    path.write_bytes(b"this is not SQLite" * 100)
    with pytest.raises(fdq.ConnectError) as info:
        fdq.connect(f"sqlite://{path}")
    assert str(path) in str(info.value) and "is not an SQLite database" in str(info.value)
    assert path.read_bytes() == b"this is not SQLite" * 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.db"]


def _other_application(path, schema: str):
    conn = sqlite3.connect(path)
    conn.executescript(schema)
    conn.commit()
    conn.close()
    return path.read_bytes()


def _journal_mode(path) -> str:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        conn.close()


@pytest.mark.parametrize("schema,tables", [
    ("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT); INSERT INTO users VALUES (1, 'ann');", "users"),
    ("CREATE TABLE kv (k TEXT, v TEXT); CREATE TABLE txlog (version, clock, ranges);", "kv"),
    ("CREATE TABLE kv (key BLOB PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID; CREATE VIEW v AS SELECT 1;",
     "view v"),
], ids=["users", "kv-of-another-shape", "fdq-tables-and-a-view"])
def test_another_applications_sqlite_file_is_refused_and_left_unchanged(tmp_path, schema, tables):
    """Even a read-only command used to convert it (WAL, FDQ's tables, side files)."""
    path = tmp_path / "app.db"
    before = _other_application(path, schema)
    url = f"sqlite://{path}"
    with pytest.raises(fdq.ConnectError) as info:
        fdq.connect(url)
    text = str(info.value)
    assert url in text and "another application" in text and f"(tables: {tables}" in text, text
    out = subprocess.run([str(FDQ), "--url", url, "topics"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "another application" in out.stderr and "Traceback" not in out.stderr, out
    assert path.read_bytes() == before
    assert _journal_mode(path) == "delete"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]     # no WAL, no -fdqclock


def test_an_empty_sqlite_file_becomes_an_fdq_database(tmp_path):
    """No tables: nothing of anyone's to lose."""
    path = tmp_path / "empty.db"
    path.touch()
    fdq.connect(f"sqlite://{path}")[b"k"] = b"v"
    _other_application(tmp_path / "blank.db", "PRAGMA user_version = 0;")
    fdq.connect(f"sqlite://{tmp_path / 'blank.db'}")[b"k"] = b"v"
    assert _journal_mode(path) == _journal_mode(tmp_path / "blank.db") == "wal"


def test_non_string_url():
    with pytest.raises(fdq.ConnectError):
        fdq.connect(42)


@pytest.mark.skipif(bool(ctypes.util.find_library("fdb_c")) or ON_FDB,
                    reason="a FoundationDB client library (or its stand-in) is installed")
def test_fdb_without_the_client_library(tmp_path):
    """In a fresh process: loading the binding changes module state."""
    cluster = tmp_path / "fdb.cluster"
    cluster.write_text("test:test@127.0.0.1:4500\n")
    code = ("import fdq, sys\n"
            "try:\n"
            f"    fdq.connect('fdb://{cluster}')\n"
            "except fdq.ConnectError as e:\n"
            "    print(e); sys.exit(0)\n"
            "sys.exit(1)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"fdb://{cluster}" in out.stdout and "client library" in out.stdout
    assert "Install" in out.stdout  # says how to get it


def test_connect_checks_the_format_and_writes_nothing(tmp_path):
    url = f"sqlite://{tmp_path / 'f.db'}"
    db = fdq.connect(url)
    assert list(db.create_transaction().get_range(b"", b"\xff")) == []  # checking wrote nothing
    ks = Keyspace()
    db[ks.format_key] = fdb.tuple.pack((FORMAT_VERSION,))
    fdq.connect(url)  # the current format is fine
    db[ks.format_key] = fdb.tuple.pack((FORMAT_VERSION + 1,))
    with pytest.raises(fdq.FormatError) as info:
        fdq.connect(url)
    assert str(FORMAT_VERSION + 1) in str(info.value)
    assert fdq.connect(url, check_format=False) is not None


@pytest.mark.parametrize("url", ["sqlite://{tmp}/d/queue#a.db", "fdb://{tmp}/fdb#1.cluster"])
def test_a_hash_in_a_url_is_refused_saying_to_write_it_percent_23(tmp_path, url):
    """'#' starts a URL fragment: sqlite:///d/queue#a.db used to open d/queue."""
    (tmp_path / "d").mkdir()
    url = url.replace("{tmp}", str(tmp_path))
    with pytest.raises(fdq.ConnectError) as info:
        fdq.connect(url)
    assert url in str(info.value) and "write it %23" in str(info.value)
    assert url.replace("#", "%23") in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"] and not list((tmp_path / "d").iterdir())


@pytest.mark.parametrize("encoded,name", [
    ("queue%23a.db", "queue#a.db"), ("sp%20ace.db", "sp ace.db"), ("q%25b.db", "q%b.db"),
    ("what%3F.db", "what?.db"), ("plain.db", "plain.db"),
])
def test_sqlite_paths_are_percent_decoded(tmp_path, encoded, name):
    db = fdq.connect(f"sqlite://{tmp_path}/{encoded}")
    db[b"k"] = b"v"
    assert db.path == str(tmp_path / name)
    assert (tmp_path / name).exists() and not (encoded != name and (tmp_path / encoded).exists())


def test_an_fdb_cluster_file_path_is_percent_decoded(tmp_path):
    with pytest.raises(fdq.ConnectError) as info:
        fdq.connect(f"fdb://{tmp_path}/my%20fdb.cluster")
    assert repr(f"{tmp_path}/my fdb.cluster") in str(info.value)


def test_the_default_url_names_a_home_with_hash_and_percent(tmp_path, monkeypatch):
    monkeypatch.delenv("FDQ_URL", raising=False)
    home = tmp_path / "h#1 50%"
    monkeypatch.setenv("FDQ_HOME", str(home))
    db = fdq.connect()
    db[b"k"] = b"v"
    assert db.path == str(home / "fdq.db") and (home / "fdq.db").exists()


@pytest.mark.parametrize("raw,shown", [
    (fdb.tuple.pack(("2",)), "('2',)"),
    (fdb.tuple.pack(()), "decodes to ()"),
    (b"\x01\x02garbage", "garbage"),
    (fdb.tuple.pack((None,)), "(None,)"),
    (fdb.tuple.pack((1.5,)), "(1.5,)"),
    (fdb.tuple.pack((True,)), "(True,)"),
    (fdb.tuple.pack((1, 1)), "(1, 1)"),
    (fdb.tuple.pack((0,)), "decodes to 0"),
    (fdb.tuple.pack((-1,)), "decodes to -1"),
    (b"\xff\x00", "does not decode"),
], ids=["string", "empty", "bytes", "none", "float", "bool", "two", "zero", "negative", "undecodable"])
def test_a_malformed_layout_version_is_refused_naming_the_value(eng, raw, shown):
    """meta/format holds exactly one int of 1..FORMAT_VERSION: anything else is a
    FormatError naming the stored value and the cause, on connect and on first write."""
    ks = Keyspace(root=("fdqtest", eng.p))
    eng.db[ks.format_key] = raw
    try:
        for write in (False, True):
            with pytest.raises(fdq.FormatError) as info:
                ensure_format(eng.db, ks, write=write)
            text = str(info.value)
            assert "meta/format holds" in text and shown in text, text
            assert "not written by FDQ, or it is damaged" in text
        assert eng.db[ks.format_key] == raw  # nothing rewritten
    finally:
        del eng.db[ks.format_key]


def test_connect_names_the_url_of_a_malformed_layout_version(tmp_path):
    url = f"sqlite://{tmp_path / 'f.db'}"
    db = fdq.connect(url)
    db[Keyspace().format_key] = fdb.tuple.pack(("1",))
    with pytest.raises(fdq.FormatError) as info:
        fdq.connect(url)
    assert url in str(info.value) and "('1',)" in str(info.value)


def test_default_url(tmp_path, monkeypatch):
    monkeypatch.delenv("FDQ_URL", raising=False)
    monkeypatch.setenv("FDQ_HOME", str(tmp_path / "home"))
    db = fdq.connect()
    assert db.path == os.path.join(str(tmp_path / "home"), "fdq.db")
    monkeypatch.setenv("FDQ_URL", f"sqlite://{tmp_path / 'env.db'}")
    assert fdq.connect().path == str(tmp_path / "env.db")


def test_connecting_again_and_again_leaves_no_descriptor_behind(url):
    """A service may connect per request: what each connection opened (the embedded
    engine's version clock descriptors, its watcher probe) goes with it or is shared,
    so this process's descriptors stay bounded."""
    def open_fds() -> int:
        gc.collect()
        return len(os.listdir("/proc/self/fd"))
    fdq.Supervisor(fdq.connect(url)).create_topic("t")
    before = open_fds()
    for _ in range(40):
        db = fdq.connect(url)
        fdq.Producer(db).push("t", b"x")
        with fdq.Consumer(db, "t") as c:
            c.fetch(1, timeout=0.01)
        del db, c
    wait_for(lambda: open_fds() <= before + 8, 30, what=f"this process's descriptors back near {before}")
