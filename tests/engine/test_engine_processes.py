"""Several OS processes on one database: serializable read-modify-write, and a database
object that survives a fork."""
from __future__ import annotations

import multiprocessing
import struct

import pytest

from conftest import collect, spawn


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
