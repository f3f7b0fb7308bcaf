"""What one SQLite commit costs on this machine, with the engine's file settings (WAL,
synchronous=NORMAL, a WITHOUT ROWID key-value table): the floor under every push path.

A commit's cost grows with the number of distinct B-tree pages it dirties (each one is a
WAL frame written at COMMIT), far more than with its rows: a single push writes rows under
~7 key prefixes (log, ready queue, counters, marker, marker index, the engine's txlog), so
it dirties ~7 pages. Run it twice with ``--dir /dev/shm`` to see how much of a page's cost
is the file system's.

    python -m bench.investigations.sqlite_floor [--dir DIR] [--commits N]
"""
import argparse
import os
import sqlite3
import tempfile
import time

VALUE = b"x" * 120


def _case(conn, label, rows_of, commits):
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(commits):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?)", rows_of(i))
        conn.execute("COMMIT")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return label, commits / wall, cpu / commits * 1e6, wall / commits * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where the database file goes (default: a temporary directory)")
    ap.add_argument("--commits", type=int, default=4000)
    args = ap.parse_args()
    if args.commits < 1:
        ap.error("--commits must be at least 1")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        conn = sqlite3.connect(os.path.join(d, "floor.db"), isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE kv (key BLOB PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID")
        n = args.commits
        cases = [
            _case(conn, "1 row", lambda i: [(b"a" + i.to_bytes(8, "big"), VALUE)], n),
            _case(conn, "8 rows, 1 page", lambda i: [(b"b" + i.to_bytes(8, "big") + bytes([r]), VALUE)
                                                     for r in range(8)], n),
            _case(conn, "8 rows, 2 pages", lambda i: [(bytes([0x30 + r % 2]) + i.to_bytes(8, "big") + bytes([r]), VALUE)
                                                      for r in range(8)], n),
            _case(conn, "8 rows, 8 pages", lambda i: [(bytes([0x10 + r]) + i.to_bytes(8, "big"), VALUE)
                                                      for r in range(8)], n),
            _case(conn, "empty", lambda i: [], n),
        ]
        conn.close()
    where = args.dir or tempfile.gettempdir()
    print(f"SQLite {sqlite3.sqlite_version}, database in {where}, {n:,} commits per case")
    print("| commit | commits/s | CPU µs per commit | wall µs per commit |")
    print("|---|---:|---:|---:|")
    for label, rate, cpu, wall in cases:
        print(f"| {label} | {rate:,.0f} | {cpu:.0f} | {wall:.0f} |")


if __name__ == "__main__":
    main()
