"""Edge cases of the Spark source found in review: negated filters, entries trimmed while
a read is in flight, reads of a topic being written."""
from __future__ import annotations

import time

import pytest

import fdq
import fdq.spark as fs
from fdq import log
from fdq.keyspace import Keyspace

import sparkhelpers  # noqa: F401 - skips this module without pyspark, pyarrow or Java
from fdqtest import database_url


def _topic(tmp_path, name="t", shards=4):
    url = database_url(tmp_path / "fdq.db")
    db = fdq.connect(url)
    fdq.Supervisor(db).create_topic(name, shards=shards, extend=True)
    return url, db


def _load(spark, url, topic="t", **opts):
    r = spark.read.format("fdq").option("url", url).option("topic", topic)
    for k, v in opts.items():
        r = r.option(k, str(v))
    return r.load()


def test_negated_filters_are_left_to_spark(spark, tmp_path):
    """Spark pushes NOT(...) as a Not filter, which has no column: it must come back
    unhandled (it crashed pushFilters with AttributeError), and the rows stay right."""
    url, db = _topic(tmp_path)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(f"m{i}".encode(), f"k{i % 3}") for i in range(30)])
    df = _load(spark, url)
    assert df.filter("shard_key != 'k1'").count() == 20
    assert df.filter("NOT (shard_key IN ('k0', 'k2'))").count() == 10
    assert df.filter("NOT (insertion_time < TIMESTAMP '2000-01-01 00:00:00')").count() == 30


def test_a_large_body_trimmed_while_its_batch_is_read_is_left_out(tmp_path):
    """read() scans a batch of records, then reads the chunks of large bodies in another
    transaction: a trim between the two deleted the chunks, and the message came out
    with an empty body. It is gone from the log, so it must not come out at all."""
    url, db = _topic(tmp_path, shards=1)
    big = b"x" * 300_000   # chunked
    fdq.Producer(db).push_many("t", [fdq.Envelope(big, "a"), fdq.Envelope(b"small", "b")])
    ts = Keyspace().topic("t")
    (bucket, begin, end), = [r for p in fs.FDQReader(fs.read_options({"url": url, "topic": "t"}))
                             .partitions() for r in p.ranges]
    (keys, raws), = log.scan_entries(db, ts, begin, end)
    assert log.decode_entries(db, ts, keys, raws)["body"] == [big, b"small"]
    # The retention trim of the large message lands between the scan and the chunk read.
    big_vs = log.Versionstamp.from_bytes(keys[0][-12:])
    from fdq.supervisor import trim_oldest_chunk
    nchunks = log.Record.decode(raws[0]).nchunks
    assert nchunks > 1
    assert trim_oldest_chunk(db, ts, [(bucket, big_vs)], 0)[0] == 1
    cols = log.decode_entries(db, ts, keys, raws)
    assert cols["body"] == [b"small"] and cols["shard_key"] == ["b"]
    assert cols["vs"] == keys[1][-12:] and len(cols["ts_ms"]) == 1


def _read_all(reader, partitions) -> list:
    ids = []
    for p in partitions:
        for rb in reader.read(p):
            ids += rb.column("id").to_pylist()
    return ids


@pytest.mark.parametrize("parts", [1, 3])
def test_a_batch_read_returns_what_was_committed_when_it_was_planned(tmp_path, parts):
    """A read of a topic being written: its tasks run after planning (and a retried task
    later still). Each must read the log as committed at planning, not a mix of buckets
    read at different times that includes some later pushes and misses earlier ones."""
    url, db = _topic(tmp_path, shards=4)
    p = fdq.Producer(db)
    before = [r.id for r in p.push_many("t", [fdq.Envelope(b"a%d" % i, f"k{i}") for i in range(200)])]
    reader = fs.FDQReader(fs.read_options({"url": url, "topic": "t", "numPartitions": str(parts),
                                           "batchSize": "16"}))
    planned = reader.partitions()
    assert len(log.log_buckets(db, Keyspace().topic("t"))) == 4
    p.push_many("t", [fdq.Envelope(b"b%d" % i, f"k{i}") for i in range(200)])   # after planning
    got = _read_all(reader, planned)
    assert sorted(got) == sorted(before)
    # A retried task reads the same rows.
    assert sorted(_read_all(reader, planned)) == sorted(before)


def test_read_batches_of_large_messages_are_bounded_in_bytes(tmp_path):
    """Messages just under the chunking size (~90 KB inline): a read batch of the
    default 2,048 entries was ~180 MB in one read transaction (near FDB's 5 s on a
    cluster) and in one Arrow batch. Batches now stay near log.SCAN_BYTES."""
    url, db = _topic(tmp_path, shards=1)
    p = fdq.Producer(db)
    for i in range(10):
        p.push_many("t", [fdq.Envelope(bytes([i]) * 89_000) for _ in range(20)])
    reader = fs.FDQReader(fs.read_options({"url": url, "topic": "t"}))   # batchSize 2048
    sizes, rows = [], 0
    for part in reader.partitions():
        for rb in reader.read(part):
            sizes.append(sum(len(b) for b in rb.column("body").to_pylist()))
            rows += rb.num_rows
    assert rows == 200
    assert max(sizes) <= 9_000_000, sizes


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


def test_a_user_schema_is_refused_at_load_with_a_clear_error(spark, tmp_path):
    """The source returns its own columns: a schema given with .schema() (a subset, say)
    failed inside the tasks with Spark's Arrow type mismatch; refuse it at load."""
    url, db = _topic(tmp_path)
    fdq.Producer(db).push("t", b"x")
    with pytest.raises(Exception) as ei:
        (spark.read.format("fdq").schema("id string, body binary").option("url", url)
         .option("topic", "t").load().collect())
    assert "fdq: a schema given with .schema() is not supported" in str(ei.value)
    # Its own schema, given explicitly, is accepted.
    df = spark.read.format("fdq").schema(fs.SCHEMA).option("url", url).option("topic", "t").load()
    assert df.count() == 1
