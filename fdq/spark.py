"""Spark: a PySpark data source (batch read, streaming read, write) over a topic's "all" log.

Register it once per session, then use the format ``fdq``::

    import fdq.spark
    fdq.spark.register(spark)
    df = (spark.read.format("fdq").option("url", "sqlite:///data/fdq.db")
          .option("topic", "orders").option("start", "2026-11-01T00:00:00Z").load())

Read options (strings, as Spark passes them): ``url`` and ``topic`` (required), ``start``
/ ``end`` (epoch ms or ISO-8601, naive = UTC; the window is ``[start, end)``),
``numPartitions``, ``batchSize`` (at most this many entries per read transaction, and
~8 MB of them), ``batchFormat``
(``arrow``, the default and faster, or ``tuples``), ``filterPushdown`` (``true``:
``FDQPushdownReader``). Streaming adds
``startingPosition`` (``earliest``, ``latest`` or a time) and ``maxRecordsPerTrigger``.
Write options: ``url``, ``topic``, ``batchSize`` (messages per push transaction),
``writeId`` (see :class:`FDQWriter`), ``idempotent`` (refused on a topic with
``dedupe_window_s = 0``, which cannot deduplicate), ``autoCreate`` (``true``, the default
as for a producer: a missing topic is created with the default configuration; ``false``:
refused).

Every partition opens its own connection inside ``read()`` / ``write()``; the reading
and the decoding of log entries are :mod:`fdq.log`'s, pushes are :class:`fdq.Producer`'s:
this module only plans partitions and converts to and from Spark's types.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import uuid
from array import array
from itertools import accumulate, chain

from pyspark.sql.datasource import (DataSource, DataSourceArrowWriter, DataSourceReader,
                                    DataSourceStreamReader, EqualTo, GreaterThan,
                                    GreaterThanOrEqual, In, InputPartition, LessThan,
                                    LessThanOrEqual, WriterCommitMessage)
from pyspark import TaskContext
try:   # read limits (maxRecordsPerTrigger)
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows
except ImportError:   # pragma: no cover - older pyspark: Spark never asks for a read limit
    ReadAllAvailable = ReadMaxRows = None
try:   # pyspark 4.3 (Trigger.AvailableNow with read limits)
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:   # pragma: no cover - older pyspark: Spark reads all in one batch
    class SupportsTriggerAvailableNow:
        pass
from pyspark.sql.types import (BinaryType, IntegerType, MapType, StringType, StructField,
                               StructType, TimestampType)

from . import log, times
from .config import ProducerConfig, check_name
from .engine import transactional
from .keyspace.format import connect
from .errors import ConfigError, FDQError, InvalidName, TopicExists, TopicNotFound
from .keyspace import Keyspace
from .ops import log as oplog
from .producer import Envelope, Producer
from .supervisor import Supervisor
from .ops.topics import read_topic_config

SCHEMA = StructType([
    StructField("topic", StringType()),
    StructField("id", StringType()),
    StructField("insertion_time", TimestampType()),
    StructField("shard_key", StringType()),
    StructField("headers", MapType(StringType(), StringType())),
    StructField("body", BinaryType()),
    StructField("shard", IntegerType()),      # the log bucket: the shard when it was pushed
    StructField("msg_id", StringType()),      # the producer's msg_id (dedupe key), if any
    StructField("replay_of", StringType()),   # the original id of a replayed message
])

READ_OPTIONS = {"url", "topic", "start", "end", "numpartitions", "batchsize", "batchformat", "filterpushdown"}
STREAM_OPTIONS = {"url", "topic", "numpartitions", "batchsize", "batchformat",
                  "startingposition", "maxrecordspertrigger"}
WRITE_OPTIONS = {"url", "topic", "batchsize", "writeid", "idempotent", "autocreate"}
_CANONICAL = {o.lower(): o for o in ("url", "topic", "start", "end", "numPartitions", "batchSize",
                                     "batchFormat", "startingPosition", "maxRecordsPerTrigger",
                                     "writeId", "idempotent", "autoCreate", "filterPushdown")}
SPLIT_CHUNK_MAX = (1 << 31) - 1  # get_range_split_points' chunk size: a C int in FDB's binding


class SparkOptionError(ConfigError):
    """A data source option is missing or invalid; the message names it."""


# -- options ---------------------------------------------------------------------------

def _get(options, name):
    v = options.get(name.lower())
    return v.strip() if isinstance(v, str) else v


def parse_time(value, option: str) -> int | None:
    """Epoch milliseconds from an option value, as ``fdq.times.parse_time`` reads it
    (ISO-8601, naive = UTC; ``<n>s``; ``<n>ms`` or a bare integer of epoch ms, refused
    when it looks like seconds). None/empty -> None."""
    if value is None or value == "":
        return None
    try:
        return times.parse_time(value)
    except ConfigError as e:
        raise SparkOptionError(f"fdq: option {option!r}: {e}") from None


def _int(options, name, default, minimum=1):
    v = _get(options, name)
    if v is None or v == "":
        return default
    try:
        n = int(v)
    except (TypeError, ValueError):
        n = None
    if n is None or n < minimum:
        raise SparkOptionError(f"fdq: option {name!r} must be an integer >= {minimum}, not {v!r}")
    return n


def _check_known(options, known, what):
    for k in options:
        if k.lower() not in known and k.lower() != "path":
            names = ", ".join(sorted(_CANONICAL[o] for o in known))
            raise SparkOptionError(f"fdq: unknown {what} option {k!r} (known: {names})")


def _common(options, known, what) -> dict:
    _check_known(options, known, what)
    url = _get(options, "url")
    if not url:
        raise SparkOptionError("fdq: option 'url' is required (e.g. sqlite:///path/to/fdq.db "
                               "or fdb:///etc/foundationdb/fdb.cluster)")
    topic = _get(options, "topic")
    if not topic:
        raise SparkOptionError("fdq: option 'topic' is required")
    try:
        check_name(topic)
    except InvalidName as e:
        raise SparkOptionError(f"fdq: option 'topic': {e}") from None
    fmt = (_get(options, "batchFormat") or "arrow").lower()
    if fmt not in ("arrow", "tuples"):
        raise SparkOptionError(f"fdq: option 'batchFormat' must be 'arrow' or 'tuples', not {fmt!r}")
    return {"url": url, "topic": topic, "batch_format": fmt,
            "batch_size": _int(options, "batchSize", 2048)}


def read_options(options) -> dict:
    o = _common(options, READ_OPTIONS, "read")
    o["start_ms"] = parse_time(_get(options, "start"), "start")
    o["end_ms"] = parse_time(_get(options, "end"), "end")
    o["num_partitions"] = _int(options, "numPartitions", None)
    o["filter_pushdown"] = _bool(options, "filterPushdown", False)
    return o


def stream_options(options) -> dict:
    o = _common(options, STREAM_OPTIONS, "readStream")
    pos = (_get(options, "startingPosition") or "earliest")
    if pos.lower() in ("earliest", "latest"):
        o["starting"], o["start_ms"] = pos.lower(), None
    else:
        try:
            o["start_ms"] = times.parse_time(pos)
        except ConfigError as e:
            raise SparkOptionError(f"fdq: option 'startingPosition' must be 'earliest', 'latest' or a "
                                   f"time: {e}") from None
        o["starting"] = "time"
    o["end_ms"] = None
    o["num_partitions"] = _int(options, "numPartitions", 2)
    o["max_records"] = _int(options, "maxRecordsPerTrigger", None)
    return o


def load_options(options) -> dict:
    """The options as ``load()`` can check them: ``DataSource.schema()`` runs there for
    both ``read`` and ``readStream`` without knowing which, so each value is checked
    by the rule of the reader that takes it (a bad ``start`` or ``numPartitions`` fails
    at load, not inside the first action)."""
    o = _common(options, READ_OPTIONS | STREAM_OPTIONS, "read")
    for known, check in ((READ_OPTIONS, read_options), (STREAM_OPTIONS, stream_options)):
        check({k.lower(): v for k, v in options.items() if k.lower() in known})
    return o


def write_options(options) -> dict:
    o = _common(options, WRITE_OPTIONS, "write")
    o["batch_size"] = _int(options, "batchSize", 500)
    o["idempotent"] = _bool(options, "idempotent", True)
    o["auto_create"] = _bool(options, "autoCreate", True)
    wid = _get(options, "writeId") or uuid.uuid4().hex
    if len(wid) > 128:
        raise SparkOptionError("fdq: option 'writeId' must be at most 128 characters")
    o["write_id"] = wid
    return o


def _bool(options, name: str, default: bool) -> bool:
    v = (_get(options, name) or str(default)).lower()
    if v not in ("true", "false"):
        raise SparkOptionError(f"fdq: option {name!r} must be 'true' or 'false', not {v!r}")
    return v == "true"


# -- connections -------------------------------------------------------------------------

_dbs: dict = {}


def _db(url: str):
    """One connection per URL per process (Spark reuses its Python workers)."""
    key = (os.getpid(), url)
    db = _dbs.get(key)
    if db is None:
        db = _dbs[key] = connect(url)
    return db


def _open_topic(o: dict):
    """(db, TopicSpace, config); clear errors naming the option for a bad URL or topic."""
    try:
        db = _db(o["url"])
    except ConfigError as e:
        raise SparkOptionError(f"fdq: option 'url': {e}") from None
    ts = Keyspace().topic(o["topic"])
    try:
        config = read_topic_config(db, ts, snapshot=True)
    except TopicNotFound:
        raise TopicNotFound(f"fdq: option 'topic': topic {o['topic']!r} does not exist "
                            f"in {o['url']}") from None
    return db, ts, config


# -- reading: partitions and rows ------------------------------------------------------------

class LogPartition(InputPartition):
    """Key ranges [(bucket, begin, end)] of the log, read by one task."""

    def __init__(self, ranges):
        super().__init__(ranges)
        self.ranges = ranges


# pyarrow (and pyspark's arrow types, which import it) only where a worker builds Arrow
# batches: importing it costs ~90 ms, which the driver and the writer never need.

def _arrow_schema():
    from pyspark.sql.pandas.types import to_arrow_schema
    return to_arrow_schema(SCHEMA, timezone="UTC")


def _json(v) -> str:
    t = type(v)
    if t is int:
        return str(v)
    if t is bool:
        return "true" if v else "false"
    return json.dumps(v, separators=(",", ":"))


def _header_items(h):
    """Header values as strings: strings as they are, the rest JSON-encoded."""
    if not h:
        return None
    return [(k, v if type(v) is str else _json(v)) for k, v in h.items()]


_id_offsets: dict = {}


def _ids(vs: bytes, n: int):
    """The message ids (hex of each 12-byte position) as an Arrow string array, built
    from one hex string and fixed offsets (cached per batch length)."""
    import pyarrow as pa
    offsets = _id_offsets.get(n)
    if offsets is None:
        offsets = pa.array(range(0, 24 * n + 1, 24), pa.int32()).buffers()[1]
        if len(_id_offsets) < 64:
            _id_offsets[n] = offsets
    return pa.StringArray.from_buffers(n, offsets, pa.py_buffer(vs.hex().encode()))


def _headers(heads, n, map_type):
    """Header dicts (or None) as an Arrow map<string,string> array, built from flat key
    and value lists and offsets (no per-row lists of pairs)."""
    import pyarrow as pa
    if not any(heads):
        return pa.nulls(n, map_type)
    lens = [len(h) if h else 0 for h in heads]
    present = list(filter(None, heads))
    keys = list(chain.from_iterable(present))
    values = list(chain.from_iterable(map(dict.values, present)))
    if not all(type(v) is str for v in values):
        values = [v if type(v) is str else str(v) if type(v) is int else _json(v) for v in values]
    # array() takes a list of ints in C; pa.array() converts them one by one (slower).
    offsets = array("i", list(accumulate(lens, initial=0)))
    return pa.MapArray.from_arrays(pa.Array.from_buffers(pa.int32(), n + 1, [None, pa.py_buffer(offsets)]),
                                   pa.array(keys, pa.string()), pa.array(values, pa.string()),
                                   type=map_type, mask=pa.array([not x for x in lens], pa.bool_()))


def _strings(values, n):
    import pyarrow as pa
    return pa.array(values, pa.string()) if any(values) else pa.nulls(n, pa.string())


def _to_arrow(pa_schema, topic, bucket, cols, cache=None):
    """One record batch of SCHEMA from decode_entries' columns. ``cache``: a dict kept
    by the caller for the constant columns (topic, bucket) per batch length."""
    import pyarrow as pa
    n = len(cols["ts_ms"])
    f = pa_schema.field
    const = cache.get((bucket, n)) if cache is not None else None
    if const is None:
        const = (pa.repeat(pa.scalar(topic, pa.string()), n), pa.repeat(pa.scalar(bucket, pa.int32()), n))
        if cache is not None:
            cache[(bucket, n)] = const
    ts_ms = array("q", cols["ts_ms"])   # a list of ints into a buffer in C (pa.array: one by one)
    ts = pa.Array.from_buffers(pa.timestamp("ms", tz="UTC"), n, [None, pa.py_buffer(ts_ms)])
    return pa.RecordBatch.from_arrays([
        const[0],
        _ids(cols["vs"], n),
        ts.cast(f("insertion_time").type),
        pa.array(cols["shard_key"], pa.string()),
        _headers(cols["headers"], n, f("headers").type),
        pa.array(cols["body"], pa.binary()),
        const[1],
        _strings(cols["msg_id"], n),
        _strings(cols["replay_of"], n),
    ], schema=pa_schema)


def _to_tuples(topic, bucket, cols):
    utc = datetime.timezone.utc
    vs = cols["vs"]
    for i, t in enumerate(cols["ts_ms"]):
        h = _header_items(cols["headers"][i])
        yield (topic, vs[i * 12:i * 12 + 12].hex(), datetime.datetime.fromtimestamp(t / 1000, utc),
               cols["shard_key"][i], dict(h) if h else None, cols["body"][i], bucket,
               cols["msg_id"][i], cols["replay_of"][i])


def read_partition(o: dict, ranges, start_ms=None, end_ms=None, shard_keys=None):
    """Rows (Arrow record batches or tuples) of the log entries in ``ranges``, read in
    bounded batches, each in its own short transaction, on this process's connection.

    The cyclic garbage collector is paused while a batch is read, decoded and converted
    (as msgpack advises for large unpacks): those objects form no cycles, and the
    collections their allocations trigger cost 15-20% of the read path."""
    db = _db(o["url"])
    ts = Keyspace().topic(o["topic"])
    arrow = o["batch_format"] == "arrow"
    pa_schema = _arrow_schema() if arrow else None
    cache = {}
    for bucket, begin, end in ranges:
        batches = log.scan_entries(db, ts, begin, end, o["batch_size"])
        while True:
            was_enabled = gc.isenabled()
            gc.disable()
            try:
                kv = next(batches, None)
                if kv is None:
                    break
                cols = log.decode_entries(db, ts, kv[0], kv[1], start_ms, end_ms, shard_keys)
                del kv
                if not cols["ts_ms"]:
                    continue
                out = _to_arrow(pa_schema, o["topic"], bucket, cols, cache) if arrow else None
            finally:
                if was_enabled:
                    gc.enable()
            if arrow:
                yield out
            else:
                yield from _to_tuples(o["topic"], bucket, cols)


def _us(value):
    """Microseconds since the epoch of a pushed-down timestamp, or None if unusable."""
    if isinstance(value, datetime.datetime) and value.tzinfo is not None:
        delta = value - datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
        return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
    return None


@transactional
def plan_ranges(tr, ts, buckets, start_vs: bytes | None, end_vs: bytes | None, parts: int) -> list:
    """Split the log's buckets, narrowed to positions [start_vs, end_vs), into at most
    ``parts`` lists of key ranges of about equal size, by the database's
    ``get_range_split_points`` (so partitions follow the data). ``buckets``: bucket
    numbers, or {bucket: its last position to read} (``oplog.last_positions``: a read of
    exactly what was committed then, not of what commits while its tasks run). Retried
    on retryable errors, as every read (``transactional``)."""
    spans, total = [], 0
    upto = buckets if isinstance(buckets, dict) else {}
    for b in sorted(buckets):
        begin, end = oplog.bucket_range(ts, b)
        if start_vs is not None:
            begin = max(begin, oplog.entry_key(ts, b, start_vs))
        if end_vs is not None:
            end = min(end, oplog.entry_key(ts, b, end_vs))
        if b in upto:
            end = min(end, oplog.entry_key(ts, b, upto[b]) + b"\x00")
        if begin >= end:
            continue
        if parts == 1:   # one partition: every range, no sizes to balance
            spans.append((b, begin, end, 0))
            continue
        size = int(tr.get_estimated_range_size_bytes(begin, end).wait())
        spans.append((b, begin, end, size))
        total += size
    if not spans:
        return []
    if parts == 1:
        return [[(b, begin, end) for b, begin, end, _size in spans]]
    # The binding passes the chunk size as a 32-bit C int: a larger one (a log of several
    # GB read in few partitions) would arrive wrapped.
    chunk = min(SPLIT_CHUNK_MAX, max(64 << 10, total // (parts * 2) + 1))
    pieces = []   # (bucket, begin, end, estimated bytes)
    for b, begin, end, size in spans:
        points = list(tr.get_range_split_points(begin, end, chunk).wait()) if size > chunk else [begin, end]
        k = len(points) - 1
        for i in range(k):
            est = chunk if i < k - 1 else max(1, size - chunk * (k - 1))
            pieces.append((b, points[i], points[i + 1], est))
    out, cur, acc, target = [], [], 0, (sum(p[3] for p in pieces) / parts)
    for b, begin, end, est in pieces:
        if cur and acc + est / 2 > target * (len(out) + 1) and len(out) < parts - 1:
            out.append(cur)
            cur = []
        if cur and cur[-1][0] == b and cur[-1][2] == begin:
            cur[-1] = (b, cur[-1][1], end)   # adjacent pieces of one bucket: one range
        else:
            cur.append((b, begin, end))
        acc += est
    out.append(cur)
    return out


class FDQReader(DataSourceReader):
    """Batch reader: one row per message of the "all" log in ``[start, end)``."""

    def __init__(self, o: dict):
        self.o = o
        self.start_us = None if o["start_ms"] is None else o["start_ms"] * 1000
        self.end_us = None if o["end_ms"] is None else o["end_ms"] * 1000   # exclusive
        self.shard_keys = None

    def _window_ms(self):
        # Messages carry ms: t_ms*1000 >= start_us  <=>  t_ms >= ceil(start_us / 1000).
        start = None if self.start_us is None else -(-self.start_us // 1000)
        end = None if self.end_us is None else -(-self.end_us // 1000)
        return start, end

    def partitions(self):
        db, ts, _config = _open_topic(self.o)
        start_ms, end_ms = self._window_ms()
        if (start_ms is not None and end_ms is not None and start_ms >= end_ms) or self.shard_keys == set():
            return [LogPartition([])]
        # The read is of the log as committed now: {bucket: last position}, one snapshot.
        last = oplog.last_positions(db, ts)
        start_vs = oplog.position_for_time(db, ts, start_ms).to_bytes() if start_ms is not None else None
        end_vs = oplog.position_after_time(db, ts, end_ms)
        parts = self.o["num_partitions"] or max(1, len(last))
        planned = plan_ranges(db, ts, last, start_vs, end_vs, parts)
        return [LogPartition(r) for r in planned] or [LogPartition([])]

    def read(self, partition):
        start_ms, end_ms = self._window_ms()
        return read_partition(self.o, partition.ranges, start_ms, end_ms, self.shard_keys)


# -- streaming ----------------------------------------------------------------------------------

def _decode_offset(offset) -> dict:
    return {int(b): bytes.fromhex(h) for b, h in (offset or {}).get("positions", {}).items()}


def _encode_offset(cursors: dict) -> dict:
    return {"positions": {str(b): cursors[b].hex() for b in sorted(cursors) if cursors[b] is not None}}



class FDQPushdownReader(FDQReader):
    """``FDQReader`` with the filter pushdown (option ``filterPushdown=true``; Spark's
    ``spark.sql.python.filterPushdown.enabled``, which ``register`` sets, must be on).
    Not the default: Spark 4.3 keeps the reader a filtered query planned for the same
    DataFrame's later queries that have no filter (``df.filter(...).count()`` then
    ``df.count()`` counted the filtered rows)."""

    def pushFilters(self, filters):
        """insertion_time comparisons narrow the window (and the scanned key range);
        shard_key = / IN are applied before rows are built. Both exactly: Spark does not
        re-check them. Each call starts from the options alone (a DataFrame's next
        filtered query is pushed into the reader of its last one)."""
        FDQReader.__init__(self, self.o)
        for f in filters:
            col = getattr(f, "attribute", None)   # Not(...) has none: Spark applies it
            if col == ("insertion_time",) and isinstance(f, (EqualTo, GreaterThan, GreaterThanOrEqual,
                                                              LessThan, LessThanOrEqual)):
                us = _us(f.value)
                if us is None:
                    yield f
                    continue
                lo = hi = None   # [lo, hi) in µs
                if isinstance(f, EqualTo):
                    lo, hi = us, us + 1
                elif isinstance(f, GreaterThan):
                    lo = us + 1
                elif isinstance(f, GreaterThanOrEqual):
                    lo = us
                elif isinstance(f, LessThan):
                    hi = us
                else:
                    hi = us + 1
                if lo is not None:
                    self.start_us = lo if self.start_us is None else max(self.start_us, lo)
                if hi is not None:
                    self.end_us = hi if self.end_us is None else min(self.end_us, hi)
            elif col == ("shard_key",) and isinstance(f, (EqualTo, In)):
                keys = {f.value} if isinstance(f, EqualTo) else set(f.value)
                keys = {k for k in keys if isinstance(k, str)}
                self.shard_keys = keys if self.shard_keys is None else self.shard_keys & keys
            else:
                yield f


class FDQStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Streaming reader. An offset is {"positions": {bucket: position}}: the last log
    position read in each bucket (absent: nothing read there yet). A micro-batch reads,
    per bucket, the entries after the start offset's position up to and including the
    end offset's. Positions are commit versionstamps, and a later commit always gets a
    larger one, so the entries in such a range never change: no gap, no duplicate, across
    micro-batches and restarts from a checkpoint. Except by retention: entries a trim
    deletes before they are read are skipped (the log keeps no trace of them, so this
    reader cannot tell them from entries never pushed; spark/README.md)."""

    def __init__(self, o: dict):
        self.o = o
        self.target = None   # Trigger.AvailableNow: {bucket: last position} when it began

    def prepareForTriggerAvailableNow(self):
        """Trigger.AvailableNow: read what is committed now, in micro-batches of at most
        ``maxRecordsPerTrigger`` (without this Spark read it all in one batch)."""
        db, ts, _config = _open_topic(self.o)
        self.target = oplog.last_positions(db, ts)

    def _capped(self, cursors: dict, new: dict) -> dict:
        """``new`` held to ``self.target`` (never behind ``cursors``)."""
        out = {}
        for b, vs in new.items():
            cap = self.target.get(b)
            if cap is not None and vs > cap:
                vs = cap
            cur = cursors.get(b)
            if cap is None or (cur is not None and cur > vs):
                vs = cur
            if vs is not None:
                out[b] = vs
        return out

    def initialOffset(self):
        """The starting position, marked ``initial``. Spark keeps no initial offset in
        the checkpoint: a first micro-batch re-run after a failure gets a new call of
        this as its start, and with ``latest`` that is later than the first one. So the
        first end offset carries its start (``origin``), which ``partitions`` reads
        from instead."""
        return dict(self._initial_positions(), initial=True)

    def _initial_positions(self) -> dict:
        db, ts, _config = _open_topic(self.o)
        if self.o["starting"] == "earliest":
            return _encode_offset({})
        if self.o["starting"] == "latest":
            return _encode_offset(oplog.last_positions(db, ts))
        vs = oplog.position_for_time(db, ts, self.o["start_ms"]).to_bytes()
        before = oplog.vs_before(vs)
        return _encode_offset({b: before for b in oplog.log_buckets(db, ts)})

    def getDefaultReadLimit(self):
        if self.o["max_records"]:
            return ReadMaxRows(self.o["max_records"])
        return ReadAllAvailable()

    def latestOffset(self, start, limit):
        db, ts, _config = _open_topic(self.o)
        cursors = _decode_offset(start)
        if isinstance(limit, ReadMaxRows):
            new, _n = oplog.advance_positions(db, ts, cursors, int(limit.max_rows))
        else:
            new = dict(cursors)
            for b, vs in oplog.last_positions(db, ts).items():
                if new.get(b) is None or vs > new[b]:
                    new[b] = vs
        if self.target is not None:
            new = self._capped(cursors, new)
        out = _encode_offset(new)
        if start.get("initial"):
            if out["positions"] == start["positions"]:
                return start   # nothing new: the same offset (no micro-batch)
            out["origin"] = start["positions"]   # see initialOffset
        return out

    def partitions(self, start, end):
        db, ts, _config = _open_topic(self.o)
        if start.get("initial") and "origin" in end:   # see initialOffset
            start = {"positions": end["origin"]}
        s, e = _decode_offset(start), _decode_offset(end)
        ranges = []
        for b in sorted(e):
            if s.get(b) == e[b]:
                continue
            ranges.append((b, oplog.after_key(ts, b, s.get(b)), oplog.entry_key(ts, b, e[b]) + b"\x00"))
        if not ranges:
            return []
        n = min(self.o["num_partitions"], len(ranges))
        return [LogPartition(ranges[i::n]) for i in range(n)]

    def read(self, partition):
        return read_partition(self.o, partition.ranges, self.o["start_ms"], None, None)

    def commit(self, end):
        """Nothing to release: the log is not consumed (retention trims it)."""


