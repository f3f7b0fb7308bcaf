"""What the benchmarks share: one percentile rule, the timed loop, the engine's commit
counter, the consumers' quick config, the common options, the machine line, the
table output (rich for people, markdown for RESULTS.md, JSON for scripts), and the
servers' processes (a free loopback port, a process's CPU, stopping one by PID).

Run the benchmarks as modules from the repository root (``python -m bench.queue_bench``)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from time import perf_counter

# The consumers of the benchmarks: quick heartbeats and polls (the tests' are quicker still).
FAST = dict(heartbeat_interval_s=0.25, zombie_timeout_s=1.5, poll_interval_s=0.05,
            lease_check_interval_s=0.25)


def pct(values, q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``: the value of rank ``int(n * q)`` in sorted
    order (the last for q = 1), nan if there is none."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def timed(step, n: int, seconds: float):
    """Call ``step()`` up to ``n`` times, stopping after the first call that began past
    ``seconds``. Returns (latencies of each call in s, elapsed s, CPU s of this process)."""
    lat = []
    append = lat.append
    c0 = time.process_time()
    t0 = perf_counter()
    deadline = t0 + seconds
    for _ in range(n):
        s = perf_counter()
        step()
        append(perf_counter() - s)
        if s > deadline:
            break
    return lat, perf_counter() - t0, time.process_time() - c0


# -- transaction counting (per process) ------------------------------------------------

COMMITS = [0]
READ_ONLY_COMMITS = [0]


def count_commits():
    """Count the embedded engine's commits that wrote something in this process
    (``COMMITS[0]``): the engine's transactions per message; and those that did not
    (``READ_ONLY_COMMITS[0]``: a consumer's watches, checks)."""
    from fdq.engine import sqlite as engine_sqlite
    original = engine_sqlite.Transaction.commit
    if getattr(original, "_counted", False):
        return

    def commit(self):
        if self._writes or self._clears or self._vs_keys:
            COMMITS[0] += 1
        else:
            READ_ONLY_COMMITS[0] += 1
        return original(self)
    commit._counted = True
    engine_sqlite.Transaction.commit = commit


def progress(msg):
    print(f"  {msg}", file=sys.stderr, flush=True)


def parser(description: str, *, quick: str = "smaller counts") -> argparse.ArgumentParser:
    """The options every benchmark takes: ``--quick``, ``--json``, ``--markdown``, ``--dir``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--json", action="store_true", help="print a JSON dict instead of the table")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown (for RESULTS.md)")
    ap.add_argument("--dir", default=None, help="where the temporary databases go")
    return ap


def machine() -> str:
    """One line: processor, cores, Python, SQLite."""
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}")


def fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def output(args, title: str, rows: list, columns: list, *, text_columns=("case", "target"), extra: dict | None = None):
    """Print ``rows`` (dicts) as JSON (``--json``: the machine line, ``extra`` and the
    rows), a markdown table (``--markdown``) or a rich table, with the ``columns`` any row
    has."""
    line = machine()
    if args.json:
        print(json.dumps({"machine": line, **(extra or {}), "rows": rows}, indent=1, default=str))
        return
    used = [c for c in columns if any(c in r for r in rows)]
    if args.markdown:
        print("| " + " | ".join(used) + " |")
        print("|" + "|".join("---" if c in text_columns else "---:" for c in used) + "|")
        for r in rows:
            print("| " + " | ".join(fmt(r.get(c, "")) if c in r else "" for c in used) + " |")
        print(f"\nMachine: {line}")
        return
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"{title} ({line})")
    for c in used:
        t.add_column(c, justify="left" if c in text_columns else "right")
    for r in rows:
        t.add_row(*[fmt(r.get(c)) if c in r else "" for c in used])
    Console(width=max(160, shutil.get_terminal_size().columns)).print(t)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) of process ``pid`` so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_process(proc: subprocess.Popen, timeout: float = 30.0, *, stop=None):
    """End ``proc`` (a server this run started): ``stop(proc)`` (default: SIGTERM), then
    SIGKILL if it has not exited within ``timeout``; reaped either way."""
    if proc.poll() is None:
        (stop or subprocess.Popen.terminate)(proc)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
