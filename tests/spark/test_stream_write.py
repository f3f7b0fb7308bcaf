"""Streaming reads, the writer (with a task retry) and the replay job."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import fdq
import fdq.spark as fs
from fdq import log
from fdq.keyspace import Keyspace

import sparkhelpers  # noqa: F401 - skips this module without pyspark, pyarrow or Java
from fdqtest import database_url
from sparkhelpers import ROOT, run_query, start_producers, wait_for, wait_producers


# The session (tests/spark/conftest.py) runs local[2,4]: up to 4 attempts per task, so a
# failed task is retried (the writer test). Arrow batches of 200 rows in this module.
ARROW_BATCH_CONF = "spark.sql.execution.arrow.maxRecordsPerBatch"


@pytest.fixture(autouse=True, scope="module")
def _small_arrow_batches(spark):
    old = spark.conf.get(ARROW_BATCH_CONF)
    spark.conf.set(ARROW_BATCH_CONF, "200")
    yield
    for q in spark.streams.active:
        q.stop()
    spark.conf.set(ARROW_BATCH_CONF, old)


def _stream(spark, url, topic, sink_dir, ck_dir, **opts):
    r = spark.readStream.format("fdq").option("url", url).option("topic", topic)
    for k, v in opts.items():
        r = r.option(k, str(v))
    return (r.load().select("id", "body", "insertion_time").writeStream.format("parquet")
            .option("path", sink_dir).option("checkpointLocation", ck_dir)
            .trigger(processingTime="0.5 seconds").start())


def _rows_in(q) -> int:
    return sum(p["numInputRows"] for p in q.recentProgress)


@pytest.mark.slow
def test_stream_reads_every_message_once_across_a_restart(spark, tmp_path):
    url = database_url(tmp_path / "fdq.db")
    fdq.Supervisor(fdq.connect(url)).create_topic("live", shards=8, extend=True)
    sink, ck = str(tmp_path / "sink"), str(tmp_path / "ck")
    ps = start_producers(url, "live", 3, 4000, tmp_path, batch=50, pause_ms=10)
    start = lambda: _stream(spark, url, "live", sink, ck, maxRecordsPerTrigger=1500, numPartitions=2)  # noqa: E731
    sunk = lambda: spark.read.parquet(sink).count() if os.path.isdir(os.path.join(sink, "_spark_metadata")) else 0  # noqa: E731
    try:
        q = run_query(start, lambda q: sum(1 for p in q.recentProgress if p["numInputRows"]) >= 2, 180,
                      "two micro-batches")
        q.stop()
        assert all(p["numInputRows"] <= 1500 for p in q.recentProgress)  # maxRecordsPerTrigger
        first = sunk()
        assert 0 < first < 12_000
        # Restart from the checkpoint, producers still pushing (12,000 > 3 batches).
        q = run_query(start, lambda q: q.recentProgress, 180, "the restarted query")
        pushed = wait_producers(ps, 240)
        want = {m["id"] for m in pushed}
        q = run_query(lambda: q, lambda q: sunk() >= len(want), 240, "the stream to catch up")
        q.stop()
    finally:
        for p, _ in ps:
            if p.poll() is None:
                p.kill()
    ids = spark.read.parquet(sink).select("id").toArrow().column("id").to_pylist()
    assert len(ids) == len(want), f"{len(ids) - len(set(ids))} duplicates"
    assert set(ids) == want


@pytest.mark.slow
def test_starting_positions_latest_and_time(spark, tmp_path):
    url = database_url(tmp_path / "fdq.db")
    db = fdq.connect(url)
    fdq.Supervisor(db).create_topic("pos")
    p = fdq.Producer(db)
    p.push_many("pos", [b"old-%d" % i for i in range(200)])
    time.sleep(0.01)
    t_ms = int(time.time() * 1000)
    time.sleep(0.01)
    p.push_many("pos", [b"mid-%d" % i for i in range(100)])
    def query(name, start):
        return (spark.readStream.format("fdq").option("url", url).option("topic", "pos")
                .option("startingPosition", start).load().writeStream.format("memory")
                .queryName(name).trigger(processingTime="0.5 seconds").start())
    count = lambda name: spark.table(name).count()  # noqa: E731
    q = run_query(lambda: query("from_latest", "latest"), lambda q: q.recentProgress, 120,
                  "a first batch")   # the start offset is fixed by then
    try:
        p.push_many("pos", [b"new-%d" % i for i in range(50)])
        wait_for(lambda: count("from_latest") >= 50, 120, "new messages")
        time.sleep(1.5)   # a few more triggers: nothing more may arrive
        latest = sorted(r.body for r in spark.table("from_latest").collect())
    finally:
        q.stop()
    q = run_query(lambda: query("from_time", str(t_ms)), lambda q: count("from_time") >= 150, 120,
                  "messages since the time")
    try:
        time.sleep(1.5)
        since = sorted(r.body for r in spark.table("from_time").collect())
    finally:
        q.stop()
    assert latest == sorted(b"new-%d" % i for i in range(50))
    assert since == sorted([b"mid-%d" % i for i in range(100)] + [b"new-%d" % i for i in range(50)])


def test_stream_option_errors(spark, tmp_path):
    url = database_url(tmp_path / "fdq.db")
    fdq.Supervisor(fdq.connect(url)).create_topic("t")
    for opt, value in [("startingPosition", "soon"), ("maxRecordsPerTrigger", "0")]:
        with pytest.raises(Exception) as ei:
            q = (spark.readStream.format("fdq").option("url", url).option("topic", "t").option(opt, value)
                 .load().writeStream.format("memory").queryName("bad").start())
            try:
                q.awaitTermination(60)
            finally:
                q.stop()
        assert f"option '{opt}'" in str(ei.value)
        # readStream...load() checks the values already
        with pytest.raises(Exception) as ei:
            spark.readStream.format("fdq").option("url", url).option("topic", "t").option(opt, value).load()
        assert f"option '{opt}'" in str(ei.value)


PAD = b"." * 300   # rows big enough that Spark's 64 KB stream buffers pass them on


def _flaky_body(url, topic, write_id, marker, fail_at):
    """A row UDF making the body; on attempt 0 of partition 1 it fails at row ``fail_at``,
    once the writer has pushed some of that partition's rows (a task dying mid-write)."""
    def body(i):
        from pyspark import TaskContext
        ctx = TaskContext.get()
        if i == fail_at and ctx.partitionId() == 1 and ctx.attemptNumber() == 0:
            db = fdq.connect(url)
            ts = Keyspace().topic(topic)
            prefix = f"spark:{write_id}:1:"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if any(rec.msg_id and rec.msg_id.startswith(prefix)
                       for _vs, _b, rec in log.iter_window(db, ts, 16, None, None)):
                    with open(marker, "w") as f:
                        f.write("partial write seen")
                    break
                time.sleep(0.2)
            raise RuntimeError("simulated task failure after a partial write")
        return b"w-%d-" % i + PAD
    return body


