"""Conformance: versions, versionstamps, the 5-second rule (docs/fdb-semantics.md §3, §5)."""
from __future__ import annotations

import json
import struct
import threading
import time

import fdb.tuple
import pytest

import fdq
from enginehelpers import code_of, collect, commit_by_other, spawn, started
from fdqtest import read, read_version


def commit_one(eng, key=b"x", value=b""):
    tr = eng.db.create_transaction()
    tr[eng.k(key)] = value
    vs = tr.get_versionstamp()
    tr.commit().wait()
    return tr, vs


def test_versions_increase_and_stamps_are_fdb_form(eng):
    t0 = eng.db.create_transaction()
    rv0 = t0.get_read_version().wait()
    tr = eng.db.create_transaction()
    tr[eng.k(b"a")] = b""
    assert tr.get_committed_version() == -1  # none yet: -1, not an error
    vs = tr.get_versionstamp()
    assert not vs.is_ready()  # resolves only after the commit
    tr.commit().wait()
    cv = tr.get_committed_version()
    assert cv > rv0
    stamp = bytes(vs.wait())
    assert len(stamp) == 10 and stamp[:8] == cv.to_bytes(8, "big")
    # each later read version sees it; each later commit is above it
    t2 = eng.db.create_transaction()
    assert t2.get_read_version().wait() >= cv
    tr2, vs2 = commit_one(eng, b"b")
    assert tr2.get_committed_version() > cv and bytes(vs2.wait()) > stamp
    # read-only: no commit version, no stamp
    ro = eng.db.create_transaction()
    ro[eng.k(b"a")].wait()
    rvs = ro.get_versionstamp()
    ro.commit().wait()
    assert ro.get_committed_version() == -1
    assert code_of(lambda: rvs.wait()) == 2021
    # the stamp must be asked for before commit(): afterwards it is used_during_commit
    assert code_of(lambda: tr.get_versionstamp().wait()) == 2017
    assert bytes(vs.wait()) == stamp  # the future asked for in time stays valid


def test_versions_advance_about_a_million_per_second(eng):
    rv1 = read_version(eng.db)
    start = time.monotonic()
    while time.monotonic() - start < 0.5:
        time.sleep(0.05)
    rv2 = read_version(eng.db)
    elapsed = time.monotonic() - start
    # generous bounds: the machine is shared and loaded
    assert 0.3e6 <= rv2 - rv1 <= (elapsed + 3) * 1e6


def test_embedded_versions_start_at_an_arbitrary_value(eng, tmp_path):
    if not eng.embedded:
        pytest.skip("a cluster's start version is not the test's to choose")
    starts = set()
    for i in range(3):
        db = fdq.connect(f"sqlite://{tmp_path / f'fresh{i}.db'}", check_format=False)
        starts.add(read_version(db))
    assert len(starts) == 3  # random per database, not a clock reading


def test_versionstamped_key_and_value_with_the_tuple_layer(eng):
    p = eng.k(b"vs/")
    tr = eng.db.create_transaction()
    key = fdb.tuple.pack_with_versionstamp(("log", fdb.tuple.Versionstamp(user_version=7)), prefix=p)
    assert key[-4:] == struct.pack("<I", len(p) + len(fdb.tuple.pack(("log",))) + 1)
    tr.set_versionstamped_key(key, b"payload")
    val = b"pre" + b"\x00" * 10 + b"post" + struct.pack("<I", 3)
    tr.set_versionstamped_value(eng.k(b"vv"), val)
    vs = tr.get_versionstamp()
    tr.commit().wait()
    stamp = bytes(vs.wait())
    rows = [(kv.key, kv.value) for kv in eng.db.create_transaction().get_range_startswith(p)]
    assert len(rows) == 1 and rows[0][1] == b"payload"
    name, v = fdb.tuple.unpack(rows[0][0][len(p):])
    assert name == "log" and v.is_complete() and v.tr_version == stamp and v.user_version == 7
    assert rows[0][0] == p + fdb.tuple.pack(("log", fdb.tuple.Versionstamp(stamp, 7)))
    assert eng.db[eng.k(b"vv")] == b"pre" + stamp + b"post"
    # incomplete stamps sort after complete ones; pack() refuses them
    assert fdb.tuple.pack((fdb.tuple.Versionstamp(stamp),)) < fdb.tuple.pack_with_versionstamp(
        (fdb.tuple.Versionstamp(),))[:-4]
    with pytest.raises(ValueError):
        fdb.tuple.pack((fdb.tuple.Versionstamp(),))