# -- writing ----------------------------------------------------------------------------------

class FDQCommit(WriterCommitMessage):
    def __init__(self, partition: int, pushed: int, duplicates: int):
        self.partition, self.pushed, self.duplicates = partition, pushed, duplicates


class FDQWriter(DataSourceArrowWriter):
    """Pushes rows (``body`` binary or string, required; ``shard_key`` string and
    ``headers`` map<string,string> optional; other columns are ignored) with
    ``Producer.push_stream``: at most ``batchSize`` messages per transaction, and what
    its sizing rule allows (``fdq.ops.push.TX_WRITE_BYTES``, every copy counted: the
    log's and one per subscription).

    Idempotent (``idempotent=true``, the default): row ``i`` of partition ``p`` is pushed
    with ``msg_id = "spark:<writeId>:<p>:<i>"``, so a re-run of a failed task (or of the
    whole job with the same ``writeId`` option) is deduplicated by FDQ's msg_id window:
    the topic's ``dedupe_window_s`` (default 120 s), counted from the first push of that
    row. This needs the partition's rows in the same order on every attempt (a
    deterministic input); a retry later than the window pushes duplicates. ``writeId``
    defaults to a fresh id per write job (chosen on the driver)."""

    def __init__(self, o: dict, schema: StructType):
        self.o = o
        self.has_key = "shard_key" in schema.fieldNames()
        self.has_headers = "headers" in schema.fieldNames()

    def write(self, iterator):
        ctx = TaskContext.get()
        part = ctx.partitionId() if ctx is not None else 0
        db, _ts, _config = _open_topic(self.o)
        producer = Producer(db, config=ProducerConfig(auto_create=self.o["auto_create"]))
        topic, prefix = self.o["topic"], f"spark:{self.o['write_id']}:{part}:"
        idem = self.o["idempotent"]

        def envelopes():
            row = 0
            for rb in iterator:
                bodies = rb.column("body").to_pylist()
                keys = rb.column("shard_key").to_pylist() if self.has_key else None
                heads = rb.column("headers").to_pylist() if self.has_headers else None
                for i, body in enumerate(bodies):
                    if isinstance(body, str):
                        body = body.encode("utf-8")
                    if body is None:
                        raise FDQError(f"fdq writer: row {row} of partition {part} has a null body")
                    h = heads[i] if heads is not None else None
                    try:
                        yield Envelope(body, keys[i] if keys is not None else None, None,
                                       prefix + str(row) if idem else None, dict(h) if h else None)
                    except FDQError as e:
                        raise type(e)(f"fdq writer: row {row} of partition {part}: {e}") from None
                    row += 1
        pushed = dups = 0
        for results in producer.push_stream(topic, envelopes(), max_messages=self.o["batch_size"]):
            dups += sum(1 for r in results if r.duplicate)
            pushed += len(results)
        return FDQCommit(part, pushed, dups)

    def commit(self, messages):
        """Each task's pushes are committed as it goes; nothing is left to do."""

    def abort(self, messages):
        """Pushed messages stay (a topic is append-only); re-run with the same writeId."""


