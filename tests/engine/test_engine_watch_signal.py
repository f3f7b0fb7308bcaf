"""The embedded engine's commit signal: watches sleep until a commit in any process
(inotify on the clock file, written after every commit) instead of polling every
millisecond, and still fire by polling when the signal is unavailable or not sent.

Each test makes the poll that would otherwise find the change far slower than the test's
bound, so it fails if the path under test does not work."""
from __future__ import annotations

import gc
import os
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

import fdq
from fdq.engine.sqlite import watches

from enginehelpers import collect, spawn, wait_ready
from fdqtest import readline_within

SLOW_POLL_S = 60.0   # a poll this slow cannot be what fired a watch within FIRE_BOUND_S
FIRE_BOUND_S = 20.0


@pytest.fixture
def embedded(eng):
    if not eng.embedded:
        pytest.skip("the embedded engine's own wake mechanism")
    return eng


@pytest.fixture
def signals(embedded, monkeypatch):
    """The commit signal works here, and the fallback poll is too slow to be what fired a
    watch within FIRE_BOUND_S: the path under test did."""
    monkeypatch.setattr(watches, "WATCH_FALLBACK_POLL_S", SLOW_POLL_S)
    if not _signal_works(embedded.db):
        pytest.skip("no inotify here")


def _watch(db, key):
    tr = db.create_transaction()
    f = tr.watch(key)
    tr.commit().wait()
    return f


def _set(db, key, value):
    tr = db.create_transaction()
    tr[key] = value
    tr.commit().wait()


def _signal_works(db) -> bool:
    db._get_store()     # creates the clock file
    s = watches._CommitSignal.open(db.path + "-fdqclock")
    if s is None:
        return False
    s.close()
    return True


@pytest.mark.usefixtures("signals")
def test_a_commit_of_another_database_object_wakes_a_watch_by_signal(embedded):
    other = fdq.connect(embedded.url, check_format=False)   # own store: no in-process kick
    k = embedded.k(b"sig")
    f = _watch(embedded.db, k)
    mgr = embedded.db._watches
    deadline = time.monotonic() + FIRE_BOUND_S
    while mgr.kick and time.monotonic() < deadline:    # the registration's check is taken
        time.sleep(0.001)
    assert not f.is_ready()
    t0 = time.monotonic()
    _set(other, k, b"1")
    assert wait_ready(f, FIRE_BOUND_S)
    assert time.monotonic() - t0 < FIRE_BOUND_S


@pytest.mark.slow
@pytest.mark.usefixtures("signals")
def test_a_commit_in_another_process_wakes_a_watch_by_signal(embedded):
    k = embedded.k(b"xsig")
    for i in range(3):      # and again: the thread sleeps on the signal between them
        f = _watch(embedded.db, k)
        collect(spawn("set", embedded.url, key=k.hex(), value=(b"v%d" % i).hex()))
        assert wait_ready(f, FIRE_BOUND_S)
        assert embedded.db[k] == b"v%d" % i


@pytest.mark.slow
def test_without_inotify_a_watch_still_fires_across_processes(embedded, monkeypatch):
    monkeypatch.setenv("FDQ_ENGINE_NO_INOTIFY", "1")        # forced fallback: the 1 ms poll
    monkeypatch.setattr(watches, "WATCH_FALLBACK_POLL_S", SLOW_POLL_S)
    assert watches._CommitSignal.open(embedded.db.path + "-fdqclock") is None
    k = embedded.k(b"nosig")
    f = _watch(embedded.db, k)
    collect(spawn("set", embedded.url, key=k.hex(), value=b"x".hex()))
    assert wait_ready(f, FIRE_BOUND_S)


_SILENT_WRITER = """
import sys
import fdq
from fdq.engine.sqlite import store
store._Store.signal_commit = lambda self: None    # a writer that sends no commit signal
db = fdq.connect(sys.argv[1], check_format=False)
tr = db.create_transaction()
tr[bytes.fromhex(sys.argv[2])] = b"silent"
tr.commit().wait()
"""


@pytest.mark.slow
def test_a_commit_without_a_signal_is_found_by_the_fallback_poll(embedded, monkeypatch):
    monkeypatch.setattr(watches, "WATCH_FALLBACK_POLL_S", 0.2)
    k = embedded.k(b"silent")
    f = _watch(embedded.db, k)
    subprocess.run([sys.executable, "-c", _SILENT_WRITER, embedded.url, k.hex()], check=True, timeout=60)
    assert wait_ready(f, FIRE_BOUND_S)
    assert embedded.db[k] == b"silent"


