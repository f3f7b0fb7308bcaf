"""Batch reads of a topic's "all" log through format("fdq")."""
from __future__ import annotations

import base64
import datetime
import json

import pytest

import fdq
from fdq.topic import create_topic
from fdq.config import TopicConfig
from fdq.keyspace import Keyspace

from sparkhelpers import push_with_processes
from fdqtest import database_url

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
    r = spark.read.format("fdq").option("url", url).option("topic", topic)
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
