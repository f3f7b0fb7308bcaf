"""Conformance: FDB's size limits (deferred errors), watches in-process and across
processes, and the outstanding-watch limit (shared/fdb-semantics.md §6, §8)."""
from __future__ import annotations

import time

import pytest

from enginehelpers import code_of, collect, spawn, wait_ready
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