def test_the_signal_reports_a_watched_file_gone(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"")
    s = watches._CommitSignal.open(str(path))
    if s is None:
        pytest.skip("no inotify here")
    try:
        assert s.drain()        # nothing pending
        with open(path, "r+b") as fh:
            fh.write(b"\0")
        assert s.drain()        # a write: an event, the watch intact
        os.unlink(path)
        deadline = time.monotonic() + FIRE_BOUND_S
        gone = False
        while not gone and time.monotonic() < deadline:
            gone = not s.drain()
            time.sleep(0.01)
        assert gone, "deleting the watched file was not reported"
    finally:
        s.close()


def _settled(mgr, after: int = -1):
    """Until the watch thread sleeps on the signal with nothing left to check, its last
    check newer than version ``after`` (a commit it has checked)."""
    deadline = time.monotonic() + FIRE_BOUND_S
    while time.monotonic() < deadline:
        with mgr.cond:
            if mgr.sleeping and not mgr.kick and not mgr.checking and mgr.checked_version is not None \
                    and mgr.checked_version > after:
                return
        time.sleep(0.001)
    raise AssertionError("the watch thread did not settle" + (f" after version {after}" if after >= 0 else ""))


@pytest.mark.slow
@pytest.mark.usefixtures("signals")
def test_a_watch_whose_snapshot_missed_a_checked_commit_fires(embedded):
    """A transaction reads a key; another process commits a change to it, which the
    sleeping watch thread checks (the key not yet watched: that commit's signal is
    consumed); then the watch is registered with the stale baseline and no signal is
    still to come. The registration must make the thread check it (the thread's last
    check is newer than the watch's snapshot)."""
    keep = _watch(embedded.db, embedded.k(b"keep"))    # keeps the thread and its checks
    mgr = embedded.db._watches
    k = embedded.k(b"stale")
    for i in range(5):
        _settled(mgr)
        tr = embedded.db.create_transaction()
        tr[k]       # opens the snapshot: the baseline
        collect(spawn("set", embedded.url, key=k.hex(), value=(b"v%d" % i).hex()))
        _settled(mgr, after=tr._rv)     # the thread checks that commit
        f = tr.watch(k)
        tr.commit().wait()
        assert wait_ready(f, FIRE_BOUND_S), i
    assert not keep.is_ready()


@pytest.mark.parametrize("where", ["other database", "this database", "other process"])
@pytest.mark.usefixtures("signals")
def test_a_watch_registered_without_a_check_fires_on_the_next_commit(embedded, where):
    """The registration asked for no check (the key's value in the thread's last check
    is the watch's baseline; the first watch of a key asks for one, the thread has no
    value for it yet): the next commit that changes the key fires it by its signal,
    whether it comes from another Database, another process, or this Database (whose
    own commits no longer kick the thread while the signal works)."""
    other = fdq.connect(embedded.url, check_format=False)
    keep = _watch(embedded.db, embedded.k(b"keep"))
    mgr = embedded.db._watches
    k = embedded.k(b"later")
    for i in range(3):
        _settled(mgr)
        f = _watch(embedded.db, k)
        with mgr.cond:
            assert not mgr.kick or not i    # no check asked for: the path under test
        value = b"v%d" % i
        if where == "other process":
            collect(spawn("set", embedded.url, key=k.hex(), value=value.hex()))
        else:
            _set(other if where == "other database" else embedded.db, k, value)
        assert wait_ready(f, FIRE_BOUND_S), i
    assert not keep.is_ready()




class _GatedConnection(sqlite3.Connection):
    """A real connection whose watch checks can be held at their start (test hook):
    the thread has then taken its keys and consumed the signals that woke it."""
    gate = None     # (entered, release) events while armed

    def execute(self, sql, *args):
        gate = _GatedConnection.gate
        if gate is not None and sql.startswith(watches._WATCH_CHECK):
            _GatedConnection.gate = None
            gate[0].set()
            gate[1].wait(FIRE_BOUND_S)
        return super().execute(sql, *args)


