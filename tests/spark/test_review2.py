"""Edge cases of the Spark source found in the second review: Trigger.AvailableNow with
maxRecordsPerTrigger, entries trimmed while a stream runs, a topic deleted mid-stream."""
from __future__ import annotations

import time

import fdq
import fdq.spark as fs

from sparkhelpers import run_query, wait_for  # noqa: F401 - skips this module without pyspark or Java
from fdqtest import database_url


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