@pytest.mark.slow
def test_writer_round_trip_with_a_task_retry_has_no_duplicates(spark, tmp_path):
    from pyspark.sql import functions as F
    url = database_url(tmp_path / "fdq.db")
    db = fdq.connect(url)
    sup = fdq.Supervisor(db)
    sup.create_topic("out", extend=True)
    n = 12_000
    marker = str(tmp_path / "failed-once")
    body = F.udf(_flaky_body(url, "out", "job1", marker, 7000), "binary", useArrow=False)   # partition 1: 4000-7999
    df = (spark.range(0, n, 1, 3)
          .select(body("id").alias("body"),
                  F.concat(F.lit("k"), (F.col("id") % 13).cast("string")).alias("shard_key"),
                  F.create_map(F.lit("n"), F.col("id").cast("string")).alias("headers")))
    df.write.format("fdq").option("url", url).option("topic", "out").option("writeId", "job1") \
        .option("batchSize", "500").mode("append").save()
    assert os.path.exists(marker), "the first attempt did not fail after a partial write"
    assert sup.stats("out")["counters"]["inserted"] == n
    # A re-run of the whole job with the same writeId pushes nothing new.
    df.write.format("fdq").option("url", url).option("topic", "out").option("writeId", "job1").mode("append").save()
    assert sup.stats("out")["counters"]["inserted"] == n
    # What a consumer receives: every row once, with its shard key and headers.
    got = {}
    c = fdq.Consumer(db, "out", extend_support=True)
    try:
        deadline = time.monotonic() + 180
        while len(got) < n and time.monotonic() < deadline:
            msgs = c.fetch(500, timeout=1.0)
            for m in msgs:
                assert m.body not in got, f"duplicate {m.body!r}"
                got[m.body] = (m.shard_key, dict(m.headers))
            c.ack_many(msgs)
        assert c.fetch(100, timeout=1.0) == []
    finally:
        c.close()
    assert got == {b"w-%d-" % i + PAD: (f"k{i % 13}", {"n": str(i)}) for i in range(n)}


