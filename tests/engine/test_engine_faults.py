"""Fault injection (``?fault_injection=P&seed=S``, embedded engine only): why every FDQ
transactional function must be idempotent, and a differential test in the spirit of
FoundationDB's binding tester."""
from __future__ import annotations

import random
import struct

import pytest

import fdq
from fdq.engine import error_types
from enginehelpers import code_of, failed_commits, wait_ready
from fdqtest import read_version


def run_counted(db, body):
    """FDB's retry loop, counting the errors it retried by code."""
    errors = {}
    tr = db.create_transaction()
    while True:
        try:
            result = body(tr)
            tr.commit().wait()
            return result, errors
        except error_types() as e:
            errors[e.code] = errors.get(e.code, 0) + 1
            tr.on_error(e).wait()


def counter(db, key):
    v = db[key]
    return 0 if v is None else struct.unpack("<q", v)[0]


def test_a_non_idempotent_function_double_applies_under_1021(eng):
    db = eng.open(eng.fault_url(0.25, 11))
    key = eng.k(b"n")

    def increment(tr):  # read-modify-write: correct once, wrong if re-run after a commit
        tr[key] = struct.pack("<q", counter_in(tr, key) + 1)

    unknown = 0
    for _ in range(60):
        _r, errors = run_counted(db, increment)
        unknown += errors.get(1021, 0)
    # a commit_unknown_result may follow a real commit (then the retry applied it again)
    # or not (as on FoundationDB): some of each here
    assert unknown > 0
    assert 60 < counter(eng.db, key) < 60 + unknown

    # fdq.transactional retries 1021 blindly, as fdb.transactional does
    key2 = eng.k(b"n2")

    @fdq.transactional
    def increment2(tr):
        tr[key2] = struct.pack("<q", counter_in(tr, key2) + 1)

    for _ in range(60):
        increment2(db)
    assert counter(eng.db, key2) > 60


def counter_in(tr, key):
    v = tr[key]
    return 0 if v == None else struct.unpack("<q", bytes(v))[0]  # noqa: E711


def test_an_idempotent_function_is_exact_under_1021(eng):
    db = eng.open(eng.fault_url(0.25, 11))
    key = eng.k(b"n")

    @fdq.transactional
    def increment_once(tr, op_id):  # the documented idiom: a marker written with the effect
        marker = eng.k(b"done/", op_id)
        if tr[marker] != None:  # noqa: E711
            return False
        tr[marker] = b""
        tr.add(key, struct.pack("<q", 1))
        return True

    unknown = 0
    for i in range(60):
        op_id = b"%04d" % i  # chosen outside the retry loop
        _r, errors = run_counted(db, lambda tr: increment_once(tr, op_id))
        unknown += errors.get(1021, 0)
    assert unknown > 0
    assert counter(eng.db, key) == 60
    assert len([k for k, _ in eng.items() if k.startswith(eng.k(b"done/"))]) == 60


def test_faults_are_reproducible_for_a_seed(eng, tmp_path):
    if not eng.embedded:
        pytest.skip("fault injection is a feature of the embedded engine's URL")
    runs = []
    for i in range(2):
        db = fdq.connect(f"sqlite://{tmp_path / f'r{i}.db'}?fault_injection=0.3&seed=5", check_format=False)
        codes = []
        for j in range(40):
            tr = db.create_transaction()
            tr[b"k%d" % j] = b""
            try:
                tr.commit().wait()
                codes.append(0)
            except error_types() as e:
                codes.append(e.code)
        runs.append(codes)
    assert runs[0] == runs[1] and set(runs[0]) - {0}  # same faults, and some happened


def test_recoveries_jump_versions_by_100_million(eng):
    db = eng.open(eng.fault_url(0.5, 3))
    versions = []   # (committed version, commits ending in 1021 just before it)
    unknown = 0
    for i in range(300):
        tr = db.create_transaction()
        tr[eng.k(b"v")] = b"%d" % i
        try:
            tr.commit().wait()
            versions.append((tr.get_committed_version(), unknown))
            unknown = 0
        except error_types() as e:
            if e.code == 1021:  # may have committed (and jumped): no committed version, as FDB
                assert tr.get_committed_version() == -1
                unknown += 1
    assert all(b > a for (a, _), (b, _) in zip(versions, versions[1:]))  # strictly increasing
    gaps = [(b - a, n) for (a, _), (b, n) in zip(versions, versions[1:])]
    jumps = [g for g, n in gaps if g >= 100_000_000]
    # a jump per recovery: at most one per commit in between (a 1021 one may have jumped)
    assert jumps and all(g < (n + 2) * 100_000_000 for g, n in gaps)


# -- differential test ----------------------------------------------------------------

KEYS = [b"%02d" % i for i in range(24)]