def test_own_versionstamped_writes_are_unreadable(eng):
    p = eng.k(b"vs/")
    tr = eng.db.create_transaction()
    tr[eng.k(b"plain")] = b"1"
    tr.set_versionstamped_key(fdb.tuple.pack_with_versionstamp((fdb.tuple.Versionstamp(),), prefix=p), b"v")
    tr.set_versionstamped_value(eng.k(b"vv"), b"\x00" * 10 + struct.pack("<I", 0))
    assert code_of(lambda: list(tr.get_range_startswith(p))) == 1036
    assert code_of(lambda: list(tr.snapshot.get_range_startswith(p))) == 1036
    assert code_of(lambda: list(tr.get_range(eng.p, eng.end()))) == 1036  # a range crossing it
    assert code_of(lambda: tr[eng.k(b"vv")].wait()) == 1036
    assert tr[eng.k(b"plain")] == b"1"  # outside the unreadable keys: fine
    tr.commit().wait()
    assert len(list(eng.db.create_transaction().get_range_startswith(p))) == 1


def test_mutations_apply_in_order_around_a_versionstamped_key(eng):
    p = eng.k(b"vs/")

    def vs_key(n):
        return fdb.tuple.pack_with_versionstamp((fdb.tuple.Versionstamp(), n), prefix=p)

    tr = eng.db.create_transaction()
    tr.set_versionstamped_key(vs_key(1), b"cleared later")
    tr.clear_range(p, p + b"\xff")  # issued after: removes it, as FDB applies mutations in order
    tr.set_versionstamped_key(vs_key(2), b"kept")
    tr.commit().wait()
    assert [kv.value for kv in eng.db.create_transaction().get_range_startswith(p)] == [b"kept"]


def test_bad_versionstamp_offset_is_deferred_to_commit(eng):
    tr = eng.db.create_transaction()
    assert tr.set_versionstamped_key(eng.k(b"abc") + struct.pack("<I", 100), b"v") is None
    assert code_of(lambda: tr.commit().wait()) == 2000


@pytest.mark.slow
def test_versionstamps_order_commits_across_processes(eng):
    p = eng.k(b"vsp/")
    workers, n = 4, 25
    procs = [spawn("vstamp", eng.url, prefix=p.hex(), worker=w, n=n) for w in range(workers)]
    stamps = {w: collect(procs[w])["stamps"] for w in range(workers)}
    rows = [(kv.key, kv.value) for kv in eng.db.create_transaction().get_range_startswith(p)]
    assert len(rows) == workers * n
    reported = sorted(s for w in stamps for s in stamps[w])
    assert len(set(reported)) == workers * n  # unique
    stored = [fdb.tuple.unpack(k[len(p):])[0].tr_version.hex() for k, _ in rows]
    assert stored == reported  # key order = stamp order, and each stamp is get_versionstamp's
    for w in range(workers):  # each process's commits in its own order
        seq = [json.loads(v)[1] for _k, v in rows if json.loads(v)[0] == w]
        assert seq == list(range(n))


def test_transaction_too_old_after_5_seconds(eng):
    """The suite's only real 5-second wait: everything that needs an old read version
    shares it."""
    k = eng.k(b"k")
    tr = eng.db.create_transaction()
    tr[k] = b"v"
    for i in range(2000):
        tr[eng.k(b"r/%04d" % i)] = b"x" * 20
    tr.commit().wait()
    # a range iteration that spans the 5 s fails too, snapshot or not
    scans = [eng.db.create_transaction().get_range_startswith(eng.k(b"r/")),
             eng.db.create_transaction().snapshot.get_range_startswith(eng.k(b"r/"))]
    iters = [iter(r) for r in scans]
    assert [next(it).key for it in iters] == [eng.k(b"r/0000")] * 2
    reader = eng.db.create_transaction()
    assert reader[k] == b"v"
    reader[eng.k(b"w")] = b"1"
    blind = eng.db.create_transaction()
    blind.get_read_version().wait()
    blind[eng.k(b"blind")] = b"1"
    read_only = eng.db.create_transaction()
    read_only[k].wait()
    # fdq.transactional retries a 1007 with a new read version
    release, attempts, outcome = threading.Event(), [], []

    @fdq.transactional
    def slow(tr):
        attempts.append(1)
        tr[k].wait()
        if len(attempts) == 1:
            release.wait(30)
        tr[eng.k(b"other")].wait()
        tr[eng.k(b"slow")] = b"done"
        return len(attempts)

    th = threading.Thread(target=lambda: outcome.append(slow(eng.db)))
    th.start()
    deadline = time.monotonic() + 5.6
    while time.monotonic() < deadline:
        time.sleep(0.1)
    release.set()
    for it in iters:
        assert code_of(lambda: list(it)) == 1007
    # a key the transaction read already comes from its cache: no storage read, no 1007
    # (RYW's SnapshotCache answers it; cached reads do not fail, fdb-semantics §5)
    assert reader[k] == b"v" and read_only[k] == b"v"
    assert code_of(lambda: reader[eng.k(b"other")].wait()) == 1007
    assert code_of(lambda: reader.commit().wait()) == 1007
    assert code_of(lambda: blind.commit().wait()) is None  # blind writes are exempt
    assert code_of(lambda: read_only.commit().wait()) is None  # read-only: nothing to check
    reader.on_error(1007).wait()
    assert reader[k] == b"v"  # a new read version
    reader.commit().wait()
    th.join(30)
    assert outcome == [2] and eng.db[eng.k(b"slow")] == b"done"


