"""Producers: push messages into a topic.

A push is one transaction that reads the topic's config key and otherwise writes blind:
the message into the "all" log and into every subscription's shard queue, counters by
atomic add. So producers never conflict with each other or with consumers; a config
change (pause, reshard, new subscription) makes in-flight pushes retry with it.

Retries are exact: each push transaction writes a marker holding its versionstamp; a
retry after ``commit_unknown_result`` finds it and returns the first commit's ids.
"""
from __future__ import annotations

import atexit
import datetime
import os
import random
import struct
import threading
import time
import weakref
from _thread import allocate_lock as _allocate_lock
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import Future as _ConcurrentFuture
from concurrent.futures import InvalidStateError
from dataclasses import dataclass
from types import MappingProxyType

import fdb.tuple as fdbtuple
from fdb.tuple import Versionstamp

from .config import ProducerConfig, TopicConfig, check_name
from .engine import after_interrupt, check_process, error_types, retry_or_raise, transactional
from .times import MIN_BARE_MS, iso_ms
from .errors import (BacklogFull, ConfigError, EngineError, FDQError, InvalidHeader, InvalidMessage,
                     MessageTooLarge, TopicHeld, TopicNotFound, is_maybe_committed)
from .headers import dispatch_tag, trace_id, validate_headers
from .keyspace import (Keyspace, TopicSpace, counter, decode_counter, ensure_format, message_id, vs_key,
                       vs_key_parts)
from .keyspace.codec import (CHUNK_BYTES, RECORD_BYTES, ROUTE_BYTES, Record, pack, packer, shard_of, split_body,
                             unpack)
from .log import entry_bytes
from .membership import read_clock
from .topic import HOLD_WAIT_S, check_hold, load_config, write_new_topic_config

VERSIONS_PER_S = 1_000_000
MARKER_TTL_S = 600.0          # push markers outlive any commit_unknown_result retry
# A marker holds its transaction's results: over this, its payload is split into parts
# at marks/<txid>/<i> (FDB's value limit is 100,000 bytes); its value then starts with
# _SPLIT (a byte msgpack never uses) and the part count.
MARKER_PART_BYTES = 90_000
_SPLIT = b"\xc1"
_OFFSET0 = struct.pack("<I", 0)
_PLACEHOLDER = b"\x00" * 10
MAX_DELAY_S = 10 * 365 * 86400   # (NaN, inf and overflowing delays are refused at the call)
MAX_SHARD_KEY_BYTES = 1024    # a shard key is stored with every copy of its message
MAX_PER_TRANSACTION = 1 << 16   # a versionstamp's user version (2 bytes) numbers them


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


MAX_TIME_MS = 1 << 62     # |epoch ms| beyond this is no time (stored times are int64)


def to_ms(t, *, refuse_seconds: bool = True) -> int | None:
    """Epoch milliseconds from an int/float (ms) or a datetime (naive = UTC). NaN,
    infinities and times beyond ``MAX_TIME_MS`` are refused (ConfigError), and so is a
    number from 1 to ``MIN_BARE_MS`` (1973-03-03 as milliseconds): it is almost surely
    epoch seconds (``time.time()``), which as milliseconds would mean January 1970 and
    replay or rewind to the start of the log (``refuse_seconds=False``: a time already
    checked, e.g. by ``Producer.replay``)."""
    if t is None:
        return None
    if isinstance(t, datetime.datetime):
        if t.tzinfo is None:
            t = t.replace(tzinfo=datetime.timezone.utc)
        return (t - _EPOCH) // datetime.timedelta(milliseconds=1)     # exact: no float
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t or not -MAX_TIME_MS <= t <= MAX_TIME_MS:
        raise ConfigError(f"time must be epoch milliseconds (within ±2**62) or a datetime, not {t!r}")
    if refuse_seconds and 0 < t < MIN_BARE_MS:
        raise ConfigError(f"time {t!r} looks like epoch seconds (as epoch milliseconds it is "
                          f"{iso_ms(int(t))}): times are epoch milliseconds or a datetime; "
                          f"pass {int(t * 1000)} or a datetime")
    return int(t)


