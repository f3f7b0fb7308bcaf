"""Cases from an adversarial review of the embedded engine against FDB's semantics
(shared/fdb-semantics.md): each one failed on the engine before its fix."""
from __future__ import annotations

import struct
import time

from enginehelpers import code_of, wait_ready


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
    seen = 0
    for i in range(400):
        tr = db.create_transaction()
        w = tr.watch(eng.k(b"w"))
        tr[eng.k(b"a%d" % i)] = b"1"
        vs = tr.get_versionstamp()
        try:
            tr.commit().wait()
            continue
        except Exception as e:  # noqa: BLE001 - the engine's error type
            if getattr(e, "code", None) != 1021:
                continue
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
