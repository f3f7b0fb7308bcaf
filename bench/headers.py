"""Benchmark of extend headers: push and consume msgs/s with 3 small headers vs none.

Run::

    python bench/headers.py             # 3 rounds x 20,000 messages per case, ~1 min
    python bench/headers.py --quick     # 1 round x 5,000 messages
    python bench/headers.py --markdown  # the table in markdown, for bench/RESULTS.md
    python bench/headers.py --json
    python bench/headers.py --profile push|consume   # cProfile of the headers case

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


def run_case(case: str, n: int, max_s: float, directory: str) -> dict:
    path = tempfile.mkdtemp(prefix=f"fdq-bench-headers-{case}-", dir=directory)
    try:
        db = fdq.connect(f"sqlite://{path}/fdq.db")
        extend = case != "plain"
        fdq.Supervisor(db).create_topic("bench", shards=16, extend=extend)
        producer = fdq.Producer(db)
        pushed, t0 = 0, perf_counter()
        while pushed < n and perf_counter() - t0 < max_s:
            envs = [fdq.Envelope(BODY, headers=headers_for(case, pushed + j)) for j in range(BATCH)]
            producer.push_many("bench", envs)
            pushed += BATCH
        push_s = perf_counter() - t0
        consumer = fdq.Consumer(db, "bench", extend_support=extend,
                                config=fdq.ConsumerConfig(heartbeat_interval_s=1.0))
        try:
            if case == "extend-3h-tag":   # the tag's shards get their owner within a heartbeat
                deadline = time.monotonic() + 10
                while not any(t == "tag-a" for t, _n in consumer.owned_shards) and time.monotonic() < deadline:
                    time.sleep(0.05)
            got, t0 = 0, perf_counter()
            while got < pushed and perf_counter() - t0 < max_s:
                msgs = consumer.fetch(BATCH, timeout=1.0)
                if msgs:
                    consumer.ack_many(msgs)
                    got += len(msgs)
            consume_s = perf_counter() - t0
        finally:
            consumer.close()
        return {"pushed": pushed, "push_msgs_s": pushed / push_s, "consumed": got,
                "consume_msgs_s": got / consume_s if consume_s else 0.0}
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


def bench(rounds: int, n: int, max_s: float, directory: str) -> dict:
    samples = {c: [] for c in CASES}
    for r in range(rounds):
        for case in CASES:
            res = run_case(case, n, max_s, directory)
            samples[case].append(res)
            progress(f"round {r + 1}/{rounds} {case}: push {res['push_msgs_s']:,.0f} msgs/s, "
                     f"consume {res['consume_msgs_s']:,.0f} msgs/s ({res['consumed']}/{res['pushed']})")
    out = {}
    for case, rs in samples.items():
        out[case] = {"push_msgs_s": statistics.median(r["push_msgs_s"] for r in rs),
                     "consume_msgs_s": statistics.median(r["consume_msgs_s"] for r in rs),
                     "messages": rs[0]["pushed"], "all_consumed": all(r["consumed"] == r["pushed"] for r in rs),
                     "push_samples": [round(r["push_msgs_s"]) for r in rs],
                     "consume_samples": [round(r["consume_msgs_s"]) for r in rs]}
    ref, plain = out["extend-none"], out["plain"]
    for case, c in out.items():
        for k in ("push_msgs_s", "consume_msgs_s"):
            c[k.replace("_msgs_s", "_ratio")] = c[k] / ref[k]
            c[k.replace("_msgs_s", "_ratio_plain")] = c[k] / plain[k]
    return {"machine": machine(), "rounds": rounds, "messages_per_case": n, "batch": BATCH,
            "body_bytes": len(BODY), "cases": out,
            "loadavg_at_end": os.getloadavg()}


def print_table(result, markdown=False):
    head = ["case", "push msgs/s", "push ratio", "consume msgs/s", "consume ratio", "samples push / consume"]
    rows = []
    for case, c in result["cases"].items():
        rows.append([case, f"{c['push_msgs_s']:,.0f}", f"{c['push_ratio']:.2f}",
                     f"{c['consume_msgs_s']:,.0f}", f"{c['consume_ratio']:.2f}",
                     f"{c['push_samples']} / {c['consume_samples']}"])
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
          f"{result['batch']}, {result['body_bytes']}-byte bodies; ratio = case / extend-none (median of rounds). "
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
    ap.add_argument("--max-s", type=float, default=20.0, help="bound per measured loop (seconds)")
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
