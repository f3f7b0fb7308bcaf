"""Conformance: FDB's size limits (deferred errors), watches in-process and across
processes, and the outstanding-watch limit (docs/fdb-semantics.md §6, §8)."""
from __future__ import annotations

import gc
import struct
import time

import pytest

from fdq.engine.types import KEY_SIZE_LIMIT, VALUE_SIZE_LIMIT
from enginehelpers import code_of, collect, commit_by_other, spawn, wait_ready
from fdqtest import readline_within


def test_key_and_value_limits_are_deferred(eng):
    tr = eng.db.create_transaction()
    tr[eng.p + b"k" * (10_000 - len(eng.p))] = b"x" * 100_000  # exactly at both limits
    tr.commit().wait()
    # too-large key: set returns at once, the next read raises 2102
    tr = eng.db.create_transaction()
    assert tr.set(eng.p + b"k" * 10_000, b"") is None
    assert code_of(lambda: tr[eng.k(b"other")].wait()) == 2102
    assert code_of(lambda: tr.commit().wait()) == 2102
    # too-large value: 2103 at commit, nothing written
    tr = eng.db.create_transaction()
    tr[eng.k(b"ok")] = b"1"
    tr[eng.k(b"big")] = b"x" * 100_001
    e = None
    try:
        tr.commit().wait()
    except Exception as err:  # noqa: BLE001 - inspected below
        e = err
    assert getattr(e, "code", None) == 2103
    if eng.embedded:
        assert "100,000" in str(e)  # the message names the limit
    assert eng.db[eng.k(b"ok")] is None
    # reading or clearing an oversized key is harmless
    tr = eng.db.create_transaction()
    assert tr[eng.p + b"k" * 20_000] == None  # noqa: E711
    tr.clear(eng.p + b"k" * 20_000)
    tr[eng.k(b"after")] = b""
    tr.commit().wait()


def test_transaction_size_limit(eng):
    tr = eng.db.create_transaction()
    for i in range(101):
        tr[eng.k(b"big/%03d" % i)] = b"x" * 99_000  # ~10.0 MB of values: over 10,000,000 B
    e = None
    try:
        tr.commit().wait()
    except Exception as err:  # noqa: BLE001
        e = err
    assert getattr(e, "code", None) == 2101
    if eng.embedded:
        assert "10,000,000" in str(e)
    assert eng.items() == []
    # just under: commits
    tr = eng.db.create_transaction()
    for i in range(98):
        tr[eng.k(b"big/%03d" % i)] = b"x" * 100_000
    tr.commit().wait()
    # a smaller size_limit, conflict ranges counted
    tr = eng.db.create_transaction()
    tr.options.set_size_limit(1000)
    for i in range(10):
        tr.add_read_conflict_key(eng.k(b"r" * 50 + b"%d" % i))
    tr[eng.k(b"x")] = b""
    assert code_of(lambda: tr.commit().wait()) == 2101


def test_watch_fires_after_a_change_in_process(eng):
    k = eng.k(b"w")
    tr = eng.db.create_transaction()
    tr[k] = b"1"
    tr.commit().wait()
    tr = eng.db.create_transaction()
    f = tr.watch(k)
    tr.commit().wait()
    assert not f.is_ready()
    t2 = eng.db.create_transaction()
    t2[k] = b"2"
    t2.commit().wait()
    assert wait_ready(f)
    assert f.wait() is None
    # set-then-watch in one transaction waits for the next change
    tr = eng.db.create_transaction()
    tr[k] = b"3"
    f = tr.watch(k)
    tr.commit().wait()
    t2 = eng.db.create_transaction()
    t2.clear(k)
    t2.commit().wait()
    assert wait_ready(f)


def test_watch_fires_on_own_write_and_fails_with_its_transaction(eng):
    k = eng.k(b"w")
    tr = eng.db.create_transaction()
    f = tr.watch(k)
    tr[k] = b"changed"  # the transaction's own later change fires it
    assert wait_ready(f, 5) and f.wait() is None
    tr.commit().wait()
    # a failed commit fails the watch with the commit's error
    tr = eng.db.create_transaction()
    tr[eng.k(b"r")].wait()
    f = tr.watch(k)
    tr[eng.k(b"x")] = b""
    other = eng.db.create_transaction()
    other[eng.k(b"r")] = b"1"
    other.commit().wait()
    assert code_of(lambda: tr.commit().wait()) == 1020
    assert wait_ready(f, 5) and code_of(f.wait) == 1020
    # reset before commit -> 1025; cancel -> 1101
    tr = eng.db.create_transaction()
    f = tr.watch(k)
    tr.reset()
    assert wait_ready(f, 5) and code_of(f.wait) == 1025
    tr = eng.db.create_transaction()
    f = tr.watch(k)
    tr.commit().wait()
    f.cancel()
    assert wait_ready(f, 5) and code_of(f.wait) == 1101


def test_dropping_an_uncommitted_transaction_fails_its_watch_at_once(eng):
    # As FDB: a transaction destroyed before its commit cancels its pending watch
    # (1025) when its last reference goes, not at a later pass of the cyclic GC (the
    # embedded engine's transaction referred to itself, and waited for one).
    k = eng.k(b"w")
    tr = eng.db.create_transaction()
    tr[k].wait()
    f = tr.watch(k)
    gc.disable()
    try:
        del tr
        assert wait_ready(f, 5) and code_of(f.wait) == 1025
    finally:
        gc.enable()