def test_writer_errors(spark, tmp_path):
    url = database_url(tmp_path / "fdq.db")
    fdq.Supervisor(fdq.connect(url)).create_topic("t")
    df = spark.createDataFrame([("a",)], "payload string")
    with pytest.raises(Exception) as ei:
        df.write.format("fdq").option("url", url).option("topic", "t").mode("append").save()
    assert "'body' column" in str(ei.value)
    ok = spark.createDataFrame([(b"a",)], "body binary")
    with pytest.raises(Exception) as ei:
        ok.write.format("fdq").option("url", url).option("topic", "missing").option("autoCreate", "false") \
            .mode("append").save()
    assert "option 'topic'" in str(ei.value) and "does not exist" in str(ei.value)
    with pytest.raises(Exception) as ei:
        ok.write.format("fdq").option("url", url).option("topic", "t").option("autoCreate", "maybe") \
            .mode("append").save()
    assert "option 'autoCreate' must be 'true' or 'false'" in str(ei.value)
    with pytest.raises(Exception) as ei:
        ok.write.format("fdq").option("url", url).option("topic", "t").mode("overwrite").save()
    assert "overwrite" in str(ei.value)
    with pytest.raises(Exception) as ei:
        spark.createDataFrame([(1,)], "body int").write.format("fdq").option("url", url) \
            .option("topic", "t").mode("append").save()
    assert "column 'body' must be binary or string, not int" in str(ei.value)
    # No dedupe window: a retried task would push its rows twice; refused unless asked for.
    db = fdq.connect(url)
    fdq.Supervisor(db).create_topic("nodedupe", dedupe_window_s=0)
    with pytest.raises(Exception) as ei:
        ok.write.format("fdq").option("url", url).option("topic", "nodedupe").mode("append").save()
    assert "dedupe_window_s = 0" in str(ei.value) and "option 'idempotent'" in str(ei.value)
    assert fdq.Supervisor(db).stats("nodedupe")["counters"]["inserted"] == 0
    ok.write.format("fdq").option("url", url).option("topic", "nodedupe").option("idempotent", "false") \
        .mode("append").save()
    assert fdq.Supervisor(db).stats("nodedupe")["counters"]["inserted"] == 1


@pytest.fixture()
def replay_topic(tmp_path):
    url = database_url(tmp_path / "fdq.db")
    db = fdq.connect(url)
    sup = fdq.Supervisor(db)
    sup.create_topic("src", extend=True)
    sup.create_topic("dst", extend=True)
    p = fdq.Producer(db)
    envs = [fdq.Envelope(b"m-%d" % i, shard_key=f"k{i % 5}", headers={"kind": "a" if i % 2 else "b", "i": i})
            for i in range(3000)]
    for i in range(0, len(envs), 500):
        p.push_many("src", envs[i:i + 500])
    return url, envs


