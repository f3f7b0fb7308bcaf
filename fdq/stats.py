"""Counters: what every stat is made of (atomic adds, read back here; never scans).

Per topic (``topic/<t>/all/stats``): ``inserted`` (pushed into the "all" log), ``routed``
(routed to the subscriptions' queues; lags ``inserted`` while paused).
Per shard of a subscription (``.../shards/<tag>/<n>/stats``): ``routed`` (messages put
in this shard's queue; consumers watch it), ``done`` (removed for good: acked,
dead-lettered, consumed at most once or exactly once), ``emitted`` (deliveries,
redeliveries included), ``in_flight`` (leased now), ``delayed`` (waiting to be due),
``dead`` (sent to the DLQ), ``requeued`` (redeliveries queued). Backlog = routed - done.
"""
from __future__ import annotations

from .keyspace import TopicSpace, decode_counter

SHARD_COUNTERS = ("routed", "done", "emitted", "in_flight", "delayed", "dead", "acked", "requeued")


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
