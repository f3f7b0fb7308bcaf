"""Pushing messages: the push transaction, and the one rule for how much it may write.

A push is one transaction that reads each topic's config key and otherwise writes blind:
the message into the "all" log and into every subscription's shard queue (or, while the
topic is paused, into its pending list for play), counters by atomic add. So producers
never conflict with each other or with consumers; a config change (pause, reshard, new
subscription) makes in-flight pushes retry with it.

Retries are exact: each push transaction writes a marker holding its results, stamped
with its commit; a retry after ``commit_unknown_result`` finds it (:func:`read_marker`)
and returns the first commit's ids. Markers expire after ``MARKER_TTL_S``.

Sizing, once: a message's writes are a copy (body, key, headers) in the log and one per
subscription (:func:`write_bytes`), one message's bodies at most ``ROUTE_BYTES``; a transaction that
takes as many messages as fit (``push_batch(budget=...)``) stops before ``TX_WRITE_BYTES``
(:func:`fits`), but always takes its first message.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..config import TopicConfig, check_name
from ..engine import transactional
from ..envelope import Envelope
from ..errors import BacklogFull, InvalidHeader, MessageTooLarge, TopicNotFound
from ..headers import PROPAGATION, dispatch_tag
from ..keyspace.format import ensure_format
from ..keyspace import (VERSIONS_PER_S, Keyspace, TopicSpace, counter, index_part, message_id, push_counters,
                        vs_key, vs_key_parts)
from ..keyspace.codec import (CHUNK_BYTES, CHUNK_WRITE_BYTES, RECORD_BYTES, ROUTE_BYTES, Record, decode_dedupe,
                              decode_marker, encode_dedupe, encode_marker, encode_pending, packer, split_body)
from .clock import due_base, read_clock
from .stats import push_counters as push_counters_of, shard_counters
from .topics import cached_topic_config, check_hold, write_new_topic_config
from .log import entry_bytes
from .routing import home_for, shard_for

# What one push transaction that takes as many messages as fit may write (their bodies'
# copies): the budget of every chunked operation, far under FDB's 10 MB per transaction.
TX_WRITE_BYTES = CHUNK_WRITE_BYTES
MARKER_TTL_S = 600.0    # push markers outlive any commit_unknown_result retry (trim expires them)


def message_bytes(env) -> int:
    """One copy of a message as the sizing rule counts it: its body, shard key and
    headers (encoded)."""
    n = len(env.body)
    if env.shard_key:
        n += len(env.shard_key)
    if env.headers:
        n += len(packer()(dict(env.headers)))
    return n


def write_bytes(nbytes: int, config: TopicConfig) -> int:
    """What a message of ``nbytes`` (``message_bytes``) writes as the sizing rule counts
    it: a copy in the log and one in each of the topic's subscriptions."""
    return nbytes * (1 + len(config.subs))


def fits(written: int, more: int, budget: int = TX_WRITE_BYTES) -> bool:
    """The sizing rule: ``more`` bytes of writes fit a transaction that has written
    ``written`` (a transaction always takes its first message, up to ``ROUTE_BYTES``)."""
    return written + more <= budget


@dataclass(frozen=True)
class PushItem:
    """A message pushed on FDQ's own behalf (a replay): as an ``Envelope``, plus the
    original's id (``replay_of``) and due time (``due_at``, topic clock ms)."""

    body: bytes
    shard_key: str | None = None
    headers: dict | None = None
    replay_of: str | None = None
    due_at: int | None = None
    msg_id = None       # (not fields: what push reads of an Envelope, never set here)
    delay = None


