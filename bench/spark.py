"""Spark benchmark: batch reads (count, full scan to Arrow) with 1, 2 and 4 partitions,
against a plain Arrow scan of the same SQLite rows without FDQ (same run), Arrow vs tuple
batches, and streaming throughput and delay.

    python -m bench.spark                  # 1,000,000 messages (fill ~2-4 min on 2 cores)
    python -m bench.spark --messages 100000 --quick
    python -m bench.spark --db /tmp/fdq-bench.db   # keep the database between runs

Prints a markdown report (bench/RESULTS.md, Spark section). Every phase is bounded:
--budget seconds per Spark action (it is reported as a timeout, not waited out).
"""
from __future__ import annotations

import argparse
import shutil
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))

import fdq
from fdq import log
from fdq.keyspace import Keyspace

from bench._common import machine

TOPIC = "bench"
_FILL = r"""
import sys, fdq
url, topic, proc, count, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
db = fdq.connect(url)
p = fdq.Producer(db)
pad = b"x" * 80
for start in range(0, count, batch):
    envs = []
    for i in range(start, min(count, start + batch)):
        envs.append(fdq.Envelope(b"%d-%d-" % (proc, i) + pad, shard_key="k%d" % (i % 1000),
                                 headers={"n": i, "src": "bench"} if i % 3 == 0 else None))
    p.push_many(topic, envs)
"""


