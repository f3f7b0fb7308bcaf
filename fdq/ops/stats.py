"""Stats: every figure is made of counters (atomic adds, read back here) and a few point
reads, never a scan of a backlog.

Per topic (``topic/<t>/all/stats``): ``inserted`` (pushed into the "all" log), ``routed``
(routed to the subscriptions' queues; lags ``inserted`` while paused), ``inserted_bytes``
and ``log_bytes``: the four a push adds, packed in one key per part
(``keyspace.PUSH_COUNTERS``), unpacked here.
Per shard of a subscription (``.../shards/<tag>/<n>/stats``): ``routed`` (messages put
in this shard's queue; consumers watch it), ``done`` (removed for good: acked,
dead-lettered, consumed at most once or exactly once, dropped by TTL), ``emitted`` (deliveries,
redeliveries included), ``in_flight`` (leased now), ``delayed`` (waiting to be due),
``dead`` (sent to the DLQ), ``requeued`` (redeliveries queued), ``filtered`` (dropped by
the subscription's filter: counted in ``done`` too), ``expired`` (its TTL ended before a
delivery: dropped or dead-lettered, by the topic's ``ttl_action``). Backlog = routed - done.
"""
from __future__ import annotations

from collections import defaultdict

from .dlq import dlq_size
from ..engine import transactional
from ..errors import TopicNotFound
from ..keyspace import PUSH_COUNTERS, PUSH_STAT, VERSIONS_PER_S, TopicSpace, decode_counter, decode_counters
from ..keyspace.codec import Record, decode_leader, unpack
from .clock import heartbeat_age, read_clock
from .membership import read_members, read_owners
from .topics import load_config

SHARD_COUNTERS = ("routed", "done", "emitted", "in_flight", "delayed", "dead", "acked", "requeued", "filtered",
                  "expired")


def topic_counter(reader, ts: TopicSpace, name: str) -> int:
    """Topic counter ``name``: the sum of its parts (``TopicSpace.stat``; a push counter:
    its slot of the packed parts)."""
    if name in PUSH_COUNTERS:
        return push_counters(reader, ts)[name]
    r = ts.stat_range(name)
    return sum(decode_counter(kv.value) for kv in reader.get_range(r.start, r.stop))


def push_counters(reader, ts: TopicSpace) -> dict:
    """{name: sum of its parts} of the packed push counters (``PUSH_COUNTERS``)."""
    sums = [0] * len(PUSH_COUNTERS)
    r = ts.stat_range(PUSH_STAT)
    for kv in reader.get_range(r.start, r.stop):
        for i, v in enumerate(decode_counters(kv.value, len(PUSH_COUNTERS))):
            sums[i] += v
    return dict(zip(PUSH_COUNTERS, sums))


def topic_counters(reader, ts: TopicSpace) -> dict:
    """Every topic counter (the sums of their parts), in one range read; 0 for one never
    written."""
    sums = defaultdict(int)
    r = ts.stats.range()
    for kv in reader.get_range(r.start, r.stop):
        name = ts.stats.unpack(kv.key)[0]
        if name == PUSH_STAT:
            for slot, v in zip(PUSH_COUNTERS, decode_counters(kv.value, len(PUSH_COUNTERS))):
                sums[slot] += v
        else:
            sums[name] += decode_counter(kv.value)
    return sums


def shard_counters(reader, ts: TopicSpace, sub: str, config, tags=None) -> dict:
    """{(tag, n): {counter: value, ..., "backlog": routed - done}} for a subscription
    (every dispatch tag's shards unless ``tags`` is given)."""
    if tags is None:
        r = ts.tags.range()
        tags = [""] + [ts.tags.unpack(kv.key)[0] for kv in reader.get_range(r.start, r.stop)]
    futures = {}
    for tag in tags:
        for n in range(max(config.shards, config.resharding_to or 0)):   # a growing reshard: the new ones too
            shard = ts.shard(sub, tag, n)
            futures[(tag, n)] = {name: reader[shard.stat(name)] for name in SHARD_COUNTERS}
    out = {}
    for key, fs in futures.items():
        c = {name: decode_counter(f) for name, f in fs.items()}
        c["backlog"] = c["routed"] - c["done"]
        out[key] = c
    return out


