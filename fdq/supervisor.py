"""The supervisor: topics, pause / play, rebalance and reshard, stats, retention, replay.

Long operations (play, reshard, replay, trim, DLQ redrive/purge) run as a series of
transactions of at most ``CHUNK`` messages (and ``CHUNK_WRITE_BYTES``) each, well under
FDB's 5 s and 10 MB, and are resumable: each chunk removes what it has done, so a killed
run finishes when run again, with nothing lost or doubled.
"""
from __future__ import annotations

import dataclasses
import os
import time

from . import delivery, membership
from .config import UPDATABLE_TOPIC_FIELDS, ConsumerConfig, TopicConfig, check_name
from .engine import after_interrupt, error_types, transactional
from .errors import ConfigError, TopicExists, TopicHeld, TopicNotFound
from .headers import dispatch_tag
from .keyspace import (Keyspace, TopicSpace, Versionstamp, counter, decode_counter, message_id, parse_message_id,
                       vs_from_bytes)
from .keyspace.codec import (CHUNK_BYTES, CHUNK_WRITE_BYTES, LeaseRecord, Record, decode_leases, decode_pending, pack,
                             reshard_shard, shard_of, unpack)
from .log import buckets_in, chunks_bytes, entry_bytes, iter_window, log_buckets, read_chunk
from .ops.push import MARKER_TTL_S
from .stats import SHARD_COUNTERS, shard_counters
from .topic import (HOLD_WAIT_S, create_topic, held, list_topics, load_config, read_topic_config,
                    update_topic_config)

CHUNK = 500
VERSIONS_PER_S = 1_000_000


# -- routing of messages already in the log ----------------------------------------------

def _route_existing(tr, ts: TopicSpace, config: TopicConfig, n: int, vs, raw: bytes, clock):
    """Route a logged message (complete versionstamp ``vs``) to every subscription: delayed
    until its record's due time if it has one and it is still ahead of ``clock``, else ready."""
    rec = Record.decode(raw)
    due = rec.due
    if due is not None and due <= clock:
        due = None
    tag = dispatch_tag(rec.headers)
    chunks = []
    if rec.nchunks:
        r = ts.all_chunks[vs].range()
        chunks = [kv.value for kv in tr.snapshot.get_range(r.start, r.stop)]
    for sub in config.subs:
        shard = ts.shard(sub, tag, n)
        if due is not None:
            tr[shard.delayed_key(due, vs)] = raw
            tr.add(shard.stat("delayed"), counter(1))
        else:
            tr[shard.ready_key(vs)] = raw
        for i, c in enumerate(chunks):
            tr[shard.chunks.pack((vs, i))] = c
        tr.add(shard.stat("routed"), counter(1))
    tr.add(ts.stat("routed"), counter(1))
    return len(config.subs) * (len(raw) + sum(map(len, chunks)))


@transactional
def play_chunk(tr, ts: TopicSpace, limit: int, hold: int | None = None) -> tuple:
    """Route up to ``limit`` messages (or ``CHUNK_WRITE_BYTES`` of them) pushed while
    paused (or resharding), in order. Returns ``(routed, done, hold)``; the caller
    passes ``hold`` back. Does nothing while a reshard is still moving queues.

    The topic resumes (and a finished reshard's drain ends) in the transaction that
    finds nothing left pending, so no push routes before an older pending one. Under
    a steady stream of pushes that transaction would conflict with every push landing
    in the pending area and never commit, so first the topic is *held*: a chunk that
    reaches the end records ``held_at`` (its read version), and pushes from then on
    wait (``fdq.errors.TopicHeld``) instead of writing. The next chunk routes what
    landed before the hold and resumes, unless the hold is gone (a pause or another
    play since: done, the pause stands) or older than ``HOLD_VERSIONS`` (a play that
    died: pushes went on, hold again)."""
    config = read_topic_config(tr, ts)
    if resharding(config):
        return 0, True, None
    clock = membership.read_clock(tr, ts.clock_key)
    r = ts.pending.range()
    moved = written = 0
    last = None
    full = False
    for kv in tr.snapshot.get_range(r.start, r.stop, limit=limit):
        vs = ts.pending.unpack(kv.key)[0]
        n = decode_pending(kv.value)
        raw = tr.snapshot[ts.log_key(n, vs)]
        if raw != None:  # noqa: E711 - trimmed meanwhile: nothing to route
            rec = Record.decode(raw)
            # Over the budget with this message (its copies, chunks at most CHUNK_BYTES
            # each): the next chunk routes it. A push accepted it alone under ROUTE_BYTES,
            # not on top of ~CHUNK_WRITE_BYTES of others (FDB's limit is 10 MB).
            if written and written + len(config.subs) * (len(raw) + rec.nchunks * CHUNK_BYTES) > CHUNK_WRITE_BYTES:
                full = True
                break
            target = shard_of(rec.shard_key, config.shards) if rec.shard_key is not None else n % config.shards
            written += _route_existing(tr, ts, config, target, vs, bytes(raw), clock)
        last = kv.key
        moved += 1
    if last is not None:
        # what it routed conflicts with another play routing it (whichever way this
        # chunk ends); later pushes do not. Before the clears: as FDB's RYW, a read
        # conflict skips keys the transaction already cleared.
        tr.add_read_conflict_range(r.start, last + b"\x00")
        tr.clear_range(r.start, last + b"\x00")
    if moved == limit or full:
        return moved, False, hold
    if last is None and config.routing and config.held_at is None:
        return 0, True, None                # running, nothing pending: no hold, no write
    rv = tr.get_read_version().wait()
    if config.held_at is None and hold is not None:
        return moved, True, None            # paused since the hold (or resumed by another play)
    if config.held_at is None or not held(rv, config.held_at):
        tr[ts.config_key] = pack(dataclasses.replace(config, held_at=rv).as_dict())
        return moved, False, rv
    # Held: no push wrote the pending area since the hold committed (each one read the
    # config before it, or conflicts with the hold's write), so reading all of it
    # conflicts only with what this chunk missed.
    tr.add_read_conflict_range(r.start, r.stop)
    changes = {"held_at": None}
    if config.resharding_to is not None:     # drained: route pushes again
        changes["resharding_to"] = None
    if config.paused:
        changes["paused"] = False
    tr[ts.config_key] = pack(dataclasses.replace(config, **changes).as_dict())
    return moved, True, None


def resharding(config: TopicConfig) -> bool:
    """Whether a shard-count change is moving queues (``reshard_begin`` until
    ``reshard_finish``). After the finish, ``resharding_to == shards`` while the
    messages pushed meanwhile (the pending area) are routed: pushes still go there, so
    none overtakes an older message of its key."""
    return config.resharding_to is not None and config.resharding_to != config.shards


# -- resharding ---------------------------------------------------------------------

