"""The key layout: the only code that knows where FDQ keeps what (docs/design.md §2).

Everything lives under a root subspace (default ``("fdq",)``), tuple-encoded::

    meta/format                                           layout version
    \xff/metadataVersion (outside the root)              bumped with every topic config change
    meta/leaders/<name>                                   a database-wide role's holder (ops/leaders)
    meta/leaders/<name>/beat                              its holder's beat counter (atomic add)
    meta/leaders/maintenance/<topic>[/beat]               the role of a topic's maintainer (fdq.maintainer)
    config/topics/<topic>                                 topic config (read by every push)
    config/topics/<topic>/consumers/<sub>/<id>            consumer record
    config/topics/<topic>/heartbeats/<sub>/<id>/hb        heartbeat counter (atomic add): apart from
                                                          the records, which assignment reads
    config/topics/<topic>/heartbeats/<sub>/<id>/hbc, hbv  clock, version at its last heartbeat (display)
    config/topics/<topic>/shards/<sub>/<tag>/<n>          shard record: owner, epoch
    config/topics/<topic>/assignment/<sub>                bumped when ownership changes
    config/topics/<topic>/subs/<sub>                      subscription record (config, start)
    config/topics/<topic>/subs/<sub>/boundary             versionstamp of its creation / reset
    config/topics/<topic>/subs/<sub>/cursor/<bucket>      catch-up progress per log bucket
    config/topics/<topic>/subs/<sub>/purge/<tag>/<n>      a reset's purge progress per shard
    topic/<topic>/clock                                   the topic's clock (ms; ops.clock): its
                                                          consumers advance it, its delays are due by it
    topic/<topic>/clock_version                           read version of its last advance (display)
    topic/<topic>/all/log/<bucket>/<vs>                   the "all" log (bucket = shard n)
    topic/<topic>/all/time/<minute_ms>/<vs>               sparse time -> position index
    topic/<topic>/all/stats/push/<part>                   inserted, routed, inserted_bytes, log_bytes: one
                                                          packed counter (PUSH_COUNTERS), summed parts
    topic/<topic>/all/stats/<name>/<part>                 emitted, acked, trimmed, ...: summed parts
    topic/<topic>/all/chunks/<part>/<vs>/<i>              body chunks of large messages (part: chunk_part)
    topic/<topic>/all/pending/<bucket>/<vs>               pushed while paused, not yet routed (bucket:
                                                          its log bucket; play merges the buckets)
    topic/<topic>/subs/<sub>/shards/<tag>/<n>/ready/<vs>             ready queue
    topic/<topic>/subs/<sub>/shards/<tag>/<n>/delayed/<due>/<vs>     due = topic clock ms
    topic/<topic>/subs/<sub>/shards/<tag>/<n>/leased/<vs>/<lease_id> a leased batch (or part):
                                                          vs = its first message's
    topic/<topic>/subs/<sub>/shards/<tag>/<n>/stats/<name>           per-shard counters
    topic/<topic>/subs/<sub>/chunks/<part>/<vs>/<i>       body chunks of queued messages (part: chunk_part)
    topic/<topic>/subs/<sub>/dlq/<vs>                     dead letters, with the reason
    topic/<topic>/subs/<sub>/stats/<name>                 per-subscription counters
    topic/<topic>/tags/<tag>                              dispatch tags seen (blind set by push)
    topic/<topic>/marks/<txid>, marks_by_version/<p>/<vs> push markers (1021-safe retries)
    topic/<topic>/dedupe/<msg_id>, dedupe_by_version/<p>/<vs> user msg_id dedupe window
    topic/<topic>/replays/<window>/<run>[/"hb"]           a replay's progress and heartbeat (while it runs)
    topic/<topic>/replays/<id>/"done"                     a finished replay (its window, count, when)
    topic/<topic>/maintenance                             its maintainer's last pass (ops.retention)

No key or append point every push writes (issue 26.1), and what each split costs the
ordering guarantees (nothing):

* the topic counters: parts summed on read (``STAT_PARTS``); the four a push adds packed
  in one key and one atomic add (``PUSH_COUNTERS``). Atomic adds commute: a sum of parts
  is the same number a single key held, and a snapshot read of the parts is one version's
  sum, so ``stats``, the backlog check and trim by size see exactly what they saw.
* the marker and dedupe indexes (``INDEX_PARTS``, by a hash of the txid / msg_id): each
  part is in version order, and expiry only needs "older than a version", per part.
* body chunks (``chunks/<part>``, ``chunk_part``: by the message's shard key, or its
  home shard, which every copy of its record keeps): a message's chunks are found from
  its record and stamp, never by scanning in order, so the split costs no order.
* pending entries (``pending/<bucket>``, the message's log bucket): play reads every
  bucket's head at one read version and merges them by versionstamp up to the smallest
  last key read of a bucket with more (``ops.log.merged_heads``, as the log reader does).
  A stamp is the commit order, and anything committed after that read version has a
  larger one, so each chunk routes exactly the oldest pending messages: the same order,
  gap-free, as one list gave. Trim's ``first_pending`` reads each bucket's head with a
  conflict (a push starting a bucket, or a play, conflicts as before).

``<vs>`` is a tuple-layer Versionstamp: the commit's 10-byte stamp plus the message's
index in its transaction, so keys sort by commit order and are gap-free for readers
(:mod:`.stamps`). Values are encoded by :mod:`.codec`.
"""
from __future__ import annotations