class _Batch:
    """What one push transaction keeps across its messages (the full path's state)."""

    __slots__ = ("ks", "now_ms", "minute", "time_index", "rv", "clock", "due_base", "batch_ids", "counters",
                 "routed", "pushed", "tags")

    def __init__(self, ks: Keyspace, now_ms: int, time_index: dict):
        self.ks, self.now_ms, self.time_index = ks, now_ms, time_index
        self.minute = now_ms // 60000 * 60000
        self.rv = None
        self.clock, self.due_base = {}, {}  # topic -> its clock's reading, due base (delays, TTLs): read once
        self.batch_ids = {}
        self.counters = defaultdict(int)
        self.routed = defaultdict(int)      # the shards' routed counters (``add_routed``)
        # topic -> its push counters' amounts (PUSH_COUNTERS: inserted, routed,
        # inserted_bytes, log_bytes), added as one packed operand
        self.pushed = defaultdict(lambda: [0, 0, 0, 0])
        self.tags = set()     # each tag's key once per transaction


@transactional
def push_batch(tr, ks: Keyspace, items: list, txid: bytes, spread: int, auto_create,
               now_ms: int, time_index: dict, check_marker: bool = True, budget: int | None = None):
    """Push ``items`` [(topic, Envelope or PushItem)] in this transaction. Returns
    ``(results, stamp)``: results [(topic, user_version, shard, dup_of)] and the commit's
    stamp: 10 bytes if this push had already committed (a retry after
    commit_unknown_result), else the ``get_versionstamp()`` future, ready once the
    transaction commits.

    ``budget`` (bytes, e.g. ``TX_WRITE_BYTES``): push only the first items whose writes
    fit it (:func:`fits`, by the configs read here; at least one): the results say how
    many. None: all of them (FDB refuses a transaction over 10 MB: 2101).
    ``check_marker=False`` skips the marker read on a first attempt (a fresh ``txid``
    cannot have committed yet). ``dup_of`` is a message id (an earlier push) or an int
    (the user version of an earlier message of this batch)."""
    first = ks.topic(items[0][0])
    marker_key = first.marker_key(txid)
    if check_marker:
        found = read_marker(tr, first, txid)
        if found is not None:   # committed before: return what it returned
            return found
    b = _Batch(ks, now_ms, time_index)
    configs = {}
    plans = {}
    results = []
    spent = 0
    packb = packer()
    # (plan, shard) -> [plain messages pushed there, their records' bytes (log_bytes),
    # their bodies' bytes (inserted_bytes)]
    plain = {}
    set_stamped = tr.set_versionstamped_key
    minute = b.minute
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
        if len(body) > CHUNK_BYTES and write_bytes(len(body), config) > ROUTE_BYTES:
            # its copies (the log's, one per subscription) are written in one transaction
            raise MessageTooLarge(f"message body of {len(body):,} bytes is too large to route to topic {topic!r}'s "
                                  f"log and its {len(config.subs)} subscriptions in one transaction (at most "
                                  f"{ROUTE_BYTES // (1 + len(config.subs)):,} bytes each)")
        if budget is not None:
            more = write_bytes(message_bytes(env), config)
            if results and not fits(spent, more, budget):
                break       # the rest: the caller's next transaction
            spent += more
        key = env.shard_key
        # unkeyed: its home, kept in its record (the shard key's slot) for every later copy
        n = shard_for(key, config.shards) if key is not None else home_for(spread, uv, config.shards)
        if plan.routing and env.msg_id is None and not env.delay and not env.headers \
                and 0 < len(body) <= CHUNK_BYTES and isinstance(env, Envelope) \
                and env.ttl_s is None and plan.config.ttl_s is None:
            # The common message (what _push_full does for it, with the keys' prefixes
            # prepared once per transaction): its record into the log and into every
            # subscription's ready queue of shard n.
            record = packb([now_ms, n if key is None else key, None, None, body])   # = Record(...).encode()
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
                set_stamped(ts.time_index_vs_key(minute, uv), b"")
            results.append((topic, uv, n, None))
            continue
        results.append(_push_full(tr, b, plan, topic, env, uv, n))
    counters, routed, pushed = b.counters, b.routed, b.pushed
    for (plan, n), (count, record_bytes, body_bytes) in plain.items():
        for key in plan.counter_keys(n):
            routed[key] += count
        sums = pushed[plan.ts.name]
        sums[0] += count
        sums[1] += count
        sums[2] += body_bytes
        sums[3] += record_bytes + count * plan.log_key_bytes(n)
    for key, amount in counters.items():
        tr.add(key, counter(amount))
    for key, amount in routed.items():
        add_routed(tr, key, amount)
    # the topic's push counters: one part per transaction (by its txid, as its marker's
    # index), one packed add for the four
    part = index_part(txid)
    for topic, sums in pushed.items():
        tr.add(ks.topic(topic).push_stat(part), push_counters(*sums))
    written = None
    for topic, config in configs.items():
        if config.max_backlog is not None:
            if written is None:     # a duplicate msg_id writes nothing: it is answered, never refused
                written = {r[0] for r in results if r[3] is None}
            if topic in written:
                _check_backlog(tr, ks.topic(topic), config)
    value, parts = encode_marker(results)
    tr.set_versionstamped_value(marker_key, value)
    for i, part in enumerate(parts, 1):     # over one value: the rest in parts beside it
        tr[first.marker_part_key(txid, i)] = part
    tr.set_versionstamped_key(vs_key(first.marker_index(index_part(txid)).key(), 0), txid)
    return results, tr.get_versionstamp()