@transactional
def reshard_begin(tr, ts: TopicSpace, shards: int) -> TopicConfig:
    """Start changing the shard count: pushes go to the pending area; every shard's
    owner is fenced off (epoch bump, no owner) until ``reshard_finish``."""
    config = read_topic_config(tr, ts)
    if shards == config.shards and config.resharding_to in (None, shards):
        return config       # nothing to move (or moved: its pending area left to route)
    if config.resharding_to not in (None, shards):
        raise ConfigError(f"topic {ts.name!r} is already being resharded to {config.resharding_to} shards: finish "
                          f"that first (fdq rebalance {ts.name}, without --shards; Supervisor.rebalance), "
                          "then change the count")
    config = dataclasses.replace(config, resharding_to=shards)
    tr[ts.config_key] = pack(config.as_dict())
    for sub in config.subs:
        for s, (owner, epoch) in membership.read_owners(tr, ts, sub, snapshot=False).items():
            tr[ts.shard_records[sub].pack(s)] = pack([None, epoch + 1])
        tr.add(ts.assignment_key(sub), counter(1))
    return config


@transactional
def reshard_chunk(tr, ts: TopicSpace, sub: str, tag: str, old_n: int, area: str, new_shards: int,
                  limit: int, after: bytes | None = None) -> tuple:
    """Move the entries of one queue area (ready, delayed, leased) of shard ``(tag,
    old_n)`` whose new shard differs, reading up to ``limit`` entries (lease records)
    or ``CHUNK_WRITE_BYTES`` of them after the key ``after``. Keys keep their
    versionstamp, so each new shard's queue stays in push order per shard key. Returns
    ``(entries read, last key read, done)``: entries that stay put are skipped by the
    next chunk's ``after``, so a long run of them cannot loop forever."""
    src = ts.shard(sub, tag, old_n)
    space = getattr(src, area)
    r = space.range()
    begin = after + b"\x00" if after is not None else r.start
    read = size = 0
    last = None
    moves = {}      # new shard n -> messages moved there
    for kv in tr.get_range(begin, r.stop, limit=limit):
        if size >= CHUNK_WRITE_BYTES:
            break       # what it moved, written again elsewhere: under FDB's 10 MB per transaction
        read += 1
        last = kv.key
        size += len(kv.key) + len(kv.value)
        if area == "leased":
            _reshard_lease_record(tr, ts, src, kv.key, kv.value, new_shards, moves)
            continue
        parts = space.unpack(kv.key)
        new_n = reshard_shard(Record.decode(kv.value), parts[-1], new_shards)
        if new_n == old_n:
            continue
        tr[getattr(ts.shard(sub, tag, new_n), area).pack(parts)] = kv.value
        del tr[kv.key]
        moves[new_n] = moves.get(new_n, 0) + 1
    for new_n, k in moves.items():
        dst = ts.shard(sub, tag, new_n)
        tr.add(src.stat("routed"), counter(-k))
        tr.add(dst.stat("routed"), counter(k))
        if area != "ready":
            name = "in_flight" if area == "leased" else "delayed"
            tr.add(src.stat(name), counter(-k))
            tr.add(dst.stat(name), counter(k))
    return read, last, read < limit and size < CHUNK_WRITE_BYTES


def _reshard_lease_record(tr, ts: TopicSpace, src, key: bytes, raw, new_shards: int, moves: dict):
    """Split lease record ``key`` of shard ``src`` by its messages' new shards: those
    that move go to a record under the same key suffix (lease id and first stamp) in
    their new shard, merged with one already there (a part of the same record moved by
    an earlier reshard: disjoint messages of one batch, so the merge is no larger than
    the batch's record was); the rest stay."""
    lr = decode_leases(key, raw)
    groups = {}
    for e in lr.entries:
        n = reshard_shard(Record.decode(e[1]), vs_from_bytes(e[0]), new_shards)
        groups.setdefault(n, []).append(e)
    if list(groups) == [src.n]:
        return
    suffix = key[len(src.leased_prefix):]
    for n, entries in groups.items():
        if n == src.n:
            continue
        dst = ts.shard(src.sub, src.tag, n)
        dkey = dst.leased_prefix + suffix
        there = tr[dkey]
        if there != None:  # noqa: E711
            entries = sorted(decode_leases(dkey, there).entries + entries)
        tr[dkey] = LeaseRecord(lr.lease_id, lr.consumer_id, lr.ack_wait_ms, entries, lr.bump).encode()
        moves[n] = moves.get(n, 0) + len(groups[n])
    stay = groups.get(src.n)
    if stay:
        tr[key] = LeaseRecord(lr.lease_id, lr.consumer_id, lr.ack_wait_ms, stay, lr.bump).encode()
    else:
        del tr[key]


@transactional
def fold_shard_counters(tr, ts: TopicSpace, sub: str, tag: str, old_n: int, new_shards: int) -> dict:
    """Move the counters of shard ``(tag, old_n)``, which a reshard to ``new_shards``
    removes (its queues already moved), into shard ``old_n % new_shards``: the
    subscription's stats sum its shards' counters, so its emitted, acked, done... must
    not vanish with the shard (backlog = routed - done stays as it was). Safe to
    re-run: a folded shard's counters are 0. Returns what it moved."""
    if old_n < new_shards:
        return {}
    src, dst = ts.shard(sub, tag, old_n), ts.shard(sub, tag, old_n % new_shards)
    values = {name: decode_counter(tr[src.stat(name)]) for name in SHARD_COUNTERS + ("filtered",)}
    moved = {name: v for name, v in values.items() if v}
    for name, v in moved.items():
        tr.add(src.stat(name), counter(-v))
        tr.add(dst.stat(name), counter(v))
    return moved


@transactional
def reshard_finish(tr, ts: TopicSpace) -> TopicConfig:
    """Adopt the new shard count. A playing topic keeps ``resharding_to`` (now equal
    to ``shards``) until ``play_chunk`` has routed what was pushed meanwhile, so pushes
    keep going to the pending area after the older ones; a paused one routes nothing
    until its play anyway."""
    config = read_topic_config(tr, ts)
    if not resharding(config):
        if config.paused and config.resharding_to is not None:    # paused while draining:
            config = dataclasses.replace(config, resharding_to=None)  # its play routes them
            tr[ts.config_key] = pack(config.as_dict())
        return config
    config = dataclasses.replace(config, shards=config.resharding_to,
                                 resharding_to=None if config.paused else config.resharding_to)
    tr[ts.config_key] = pack(config.as_dict())
    for sub in config.subs:
        membership.assign_shards(tr, ts, sub, config)
    for sub in config.catchup:
        # A reset's purge marks shards it finished; the reshard moved messages it had
        # not purged yet into them: it scans every shard again (safe, it is idempotent).
        r = ts.sub_records[sub]["purge"].range()
        tr.clear_range(r.start, r.stop)
    return config


# -- retention ----------------------------------------------------------------------