@transactional
def topic_stats(tr, ts: TopicSpace, now_ms: int) -> dict:
    """``Supervisor.stats`` at ``now_ms`` (the caller's clock: a subscription's lag is
    ``now_ms`` minus its oldest ready message's time), in one read-only transaction
    (snapshot reads)."""
    snap = tr.snapshot
    config = load_config(snap[ts.config_key])
    if config is None:
        raise TopicNotFound(f"topic {ts.name!r} does not exist")
    rv = tr.get_read_version().wait()
    clock = read_clock(tr, ts.clock_key)
    clock_version = _counter_or_none(snap[ts.clock_version_key])
    sums = topic_counters(snap, ts)
    topic = {k: sums[k] for k in ("inserted", "routed", "emitted", "acked")}
    topic["pending"] = topic["inserted"] - topic["routed"]
    # Bodies pushed, all time (nsqd's message_bytes), log entries trim deleted, and the
    # log's size now (TopicConfig).
    topic["inserted_bytes"] = sums["inserted_bytes"]
    topic["trimmed"] = sums["trimmed"]
    topic["log_bytes"] = sums["log_bytes"]
    subs = {}
    for sub in config.subs:
        shards = shard_counters(snap, ts, sub, config)
        owners = read_owners(tr, ts, sub)
        members = read_members(tr, ts, sub)
        consumers = []
        # every shard has a live owner: a member owning none waits for one (standby)
        all_owned = bool(owners) and all(o is not None and o in members for o, _e in owners.values())
        for cid, m in sorted(members.items()):
            hbc, hbv = snap[ts.heartbeat_clock_key(sub, cid)], snap[ts.heartbeat_version_key(sub, cid)]
            age = heartbeat_age(_counter_or_none(hbc), _counter_or_none(hbv), clock, clock_version, rv)
            zombie_after = m["record"].get("zombie_after_s")
            consumers.append({"id": cid, "heartbeats": m["hb"], "mode": m["record"].get("mode"),
                              "host": m["record"].get("host"), "pid": m["record"].get("pid"),
                              "tag": m["record"].get("tag"),
                              "heartbeat_age_s": age, "zombie_after_s": zombie_after,
                              # for people, as the age: a peer would take its shards (none
                              # runs to, or it has not yet); liveness never reads this
                              "zombie": None if age is None or zombie_after is None else age > zombie_after,
                              "standby": all_owned and not any(o == cid for o, _e in owners.values()),
                              "shards": sorted(n for (t, n), (o, _e) in owners.items() if o == cid),
                              "tag_shards": sorted([t, n] for (t, n), (o, _e) in owners.items() if o == cid)})
        oldest = None
        for (tag, n) in shards:
            r = ts.shard(sub, tag, n).ready_range
            for kv in snap.get_range(r.start, r.stop, limit=1):
                t = Record.decode(kv.value).ts_ms
                oldest = t if oldest is None else min(oldest, t)
        total = lambda k: sum(c[k] for c in shards.values())  # noqa: E731
        subs[sub] = {
            "catching_up": sub in config.catchup, "paused": sub in config.paused_subs,
            "backlog": total("backlog"), "in_flight": total("in_flight"), "delayed": total("delayed"),
            "emitted": total("emitted"), "acked": total("acked"), "filtered": total("filtered"),
            "expired": total("expired"),
            "dlq": dlq_size(snap, ts, sub),
            "oldest_ready_ms": oldest,
            "lag_ms": (now_ms - oldest) if oldest is not None else 0,
            "consumers": consumers,
            # consumers beyond the shard count: raise it with rebalance (``--shards``)
            "standby": sum(c["standby"] for c in consumers),
            "shards": [{"tag": tag, "shard": n, "owner": owners.get((tag, n), (None, 0))[0], **c}
                       for (tag, n), c in sorted(shards.items())],
            "tags": per_tag(shards, owners, members),
        }
    return {"topic": ts.name, "config": config.as_dict(), "counters": topic, "subscriptions": subs,
            "maintenance": maintenance_stats(snap, ts, rv, sums)}


def maintenance_stats(snap, ts: TopicSpace, rv: int, sums) -> dict:
    """The topic's maintenance (``fdq.maintainer``): the ``holder`` of its role (None:
    none; its ``beat`` counter), its last pass (``last_pass_age_s`` by database versions,
    for display; what it ``removed``: log entries, expired messages; ``behind``: its sweep goes on) and
    the log entries and bytes trimmed in all (by it and by ``trim``)."""
    record_key, beat_key = ts.maintenance_role_keys
    holder = (decode_leader(snap[record_key]) or {}).get("holder")
    raw = snap[ts.maintenance_key]
    last = unpack(bytes(raw)) if raw != None else {}    # noqa: E711
    version = last.get("version")
    return {"holder": holder, "beat": decode_counter(snap[beat_key]),
            "last_pass_by": last.get("holder"),
            "last_pass_age_s": max(0.0, (rv - version) / VERSIONS_PER_S) if isinstance(version, int) else None,
            "last_pass_removed": last.get("removed"), "behind": last.get("behind"),
            "trimmed": sums["trimmed"], "trimmed_bytes": sums["trimmed_bytes"]}


def _counter_or_none(raw):
    return None if raw == None else decode_counter(raw)  # noqa: E711


def per_tag(shards: dict, owners: dict, members: dict) -> dict:
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
