"""The key layout: the only code that knows where FDQ keeps what (design §2).

Everything lives under a root subspace (default ``("fdq",)``), tuple-encoded::

    meta/format                                           layout version
    meta/clock                                            the database clock (ms; see membership)
    meta/clock_version                                    read version of its last advance (display)
    config/topics/<topic>                                 topic config (read by every push)
    config/topics/<topic>/consumers/<sub>/<id>            consumer record
    config/topics/<topic>/consumers/<sub>/<id>/hb         heartbeat counter (atomic add)
    config/topics/<topic>/consumers/<sub>/<id>/hbc, hbv   clock, version at its last heartbeat (display)
    config/topics/<topic>/shards/<sub>/<tag>/<n>          shard record: owner, epoch
    config/topics/<topic>/assignment/<sub>                bumped when ownership changes
    config/topics/<topic>/subs/<sub>                      subscription record (config, start)
    config/topics/<topic>/subs/<sub>/boundary             versionstamp of its creation / reset
    config/topics/<topic>/subs/<sub>/cursor/<bucket>      catch-up progress per log bucket
    topic/<topic>/all/log/<bucket>/<vs>                   the "all" log (bucket = shard n)
    topic/<topic>/all/time/<minute_ms>/<vs>               sparse time -> position index
    topic/<topic>/all/stats/<name>                        inserted, routed, emitted, acked
    topic/<topic>/all/chunks/<vs>/<i>                     body chunks of large messages
    topic/<topic>/all/pending/<vs>                        pushed while paused, not yet routed
    topic/<topic>/subs/<sub>/shards/<tag>/<n>/ready/<vs>             ready queue
    topic/<topic>/subs/<sub>/shards/<tag>/<n>/delayed/<due>/<vs>     due = database clock ms
    topic/<topic>/subs/<sub>/shards/<tag>/<n>/leased/<vs>/<lease_id> a leased batch (or part):
                                                          vs = its first message's
    topic/<topic>/subs/<sub>/shards/<tag>/<n>/leased/<vs>            format 1: one leased message
    topic/<topic>/subs/<sub>/shards/<tag>/<n>/stats/<name>           per-shard counters
    topic/<topic>/subs/<sub>/chunks/<vs>/<i>              body chunks of queued messages
    topic/<topic>/subs/<sub>/dlq/<vs>                     dead letters, with the reason
    topic/<topic>/subs/<sub>/stats/<name>                 per-subscription counters
    topic/<topic>/tags/<tag>                              dispatch tags seen (blind set by push)
    topic/<topic>/marks/<txid>, marks_by_version/<vs>     push markers (1021-safe retries)
    topic/<topic>/dedupe/<msg_id>, dedupe_by_version/<vs> user msg_id dedupe window
    topic/<topic>/replays/<window>/<run>[/"hb"]           a replay's progress and heartbeat (while it runs)
    topic/<topic>/log_count/stamp, cursor/<bucket>        counting an older topic's log (fdq.logcount)

``<vs>`` is a tuple-layer Versionstamp: the commit's 10-byte stamp plus the message's
index in its transaction, so keys sort by commit order and are gap-free for readers.
"""
from __future__ import annotations

import struct

import fdb.tuple as fdbtuple
from fdb.subspace_impl import Subspace
from fdb.tuple import Versionstamp

from ..errors import FormatError
from ..engine import transactional

FORMAT_VERSION = 1

__all__ = ["Keyspace", "TopicSpace", "ShardSpace", "Versionstamp", "FORMAT_VERSION", "vs_key", "vs_key_parts",
           "vs_from_bytes", "counter", "decode_counter", "ensure_format", "message_id", "parse_message_id"]

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


class StoredVersionstamp(Versionstamp):
    """A complete Versionstamp read from a key, keeping its 12 bytes: the consuming hot
    path builds several keys and an id from each message's stamp (``to_bytes`` packs a
    struct every time). Equal to, hashes as, and packs as a plain ``Versionstamp``."""

    __slots__ = ("_bytes",)

    def __init__(self, raw: bytes):
        # Only the bytes: the parts are computed when asked (comparisons, hashing, some
        # supervisor paths), which the consuming hot path never does.
        self._bytes = raw

    @property
    def tr_version(self):
        return self._bytes[:10]

    @property
    def user_version(self):
        return (self._bytes[10] << 8) | self._bytes[11]

    def to_bytes(self):
        return self._bytes


_INCOMPLETE = b"\xff" * 10


def vs_from_bytes(raw: bytes) -> Versionstamp:
    """The complete Versionstamp of 12 stored bytes (a key's last 12, after 0x33)."""
    if type(raw) is not bytes:
        raw = bytes(raw)
    if len(raw) != 12 or raw[:10] == _INCOMPLETE:
        return Versionstamp.from_bytes(raw)
    return StoredVersionstamp(raw)


def message_id(vs: Versionstamp) -> str:
    """A message's printable id: 24 hex digits of its 12-byte versionstamp."""
    return vs.to_bytes().hex()