@transactional
def trim_bucket_chunk(tr, ts: TopicSpace, bucket: int, before_ms: int, limit: int, after=None,
                      young_from: int | None = None) -> tuple:
    """Delete the log entries of ``bucket`` inserted before ``before_ms`` among the next
    ``limit`` after position ``after`` (None: its start), never one not yet routed
    (``first_pending``) nor any after it. -> (deleted, bytes freed, last position read,
    done). ``done`` at the bucket's end, or at the first entry inserted at or after
    ``before_ms`` and committed at or after version ``young_from``; an entry inserted
    "later" but committed before ``young_from`` is a producer clock running ahead: it is
    kept and the scan goes on (None: stop at the first entry not due). The bytes freed
    are subtracted from the ``log_bytes`` counter here.

    Entries are read by snapshot (pushes appending to the bucket do not abort a trim)
    with a read conflict on each deleted one: two trims never both delete (and
    subtract) one entry."""
    space = ts.log[bucket]
    r = space.range()
    begin = ts.log_key(bucket, after) + b"\x00" if after is not None else r.start
    pending = first_pending(tr, ts)
    deleted = freed = 0
    rows = list(tr.snapshot.get_range(begin, r.stop, limit=limit))
    last, done = after, len(rows) < limit
    for kv in rows:
        vs = space.unpack(kv.key)[0]
        if pending is not None and vs >= pending:
            done = True
            break
        rec = Record.decode(kv.value)
        if rec.ts_ms >= before_ms:
            if young_from is None or _version_of(vs) >= young_from:
                done = True
                break
            last = vs       # a clock ahead: kept, and not a reason to keep what follows
            continue
        freed += _delete_entry(tr, ts, bucket, kv.key, vs, kv.value, rec.nchunks)
        deleted += 1
        last = vs
    _note_trimmed(tr, ts, deleted, freed)
    return deleted, freed, last, done


def _note_trimmed(tr, ts: TopicSpace, deleted: int, freed: int):
    """Subtract ``freed`` from ``log_bytes`` and count the entries deleted (``trimmed``).
    ``trimmed`` is written by every trim that deletes and read with a conflict by trim by
    size: two trims are serialized, so the size one never acts on a ``log_bytes`` that
    another trim lowered since it read it (it would delete more than needed)."""
    if freed:
        tr.add(ts.stat("log_bytes"), counter(-freed))
    if deleted:
        tr.add(ts.stat("trimmed"), counter(deleted))


def _version_of(vs) -> int:
    return int.from_bytes(vs.tr_version[:8], "big")


def _delete_entry(tr, ts: TopicSpace, bucket: int, key: bytes, vs, raw, nchunks: int) -> int:
    """Delete one log entry (read by the caller) and its body chunks: its bytes
    (``fdq.log.entry_bytes``). A read conflict on its key: a concurrent trim deleting it
    too makes one of the two retry (and find it gone)."""
    tr.add_read_conflict_key(key)
    size = 0
    if nchunks:
        last = tr.snapshot[ts.all_chunks.pack((vs, nchunks - 1))]
        size = chunks_bytes(len(last) if last != None else 0, nchunks)   # noqa: E711
        cr = ts.all_chunks[vs].range()
        tr.clear_range(cr.start, cr.stop)
    del tr[key]
    return entry_bytes(ts, bucket, len(raw), nchunks, size)


@transactional
def trim_oldest_chunk(tr, ts: TopicSpace, entries: list, max_bytes: int) -> tuple:
    """Delete the oldest of ``entries`` [(bucket, vs)] (the log's oldest, in log order)
    while the log is over ``max_bytes`` by its ``log_bytes`` counter, never one not yet
    routed nor any after it. -> (deleted, bytes freed, done). An entry already gone (a
    concurrent trim) is skipped. The counter is read by snapshot (concurrent pushes do
    not abort a trim), ``trimmed`` with a conflict (a concurrent trim does); the bytes
    freed are subtracted from it here."""
    tr.add_read_conflict_key(ts.stat("trimmed"))    # any other trim's commit (``_note_trimmed``)
    size = decode_counter(tr.snapshot[ts.stat("log_bytes")])
    pending = first_pending(tr, ts)
    raws = [tr.snapshot[ts.log_key(b, vs)] for b, vs in entries]    # (futures on FDB)
    deleted = freed = 0
    done = False
    for (bucket, vs), raw in zip(entries, raws):
        if size - freed <= max_bytes or (pending is not None and vs >= pending):
            done = True
            break
        if raw == None:  # noqa: E711 - deleted meanwhile
            continue
        freed += _delete_entry(tr, ts, bucket, ts.log_key(bucket, vs), vs, raw, Record.decode(raw).nchunks)
        deleted += 1
    _note_trimmed(tr, ts, deleted, freed)
    return deleted, freed, done


@transactional
def trim_index_chunk(tr, ts: TopicSpace, limit: int) -> tuple:
    """Delete time index entries (in minute order) that point before the log's oldest
    entry, up to the first that does not. -> (deleted, done). Deleting an index entry is
    always safe (a window then starts earlier, ``log.position_for_time``); keeping them
    would grow the index without bound under retention by size alone."""
    oldest = None
    for b in buckets_in(tr, ts):
        br = ts.log[b].range()
        for kv in tr.snapshot.get_range(br.start, br.stop, limit=1):
            vs = ts.log[b].unpack(kv.key)[0]
            oldest = vs if oldest is None or vs < oldest else oldest
    if oldest is None:      # an empty log: whatever is committed later is after this version
        rv = tr.get_read_version().wait()
        oldest = Versionstamp(rv.to_bytes(8, "big") + b"\x00\x00", 0)
    r = ts.time_index.range()
    rows = list(tr.snapshot.get_range(r.start, r.stop, limit=limit))   # (pushes add index
    for n, kv in enumerate(rows):                                       # entries: no conflict)
        if ts.time_index.unpack(kv.key)[1] >= oldest:
            return n, True
        del tr[kv.key]
    return len(rows), len(rows) < limit


def first_pending(tr, ts: TopicSpace):
    """The oldest message pushed while paused or resharding and not routed yet (its log
    entry is its only copy: retention must keep it and every later one), or None. Not a
    snapshot: a play routing it, or a push adding the first one, conflicts."""
    r = ts.pending.range()
    for kv in tr.get_range(r.start, r.stop, limit=1):
        return ts.pending.unpack(kv.key)[0]
    return None


@transactional
def _read_version(tr) -> int:
    return tr.get_read_version().wait()


@transactional
def expire_index_chunk(tr, space, older_than_version: int, limit: int, target=None, text=False,
                       keep_after_ms: int | None = None, keep_before_ms: int | None = None) -> int:
    """Delete up to ``limit`` by-version index entries older than a version, and the
    entries they point to in ``target`` (markers, dedupe ids) if they still belong to
    that index entry (an id pushed again since keeps its newer entry). With
    ``keep_after_ms``, a dedupe entry whose producer time is at or after it (and before
    ``keep_before_ms``, if given) is kept: old by versions but young by the clock means
    a version jump, not age; a time past ``keep_before_ms`` is a producer's clock ahead
    (kept, it would stop the cleanup of every later entry while that clock is ahead)."""
    r = space.range()
    n = 0
    for kv in tr.get_range(r.start, r.stop, limit=limit):
        vs = space.unpack(kv.key)[0]
        if int.from_bytes(vs.tr_version[:8], "big") >= older_than_version:
            break
        if target is not None:
            tid = bytes(kv.value).decode() if text else bytes(kv.value)
            tkey = target.pack((tid,))
            current = tr[tkey]
            if current != None:  # noqa: E711
                cur = bytes(current)
                if cur[:10] == vs.tr_version:
                    if keep_after_ms is not None and \
                            keep_after_ms <= int.from_bytes(cur[12:20], "big") < (keep_before_ms or 1 << 63):
                        break
                    del tr[tkey]
                    if not text:   # a push marker's parts, if split (producer.read_marker)
                        pr = target[tid].range()
                        tr.clear_range(pr.start, pr.stop)
        del tr[kv.key]
        n += 1
    return n


