"""Replay a window of an FDQ topic with Spark: to Parquet, or re-published to a topic.

    spark-submit spark/replay_job.py --url sqlite:///data/fdq.db --topic orders \\
        --start 2026-11-01T00:00:00Z --end 2026-11-02T00:00:00Z --shard-key cust-42 --parquet out/
    python spark/replay_job.py --url ... --topic orders --to-topic orders-replay

Reads the topic's "all" log in ``[start, end)`` through ``format("fdq")`` (fdq.spark),
optionally keeps only messages with one of the ``--shard-key`` values and/or a header
``--header NAME=VALUE`` (non-string header values compare as their JSON), then writes
Parquet (all columns) or pushes body, shard_key and headers to ``--to-topic`` through the
fdq writer (idempotent per ``--write-id``). Progress goes to stderr; on error it exits 1
with one line.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time


def parse_args(argv):
    p = argparse.ArgumentParser(prog="replay_job", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="FDQ database URL (sqlite:///path or fdb://...)")
    p.add_argument("--topic", required=True, help="topic to read")
    p.add_argument("--start", help="window start, inclusive (ISO-8601, <n>s, <n>ms; a bare number is epoch ms)")
    p.add_argument("--end", help="window end, exclusive (as --start)")
    p.add_argument("--shard-key", action="append", default=[], help="keep this shard key (repeatable)")
    p.add_argument("--header", action="append", default=[], metavar="NAME=VALUE",
                   help="keep messages whose header NAME equals VALUE (repeatable: all must match)")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--parquet", metavar="DIR", help="write Parquet here")
    out.add_argument("--to-topic", metavar="TOPIC", help="re-publish to this topic")
    p.add_argument("--to-url", help="database of --to-topic (default: --url)")
    p.add_argument("--write-id", help="idempotency id of the re-publish (re-running with the same "
                                      "id within the topic's dedupe window pushes nothing twice)")
    p.add_argument("--partitions", type=int, help="read partitions (default: one per log bucket)")
    p.add_argument("--master", default=None, help="Spark master when run with plain python (default local[*])")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p.parse_args(argv)


def _progress(spark, stop: threading.Event):
    """Print the running stages' task counts to stderr every 2 s."""
    tracker = spark.sparkContext.statusTracker()
    last = None
    while not stop.wait(2.0):
        parts = []
        for sid in tracker.getActiveStageIds():
            info = tracker.getStageInfo(sid)
            if info:
                parts.append(f"stage {sid}: {info.numCompletedTasks}/{info.numTasks} tasks")
        line = "; ".join(parts)
        if line and line != last:
            print(f"replay: {line}", file=sys.stderr, flush=True)
            last = line


def one_line(e: BaseException) -> str:
    """The FDQ error inside a Spark exception (which carries a whole Python traceback)."""
    text = str(e)
    m = re.findall(r"(?:fdq\.(?:errors|spark)\.\w+|\w*Error|\w*Exception): (fdq.*)", text)
    if m:
        return m[-1].strip()
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return f"{type(e).__name__}: {first}"


def run(args) -> int:
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import fdq.spark
    from fdq.spark import parse_time

    parse_time(args.start, "start")   # fail fast, before a Spark session is paid for
    parse_time(args.end, "end")
    for h in args.header:
        if "=" not in h:
            raise fdq.spark.SparkOptionError(f"fdq: --header must be NAME=VALUE, not {h!r}")
    builder = SparkSession.builder.appName("fdq-replay")
    if args.master or "PYSPARK_GATEWAY_PORT" not in os.environ:   # not under spark-submit
        builder = builder.master(args.master or "local[*]")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)   # workers import fdq too
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    fdq.spark.register(spark)
    stop = threading.Event()
    if not args.quiet:
        threading.Thread(target=_progress, args=(spark, stop), daemon=True).start()
    t0 = time.monotonic()
    try:
        reader = spark.read.format("fdq").option("url", args.url).option("topic", args.topic)
        if args.start:
            reader = reader.option("start", args.start)
        if args.end:
            reader = reader.option("end", args.end)
        if args.partitions:
            reader = reader.option("numPartitions", str(args.partitions))
        df = reader.load()
        if args.shard_key:
            df = df.filter(F.col("shard_key").isin(args.shard_key))
        for h in args.header:
            name, value = h.split("=", 1)
            df = df.filter(F.col("headers").getItem(name) == value)
        if args.parquet:
            df.write.mode("errorifexists").parquet(args.parquet)
            n = spark.read.parquet(args.parquet).count()
            where = args.parquet
        else:
            from fdq import Supervisor, connect
            to_url = args.to_url or args.url
            sup = Supervisor(connect(to_url))
            before = sup.stats(args.to_topic)["counters"]["inserted"]
            w = (df.select("body", "shard_key", "headers").write.format("fdq").mode("append")
                 .option("url", to_url).option("topic", args.to_topic))
            if args.write_id:
                w = w.option("writeId", args.write_id)
            w.save()
            n = sup.stats(args.to_topic)["counters"]["inserted"] - before
            where = f"topic {args.to_topic!r}"
    finally:
        stop.set()
    if not args.quiet:
        print(f"replay: {n:,} messages to {where} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    print(n)
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("replay_job: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, not a JVM stack trace
        print(f"replay_job: error: {one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
