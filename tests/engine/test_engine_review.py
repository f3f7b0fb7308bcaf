"""Cases from an adversarial review of the embedded engine against FDB's semantics
(shared/fdb-semantics.md): each one failed on the engine before its fix."""
from __future__ import annotations

import struct
import time

from enginehelpers import code_of, wait_ready
from fdqtest import read_version, read, readline_within


def _failed_commits(db, code: int, attempts: int, setup):
    """Yields ``(tr, setup(tr, i))`` for each of ``attempts`` transactions whose commit
    failed with ``code`` (fault injection decides; other outcomes are skipped)."""
    for i in range(attempts):
        tr = db.create_transaction()
        got = setup(tr, i)
        try:
            tr.commit().wait()
            continue
        except Exception as e:  # noqa: BLE001 - the engine's error type
            if getattr(e, "code", None) != code:
                continue
        yield tr, got


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


def test_commit_unknown_result_settles_nothing_of_the_attempt(eng):
    """FDB's commit that ends in 1021 is a failed commit for its futures: the
    versionstamp future fails (2020: the stamp is unknown), the watches fail with
    1021 (they were never set up) and get_committed_version() stays -1. The injected
    1021 handed out the real stamp and kept the watches."""
    db = eng.open(eng.fault_url(0.5, 7))
    def setup(tr, i):
        w = tr.watch(eng.k(b"w"))
        tr[eng.k(b"a%d" % i)] = b"1"
        return w, tr.get_versionstamp()
    seen = 0
    for tr, (w, vs) in _failed_commits(db, 1021, 400, setup):
        seen += 1
        assert tr.get_committed_version() == -1
        assert code_of(vs.wait) == 2020
        assert wait_ready(w, 5) and code_of(w.wait) == 1021
        if seen >= 5:
            break
    assert seen >= 5


def _stamped_key(prefix: bytes, tail: bytes = b"") -> bytes:
    return prefix + b"\x00" * 10 + tail + struct.pack("<I", len(prefix))


def test_get_key_across_an_own_versionstamped_key_is_unreadable(eng):
    """A key selector resolved across keys a versionstamped key of the transaction may
    become is accessed_unreadable (1036) in FDB, as a range read there is; the engine
    resolved it past them as if they did not exist."""
    KS = eng.KeySelector
    p = eng.k(b"p/")
    tr = eng.db.create_transaction()
    tr[eng.k(b"a")] = b"1"
    tr[eng.k(b"z")] = b"1"
    tr.commit().wait()
    tr = eng.db.create_transaction()
    tr.set_versionstamped_key(_stamped_key(p), b"v")
    assert code_of(lambda: tr.get_key(KS.first_greater_or_equal(p)).wait()) == 1036
    assert code_of(lambda: tr.get_key(KS.last_less_than(eng.k(b"z"))).wait()) == 1036
    assert code_of(lambda: tr.snapshot.get_key(KS.first_greater_than(eng.k(b"a"))).wait()) == 1036
    # selectors that resolve without crossing them are readable
    assert tr.get_key(KS.first_greater_or_equal(eng.k(b"a"))).wait() == eng.k(b"a")
    assert tr.get_key(KS.last_less_or_equal(eng.k(b"a"))).wait() == eng.k(b"a")
    tr.commit().wait()


def test_a_versionstamped_value_stays_unreadable_and_atomic_ops_apply_on_it(eng):
    """FDB: the key of a versionstamped value is unreadable in its transaction even if
    written again later (set, clear, atomic op); and an atomic op after it applies to
    the stamped value at commit. The engine read the later value, and an atomic op
    replaced the stamped value with the op's result on the stored one."""
    k = eng.k(b"q")
    for later in ("set", "clear", "byte_max"):
        tr = eng.db.create_transaction()
        tr.set_versionstamped_value(k, b"ab" + b"\x00" * 10 + struct.pack("<I", 2))
        if later == "set":
            tr[k] = b"x"
        elif later == "clear":
            tr.clear(k)
        else:
            tr.byte_max(k, b"a")
        assert code_of(lambda: tr[k].wait()) == 1036, later
        assert code_of(lambda: list(tr.get_range(eng.k(b"p"), eng.k(b"r")))) == 1036, later
        tr.reset()
    tr = eng.db.create_transaction()
    tr.set_versionstamped_value(k, b"ab" + b"\x00" * 10 + struct.pack("<I", 2))
    tr.byte_max(k, b"a")      # b"ab" + stamp > b"a": the stamped value stays
    vs = tr.get_versionstamp()
    tr.commit().wait()
    assert eng.db[k] == b"ab" + bytes(vs.wait())
    tr = eng.db.create_transaction()
    tr.set_versionstamped_value(k, b"\x00" * 10 + b"\x01" + struct.pack("<I", 0))
    tr.bit_or(k, b"\x00" * 10 + b"\x02")
    vs = tr.get_versionstamp()
    tr.commit().wait()
    assert eng.db[k] == bytes(vs.wait()) + b"\x03"


