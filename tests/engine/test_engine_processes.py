"""Several OS processes on one database: serializable read-modify-write, and a database
object that survives a fork."""
from __future__ import annotations

import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fdq
from enginehelpers import HOLD_CLOCK_LOCK, code_of, collect, spawn
from fdqtest import readline_within

FDQ = Path(sys.executable).parent / "fdq"


@pytest.mark.slow
def test_read_modify_write_from_4_processes_loses_no_update(eng):
    p = eng.k(b"rmw/")
    workers, n, keys = 4, 150, 3
    procs = [spawn("rmw", eng.url, prefix=p.hex(), seed=w, n=n, keys=keys) for w in range(workers)]
    results = [collect(proc) for proc in procs]
    total = sum(struct.unpack("<q", v)[0] for k, v in eng.items() if k.startswith(p))
    assert total == workers * n  # every committed increment counted once
    assert set(c for r in results for c in r["errors"]) <= {"1020"}  # only conflicts were retried


def _child_writes(db, key):
    tr = db.create_transaction()
    tr[key] = b"from-forked-child"
    tr.commit().wait()


@pytest.mark.slow
def test_a_forked_child_can_use_the_parents_database(eng):
    if not eng.embedded:
        pytest.skip("the FDB client's network thread does not survive fork (FDB's rule)")
    tr = eng.db.create_transaction()
    tr[eng.k(b"parent")] = b"1"
    tr.commit().wait()
    held = eng.db.create_transaction()
    held[eng.k(b"parent")].wait()  # the parent holds an open read snapshot across the fork
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_child_writes, args=(eng.db, eng.k(b"child")))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert eng.db[eng.k(b"child")] == b"from-forked-child"
    assert held[eng.k(b"parent")] == b"1"  # the parent's connections still work
    held[eng.k(b"after")] = b""
    held.commit().wait()


@pytest.mark.slow
def test_kill_9_mid_transfers_leaves_a_consistent_usable_database(eng):
    """Each transfer commits atomically or not at all: after kill -9 at an arbitrary
    moment, the total is intact, and the file (locks included) is usable at once."""
    accounts, total = 10, 10 * 1000
    tr = eng.db.create_transaction()
    for i in range(accounts):
        tr[eng.k(b"acct/%03d" % i)] = struct.pack("<q", 1000)
    tr.commit().wait()
    procs = [spawn("bank", eng.url, prefix=eng.p.hex(), seed=w, worker=w, n=100_000,
                   accounts=accounts, total=total) for w in range(2)]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until both have committed some transfers
            marks = [k for k, _ in eng.items() if k.startswith(eng.k(b"mark/"))]
            if {m.split(b"/")[-1].split(b"-")[0] for m in marks} >= {b"0", b"1"} and len(marks) >= 40:
                break
            time.sleep(0.02)
        else:
            raise AssertionError("workers made no progress")
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(30)
    assert all(p.returncode == -signal.SIGKILL for p in procs)
    balances = [struct.unpack("<q", v)[0] for k, v in eng.items() if k.startswith(eng.k(b"acct/"))]
    assert sum(balances) == total and len(balances) == accounts
    # no lock left behind: a read-write transaction commits promptly
    t0 = time.monotonic()
    tr = eng.db.create_transaction()
    tr[eng.k(b"acct/000")].wait()
    tr[eng.k(b"after-kill")] = b"1"
    tr.commit().wait()
    assert time.monotonic() - t0 < 10