def fill(url: str, n: int, procs: int = 2, batch: int = 1000) -> float:
    db = fdq.connect(url)
    sup = fdq.Supervisor(db)
    if TOPIC in dict(sup.topics()):
        have = sup.stats(TOPIC)["counters"]["inserted"]
        if have >= n:   # a kept --db (a streaming run adds its live messages)
            return 0.0
        raise SystemExit(f"bench: {url} holds {have:,} messages in {TOPIC!r}, not {n:,}: use a new --db")
    sup.create_topic(TOPIC, shards=16, extend=True)
    t0 = time.monotonic()
    ps = [subprocess.Popen([sys.executable, "-c", _FILL, url, TOPIC, str(i), str(n // procs + (i < n % procs)),
                            str(batch)]) for i in range(procs)]
    for p in ps:
        if p.wait(timeout=1800) != 0:
            raise SystemExit("bench: a fill process failed")
    return time.monotonic() - t0


def raw_arrow_scan(path: str, url: str) -> tuple:
    """The physical reference: the log's rows read with plain sqlite3 into Arrow arrays
    (key, value), no FDQ, no decoding. -> (rows, seconds)."""
    import pyarrow as pa
    ts = Keyspace().topic(TOPIC)
    r = ts.log.range()
    conn = sqlite3.connect(path)
    t0, c0 = time.perf_counter(), time.process_time()
    cur = conn.execute("SELECT key, value FROM kv WHERE key >= ? AND key < ? ORDER BY key", (r.start, r.stop))
    n = 0
    while True:
        rows = cur.fetchmany(10000)
        if not rows:
            break
        keys, values = zip(*rows)
        batch = pa.RecordBatch.from_arrays([pa.array(keys, pa.binary()), pa.array(values, pa.binary())],
                                           names=["key", "value"])
        n += batch.num_rows
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    conn.close()
    return n, dt, cpu


def source_scan(url: str, fmt: str) -> tuple:
    """fdq.spark's read path without Spark (one process, the whole log): rows, seconds,
    CPU seconds."""
    import fdq.spark as fs
    o = fs.read_options({"url": url, "topic": TOPIC, "batchformat": fmt})
    db, ts, _ = fs._open_topic(o)
    plan = fs.plan_ranges(db, ts, log.log_buckets(db, ts), None, None, 1)
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for part in plan:
        for x in fs.read_partition(o, part):
            n += x.num_rows if fmt == "arrow" else 1
    return n, time.perf_counter() - t0, time.process_time() - c0


def timed(fn, budget: float):
    """Run fn in a thread; (result, seconds) or (None, None) past the budget."""
    box = {}

    def run():
        t0 = time.perf_counter()
        box["r"] = fn()
        box["t"] = time.perf_counter() - t0
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(budget)
    if th.is_alive():
        return None, None
    return box["r"], box["t"]


def ceiling_source(rows_total: int, parts: int, fmt: str = "fdq_ceiling"):
    """A Python data source with fdq's schema that yields pre-built Arrow batches (made
    once per task from synthetic rows like the bench's): what Spark itself costs to take
    rows from a Python source, the ceiling of any such reader on this machine."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class CeilingReader(DataSourceReader):
        def partitions(self):
            return [InputPartition(rows_total // parts) for _ in range(parts)]

        def read(self, partition):
            import fdq.spark as fs
            n = 4096
            cols = {"vs": b"".join(i.to_bytes(12, "big") for i in range(n)), "ts_ms": [1_763_860_000_000 + i for i in range(n)],
                    "shard_key": ["k%d" % (i % 1000) for i in range(n)],
                    "headers": [{"n": i, "src": "bench"} if i % 3 == 0 else None for i in range(n)],
                    "body": [b"0-%d-" % i + b"x" * 80 for i in range(n)], "msg_id": [None] * n,
                    "replay_of": [None] * n}
            batch = fs._to_arrow(fs._arrow_schema(), TOPIC, 0, cols)
            left = partition.value
            while left > 0:
                yield batch if left >= n else batch.slice(0, left)
                left -= n

    class Ceiling(DataSource):
        @classmethod
        def name(cls):
            return fmt

        def schema(self):
            import fdq.spark as fs
            return fs.SCHEMA

        def reader(self, schema):
            return CeilingReader()
    return Ceiling


def spark_session(cores: int):
    from pyspark.sql import SparkSession
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    s = (SparkSession.builder.master(f"local[{cores}]").appName("fdq-bench")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.driver.memory", "2g")
         .config("spark.python.authenticate.socketTimeout", "180s").config("spark.sql.shuffle.partitions", "4")
         .getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    import fdq.spark
    fdq.spark.register(s)
    return s


def streaming(spark, url: str, tmp: str, n: int, budget: float, max_per_trigger: int) -> dict:
    """Catch-up: read the log from earliest in micro-batches of maxRecordsPerTrigger;
    then live: a producer pushes at a steady rate while the query tails the log;
    delay = batch end time - each message's insertion time (the producer's clock, same
    host)."""
    from pyspark.sql import functions as F
    batches = []

    def sink(df, batch_id):
        t_start = time.time()
        row = df.agg(F.count("*").alias("n"), F.min("insertion_time").alias("lo"),
                     F.max("insertion_time").alias("hi"),
                     F.avg(F.col("insertion_time").cast("double")).alias("avg")).collect()[0]
        now = time.time()
        if row.n:
            batches.append({"id": batch_id, "n": row.n, "t": now, "t_start": t_start,
                            "delay_max": now - row.lo.timestamp(), "delay_min": now - row.hi.timestamp(),
                            "delay_avg": now - row.avg})

    def query(start, trigger_s, limit):
        return (spark.readStream.format("fdq").option("url", url).option("topic", TOPIC)
                .option("startingPosition", start).option("maxRecordsPerTrigger", str(limit))
                .option("numPartitions", "2").load()
                .writeStream.foreachBatch(sink).trigger(processingTime=f"{trigger_s} seconds")
                .option("checkpointLocation", os.path.join(tmp, f"ck-{start}")).start())
    out = {}
    q = query("earliest", 0, max_per_trigger)
    t0 = time.monotonic()
    while time.monotonic() - t0 < budget and sum(b["n"] for b in batches) < n:
        time.sleep(0.5)
    q.stop()
    done = sum(b["n"] for b in batches)
    if len(batches) >= 2:   # from the end of the first batch: steady state, no planning start-up
        span = batches[-1]["t"] - batches[0]["t"]
        out["catchup_rps"] = sum(b["n"] for b in batches[1:]) / span if span > 0 else None
    out["catchup_rows"], out["catchup_batches"] = done, len(batches)
    batches.clear()
    # Live: a producer at ~2,000 msg/s for 20 s, 1 s trigger.
    q = query("latest", 1, 100_000)
    time.sleep(3)
    rate_code = ("import sys,time,fdq; db=fdq.connect(sys.argv[1]); p=fdq.Producer(db)\n"
                 "t0=time.monotonic(); i=0\n"
                 "while time.monotonic()-t0 < 20:\n"
                 "    p.push_many('bench', [fdq.Envelope(b'live-%d' % (i+j), shard_key='k%d' % j) for j in range(100)]); i+=100\n"
                 "    time.sleep(max(0, t0 + i/2000 - time.monotonic()))\n"
                 "print(i)")
    pushed = int(subprocess.run([sys.executable, "-c", rate_code, url], capture_output=True, text=True,
                                timeout=120).stdout.strip() or 0)
    t1 = time.monotonic()
    while time.monotonic() - t1 < 60 and sum(b["n"] for b in batches) < pushed:
        time.sleep(0.5)
    q.stop()
    out["live_pushed"], out["live_read"] = pushed, sum(b["n"] for b in batches)
    if batches:
        out["live_batches"] = len(batches)
        out["delay_avg_p50"] = statistics.median(b["delay_avg"] for b in batches)
        out["delay_max_p50"] = statistics.median(b["delay_max"] for b in batches)
        out["delay_max_max"] = max(b["delay_max"] for b in batches)
        out["batch_rows_p50"] = statistics.median(b["n"] for b in batches)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--db", help="database file (default: a fresh temp file)")
    ap.add_argument("--budget", type=float, default=300, help="seconds per Spark action")
    ap.add_argument("--quick", action="store_true", help="skip tuples-in-Spark and streaming")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="rounds over the Spark batch cases (best and median)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fdq-bench-spark-")
    path = os.path.abspath(args.db or os.path.join(tmp, "fdq.db"))
    url = "sqlite://" + path
    fill_s = fill(url, args.messages)
    args.messages = fdq.Supervisor(fdq.connect(url)).stats(TOPIC)["counters"]["inserted"]
    if fill_s:
        print(f"filled {args.messages:,} messages in {fill_s:.0f} s ({args.messages / fill_s:,.0f} msg/s)",
              file=sys.stderr)
    rows = []
    import fdq.spark as fs
    o = fs.read_options({"url": url, "topic": TOPIC})
    db, ts, _ = fs._open_topic(o)
    plan_s = {}
    for parts in (1, 2, 4, 16):
        t_plan = time.perf_counter()
        fs.plan_ranges(db, ts, log.log_buckets(db, ts), None, None, parts)
        plan_s[parts] = time.perf_counter() - t_plan
    # The reference and the read path alternately, best of --repeat (wall and CPU apart).
    best = {}
    for _round in range(args.repeat):
        for key, fn in (("ref", lambda: raw_arrow_scan(path, url)), ("arrow", lambda: source_scan(url, "arrow"))):
            n, dt, cpu = fn()
            b = best.setdefault(key, [n, dt, cpu])
            b[1], b[2] = min(b[1], dt), min(b[2], cpu)
    best["tuples"] = list(source_scan(url, "tuples"))
    n, dt, cpu = best["ref"]
    ref, ref_cpu = n / dt, n / cpu
    rows.append(("plain sqlite3 → Arrow (key, value), no FDQ: reference", n, dt, ref))
    cpu_rates = [("plain sqlite3 → Arrow: reference", ref_cpu)]
    for fmt in ("arrow", "tuples"):
        n, dt, cpu = best[fmt]
        rows.append((f"fdq.spark read path, no Spark, 1 process, {fmt}", n, dt, n / dt))
        cpu_rates.append((f"fdq.spark read path, {fmt}", n / cpu))
    spark = spark_session(4)
    load = lambda parts, fmt="arrow": (spark.read.format("fdq").option("url", url).option("topic", TOPIC)  # noqa: E731
                                       .option("numPartitions", str(parts)).option("batchFormat", fmt).load())
    load(4).count()   # warm up: start and import fdq in every Python worker
    cases = [(f"Spark count(), {parts} partition(s)", lambda parts=parts: load(parts).count()) for parts in (1, 2, 4)]
    cases += [(f"Spark full scan toArrow(), {parts} partition(s)", lambda parts=parts: load(parts).toArrow().num_rows)
              for parts in (1, 2, 4)]
    for parts in (1, 2):
        fmt = f"fdq_ceiling{parts}"
        spark.dataSource.register(ceiling_source(args.messages, parts, fmt))
        cases.append((f"ceiling: Spark count() of pre-built Arrow batches, {parts} partition(s)",
                      lambda fmt=fmt: spark.read.format(fmt).load().count()))
    if not args.quick:
        cases.append(("Spark count(), 2 partitions, tuples", lambda: load(2, "tuples").count()))
    # Rounds over all cases (not each case N times in a row): load from other processes
    # on a shared machine then spreads over the cases instead of hitting one.
    times = {name: [] for name, _ in cases}
    counts = {}
    for _round in range(args.repeat):
        for name, fn in cases:
            r, dt = timed(fn, args.budget)
            if r is not None:
                times[name].append(dt)
                counts[name] = r
    for name, _ in cases:
        ts_ = sorted(times[name])
        if not ts_:
            rows.append((name, None, None, None))
            continue
        rows.append((name, counts[name], ts_[0], counts[name] / ts_[0], statistics.median(ts_)))
    stream = None
    if not (args.quick or args.no_stream):
        stream = streaming(spark, url, tmp, args.messages, args.budget, 100_000)
    spark.stop()
    shutil.rmtree(tmp, ignore_errors=True)   # checkpoints, and the database unless --db

    print(f"* Machine: {machine()}, {platform.system()} {platform.release()}, "
          f"load average at the end {os.getloadavg()[0]:.1f}")
    import pyspark
    print(f"* pyspark {pyspark.__version__}, Spark local[4] (2 cores), {args.messages:,} messages "
          f"(~100-byte bodies, 1/3 with headers, 16 buckets)")
    print()
    print(f"Spark cases: best of {args.repeat} rounds (rows/s and its share of the reference), and the median.")
    print()
    print("| case | rows | seconds | rows/s | of reference | median rows/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r, dt, rps, *med in rows:
        if r is None:
            print(f"| {name} | timeout ({args.budget:.0f} s) | | | | |")
        else:
            m = f"{r / med[0]:,.0f}" if med else ""
            print(f"| {name} | {r:,} | {dt:.2f} | {rps:,.0f} | {rps / ref:.2f} | {m} |")
    print()
    print("| in-process case (same run) | rows per CPU-second | of reference |")
    print("|---|---:|---:|")
    for name, rate in cpu_rates:
        print(f"| {name} | {rate:,.0f} | {rate / ref_cpu:.2f} |")
    print("\nPartition planning (log_buckets + plan_ranges, whole log): "
          + ", ".join(f"{p} partition(s) {t:.2f} s" for p, t in plan_s.items()))
    if stream:
        print()
        print("| streaming | value |")
        print("|---|---:|")
        for k, v in stream.items():
            print(f"| {k} | {v:,.2f} |" if isinstance(v, float) else f"| {k} | {v:,} |")


if __name__ == "__main__":
    main()