import struct
import zlib

import fdb.tuple as fdbtuple
from fdb.subspace_impl import Subspace
from fdb.tuple import Versionstamp

from .stamps import (STAMP_BYTES, VERSIONS_PER_S, VS_CODE, StoredVersionstamp, message_id, parse_message_id,
                     position_of, stamp_of_value, stamped_value, version_of, vs_from_bytes, vs_key, vs_key_parts)


# (the stamps' names are re-exported: callers import them from fdq.keyspace)
# A topic's counters are split over this many keys by shard number (TopicSpace.stat).
STAT_PARTS = 16
# The topic counters a push adds (and play's routed, trim's log_bytes) share one key per
# part, ``all/stats/push/<part>``, and one atomic add: a little-endian integer of a signed
# 64-bit slot each, in this order (``counters`` builds the operand, ``decode_counters``
# reads it back). FDB's add carries over the whole value, so each slot stays exact as long
# as it fits 64 bits; a push writes one mutation for all four.
PUSH_COUNTERS = ("inserted", "routed", "inserted_bytes", "log_bytes")
PUSH_STAT = "push"
# The by-version indexes of push markers and dedupe ids are split over this many ranges,
# by a hash of what they index (TopicSpace.marker_index, dedupe_index): no single append
# point every push (or every push with a msg_id) writes.
INDEX_PARTS = 16
# FoundationDB's metadata version: every change of a topic's config bumps it in the same
# transaction (ops.topics), so readers may cache configs behind it (ops.topics.cached_topic_config).
METADATA_VERSION_KEY = b"\xff/metadataVersion"
# replays/<id>/REPLAY_DONE: a finished replay's record (config.check_replay_id refuses the name).
REPLAY_DONE = "done"

__all__ = ["Keyspace", "TopicSpace", "ShardSpace", "STAT_PARTS", "chunk_part", "PUSH_COUNTERS", "PUSH_STAT",
           "counters", "push_counters", "decode_counters", "INDEX_PARTS", "REPLAY_DONE", "METADATA_VERSION_KEY",
           "index_part", "Versionstamp", "vs_key", "vs_key_parts",
           "vs_from_bytes", "counter", "decode_counter", "ensure_format", "message_id", "parse_message_id",
           "StoredVersionstamp", "STAMP_BYTES", "VERSIONS_PER_S", "position_of", "stamp_of_value", "stamped_value",
           "version_of"]

_I64 = struct.Struct("<q")


def counter(n: int) -> bytes:
    """An int64 little-endian operand for ``tr.add``."""
    return _I64.pack(n)


def decode_counter(raw) -> int:
    """A counter's value; absent reads as 0."""
    if raw is None or raw == None:  # noqa: E711 - FDB's absent Value equals None
        return 0
    b = bytes(raw)
    return int.from_bytes(b[:8].ljust(8, b"\x00"), "little", signed=True) if b else 0


_SLOT_BITS = 64
_SLOT_MASK = (1 << _SLOT_BITS) - 1
_SLOT_SIGN = 1 << (_SLOT_BITS - 1)


def counters(amounts) -> bytes:
    """The ``tr.add`` operand adding ``amounts[i]`` to slot ``i`` of a packed counter
    (``PUSH_COUNTERS``): one little-endian integer, 8 bytes a slot (two's complement, so
    a negative amount borrows from the next slot, which ``decode_counters`` undoes)."""
    width = 8 * len(amounts)
    v = 0
    for i, a in enumerate(amounts):
        v += a << (_SLOT_BITS * i)
    return (v % (1 << (8 * width))).to_bytes(width, "little")