class Supervisor:
    """Admin operations on topics.

    Example::

        s = fdq.Supervisor(db)
        s.create_topic("orders", shards=16)
        s.pause("orders"); s.play("orders")
        s.rebalance("orders", shards=32)
        print(s.stats("orders")["subscriptions"]["default"]["backlog"])
    """

    def __init__(self, db, *, keyspace: Keyspace | None = None):
        self.db = db
        self.keyspace = keyspace or Keyspace()

    def _ts(self, name: str) -> TopicSpace:
        return self.keyspace.topic(check_name(name))

    def config(self, name: str) -> TopicConfig:
        return read_topic_config(self.db, self._ts(name), snapshot=True)

    def create_topic(self, name: str, shards: int | None = None, **options) -> TopicConfig:
        """Create a topic (``shards`` defaults to 16). A no-op if it exists, unless
        ``shards`` is given and differs from its count: that is ``TopicExists`` (change
        a topic's shard count with ``rebalance``)."""
        try:
            config = TopicConfig(**options) if shards is None else TopicConfig(shards=shards, **options)
        except TypeError as e:
            raise ConfigError(f"unknown topic option: {e}") from None
        result = create_topic(self.db, self.keyspace, check_name(name), config, strict_shards=shards is not None)
        if config.extend and not result.extend:    # never a silent no-op: say how to get it
            raise TopicExists(f"topic {name!r} already exists without extend support: "
                              "upgrade it with upgrade_extend (one-way)")
        return result

    def delete_topic(self, name: str):
        """Delete a topic: its config, consumers, queues, log and counters."""
        ts = self._ts(name)
        self.config(name)

        @transactional
        def drop(tr):
            r = ts.config_space.range()
            tr.clear_range(r.start, r.stop)
            del tr[ts.config_key]
            r = ts.space.range()
            tr.clear_range(r.start, r.stop)
        drop(self.db)

    def topics(self) -> list:
        """[(name, TopicConfig)] by name."""
        return list_topics(self.db, self.keyspace)

    def upgrade_extend(self, name: str) -> TopicConfig:
        """Give a topic extend support (headers, tag dispatch). One-way; messages
        already stored stay readable (a plain record is an extend record without
        headers). Consumers must then connect with ``extend_support=True``."""
        return update_topic_config(self.db, self._ts(name), extend=True)

    def update_topic(self, name: str, **changes) -> TopicConfig:
        """Change a topic's retention and limits (``fdq.config.UPDATABLE_TOPIC_FIELDS``;
        None clears an optional one), e.g. of a topic a push created with the defaults:
        pushes read them from their next transaction on, ``trim`` at its next run.
        Returns the new config."""
        fixed = sorted(set(changes) - set(UPDATABLE_TOPIC_FIELDS))
        if fixed:
            raise ConfigError(f"topic option(s) {', '.join(fixed)} cannot be updated "
                              f"(updatable: {', '.join(UPDATABLE_TOPIC_FIELDS)})")
        return update_topic_config(self.db, self._ts(name), **changes)

    def pause(self, name: str) -> TopicConfig:
        """Stop routing and consumption: pushes still land in the "all" log."""
        return update_topic_config(self.db, self._ts(name), paused=True, held_at=None)   # (ends a play's hold)

    def play(self, name: str, progress=None) -> int:
        """Route what arrived while paused, in order, then resume. Resumable. Refused
        while a reshard is moving queues (run rebalance again to finish it); a reshard
        that begins meanwhile stops it with the same error (the topic stays paused)."""
        ts = self._ts(name)
        config = self.config(name)
        if resharding(config):
            raise ConfigError(f"topic {name!r} is being resharded to {config.resharding_to} shards: "
                              "finish that first (run rebalance again)")
        total = 0
        hold = None
        while True:
            n, done, hold = play_chunk(self.db, ts, CHUNK, hold)
            total += n
            if progress:
                progress(n)
            if done:     # resumed in the chunk that routed the last one: a pause since holds
                config = self.config(name)
                if resharding(config):
                    raise ConfigError(f"topic {name!r} began resharding to {config.resharding_to} shards "
                                      f"during play ({total:,} routed): it stays paused; finish the reshard "
                                      "(run rebalance again), then play")
                return total

    def rebalance(self, name: str, shards: int | None = None, progress=None) -> TopicConfig:
        """Re-divide shards among live consumers now; with ``shards=N`` change the shard
        count, re-routing every backlog with each shard key's order kept. Resumable."""
        ts = self._ts(name)
        config = self.config(name)
        if shards is None and config.resharding_to is not None:
            shards = config.resharding_to      # finish a reshard a killed run left
        if shards is None or (shards == config.shards and not resharding(config)):
            config = reshard_finish(self.db, ts)    # no-op unless paused while draining
            for sub in config.subs:
                membership.assign_shards(self.db, ts, sub, config)
            if not config.paused:
                self.play(name)   # a rerun after a reshard killed before its play
            return self.config(name)
        TopicConfig(shards=shards)   # validates
        if config.resharding_to is not None and not resharding(config):
            # the last reshard's drain, unfinished (killed): end it before this one
            if reshard_finish(self.db, ts).resharding_to is not None:
                self.play(name)
        config = reshard_begin(self.db, ts, shards)
        old = max(config.shards, shards)
        tags = membership.read_tags(self.db, ts)
        for sub in config.subs:
            for tag in tags:
                for n in range(old):
                    for area in ("ready", "delayed", "leased"):
                        after = None
                        while True:
                            read, after, done = reshard_chunk(self.db, ts, sub, tag, n, area, shards, CHUNK, after)
                            if progress:
                                progress(read)
                            if done:
                                break
                    if n >= shards:
                        fold_shard_counters(self.db, ts, sub, tag, n, shards)
        config = reshard_finish(self.db, ts)
        if not config.paused:
            self.play(name)
        return self.config(name)   # as stored now (the play above ended resharding_to)

    def stats(self, name: str) -> dict:
        """Counters, backlog per shard, in-flight, DLQ, consumers and lag; from counters
        and a few point reads (O(shards + consumers), never O(backlog)). A consumer's
        ``heartbeat_age_s`` is for display (``membership.heartbeat_age``: the database
        clock, then versions); liveness does not use it. Its ``zombie`` is that age past
        its ``zombie_after_s`` (None if either is unknown): a consumer that died (kill -9)
        stays registered, owning its shards, until a live peer of its subscription finds
        it a zombie, so with none running it is listed for good."""
        return topic_stats(self.db, self._ts(name), name)


    def trim(self, name: str, *, before_ms: int | None = None, progress=None) -> int:
        """Apply retention to the "all" log: delete what was inserted before ``before_ms``
        (default: ``retention_s`` of the config), then, with ``retention_bytes``, the oldest
        entries (in log order) until the log's size (``TopicConfig``: its ``log_bytes``
        counter) is at most ``retention_bytes``; drop time index entries that point before
        the oldest entry left; and expire push markers and dedupe ids past their windows.
        Returns the log entries deleted. Queued messages are untouched, and so is every
        entry from the oldest one not routed yet (pushed while paused) on.

        By age, "inserted" is the producer's clock (a record's ``ts_ms``): an entry
        stamped at or after ``before_ms`` is kept, and the scan of its bucket goes on
        past it while entries were committed before ``before_ms`` by the database's
        versions (a producer clock running ahead), stopping at the first one committed
        since (an entry of a clock running behind is deleted by a later trim). Chunked
        and resumable: a trim killed mid-way leaves the counter equal to the log's size,
        and running it again finishes. ``before_ms``: epoch ms or a datetime; anything
        else is a ConfigError (a NaN, never compared as newer, deleted the whole log)."""
        from .producer import to_ms
        before_ms = to_ms(before_ms)
        ts = self._ts(name)
        config = self.config(name)
        if before_ms is None and config.retention_s is not None:
            before_ms = int((time.time() - config.retention_s) * 1000)
        deleted = 0
        buckets = log_buckets(self.db, ts)     # a reshard to fewer shards leaves buckets behind
        if before_ms is not None:
            # Versions advance at least VERSIONS_PER_S (recoveries jump ahead): an entry
            # committed at or after this version was committed after before_ms.
            young_from = _read_version(self.db) - max(0, int(time.time() * 1000) - before_ms) * (VERSIONS_PER_S // 1000)
            for b in buckets:
                after = None
                while True:
                    n, _freed, after, done = trim_bucket_chunk(self.db, ts, b, before_ms, CHUNK, after,
                                                               young_from)
                    deleted += n
                    if progress:
                        progress(n)
                    if done:
                        break
            idx = ts.time_index
            r = idx.range()

            @transactional
            def trim_index(tr):
                tr.clear_range(r.start, idx.pack((before_ms // 60000 * 60000 - 120_000,)))
            trim_index(self.db)
        if config.retention_bytes is not None:
            deleted += self._trim_to_size(ts, log_buckets(self.db, ts), config, progress)
        while not trim_index_chunk(self.db, ts, CHUNK)[1]:
            pass
        rv = _read_version(self.db)
        now_ms = int(time.time() * 1000)
        for space, target, window, text in ((ts.marks_by_version, ts.marks, MARKER_TTL_S, False),
                                            (ts.dedupe_by_version, ts.dedupe, config.dedupe_window_s, True)):
            keep_after = now_ms - int(window * 1000) if text else None
            keep_before = now_ms + int(window * 1000) if text else None   # as push judges a dedupe id
            while expire_index_chunk(self.db, space, rv - int(window * VERSIONS_PER_S), CHUNK,
                                     target, text, keep_after, keep_before) == CHUNK:
                pass
        return deleted

    def _trim_to_size(self, ts: TopicSpace, buckets: list, config: TopicConfig, progress=None) -> int:
        """Delete the log's oldest entries until its size is at most ``retention_bytes``
        by its ``log_bytes`` counter (exact; read again in every chunk)."""
        deleted, cursors = 0, {}
        while True:
            rows = read_chunk(self.db, ts, buckets, cursors, CHUNK)
            if not rows:
                break
            n, _freed, done = trim_oldest_chunk(self.db, ts, [(b, vs) for vs, b, _rec, _raw in rows],
                                                config.retention_bytes)
            deleted += n
            if progress:
                progress(n)
            if done:
                break       # fits, or reached messages not routed yet: they and later ones stay
        return deleted

    # -- subscriptions (see fdq.subscription) -----------------------------------------

    def create_subscription(self, name: str, subscription: str, config=None, *, ephemeral: bool = False,
                            progress=None) -> dict:
        """Create a subscription of topic ``name`` (defaults when ``config`` is None) and
        copy its start point (``deliver_policy``) from the "all" log before returning;
        then its consumers deliver. Re-running with the same config is a no-op that
        finishes an interrupted catch-up; a different config is an error listing the
        differing fields. Returns ``subscription_info``."""
        from .config import SubscriptionConfig
        from .subscription import catch_up, create_subscription
        ts = self._ts(name)
        check_name(subscription, "subscription")
        config = config if config is not None else SubscriptionConfig()
        if isinstance(config, dict):
            config = SubscriptionConfig.from_dict(config)
        if not isinstance(config, SubscriptionConfig):
            raise ConfigError(f"config must be a fdq.SubscriptionConfig, not {type(config).__name__}")
        if ephemeral and not config.ephemeral:
            config = dataclasses.replace(config, ephemeral=True)
        create_subscription(self.db, ts, subscription, config)
        catch_up(self.db, ts, subscription, progress=progress)
        return self.subscription(name, subscription)

    def delete_subscription(self, name: str, subscription: str):
        """Delete a subscription and all its state (queues, leases, DLQ, counters,
        consumers); nothing else. Its consumers get SubscriptionNotFound."""
        from .subscription import delete_subscription
        self.subscription(name, subscription)   # raises SubscriptionNotFound; checked apart so a
        delete_subscription(self.db, self._ts(name), subscription)  # retry after 1021 is no error

    def pause_subscription(self, name: str, subscription: str) -> bool:
        """Stop delivering to one subscription (pushes still fill its queues); the other
        subscriptions go on. Returns whether it was already paused."""
        from .subscription import set_subscription_paused
        return set_subscription_paused(self.db, self._ts(name), check_name(subscription, "subscription"), True)

    def play_subscription(self, name: str, subscription: str) -> bool:
        """Resume delivering to a paused subscription. Returns whether it was paused."""
        from .subscription import set_subscription_paused
        return set_subscription_paused(self.db, self._ts(name), check_name(subscription, "subscription"), False)

    def update_subscription(self, name: str, subscription: str, **changes):
        """Change updatable fields of a subscription (``fdq.config.UPDATABLE_SUBSCRIPTION_FIELDS``);
        its consumers apply them at their next heartbeat. Returns the new config."""
        from .config import SubscriptionConfig
        from .subscription import update_subscription
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(SubscriptionConfig)})
        if unknown:
            raise ConfigError(f"unknown subscription option(s): {', '.join(unknown)}")
        return update_subscription(self.db, self._ts(name), subscription, **changes)

    def reset(self, name: str, subscription: str, to_time=None, progress=None) -> int:
        """Move a subscription's start to ``to_time`` (epoch ms or datetime; None: now),
        backwards (rewind: messages inserted since are delivered again) or forwards
        (skip). Its ready and delayed messages are replaced by the "all" log's messages
        inserted at ``to_time`` or later (within retention); leases and the DLQ are left
        alone. Messages pushed meanwhile are kept, exactly once. Returns messages copied."""
        from .producer import to_ms
        from .subscription import begin_reset, catch_up
        ts = self._ts(name)
        begin_reset(self.db, ts, subscription, to_ms(to_time))
        return catch_up(self.db, ts, subscription, progress=progress)

    def subscription(self, name: str, subscription: str) -> dict:
        """{"name", "config", "ephemeral", "catching_up", "start_position"}."""
        from .subscription import subscription_info
        return subscription_info(self.db, self._ts(name), subscription)

    def subscriptions(self, name: str) -> list:
        """``subscription`` of each of the topic's subscriptions, in creation order."""
        return [self.subscription(name, sub) for sub in self.config(name).subs]

    def reap(self, name: str, zombie_after_s: float = 3.0) -> list:
        """Delete the topic's ephemeral subscriptions whose consumers are all zombies:
        watches their heartbeats for ``zombie_after_s``, or a member's own longer timeout
        (blocking). Returns those deleted."""
        from .subscription import Reaper
        reaper = Reaper(zombie_after_s)
        ts = self._ts(name)
        reaper.observe(self.db, ts, self.config(name), time.monotonic())
        deadline = time.monotonic() + reaper.longest_timeout_s
        while time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return reaper.observe(self.db, ts, self.config(name), time.monotonic())


    def dlq_list(self, name: str, subscription: str = "default", limit: int = 100) -> list:
        ts = self._ts(name)
        self.subscription(name, subscription)      # TopicNotFound, SubscriptionNotFound
        return [{"id": message_id(vs), "reason": reason, "consumer": cid, "attempts": rec.attempts,
                 "shard_key": rec.shard_key, "insertion_time": rec.ts_ms, "body": rec.body}
                for vs, rec, reason, cid, _k in delivery.dlq_list(self.db, ts, subscription, limit)]

    def dlq_redrive(self, name: str, subscription: str = "default", progress=None) -> int:
        """Move the subscription's dead letters back to their shards' ready queues
        (attempts reset), in chunks; resumable. A dead letter whose message is queued
        already (a ``reset`` rewound over it) leaves the DLQ without a second copy: the
        queued one delivers it. Returns the dead letters moved."""
        ts = self._ts(name)
        config = self.config(name)
        self.subscription(name, subscription)
        total = 0
        while True:
            n, done = delivery.dlq_redrive_chunk(self.db, ts, subscription, config, CHUNK)
            total += n
            if progress:
                progress(n)
            if done:
                return total

    def dlq_purge(self, name: str, subscription: str = "default") -> int:
        ts = self._ts(name)
        self.subscription(name, subscription)
        total = 0
        while True:
            n = delivery.dlq_purge_chunk(self.db, ts, subscription, CHUNK)
            total += n
            if n < CHUNK:
                return total

    def dlq_redrive_ids(self, name: str, subscription: str, ids) -> int:
        """Move the dead letters of ``ids`` (``dlq_list``'s ``id``) back to their shards'
        ready queues, attempts reset, as ``dlq_redrive`` moves all of them; an id no
        longer in the DLQ (redriven or purged meanwhile) is skipped. In chunks of at most
        ``CHUNK`` ids (and ``CHUNK_WRITE_BYTES``). Returns the dead letters moved; an id
        that is not a message id is a ``ConfigError``, nothing moved."""
        ts, vss = self._dlq_ids(name, subscription, ids)
        total = 0
        while vss:
            moved, looked = delivery.dlq_redrive_ids(self.db, ts, subscription, vss[:CHUNK])
            total += moved
            vss = vss[looked:]
        return total

    def dlq_purge_ids(self, name: str, subscription: str, ids) -> int:
        """Delete the dead letters of ``ids`` (``dlq_list``'s ``id``), skipping those no
        longer in the DLQ, ``CHUNK`` per transaction. Returns how many were deleted; an
        id that is not a message id is a ``ConfigError``, nothing deleted."""
        ts, vss = self._dlq_ids(name, subscription, ids)
        total = 0
        for i in range(0, len(vss), CHUNK):
            total += delivery.dlq_purge_ids(self.db, ts, subscription, vss[i:i + CHUNK])
        return total

    def _dlq_ids(self, name: str, subscription: str, ids) -> tuple:
        if isinstance(ids, (str, bytes)):
            raise ConfigError(f"ids must be a list of message ids, not one {type(ids).__name__}")
        vss, seen = [], set()
        for mid in ids:
            try:
                vs = parse_message_id(mid)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if vs.to_bytes() not in seen:        # each once, in the order given
                seen.add(vs.to_bytes())
                vss.append(vs)
        ts = self._ts(name)
        self.subscription(name, subscription)      # TopicNotFound, SubscriptionNotFound
        return ts, vss

    def consumers(self, name: str) -> list:
        st = self.stats(name)
        return [dict(c, subscription=sub) for sub, s in st["subscriptions"].items() for c in s["consumers"]]


@transactional
def topic_stats(tr, ts: TopicSpace, name: str) -> dict:
    """``Supervisor.stats``, in one read-only transaction (snapshot reads; retried on a
    retryable error like every transactional function)."""
    snap = tr.snapshot
    config = load_config(snap[ts.config_key])
    if config is None:
        raise TopicNotFound(f"topic {name!r} does not exist")
    rv = tr.get_read_version().wait()
    clock = membership.read_clock(tr, ts.clock_key)
    clock_version = _counter_or_none(snap[ts.clock_version_key])
    topic = {k: decode_counter(snap[ts.stat(k)]) for k in ("inserted", "routed", "emitted", "acked")}
    topic["pending"] = topic["inserted"] - topic["routed"]
    # Bodies pushed, all time (nsqd's message_bytes), log entries trim deleted, and the
    # log's size now (TopicConfig).
    topic["inserted_bytes"] = decode_counter(snap[ts.stat("inserted_bytes")])
    topic["trimmed"] = decode_counter(snap[ts.stat("trimmed")])
    topic["log_bytes"] = decode_counter(snap[ts.stat("log_bytes")])
    subs = {}
    for sub in config.subs:
        shards = shard_counters(snap, ts, sub, config)
        owners = membership.read_owners(tr, ts, sub)
        members = membership.read_members(tr, ts, sub)
        consumers = []
        for cid, m in sorted(members.items()):
            hbc, hbv = (snap[ts.heartbeat_clock_key(sub, cid)], snap[ts.consumers.pack((sub, cid, "hbv"))])
            age = membership.heartbeat_age(_counter_or_none(hbc), _counter_or_none(hbv), clock, clock_version, rv)
            zombie_after = m["record"].get("zombie_after_s")
            consumers.append({"id": cid, "heartbeats": m["hb"], "mode": m["record"].get("mode"),
                              "host": m["record"].get("host"), "pid": m["record"].get("pid"),
                              "tag": m["record"].get("tag"),
                              "heartbeat_age_s": age, "zombie_after_s": zombie_after,
                              # for people, as the age: a peer would take its shards (none
                              # runs to, or it has not yet); liveness never reads this
                              "zombie": None if age is None or zombie_after is None else age > zombie_after,
                              "shards": sorted(n for (t, n), (o, _e) in owners.items() if o == cid),
                              "tag_shards": sorted([t, n] for (t, n), (o, _e) in owners.items() if o == cid)})
        oldest = None
        for (tag, n) in shards:
            shard = ts.shard(sub, tag, n)
            r = shard.ready.range()
            for kv in snap.get_range(r.start, r.stop, limit=1):
                t = Record.decode(kv.value).ts_ms
                oldest = t if oldest is None else min(oldest, t)
        total = lambda k: sum(c[k] for c in shards.values())  # noqa: E731
        subs[sub] = {
            "catching_up": sub in config.catchup, "paused": sub in config.paused_subs,
            "backlog": total("backlog"), "in_flight": total("in_flight"), "delayed": total("delayed"),
            "emitted": total("emitted"), "acked": total("acked"),
            "dlq": delivery.dlq_size(snap, ts, sub),
            "oldest_ready_ms": oldest,
            "lag_ms": (int(time.time() * 1000) - oldest) if oldest is not None else 0,
            "consumers": consumers,
            "shards": [{"tag": tag, "shard": n, "owner": owners.get((tag, n), (None, 0))[0], **c}
                       for (tag, n), c in sorted(shards.items())],
            "tags": _per_tag(shards, owners, members),
        }
    return {"topic": name, "config": config.as_dict(), "counters": topic, "subscriptions": subs}


def _counter_or_none(raw):
    return None if raw == None else decode_counter(raw)  # noqa: E711


def _per_tag(shards: dict, owners: dict, members: dict) -> dict:
    """{tag: backlog, in-flight and delayed of the tag's shards, their owners, and
    whether they fell back to untagged consumers ("" is the untagged messages)}."""
    out = {}
    for (tag, n), c in sorted(shards.items()):
        t = out.setdefault(tag, {"shards": 0, "backlog": 0, "in_flight": 0, "delayed": 0, "owners": set()})
        t["shards"] += 1
        for k in ("backlog", "in_flight", "delayed"):
            t[k] += c[k]
        owner = owners.get((tag, n), (None, 0))[0]
        if owner is not None:
            t["owners"].add(owner)
    for tag, t in out.items():
        t["owners"] = sorted(t["owners"])
        t["fallback"] = bool(tag) and any(not (members.get(o, {}).get("record", {}).get("tag"))
                                          for o in t["owners"])
    return out


REPLAY_HEARTBEAT_S = 0.5   # a running replay bumps its heartbeat counter this often
REPLAY_ORPHAN_S = 3.0      # a replay whose heartbeat stays unchanged this long was killed


def replay_window(db, ks: Keyspace, topic: str, start_ms, end_ms, progress=None) -> int:
    """Push again every logged message inserted in ``[start_ms, end_ms)`` and committed
    before the replay began, in log order, ``CHUNK`` per transaction: once per call.

    Each call is a *run* with its own progress record (``replay_begin``) and a heartbeat
    (a counter a thread bumps every ``REPLAY_HEARTBEAT_S``); each chunk pushes and advances
    the run's progress in one transaction (``replay_chunk``), fenced by the run's owner,
    so a retry after ``commit_unknown_result`` pushes nothing twice. Resumable: a call
    that finds a run of the same window whose heartbeat stays unchanged for
    ``REPLAY_ORPHAN_S`` on its own monotonic clock (killed) takes it over and finishes
    what it left; a run that is alive is left alone, and this call replays the window
    on its own (so two calls at once replay it twice). A finished run removes its
    progress. Returns how many this call pushed (a resumed run: what was left)."""
    import threading

    from .log import body_of
    from .producer import to_ms
    start_ms, end_ms = to_ms(start_ms, refuse_seconds=False), to_ms(end_ms, refuse_seconds=False)
    if start_ms is not None and end_ms is not None and end_ms < start_ms:
        raise ConfigError(f"replay window ends ({end_ms}) before it starts ({start_ms})")
    ts = ks.topic(check_name(topic))
    config = read_topic_config(db, ts, snapshot=True)     # TopicNotFound for an unknown topic
    window = f"{start_ms}:{end_ms}"
    owner = os.urandom(8).hex()
    run, state = None, None
    for orphan in _orphaned_runs(db, ts, window):
        got = replay_begin(db, ts, window, owner, start_ms, end_ms, claim=orphan)
        if got is not None:
            run, state = got
            break
    if run is None:
        run, state = replay_begin(db, ts, window, owner, start_ms, end_ms)
    stop = threading.Event()
    beat = threading.Thread(target=_replay_heartbeat, args=(db, ts, window, run, stop),
                            name=f"fdq-replay-{run}", daemon=True)
    beat.start()
    try:
        after = state["after"]
        index = {}
        batch, first, count, size = [], state["count"], state["count"], 0
        copies = 1 + len(config.subs)    # what the last chunk found (each reads it again)

        def flush():
            nonlocal count, copies
            while batch:
                try:
                    # the progress's count, not what the last attempt pushed: an attempt that
                    # committed and reported commit_unknown_result leaves its retry nothing to do
                    while True:
                        try:
                            now, taken, copies = replay_chunk(db, ks, ts, (window, run, owner), batch,
                                                              os.urandom(16), int(time.time() * 1000), index)
                            break
                        except TopicHeld:      # a play finishing: nothing written, try again
                            time.sleep(HOLD_WAIT_S)
                    if progress:
                        progress(now - count)
                    count = now
                except BaseException:
                    # Interrupted (Ctrl-C lands right after a commit as easily as anywhere)
                    # or failed: the chunk may have committed; progress hears what did.
                    after_interrupt()
                    now = _committed_count(db, ts, window, run, owner)
                    if progress and now is not None and now > count:
                        progress(now - count)
                    raise
                del batch[:taken]
        for vs, _b, rec in iter_window(db, ts, log_buckets(db, ts), start_ms, end_ms):
            if int.from_bytes(vs.tr_version[:8], "big") > state["stop"]:
                break       # committed after the replay began (its own pushes among them)
            if after is not None and vs.to_bytes() <= after:
                continue    # replayed by an earlier run of this replay
            body = body_of(db, ts, vs, rec, strict=True)
            if body is None:
                continue    # trimmed since read: no longer in the log, not replayed
            env = _ReplayEnvelope(body, rec.shard_key, None, None, rec.headers, replay_of=message_id(vs),
                                  due_at=rec.due)
            if batch and (size + len(body)) * copies > CHUNK_WRITE_BYTES:
                flush()     # not on top of the batch: its copies could pass FDB's 10 MB
                size = 0
            batch.append((vs, env))
            size += len(env.body)
            if len(batch) >= CHUNK or size * copies >= CHUNK_WRITE_BYTES:
                flush()
                size = 0
        flush()
        replay_finish(db, ts, window, run, owner)
    finally:
        stop.set()
        beat.join()
    return count - first


def _run_key(ts: TopicSpace, window: str, run: str) -> bytes:
    return ts.replays.pack((window, run))


def _beat_key(ts: TopicSpace, window: str, run: str) -> bytes:
    return ts.replays.pack((window, run, "hb"))


def _replay_heartbeat(db, ts: TopicSpace, window: str, run: str, stop):
    @transactional
    def beat(tr):
        tr.add(_beat_key(ts, window, run), counter(1))     # blind: conflicts with nothing
    while not stop.wait(REPLAY_HEARTBEAT_S):
        try:
            beat(db)
        except Exception:       # a database hiccup: the next beat tries again
            pass


@transactional
def _replay_runs(tr, ts: TopicSpace, window: str) -> dict:
    """{run: (owner, heartbeat)} of the unfinished runs of ``window``."""
    r = ts.replays[window].range()
    out, beats = {}, {}
    for kv in tr.snapshot.get_range(r.start, r.stop):
        key = ts.replays.unpack(kv.key)
        if len(key) == 2:
            out[key[1]] = unpack(bytes(kv.value)).get("owner")
        else:
            beats[key[1]] = decode_counter(kv.value)
    return {run: (o, beats.get(run, 0)) for run, o in out.items()}


def _orphaned_runs(db, ts: TopicSpace, window: str) -> list:
    """[(run, owner, heartbeat)] of the runs of ``window`` whose owner and heartbeat stay
    unchanged for ``REPLAY_ORPHAN_S`` (their callers were killed), oldest watched first;
    returns at once when there are none or all are alive."""
    seen = _replay_runs(db, ts, window)
    deadline = time.monotonic() + REPLAY_ORPHAN_S
    while seen and time.monotonic() < deadline:
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        now = _replay_runs(db, ts, window)
        seen = {run: v for run, v in seen.items() if now.get(run) == v}
    return [(run, *v) for run, v in seen.items()]


@transactional
def replay_begin(tr, ts: TopicSpace, window: str, owner: str, start_ms, end_ms, claim=None):
    """Start a run of the replay of ``window`` owned by ``owner``: it replays what was
    committed up to this transaction's read version (``stop``). With ``claim`` (run,
    owner, heartbeat as ``_orphaned_runs`` saw them), take that run over instead, if it
    is still as seen (else None). Returns ``(run, progress)``."""
    if claim is not None:
        run, old_owner, seen = claim
        raw = tr[_run_key(ts, window, run)]
        if raw == None or decode_counter(tr[_beat_key(ts, window, run)]) != seen:  # noqa: E711
            return None
        state = unpack(bytes(raw))
        if state.get("owner") != old_owner:
            return None
        state["owner"] = owner
        tr[_run_key(ts, window, run)] = pack(state)
        return run, state
    state = {"start": start_ms, "end": end_ms, "stop": tr.get_read_version().wait(), "after": None,
             "count": 0, "owner": owner}
    tr[_run_key(ts, window, owner)] = pack(state)
    return owner, state


@transactional
def replay_chunk(tr, ks: Keyspace, ts: TopicSpace, run: tuple, entries: list, txid: bytes,
                 now_ms: int, time_index: dict) -> tuple:
    """Push the ``entries`` [(vs, envelope)] past the progress of ``run`` (window, run,
    owner) and advance it, in this one transaction, if ``owner`` still owns the run
    (``ReplayTakenOver`` if not). Returns ``(pushed, taken, copies)``: how many the run
    has pushed in all, how many of ``entries`` (from the first) are done, and the copies
    a message gets (the log's and one per subscription) by the config read here.

    The entries taken are those whose bodies' copies fit ``CHUNK_WRITE_BYTES`` (at least
    one) under the topic's subscriptions as this transaction reads them (a subscription
    created or deleted meanwhile conflicts): the caller's batch was sized by an earlier
    count, and a replay outlives many subscription changes."""
    from .errors import ReplayTakenOver
    from .producer import push_batch
    window, run_id, owner = run
    key = _run_key(ts, window, run_id)
    raw = tr[key]
    if raw == None:  # noqa: E711
        raise ConfigError(f"replay {window!r} of topic {ts.name!r} is not running")
    state = unpack(bytes(raw))
    if state.get("owner") != owner:
        raise ReplayTakenOver(f"replay {window!r} of topic {ts.name!r} stalled for over {REPLAY_ORPHAN_S} s "
                              "and another call took it over: this one stops")
    copies = 1 + len(read_topic_config(tr, ts).subs)
    todo = [(vs, env) for vs, env in entries if state["after"] is None or vs.to_bytes() > state["after"]]
    skipped = len(entries) - len(todo)
    size = 0
    for i, (_vs, env) in enumerate(todo):
        size += len(env.body)
        if i and size * copies > CHUNK_WRITE_BYTES:
            todo = todo[:i]
            break
    if todo:
        push_batch(tr, ks, [(ts.name, env) for _vs, env in todo], txid, int.from_bytes(txid[:4], "big"),
                   False, now_ms, time_index, False)
        state["after"] = todo[-1][0].to_bytes()
        state["count"] += len(todo)
        tr[key] = pack(state)
    return state["count"], skipped + len(todo), copies


def _committed_count(db, ts: TopicSpace, window: str, run: str, owner: str) -> int | None:
    """How many run ``run`` has pushed by its progress record (None if it is not
    ``owner``'s any more, or cannot be read now): what an interrupted replay reports."""
    tr = db.create_transaction()    # held until the read is waited for: FDB cancels the
    try:                            # reads of a transaction it destroys (1025)
        raw = tr.snapshot[_run_key(ts, window, run)].wait()
    except error_types():   # (the interrupt's report, not worth a retry loop)
        return None
    if raw == None:  # noqa: E711
        return None
    state = unpack(bytes(raw))
    return state["count"] if state.get("owner") == owner else None


@transactional
def replay_finish(tr, ts: TopicSpace, window: str, run: str, owner: str):
    """Remove a finished run's progress and heartbeat (if ``owner`` still owns it)."""
    raw = tr[_run_key(ts, window, run)]
    if raw != None and unpack(bytes(raw)).get("owner") == owner:  # noqa: E711
        del tr[_run_key(ts, window, run)]
        del tr[_beat_key(ts, window, run)]


@dataclasses.dataclass(frozen=True)
class _ReplayEnvelope:
    body: bytes
    shard_key: str | None
    delay: float | None
    msg_id: str | None
    headers: dict | None
    replay_of: str | None = None
    due_at: int | None = None     # the original's due time (database clock ms), if delayed


__all__ = ["Supervisor", "replay_window", "replay_begin", "replay_chunk", "replay_finish", "play_chunk", "reshard_begin", "reshard_chunk",
           "reshard_finish", "trim_bucket_chunk", "ConsumerConfig", "os", "Versionstamp"]
