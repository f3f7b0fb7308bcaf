"""Benchmarks of FDQ's embedded engine (``sqlite://``) against raw ``sqlite3``.

Run::

    python -m bench.engine            # full run, about 45 s (bounded under 90 s)
    python -m bench.engine --quick    # about 11 s, smaller counts
    python -m bench.engine --json     # a machine-readable dict instead of the table
    python -m bench.engine --markdown # the table in markdown, for bench/RESULTS.md
    python -m bench.engine --profile single   # cProfile of one engine path (single,
                                              # batch, range, snapshot), top functions

Every case runs on a fresh database in a fresh temporary directory (``--dir`` to choose
where), is bounded both in operations and in seconds, and is measured twice in the same
run: through the engine (``fdq.connect("sqlite:///...")``, FoundationDB's Python API) and
through raw ``sqlite3`` doing the same work with the same file settings (WAL,
``synchronous=NORMAL``, ``kv (key BLOB PRIMARY KEY, value BLOB) WITHOUT ROWID``,
``BEGIN IMMEDIATE ... COMMIT`` per transaction). The ratio is engine / raw.

Cases:

* ``single``: one ``tr.set`` (tuple-packed key, 100-byte value) + commit per
  transaction: transactions/s, p50/p99 commit latency (µs, set + commit), and what a
  commit costs beyond SQLite's work: SQL statements per commit (raw: 3) and Python calls
  per transaction (``engine_commit_cost``).
* ``batch``: 1,000 sets per transaction: rows/s.
* ``range``: a full ``get_range`` over ~200k rows (serializable, and ``tr.snapshot``):
  rows/s.
* ``rmw``: two OS processes (multiprocessing, spawn) incrementing 8-byte LE counters
  among 100 keys (random key each) with ``@fdq.transactional``: committed tx/s, and
  retries (1020 ``not_committed``) per committed tx, counted as body calls - commits.
  The final counter sum is checked against the commits (no lost update).

Each case reports the WAL file's size at the end (and the largest seen while it ran):
the engine must let the WAL checkpoint.
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import sqlite3
import statistics
import struct
import sys
import tempfile
import time
from time import perf_counter, process_time

import fdq
import fdb.tuple  # noqa: E402  (fdq installs the fdb.impl shim it needs)

from bench._common import pct

VALUE_SIZE = 100
BATCH = 1000
RMW_KEYS = 100
UPSERT = "INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)"
RAW_SCHEMA = "CREATE TABLE IF NOT EXISTS kv (key BLOB PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID"

# Bounds per mode: (max operations, max seconds) per measured loop.
PLANS = {
    "full": dict(single_n=200_000, single_s=8.0, raw_single_n=400_000, raw_single_s=4.0,
                 batch_tx=2_000, batch_s=5.0, raw_batch_tx=2_000, raw_batch_s=3.0,
                 range_rows=200_000, range_reps=3, range_s=12.0,
                 rmw_s=8.0, raw_rmw_s=5.0),
    "quick": dict(single_n=30_000, single_s=2.0, raw_single_n=60_000, raw_single_s=1.0,
                  batch_tx=300, batch_s=1.2, raw_batch_tx=300, raw_batch_s=0.8,
                  range_rows=50_000, range_reps=2, range_s=3.0,
                  rmw_s=2.0, raw_rmw_s=1.5),
}


def progress(msg: str):
    print(f"[bench/engine] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------
# Machine


def machine_info(directory: str) -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    fs = "unknown"
    try:
        best = ""
        real = os.path.realpath(directory)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fs = mnt, f"{parts[2]} ({parts[0]} on {mnt})"
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "platform": platform.platform(),
        "filesystem": fs,
        "fdq": getattr(fdq, "__version__", "?"),
        "fdq_revision": _revision(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _revision() -> str:
    """The git commit of the checkout measured, '+dirty' if fdq/engine has local edits."""
    import subprocess

    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", top, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", top, "status", "--porcelain", "--", "fdq/engine"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


# ---------------------------------------------------------------------------------
# Helpers


class Case:
    """A fresh directory with one engine database and one raw database."""

    def __init__(self, root: str, name: str):
        self.dir = tempfile.mkdtemp(prefix=f"fdq-bench-{name}-", dir=root)
        self.engine_path = os.path.join(self.dir, "engine.db")
        self.raw_path = os.path.join(self.dir, "raw.db")
        self.url = "sqlite://" + self.engine_path

    def wal(self, path: str) -> int:
        try:
            return os.path.getsize(path + "-wal")
        except OSError:
            return 0

    def cleanup(self):
        gc.collect()
        shutil.rmtree(self.dir, ignore_errors=True)


class WalPeak:
    def __init__(self, path):
        self.path = path + "-wal"
        self.peak = 0

    def sample(self):
        try:
            s = os.path.getsize(self.path)
        except OSError:
            return
        if s > self.peak:
            self.peak = s


def raw_connect(path: str, timeout: float = 10.0) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=timeout, check_same_thread=False)
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    assert mode.lower() == "wal", mode
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(RAW_SCHEMA)
    return conn


def make_keys(tag: str, n: int, start: int = 0):
    return [fdb.tuple.pack(("bench", tag, i)) for i in range(start, start + n)]


def make_values(n: int):
    base = os.urandom(VALUE_SIZE - 8)
    return [base + i.to_bytes(8, "little") for i in range(n)]


def ratio(a, b):
    return (a / b) if a and b else None


# ---------------------------------------------------------------------------------
# single: one set + commit per transaction


def _single(commit_one, n_max, s_max, wal: WalPeak | None):
    """``commit_one(i)`` up to ``n_max`` times (stopping past ``s_max``), the WAL sampled
    every 1,024. Returns (transactions, elapsed s, latencies in s, CPU s)."""
    lat = []
    append = lat.append
    clock = perf_counter
    deadline = clock() + s_max
    t0 = clock()
    c0 = process_time()
    n = 0
    for i in range(n_max):
        s = clock()
        commit_one(i)
        e = clock()
        append(e - s)
        n += 1
        if not n & 1023:
            if wal is not None:
                wal.sample()
            if e > deadline:
                break
    return n, clock() - t0, lat, process_time() - c0


def engine_single(db, keys, values, n_max, s_max, wal: WalPeak | None = None):
    create = db.create_transaction

    def commit_one(i):
        tr = create()
        tr.set(keys[i], values[i])
        tr.commit().wait()
    return _single(commit_one, n_max, s_max, wal)


def raw_single(conn, keys, values, n_max, s_max, wal: WalPeak | None = None):
    execute = conn.execute

    def commit_one(i):
        execute("BEGIN IMMEDIATE")
        execute(UPSERT, (keys[i], values[i]))
        execute("COMMIT")
    return _single(commit_one, n_max, s_max, wal)


def engine_commit_cost(db, keys, values, n: int = 200) -> dict:
    """What one ``set`` + commit costs the engine beyond SQLite's work: SQL statements its
    writer connection runs per commit (``set_trace_callback``), and Python function calls
    per transaction (``sys.setprofile``: calls of Python functions and of C builtins)."""
    writer = db._get_store().writer
    statements = []
    writer.set_trace_callback(statements.append)
    try:
        engine_single(db, keys, values, n, 60)
    finally:
        writer.set_trace_callback(None)
    calls = [0]

    def count(_frame, event, _arg):
        if event == "call" or event == "c_call":
            calls[0] += 1
    create = db.create_transaction
    sys.setprofile(count)
    try:
        for i in range(n):
            tr = create()
            tr.set(keys[n + i], values[n + i])
            tr.commit().wait()
    finally:
        sys.setprofile(None)
    return {"statements_per_commit": len(statements) / n, "python_calls_per_tx": calls[0] / n}


def _single_figures(n, elapsed, lat, cpu, **extra) -> dict:
    lat.sort()
    return dict(ops=n, seconds=elapsed, tx_per_s=n / elapsed, tx_per_cpu_s=n / cpu, p50_us=pct(lat, .50) * 1e6,
                p99_us=pct(lat, .99) * 1e6, p999_us=pct(lat, .999) * 1e6, **extra)


def case_single(root, plan):
    c = Case(root, "single")
    try:
        n_keys = max(plan["single_n"], plan["raw_single_n"])
        keys, values = make_keys("w", n_keys), make_values(n_keys)
        warm_k, warm_v = make_keys("warm", 200), make_values(200)

        db = fdq.connect(c.url)
        engine_single(db, warm_k, warm_v, 200, 60)
        wal_e = WalPeak(c.engine_path)
        n, el, lat, cpu = engine_single(db, keys, values, plan["single_n"], plan["single_s"], wal_e)
        wal_e.sample()
        eng_wal = c.wal(c.engine_path)
        cost = engine_commit_cost(db, *(make_keys("cost", 400), make_values(400)))
        eng = _single_figures(n, el, lat, cpu, wal_bytes=eng_wal, wal_peak_bytes=wal_e.peak, tx_per_op=1.0,
                              db_bytes=os.path.getsize(c.engine_path), **cost)
        del db
        progress(f"single  engine: {n:,} tx in {el:.2f} s = {n / el:,.0f} tx/s, "
                 f"p50 {eng['p50_us']:.0f} µs, p99 {eng['p99_us']:.0f} µs")

        conn = raw_connect(c.raw_path)
        raw_single(conn, warm_k, warm_v, 200, 60)
        wal_r = WalPeak(c.raw_path)
        n, el, lat, cpu = raw_single(conn, keys, values, plan["raw_single_n"], plan["raw_single_s"], wal_r)
        wal_r.sample()
        raw = _single_figures(n, el, lat, cpu, wal_bytes=c.wal(c.raw_path), wal_peak_bytes=wal_r.peak,
                              db_bytes=os.path.getsize(c.raw_path))
        conn.close()
        progress(f"single  raw:    {n:,} tx in {el:.2f} s = {n / el:,.0f} tx/s, "
                 f"p50 {raw['p50_us']:.0f} µs, p99 {raw['p99_us']:.0f} µs")
        return {"engine": eng, "raw": raw, "ratio": ratio(eng["tx_per_s"], raw["tx_per_s"]),
                "ratio_cpu": ratio(eng["tx_per_cpu_s"], raw["tx_per_cpu_s"])}
    finally:
        c.cleanup()


# ---------------------------------------------------------------------------------
# batch: 1,000 sets per transaction


def _batch_rows(tag, t):
    return make_keys(tag, BATCH, t * BATCH), make_values(BATCH)


def _batched(commit_batch, tag, tx_max, s_max, wal: WalPeak | None):
    """``commit_batch(keys, values)`` of BATCH rows up to ``tx_max`` times (stopping past
    ``s_max``); keys are packed outside the timed part. Returns (transactions, busy s, CPU s)."""
    clock = perf_counter
    deadline = clock() + s_max
    busy = cpu = 0.0
    txs = 0
    for t in range(tx_max):
        keys, values = _batch_rows(tag, t)
        c = process_time()
        s = clock()
        commit_batch(keys, values)
        e = clock()
        cpu += process_time() - c
        busy += e - s
        txs += 1
        if wal is not None:
            wal.sample()
        if e > deadline:
            break
    return txs, busy, cpu


def engine_batch(db, tag, tx_max, s_max, wal: WalPeak | None = None):
    def commit_batch(keys, values):
        tr = db.create_transaction()
        for i in range(BATCH):
            tr.set(keys[i], values[i])
        tr.commit().wait()
    return _batched(commit_batch, tag, tx_max, s_max, wal)


def raw_batch(conn, tag, tx_max, s_max, wal: WalPeak | None = None):
    def commit_batch(keys, values):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(UPSERT, zip(keys, values))
        conn.execute("COMMIT")
    return _batched(commit_batch, tag, tx_max, s_max, wal)


def case_batch(root, plan):
    c = Case(root, "batch")
    try:
        db = fdq.connect(c.url)
        engine_batch(db, "warm", 2, 60)
        wal_e = WalPeak(c.engine_path)
        txs, el, cpu = engine_batch(db, "b", plan["batch_tx"], plan["batch_s"], wal_e)
        eng = dict(ops=txs * BATCH, transactions=txs, seconds=el, rows_per_s=txs * BATCH / el,
                   rows_per_cpu_s=txs * BATCH / cpu,
                   tx_per_s=txs / el, wal_bytes=c.wal(c.engine_path), wal_peak_bytes=wal_e.peak,
                   tx_per_op=1.0 / BATCH, db_bytes=os.path.getsize(c.engine_path))
        del db
        progress(f"batch   engine: {txs:,} tx x {BATCH} rows in {el:.2f} s = "
                 f"{eng['rows_per_s']:,.0f} rows/s")

        conn = raw_connect(c.raw_path)
        raw_batch(conn, "warm", 2, 60)
        wal_r = WalPeak(c.raw_path)
        txs, el, cpu = raw_batch(conn, "b", plan["raw_batch_tx"], plan["raw_batch_s"], wal_r)
        raw = dict(ops=txs * BATCH, transactions=txs, seconds=el, rows_per_s=txs * BATCH / el,
                   rows_per_cpu_s=txs * BATCH / cpu,
                   tx_per_s=txs / el, wal_bytes=c.wal(c.raw_path), wal_peak_bytes=wal_r.peak,
                   db_bytes=os.path.getsize(c.raw_path))
        conn.close()
        progress(f"batch   raw:    {txs:,} tx x {BATCH} rows in {el:.2f} s = "
                 f"{raw['rows_per_s']:,.0f} rows/s")
        return {"engine": eng, "raw": raw, "ratio": ratio(eng["rows_per_s"], raw["rows_per_s"]),
                "ratio_cpu": ratio(eng["rows_per_cpu_s"], raw["rows_per_cpu_s"])}
    finally:
        c.cleanup()


# ---------------------------------------------------------------------------------
# range: full get_range over ~200k rows


PREFIX_BEGIN = fdb.tuple.pack(("bench", "r"))
PREFIX_END = PREFIX_BEGIN + b"\xff"


def engine_range(db, snapshot: bool):
    c0 = process_time()
    t0 = perf_counter()
    tr = db.create_transaction()
    view = tr.snapshot if snapshot else tr
    n = 0
    for _kv in view.get_range(PREFIX_BEGIN, PREFIX_END):
        n += 1
    tr.commit().wait()  # read-only: ends the read snapshot
    return n, perf_counter() - t0, process_time() - c0


def raw_range(conn):
    c0 = process_time()
    t0 = perf_counter()
    conn.execute("BEGIN")
    n = 0
    for _row in conn.execute("SELECT key, value FROM kv WHERE key >= ? AND key < ? ORDER BY key",
                             (PREFIX_BEGIN, PREFIX_END)):
        n += 1
    conn.execute("COMMIT")
    return n, perf_counter() - t0, process_time() - c0


def populate_engine(db, n_rows):
    keys = None
    for start in range(0, n_rows, BATCH):
        keys = make_keys("r", min(BATCH, n_rows - start), start)
        vals = make_values(len(keys))
        tr = db.create_transaction()
        for k, v in zip(keys, vals):
            tr.set(k, v)
        tr.commit().wait()


def populate_raw(conn, n_rows):
    for start in range(0, n_rows, BATCH):
        keys = make_keys("r", min(BATCH, n_rows - start), start)
        vals = make_values(len(keys))
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(UPSERT, zip(keys, vals))
        conn.execute("COMMIT")


def _reps(fn, reps, s_max, expect):
    rates, times, cpu_rates = [], [], []
    deadline = perf_counter() + s_max
    for _ in range(reps):
        n, el, cpu = fn()
        cpu_rates.append(n / cpu if cpu > 0 else 0.0)
        if n != expect:
            raise AssertionError(f"range read returned {n:,} rows, expected {expect:,}")
        rates.append(n / el)
        times.append(el)
        if perf_counter() > deadline:
            break
    return dict(rows=expect, reps=len(rates), seconds_median=statistics.median(times),
                rows_per_s=statistics.median(rates), rows_per_s_best=max(rates),
                rows_per_cpu_s=statistics.median(cpu_rates))


def case_range(root, plan):
    c = Case(root, "range")
    rows = plan["range_rows"]
    try:
        db = fdq.connect(c.url)
        t0 = perf_counter()
        populate_engine(db, rows)
        progress(f"range   engine: populated {rows:,} rows in {perf_counter() - t0:.2f} s")
        engine_range(db, True)  # warm the page cache
        ser = _reps(lambda: engine_range(db, False), plan["range_reps"], plan["range_s"] / 2, rows)
        snap = _reps(lambda: engine_range(db, True), plan["range_reps"], plan["range_s"] / 2, rows)
        ewal = c.wal(c.engine_path)
        for d in (ser, snap):
            d.update(wal_bytes=ewal, tx_per_op=1.0 / rows)
        del db
        progress(f"range   engine: {ser['rows_per_s']:,.0f} rows/s serializable, "
                 f"{snap['rows_per_s']:,.0f} rows/s snapshot "
                 f"({ser['seconds_median']:.2f} s / {snap['seconds_median']:.2f} s per scan)")

        conn = raw_connect(c.raw_path)
        populate_raw(conn, rows)
        raw_range(conn)
        raw = _reps(lambda: raw_range(conn), plan["range_reps"], plan["range_s"] / 2, rows)
        raw["wal_bytes"] = c.wal(c.raw_path)
        conn.close()
        progress(f"range   raw:    {raw['rows_per_s']:,.0f} rows/s ({raw['seconds_median']:.2f} s per scan)")
        return {"engine": ser, "engine_snapshot": snap, "raw": raw,
                "ratio": ratio(ser["rows_per_s"], raw["rows_per_s"]),
                "ratio_snapshot": ratio(snap["rows_per_s"], raw["rows_per_s"]),
                "ratio_cpu": ratio(ser["rows_per_cpu_s"], raw["rows_per_cpu_s"]),
                "ratio_snapshot_cpu": ratio(snap["rows_per_cpu_s"], raw["rows_per_cpu_s"])}
    finally:
        c.cleanup()


# ---------------------------------------------------------------------------------
# rmw: 2 processes, read-modify-write of counters


def _rmw_worker(kind, path, seconds, seed, ready, start, results, profile_out=None):
    import fdq as _fdq
    import fdb.tuple as _tuple

    rng = random.Random(seed)
    keys = [_tuple.pack(("bench", "ctr", i)) for i in range(RMW_KEYS)]
    calls = 0
    commits = 0
    if kind == "engine":
        db = _fdq.connect("sqlite://" + path)

        @_fdq.transactional
        def incr(tr, key):
            nonlocal calls
            calls += 1
            v = tr[key]
            n = struct.unpack("<q", bytes(v))[0] if v.present() else 0
            tr[key] = struct.pack("<q", n + 1)

        def op(key):
            incr(db, key)
    else:
        conn = raw_connect(path)
        ex = conn.execute

        def op(key):
            nonlocal calls
            calls += 1
            ex("BEGIN IMMEDIATE")
            row = ex("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
            n = struct.unpack("<q", row[0])[0] if row else 0
            ex(UPSERT, (key, struct.pack("<q", n + 1)))
            ex("COMMIT")

    pr = None
    if profile_out:
        import cProfile

        pr = cProfile.Profile()
    ready.put(os.getpid())
    start.wait()
    if pr is not None:
        pr.enable()
    t0 = perf_counter()
    end = t0 + seconds
    error = None
    try:
        while perf_counter() < end:
            op(rng.choice(keys))
            commits += 1
    except Exception as e:  # report, don't hang the parent
        error = f"{type(e).__name__}: {e}"
    if pr is not None:
        pr.disable()
        pr.dump_stats(profile_out)
    results.put(dict(calls=calls, commits=commits, seconds=perf_counter() - t0, error=error))


def _rmw_run(kind, path, seconds, wal: WalPeak, profile_out=None):
    ctx = mp.get_context("spawn")
    ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_rmw_worker, args=(kind, path, seconds, 1000 + i, ready, start, results,
                                                   profile_out if i == 0 else None))
             for i in range(2)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=60)
    t0 = perf_counter()
    start.set()
    out = []
    while len(out) < len(procs):
        wal.sample()
        try:
            out.append(results.get(timeout=0.05))
        except Exception:
            if perf_counter() - t0 > seconds + 60:
                raise RuntimeError(f"rmw {kind}: workers did not finish")
    wall = perf_counter() - t0
    for p in procs:
        p.join(timeout=30)
    errors = [r["error"] for r in out if r["error"]]
    calls = sum(r["calls"] for r in out)
    commits = sum(r["commits"] for r in out)
    return dict(commits=commits, calls=calls, retries=calls - commits, seconds=wall,
                tx_per_s=commits / wall, retries_per_commit=(calls - commits) / commits if commits else None,
                per_process_tx_per_s=[round(r["commits"] / r["seconds"]) for r in out],
                errors=errors)


def _counter_sum_engine(db):
    tr = db.create_transaction()
    total = 0
    for kv in tr.get_range_startswith(fdb.tuple.pack(("bench", "ctr"))):
        total += struct.unpack("<q", kv.value)[0]
    tr.commit().wait()
    return total


def case_rmw(root, plan):
    c = Case(root, "rmw")
    try:
        db = fdq.connect(c.url)
        _counter_sum_engine(db)  # opens a pooled connection: the WAL is measured live at the end
        wal_e = WalPeak(c.engine_path)
        eng = _rmw_run("engine", c.engine_path, plan["rmw_s"], wal_e)
        wal_e.sample()
        eng["wal_bytes"] = c.wal(c.engine_path)
        eng["wal_peak_bytes"] = wal_e.peak
        eng["tx_per_op"] = eng["calls"] / eng["commits"] if eng["commits"] else None
        total = _counter_sum_engine(db)
        eng["counter_sum"] = total
        eng["lost_updates"] = eng["commits"] - total
        del db
        progress(f"rmw     engine: {eng['commits']:,} commits in {eng['seconds']:.2f} s = "
                 f"{eng['tx_per_s']:,.0f} tx/s, {eng['retries']:,} retries "
                 f"({eng['retries_per_commit']:.4f}/commit), counter sum {total:,}"
                 + (f", ERRORS {eng['errors']}" if eng["errors"] else ""))
        if eng["lost_updates"]:
            progress(f"rmw     engine: LOST UPDATES: {eng['lost_updates']} committed increments are "
                     "missing from the counters (serializability violation)")

        conn = raw_connect(c.raw_path)
        wal_r = WalPeak(c.raw_path)
        raw = _rmw_run("raw", c.raw_path, plan["raw_rmw_s"], wal_r)
        wal_r.sample()
        raw["wal_bytes"] = c.wal(c.raw_path)
        raw["wal_peak_bytes"] = wal_r.peak
        total = sum(struct.unpack("<q", v)[0] for (v,) in conn.execute("SELECT value FROM kv"))
        raw["counter_sum"] = total
        raw["lost_updates"] = raw["commits"] - total
        conn.close()
        progress(f"rmw     raw:    {raw['commits']:,} commits in {raw['seconds']:.2f} s = "
                 f"{raw['tx_per_s']:,.0f} tx/s (SQLite write lock, no optimistic conflicts)"
                 + (f", ERRORS {raw['errors']}" if raw["errors"] else ""))
        return {"engine": eng, "raw": raw, "ratio": ratio(eng["tx_per_s"], raw["tx_per_s"])}
    finally:
        c.cleanup()


# ---------------------------------------------------------------------------------
# Profile


def profile(root, which, plan):
    import cProfile
    import pstats

    c = Case(root, "profile")
    try:
        db = fdq.connect(c.url)
        pr = cProfile.Profile()
        if which == "single":
            n = min(plan["single_n"], 30_000)
            keys, values = make_keys("w", n), make_values(n)
            engine_single(db, make_keys("warm", 100), make_values(100), 100, 60)
            pr.enable()
            engine_single(db, keys, values, n, 1e9)
            pr.disable()
        elif which == "batch":
            batches = [_batch_rows("b", t) for t in range(50)]  # packed outside the profile
            pr.enable()
            for keys, values in batches:
                tr = db.create_transaction()
                for k, v in zip(keys, values):
                    tr.set(k, v)
                tr.commit().wait()
            pr.disable()
        elif which in ("range", "snapshot"):
            rows = plan["range_rows"]
            populate_engine(db, rows)
            engine_range(db, True)
            pr.enable()
            for _ in range(2):
                engine_range(db, which == "snapshot")
            pr.disable()
        elif which == "rmw":
            out = os.path.join(c.dir, "rmw.prof")
            r = _rmw_run("engine", c.engine_path, plan["rmw_s"], WalPeak(c.engine_path), out)
            print(f"2-process RMW: {r['tx_per_s']:,.0f} tx/s, {r['retries_per_commit']:.4f} "
                  "retries/commit (profiled: process 0)")
            pr = None
        else:
            raise SystemExit(f"--profile: unknown case {which!r} (single, batch, range, snapshot, rmw)")
        st = pstats.Stats(pr) if pr is not None else pstats.Stats(out)
        total = st.total_tt
        sql = {}
        for (fn_file, _line, name), (_cc, _nc, tt, _ct, _callers) in st.stats.items():
            if "sqlite3." in name:
                sql[name] = sql.get(name, 0.0) + tt
        sql_total = sum(sql.values())
        print(f"cProfile of the engine's {which!r} path: {total:.3f} s total (profiler overhead "
              "inflates the Python share)")
        print(f"  in sqlite3 C calls: {sql_total / total:6.1%}")
        for name, tt in sorted(sql.items(), key=lambda x: -x[1]):
            print(f"      {tt / total:6.1%}  {name}")
        print(f"  Python and other builtins: {1 - sql_total / total:6.1%}")
        print()
        st.sort_stats("tottime").print_stats(25)
        st.sort_stats("cumulative").print_stats(25)
    finally:
        c.cleanup()


# ---------------------------------------------------------------------------------
# Output


def _fmt(x, digits=0):
    if x is None:
        return "-"
    if isinstance(x, float) and digits:
        return f"{x:,.{digits}f}"
    return f"{x:,.0f}"


def _kb(b):
    return "-" if b is None else f"{b / 1024:,.0f} KB"


def _wal(d):
    s = _kb(d.get("wal_bytes"))
    if d.get("wal_peak_bytes"):
        s += f" (peak {_kb(d['wal_peak_bytes'])})"
    return s


def table_rows(res: dict):
    rows = []  # metric, engine, raw, ratio, target, wal engine, wal raw, engine tx/op
    s = res.get("single")
    if s:
        e, r = s["engine"], s["raw"]
        rows.append(("single-write tx/s (1 set + commit)", _fmt(e["tx_per_s"]), _fmt(r["tx_per_s"]),
                     f"{s['ratio']:.2f}", "≥ 15,000/s", _wal(e), _wal(r), "1"))
        rows.append(("  per CPU-second (load-independent)", _fmt(e["tx_per_cpu_s"]), _fmt(r["tx_per_cpu_s"]),
                     f"{s['ratio_cpu']:.2f}", "", "", "", ""))
        rows.append(("  commit latency p50 (µs)", _fmt(e["p50_us"]), _fmt(r["p50_us"]),
                     f"{e['p50_us'] / r['p50_us']:.2f}", "", "", "", ""))
        rows.append(("  commit latency p99 (µs)", _fmt(e["p99_us"]), _fmt(r["p99_us"]),
                     f"{e['p99_us'] / r['p99_us']:.2f}", "", "", "", ""))
        if "statements_per_commit" in e:
            rows.append(("  SQL statements per commit", f"{e['statements_per_commit']:.1f}", "3", "", "", "", "",
                         ""))
            rows.append(("  Python calls per tx (functions + builtins)", f"{e['python_calls_per_tx']:.0f}", "",
                         "", "", "", "", ""))
    b = res.get("batch")
    if b:
        e, r = b["engine"], b["raw"]
        rows.append((f"{BATCH:,}-key tx: rows/s", _fmt(e["rows_per_s"]), _fmt(r["rows_per_s"]),
                     f"{b['ratio']:.2f}", "≥ 0.50 of raw", _wal(e), _wal(r), f"1/{BATCH:,}"))
        rows.append(("  per CPU-second (load-independent)", _fmt(e["rows_per_cpu_s"]), _fmt(r["rows_per_cpu_s"]),
                     f"{b['ratio_cpu']:.2f}", "≥ 0.50 of raw", "", "", ""))
    g = res.get("range")
    if g:
        e, sn, r = g["engine"], g["engine_snapshot"], g["raw"]
        n = e["rows"]
        rows.append((f"range read rows/s ({n:,} rows)", _fmt(e["rows_per_s"]), _fmt(r["rows_per_s"]),
                     f"{g['ratio']:.2f}", "≥ 0.50 of raw", _wal(e), _wal(r), f"1/{n:,}"))
        rows.append(("  per CPU-second (load-independent)", _fmt(e["rows_per_cpu_s"]), _fmt(r["rows_per_cpu_s"]),
                     f"{g['ratio_cpu']:.2f}", "≥ 0.50 of raw", "", "", ""))
        rows.append(("  snapshot range read rows/s", _fmt(sn["rows_per_s"]), _fmt(r["rows_per_s"]),
                     f"{g['ratio_snapshot']:.2f}", "≥ 0.50 of raw", "", "", f"1/{n:,}"))
        rows.append(("  snapshot, per CPU-second", _fmt(sn["rows_per_cpu_s"]), _fmt(r["rows_per_cpu_s"]),
                     f"{g['ratio_snapshot_cpu']:.2f}", "≥ 0.50 of raw", "", "", ""))
    m = res.get("rmw")
    if m:
        e, r = m["engine"], m["raw"]
        rows.append(("RMW 2 procs, 100 keys: committed tx/s", _fmt(e["tx_per_s"]), _fmt(r["tx_per_s"]),
                     f"{m['ratio']:.2f}", "", _wal(e), _wal(r), f"{e['tx_per_op']:.4f}"))
        rows.append(("  retries (1020) per committed tx", f"{e['retries_per_commit']:.4f}",
                     "0 (locks)", "", "", "", "", ""))
        rows.append(("  lost updates (commits - counter sum)", _fmt(e["lost_updates"]),
                     _fmt(r["lost_updates"]), "", "0", "", "", ""))
    return rows


HEADERS = ("case", "engine", "raw sqlite3", "engine/raw", "target", "WAL at end: engine",
           "WAL at end: raw", "engine tx/op")


def print_table(result):
    m = result["machine"]
    head = (f"Machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), "
            f"Python {m['python']}, SQLite {m['sqlite']}, {m['filesystem']}; fdq {m['fdq_revision']}; "
            f"mode {result['mode']}; {result['date']}; load average at start {m.get('loadavg_1m')}")
    rows = table_rows(result["results"])
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(head)
        print(" | ".join(HEADERS))
        for r in rows:
            print(" | ".join(r))
        return
    console = Console() if sys.stdout.isatty() else Console(width=190)
    console.print(head)
    t = Table(title="FDQ embedded engine vs raw sqlite3")
    for i, h in enumerate(HEADERS):
        t.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*r)
    console.print(t)


def print_markdown(result):
    print("| " + " | ".join(HEADERS) + " |")
    print("|" + "|".join(["---"] + ["---:"] * (len(HEADERS) - 1)) + "|")
    for r in table_rows(result["results"]):
        print("| " + " | ".join(r) + " |")


# ---------------------------------------------------------------------------------


CASES = {"single": case_single, "batch": case_batch, "range": case_range, "rmw": case_rmw}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller counts, about 15 s")
    ap.add_argument("--json", action="store_true", help="print a JSON dict instead of the table")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated subset of {', '.join(CASES)}")
    ap.add_argument("--dir", default=None, help="where to create the temporary databases")
    ap.add_argument("--profile", metavar="CASE", default=None,
                    help="cProfile one engine path (single, batch, range, snapshot, rmw) and exit")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    plan = PLANS[mode]
    root = args.dir or tempfile.gettempdir()
    if args.profile:
        profile(root, args.profile, plan)
        return 0
    cases = [x.strip() for x in args.cases.split(",") if x.strip()]
    for x in cases:
        if x not in CASES:
            ap.error(f"unknown case {x!r} (known: {', '.join(CASES)})")
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode": mode,
              "machine": machine_info(root), "plan": plan, "results": {}}
    t0 = perf_counter()
    for x in cases:
        progress(f"case {x} ...")
        result["results"][x] = CASES[x](root, plan)
    result["total_seconds"] = perf_counter() - t0
    progress(f"done in {result['total_seconds']:.1f} s")
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif args.markdown:
        print_markdown(result)
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