def test_too_many_watches(eng):
    eng.db.options.set_max_watches(3)
    try:
        tr = eng.db.create_transaction()
        fs = [tr.watch(eng.k(b"w%d" % i)) for i in range(3)]
        tr.commit().wait()
        tr = eng.db.create_transaction()
        f4 = tr.watch(eng.k(b"w4"))
        tr.commit().wait()
        assert wait_ready(f4, 10) and code_of(f4.wait) == 1032
        fs[0].cancel()  # frees a slot
        tr = eng.db.create_transaction()
        f5 = tr.watch(eng.k(b"w5"))
        tr.commit().wait()
        assert not f5.is_ready()
        for f in fs[1:] + [f5]:
            f.cancel()
    finally:
        eng.db.options.set_max_watches(10_000)


@pytest.mark.slow
def test_watches_fire_across_processes(eng):
    k = eng.k(b"xw")
    # a watch here fires on a commit in another process
    tr = eng.db.create_transaction()
    f = tr.watch(k)
    tr.commit().wait()
    collect(spawn("set", eng.url, key=k.hex(), value=b"from-child".hex()))
    assert wait_ready(f, 20)
    # a watch in another process fires on a commit here
    proc = spawn("watch", eng.url, key=k.hex(), timeout=30)
    assert readline_within(proc, 60, "armed").strip() == "armed"
    t0 = time.monotonic()
    tr = eng.db.create_transaction()
    tr[k] = b"from-parent"
    tr.commit().wait()
    result = collect(proc)
    assert result == {"fired": True, "value": b"from-parent".hex()}
    assert time.monotonic() - t0 < 30


def test_system_keys_need_an_option(eng):
    tr = eng.db.create_transaction()
    assert tr.set(b"\xff/not-mine", b"") is None  # deferred, as every write error
    assert code_of(lambda: tr.commit().wait()) == 2004
    tr = eng.db.create_transaction()
    assert code_of(lambda: tr[b"\xff/x"].wait()) == 2004
    # \xff/metadataVersion is readable without options (None until first bumped)
    tr = eng.db.create_transaction()
    v = tr[b"\xff/metadataVersion"]
    assert v == None or len(v) == 10  # noqa: E711
    # a user range may end exactly at \xff
    list(tr.get_range(eng.p, b"\xff", limit=1))


def test_watches_need_read_your_writes(eng):
    tr = eng.db.create_transaction()
    tr.options.set_read_your_writes_disable()
    f = tr.watch(eng.k(b"w"))
    assert wait_ready(f, 5) and code_of(f.wait) == 1034


def test_versionstamp_operands_metadata_version_and_conflict_range_limits(eng):
    """FDB (ReadYourWrites atomicOp, set, add_*_conflict_range): a versionstamped key's
    size and a versionstamped value's size count their 4-byte offset; the metadata
    version key takes only set_versionstamped_value of 14 zero bytes (else 2000, set
    included); conflict ranges past the legal key space are 2004 at once. The engine
    allowed 4 bytes more, any write of the metadata version key given system-key
    access, and any conflict range."""

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


def test_watch_checks_its_key_as_fdb(eng):
    """FDB's watch(): a key outside the legal range is 2004 (the metadata version key
    excepted), an oversized one 2102. The engine watched them."""

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


# -- §1 options / §6 system keys: READ_SYSTEM_KEYS sets readSystemKeys only;
# ACCESS_SYSTEM_KEYS sets both (RYW setOptionImpl); set/clear/atomicOp check
# getMaxWriteKey(), which is normalKeys.end unless writeSystemKeys.

def test_read_system_keys_does_not_allow_writes(eng):
    tr = eng.db.create_transaction()
    tr.options.set_read_system_keys()
    tr[b"\xff/fdq-test-not-written"].wait()            # reads are allowed
    list(tr.get_range(b"\xff", b"\xff\x00", limit=1))
    tr.set(b"\xff/fdq-test-not-written", b"")
    assert code_of(lambda: tr.commit().wait()) == 2004
    for write in (lambda t: t.clear(b"\xff/fdq-test-not-written"),
                  lambda t: t.clear_range(b"\xff/fdq-test-not-written", b"\xff/fdq-test-not-writteo"),
                  lambda t: t.add(b"\xff/fdq-test-not-written", b"\x01"),
                  lambda t: t.add_write_conflict_key(b"\xff/fdq-test-not-written")):
        tr = eng.db.create_transaction()
        tr.options.set_read_system_keys()
        assert code_of(lambda: (write(tr), tr.commit().wait())) == 2004


def test_a_watch_ignores_other_transactions_until_its_commit(eng):
    """§8: before commit other transactions' changes are ignored; once committed it
    compares with its baseline, so a change made meanwhile fires it at once. A watch
    set after its own write waits for the next change. (With a write, this commit
    would fail: a watch reads its key, §4.)"""
    k = eng.k(b"w")
    tr = eng.db.create_transaction()
    f = tr.watch(k)
    commit_by_other(eng, lambda t: t.set(k, b"theirs"))
    assert not wait_ready(f, 0.3)
    tr.commit().wait()                      # read-only: registered at its read version
    assert wait_ready(f, 20) and f.wait() is None
    tr = eng.db.create_transaction()
    tr[k] = b"mine"
    f = tr.watch(k)
    tr.commit().wait()
    assert not wait_ready(f, 0.3)           # its own value is the baseline
    commit_by_other(eng, lambda t: t.set(k, b"next"))
    assert wait_ready(f, 20) and f.wait() is None


def test_any_own_atomic_op_fires_a_pending_watch(eng):
    """§8: the transaction's own later write fires it; any atomic op counts (RYW
    triggers watches on every atomicOp, whatever the result)."""
    k = eng.k(b"w")
    commit_by_other(eng, lambda t: t.set(k, b"\x00"))
    tr = eng.db.create_transaction()
    f = tr.watch(k)
    tr.add(k, b"\x00")                      # adds zero: same value, still fires
    assert wait_ready(f, 5) and f.wait() is None
