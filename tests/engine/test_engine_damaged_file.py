"""A database file that fails under SQLite: damaged pages, a full disk, a write the OS
refuses. Each reaches the user as one FDQ error that names the file and the cause (it
used to be a raw sqlite3.DatabaseError on reads, or "An internal error occurred
(internal_error, code 4100)" from a commit), and is never retried."""
from __future__ import annotations

import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import fdq
from fdq.errors import DatabaseCorrupt
from fdqtest import embedded_only

FDQ = Path(sys.executable).parent / "fdq"


def _damage(path: Path, pages: range):
    """Overwrite the b-tree page type byte of ``pages`` of a checkpointed file."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(path.read_bytes())
    page_size = int.from_bytes(data[16:18], "big")
    for n in pages:
        data[n * page_size] = 0x77
    path.write_bytes(data)


@pytest.fixture
def damaged(eng):
    """A topic of 200 messages of 2 kB whose file has damaged pages."""
    if eng.path is None:
        pytest.skip("damages the embedded engine's file (also under the libfdb_c stand-in)")
    fdq.Supervisor(eng.db).create_topic("t", shards=1)
    fdq.Producer(eng.db).push_many("t", [b"x" * 2000] * 200)
    _damage(eng.path, range(20, 60))
    return eng


@embedded_only
def test_reads_of_a_damaged_file_raise_database_corrupt_naming_it(damaged):
    db = fdq.connect(damaged.url, check_format=False)
    with pytest.raises(DatabaseCorrupt) as info:
        db.get_range(b"", b"\xff")
    e = info.value
    assert isinstance(e, fdq.EngineError) and e.code == 4100 and e.path == str(damaged.path)
    assert str(e) == (f"database file {str(damaged.path)!r} is damaged (SQLite: database disk image is "
                      f"malformed): stop the processes using it, keep a copy, then recover it (sqlite3 "
                      f"{damaged.path} .recover) or restore a backup")


@embedded_only     # FDB's C API carries a code, not a text: a damaged SQLite file is the embedded engine's
def test_fdq_tail_on_a_damaged_file_exits_1_with_one_line_naming_it(damaged):
    out = subprocess.run([str(FDQ), "--url", damaged.url, "tail", "t", "-n", "300", "--timeout", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert str(damaged.path) in lines[0] and "is damaged" in lines[0] and ".recover" in lines[0], lines


def _push_too_much(url, preexec_fn=None, wrap=()):
    lines = ("x" * 50_000 + "\n") * 100
    return subprocess.run([*wrap, str(FDQ), "--url", url, "push", "t", "-"], input=lines, capture_output=True,
                          text=True, timeout=120, preexec_fn=preexec_fn)


def _file_size_limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, 600_000))


@embedded_only
def test_a_write_the_os_refuses_names_the_io_error_and_the_file(tmp_path):
    """RLIMIT_FSIZE: write() fails with EFBIG, which SQLite reports as an I/O error."""
    path = tmp_path / "f.db"
    url = f"sqlite://{path}"
    fdq.Supervisor(fdq.connect(url)).create_topic("t", shards=1)
    out = _push_too_much(url, preexec_fn=_file_size_limit)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out
    assert "disk I/O error (SQLITE_IOERR_WRITE)" in out.stderr and repr(str(path)) in out.stderr, out.stderr


@embedded_only
@pytest.mark.skipif(not shutil.which("unshare") or not sys.platform.startswith("linux"),
                    reason="a small tmpfs in a user namespace (unshare -rm) fills a disk without root")
def test_a_full_disk_says_database_or_disk_is_full_and_names_the_file(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mnt)],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"no user namespace with mounts here: {probe.stderr.strip()}")
    path = mnt / "f.db"
    script = (f"mount -t tmpfs -o size=600k tmpfs {mnt} && "
              f"{FDQ} --url sqlite://{path} topics create t --shards 1 >/dev/null && "
              f"exec {FDQ} --url sqlite://{path} push t -")
    out = subprocess.run(["unshare", "-rm", "sh", "-c", script], input=("x" * 50_000 + "\n") * 100,
                         capture_output=True, text=True, timeout=120, env={**os.environ})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out
    assert "database or disk is full" in out.stderr and repr(str(path)) in out.stderr, out.stderr
    assert "An internal error occurred" not in out.stderr