def test_versionstamped_keys_conflict_with_readers_of_their_keys_only(eng):
    """The commit's write conflicts cover every stamped key it wrote (a reader of a range
    holding them fails) and nothing another transaction could have written next to
    them: a reader of the keys beside them (after every stamp, or before) commits."""
    p = eng.k(b"vs/")

    def vs_key(n, prefix=p):
        return fdb.tuple.pack_with_versionstamp((fdb.tuple.Versionstamp(user_version=n),), prefix=prefix)

    eng.db[eng.k(b"vs/", fdb.tuple.pack(("after",)))] = b"x"
    eng.db[eng.k(b"vs/", fdb.tuple.pack((0,)))] = b"x"
    readers = {name: eng.db.create_transaction() for name in ("all", "after", "before", "other")}
    list(readers["all"].get_range_startswith(p))
    list(readers["after"].get_range(p + b"\x34", p + b"\xff"))       # past every versionstamp (0x33)
    list(readers["before"].get_range(p, p + b"\x33"))                # before every versionstamp
    list(readers["other"].get_range_startswith(eng.k(b"vt/")))
    for tr in readers.values():
        tr[eng.k(b"out/", id(tr).to_bytes(8, "big"))] = b"1"
    tr = eng.db.create_transaction()
    for n in (5, 1, 300, 2):                                          # two prefixes, out of order
        tr.set_versionstamped_key(vs_key(n), b"v")
        tr.set_versionstamped_key(vs_key(n, prefix=eng.k(b"vt/")), b"v")
    tr.commit().wait()
    assert code_of(lambda: readers["all"].commit().wait()) == 1020
    assert code_of(lambda: readers["other"].commit().wait()) == 1020
    readers["after"].commit().wait()
    readers["before"].commit().wait()


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


# -- §1 snapshot RYW: with snapshot RYW disabled (disables outnumber enables) snapshot
# reads go straight to the database (RYWImpl::read with snapshot and
# snapshotRywEnabled <= 0: no write map), for get, get_key and get_range alike, and
# so never meet this transaction's unreadable versionstamped keys (§3). The database
# option sets the default (ReadYourWritesTransactionOptions::reset copies
# DatabaseContext::snapshotRywEnabled).

def test_snapshot_reads_with_snapshot_ryw_disabled_ignore_own_versionstamped_keys(eng):
    tr = eng.db.create_transaction()
    tr.get_read_version().wait()
    tr.set_versionstamped_key(fdb.tuple.pack_with_versionstamp((fdb.tuple.Versionstamp(),), prefix=eng.k(b"v")), b"x")
    assert code_of(lambda: list(tr.snapshot.get_range(eng.p, eng.end()))) == 1036
    tr.options.set_snapshot_ryw_disable()
    assert list(tr.snapshot.get_range(eng.p, eng.end())) == []
    assert code_of(lambda: list(tr.get_range(eng.p, eng.end()))) == 1036


def test_committed_version_is_minus_one_after_a_failed_commit(eng):
    """§1: get_committed_version() is -1 unless the last commit succeeded with writes."""
    tr = started(eng)
    tr[eng.k(b"a")].wait()
    tr[eng.k(b"w")] = b""
    commit_by_other(eng, lambda t: t.set(eng.k(b"a"), b"1"))
    assert code_of(lambda: tr.commit().wait()) == 1020
    assert tr.get_committed_version() == -1
    tr.reset()
    tr[eng.k(b"w")] = b""
    tr.commit().wait()
    assert tr.get_committed_version() > 0
