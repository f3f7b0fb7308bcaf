"""Conformance: the retry loop — ``fdq.transactional`` with a database and with a
transaction, ``on_error`` backoff, non-retryable errors (docs/fdb-semantics.md §2, §7), and
``fdq.engine.transact``, the loop under them (attempts that may have committed, on_error)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

import fdq
from fdq.engine import Again, Done, StreamingMode, error_types, retry, run_within, transact
from enginehelpers import HOLD_CLOCK_LOCK, code_of, commit_by_other, failed_commits, wait_ready
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


def test_a_non_retryable_error_leaves_transactional_with_its_description(eng):
    """The retry loop tells the engine the code; when it gives up, the error itself
    leaves (a full disk's cause used to become a bare 'An internal error occurred')."""
    @fdq.transactional
    def fails(tr):
        tr[eng.k(b"x")] = b"1"
        raise fdq.EngineError(4100, "SQLite: database or disk is full, writing '/p/fdq.db'")

    with pytest.raises(fdq.EngineError) as info:
        fails(eng.db)
    assert info.value.code == 4100 and "database or disk is full" in str(info.value)
    assert eng.db[eng.k(b"x")] is None


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


# -- transact: the one retry loop (fdq.engine.retry) ----------------------------------


def test_transact_tells_the_next_attempt_that_one_may_have_committed(eng):
    """An attempt that raised commit_unknown_result (1021) may have committed: the body's
    next attempt is told (say, to look for its marker before writing again)."""
    seen = []

    def body(tr, attempt):
        seen.append((attempt.number, attempt.maybe_committed, attempt.in_flight))
        tr[eng.k(b"a")] = b"%d" % attempt.number
        if attempt.number == 1:
            raise eng.Error(1021)
        if attempt.number == 2:
            raise eng.Error(1020)   # surely not committed: what an earlier one did still stands
        return "done"

    assert transact(eng.db, body) == "done"
    assert seen == [(1, False, False), (2, True, False), (3, True, False)]
    assert eng.items() == [(eng.k(b"a"), b"3")]


class _Ready:
    """A future that is ready: ``wait()`` returns None or raises ``error``."""

    def __init__(self, error=None):
        self.error = error

    def wait(self):
        if self.error is not None:
            raise self.error


def test_transact_reports_a_commit_that_timed_out_as_maybe_in_flight():
    """A commit that times out (1031) may have committed and may still apply: on_error
    sees it as maybe committed and in flight, and the error the engine gave up on."""
    class Tr:
        def __init__(self):
            self.commits = 0

        def commit(self):
            self.commits += 1
            return _Ready(fdq.EngineError(1031))

        def on_error(self, code):
            return _Ready(fdq.EngineError(code))    # 1031 is not retryable

    class Db:
        def create_transaction(self):
            return Tr()

    errors = []

    def on_error(e, attempt):
        errors.append((e.code, attempt.number, attempt.maybe_committed, attempt.in_flight, attempt.gave_up.code))
    with pytest.raises(fdq.EngineError) as info:
        transact(Db(), lambda tr, attempt: None, on_error=on_error)
    assert info.value.code == 1031 and errors == [(1031, 1, True, True, 1031)]


def test_transact_on_error_done_stops_and_returns_its_value(eng):
    """on_error's Done(value): the call returns value, no more attempts (a caller's probe
    found that an attempt which may have committed did)."""
    calls = []

    def body(tr, attempt):
        calls.append(attempt.number)
        tr[eng.k(b"a")] = b"1"
        raise eng.Error(1021)

    def on_error(e, attempt):
        assert e.code == 1021 and attempt.maybe_committed and attempt.gave_up is None
        assert attempt.result is None       # the body raised: no result
        return Done("probed")

    assert transact(eng.db, body, on_error=on_error) == "probed"
    assert calls == [1] and eng.items() == []


def test_transact_on_error_again_retries_what_would_be_raised(eng):
    """on_error's Again(): reset and run again, also after an error the engine gives up
    on (2101: the caller halves its batch) and after an exception that is not an engine
    error (a hold that lapses); None raises them as usual."""
    class Held(Exception):
        pass

    seen = []

    def body(tr, attempt):
        seen.append(attempt.number)
        tr[eng.k(b"a")] = b"%d" % attempt.number
        if attempt.number == 1:
            raise eng.Error(2101)
        if attempt.number == 2:
            raise Held()
        return attempt.number

    answers = []

    def on_error(e, attempt):
        answers.append((type(e).__name__, getattr(attempt.gave_up, "code", None)))
        return Again()

    assert transact(eng.db, body, on_error=on_error) == 3
    assert seen == [1, 2, 3] and eng.items() == [(eng.k(b"a"), b"3")]
    assert answers == [(eng.Error.__name__, 2101), ("Held", None)]
    # None: the final engine error leaves as an EngineError (on FDB too), others as they are
    with pytest.raises(fdq.EngineError) as info:
        transact(eng.db, lambda tr, a: (_ for _ in ()).throw(eng.Error(2101)), on_error=lambda e, a: None)
    assert info.value.code == 2101
    with pytest.raises(Held):
        transact(eng.db, lambda tr, a: (_ for _ in ()).throw(Held()), on_error=lambda e, a: None)
    with pytest.raises(TypeError):
        transact(eng.db, lambda tr, a: (_ for _ in ()).throw(Held()), on_error=lambda e, a: "again")


def test_transact_timeout_spans_attempts_and_agains(eng):
    """timeout_ms bounds the whole call: retries keep the transaction's timeout, and an
    Again (whose reset clears it) keeps what is left of it."""
    calls = []

    def body(tr, attempt):
        calls.append(attempt.number)
        tr[eng.k(b"a")].wait()
        raise RuntimeError("held")

    def on_error(e, attempt):
        if attempt.gave_up is not None:
            return None
        time.sleep(0.05)
        return Again()

    t0 = time.monotonic()
    with pytest.raises(fdq.EngineError) as info:
        transact(eng.db, body, on_error=on_error, timeout_ms=400)
    assert info.value.code == 1031 and 0.35 < time.monotonic() - t0 < 5 and len(calls) >= 3


def test_transact_an_interrupt_leaves_through_after_interrupt(eng, monkeypatch):
    """An interrupt in an attempt (KeyboardInterrupt, a signal handler's exception) gives
    the thread a fresh wait semaphore on FDB's binding before it leaves (after_interrupt)."""
    calls = []
    monkeypatch.setattr(retry, "after_interrupt", lambda: calls.append(1))

    def body(tr, attempt):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        transact(eng.db, body)
    assert calls == [1]
    with pytest.raises(KeyError):
        transact(eng.db, lambda tr, a: {}["x"])
    assert calls == [1]


def test_transact_refuses_a_generator_and_transactional_runs_on_it(eng, monkeypatch):
    """transact refuses a lazy result, as transactional; transactional's retries go
    through transact's retry_or_raise (where tests count retries)."""
    with pytest.raises(ValueError):
        transact(eng.db, lambda tr, a: (kv for kv in tr.get_range(eng.p, eng.end())))
    codes = []
    real = retry.retry_or_raise

    def counted(tr, e):
        codes.append(e.code)
        return real(tr, e)

    attempts = []

    @fdq.transactional
    def once_conflicting(tr, key):
        attempts.append(1)
        if len(attempts) == 1:
            raise eng.Error(1020)
        tr[key] = b"1"

    monkeypatch.setattr(retry, "retry_or_raise", counted)
    once_conflicting(eng.db, eng.k(b"a"))
    assert run_within(eng.db, 5000, lambda tr: tr[eng.k(b"a")].value) == b"1"
    assert codes == [1020] and len(attempts) == 2


def test_on_error_reset_and_cancel_fail_what_the_attempt_left_pending(eng):
    """As FDB's RYW reset (on_error, reset, cancel: 1025; timeout: 1031): a watch or
    versionstamp future of an abandoned attempt fails; it is never left pending (a
    waiter would hang forever)."""
    k = eng.k(b"w")
    for end in ("on_error", "reset", "cancel"):
        tr = eng.db.create_transaction()
        w = tr.watch(k)
        tr[eng.k(b"a")] = b"1"
        vs = tr.get_versionstamp()
        if end == "on_error":
            tr.on_error(1020).wait()
        elif end == "reset":
            tr.reset()
        else:
            tr.cancel()
        assert wait_ready(w, 5), end
        assert code_of(w.wait) == 1025, end
        assert wait_ready(vs, 5), end
        assert code_of(vs.wait) == 1025, end
    # a timeout fails them with 1031
    tr = eng.db.create_transaction()
    tr.options.set_timeout(30)
    w = tr.watch(k)
    tr[eng.k(b"a")] = b"1"
    vs = tr.get_versionstamp()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.1:
        time.sleep(0.01)
    assert code_of(lambda: tr.commit().wait()) == 1031
    assert code_of(lambda: tr.on_error(1031).wait()) == 1031
    assert wait_ready(w, 5) and code_of(w.wait) == 1031
    assert wait_ready(vs, 5) and code_of(vs.wait) == 1031
    # the versionstamp of a committed attempt stays as it was after reset()
    tr = eng.db.create_transaction()
    tr[eng.k(b"a")] = b"2"
    vs = tr.get_versionstamp()
    tr.commit().wait()
    tr.reset()
    assert len(bytes(vs.wait())) == 10


def test_timeout_bounds_waiting_for_a_stalled_committer(eng):
    """A process stopped in the middle of a commit (SIGSTOP, a frozen container) holds
    the engine's version clock lock: a transaction with a timeout must still end with
    transaction_timed_out (1031), for its reads and its commit, as FDB's timeout bounds
    every wait of the transaction. The engine waited for the lock without bound."""
    if not eng.embedded:
        pytest.skip("the version clock lock is the embedded engine's")
    eng.db[eng.k(b"a")] = b"1"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_CLOCK_LOCK, eng.db.path + "-fdqclock"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert readline_within(holder, 60, "locked").strip() == "locked"
        results = {}

        def read():
            tr = eng.db.create_transaction()
            tr.options.set_timeout(300)
            results["read"] = code_of(lambda: tr[eng.k(b"a")].wait())

        def commit():
            tr = eng.db.create_transaction()
            tr.options.set_timeout(300)
            tr[eng.k(b"b")] = b"1"
            results["commit"] = code_of(lambda: tr.commit().wait())

        threads = [threading.Thread(target=f, daemon=True) for f in (read, commit)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert results == {"read": 1031, "commit": 1031}
    finally:
        holder.kill()
        holder.wait(10)
    # the lock released, both work again (the commit's SQLite write lock was let go)
    for t in threads:
        t.join(10)
    tr = eng.db.create_transaction()
    tr[eng.k(b"b")] = b"2"
    tr.commit().wait()
    assert eng.db[eng.k(b"b")] == b"2"


def test_a_timed_out_commit_may_have_applied(eng):
    """FDB: transaction_timed_out (1031) from a commit "may have committed" (a commit
    in flight when the timeout fires still lands; FDB's client simulates exactly that).
    Under fault injection the engine's 1031 never followed a real commit, so code that
    takes a timed-out commit for "not committed" passed."""
    db = eng.open(eng.fault_url(0.3, 9))
    def setup(tr, i):
        tr.options.set_timeout(60_000)
        tr[eng.k(b"t%04d" % i)] = b"1"
        return eng.k(b"t%04d" % i)
    applied = 0
    for tr, key in failed_commits(db, 1031, 400, setup):
        # as FDB after a timeout: every later use is 1031, on_error included
        assert code_of(lambda: tr.on_error(1031).wait()) == 1031
        assert code_of(lambda: tr[key].wait()) == 1031
        if eng.db[key] is not None:
            applied += 1
            if applied >= 3:
                break
    assert applied >= 3


def test_the_timeout_spans_retries_and_only_three_options_survive_on_error(eng):
    """§1/§5: only timeout, retry limit and max retry delay are persistent (RYW
    resetRyow re-applies persistentOptions); the timeout counts from creation or
    reset(), not from on_error (creationTime is set by reset() only)."""
    k = eng.k(b"a")
    commit_by_other(eng, lambda t: t.set(k, b"stored"))
    tr = eng.db.create_transaction()
    tr.options.set_size_limit(100)
    tr.options.set_snapshot_ryw_disable()
    tr.options.set_read_system_keys()
    tr[k] = b"mine"
    assert tr.snapshot[k] == b"stored"
    tr.on_error(1020).wait()
    assert code_of(lambda: tr[b"\xff/x"].wait()) == 2004     # system keys are off again
    tr[k] = b"x" * 200
    assert tr.snapshot[k] == b"x" * 200     # snapshot RYW is back on
    tr.commit().wait()                      # the 100-byte size limit is gone too
    tr = eng.db.create_transaction()
    tr.options.set_retry_limit(1)
    tr.on_error(1020).wait()
    assert code_of(lambda: tr.on_error(1020).wait()) == 1020  # the retry limit survived
    tr.reset()                              # ... and reset() clears it
    t0 = time.monotonic()
    tr.options.set_timeout(1000)
    tr.options.set_max_retry_delay(5)
    while time.monotonic() - t0 < 0.4:
        tr.on_error(1020).wait()            # retries do not restart the clock
    while time.monotonic() - t0 < 1.1:
        time.sleep(0.01)
    assert code_of(lambda: tr[k].wait()) == 1031


def test_after_on_error_re_raises_the_transaction_is_cancelled_until_reset(eng):
    """§7: after any re-raise RYW sends transaction_cancelled to resetPromise: every
    later use fails with 1025 until reset()."""
    tr = eng.db.create_transaction()
    assert code_of(lambda: tr.on_error(2101).wait()) == 2101
    assert code_of(lambda: tr[eng.k(b"a")].wait()) == 1025
    assert code_of(lambda: tr.commit().wait()) == 1025
    assert code_of(lambda: tr.on_error(1020).wait()) == 1025
    tr.reset()
    assert tr[eng.k(b"a")] == None  # noqa: E711


# -- §2 a lazy FDBRange does not outlive its transaction: FDBRange keeps only its
# first batch (requested at call time); each further batch is a new read, which after
# commit fails with used_during_commit 2017. The first batch is byte-limited
# (bindings/c/fdb_c.cpp, fdb_transaction_get_range_impl: iterator mode starts at 4,096
# bytes; small 256, medium 1,000, large 4,096, serial and want_all 80,000; exact:
# the row limit alone).

def test_a_lazy_range_returned_from_a_transactional_function_fails_past_its_first_batch(eng):
    commit_by_other(eng, lambda t: [t.set(eng.k(b"r/%02d" % i), b"x" * 300) for i in range(20)])

    @fdq.transactional
    def lazy(tr, **kw):
        tr[eng.k(b"w")] = b""
        return tr.get_range(eng.k(b"r/"), eng.k(b"r0"), **kw)

    rows = []
    assert code_of(lambda: [rows.append(kv.key) for kv in lazy(eng.db)]) == 2017
    assert 0 < len(rows) < 20           # 6,000 bytes: more than the first 4,096
    assert len(list(lazy(eng.db, limit=5))) == 5       # 1,500 bytes: one batch, no read after
    assert len(list(lazy(eng.db, streaming_mode=StreamingMode.exact, limit=20))) == 20
    assert code_of(lambda: list(lazy(eng.db, streaming_mode=StreamingMode.small))) == 2017