def _push_full(tr, b: _Batch, plan, topic: str, env, uv: int, n: int) -> tuple:
    """Push message ``uv`` (any message: a msg_id, a delay, headers, chunks, a replay, a
    paused topic) to shard ``n``; returns its result."""
    ts, config = plan.ts, plan.config
    if env.headers and not config.extend and not PROPAGATION.issuperset(env.headers):
        raise InvalidHeader(f"topic {topic!r} has no extend support: headers are refused "
                            "(create it with extend=True or upgrade it)")
    if env.msg_id is not None:
        if (topic, env.msg_id) in b.batch_ids:
            first_uv, first_n = b.batch_ids[(topic, env.msg_id)]
            return topic, uv, first_n, first_uv
        if b.rv is None:
            b.rv = tr.get_read_version().wait()
        dkey = ts.dedupe_key(env.msg_id)
        seen = tr[dkey]
        if seen != None:  # noqa: E711
            entry = decode_dedupe(seen)
            # Within the window by versions, or by the producers' clock: a version
            # jump (FDB recovery, ~100 s) must not make a recent id look old. Clocks
            # disagree both ways: a first push "in the future" beyond the window is
            # a skewed clock, not a young id (else the id stays a duplicate for as
            # long as that clock is ahead).
            young = entry.version >= b.rv - int(config.dedupe_window_s * VERSIONS_PER_S) \
                or abs(b.now_ms - entry.ts_ms) < config.dedupe_window_s * 1000
            if young:
                return topic, uv, entry.shard, message_id(entry.vs)
        b.batch_ids[(topic, env.msg_id)] = (uv, n)
        tr.set_versionstamped_value(dkey, encode_dedupe(uv, b.now_ms, n))
        mid = env.msg_id.encode()
        tr.set_versionstamped_key(vs_key(ts.dedupe_index(index_part(mid)).key(), uv), mid)
    if isinstance(env, Envelope):
        replay_of = due_at = None
        headers = env._plain_headers
    else:       # a PushItem (a replay): the original's id and due time
        replay_of, due_at = env.replay_of, env.due_at
        headers = dict(env.headers) if env.headers else None
    due = None
    if env.delay:
        due = _due_base(tr, b, ts) + int(env.delay * 1000)
    elif due_at is not None:
        clock = b.clock.get(topic)
        if clock is None:
            clock = b.clock[topic] = read_clock(tr, ts.clock_key)
        due = due_at if due_at > clock else None     # (a replayed message already due: ready at once)
    expires = _expires(tr, b, ts, env, config)
    inline, chunks = split_body(env.body)
    key = env.shard_key
    home = n if key is None else None
    rec = Record(b.now_ms, key, env.msg_id, headers, inline, 0, len(chunks), replay_of, due, expires, home)
    record = rec.encode()
    if len(record) > RECORD_BYTES:      # the body fits a value, not with its headers and keys
        inline, chunks = split_body(env.body, force=True)
        rec = Record(b.now_ms, key, env.msg_id, headers, inline, 0, len(chunks), replay_of, due, expires, home)
        record = rec.encode()
    if not config.routing and len(config.subs) * (len(record) + len(env.body)) > ROUTE_BYTES:
        # play routes it alone, to every subscription, in one transaction: refuse what
        # could never be routed (it would block the play, and every message behind it)
        raise MessageTooLarge(f"message body of {len(env.body):,} bytes is too large to route to "
                              f"topic {topic!r}'s {len(config.subs)} subscriptions in one transaction "
                              f"(at most {ROUTE_BYTES:,} bytes in all)")
    counters = b.counters
    tr.set_versionstamped_key(vs_key(ts.log_prefix(n), uv), record)
    for i, chunk in enumerate(chunks):
        tr.set_versionstamped_key(ts.chunk_vs_key(uv, i, rec), chunk)
    sums = b.pushed[topic]
    sums[0] += 1
    sums[2] += len(env.body)
    sums[3] += entry_bytes(ts, n, len(record), len(chunks), len(env.body) if chunks else 0, rec)
    if b.time_index.get(topic) != b.minute:
        b.time_index[topic] = b.minute   # a lost entry only makes a replay scan longer
        tr.set_versionstamped_key(ts.time_index_vs_key(b.minute, uv), b"")
    tag = dispatch_tag(headers)
    if tag and (topic, tag) not in b.tags:
        b.tags.add((topic, tag))
        _note_tag(tr, ts, tag)
    if config.routing:
        route_message(tr, ts, config, tag, n, uv, record, chunks, due, counters, rec, b.routed)
        sums[1] += 1
    else:
        tr.set_versionstamped_key(ts.pending_vs_key(n, uv), encode_pending(n))
    return topic, uv, n, None


