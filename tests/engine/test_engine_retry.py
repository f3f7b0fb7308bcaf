"""Conformance: the retry loop — ``fdq.transactional`` with a database and with a
transaction, ``on_error`` backoff, non-retryable errors (shared/fdb-semantics.md §2, §7)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

import fdq
from fdq.engine import error_types, run_within
from enginehelpers import code_of
from fdqtest import readline_within, wait_for


def test_transactional_with_a_database_retries_a_conflict(eng):
    k = eng.k(b"n")
    eng.db[k] = b"0"
    attempts = []

    @fdq.transactional
    def bump(tr, key):
        attempts.append(1)
        n = int(bytes(tr[key]))
        if len(attempts) == 1:  # someone else commits between our read and our commit
            other = eng.db.create_transaction()
            other[key] = b"100"
            other.commit().wait()
        tr[key] = b"%d" % (n + 1)
        return n + 1

    assert bump(eng.db, k) == 101
    assert len(attempts) == 2 and eng.db[k] == b"101"


def test_transactional_with_a_transaction_joins_it(eng):
    calls = []

    @fdq.transactional
    def put(tr, key, value):
        calls.append(1)
        tr[key] = value

    tr = eng.db.create_transaction()
    put(tr, eng.k(b"a"), b"1")
    put(tr, eng.k(b"b"), b"2")
    assert eng.db[eng.k(b"a")] is None  # not committed by put
    assert tr[eng.k(b"a")] == b"1"
    tr.commit().wait()
    assert eng.db[eng.k(b"b")] == b"2" and len(calls) == 2

    @fdq.transactional
    def read(tr, key):
        return tr[key].value

    assert read(eng.db.create_transaction().snapshot, eng.k(b"a")) == b"1"

    @fdq.transactional(parameter="db")
    def by_name(x, db):
        db[eng.k(b"c")] = x

    by_name(b"3", eng.db)
    assert eng.db[eng.k(b"c")] == b"3"


def test_transactional_reraises_non_retryable_errors_at_once(eng):
    attempts = []

    @fdq.transactional
    def boom(tr):
        attempts.append(1)
        tr[eng.k(b"x")] = b"1"
        raise KeyError("not an FDB error")

    with pytest.raises(KeyError):
        boom(eng.db)
    assert len(attempts) == 1 and eng.db[eng.k(b"x")] is None

    @fdq.transactional
    def too_big(tr):
        attempts.append(1)
        tr[eng.k(b"y")] = b"v" * 100_001

    with pytest.raises(fdq.EngineError) as info:
        too_big(eng.db)
    assert info.value.code == 2103 and info.value.name == "value_too_large"
    assert isinstance(info.value, fdq.FDQError) and len(attempts) == 2

    with pytest.raises(ValueError):
        @fdq.transactional
        def gen(tr):
            yield tr[eng.k(b"x")]

    # a call that returns a generator is refused too, with a database or a transaction
    @fdq.transactional
    def returns_gen(tr):
        return (kv for kv in tr.get_range(eng.p, eng.end()))

    with pytest.raises(ValueError):
        returns_gen(eng.db)
    with pytest.raises(ValueError):
        returns_gen(eng.db.create_transaction())


def test_transactional_returns_a_usable_versionstamp_future(eng):
    @fdq.transactional
    def write(tr):
        tr[eng.k(b"a")] = b""
        return tr.get_versionstamp()

    assert len(bytes(write(eng.db).wait())) == 10


def test_on_error_resets_backs_off_and_gives_up(eng):
    tr = eng.db.create_transaction()
    tr.options.set_max_retry_delay(20)
    tr.options.set_retry_limit(3)
    tr[eng.k(b"a")] = b"1"
    rv = tr.get_read_version().wait()
    t0 = time.monotonic()
    tr.on_error(1020).wait()
    assert tr[eng.k(b"a")] == None  # noqa: E711 - reset: own writes are gone
    assert tr.get_read_version().wait() > rv  # a new read version
    for _ in range(2):
        tr.on_error(1020).wait()  # retries 2 and 3
    assert time.monotonic() - t0 < 10  # backoff capped by max_retry_delay (generous: loaded machine)
    # the retry limit (an option that survives on_error) is reached: the error is re-raised
    assert code_of(lambda: tr.on_error(1020).wait()) == 1020
    # non-retryable errors are re-raised at once
    for code in (2101, 2102, 1032, 1036, 1025):
        t = eng.db.create_transaction()
        assert code_of(lambda: t.on_error(code).wait()) == code
    # anything but an FDB error or a code is re-raised as is
    t = eng.db.create_transaction()
    with pytest.raises(KeyError):
        t.on_error(KeyError("mine"))
    # 1021 is retryable (maybe committed): on_error retries it blindly
    t = eng.db.create_transaction()
    assert code_of(lambda: t.on_error(1021).wait()) is None


def test_transaction_timeout(eng):
    tr = eng.db.create_transaction()
    tr.options.set_timeout(30)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.1:
        time.sleep(0.01)
    assert code_of(lambda: tr[eng.k(b"a")].wait()) == 1031
    # every later use fails with 1031 (not 1025) until reset, on_error included
    assert code_of(lambda: tr.on_error(1031).wait()) == 1031
    assert code_of(lambda: tr.commit().wait()) == 1031
    # reset() clears every option, the timeout included
    tr.reset()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.1:
        time.sleep(0.01)
    assert tr[eng.k(b"a")] == None  # noqa: E711


def test_timeout_bounds_a_commit_waiting_for_the_write_lock(eng, tmp_path):
    """A transaction's timeout also bounds its commit's wait for a writer that does not
    finish (embedded: another process holding SQLite's write lock), and run_within
    gives up after its timeout instead of retrying forever."""
    if not eng.embedded:
        pytest.skip("holding the write lock from outside is a property of the embedded engine")
    path = eng.url.split("sqlite://", 1)[1]
    waiting = None
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time\n"
         "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
         "c.execute('BEGIN IMMEDIATE'); print('held', flush=True); time.sleep(120)", path],
        stdout=subprocess.PIPE, text=True)
    try:
        assert readline_within(holder, 60, "held").strip() == "held"
        tr = eng.db.create_transaction()
        tr.options.set_timeout(300)
        tr[eng.k(b"a")] = b"1"
        t0 = time.monotonic()
        assert code_of(lambda: tr.commit().wait()) == 1031
        assert time.monotonic() - t0 < 3.0       # the lock wait alone is 10 s

        def put(tr):
            tr[eng.k(b"b")] = b"1"
        t0 = time.monotonic()
        assert code_of(lambda: run_within(eng.db, 500, put)) == 1031
        assert time.monotonic() - t0 < 3.0
        # Also while another thread of this process is the one waiting for the lock.
        waiting = threading.Thread(target=lambda: code_of(lambda: run_within(eng.db, 8000, put)))
        waiting.start()
        store = eng.db._get_store()
        wait_for(store.write_lock.locked, 10, what="the other thread waiting for SQLite's lock")
        t0 = time.monotonic()
        assert code_of(lambda: run_within(eng.db, 300, put)) == 1031
        assert time.monotonic() - t0 < 3.0
        assert holder.poll() is None             # still holding: nothing waited it out
    finally:
        holder.kill()
        holder.wait()
    if waiting is not None:
        waiting.join(30)
    assert eng.items() in ([], [(eng.k(b"b"), b"1")])   # the 8 s one may commit once the lock is free
    assert run_within(eng.db, 5000, put) is None
    assert eng.items() == [(eng.k(b"b"), b"1")]


def test_error_types_are_fdq_errors(eng):
    assert all(issubclass(t, Exception) for t in error_types())
    e = fdq.EngineError(1020)
    assert e.code == 1020 and e.name == "not_committed" and "1020" in str(e)