def _utf8(what: str, text: str):
    """Refuse a str that has no UTF-8 form (lone surrogates): caught at the call, it
    cannot fail the other pushes of a shared transaction."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidMessage(f"{what} must be valid Unicode (it has no UTF-8 form): {text!r}") from None


@dataclass(frozen=True)
class Envelope:
    """What a producer pushes. ``headers`` is a read-only mapping (extend topics only).
    Limits: ``shard_key`` at most ``MAX_SHARD_KEY_BYTES`` (UTF-8), ``msg_id`` 256
    characters, the body the topic's ``max_message_bytes``."""

    body: bytes
    shard_key: str | None = None
    delay: float | None = None
    msg_id: str | None = None
    headers: Mapping | None = None

    def __post_init__(self):
        if isinstance(self.body, (bytearray, memoryview)):
            object.__setattr__(self, "body", bytes(self.body))
        if not isinstance(self.body, bytes):
            raise InvalidMessage(f"message body must be bytes, not {type(self.body).__name__}"
                                 + (" (encode the str first)" if isinstance(self.body, str) else ""))
        if self.shard_key is not None:
            if not isinstance(self.shard_key, str):
                raise InvalidMessage(f"shard_key must be a str, not {type(self.shard_key).__name__}")
            if not self.shard_key.isascii():
                _utf8("shard_key", self.shard_key)
            if len(self.shard_key) > MAX_SHARD_KEY_BYTES // 4 and len(self.shard_key.encode()) > MAX_SHARD_KEY_BYTES:
                raise InvalidMessage(f"shard_key of {len(self.shard_key.encode()):,} bytes (UTF-8) exceeds "
                                     f"the limit of {MAX_SHARD_KEY_BYTES:,}")
        if self.msg_id is not None and (not isinstance(self.msg_id, str) or not 0 < len(self.msg_id) <= 256):
            raise InvalidMessage(f"msg_id must be a non-empty str of at most 256 characters, not {self.msg_id!r}")
        if self.msg_id is not None and not self.msg_id.isascii():
            _utf8("msg_id", self.msg_id)
        if isinstance(self.delay, datetime.timedelta):
            object.__setattr__(self, "delay", self.delay.total_seconds())
        if self.delay is not None and (isinstance(self.delay, bool) or not isinstance(self.delay, (int, float))
                                       or not 0 <= self.delay <= MAX_DELAY_S):
            raise InvalidMessage(f"delay must be seconds from 0 to {MAX_DELAY_S:,}, not {self.delay!r}")
        if self.headers is not None:
            plain = validate_headers(self.headers)
            object.__setattr__(self, "headers", MappingProxyType(plain))
            object.__setattr__(self, "_plain_headers", plain or None)   # what push encodes: no copy


@dataclass(frozen=True)
class PushResult:
    """The outcome of one push: ``id`` is the message's id (the first one's, for a
    deduplicated ``msg_id``). When the message's ``##trace_id`` header is a string of
    digits, ``trace_id`` echoes it and ``position`` is the message's position in the
    topic's log (its id: commit versionstamp + index), as NSQ's PUB_EXT response does."""

    id: str
    topic: str
    shard: int
    duplicate: bool = False
    trace_id: str | None = None
    position: str | None = None


_new = object.__new__


def _plain_result(mid: str, topic: str, shard: int) -> PushResult:
    """``PushResult(mid, topic, shard)`` without the frozen dataclass's ``__init__``
    (one ``object.__setattr__`` per field: half of a push_many's result time)."""
    r = _new(PushResult)
    r.__dict__.update(id=mid, topic=topic, shard=shard, duplicate=False, trace_id=None, position=None)
    return r


class _Item:
    """One queued push. ``done`` is a lock held until the push is committed or failed:
    a waiting caller blocks on acquiring it (cheaper than an Event: no Condition, no
    waiter lock per wait, one wake-up per message)."""

    __slots__ = ("topic", "env", "result", "error", "future", "done")

    def __init__(self, topic: str, env: Envelope, future: _ConcurrentFuture | None = None):
        self.topic, self.env, self.future = topic, env, future
        self.result = self.error = None
        self.done = _allocate_lock()
        self.done.acquire()


# Messages without a shard key: a transaction puts runs of STICKY_RUN of them on one
# shard, starting at a random shard (Kafka's sticky partitioner, KIP-480). Even over
# time, and a batch touches a few shards' key ranges instead of every one of them.
STICKY_RUN = 100


def _spread_start() -> int:
    return random.randrange(1 << 30)