# -- the data source -------------------------------------------------------------------------------

def _check_write_schema(schema: StructType):
    types = {f.name: f.dataType for f in schema.fields}
    if "body" not in types:
        raise SparkOptionError("fdq writer: the DataFrame needs a 'body' column (binary or string); "
                               f"it has {', '.join(types) or 'no columns'}")
    if not isinstance(types["body"], (BinaryType, StringType)):
        raise SparkOptionError(f"fdq writer: column 'body' must be binary or string, not {types['body'].simpleString()}")
    if "shard_key" in types and not isinstance(types["shard_key"], StringType):
        raise SparkOptionError("fdq writer: column 'shard_key' must be a string, not "
                               f"{types['shard_key'].simpleString()}")
    if "headers" in types and types["headers"] != MapType(StringType(), StringType()) \
            and types["headers"] != MapType(StringType(), StringType(), False):
        raise SparkOptionError("fdq writer: column 'headers' must be map<string,string>, not "
                               f"{types['headers'].simpleString()}")


def _check_read_schema(schema: StructType):
    """Rows always have SCHEMA's columns: a different schema given with ``.schema()``
    would fail inside every task (Spark checks each batch's columns)."""
    if [(f.name, f.dataType) for f in schema.fields] != [(f.name, f.dataType) for f in SCHEMA.fields]:
        raise SparkOptionError(f"fdq: a schema given with .schema() is not supported (got "
                               f"{schema.simpleString()}); the source's schema is {SCHEMA.simpleString()}: "
                               "select the columns you need after load()")


