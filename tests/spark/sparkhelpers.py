"""Helpers of the Spark tests: a local Spark session (one for the whole directory, see
conftest.py), topics filled by producer processes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install -e '.[test]')")
pytest.importorskip("pyarrow", reason="pyarrow is not installed")

if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
    pytest.skip("Java (17+) is not installed: Spark needs a JVM", allow_module_level=True)

import fdq  # noqa: E402
import fdq.spark  # noqa: E402
from fdqtest import WORKERS, wait_for  # noqa: F401 - wait_for re-exported to this directory's tests

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def make_session(master: str = "local[2]", **conf):
    from pyspark.sql import SparkSession
    os.environ["PYSPARK_PYTHON"] = sys.executable   # workers must import this fdq
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    b = (SparkSession.builder.master(master).appName("fdq-tests")
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.python.worker.reuse", "true")
         # Python workers that start slowly on a loaded machine must not time out.
         .config("spark.python.authenticate.socketTimeout", "180s"))
    for k, v in conf.items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    fdq.spark.register(spark)
    return spark


def start_producers(url: str, topic: str, procs: int, per_proc: int, out_dir, *,
                    batch: int = 500, pause_ms: int = 0) -> list:
    """Start ``procs`` producer processes (``tests/workers`` role ``spark-producer``);
    returns [(Popen, output file)]."""
    ps = []
    for i in range(procs):
        out = os.path.join(str(out_dir), f"pushed-{topic}-{i}.jsonl")
        ps.append((subprocess.Popen([sys.executable, str(WORKERS), "spark-producer", "--url", url, "--name", f"p{i}",
                                     "--out", out, "--topic", topic, "--proc", str(i), "--count", str(per_proc),
                                     "--batch", str(batch), "--pause-ms", str(pause_ms)]), out))
    return ps


def wait_producers(ps, timeout: float = 300.0) -> list:
    """Wait for the producer processes; returns every message they pushed: dicts of id,
    body (base64), shard_key, headers."""
    deadline = time.monotonic() + timeout
    try:
        for p, _out in ps:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, f"producer process exited {p.returncode}"
    finally:
        for p, _out in ps:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [m for _p, out in ps for m in read_pushed(out)]


def push_with_processes(url: str, topic: str, procs: int, per_proc: int, out_dir, *,
                        batch: int = 500, pause_ms: int = 0, timeout: float = 300.0) -> list:
    """Run producer processes at once and wait for them (see start_producers)."""
    return wait_producers(start_producers(url, topic, procs, per_proc, out_dir, batch=batch,
                                          pause_ms=pause_ms), timeout)


def read_pushed(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f]


def run_query(start, cond, timeout: float, what: str):
    """Start a streaming query (``start()``) and wait until ``cond(query)``. Spark gives a
    Python streaming source 10 s (hard-coded) to connect back to the JVM; on a machine
    starved of CPU that start-up can miss it and the query dies before its first batch:
    then it is started again (from its checkpoint, if it has one), at most 3 times.
    Any other failure fails the test."""
    q, restarts = start(), 0
    deadline = time.monotonic() + timeout
    while True:
        if q.isActive and cond(q):
            return q
        if not q.isActive:
            exc = q.exception()
            if exc is not None and "connect back" in str(exc) and restarts < 3:
                restarts += 1
                q = start()
                continue
            if cond(q):
                return q
            raise AssertionError(f"streaming query stopped while waiting for {what}: {exc}")
        if time.monotonic() > deadline:
            q.stop()
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.3)
