"""Batch reads of a topic's "all" log through format("fdq")."""
from __future__ import annotations

import base64
import datetime
import json

import pytest

import fdq
import fdq.spark as fs
from fdq import log
from fdq.config import TopicConfig
from fdq.ops.retention import trim_oldest_chunk
from fdq.keyspace import Keyspace
from fdq.ops.topics import create_topic

import sparkhelpers  # noqa: F401 - skips this module without pyspark, pyarrow or Java
from fdqtest import database_url
from sparkhelpers import push_with_processes


# 50,000 messages: the default read's partitions (one per bucket, 16 here) average ~3,100
# rows, so most span two read batches (batchSize 2,048 rows), and numPartitions=3's span
# several; 100,000 proved nothing more and took twice as long to push and to read.
TOTAL_PROCS, PER_PROC = 4, 12_500


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A topic of 50,000 messages pushed by 4 producer processes at once."""
    d = tmp_path_factory.mktemp("big")
    url = database_url(d / "fdq.db")
    db = fdq.connect(url)
    create_topic(db, Keyspace(), "events", TopicConfig(extend=True, shards=16))
    pushed = push_with_processes(url, "events", TOTAL_PROCS, PER_PROC, d)
    assert len(pushed) == TOTAL_PROCS * PER_PROC
    return url, pushed


@pytest.fixture(scope="module")
def full(spark, big):
    """The whole topic read once as Arrow: (table, count())."""
    url, _ = big
    df = load(spark, url)
    return df.select("id", "body", "shard_key", "headers", "insertion_time").toArrow(), df.count()


def load(spark, url, topic="events", **opts):
    """A read with the filter pushdown (``FDQPushdownReader``): these tests pin it."""
    r = spark.read.format("fdq").option("url", url).option("topic", topic).option("filterPushdown", "true")
    for k, v in opts.items():
        r = r.option(k, str(v))
    return r.load()


def _norm_headers(h):
    """What the reader returns for pushed headers: strings stay, the rest as JSON."""
    if not h:
        return None
    return {k: v if isinstance(v, str) else json.dumps(v, separators=(",", ":")) for k, v in h.items()}


def _rows(table):
    """{id: (body, shard_key, headers)} of an Arrow table read from the source."""
    cols = table.to_pydict()
    return {i: (b, k, dict(h) if h else None)
            for i, b, k, h in zip(cols["id"], cols["body"], cols["shard_key"], cols["headers"])}


@pytest.mark.slow
def test_count_and_content_equal_what_was_pushed(big, full):
    _url, pushed = big
    table, count = full
    assert count == len(pushed)
    got = _rows(table)
    want = {m["id"]: (base64.b64decode(m["body"]), m["shard_key"], _norm_headers(m["headers"]))
            for m in pushed}
    assert len(got) == len(pushed)            # ids are unique
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("parts", [3])
def test_partitions_cover_the_log_once(spark, big, parts):
    url, pushed = big
    df = load(spark, url, numPartitions=parts)
    assert df.rdd.getNumPartitions() <= parts
    ids = df.select("id").toArrow().column("id").to_pylist()
    assert len(ids) == len(pushed) and set(ids) == {m["id"] for m in pushed}


@pytest.mark.slow
def test_tuples_and_arrow_give_the_same_rows(spark, big):
    url, _ = big
    a = load(spark, url, batchFormat="arrow").filter("shard_key = 'k7'")
    t = load(spark, url, batchFormat="tuples").filter("shard_key = 'k7'")
    ra, rt = sorted(a.collect()), sorted(t.collect())
    assert len(ra) == TOTAL_PROCS * PER_PROC // 50 and ra == rt


@pytest.mark.slow
def test_window_edges_start_inclusive_end_exclusive(spark, big, full):
    url, _ = big
    table, _count = full
    ms = [round(t.timestamp() * 1000) for t in table.column("insertion_time").to_pylist()]
    ids = table.column("id").to_pylist()
    times = sorted(set(ms))
    assert len(times) >= 3, "pushes took too little time to have distinct insertion times"
    t1, t2 = times[len(times) // 3], times[2 * len(times) // 3]
    want = {i for i, t in zip(ids, ms) if t1 <= t < t2}
    at_t1 = {i for i, t in zip(ids, ms) if t == t1}
    at_t2 = {i for i, t in zip(ids, ms) if t == t2}
    assert at_t1 and at_t2
    end_iso = datetime.datetime.fromtimestamp(t2 / 1000, datetime.timezone.utc).isoformat()
    got = set(load(spark, url, start=t1, end=end_iso).select("id").toArrow().column("id").to_pylist())
    assert got == want
    assert at_t1 <= got and not (at_t2 & got)
    # The same window as a filter Spark pushes down.
    from pyspark.sql import functions as F
    lo = F.lit(datetime.datetime.fromtimestamp(t1 / 1000, datetime.timezone.utc))
    hi = F.lit(datetime.datetime.fromtimestamp(t2 / 1000, datetime.timezone.utc))
    df = load(spark, url).filter((F.col("insertion_time") >= lo) & (F.col("insertion_time") < hi))
    assert set(df.select("id").toArrow().column("id").to_pylist()) == want


@pytest.mark.slow
def test_shard_key_and_header_filters(spark, big):
    url, pushed = big
    want = {m["id"] for m in pushed if m["shard_key"] in ("k3", "k4")}
    df = load(spark, url).filter("shard_key in ('k3', 'k4')")
    assert set(df.select("id").toArrow().column("id").to_pylist()) == want
    want_a = {m["id"] for m in pushed if m["headers"] and m["headers"]["kind"] == "a" and m["headers"]["proc"] == 2}
    df = load(spark, url).filter("headers['kind'] = 'a' and headers['proc'] = '2'")
    assert set(df.select("id").toArrow().column("id").to_pylist()) == want_a


@pytest.mark.slow
def test_empty_windows(spark, big):
    url, _ = big
    assert load(spark, url, start="5000ms", end="5000ms").count() == 0
    assert load(spark, url, start="2001-01-01T00:00:00Z", end="2001-01-02T00:00:00Z").count() == 0
    assert load(spark, url, start="2099-01-01T00:00:00").count() == 0


def test_large_bodies_and_empty_topic(spark, tmp_path):
    url = database_url(tmp_path / "fdq.db")
    db = fdq.connect(url)
    sup = fdq.Supervisor(db)
    sup.create_topic("big-bodies", extend=True)
    sup.create_topic("empty")
    # Chunked bodies (records of 7 fields), and empty ones (a record of 1 or 4 fields).
    bodies = [bytes([i]) * (250_000 + i) for i in range(3)] + [b"small", b"", b""]
    envs = [fdq.Envelope(b) for b in bodies[:-1]] + [fdq.Envelope(b"", headers={"h": 1})]
    fdq.Producer(db).push_many("big-bodies", envs)
    rows = load(spark, url, "big-bodies").select("body", "headers").collect()
    assert sorted(r.body for r in rows) == sorted(bodies)
    assert sorted(str(r.headers) for r in rows) == sorted(["None"] * 5 + [str({"h": "1"})])
    assert load(spark, url, "empty").count() == 0


def _error_of(fn) -> str:
    with pytest.raises(Exception) as ei:
        fn()
    return str(ei.value)


def test_unknown_topic_and_bad_options_fail_at_load(spark, tmp_path):
    url = database_url(tmp_path / "fdq.db")
    fdq.Supervisor(fdq.connect(url)).create_topic("t")
    base = lambda: spark.read.format("fdq")  # noqa: E731
    msg = _error_of(lambda: base().option("url", url).option("topic", "nope").load())
    assert "option 'topic'" in msg and "'nope' does not exist" in msg
    assert "option 'url' is required" in _error_of(lambda: base().option("topic", "t").load())
    assert "option 'topic' is required" in _error_of(lambda: base().option("url", url).load())
    msg = _error_of(lambda: base().option("url", url).option("topic", "bad name!").load())
    assert "option 'topic'" in msg and "invalid topic name" in msg
    msg = _error_of(lambda: base().option("url", "mysql://x").option("topic", "t").load())
    assert "option 'url'" in msg
    msg = _error_of(lambda: base().option("url", url).option("topic", "t").option("numPartition", "2").load())
    assert "unknown read option 'numpartition'" in msg.lower()
    for opt, value in [("start", "yesterday"), ("end", "2026-13-01"), ("numPartitions", "0"),
                       ("batchSize", "many"), ("batchFormat", "csv")]:
        # at load(), not only at the first action
        msg = _error_of(lambda: base().option("url", url).option("topic", "t").option(opt, value).load())
        assert f"option '{opt}'" in msg, (opt, msg[:2000])
    # epoch seconds where milliseconds are meant: refused, not read as January 1970
    msg = _error_of(lambda: base().option("url", url).option("topic", "t").option("start", "1700000000").load())
    assert "option 'start': '1700000000' is ambiguous" in msg, msg[:2000]


def _topic(tmp_path, name="t", shards=4):
    url = database_url(tmp_path / "fdq.db")
    db = fdq.connect(url)
    fdq.Supervisor(db).create_topic(name, shards=shards, extend=True)
    return url, db


def _load(spark, url, topic="t", **opts):
    r = spark.read.format("fdq").option("url", url).option("topic", topic).option("filterPushdown", "true")
    for k, v in opts.items():
        r = r.option(k, str(v))
    return r.load()


def _read_all(reader, partitions) -> list:
    ids = []
    for p in partitions:
        for rb in reader.read(p):
            ids += rb.column("id").to_pylist()
    return ids


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


def test_with_pushdown_each_query_of_a_dataframe_has_its_own_filters(spark, tmp_path):
    """Spark plans each filtered query of one DataFrame with the reader it pushed the
    last one's filters into: they narrowed the next (a shard-key filter, then another,
    counted the rows matching both). Each push starts from the options alone."""
    url, db = _topic(tmp_path)
    fdq.Producer(db).push_many("t", [fdq.Envelope(f"m{i}".encode(), f"k{i % 3}") for i in range(30)])
    df = _load(spark, url)
    assert df.filter("shard_key = 'k1'").count() == 10
    assert df.filter("shard_key in ('k0', 'k2')").count() == 20
    assert df.filter("shard_key = 'k0'").count() == 10


def test_by_default_a_count_after_a_filtered_count_counts_every_row(spark, tmp_path):
    """With the pushdown, Spark 4.3 keeps the reader a filtered query planned for the
    DataFrame's next query without a filter: its count was the filtered one. The pushdown
    is a read option (``filterPushdown``), off by default."""
    url, db = _topic(tmp_path)
    fdq.Producer(db).push_many("t", [fdq.Envelope(f"m{i}".encode(), f"k{i % 3}") for i in range(30)])
    df = spark.read.format("fdq").option("url", url).option("topic", "t").load()
    assert df.filter("shard_key = 'k1'").count() == 10
    assert df.count() == 30


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
    nchunks = log.Record.decode(raws[0]).nchunks
    assert nchunks > 1
    assert trim_oldest_chunk(db, ts, [(bucket, big_vs)], 0)[0] == 1
    cols = log.decode_entries(db, ts, keys, raws)
    assert cols["body"] == [b"small"] and cols["shard_key"] == ["b"]
    assert cols["vs"] == keys[1][-12:] and len(cols["ts_ms"]) == 1


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