@transactional
def push_batch(tr, ks: Keyspace, items: list, txid: bytes, spread: int, auto_create,
               now_ms: int, time_index: dict, check_marker: bool = True):
    """Push ``items`` [(topic, Envelope)] in this transaction. Returns ``(results,
    stamp)``: results [(topic, user_version, shard, dup_of)] and the commit's stamp: 10
    bytes if this push had already committed (a retry after commit_unknown_result), else
    the ``get_versionstamp()`` future, ready once the transaction commits.

    ``check_marker=False`` skips the marker read on a first attempt (a fresh ``txid``
    cannot have committed yet). ``dup_of`` is a message id (an earlier push) or an int
    (the user version of an earlier message of this batch)."""
    first = ks.topic(items[0][0])
    marker_key = first.marks.pack((txid,))
    if check_marker:
        found = read_marker(tr, first, txid)
        if found is not None:   # committed before: return what it returned
            return found
    rv = clock = None
    configs = {}
    plans = {}
    results = []
    batch_ids = {}
    counters = defaultdict(int)
    tags_written = set()     # each tag's key once per transaction
    packb = packer()
    # (plan, shard) -> [plain messages pushed there, their records' bytes (log_bytes),
    # their bodies' bytes (inserted_bytes)]
    plain = {}
    set_stamped = tr.set_versionstamped_key
    minute = now_ms // 60000 * 60000
    last_plan = last_n = targets = sums = None
    for uv, (topic, env) in enumerate(items):
        plan = plans.get(topic)
        if plan is None:
            ts = ks.topic(topic)
            config = configs[topic] = _config_for_push(tr, ks, ts, auto_create)
            if not config.routing and config.held_at is not None:
                check_hold(tr, ts, config)      # TopicHeld: the caller waits and retries
            plan = plans[topic] = _push_plan(ts, config)
        ts, config = plan.ts, plan.config
        body = env.body
        if len(body) > config.max_message_bytes:
            raise MessageTooLarge(f"message body of {len(body):,} bytes exceeds topic {topic!r}'s "
                                  f"max_message_bytes ({config.max_message_bytes:,})")
        if len(body) > CHUNK_BYTES and len(body) * (1 + len(config.subs)) > ROUTE_BYTES:
            # its copies (the log's, one per subscription) are written in one transaction
            raise MessageTooLarge(f"message body of {len(body):,} bytes is too large to route to topic {topic!r}'s "
                                  f"log and its {len(config.subs)} subscriptions in one transaction (at most "
                                  f"{ROUTE_BYTES // (1 + len(config.subs)):,} bytes each)")
        n = shard_of(env.shard_key, config.shards) if env.shard_key is not None else \
            (spread + uv // STICKY_RUN) % config.shards
        if plan.routing and env.msg_id is None and not env.delay and not env.headers \
                and 0 < len(body) <= CHUNK_BYTES and getattr(env, "replay_of", None) is None:
            # The common message (what route_message does for it, with the keys'
            # prefixes prepared once per transaction): its record into the log and into
            # every subscription's ready queue of shard n.
            record = packb([now_ms, env.shard_key, None, None, body])   # = Record(...).encode()
            uvb = uv.to_bytes(2, "big")
            if n != last_n or plan is not last_plan:     # unkeyed messages: runs on one shard
                last_plan, last_n = plan, n
                targets = plan.targets(n)
                sums = plain.get((plan, n))
                if sums is None:
                    sums = plain[(plan, n)] = [0, 0, 0]
            for head, offset in targets:
                set_stamped(head + uvb + offset, record)
            sums[0] += 1        # its counters, added below
            sums[1] += len(record)
            sums[2] += len(body)
            if time_index.get(topic) != minute:
                time_index[topic] = minute   # a lost entry only makes a replay scan longer
                tr.set_versionstamped_key(vs_key(ts.time_index.pack((minute,)), uv), b"")
            results.append((topic, uv, n, None))
            continue
        if env.headers and not config.extend:
            raise InvalidHeader(f"topic {topic!r} has no extend support: headers are refused "
                                "(create it with extend=True or upgrade it)")
        if env.msg_id is not None:
            if (topic, env.msg_id) in batch_ids:
                first_uv, first_n = batch_ids[(topic, env.msg_id)]
                results.append((topic, uv, first_n, first_uv))
                continue
            if rv is None:
                rv = tr.get_read_version().wait()
            dkey = ts.dedupe.pack((env.msg_id,))
            seen = tr[dkey]
            if seen != None:  # noqa: E711
                raw = bytes(seen)
                first_vs = Versionstamp.from_bytes(raw[:12])
                # Within the window by versions, or by the producers' clock: a version
                # jump (FDB recovery, ~100 s) must not make a recent id look old. Clocks
                # disagree both ways: a first push "in the future" beyond the window is
                # a skewed clock, not a young id (else the id stays a duplicate for as
                # long as that clock is ahead).
                young = int.from_bytes(first_vs.tr_version[:8], "big") >= rv - int(config.dedupe_window_s * VERSIONS_PER_S)
                if not young and len(raw) >= 20:
                    young = abs(now_ms - int.from_bytes(raw[12:20], "big")) < config.dedupe_window_s * 1000
                if young:
                    # the first one's shard (kept from its push; entries written before
                    # it was kept: this push's, as then)
                    first_n = int.from_bytes(raw[20:24], "big") if len(raw) >= 24 else n
                    results.append((topic, uv, first_n, message_id(first_vs)))
                    continue
            batch_ids[(topic, env.msg_id)] = (uv, n)
            tr.set_versionstamped_value(dkey, _PLACEHOLDER + uv.to_bytes(2, "big") + now_ms.to_bytes(8, "big")
                                        + n.to_bytes(4, "big") + _OFFSET0)
            tr.set_versionstamped_key(vs_key(ts.dedupe_by_version.key(), uv), env.msg_id.encode())
        due = None
        due_at = getattr(env, "due_at", None)     # a replay: the original's due time
        if env.delay or due_at is not None:
            if clock is None:
                clock = read_clock(tr, ts.clock_key)
            due = clock + int(env.delay * 1000) if env.delay else due_at
            if due <= clock:
                due = None      # (a replayed message already due: ready at once)
        inline, chunks = split_body(env.body)
        headers = getattr(env, "_plain_headers", None)
        if headers is None and env.headers:
            headers = dict(env.headers)
        record = Record(now_ms, env.shard_key, env.msg_id, headers, inline, 0, len(chunks),
                        getattr(env, "replay_of", None), due).encode()
        if len(record) > RECORD_BYTES:      # the body fits a value, not with its headers and keys
            inline, chunks = split_body(env.body, force=True)
            record = Record(now_ms, env.shard_key, env.msg_id, headers, inline, 0, len(chunks),
                            getattr(env, "replay_of", None), due).encode()
        if not config.routing and len(config.subs) * (len(record) + len(env.body)) > ROUTE_BYTES:
            # play routes it alone, to every subscription, in one transaction: refuse what
            # could never be routed (it would block the play, and every message behind it)
            raise MessageTooLarge(f"message body of {len(env.body):,} bytes is too large to route to "
                                  f"topic {topic!r}'s {len(config.subs)} subscriptions in one transaction "
                                  f"(at most {ROUTE_BYTES:,} bytes in all)")
        tr.set_versionstamped_key(vs_key(ts.log_prefix(n), uv), record)
        for i, chunk in enumerate(chunks):
            tr.set_versionstamped_key(vs_key(ts.all_chunks.key(), uv, fdbtuple.pack((i,))), chunk)
        counters[ts.stat("log_bytes")] += entry_bytes(ts, n, len(record), len(chunks),
                                                      len(env.body) if chunks else 0)
        counters[ts.stat("inserted_bytes")] += len(env.body)
        if time_index.get(topic) != minute:
            time_index[topic] = minute   # a lost entry only makes a replay scan longer
            tr.set_versionstamped_key(vs_key(ts.time_index.pack((minute,)), uv), b"")
        counters[ts.stat("inserted")] += 1
        if config.routing:
            tag = dispatch_tag(headers)
            if tag and (topic, tag) not in tags_written:
                tags_written.add((topic, tag))
                _note_tag(tr, ts, tag)
            route_message(tr, ts, config, tag, n, uv, record, chunks, due, counters)
        else:
            tag = dispatch_tag(headers)
            if tag and (topic, tag) not in tags_written:
                tags_written.add((topic, tag))
                _note_tag(tr, ts, tag)
            tr.set_versionstamped_key(vs_key(ts.pending.key(), uv), pack(n))
        results.append((topic, uv, n, None))
    for (plan, n), (count, record_bytes, body_bytes) in plain.items():
        for key in plan.counter_keys(n):
            counters[key] += count
        counters[plan.ts.stat("log_bytes")] += record_bytes + count * plan.log_key_bytes(n)
        counters[plan.ts.stat("inserted_bytes")] += body_bytes
    for key, amount in counters.items():
        tr.add(key, counter(amount))
    written = None
    for topic, config in configs.items():
        if config.max_backlog is not None:
            if written is None:     # a duplicate msg_id writes nothing: it is answered, never refused
                written = {r[0] for r in results if r[3] is None}
            if topic in written:
                _check_backlog(tr, ks.topic(topic), config)
    payload = pack(results)
    if len(payload) <= MARKER_PART_BYTES:
        tr.set_versionstamped_value(marker_key, _PLACEHOLDER + payload + _OFFSET0)
    else:   # over one value: the rest in parts beside it (read_marker)
        parts = [payload[i:i + MARKER_PART_BYTES] for i in range(0, len(payload), MARKER_PART_BYTES)]
        tr.set_versionstamped_value(marker_key, _PLACEHOLDER + _SPLIT + len(parts).to_bytes(4, "big")
                                    + parts[0] + _OFFSET0)
        for i, part in enumerate(parts[1:], 1):
            tr[first.marks.pack((txid, i))] = part
    tr.set_versionstamped_key(vs_key(first.marks_by_version.key(), 0), txid)
    return results, tr.get_versionstamp()


def read_marker(tr, ts: TopicSpace, txid: bytes):
    """``(results, stamp)`` of the push transaction ``txid`` if it committed (its
    marker, under the topic of its first message), else None."""
    marker = tr[ts.marks.pack((txid,))]
    if marker == None:  # noqa: E711
        return None
    raw = bytes(marker)
    stamp, payload = raw[:10], raw[10:]
    if payload[:1] == _SPLIT:
        r = ts.marks[txid].range()
        payload = payload[5:] + b"".join(bytes(kv.value) for kv in tr.get_range(r.start, r.stop))
    return unpack(payload), stamp


def _note_tag(tr, ts: TopicSpace, tag: str):
    """Record a dispatch tag (lets consumers find the tag's shards) if it is new. Read
    by snapshot, written only when absent: shard assignment reads the tags with a
    conflict range, so a tag key rewritten by every push made each assignment conflict
    with a tagged push stream."""
    key = ts.tags.pack((tag,))
    if tr.snapshot[key] == None:  # noqa: E711
        tr[key] = b""


class _PushPlan:
    """What a plain message (no msg_id, delay, headers or chunks) of one topic under one
    config writes, per shard: the stamped keys' prefixes (``vs_key_parts``: key = head +
    user version + offset) of its log row and of every subscription's ready row, and
    the counters it adds 1 to, and its log key's bytes (the log_bytes counter). Built once
    per topic, config and producer process."""

    __slots__ = ("ts", "config", "routing", "_shards")

    def __init__(self, ts: TopicSpace, config: TopicConfig):
        self.ts, self.config, self.routing = ts, config, config.routing
        self._shards = {}

    def _shard(self, n: int):
        got = self._shards.get(n)
        if got is None:
            ts = self.ts
            shards = [ts.shard(sub, "", n) for sub in self.config.subs]
            targets = [vs_key_parts(ts.log_prefix(n))] + [vs_key_parts(s.ready_prefix) for s in shards]
            keys = [ts.stat("inserted"), ts.stat("routed")] + [s.stat("routed") for s in shards]
            got = self._shards[n] = (targets, keys, entry_bytes(ts, n, 0))
        return got

    def targets(self, n: int) -> list:
        got = self._shards.get(n)
        return (got or self._shard(n))[0]

    def counter_keys(self, n: int) -> list:
        return self._shard(n)[1]

    def log_key_bytes(self, n: int) -> int:
        """The bytes of a log key of shard ``n`` (``fdq.log.entry_bytes`` of an empty record)."""
        return self._shard(n)[2]


def _push_plan(ts: TopicSpace, config: TopicConfig) -> _PushPlan:
    plans = ts.push_plans
    plan = plans.get(config)
    if plan is None:
        if len(plans) > 16:
            plans.clear()
        plan = plans[config] = _PushPlan(ts, config)
    return plan


def route_message(tr, ts: TopicSpace, config: TopicConfig, tag: str, n: int, uv: int,
                  record: bytes, chunks: list, due: int | None, counters):
    """Write one message (user version ``uv`` of this transaction's versionstamp) into
    every subscription's shard queue: ready, or delayed until the database clock reaches
    ``due`` (ms, ``membership.read_clock``)."""
    for sub in config.subs:
        shard = ts.shard(sub, tag, n)
        if due is None:
            tr.set_versionstamped_key(vs_key(shard.ready_prefix, uv), record)
        else:
            tr.set_versionstamped_key(vs_key(shard.delayed.pack((due,)), uv), record)
            counters[shard.stat("delayed")] += 1
        for i, chunk in enumerate(chunks):
            tr.set_versionstamped_key(vs_key(shard.chunks.key(), uv, fdbtuple.pack((i,))), chunk)
        counters[shard.stat("routed")] += 1   # consumers watch this key
    counters[ts.stat("routed")] += 1


_config_cache = {}


def _decode_config(raw) -> TopicConfig | None:
    if raw == None:  # noqa: E711
        return None
    raw = bytes(raw)
    config = _config_cache.get(raw)
    if config is None:
        if len(_config_cache) > 1024:
            _config_cache.clear()
        config = _config_cache[raw] = load_config(raw)
    return config


def _config_for_push(tr, ks, ts, auto_create) -> TopicConfig:
    config = _decode_config(tr[ts.config_key])
    if config is None:
        if not auto_create:
            raise TopicNotFound(f"topic {ts.name!r} does not exist")
        check_name(ts.name)
        ensure_format(tr, ks)     # as create_topic: the first topic records the layout
        config = auto_create if isinstance(auto_create, TopicConfig) else TopicConfig()
        config = write_new_topic_config(tr, ts, config)
    return config


def _check_backlog(tr, ts, config):
    """Snapshot reads of the shard counters: pushes never conflict over the backlog, so
    concurrent producers may overshoot max_backlog by their in-flight batches. What is
    not routed yet (pushed while paused or resharding) counts for every subscription."""
    from .stats import shard_counters
    pending = decode_counter(tr.snapshot[ts.stat("inserted")]) - decode_counter(tr.snapshot[ts.stat("routed")])
    for sub in config.subs:
        backlog = pending + sum(c["backlog"] for c in shard_counters(tr.snapshot, ts, sub, config).values())
        if backlog > config.max_backlog:
            raise BacklogFull(f"topic {ts.name!r} subscription {sub!r} would have a backlog of "
                              f"{backlog:,} (max_backlog {config.max_backlog:,}): push refused")


class _GroupCommit:
    """Group commit. A caller that finds nobody committing commits what is queued itself
    (one thread: no hand-off, no wake-up); callers arriving meanwhile queue and wait. If
    pushes are queued when its commit ends, it hands them to the producer's flusher
    thread and returns (to push again): the flusher keeps committing while pushes keep
    coming, each commit carrying every caller waiting, and gives up leading when the
    queue stays empty. Asynchronous pushes (no caller waiting) are always led by it."""

    def __init__(self, flush, max_batch: int, linger_s: float):
        self._flush = flush
        self._max_batch = max_batch
        self._linger_s = linger_s
        self._lock = threading.Lock()
        self._queue = []
        self._leading = False
        self._flusher = None
        self._flusher_go = threading.Event()
        self._commit_s = 0.0
        self._callers = 0        # callers inside submit: queued, or released and not yet returned
        self._async_pending = 0  # asynchronous pushes queued or being committed
        self._idle = threading.Condition(self._lock)
        self._local = threading.local()     # .flushing: this thread is committing a batch
        self._committing = []    # the batches being committed (a forked child fails their futures)
        _LIVE_GROUPS.add(self)

    def submit(self, item: _Item):
        """Queue ``item`` and return once it is committed (or failed)."""
        if getattr(self._local, "flushing", False):
            # Called by the thread committing a batch: from a push_async future's done
            # callback (run where the result is set). It would wait for itself while
            # nobody else may lead: commit this push now, alone.
            self._flush([item])
            return
        with self._lock:
            self._queue.append(item)
            self._callers += 1
            lead = not self._leading
            if lead:
                self._leading = True
        try:
            if not lead:
                item.done.acquire()
                return
            self._lead(rounds=1)
        finally:
            with self._lock:
                self._callers -= 1

    def submit_async(self, item: _Item):
        """Queue ``item`` without waiting; its ``future`` resolves after the commit."""
        with self._lock:
            self._queue.append(item)
            self._async_pending += 1
            if self._leading:
                return
            self._leading = True
        self._wake_flusher()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every asynchronous push queued so far is committed or failed
        (and those queued meanwhile); False if ``timeout`` passed first. From the
        thread committing a batch (a ``push_async`` future's done callback) it would
        wait for itself: a ``ConfigError`` says so instead."""
        if getattr(self._local, "flushing", False):
            raise ConfigError("Producer.flush() called from a push_async callback: the callback runs in the "
                              "thread committing the pushes it would wait for; flush from another thread")
        with self._idle:
            return self._idle.wait_for(lambda: not self._async_pending, timeout)

    def _wake_flusher(self):
        with self._lock:    # (with the flusher's idle exit: a wake-up is never left unread)
            self._flusher_go.set()
            if self._flusher is None or not self._flusher.is_alive():
                self._flusher = threading.Thread(target=self._flusher_loop, name="fdq-producer-flush",
                                                 daemon=True)
                self._flusher.start()

    def _flusher_loop(self):
        while True:
            if not self._flusher_go.wait(FLUSHER_IDLE_S):
                # Idle: end (a thread waiting forever would hold its Producer and
                # connection: one made per request left one each). The next wake-up
                # starts another.
                with self._lock:
                    if not self._flusher_go.is_set():
                        if self._flusher is threading.current_thread():
                            self._flusher = None
                        return
                continue
            self._flusher_go.clear()
            try:
                self._lead(rounds=None)
            except BaseException:   # delivered to the items' futures by the flush
                pass

    def _lead(self, rounds: int | None):
        """Commit queued pushes, ``rounds`` times (None: until the queue stays empty),
        then hand what is left to the flusher."""
        last = 0
        n = 0
        try:
            while rounds is None or n < rounds:
                n += 1
                if self._linger_s:
                    time.sleep(self._linger_s)
                elif last and len(self._queue) < min(self._callers, self._max_batch):
                    self._gather()
                with self._lock:
                    batch = self._queue[:self._max_batch]
                    del self._queue[:self._max_batch]
                    if not batch:
                        self._leading = False
                        return
                t0 = time.perf_counter()
                self._committing.append(batch)
                try:
                    self._local.flushing = True
                    self._flush(batch)
                finally:
                    self._local.flushing = False
                    self._committing.remove(batch)
                    done = sum(it.future is not None for it in batch)
                    if done:
                        with self._lock:
                            self._async_pending -= done
                            if not self._async_pending:
                                self._idle.notify_all()
                self._commit_s = time.perf_counter() - t0
                last = len(batch)
        except BaseException:
            after_interrupt()
            # Interrupted (a signal handler's exception while lingering, say): the
            # flusher takes over what is queued, or nobody would lead it again.
            self._handoff()
            raise
        self._handoff()

    def _gather(self):
        """Give the callers the last commit released (waiting for the GIL meanwhile) the
        time to push again before the next commit takes the queue: until every caller
        inside ``submit`` has queued, for at most a fifth of the last commit's time (and
        1 ms). Else the callers split into groups that alternate, each commit carrying
        one group."""
        deadline = time.perf_counter() + min(0.001, self._commit_s / 5)
        while len(self._queue) < min(self._callers, self._max_batch) and time.perf_counter() < deadline:
            time.sleep(0)

    def _reset_in_child(self):
        """After fork(), in the child: its locks may have been held by a thread of the
        parent, its queue is the parent's (committed there), and nobody leads it. The
        futures of the pushes queued or being committed (the parent's, copied) fail here:
        the parent commits them."""
        queued, self._queue = self._queue, []
        for batch in self._committing:    # being committed by a thread of the parent's
            queued += batch
        self._committing = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._leading = False
        self._flusher = None
        self._flusher_go = threading.Event()
        self._callers = self._async_pending = 0
        self._local = threading.local()
        err = EngineError(1021, "this push was queued before the process forked: the parent process "
                                "commits it, not this one (it may have committed)")
        for it in queued:
            if it.future is not None:
                try:
                    it.future.set_exception(err)
                except InvalidStateError:
                    pass

    def _handoff(self):
        with self._lock:
            if not self._queue:
                self._leading = False
                return
        self._wake_flusher()


_LIVE_GROUPS = weakref.WeakSet()
FLUSHER_IDLE_S = 2.0    # a producer's flusher thread ends after this long without work
_LIVE_PRODUCERS = weakref.WeakSet()
EXIT_FLUSH_S = 60.0     # at interpreter exit, how long pending push_async calls may take


def _after_fork_in_child():
    """A Producer used on both sides of a fork(): the child gets a session of its own
    (the parent's would give both processes the same transaction ids, and a retry after
    commit_unknown_result would take the other's marker for its own commit) and a group
    commit with no leader (the parent's flusher thread is not in the child)."""
    for producer in list(_LIVE_PRODUCERS):
        producer._session = os.urandom(8)
        producer._seq_lock = threading.Lock()
    for group in list(_LIVE_GROUPS):
        group._reset_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _flush_at_exit():
    """The flusher is a daemon thread (it must not keep a process alive): at a normal
    exit, commit what ``push_async`` callers left queued before it is stopped."""
    deadline = time.monotonic() + EXIT_FLUSH_S
    for group in list(_LIVE_GROUPS):
        group.flush(max(0.0, deadline - time.monotonic()))


class Producer:
    """Pushes messages. Thread-safe; concurrent ``push`` calls share transactions.

    Example::

        p = fdq.Producer(db)
        r = p.push("orders", b"body", shard_key="cust-42")
        p.push_many("orders", [fdq.Envelope(b"a", shard_key="x"), fdq.Envelope(b"b")])
    """

    def __init__(self, db, *, config: ProducerConfig | None = None, keyspace: Keyspace | None = None):
        self.db = db
        self.config = config or ProducerConfig()
        self.keyspace = keyspace or Keyspace()
        self._time_index = {}
        # Marker ids: a random session plus a sequence, so a producer's markers are
        # neighbours in the key space (one B-tree page, not a random one per push).
        self._session = os.urandom(8)
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._group = _GroupCommit(self._flush, self.config.max_batch, self.config.linger_ms / 1000)
        _LIVE_PRODUCERS.add(self)
        # atexit runs handlers last-registered first: registered again here, the exit flush
        # runs before the handler of FoundationDB's binding (registered when fdb.impl was
        # imported, before any Database existed) stops its network thread.
        atexit.unregister(_flush_at_exit)
        atexit.register(_flush_at_exit)

    def push(self, topic: str, body: bytes, *, shard_key: str | None = None, msg_id: str | None = None,
             delay: float | None = None, headers: Mapping | None = None) -> PushResult:
        """Push one message; returns after it is committed. A call interrupted (by a
        signal handler's exception) may still commit its push, as a cancelled future."""
        item = _Item(check_name(topic), Envelope(body, shard_key, delay, msg_id, headers))
        self._group.submit(item)
        if item.error is not None:
            raise item.error
        return item.result

    def push_async(self, topic: str, body: bytes, *, shard_key: str | None = None,
                   msg_id: str | None = None, delay: float | None = None,
                   headers: Mapping | None = None) -> _ConcurrentFuture:
        """As ``push`` without waiting: returns a ``concurrent.futures.Future`` of the
        ``PushResult``, resolved after the commit. Pending pushes share transactions
        (committed by one background thread per producer). Cancelling the future does
        not recall the push."""
        item = _Item(check_name(topic), Envelope(body, shard_key, delay, msg_id, headers),
                     future=_ConcurrentFuture())
        self._group.submit_async(item)
        return item.future

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every ``push_async`` made so far is committed (or failed); False
        if ``timeout`` (seconds) passed first. Also done at a normal interpreter exit
        (for up to ``EXIT_FLUSH_S``), so queued pushes are not dropped with the process."""
        return self._group.flush(timeout)

    def push_many(self, topic: str, envelopes) -> list:
        """Push several messages in one transaction (all or none). More than one
        transaction can hold (FDB's 10 MB: each message is written to the log and to
        every subscription) is refused with ``MessageTooLarge``, nothing pushed."""
        check_name(topic)
        envs = [e if isinstance(e, Envelope) else Envelope(e) for e in envelopes]
        if not envs:
            return []
        if len(envs) > MAX_PER_TRANSACTION:
            raise InvalidMessage(f"push_many of {len(envs):,} messages: one transaction holds at most "
                                 f"{MAX_PER_TRANSACTION:,} (a message id numbers it in 2 bytes)")
        try:
            return self._commit([(topic, e) for e in envs])
        except EngineError as e:
            if e.code != 2101 or len(envs) == 1:
                raise
            # (one message too big is refused by push_batch with its own reason)
            raise MessageTooLarge(f"push_many of {len(envs):,} messages ({sum(len(x.body) for x in envs):,} "
                                  f"bytes of bodies) does not fit one transaction (FDB's 10 MB, each message "
                                  f"written to the log and to every subscription's queue): nothing was "
                                  f"pushed; push them in smaller batches") from e

    def _flush(self, batch: list):
        interrupted = None
        try:
            self._commit_group(batch)
        except Exception as e:
            for it in batch:
                if it.result is None and it.error is None:
                    it.error = e
        except BaseException as e:
            after_interrupt()
            # The committing thread was interrupted (KeyboardInterrupt, a signal
            # handler's exception): that is its own to raise, once every push of the
            # batch is released with an error of its own, which cannot say more than
            # "may have committed" (the interrupt may have come after the commit).
            interrupted = e
            err = EngineError(1021, f"the thread committing this push was interrupted ({e!r}): "
                                    "it may have committed")
            for it in batch:
                if it.result is None and it.error is None:
                    it.error = err
        for it in batch:
            future = it.future
            if future is not None:
                try:
                    if it.error is not None:
                        future.set_exception(it.error)
                    else:
                        future.set_result(it.result)
                except InvalidStateError:
                    pass    # cancelled by its owner: the push is stored all the same
            it.done.release()
        if interrupted is not None:
            raise interrupted

    def _commit_group(self, batch: list):
        """Commit queued pushes together. One bad push must not fail the others: a
        refused batch is split in halves until the bad ones stand alone (O(log n) more
        transactions per bad push, not one per message)."""
        try:
            results = self._commit([(it.topic, it.env) for it in batch])
        except FDQError as e:
            if len(batch) == 1 or is_maybe_committed(e):
                # Maybe committed: the whole batch shares the outcome; pushing halves
                # again would store its messages twice.
                for it in batch:
                    it.error = e
                return
            half = len(batch) // 2
            self._commit_group(batch[:half])
            self._commit_group(batch[half:])
            return
        for it, r in zip(batch, results):
            it.result = r

    def _commit(self, items: list) -> list:
        now_ms = int(time.time() * 1000)
        with self._seq_lock:
            self._seq += 1
            txid = self._session + self._seq.to_bytes(8, "big")
        spread = _spread_start()
        check_process(self.db)
        tr = self.db.create_transaction()
        maybe_committed = in_flight = False
        while True:
            committing = False
            try:
                results, stamp = push_batch(tr, self.keyspace, items, txid, spread, self.config.auto_create,
                                            now_ms, self._time_index, maybe_committed)
                committing = True
                tr.commit().wait()
                break
            except TopicHeld:       # a play finishing (~ms; lapses by itself): not written
                tr.reset()
                time.sleep(HOLD_WAIT_S)
                continue
            except error_types() as e:
                # 1021/1039: may have committed, no longer in flight; 1031 during the
                # commit (a timeout): may have committed, maybe still in flight (FDB).
                in_flight = in_flight or (committing and getattr(e, "code", None) == 1031)
                maybe_committed = maybe_committed or is_maybe_committed(e) or in_flight
                try:
                    retry_or_raise(tr, e)
                except FDQError as final:
                    if not maybe_committed:
                        raise
                    # Given up (retry limit, timeout) after an attempt that may have
                    # committed: its marker says whether it did. Never report such a
                    # push as not committed (the caller, or the group commit's split,
                    # would push it again).
                    results, stamp = self._resolve(items[0][0], txid, in_flight, final)
                    break
        stamp = stamp if type(stamp) is bytes else bytes(stamp.wait())
        out = []
        stamp_hex = stamp.hex()
        for (topic, uv, n, dup_of), (_t, env) in zip(results, items):
            if dup_of is None and not env.headers:
                # message_id(Versionstamp(stamp, uv)), without the objects
                out.append(_plain_result(f"{stamp_hex}{uv:04x}", topic, n))
                continue
            if isinstance(dup_of, int):
                dup_of = message_id(Versionstamp(stamp, dup_of))
            mid = dup_of or message_id(Versionstamp(stamp, uv))
            trace = trace_id(env.headers)   # digits only, as NSQ's PUB_EXT echoes it
            out.append(PushResult(mid, topic, n, dup_of is not None, trace,
                                  mid if trace is not None else None))
        return out

    def _resolve(self, topic: str, txid: bytes, in_flight: bool, final: Exception):
        """The outcome of a push transaction that gave up after an attempt that may have
        committed: ``(results, stamp)`` from its marker if it committed; ``final`` if it
        surely did not (its unknown attempts are no longer in flight, and the marker is
        absent); else a ``commit_unknown_result`` EngineError (maybe committed)."""
        ts = self.keyspace.topic(topic)
        check_process(self.db)
        tr = self.db.create_transaction()
        try:
            while True:
                try:
                    found = read_marker(tr, ts, txid)
                    break
                except error_types() as e:
                    retry_or_raise(tr, e)
        except FDQError as e:
            raise EngineError(1021, f"push gave up ({final}) after an attempt that may have committed; "
                                    f"its outcome could not be read ({e})") from final
        if found is not None:
            return found
        if in_flight:
            raise EngineError(1021, f"push gave up ({final}) while a commit may still be in flight: "
                                    "it may have committed") from final
        raise final

    def replay(self, topic: str, start, end=None, *, progress=None) -> int:
        """Re-deliver the "all" log's messages with insertion time in ``[start, end)``
        (epoch milliseconds or ``datetime``, naive = UTC; ``end=None``: no bound)
        (committed before the replay began) to the topic's subscriptions, in order, as
        new messages (new ids; the record keeps the original id in ``replay_of``; a
        delayed message not due yet stays delayed until its due time), once per call:
        two calls at once replay the window twice. Resumable: the same call after a
        crash takes over the killed run (once its heartbeat has stood still for
        ``fdq.supervisor.REPLAY_ORPHAN_S``) and continues where it stopped; nothing is
        pushed twice. ``start``/``end``: epoch ms or datetimes (naive = UTC); ``end``
        before ``start`` is a ConfigError. Returns how many this call replayed."""
        from .supervisor import replay_window
        return replay_window(self.db, self.keyspace, topic, to_ms(start), to_ms(end), progress=progress)


__all__ = ["Producer", "Envelope", "PushResult", "push_batch", "route_message", "to_ms"]