@pytest.mark.slow
@pytest.mark.usefixtures("signals")
def test_a_watch_registered_during_a_check_that_consumed_its_commit_fires(embedded, monkeypatch):
    """A transaction reads a key; another process commits a change to it; the watch
    thread wakes on that commit's signal and is held inside its check (keys taken, the
    signal consumed); the watch is registered then. The check's end must ask for
    another check: no signal is still to come for that commit."""
    real_connect = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect",
                        lambda *a, **kw: real_connect(*a, factory=_GatedConnection, **kw))
    keep = _watch(embedded.db, embedded.k(b"keep"))    # starts the thread (gated connection)
    mgr = embedded.db._watches
    k = embedded.k(b"held")
    try:
        for i in range(3):
            _settled(mgr)
            tr = embedded.db.create_transaction()
            tr[k]       # the baseline's snapshot
            entered, release = threading.Event(), threading.Event()
            _GatedConnection.gate = (entered, release)
            collect(spawn("set", embedded.url, key=k.hex(), value=(b"v%d" % i).hex()))
            assert entered.wait(FIRE_BOUND_S)
            with mgr.cond:
                assert mgr.checking
            f = tr.watch(k)
            tr.commit().wait()
            release.set()
            assert wait_ready(f, FIRE_BOUND_S), i
    finally:
        _GatedConnection.gate = None
    assert not keep.is_ready()


@pytest.mark.usefixtures("signals")
def test_a_watch_registered_while_the_thread_lingers_fires_on_the_next_commit(embedded, monkeypatch):
    """With no watch left the thread waits (lingers) on its condition, not on signals;
    a registration that needs no check must still wake it to sleep on them again. The
    writes come from another process: the thread's check fires the watch, then finds no
    watch left (a commit of this process fires it without waking the thread)."""
    monkeypatch.setattr(watches, "WATCH_LINGER_S", SLOW_POLL_S)
    mgr = embedded.db._watch_manager()
    k = embedded.k(b"linger")
    for i in range(3):
        f = _watch(embedded.db, k)
        if i:
            with mgr.cond:
                assert not mgr.kick     # registered while lingering: no check asked for
        collect(spawn("set", embedded.url, key=k.hex(), value=(b"v%d" % i).hex()))
        assert wait_ready(f, FIRE_BOUND_S), i
        deadline = time.monotonic() + FIRE_BOUND_S
        while time.monotonic() < deadline:      # the thread lingers, no watch left
            with mgr.cond:
                if mgr.lingering:
                    break
            time.sleep(0.001)
        else:
            raise AssertionError("the watch thread did not linger")


@pytest.mark.usefixtures("signals")
def test_a_watch_whose_snapshot_missed_an_unsignalled_own_commit_fires(embedded):
    """A commit of this process sends no signal when no other process watches, and
    fires only the watches of the keys it wrote. A watch whose baseline missed such a
    commit (the key not yet watched then) must still be checked."""
    keep = _watch(embedded.db, embedded.k(b"keep"))
    mgr = embedded.db._watches
    k = embedded.k(b"own")
    for i, writer in enumerate([embedded.db, fdq.connect(embedded.url, check_format=False)] * 2):
        _settled(mgr)
        tr = embedded.db.create_transaction()
        tr[k]       # the baseline's snapshot
        _set(writer, k, b"v%d" % i)     # no signal, no kick: the key is not watched yet
        f = tr.watch(k)
        tr.commit().wait()
        assert wait_ready(f, FIRE_BOUND_S), i
    assert not keep.is_ready()


@pytest.mark.usefixtures("signals")
def test_a_commit_of_this_process_fires_the_watches_of_its_keys_before_it_returns(embedded):
    """A commit fires this process's watches on the keys it wrote itself, in the
    committing thread: no wake-up of the watch thread and no check between a push and
    the consumer of the same process. Watches on other keys stay."""
    keep = _watch(embedded.db, embedded.k(b"keep"))
    mgr = embedded.db._watches
    k = embedded.k(b"pushed")
    tr = embedded.db.create_transaction()
    tr.add(k, (1).to_bytes(8, "little"))
    tr.commit().wait()
    for i in range(3):
        f = _watch(embedded.db, k)
        _settled(mgr)                   # the check its registration may have asked for
        checked = mgr.checked_version
        tr = embedded.db.create_transaction()
        tr.options.set_next_write_no_write_conflict_range()      # as a push adds to ``routed``
        tr.add(k, (1).to_bytes(8, "little"))
        tr.commit().wait()
        assert f.is_ready(), i
        f.wait()
        with mgr.cond:
            assert mgr.checked_version == checked and not mgr.kick, i
    assert not keep.is_ready()


