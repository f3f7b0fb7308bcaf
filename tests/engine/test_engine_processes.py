"""Several OS processes on one database: serializable read-modify-write, and a database
object that survives a fork."""
from __future__ import annotations

import multiprocessing
import struct

import pytest

from enginehelpers import collect, spawn


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
    import os
    import signal
    import time

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