class FDQDataSource(DataSource):
    """``format("fdq")``: see the module's documentation for the options."""

    @classmethod
    def name(cls):
        return "fdq"

    def schema(self):
        # Called at load(): check the options and the topic there, where errors are clearest.
        _open_topic(load_options(self.options))
        return SCHEMA

    def reader(self, schema):
        _check_read_schema(schema)
        o = read_options(self.options)
        _open_topic(o)
        return FDQPushdownReader(o) if o["filter_pushdown"] else FDQReader(o)

    def streamReader(self, schema):
        _check_read_schema(schema)
        o = stream_options(self.options)
        _open_topic(o)
        return FDQStreamReader(o)

    def writer(self, schema, overwrite):
        if overwrite:
            raise SparkOptionError("fdq writer: mode 'overwrite' is not supported: a topic is "
                                   "append-only (use mode 'append')")
        o = write_options(self.options)
        _check_write_schema(schema)
        if o["auto_create"]:
            _create_if_missing(o)
        _db_, _ts, config = _open_topic(o)
        if o["idempotent"] and not config.dedupe_window_s:
            # A retried task would push its rows again: refuse rather than break the promise.
            raise SparkOptionError(f"fdq writer: topic {o['topic']!r} has dedupe_window_s = 0, so an "
                                   "idempotent write (option 'idempotent', default true) cannot "
                                   "deduplicate a retried task: give the topic a dedupe window or "
                                   "set option 'idempotent' to 'false'")
        return FDQWriter(o, schema)


def _create_if_missing(o: dict):
    """Create the write's topic with the default configuration, as a producer's first push
    would (``ProducerConfig.auto_create``), here on the driver: the dedupe window the
    idempotent write relies on is then checked before any task runs."""
    db = _db(o["url"])
    try:
        Supervisor(db).create_topic(o["topic"])
    except TopicExists:
        pass
    except InvalidName as e:
        raise SparkOptionError(f"fdq: option 'topic': {e}") from None


def register(spark) -> None:
    """Register ``format("fdq")`` with a SparkSession (and enable the Python data source
    filter pushdown it uses: ``spark.sql.python.filterPushdown.enabled``)."""
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    spark.dataSource.register(FDQDataSource)


__all__ = ["register", "FDQDataSource", "FDQReader", "FDQPushdownReader", "FDQStreamReader", "FDQWriter",
           "SparkOptionError", "SCHEMA", "parse_time", "plan_ranges"]