@pytest.mark.usefixtures("signals")
def test_a_watch_set_by_a_writing_transaction_fires_for_an_own_conflict_free_write_it_missed(embedded):
    """A transaction reads a key for its watch; a commit of this process adds to the key
    without a write conflict range (a push's ``routed``), so the watching transaction,
    which writes elsewhere, commits after it. Its baseline missed that add, which fired
    no watch (none was registered yet): the registration must ask for a check, judged by
    the baseline's read version, not the later commit version."""
    keep = _watch(embedded.db, embedded.k(b"keep"))
    mgr = embedded.db._watches
    k = embedded.k(b"routed")
    for i in range(3):
        _settled(mgr)
        tr = embedded.db.create_transaction()
        f = tr.watch(k)                     # the baseline, at tr's read version
        tr[embedded.k(b"lease")] = b"%d" % i
        add = embedded.db.create_transaction()
        add.options.set_next_write_no_write_conflict_range()
        add.add(k, (1).to_bytes(8, "little"))
        add.commit().wait()
        tr.commit().wait()                  # no conflict: the add wrote no conflict range
        assert wait_ready(f, FIRE_BOUND_S), i
    assert not keep.is_ready()


def _many_watched(embedded, n=300):
    """``n`` keys (over 256: a commit's clear ranges are not searched for them, a search
    per key and commit), set, each watched; the thread settled on them."""
    keys = [embedded.k(b"many/%03d" % i) for i in range(n)]
    tr = embedded.db.create_transaction()
    for k in keys:
        tr[k] = b"v"
    tr.commit().wait()
    fs = [_watch(embedded.db, k) for k in keys]
    _settled(embedded.db._watches)
    return keys, fs


@pytest.mark.usefixtures("signals")
def test_an_own_clear_range_over_many_watched_keys_fires_the_cleared_ones(embedded):
    """A commit whose clear ranges were not searched for the watched keys asks the
    thread to check them all: the cleared ones fire, the others stay."""
    keys, fs = _many_watched(embedded)
    tr = embedded.db.create_transaction()
    tr.clear_range(keys[5], keys[8])    # keys 5, 6 and 7
    tr.commit().wait()
    for i in (5, 6, 7):
        assert wait_ready(fs[i], FIRE_BOUND_S), i
    assert not any(fs[i].is_ready() for i in range(len(keys)) if i not in (5, 6, 7))


@pytest.mark.usefixtures("signals")
def test_a_watch_whose_baseline_missed_an_own_clear_over_many_checked_keys_fires(embedded):
    """After an own unsignalled commit whose clear ranges were not searched for the keys
    of the thread's last check, any new watch is checked: its baseline may be older than
    the clear, and no signal is to come for it. Here the key was last written by an own
    commit the baseline did see, which alone would let the registration skip the check."""
    keys, fs = _many_watched(embedded)
    tr = embedded.db.create_transaction()
    for k in keys:
        tr[k] = b"w"
    tr.commit().wait()                  # fires every watch, in this thread
    assert all(f.is_ready() for f in fs)
    late = embedded.db.create_transaction()
    late[keys[7]]                       # the late watch's baseline: b"w", before the clear
    tr = embedded.db.create_transaction()
    tr.clear_range(keys[5], keys[8])
    tr.commit().wait()
    f = late.watch(keys[7])
    late.commit().wait()
    assert wait_ready(f, FIRE_BOUND_S)


@pytest.mark.usefixtures("signals")
def test_an_own_commit_of_unwatched_keys_does_not_wake_the_thread(embedded):
    keep = _watch(embedded.db, embedded.k(b"keep"))
    mgr = embedded.db._watches
    _settled(mgr)
    checked = mgr.checked_version
    for i in range(5):
        _set(embedded.db, embedded.k(b"elsewhere"), b"%d" % i)
        with mgr.cond:
            assert not mgr.kick
    time.sleep(0.2)     # a wake, had there been one, would have checked by now
    with mgr.cond:
        assert mgr.checked_version == checked and not mgr.kick
    _set(embedded.db, embedded.k(b"keep"), b"x")   # one that writes a watched key does
    assert wait_ready(keep, FIRE_BOUND_S)


@pytest.mark.slow
@pytest.mark.parametrize("watch_here", [False, True])
def test_a_watch_in_another_process_is_woken_by_this_ones_commit(embedded, monkeypatch, watch_here):
    """The other process holds its watcher lock: this process's commits signal it
    (whether or not this process watches too, which it must not mistake for it)."""
    if not _signal_works(embedded.db):
        pytest.skip("no inotify here")
    k = embedded.k(b"theirs")
    keep = _watch(embedded.db, embedded.k(b"keep")) if watch_here else None
    for i in range(3):
        proc = spawn("watch", embedded.url, key=k.hex(), timeout=FIRE_BOUND_S, fallback_poll_s=SLOW_POLL_S)
        assert readline_within(proc, 60, "armed").strip() == "armed"
        _set(embedded.db, k, b"v%d" % i)
        assert collect(proc) == {"fired": True, "value": (b"v%d" % i).hex()}, i
    assert keep is None or not keep.is_ready()