@pytest.mark.slow
def test_replay_job_to_parquet_end_to_end(tmp_path, replay_topic):
    """spark/replay_job.py as a user runs it: its own process and Spark session."""
    url, envs = replay_topic
    out = tmp_path / "out.parquet"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "spark", "replay_job.py"), "--url", url,
                        "--topic", "src", "--shard-key", "k1", "--shard-key", "k2", "--master", "local[2]",
                        "--parquet", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    want = sorted(e.body for e in envs if e.shard_key in ("k1", "k2"))
    assert r.stdout.strip().splitlines()[-1] == str(len(want))
    assert "replay:" in r.stderr and "messages to" in r.stderr
    import pyarrow.parquet as pq
    assert sorted(pq.read_table(str(out)).column("body").to_pylist()) == want
    # Errors: one line, exit 1 (a bad time fails before Spark starts).
    r = subprocess.run([sys.executable, os.path.join(ROOT, "spark", "replay_job.py"), "--url", url,
                        "--topic", "src", "--start", "noon", "--parquet", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0
    assert "option 'start'" in r.stderr


@pytest.mark.slow
def test_replay_job_republishes_to_a_topic(spark, replay_topic, capsys):
    """The job's main() in this process (it reuses this module's session)."""
    url, envs = replay_topic
    sys.path.insert(0, os.path.join(ROOT, "spark"))
    try:
        import replay_job
    finally:
        sys.path.pop(0)
    assert replay_job.main(["--url", url, "--topic", "src", "--header", "kind=a", "--to-topic", "dst",
                            "--quiet"]) == 0
    want = sorted(e.body for e in envs if e.headers["kind"] == "a")
    assert capsys.readouterr().out.strip() == str(len(want))
    got = spark.read.format("fdq").option("url", url).option("topic", "dst").load()
    assert sorted(r.body for r in got.select("body").collect()) == want
    assert replay_job.main(["--url", url, "--topic", "nope", "--to-topic", "dst", "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err and "option 'topic'" in err, err


def test_a_write_creates_a_missing_topic_as_a_push_does(spark, tmp_path):
    """A producer's push creates a missing topic (``ProducerConfig.auto_create``, default
    True); the writer follows the same rule (option ``autoCreate``, default true)."""
    url = database_url(tmp_path / "fdq.db")
    spark.createDataFrame([(b"a",), (b"b",)], "body binary").write.format("fdq").option("url", url) \
        .option("topic", "fresh").mode("append").save()
    sup = fdq.Supervisor(fdq.connect(url))
    assert sup.config("fresh") == fdq.TopicConfig()
    assert sup.stats("fresh")["counters"]["inserted"] == 2


def _write(url, topic, bodies):
    import pyarrow as pa
    from pyspark.sql.types import BinaryType, StructField, StructType
    w = fs.FDQWriter(fs.write_options({"url": url, "topic": topic}),
                     StructType([StructField("body", BinaryType())]))
    rb = pa.record_batch([pa.array(bodies, pa.binary())], names=["body"])
    return w.write(iter([rb]))   # outside a task: partition 0


@pytest.mark.parametrize("subs, bodies", [
    (5, [b"x" * 60_000] * 40),                           # 2.4 MB of bodies, 6 copies each
    (5, [b"y" * 60_000] * 10 + [b"z" * 1_000_000] * 2),  # large ones after a partial batch
])
def test_writer_transactions_count_every_copy_a_push_writes(tmp_path, subs, bodies):
    """A push writes a message to the log and to each subscription: the writer's ~2 MB of
    bodies per push_many made transactions over FDB's 10 MB on a topic with 4+
    subscriptions, and the write failed with transaction_too_large."""
    url = database_url(tmp_path / "fdq.db")
    db = fdq.connect(url)
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    for i in range(subs - 1):   # and "default"
        sup.create_subscription("t", f"s{i}")
    assert len(sup.config("t").subs) == subs
    assert _write(url, "t", bodies).pushed == len(bodies)
    got = [b for part in fs.FDQReader(fs.read_options({"url": url, "topic": "t"})).partitions()
           for rb in fs.FDQReader(fs.read_options({"url": url, "topic": "t"})).read(part)
           for b in rb.column("body").to_pylist()]
    assert sorted(got) == sorted(bodies)


def _topic(tmp_path, name="t", shards=4):
    url = database_url(tmp_path / "fdq.db")
    db = fdq.connect(url)
    fdq.Supervisor(db).create_topic(name, shards=shards)
    return url, db


def _ids(reader, start, end) -> list:
    return [i for p in reader.partitions(start, end) for rb in reader.read(p)
            for i in rb.column("id").to_pylist()]


def test_available_now_stops_at_what_was_committed_when_it_began(tmp_path):
    """Trigger.AvailableNow: latestOffset must never pass what was committed at
    prepareForTriggerAvailableNow, and micro-batches keep maxRecordsPerTrigger."""
    from pyspark.sql.streaming.datasource import ReadMaxRows
    url, db = _topic(tmp_path)
    p = fdq.Producer(db)
    before = [r.id for r in p.push_many("t", [fdq.Envelope(b"a%d" % i, f"k{i}") for i in range(30)])]
    reader = fs.FDQStreamReader(fs.stream_options({"url": url, "topic": "t", "maxrecordspertrigger": "7"}))
    reader.prepareForTriggerAvailableNow()
    p.push_many("t", [fdq.Envelope(b"b%d" % i, f"k{i}") for i in range(30)])   # after it began
    start, got, sizes = reader.initialOffset(), [], []
    for _ in range(20):
        end = reader.latestOffset(start, ReadMaxRows(7))
        if end == start:
            break
        ids = _ids(reader, start, end)
        sizes.append(len(ids))
        got += ids
        start = end
    assert sorted(got) == sorted(before)
    assert max(sizes) <= 7 and len(sizes) == 5, sizes
    # ReadAllAvailable (Spark may pass it too) is held to the same target.
    from pyspark.sql.streaming.datasource import ReadAllAvailable
    assert reader.latestOffset(start, ReadAllAvailable()) == start


def test_available_now_query_keeps_max_records_per_trigger(spark, tmp_path):
    """Without SupportsTriggerAvailableNow, Spark read the whole backlog in one batch."""
    url, db = _topic(tmp_path)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i, f"k{i}") for i in range(30)])
    start = lambda: (spark.readStream.format("fdq").option("url", url).option("topic", "t")  # noqa: E731
                     .option("maxRecordsPerTrigger", "7").load().writeStream.format("memory")
                     .queryName("avail_now").trigger(availableNow=True)
                     .option("checkpointLocation", str(tmp_path / "ck")).start())
    q = run_query(start, lambda q: not q.isActive, 120, "the AvailableNow query to finish")
    assert q.exception() is None
    rows = [p["numInputRows"] for p in q.recentProgress]
    assert sum(rows) == 30 and max(rows) <= 7, rows
    assert spark.sql("select count(distinct id) from avail_now").collect()[0][0] == 30


def test_a_stream_skips_what_retention_trims_before_it_is_read_and_repeats_nothing(tmp_path):
    """Documented (spark/README.md): entries trimmed before the stream reads them are
    skipped; the offsets then still read every later entry once, none twice, no error;
    a micro-batch re-run after the trim (a restart) returns a subset of what it did."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows
    url, db = _topic(tmp_path)
    p = fdq.Producer(db)
    old = [r.id for r in p.push_many("t", [fdq.Envelope(b"a%d" % i, f"k{i}") for i in range(40)])]
    reader = fs.FDQStreamReader(fs.stream_options({"url": url, "topic": "t"}))
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadMaxRows(10))
    first = _ids(reader, start, end)
    assert sorted(first) == sorted(old)[:10] and len(first) == 10
    assert fdq.Supervisor(db).trim("t", before_ms=int(time.time() * 1000) + 60_000) == 40
    assert _ids(reader, start, end) == []          # the batch re-run: what is left of it
    new = [r.id for r in p.push_many("t", [fdq.Envelope(b"b%d" % i, f"k{i}") for i in range(15)])]
    got = []
    for _ in range(10):
        nxt = reader.latestOffset(end, ReadAllAvailable())
        if nxt == end:
            break
        got += _ids(reader, end, nxt)
        end = nxt
    assert sorted(got) == sorted(new)


def test_a_first_micro_batch_re_run_after_a_restart_reads_what_it_did(tmp_path):
    """Spark keeps no initial offset in the checkpoint: re-running a failed first
    micro-batch after a restart calls initialOffset() again as its start. With
    startingPosition=latest that is later than the first call, and the re-run read
    (new latest, end]: the batch's messages were lost. The end offset carries its start."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable
    url, db = _topic(tmp_path)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(b"old%d" % i, f"k{i}") for i in range(5)])
    o = fs.stream_options({"url": url, "topic": "t", "startingposition": "latest"})
    reader = fs.FDQStreamReader(o)
    init = reader.initialOffset()
    assert reader.latestOffset(init, ReadAllAvailable()) == init   # nothing new: no batch
    first = [r.id for r in p.push_many("t", [fdq.Envelope(b"a%d" % i, f"k{i}") for i in range(10)])]
    end = reader.latestOffset(init, ReadAllAvailable())
    assert sorted(_ids(reader, init, end)) == sorted(first)
    # The sink failed; more is pushed; the query restarts and re-runs batch 0 (start:
    # a new initialOffset(), end: the one in the checkpoint).
    p.push_many("t", [fdq.Envelope(b"b%d" % i, f"k{i}") for i in range(3)])
    again = fs.FDQStreamReader(o)
    assert sorted(_ids(again, again.initialOffset(), end)) == sorted(first)
    # The next batches go on from there as before.
    nxt = again.latestOffset(end, ReadAllAvailable())
    assert "origin" not in nxt and len(_ids(again, end, nxt)) == 3
