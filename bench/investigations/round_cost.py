"""What one consumer round costs, by the number of shards that hold a message.

At 1,000 msgs/s a ``tail`` consumer mostly runs rounds of one to a few messages, each on
its own shard (unkeyed or many-keyed pushes spread over the shards). This measures such a
round as the at-least-once worker runs it (``TailConsumer._process_at_least_once``
without the handler): the previous round's acks carried into the lease transaction, one
message leased from each of ``k`` shards, the drained shards' watches set in that
transaction. Before each round (not timed) one ``push_many`` puts one message
on each of those ``k`` shards. Thread CPU time per round and per message, and SQL
statements per round (``set_trace_callback`` on the engine's connections, this thread
only; a second pass, so tracing does not bias the timing).

    python -m bench.investigations.round_cost [--shards 1,2,4,8,16] [--rounds 600] [--json]

What it showed when last run (2026-11-28; the figures are in bench/RESULTS.md's git
history): a fixed cost per round plus a cost per shard visited, both mostly Python in
the engine and the delivery code, not SQLite.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import shutil
import sys
import tempfile
import threading
import time

import fdq
from fdq.engine import sqlite as _engine

SHARDS = 16
BODY = b"x" * 100
CONFIG = dict(heartbeat_interval_s=0.25, zombie_timeout_s=1.5)


def _keys_by_shard(n: int) -> dict:
    """A shard key landing on each shard (FDQ's placement: blake2b-64 mod shards)."""
    keys, i = {}, 0
    while len(keys) < n:
        k = f"k{i}"
        h = int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "big")
        keys.setdefault(h % n, k)
        i += 1
    return keys


class _Statements:
    """Counts SQL statements run by this thread on connections opened after install()."""

    def __init__(self):
        self.on = False
        self.n = 0
        self.kinds = collections.Counter()
        self.thread = threading.current_thread()

    def install(self):
        orig = _engine._Store._open

        def _open(store, *a, **k):
            conn = orig(store, *a, **k)
            conn.set_trace_callback(self._seen)
            return conn
        _engine._Store._open = _open

    def _seen(self, sql):
        if self.on and threading.current_thread() is self.thread:
            self.n += 1
            self.kinds[sql.split(" ", 2)[0] if not sql.startswith("INSERT") else " ".join(sql.split(" ", 3)[:3])] += 1


def _rounds(c, owned, keys, p, k, rounds, stmts=None):
    shards = owned[:k]
    carried, cpu, msgs = [], 0, 0
    for _ in range(rounds):
        p.push_many("t", [fdq.Envelope(BODY, shard_key=keys[s[0][1]]) for s in shards])
        t = time.thread_time_ns()
        if stmts is not None:
            stmts.on = True
        out = c._lease_many(shards, 100, settlements=carried)
        if stmts is not None:
            stmts.on = False
        cpu += time.thread_time_ns() - t
        msgs += len(out)
        carried = [fdq.Settlement(m, fdq.Action.ACK) for m in out]
    if carried:
        c.settle(carried)
    return cpu, msgs


def measure(ks, rounds):
    stmts = _Statements()
    stmts.install()         # before connect: the engine's connections are traced
    d = tempfile.mkdtemp(prefix="fdq-round-")
    try:
        db = fdq.connect(f"sqlite:///{d}/q.db")
        fdq.Supervisor(db).create_topic("t", shards=SHARDS)
        p = fdq.Producer(db)
        c = fdq.Consumer(db, "t", config=fdq.ConsumerConfig(**CONFIG))
        deadline = time.monotonic() + 30
        while len(c._owned) < SHARDS and time.monotonic() < deadline:
            time.sleep(0.05)
        if len(c._owned) < SHARDS:
            raise SystemExit("the consumer did not take every shard within 30 s")
        owned = sorted(c._owned.items())       # [((tag, n), epoch)]
        keys = _keys_by_shard(SHARDS)
        rows = []
        for k in ks:
            print(f"round_cost: {k} shard(s), {rounds} rounds", file=sys.stderr, flush=True)
            _rounds(c, owned, keys, p, k, 20)                      # warm up
            cpu, msgs = _rounds(c, owned, keys, p, k, rounds)
            stmts.n, stmts.kinds = 0, collections.Counter()
            _rounds(c, owned, keys, p, k, min(rounds, 200), stmts)
            traced = min(rounds, 200)
            rows.append({"shards": k, "rounds": rounds, "msgs": msgs,
                         "us_per_round": round(cpu / rounds / 1e3, 1),
                         "us_per_msg": round(cpu / max(msgs, 1) / 1e3, 1),
                         "statements_per_round": round(stmts.n / traced, 1),
                         "statements": {s: round(n / traced, 2) for s, n in stmts.kinds.most_common()}})
        c.close()
        return rows
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", default="1,2,4,8,16", help="comma-separated shard counts per round")
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    ks = [int(x) for x in a.shards.split(",")]
    if not ks or any(k < 1 or k > SHARDS for k in ks) or not 1 <= a.rounds <= 100_000:
        ap.error(f"--shards takes 1..{SHARDS}, --rounds 1..100000")
    rows = measure(ks, a.rounds)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print("| shards with a message | µs CPU per round | µs per message | SQL statements per round |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shards']} | {r['us_per_round']:,.0f} | {r['us_per_msg']:,.0f} | {r['statements_per_round']} |")
    if len(rows) > 1:
        a0, a1 = rows[0], rows[-1]
        per = (a1["us_per_round"] - a0["us_per_round"]) / (a1["shards"] - a0["shards"])
        print(f"\n~{a0['us_per_round'] - per * a0['shards']:,.0f} µs per round plus ~{per:,.0f} µs per shard visited "
              f"(line through the first and last rows)")


if __name__ == "__main__":
    main()
