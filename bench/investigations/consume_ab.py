"""Same-process A/B of the consuming path of two FDQ source trees (e.g. main and a branch).

Both trees' ``fdq`` packages are imported side by side in this process (under the names
``fdq_a`` and ``fdq_b``: the package imports itself only relatively), each gets its own
temporary database with the same preloaded backlog (100-byte bodies, 16 shards) and a
``tail`` consumer whose background worker is kept idle: this thread runs the consumers'
rounds itself, ``--step`` messages of A, then of B, then B, then A, and so on, and sums the
thread CPU time each side spent. Alternating every few milliseconds puts both sides under
the same machine load, which a shared 2-core VM changes from second to second: the ratio
holds where wall-clock rates and separate runs do not.

    python -m bench.investigations.consume_ab --a /work/main --b . --mode at_most_once
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

BODY = b"x" * 100
FAST = dict(heartbeat_interval_s=0.25, zombie_timeout_s=1.5, poll_interval_s=0.05, lease_check_interval_s=0.25)


def _setup(fdq, path, total, mode, count):
    db = fdq.connect(f"sqlite://{path}/q.db")
    sup = fdq.Supervisor(db)
    sup.create_topic("c", shards=16)
    p = fdq.Producer(db)
    for i in range(0, total, 500):
        p.push_many("c", [fdq.Envelope(BODY, shard_key=f"k{j % 1000}") for j in range(i, min(total, i + 500))])

    def handler(*_a):
        count[0] += 1
    kw = {"transactional": True} if mode == "exactly_once" else {"acking": mode == "at_least_once"}
    cls = getattr(fdq, "tailing", fdq.consumer).TailConsumer      # (fdq.consumer's before issue 22)
    loop = cls._work_loop
    cls._work_loop = lambda self: None      # its worker returns at once: we run the rounds
    try:
        c = fdq.tail(db, "c", handler, config=fdq.ConsumerConfig(**FAST), **kw)
    finally:
        cls._work_loop = loop
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(c.owned_shards) < 16:
        time.sleep(0.01)
    return c


def _run_until(c, count, upto, seconds=60):
    """One side's rounds as its worker would run them, until ``upto`` messages; -> CPU s."""
    t0, deadline = time.thread_time(), time.monotonic() + seconds
    while count[0] < upto and time.monotonic() < deadline:
        shards = c._next_shards()
        if shards:
            if c.mode == "exactly_once":
                for s in shards:
                    c._visit([s])
            else:
                c._visit(shards)
        elif c._carried:
            c._flush_carried()
        else:
            c._idle(c._idle_for())
    c._flush_carried()
    if count[0] < upto:
        raise SystemExit(f"stuck at {count[0]} of {upto} messages")
    return time.thread_time() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="source tree A (holds fdq/)")
    ap.add_argument("--b", required=True, help="source tree B")
    ap.add_argument("--mode", default="at_most_once", choices=("at_most_once", "at_least_once", "exactly_once"))
    ap.add_argument("--messages", type=int, default=30_000)
    ap.add_argument("--step", type=int, default=1_000)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    links = tempfile.mkdtemp(prefix="fdq-ab-")
    os.symlink(os.path.abspath(os.path.join(args.a, "fdq")), os.path.join(links, "fdq_a"))
    os.symlink(os.path.abspath(os.path.join(args.b, "fdq")), os.path.join(links, "fdq_b"))
    sys.path.insert(0, links)
    import fdq_a
    import fdq_b
    sides = {"a": fdq_a, "b": fdq_b}
    cpu, ratios = {"a": 0.0, "b": 0.0}, []
    try:
        for _rep in range(args.reps):
            dirs = {s: tempfile.mkdtemp(prefix=f"fdq-ab-{s}-") for s in sides}
            count = {s: [0] for s in sides}
            cons = {s: _setup(m, dirs[s], args.messages, args.mode, count[s]) for s, m in sides.items()}
            try:
                for i, upto in enumerate(range(args.step, args.messages + 1, args.step)):
                    got = {}
                    for s in (("a", "b") if i % 2 == 0 else ("b", "a")):
                        got[s] = _run_until(cons[s], count[s], upto)
                        cpu[s] += got[s]
                    ratios.append(got["b"] / got["a"])
            finally:
                for c in cons.values():
                    c.shutdown()
                for d in dirs.values():
                    shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(links, ignore_errors=True)
    n = args.messages * args.reps
    print(json.dumps({"mode": args.mode, "a_cpu_s_per_10k": cpu["a"] * 1e4 / n, "b_cpu_s_per_10k": cpu["b"] * 1e4 / n,
                      "b_over_a_cpu": cpu["b"] / cpu["a"], "median_step_ratio": statistics.median(ratios),
                      "steps": len(ratios)}))


if __name__ == "__main__":
    main()
