"""The libfdb_c stand-in (``tests/standin``) behaves as the C library where a real
cluster would show FDQ's mistakes: C calling conventions through libffi, callbacks on
the network thread, reads cancelled with their transaction, no use after fork()."""
from __future__ import annotations

import ctypes
import os
import threading

import pytest

from fdqtest import STANDIN
from standin.libfdb_c import Library


def _raise_code(code, func, args):
    if code:
        raise OSError(code)
    return None


@pytest.mark.parametrize("ffi", [False, True], ids=["direct", "ffi"])
def test_error_codes_go_through_errcheck_in_both_call_modes(ffi):
    lib = Library(ffi=ffi)
    f = lib.fdb_setup_network
    f.argtypes, f.restype, f.errcheck = [], ctypes.c_int, _raise_code
    assert f() is None
    with pytest.raises(OSError) as info:
        f()                                 # network_already_setup
    assert info.value.args == (2009,)
    g = lib.fdb_get_error
    g.argtypes, g.restype = [ctypes.c_int], ctypes.c_char_p
    assert g(1020) == b"Transaction not committed due to conflict with another transaction"


needs_standin = pytest.mark.skipif(not STANDIN, reason="the binding over the stand-in (the fdb pass)")


@pytest.fixture
def fdb_db(eng):
    if eng.embedded:
        pytest.skip("FoundationDB's binding (the fdb pass)")
    return eng.db


@needs_standin
def test_a_read_not_waited_for_before_its_transaction_is_destroyed_is_cancelled(eng, fdb_db):
    import fdb
    tr = fdb_db.create_transaction()
    tr[eng.k(b"a")] = b"1"
    tr.commit().wait()
    v = fdb_db.create_transaction().snapshot[eng.k(b"a")]     # the transaction is gone at once
    with pytest.raises(fdb.FDBError) as info:
        v.wait()
    assert info.value.code == 1025
    tr = fdb_db.create_transaction()
    v = tr[eng.k(b"a")]
    assert v.wait() == b"1"                 # kept until waited for: read
    tr = fdb_db.create_transaction()
    r = tr.get_range(eng.k(b""), eng.end())
    tr.reset()                              # a retry cancels the attempt's pending reads
    with pytest.raises(fdb.FDBError) as info:
        list(r)
    assert info.value.code == 1025


@needs_standin
def test_callbacks_of_pending_futures_run_on_the_network_thread(eng, fdb_db):
    tr = fdb_db.create_transaction()
    w = tr.watch(eng.k(b"w"))
    tr.commit().wait()
    ran = []
    done = threading.Event()
    w.on_ready(lambda f: (ran.append(threading.current_thread().name), done.set()))
    tr = fdb_db.create_transaction()
    tr[eng.k(b"w")] = b"x"
    tr.commit().wait()
    assert done.wait(20)
    assert ran == ["fdb-network-thread"]


@needs_standin
def test_a_forked_child_gets_an_error_where_a_real_client_would_hang(eng, fdb_db):
    import fdb
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            tr = fdb_db.create_transaction()
            tr[eng.k(b"a")].wait()
            os.write(w, b"no error")
        except fdb.FDBError as e:
            os.write(w, b"%d" % e.code)
        except BaseException as e:      # noqa: BLE001 - reported to the parent
            os.write(w, repr(e).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read()
    os.waitpid(pid, 0)
    assert out == b"2000"
