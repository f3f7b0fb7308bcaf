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