def test_a_symlinked_path_shares_the_version_clock_lock(eng, tmp_path):
    """SQLite follows a symlink to the database file (one WAL for both names), so the
    engine's version clock lock must too: else a process opening the database by the
    link and one by its real path order nothing between them, and a commit can get a
    version at or below a snapshot that misses it (its conflicts then go unchecked).
    Shown here by a reader by the link that must wait for a lock held by the real path."""
    if not eng.embedded:
        pytest.skip("the version clock lock is the embedded engine's")
    eng.db[eng.k(b"a")] = b"1"
    link = tmp_path / "link.db"
    os.symlink(eng.db.path, link)
    via_link = eng.open(f"sqlite://{link}")
    assert via_link[eng.k(b"a")] == b"1"    # one database
    holder = subprocess.Popen([sys.executable, "-c", HOLD_CLOCK_LOCK, eng.db.path + "-fdqclock"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert readline_within(holder, 60, "locked").strip() == "locked"
        tr = via_link.create_transaction()
        tr.options.set_timeout(300)
        assert code_of(lambda: tr[eng.k(b"a")].wait()) == 1031
    finally:
        holder.kill()
        holder.wait(10)
    assert via_link[eng.k(b"a")] == b"1"


_FORK_THEN_DIE_MID_COMMIT = """
import fcntl, os, sys, time
from fdq.engine.sqlite import Database
db = Database(sys.argv[1])
db[b"t/x"] = b"1"
child = os.fork()
if child == 0:          # a forked worker that outlives its parent
    time.sleep(60)
    os._exit(0)
# the version clock lock as a commit holds it (the window a kill -9 can hit)
fcntl.flock(db._get_store().writer_fd, fcntl.LOCK_EX)
print(child, flush=True)
time.sleep(60)
"""


def test_a_process_killed_mid_commit_releases_the_lock_though_a_forked_child_lives(eng):
    """flock locks belong to the open file, which a forked child shares: a process
    killed -9 while it held the version clock lock (in the middle of a commit) left
    it held for as long as any child forked earlier lived, and every other process
    waited for it without bound (or timed out)."""
    if not eng.embedded:
        pytest.skip("the version clock lock is the embedded engine's")
    proc = subprocess.Popen([sys.executable, "-c", _FORK_THEN_DIE_MID_COMMIT, eng.db.path],
                            stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(readline_within(proc, 60, "the child's pid"))
        proc.kill()
        proc.wait(10)
        tr = eng.db.create_transaction()
        tr.options.set_timeout(3000)
        assert tr[b"t/x"].wait() == b"1"
    finally:
        proc.kill()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("argv", [["topics"], ["stats", "t"]], ids=["topics", "stats"])
def test_read_only_commands_open_while_another_process_holds_the_write_lock(eng, argv):
    """Opening an initialized database writes nothing, so it does not wait for SQLite's
    write lock (it used to take it on every open: 10 s, then 'database is locked')."""
    if eng.path is None:
        pytest.skip("SQLite's write lock: the embedded engine (or the libfdb_c stand-in)")
    fdq.Supervisor(eng.db).create_topic("t", shards=2)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time\n"
         f"c = sqlite3.connect({str(eng.path)!r}, isolation_level=None)\n"
         "c.execute('BEGIN IMMEDIATE'); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert readline_within(holder, 60, "the write lock held").strip() == "held"
        started = time.monotonic()
        out = subprocess.run([str(FDQ), "--url", eng.url, *argv], capture_output=True, text=True, timeout=7)
        took = time.monotonic() - started
        assert out.returncode == 0, out.stderr
        assert ("t" in out.stdout) and took < 7
    finally:
        holder.kill()
        holder.wait(30)


def test_opening_the_file_again_in_a_process_keeps_its_view_of_other_processes_commits(eng):
    """SQLite's locks on the database file are POSIX locks: they belong to the process,
    and closing any descriptor of the file drops them all. Opening a second Database of
    the file (its look at an existing file) must leave them: without them, another
    process closing its last connection takes this one's WAL for its own and deletes it,
    and this process reads a stale snapshot for ever after."""
    k = eng.k(b"seen")
    eng.db[k] = b"0"
    again = eng.open()        # this process opens the file once more
    again[eng.k(b"other")] = b"x"
    for i in range(1, 4):
        collect(spawn("set", eng.url, key=k.hex(), value=(b"%d" % i).hex()))
        assert eng.db[k] == b"%d" % i, i