@pytest.mark.usefixtures("signals")
def test_connections_coming_and_going_beside_a_watch_keep_its_process_signalled(embedded):
    """A process's watch thread announces itself to other processes' commits by a POSIX
    lock on the database's watcher file, which closing any descriptor the process has of
    that file drops. Connections opened and dropped beside it (each probing that file,
    their descriptors closed as they go) must leave it held: another process's commit
    still wakes the watch by signal, not by the (slow) poll."""
    k = embedded.k(b"theirs")
    f = _watch(embedded.db, k)
    _settled(embedded.db._watches)      # its thread holds the lock
    for i in range(5):
        other = fdq.connect(embedded.url, check_format=False)
        _set(other, embedded.k(b"beside"), b"%d" % i)
        del other
        gc.collect()
    collect(spawn("set", embedded.url, key=k.hex(), value=b"x".hex()))
    assert wait_ready(f, FIRE_BOUND_S)


# A write without a write conflict range from another process (a push's add to the
# ``routed`` counter a consumer watches).
_CONFLICT_FREE_SET = """
import sys, fdq
db = fdq.connect(sys.argv[1], check_format=False)
tr = db.create_transaction()
tr.options.set_next_write_no_write_conflict_range()
tr[bytes.fromhex(sys.argv[2])] = bytes.fromhex(sys.argv[3])
tr.commit().wait()
"""


@pytest.mark.slow
@pytest.mark.usefixtures("signals")
def test_a_watch_set_by_a_writing_transaction_fires_for_a_conflict_free_write_it_missed(embedded):
    """Another process writes the watched key without a write conflict range after the
    transaction's read version, and the watch thread checks that commit (its signal
    consumed); the transaction, which writes, commits (no conflict) and its watch is
    registered, after that check, with the older baseline. It must fire: no
    signal is still to come for that write (a consumer's lease round watching the
    ``routed`` counter a push adds to so)."""
    keep = _watch(embedded.db, embedded.k(b"keep"))
    mgr = embedded.db._watches
    k = embedded.k(b"counter")
    first = _watch(embedded.db, k)      # the thread knows the key's value, as a consumer's
    _set(embedded.db, k, b"v")
    assert wait_ready(first, FIRE_BOUND_S)
    for i in range(3):
        _settled(mgr)
        tr = embedded.db.create_transaction()
        f = tr.watch(k)
        tr[embedded.k(b"lease")] = b"%d" % i
        subprocess.run([sys.executable, "-c", _CONFLICT_FREE_SET, embedded.url, k.hex(), (b"p%d" % i).hex()],
                       check=True, timeout=60)
        _settled(mgr, after=tr._rv)     # the thread checks that commit
        tr.commit().wait()      # no conflict: the write took no conflict range
        assert wait_ready(f, FIRE_BOUND_S), i
    assert not keep.is_ready()


@pytest.mark.usefixtures("signals")
def test_a_watch_set_by_a_writing_transaction_costs_the_thread_no_check(embedded):
    """A consumer's lease round sets its watches in its writing transaction: a key the
    thread checked lately whose value there is the watch's baseline costs no check (the
    first watch of a key does: the thread has no value for it yet). Its own commit (no
    signal, no watched key written) must not make the thread check it again: that was a
    wake per round."""
    keep = _watch(embedded.db, embedded.k(b"keep"))
    mgr = embedded.db._watches
    k = embedded.k(b"watched")
    first = _watch(embedded.db, k)     # the thread's first value for the key
    _set(embedded.db, k, b"first")
    assert wait_ready(first, FIRE_BOUND_S)
    for i in range(3):
        _settled(mgr)
        checked = mgr.checked_version
        tr = embedded.db.create_transaction()
        f = tr.watch(k)
        tr[embedded.k(b"elsewhere")] = b"%d" % i
        tr.commit().wait()
        with mgr.cond:
            assert not mgr.kick, i
        time.sleep(0.2)     # a wake, had there been one, would have checked by now
        with mgr.cond:
            assert mgr.checked_version == checked and not mgr.kick, i
        _set(embedded.db, k, b"v%d" % i)    # and it fires on a change
        assert wait_ready(f, FIRE_BOUND_S), i
    assert not keep.is_ready()
