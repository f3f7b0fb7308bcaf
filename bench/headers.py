"""Benchmark of extend headers: push and consume msgs/s with 3 small headers vs none.

Run::

    python -m bench.headers             # 3 rounds x 20,000 messages per case, ~1 min
    python -m bench.headers --quick     # 1 round x 5,000 messages
    python -m bench.headers --markdown  # the table in markdown, for bench/RESULTS.md
    python -m bench.headers --json
    python -m bench.headers --profile push|consume   # cProfile of the headers case

Cases, measured in the same run, rounds interleaved (so machine load hits all alike),
each on a fresh embedded database (``sqlite://`` in a temporary directory):

* ``plain``: a plain topic, no headers (the reference).
* ``extend-none``: an extend topic, no headers.
* ``extend-3h``: an extend topic, 3 small headers per message
  (``{"content-type": "application/json", "source": "svc-orders", "seq": <int>}``).
* ``extend-3h-tag``: as ``extend-3h`` plus ``##client_dispatch_tag`` (4 headers; the
  messages go to the tag's shards; consumed by an untagged consumer, by fallback).

Push: ``Producer.push_many`` of 100 envelopes (built, so validated, inside the timed
loop), msgs/s. Consume: one ``Consumer`` (at-least-once), ``fetch(100)`` +
``ack_many``, until every message is consumed, msgs/s. Bodies are 100 bytes. Each
measured loop is bounded in messages and in seconds (``--max-s``). Reported: the median
over rounds, and the ratio to ``extend-none`` (and to ``plain``).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from time import perf_counter

import fdq

BODY = b"x" * 100
BATCH = 100
CASES = ("plain", "extend-none", "extend-3h", "extend-3h-tag")


def headers_for(case: str, i: int):
    if case in ("plain", "extend-none"):
        return None
    h = {"content-type": "application/json", "source": "svc-orders", "seq": i}
    if case == "extend-3h-tag":
        h["##client_dispatch_tag"] = "tag-a"
    return h


def progress(msg: str):
    print(f"[bench/headers] {msg}", file=sys.stderr, flush=True)


def run_all(n: int, max_s: float, directory: str) -> dict:
    """Every case in one database (one topic each), measured batch by batch in rotation,
    so load from elsewhere on the machine hits every case alike. Each batch is timed on
    the wall clock and on this thread's CPU clock (``time.thread_time``: the engine's
    SQLite calls run in this thread; other processes' load barely moves it)."""
    path = tempfile.mkdtemp(prefix="fdq-bench-headers-", dir=directory)
    try:
        db = fdq.connect(f"sqlite://{path}/fdq.db")
        sup = fdq.Supervisor(db)
        for case in CASES:
            sup.create_topic(case, shards=16, extend=case != "plain")
        producer = fdq.Producer(db)
        wall = {c: [0.0, 0.0] for c in CASES}   # [push, consume]
        cpu = {c: [0.0, 0.0] for c in CASES}
        pushed = dict.fromkeys(CASES, 0)
        t_start = perf_counter()
        rnd = 0
        while min(pushed.values()) < n and perf_counter() - t_start < max_s:
            order = CASES[rnd % len(CASES):] + CASES[:rnd % len(CASES)]
            rnd += 1
            for case in order:
                w0, c0 = perf_counter(), time.thread_time()
                envs = [fdq.Envelope(BODY, headers=headers_for(case, pushed[case] + j)) for j in range(BATCH)]
                producer.push_many(case, envs)
                wall[case][0] += perf_counter() - w0
                cpu[case][0] += time.thread_time() - c0
                pushed[case] += BATCH
        consumers = {c: fdq.Consumer(db, c, extend_support=c != "plain",
                                     config=fdq.ConsumerConfig(heartbeat_interval_s=0.5))
                     for c in CASES}
        got = dict.fromkeys(CASES, 0)
        try:
            # The tag's shards get their owner within a heartbeat of the consumer's loop.
            deadline = time.monotonic() + 10
            while not any(t == "tag-a" for t, _n in consumers["extend-3h-tag"].owned_shards) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            t_start = perf_counter()
            rnd = 0
            while any(got[c] < pushed[c] for c in CASES) and perf_counter() - t_start < max_s:
                order = CASES[rnd % len(CASES):] + CASES[:rnd % len(CASES)]
                rnd += 1
                for case in order:
                    if got[case] >= pushed[case]:
                        continue
                    c = consumers[case]
                    w0, c0 = perf_counter(), time.thread_time()
                    msgs = c.fetch(BATCH, timeout=1.0)
                    if msgs:
                        c.ack_many(msgs)
                    wall[case][1] += perf_counter() - w0
                    cpu[case][1] += time.thread_time() - c0
                    got[case] += len(msgs)
        finally:
            for c in consumers.values():
                c.close()
        return {case: {"pushed": pushed[case], "consumed": got[case],
                       "push_msgs_s": pushed[case] / wall[case][0],
                       "consume_msgs_s": got[case] / wall[case][1],
                       "push_msgs_cpu_s": pushed[case] / cpu[case][0],
                       "consume_msgs_cpu_s": got[case] / cpu[case][1]} for case in CASES}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_at_start": load}