def test_versionstamp_operands_metadata_version_and_conflict_range_limits(eng):
    """FDB (ReadYourWrites atomicOp, set, add_*_conflict_range): a versionstamped key's
    size and a versionstamped value's size count their 4-byte offset; the metadata
    version key takes only set_versionstamped_value of 14 zero bytes (else 2000, set
    included); conflict ranges past the legal key space are 2004 at once. The engine
    allowed 4 bytes more, any write of the metadata version key given system-key
    access, and any conflict range."""
    from fdq.engine.sqlite import KEY_SIZE_LIMIT, VALUE_SIZE_LIMIT

    def deferred(write) -> int | None:
        tr = eng.db.create_transaction()
        tr.options.set_access_system_keys()
        write(tr)
        return code_of(lambda: tr.commit().wait())

    p = eng.k(b"v/")
    key = p + b"\x00" * 10 + b"k" * (KEY_SIZE_LIMIT - len(p) - 14) + struct.pack("<I", len(p))
    assert len(key) == KEY_SIZE_LIMIT
    assert deferred(lambda tr: tr.set_versionstamped_key(key, b"")) is None
    longer = key[:-4] + b"k" + key[-4:]
    assert deferred(lambda tr: tr.set_versionstamped_key(longer, b"")) == 2102
    value = b"\x00" * (VALUE_SIZE_LIMIT - 4) + struct.pack("<I", 0)
    assert deferred(lambda tr: tr.set_versionstamped_value(eng.k(b"x"), value)) is None
    longer = b"\x00" + value
    assert deferred(lambda tr: tr.set_versionstamped_value(eng.k(b"x"), longer)) == 2103
    mv = b"\xff/metadataVersion"
    assert deferred(lambda tr: tr.set_versionstamped_value(mv, b"\x00" * 14)) is None
    assert deferred(lambda tr: tr.set_versionstamped_value(mv, b"\x00" * 15 + struct.pack("<I", 0))) == 2000
    assert deferred(lambda tr: tr.set(mv, b"x" * 10)) == 2000
    assert deferred(lambda tr: tr.add(mv, b"\x01")) == 2000
    if eng.embedded:
        tr = eng.db.create_transaction()
        assert code_of(lambda: tr.add_read_conflict_range(b"\xff", b"\xff\x01")) == 2004
        assert code_of(lambda: tr.add_write_conflict_range(eng.k(b"a"), b"\xff\x01")) == 2004
    else:       # FDB's binding: only an inverted range fails at the call; this waits for the commit
        for add in (lambda tr: tr.add_read_conflict_range(b"\xff", b"\xff\x01"),
                    lambda tr: tr.add_write_conflict_range(eng.k(b"a"), b"\xff\x01")):
            tr = eng.db.create_transaction()
            add(tr)
            tr[eng.k(b"w")] = b""
            assert code_of(lambda: tr.commit().wait()) == 2004
    tr = eng.db.create_transaction()
    tr.add_read_conflict_range(eng.k(b"a"), b"\xff")    # ends at exactly \xff: legal
    tr.add_read_conflict_key(mv)                        # the metadata version key: legal


def test_injected_commit_unknown_result_may_or_may_not_have_applied(eng):
    """FDB's 1021 means the commit may or may not have happened. Injected only after a
    real commit, it let code that takes 1021 for "it committed" pass every test."""
    db = eng.open(eng.fault_url(0.3, 5))
    def setup(tr, i):
        tr[eng.k(b"u%04d" % i)] = b"1"
        return eng.k(b"u%04d" % i)
    applied = not_applied = 0
    for _tr, key in _failed_commits(db, 1021, 600, setup):
        if eng.db[key] is None:
            not_applied += 1
        else:
            applied += 1
        if applied >= 3 and not_applied >= 3:
            break
    assert applied >= 3 and not_applied >= 3, (applied, not_applied)


_HOLD_CLOCK_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_timeout_bounds_waiting_for_a_stalled_committer(eng):
    """A process stopped in the middle of a commit (SIGSTOP, a frozen container) holds
    the engine's version clock lock: a transaction with a timeout must still end with
    transaction_timed_out (1031), for its reads and its commit, as FDB's timeout bounds
    every wait of the transaction. The engine waited for the lock without bound."""
    import subprocess
    import sys
    import threading

    if not eng.embedded:
        import pytest
        pytest.skip("the version clock lock is the embedded engine's")
    eng.db[eng.k(b"a")] = b"1"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_CLOCK_LOCK, eng.db.path + "-fdqclock"],
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


def test_watch_checks_its_key_as_fdb(eng):
    """FDB's watch(): a key outside the legal range is 2004 (the metadata version key
    excepted), an oversized one 2102. The engine watched them."""
    from fdq.engine.sqlite import KEY_SIZE_LIMIT

    tr = eng.db.create_transaction()
    w = tr.watch(b"\xff\x01")
    assert wait_ready(w, 5) and code_of(w.wait) == 2004
    tr = eng.db.create_transaction()
    w = tr.watch(eng.k(b"k" * KEY_SIZE_LIMIT))
    assert wait_ready(w, 5) and code_of(w.wait) == 2102
    tr = eng.db.create_transaction()
    w = tr.watch(b"\xff/metadataVersion")
    tr.commit().wait()
    w.cancel()


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
    for tr, key in _failed_commits(db, 1031, 400, setup):
        # as FDB after a timeout: every later use is 1031, on_error included
        assert code_of(lambda: tr.on_error(1031).wait()) == 1031
        assert code_of(lambda: tr[key].wait()) == 1031
        if eng.db[key] is not None:
            applied += 1
            if applied >= 3:
                break
    assert applied >= 3