def parse_message_id(mid: str) -> Versionstamp:
    try:
        raw = bytes.fromhex(mid)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != 12:
        raise ValueError(f"invalid message id {mid!r}: expected 24 hex digits")
    return Versionstamp.from_bytes(raw)


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
        message nak'd out of a batch whose record lives on may lead a later batch. (Format
        1 kept a row per message under ``leased.pack((vs,))``; codec.decode_leases reads
        both.)"""
        return self.leased_prefix + b"\x33" + vs12 + packed_lease_id

    def delayed_key(self, due: int, vs: Versionstamp) -> bytes:
        return self.delayed.pack((due, vs))

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
        self.clock_key = ks.clock_key
        self.clock_version_key = ks.clock_version_key
        self.config_key = ks.topics_config.pack((name,))
        self.config_space = ks.topics_config[name]
        self.consumers = self.config_space["consumers"]
        self.shard_records = self.config_space["shards"]
        self.assignment = self.config_space["assignment"]
        self.sub_records = self.config_space["subs"]
        self.space = ks.root["topic"][name]
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
        self.log_count = self.space["log_count"]
        self._shards = {}
        self._stat_keys = {}
        self.log_prefixes = {}
        self.push_plans = {}     # the producer's per-config cache (producer._PushPlan)

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

    def stat(self, name: str) -> bytes:
        key = self._stat_keys.get(name)
        if key is None:
            key = self._stat_keys[name] = self.stats.pack((name,))
        return key

    def sub_stat(self, sub: str, name: str) -> bytes:
        return self.subs[sub]["stats"].pack((name,))

    def dlq(self, sub: str) -> Subspace:
        return self.subs[sub]["dlq"]

    def take_marker_key(self, sub: str, cid: str) -> bytes:
        """Consumer ``cid``'s at-most-once take marker (``fdq.delivery.mark_take``): in the
        subscription's space, outside the consumers' range that membership reads (a
        write there per take would abort every concurrent rebalance)."""
        return self.subs[sub]["takes"].pack((cid,))

    def consumer_key(self, sub: str, cid: str) -> bytes:
        return self.consumers.pack((sub, cid))

    def heartbeat_key(self, sub: str, cid: str) -> bytes:
        return self.consumers.pack((sub, cid, "hb"))

    def heartbeat_clock_key(self, sub: str, cid: str) -> bytes:
        """The database clock at consumer ``cid``'s last heartbeat (for display)."""
        return self.consumers.pack((sub, cid, "hbc"))

    def assignment_key(self, sub: str) -> bytes:
        return self.assignment.pack((sub,))

    def log_key(self, bucket: int, vs: Versionstamp) -> bytes:
        return self.log.pack((bucket, vs))


class Keyspace:
    """The whole layout under ``root`` (a tuple, default ``("fdq",)``)."""

    def __init__(self, root: tuple = ("fdq",)):
        self.root = Subspace(tuple(root))
        self.format_key = self.root.pack(("meta", "format"))
        self.clock_key = self.root.pack(("meta", "clock"))
        # the read version of the clock's last advance (membership.advance_clock)
        self.clock_version_key = self.root.pack(("meta", "clock_version"))
        self.topics_config = self.root["config"]["topics"]
        self._topics = {}

    def topic(self, name: str) -> TopicSpace:
        t = self._topics.get(name)
        if t is None:
            t = self._topics[name] = TopicSpace(self, name)
        return t

    def topic_names_range(self):
        return self.topics_config.range()

    def unpack_topic_config_key(self, key: bytes):
        """The topic name if ``key`` is a topic's config key, else None."""
        t = self.topics_config.unpack(key)
        return t[0] if len(t) == 1 else None


_VS_PLACEHOLDER = b"\x33" + b"\xff" * 10


def vs_key(prefix: bytes, user_version: int, suffix: bytes = b"") -> bytes:
    """``prefix`` + an incomplete tuple-layer Versionstamp + ``suffix``, with the 4-byte
    offset ``set_versionstamped_key`` wants: what ``pack_with_versionstamp`` builds, without
    re-encoding the prefix for every message."""
    return (prefix + _VS_PLACEHOLDER + user_version.to_bytes(2, "big") + suffix
            + struct.pack("<I", len(prefix) + 1))


def vs_key_parts(prefix: bytes) -> tuple:
    """``(head, offset)`` such that ``head + user_version.to_bytes(2, "big") + offset`` is
    ``vs_key(prefix, user_version)``: for writing many stamped keys under one prefix."""
    return prefix + _VS_PLACEHOLDER, struct.pack("<I", len(prefix) + 1)


@transactional
def ensure_format(tr, ks: Keyspace, *, write: bool = True) -> int | None:
    """Refuse a newer layout than this FDQ knows; write ``meta/format`` on first use
    (``write=False``, as on connect: check only, an empty database stays empty)."""
    raw = tr[ks.format_key]
    if raw == None:  # noqa: E711
        if not write:
            return None
        tr[ks.format_key] = fdbtuple.pack((FORMAT_VERSION,))
        return FORMAT_VERSION
    version = fdbtuple.unpack(bytes(raw))[0]
    if version > FORMAT_VERSION:
        raise FormatError(f"database key layout is format {version}; this FDQ understands up "
                          f"to {FORMAT_VERSION}: upgrade FDQ")
    # Older formats would migrate here; format 1 is the first.
    return version