def push_counters(inserted: int = 0, routed: int = 0, inserted_bytes: int = 0, log_bytes: int = 0) -> bytes:
    """The operand adding these to the packed push counters (``PUSH_COUNTERS``, in that order)."""
    return counters((inserted, routed, inserted_bytes, log_bytes))


def decode_counters(raw, k: int) -> list:
    """The ``k`` slots of a packed counter (absent: zeros), each a signed 64-bit value."""
    if raw is None or raw == None:  # noqa: E711 - FDB's absent Value equals None
        return [0] * k
    v = int.from_bytes(bytes(raw)[:8 * k], "little")
    out = []
    for _ in range(k):
        slot = v & _SLOT_MASK
        if slot & _SLOT_SIGN:
            slot -= 1 << _SLOT_BITS
        out.append(slot)
        v = (v - slot) >> _SLOT_BITS
    return out


_CHUNK_INDEXES = [fdbtuple.pack((i,)) for i in range(256)]


def _chunk_index(i: int) -> bytes:
    return _CHUNK_INDEXES[i] if i < 256 else fdbtuple.pack((i,))


def index_part(data: bytes) -> int:
    """The part (of ``INDEX_PARTS``) of a by-version index that ``data``'s entry goes to."""
    return zlib.crc32(data) % INDEX_PARTS


def chunk_part(record) -> int:
    """The part (of ``INDEX_PARTS``) where the body chunks of the message of ``record``
    (a ``codec.Record``) are kept, in the log and in every subscription: by its shard
    key (``index_part``) or, unkeyed, its home shard. Both are in every copy of its
    record (a reshard, a requeue or a dead letter keeps them), so whoever holds the
    record finds the chunks; messages spread over the parts as over the log's buckets."""
    if record.shard_key is not None:
        return index_part(record.shard_key.encode())
    return (record.home or 0) % INDEX_PARTS


class ShardSpace:
    """The keys of one shard ``(tag, n)`` of one subscription."""

    __slots__ = ("topic", "sub", "tag", "n", "space", "ready", "delayed", "leased", "stats",
                 "record", "chunks", "_stat_keys", "ready_prefix", "leased_prefix", "clock_key",
                 "ready_range", "delayed_range")

    def __init__(self, ts: "TopicSpace", sub: str, tag: str, n: int):
        self.topic, self.sub, self.tag, self.n = ts.name, sub, tag, n
        self.space = ts.subs[sub]["shards"][tag][n]
        self.ready = self.space["ready"]
        self.delayed = self.space["delayed"]
        self.leased = self.space["leased"]
        self.stats = self.space["stats"]
        self.record = ts.config_space["shards"][sub][tag][n].key()
        self.chunks = ts.subs[sub]["chunks"]
        self.ready_prefix = self.ready.key()
        self.leased_prefix = self.leased.key()
        self.clock_key = ts.clock_key
        self.ready_range = self.ready.range()       # read on every visit of the shard
        self.delayed_range = self.delayed.range()
        self._stat_keys = {}

    # A complete Versionstamp packs as 0x33 + its 12 bytes: concatenating is what
    # ``Subspace.pack((vs,))`` returns, ~5x cheaper on the consuming hot path.
    def ready_key(self, vs: Versionstamp) -> bytes:
        return self.ready_prefix + b"\x33" + vs.to_bytes()

    def lease_key(self, vs12: bytes, packed_lease_id: bytes) -> bytes:
        """A lease record's key: ``leased.pack((vs, lease_id))`` from the first message's
        12-byte stamp and ``fdb.tuple.pack((lease_id,))``. The lease id makes it unique: a
        message nak'd out of a batch whose record lives on may lead a later batch."""
        return self.leased_prefix + b"\x33" + vs12 + packed_lease_id

    def delayed_key(self, due: int, vs: Versionstamp) -> bytes:
        return self.delayed.pack((due, vs))

    def delayed_vs_key(self, due: int, uv: int) -> bytes:
        """The stamped key (``vs_key``) of this transaction's message ``uv``, due at ``due``."""
        return vs_key(self.delayed.pack((due,)), uv)

    def chunk_vs_key(self, uv: int, i: int, record) -> bytes:
        """The stamped key of chunk ``i`` of this transaction's message ``uv`` (its ``record``)."""
        return vs_key(self.chunks.pack((chunk_part(record),)), uv, _chunk_index(i))

    def chunk_key(self, vs: Versionstamp, i: int, record) -> bytes:
        """Chunk ``i`` of the body of the queued message ``vs`` (the subscription's chunks)."""
        return self.chunks.pack((chunk_part(record), vs, i))

    def chunks_range(self, vs: Versionstamp, record):
        """The body chunks of the queued message ``vs`` (its ``record``: ``chunk_part``)."""
        return self.chunks[chunk_part(record)][vs].range()

    def any_chunks_ranges(self, vs: Versionstamp) -> list:
        """Where chunks of the queued message ``vs`` can be, in every part (for a record
        that does not decode)."""
        return [self.chunks[p][vs].range() for p in range(INDEX_PARTS)]

    def stat(self, name: str) -> bytes:
        key = self._stat_keys.get(name)
        if key is None:
            key = self._stat_keys[name] = self.stats.pack((name,))
        return key

    def __repr__(self):
        return f"<shard {self.topic}/{self.sub}/{self.tag!r}/{self.n}>"