def test_watches_pending_in_other_transactions_count_toward_the_limit(eng):
    """FDB counts a watch toward max_watches from the call (the RYW layer hands it to
    the native transaction before commit), across every transaction of the Database.
    The engine counted only the calling transaction's own pending watches."""
    eng.db.options.set_max_watches(3)
    try:
        t1 = eng.db.create_transaction()
        w1 = [t1.watch(eng.k(b"w%d" % i)) for i in range(2)]
        t2 = eng.db.create_transaction()
        ok = t2.watch(eng.k(b"x"))
        over = t2.watch(eng.k(b"y"))
        assert wait_ready(over, 5) and code_of(over.wait) == 1032
        assert not ok.is_ready() and not any(w.is_ready() for w in w1)
        t1.reset()          # its watches fail (1025) and stop counting
        t3 = eng.db.create_transaction()
        again = t3.watch(eng.k(b"y"))
        assert not (again.is_ready() and code_of(again.wait) == 1032)
        t2.cancel()
        t3.cancel()
    finally:
        eng.db.options.set_max_watches(10_000)


def test_an_injected_recovery_fails_reads_at_an_older_read_version(eng):
    """A version jump is an FDB recovery: storage moves 100,000,000 versions on, so a
    transaction still reading at a read version from before it fails with
    transaction_too_old (1007) (cached reads aside). The engine let it read on from
    its snapshot for up to 5 s."""
    db = eng.open(eng.fault_url(0.3, 21))
    tr = db.create_transaction()
    tr.snapshot[eng.k(b"a")].wait()
    rv = tr.get_read_version().wait()
    for i in range(3000):
        w = db.create_transaction()
        w[eng.k(b"b")] = b"%d" % i
        try:
            w.commit().wait()
        except Exception:  # noqa: BLE001 - injected errors: go on
            pass
        if read_version(eng.db) > rv + 100_000_000:
            break
    else:
        raise AssertionError("no version jump in 3000 commits")
    assert code_of(lambda: tr[eng.k(b"c")].wait()) == 1007
    assert code_of(lambda: list(tr.snapshot.get_range(eng.k(b""), eng.k(b"\xff")))) == 1007


def test_a_symlinked_path_shares_the_version_clock_lock(eng, tmp_path):
    """SQLite follows a symlink to the database file (one WAL for both names), so the
    engine's version clock lock must too: else a process opening the database by the
    link and one by its real path order nothing between them, and a commit can get a
    version at or below a snapshot that misses it (its conflicts then go unchecked).
    Shown here by a reader by the link that must wait for a lock held by the real path."""
    import os
    import subprocess
    import sys

    import pytest

    if not eng.embedded:
        pytest.skip("the version clock lock is the embedded engine's")
    eng.db[eng.k(b"a")] = b"1"
    link = tmp_path / "link.db"
    os.symlink(eng.db.path, link)
    via_link = eng.open(f"sqlite://{link}")
    assert via_link[eng.k(b"a")] == b"1"    # one database
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_CLOCK_LOCK, eng.db.path + "-fdqclock"],
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
    import os
    import signal
    import subprocess
    import sys

    import pytest

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


def test_metadata_version_reads_the_stamp_of_its_last_bump(eng):
    """FDB: ``\\xff/metadataVersion`` reads as the 10-byte versionstamp of the last bump
    (None if never bumped), and a reader of it conflicts with a bump. The engine never
    stored the bump: it read None forever, so a layer's metadata cache keyed on it would
    never be dropped."""
    mv = b"\xff/metadataVersion"
    before = read(eng.db, mv, snapshot=False)
    reader = eng.db.create_transaction()
    reader[mv].wait()
    reader[eng.k(b"r")] = b"1"
    tr = eng.db.create_transaction()
    tr.set_versionstamped_value(mv, b"\x00" * 14)
    vs = tr.get_versionstamp()
    tr.commit().wait()
    after = read(eng.db, mv, snapshot=False)
    assert after != before
    assert bytes(after) == bytes(vs.wait())
    assert code_of(lambda: reader.commit().wait()) == 1020


def test_fault_injection_fails_reads_too(eng):
    """FDB's reads fail with retryable errors (future_version 1009, process_behind
    1037, ...), not only its commits; injected faults were at commit only, so a read
    outside a retry loop passed every fault-injection test."""
    db = eng.open(eng.fault_url(0.3, 4))
    seen = set()
    for i in range(600):
        tr = db.create_transaction()
        code = code_of(lambda: tr[eng.k(b"a")].wait())
        if code is not None:
            seen.add(code)
            assert tr.on_error(code).wait() is None     # retryable
        if {1009, 1037} <= seen:
            break
    assert {1009, 1037} <= seen, seen