def read_marker(tr, ts: TopicSpace, txid: bytes):
    """``(results, stamp)`` of the push transaction ``txid`` if it committed (its
    marker, under the topic of its first message), else None."""
    marker = tr[ts.marker_key(txid)]
    if marker == None:  # noqa: E711
        return None

    def parts():
        r = ts.marker_parts_range(txid)
        return [kv.value for kv in tr.get_range(r.start, r.stop)]
    stamp, results = decode_marker(marker, parts)
    return results, stamp


def _note_tag(tr, ts: TopicSpace, tag: str):
    """Record a dispatch tag (lets consumers find the tag's shards) if it is new. Read
    by snapshot, written only when absent: shard assignment reads the tags with a
    conflict range, so a tag key rewritten by every push made each assignment conflict
    with a tagged push stream."""
    key = ts.tag_key(tag)
    if tr.snapshot[key] == None:  # noqa: E711
        tr[key] = b""


def _expires(tr, b: _Batch, ts: TopicSpace, env, config: TopicConfig) -> int | None:
    """When a message's TTL ends (topic clock ms; None: it has none): its own ``ttl_s``
    or the topic's (a replay's copy: the topic's), from ``clock.due_base`` as a delay
    (the clock never runs ahead of real time and this base never behind it, so a TTL
    never ends early)."""
    ttl = env.ttl_s if isinstance(env, Envelope) and env.ttl_s is not None else config.ttl_s
    if ttl is None:
        return None
    return _due_base(tr, b, ts) + int(ttl * 1000)