def model_atomic(op, old, p):
    """FDB's atomic ops (Atomic.h), written independently of the engine."""
    n = len(p)
    if op == "add":
        if not old:
            return p
        a = int.from_bytes(old[:n].ljust(n, b"\x00"), "little")
        return ((a + int.from_bytes(p, "little")) % (1 << (8 * n))).to_bytes(n, "little")
    if op == "bit_xor":
        if not old:
            return p
        return bytes(x ^ y for x, y in zip(old[:n].ljust(n, b"\x00"), p))
    if op == "byte_max":
        return p if old is None else max(old, p)
    if op == "append_if_fits":
        if not old:
            return p
        return old + p if len(old) + len(p) <= 100_000 else old
    if op == "compare_and_clear":
        return None if old is None or old == p else old
    raise AssertionError(op)


def random_program(seed, n_tx=80):
    rng = random.Random(seed)
    program = []
    for t in range(n_tx):
        ops = []
        for _ in range(rng.randint(1, 6)):
            kind = rng.choice(["set", "set", "clear", "clear_range", "add", "bit_xor", "byte_max",
                               "append_if_fits", "compare_and_clear", "read_range"])
            k = rng.choice(KEYS)
            if kind == "set":
                ops.append((kind, k, rng.choice([b"", b"a", b"\x01\x00", b"zz", b"\xff" * 3])))
            elif kind == "clear_range":
                b, e = sorted(rng.sample(KEYS, 2))
                ops.append((kind, b, e))
            elif kind in ("add", "bit_xor"):
                ops.append((kind, k, rng.randint(0, 255).to_bytes(rng.choice([1, 2, 8]), "little")))
            elif kind in ("byte_max", "append_if_fits", "compare_and_clear"):
                ops.append((kind, k, rng.choice([b"a", b"zz", b"\x01\x00"])))
            else:
                ops.append((kind, k, None))
        program.append((b"%04d" % t, ops))
    return program


def apply_model(state, ops):
    state = dict(state)
    for kind, k, arg in ops:
        if kind == "set":
            state[k] = arg
        elif kind == "clear":
            state.pop(k, None)
        elif kind == "clear_range":
            for key in [x for x in state if k <= x < arg]:
                del state[key]
        elif kind != "read_range":
            r = model_atomic(kind, state.get(k), arg)
            if r is None:
                state.pop(k, None)
            else:
                state[k] = r
    return state


def run_program(eng, db, program):
    data, marks = eng.k(b"data/"), eng.k(b"mark/")
    state = {}

    @fdq.transactional
    def step(tr, tx_id, ops, before):
        if tr[marks + tx_id] != None:  # noqa: E711 - already applied (1021)
            return None
        for kind, k, arg in ops:
            if kind == "set":
                tr[data + k] = arg
            elif kind == "clear":
                tr.clear(data + k)
            elif kind == "clear_range":
                tr.clear_range(data + k, data + arg)
            elif kind == "read_range":
                # read-your-writes mid-transaction must match the model exactly
                seen = {kv.key[len(data):]: kv.value for kv in tr.get_range_startswith(data)}
                so_far = apply_model(before, ops[:ops.index((kind, k, arg))])
                assert seen == so_far
            else:
                getattr(tr, kind)(data + k, arg)
        tr[marks + tx_id] = b""
        return True

    for tx_id, ops in program:
        step(db, tx_id, ops, state)
        state = apply_model(state, ops)
    return state


@pytest.mark.parametrize("seed", [1, 2])
def test_differential_with_and_without_faults(eng, seed):
    """A seeded random program of retry-safe transactions gives the same key space with
    fault injection as without, and both match an independent model."""
    program = random_program(seed)
    model = run_program(eng, eng.db, program)
    clean = eng.items()
    tr = eng.db.create_transaction()
    tr.clear_range(eng.p, eng.end())
    tr.commit().wait()
    run_program(eng, eng.open(eng.fault_url(0.2, seed)), program)
    faulty = eng.items()
    assert faulty == clean
    data = eng.k(b"data/")
    assert {k[len(data):]: v for k, v in clean if k.startswith(data)} == model


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
    for tr, (w, vs) in failed_commits(db, 1021, 400, setup):
        seen += 1
        assert tr.get_committed_version() == -1
        assert code_of(vs.wait) == 2020
        assert wait_ready(w, 5) and code_of(w.wait) == 1021
        if seen >= 5:
            break
    assert seen >= 5


def test_injected_commit_unknown_result_may_or_may_not_have_applied(eng):
    """FDB's 1021 means the commit may or may not have happened. Injected only after a
    real commit, it let code that takes 1021 for "it committed" pass every test."""
    db = eng.open(eng.fault_url(0.3, 5))
    def setup(tr, i):
        tr[eng.k(b"u%04d" % i)] = b"1"
        return eng.k(b"u%04d" % i)
    applied = not_applied = 0
    for _tr, key in failed_commits(db, 1021, 600, setup):
        if eng.db[key] is None:
            not_applied += 1
        else:
            applied += 1
        if applied >= 3 and not_applied >= 3:
            break
    assert applied >= 3 and not_applied >= 3, (applied, not_applied)


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