class TopicSpace:
    """The keys of one topic."""

    def __init__(self, ks: "Keyspace", name: str):
        self.name = name
        self.config_key = ks.topics_config.pack((name,))
        self.config_space = ks.topics_config[name]
        self.consumers = self.config_space["consumers"]
        self.heartbeats = self.config_space["heartbeats"]
        self.shard_records = self.config_space["shards"]
        self.assignment = self.config_space["assignment"]
        self.sub_records = self.config_space["subs"]
        self.space = ks.root["topic"][name]
        # one clock per topic: no key every consumer of the database writes 4 times a second
        self.clock_key = self.space.pack(("clock",))
        # the read version of the clock's last advance (ops.clock.advance_clock)
        self.clock_version_key = self.space.pack(("clock_version",))
        self.all = self.space["all"]
        self.log = self.all["log"]
        self.time_index = self.all["time"]
        self.stats = self.all["stats"]
        self.all_chunks = self.all["chunks"]
        self.pending = self.all["pending"]
        self.subs = self.space["subs"]
        self.tags = self.space["tags"]
        self.marks = self.space["marks"]
        self.marks_by_version = self.space["marks_by_version"]
        self.dedupe = self.space["dedupe"]
        self.dedupe_by_version = self.space["dedupe_by_version"]
        self.replays = self.space["replays"]
        self.maintenance_key = self.space.pack(("maintenance",))
        # the topic's maintainer holds this role (fdq.ops.leaders); delete_topic clears it
        self.maintenance_role = f"maintenance/{name}"
        self.maintenance_role_keys = (ks.leader_key(self.maintenance_role), ks.leader_beat_key(self.maintenance_role))
        self._shards = {}
        self._stat_keys = {}
        self.log_prefixes = {}
        self.push_plans = {}     # push's per-config cache (fdq.ops.push._PushPlan)

    def log_prefix(self, bucket: int) -> bytes:
        p = self.log_prefixes.get(bucket)
        if p is None:
            p = self.log_prefixes[bucket] = self.log.pack((bucket,))
        return p

    def shard(self, sub: str, tag: str, n: int) -> ShardSpace:
        key = (sub, tag, n)
        s = self._shards.get(key)
        if s is None:
            s = self._shards[key] = ShardSpace(self, sub, tag, n)
        return s

    def stat(self, name: str, n: int = 0) -> bytes:
        """The part of topic counter ``name`` that shard number ``n``'s writers add to
        (``n % STAT_PARTS``): a counter every push or settle updates is no single key,
        no hotter than one shard's own counters. Readers sum the parts (``stat_range``)."""
        part = n % STAT_PARTS
        key = self._stat_keys.get((name, part))
        if key is None:
            key = self._stat_keys[(name, part)] = self.stats.pack((name, part))
        return key

    def push_stat(self, n: int = 0) -> bytes:
        """Part ``n % STAT_PARTS`` of the packed push counters (``PUSH_COUNTERS``): a push
        transaction adds to the part of its txid (``index_part``), play to its message's
        shard's, trim to part 0; readers sum them all."""
        return self.stat(PUSH_STAT, n)

    def marker_index(self, part: int) -> Subspace:
        """Part ``part`` of the push markers' by-version index (``index_part`` of a txid)."""
        return self.marks_by_version[part]

    def dedupe_index(self, part: int) -> Subspace:
        """Part ``part`` of the dedupe ids' by-version index (``index_part`` of a msg_id)."""
        return self.dedupe_by_version[part]

    def stat_range(self, name: str):
        """Every part of topic counter ``name`` (``stat``)."""
        return self.stats[name].range()

    def sub_stat(self, sub: str, name: str) -> bytes:
        return self.subs[sub]["stats"].pack((name,))

    def dlq(self, sub: str) -> Subspace:
        return self.subs[sub]["dlq"]

    def dlq_key(self, sub: str, vs: Versionstamp) -> bytes:
        """The dead letter of message ``vs`` in subscription ``sub``."""
        return self.subs[sub]["dlq"].pack((vs,))

    def dlq_vs(self, sub: str, key: bytes) -> Versionstamp:
        """The message of a dead letter's key."""
        return self.subs[sub]["dlq"].unpack(key)[0]

    def sub_chunks_range(self, sub: str, vs: Versionstamp, record):
        """The body chunks of message ``vs`` (its ``record``) queued (or dead-lettered) in ``sub``."""
        return self.subs[sub]["chunks"][chunk_part(record)][vs].range()

    def sub_any_chunks_ranges(self, sub: str, vs: Versionstamp) -> list:
        """Where chunks of message ``vs`` of ``sub`` can be, in every part (for a record
        that does not decode)."""
        return [self.subs[sub]["chunks"][p][vs].range() for p in range(INDEX_PARTS)]

    def take_marker_key(self, sub: str, cid: str) -> bytes:
        """Consumer ``cid``'s at-most-once take marker (``fdq.ops.queue.mark_take``): in the
        subscription's space, outside the consumers' range that membership reads (a
        write there per take would abort every concurrent rebalance)."""
        return self.subs[sub]["takes"].pack((cid,))

    def consumer_key(self, sub: str, cid: str) -> bytes:
        return self.consumers.pack((sub, cid))

    def heartbeat_key(self, sub: str, cid: str) -> bytes:
        return self.heartbeats.pack((sub, cid, "hb"))

    def heartbeat_clock_key(self, sub: str, cid: str) -> bytes:
        """The topic's clock at consumer ``cid``'s last heartbeat (for display)."""
        return self.heartbeats.pack((sub, cid, "hbc"))

    def assignment_key(self, sub: str) -> bytes:
        return self.assignment.pack((sub,))

    def heartbeat_version_key(self, sub: str, cid: str) -> bytes:
        """The read version of consumer ``cid``'s last heartbeat (for display)."""
        return self.heartbeats.pack((sub, cid, "hbv"))

    def log_key(self, bucket: int, vs: Versionstamp) -> bytes:
        return self.log.pack((bucket, vs))

    def log_entry_key(self, bucket: int, vs12: bytes) -> bytes:
        """``log_key`` from a position's 12 bytes."""
        return self.log_prefix(bucket) + VS_CODE + vs12

    def log_bucket_range(self, bucket: int):
        return self.log[bucket].range()

    def time_index_key(self, minute_ms: int) -> bytes:
        """Where the time index's entries of ``minute_ms`` begin (entries: + a stamp)."""
        return self.time_index.pack((minute_ms,))

    def chunk_key(self, vs: Versionstamp, i: int, record) -> bytes:
        """Chunk ``i`` of the body of the log entry ``vs`` (its ``record``: ``chunk_part``)."""
        return self.all_chunks.pack((chunk_part(record), vs, i))

    def chunks_range(self, vs: Versionstamp, record):
        """The body chunks of the log entry ``vs`` (its ``record``)."""
        return self.all_chunks[chunk_part(record)][vs].range()

    def chunk_vs_key(self, uv: int, i: int, record) -> bytes:
        """The stamped key of chunk ``i`` of this transaction's message ``uv`` (its ``record``)."""
        return vs_key(self.all_chunks.pack((chunk_part(record),)), uv, _chunk_index(i))

    def chunk_keys_bytes(self, nchunks: int, record) -> int:
        """The bytes of the keys of a log entry's ``nchunks`` body chunks (its ``record``)."""
        head = len(self.all_chunks.pack((chunk_part(record),)))
        return nchunks * (head + STAMP_BYTES) + sum(map(len, map(_chunk_index, range(nchunks))))

    def time_index_vs_key(self, minute_ms: int, uv: int) -> bytes:
        """The time index's entry of ``minute_ms`` at this transaction's message ``uv``."""
        return vs_key(self.time_index.pack((minute_ms,)), uv)

    def pending_key(self, bucket: int, vs: Versionstamp) -> bytes:
        """Message ``vs``'s entry in the pending list (pushed while paused), in its log
        bucket's part: as the log, one append point per bucket, merged by versionstamp
        (``ops.log.merged_heads``)."""
        return self.pending.pack((bucket, vs))

    def pending_vs_key(self, bucket: int, uv: int) -> bytes:
        """The stamped key of this transaction's message ``uv`` (log bucket ``bucket``)
        pushed while paused."""
        return vs_key(self.pending.pack((bucket,)), uv)

    def tag_key(self, tag: str) -> bytes:
        return self.tags.pack((tag,))

    def dedupe_key(self, msg_id: str) -> bytes:
        return self.dedupe.pack((msg_id,))

    def marker_key(self, txid: bytes) -> bytes:
        """Push transaction ``txid``'s marker (``codec.encode_marker``)."""
        return self.marks.pack((txid,))

    def marker_part_key(self, txid: bytes, i: int) -> bytes:
        """Part ``i`` (from 1) of a split marker's payload."""
        return self.marks.pack((txid, i))

    def marker_parts_range(self, txid: bytes):
        return self.marks[txid].range()

    def sub_record_key(self, sub: str) -> bytes:
        """Subscription ``sub``'s record (``codec.encode_subscription``)."""
        return self.sub_records.pack((sub,))

    def sub_boundary_key(self, sub: str) -> bytes:
        """The versionstamp of ``sub``'s creation or last reset."""
        return self.sub_records.pack((sub, "boundary"))

    def sub_cursors(self, sub: str) -> Subspace:
        """``sub``'s catch-up progress, one key per log bucket (``.pack((bucket,))``)."""
        return self.sub_records[sub]["cursor"]

    def sub_cursor_key(self, sub: str, bucket: int) -> bytes:
        return self.sub_records[sub]["cursor"].pack((bucket,))

    def sub_purge_marks(self, sub: str) -> Subspace:
        """A reset's purge progress of ``sub``, one key per shard (``.pack((tag, n))``)."""
        return self.sub_records[sub]["purge"]

    def sub_purge_mark(self, sub: str, tag: str, n: int) -> bytes:
        return self.sub_records[sub]["purge"].pack((tag, n))

    def replay_done_key(self, replay_id: str) -> bytes:
        """A finished replay's record (``REPLAY_DONE``; runs are named by hex owner ids)."""
        return self.replays.pack((replay_id, REPLAY_DONE))

    def replay_run_key(self, window: str, run: str) -> bytes:
        """The progress of run ``run`` of the replay of ``window`` (``codec.encode_replay``)."""
        return self.replays.pack((window, run))

    def replay_beat_key(self, window: str, run: str) -> bytes:
        """That run's heartbeat counter."""
        return self.replays.pack((window, run, "hb"))

    def replay_runs_range(self, window: str):
        """Every run of the replay of ``window`` (progress and heartbeat keys)."""
        return self.replays[window].range()


class Keyspace:
    """The whole layout under ``root`` (a tuple, default ``("fdq",)``)."""

    def __init__(self, root: tuple = ("fdq",)):
        self.root = Subspace(tuple(root))
        self.format_key = self.root.pack(("meta", "format"))
        self.topics_config = self.root["config"]["topics"]
        self.leaders = self.root["meta"]["leaders"]
        self._topics = {}

    def topic(self, name: str) -> TopicSpace:
        t = self._topics.get(name)
        if t is None:
            t = self._topics[name] = TopicSpace(self, name)
        return t

    def leader_key(self, role: str) -> bytes:
        """Who holds the database-wide role ``role`` (``codec.encode_leader``)."""
        return self.leaders.pack((role,))

    def leader_beat_key(self, role: str) -> bytes:
        """The beat counter of ``role``'s holder."""
        return self.leaders.pack((role, "beat"))

    def topic_names_range(self):
        return self.topics_config.range()

    def unpack_topic_config_key(self, key: bytes):
        """The topic name if ``key`` is a topic's config key, else None."""
        t = self.topics_config.unpack(key)
        return t[0] if len(t) == 1 else None