def _due_base(tr, b: _Batch, ts: TopicSpace) -> int:
    """``clock.due_base`` of ``ts``'s topic, read once per transaction."""
    base = b.due_base.get(ts.name)
    if base is None:
        base = b.due_base[ts.name] = due_base(tr, ts.clock_key, ts.clock_version_key)
    return base


class _PushPlan:
    """What a plain message (no msg_id, delay, headers or chunks) of one topic under one
    config writes, per shard: the stamped keys' prefixes (``vs_key_parts``: key = head +
    user version + offset) of its log row and of every subscription's ready row, and
    the shard counters it adds 1 to, and its log key's bytes (the log_bytes counter). Built once
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
            keys = [s.stat("routed") for s in shards]
            got = self._shards[n] = (targets, keys, entry_bytes(ts, n, 0))
        return got

    def targets(self, n: int) -> list:
        got = self._shards.get(n)
        return (got or self._shard(n))[0]

    def counter_keys(self, n: int) -> list:
        return self._shard(n)[1]

    def log_key_bytes(self, n: int) -> int:
        """The bytes of a log key of shard ``n`` (``ops.log.entry_bytes`` of an empty record)."""
        return self._shard(n)[2]


def _push_plan(ts: TopicSpace, config: TopicConfig) -> _PushPlan:
    plans = ts.push_plans
    plan = plans.get(config)
    if plan is None:
        if len(plans) > 16:
            plans.clear()
        plan = plans[config] = _PushPlan(ts, config)
    return plan


def add_routed(tr, key: bytes, amount: int):
    """A push's add to a shard's ``routed`` counter, with no write conflict range: it
    wakes the shard's watchers (the watch fires on the value) but conflicts with no
    reader. The counter's readers need no conflict with a push (docs/design.md §5):
    consumers watch it (a lease round watching it in its own transaction conflicted with
    every push meanwhile), the stats and the backlog check read it by snapshot, and the
    only non-snapshot reader, ``reshard.fold_shard_counters``, runs while resharding,
    when pushes route to the pending area, not to shards."""
    tr.options.set_next_write_no_write_conflict_range()
    tr.add(key, counter(amount))


def route_message(tr, ts: TopicSpace, config: TopicConfig, tag: str, n: int, uv: int,
                  record: bytes, chunks: list, due: int | None, counters, rec: Record | None = None,
                  routed: dict | None = None):
    """Write one message (user version ``uv`` of this transaction's versionstamp; its
    ``record`` encoded, and as ``rec`` when it has ``chunks``) into every subscription's
    shard queue: ready, or delayed until the topic's clock reaches ``due`` (ms,
    ``clock.read_clock``). ``routed``: where the shards' routed counts go (the caller
    adds them with ``add_routed``), else ``counters``. (The topic's ``routed``: the
    caller's.)"""
    if routed is None:
        routed = counters
    for sub in config.subs:
        shard = ts.shard(sub, tag, n)
        if due is None:
            tr.set_versionstamped_key(vs_key(shard.ready_prefix, uv), record)
        else:
            tr.set_versionstamped_key(shard.delayed_vs_key(due, uv), record)
            counters[shard.stat("delayed")] += 1
        for i, chunk in enumerate(chunks):
            tr.set_versionstamped_key(shard.chunk_vs_key(uv, i, rec), chunk)
        routed[shard.stat("routed")] += 1   # consumers watch this key


def _config_for_push(tr, ks, ts, auto_create) -> TopicConfig:
    config = cached_topic_config(tr, ts)
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
    sums = push_counters_of(tr.snapshot, ts)
    pending = sums["inserted"] - sums["routed"]
    for sub in config.subs:
        backlog = pending + sum(c["backlog"] for c in shard_counters(tr.snapshot, ts, sub, config).values())
        if backlog > config.max_backlog:
            raise BacklogFull(f"topic {ts.name!r} subscription {sub!r} would have a backlog of "
                              f"{backlog:,} (max_backlog {config.max_backlog:,}): push refused")