METRICS = ("push_msgs_s", "push_msgs_cpu_s", "consume_msgs_s", "consume_msgs_cpu_s")


def bench(rounds: int, n: int, max_s: float, directory: str) -> dict:
    samples = {c: [] for c in CASES}
    for r in range(rounds):
        res = run_all(n, max_s, directory)
        for case in CASES:
            samples[case].append(res[case])
            progress(f"round {r + 1}/{rounds} {case}: push {res[case]['push_msgs_s']:,.0f} msgs/s "
                     f"({res[case]['push_msgs_cpu_s']:,.0f}/cpu-s), consume {res[case]['consume_msgs_s']:,.0f} "
                     f"msgs/s ({res[case]['consume_msgs_cpu_s']:,.0f}/cpu-s) "
                     f"({res[case]['consumed']}/{res[case]['pushed']})")
    out = {}
    for case, rs in samples.items():
        out[case] = {k: statistics.median(r[k] for r in rs) for k in METRICS}
        out[case].update(messages=rs[0]["pushed"], all_consumed=all(r["consumed"] == r["pushed"] for r in rs))
    ref = out["extend-none"]
    for case, c in out.items():
        for k in METRICS:
            c[k.replace("_msgs", "_ratio")] = c[k] / ref[k]
    return {"machine": machine(), "rounds": rounds, "messages_per_case": n, "batch": BATCH,
            "body_bytes": len(BODY), "cases": out, "loadavg_at_end": os.getloadavg()}


def print_table(result, markdown=False):
    head = ["case", "push msgs/s", "ratio", "push msgs/cpu-s", "ratio",
            "consume msgs/s", "ratio", "consume msgs/cpu-s", "ratio", "all consumed"]
    rows = []
    for case, c in result["cases"].items():
        rows.append([case] + [x for k in METRICS for x in (f"{c[k]:,.0f}", f"{c[k.replace('_msgs', '_ratio')]:.2f}")]
                    + [str(c["all_consumed"])])
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        for r in [head] + rows:
            print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))
    m = result["machine"]
    print(f"\n{result['rounds']} rounds x {result['messages_per_case']:,} messages, push_many of "
          f"{result['batch']}, {result['body_bytes']}-byte bodies; ratio = case / extend-none (median of rounds; "
          f"cpu-s = the measuring thread's CPU time). "
          f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, load {m['loadavg_at_start']} -> "
          f"{tuple(round(x, 2) for x in result['loadavg_at_end'])}")


def profile(which: str, n: int, directory: str):
    path = tempfile.mkdtemp(prefix="fdq-bench-headers-prof-", dir=directory)
    try:
        db = fdq.connect(f"sqlite://{path}/fdq.db")
        fdq.Supervisor(db).create_topic("bench", shards=16, extend=True)
        producer = fdq.Producer(db)
        prof = cProfile.Profile()

        def push():
            for i in range(0, n, BATCH):
                producer.push_many("bench", [fdq.Envelope(BODY, headers=headers_for("extend-3h", i + j))
                                             for j in range(BATCH)])
        if which == "push":
            prof.runcall(push)
        else:
            push()
            c = fdq.Consumer(db, "bench", extend_support=True)

            def consume():
                got = 0
                while got < n:
                    msgs = c.fetch(BATCH, timeout=1.0)
                    c.ack_many(msgs)
                    got += len(msgs)
            prof.runcall(consume)
            c.close()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 5,000 messages per case")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--messages", type=int, default=None, help="messages per case and round")
    ap.add_argument("--max-s", type=float, default=40.0, help="bound per measured loop (seconds)")
    ap.add_argument("--dir", default=None, help="where the temporary databases go")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--profile", choices=("push", "consume"))
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    n = args.messages or (5_000 if args.quick else 20_000)
    if args.profile:
        profile(args.profile, n, args.dir)
        return
    result = bench(rounds, n, args.max_s, args.dir)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result, markdown=args.markdown)


if __name__ == "__main__":
    main()
