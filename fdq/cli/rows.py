"""Rows: what the commands show, built from fdq's Python API (no queue logic here).

Every row is a plain dict with stable snake_case keys, units in the names (``_ms``,
``_s``), numbers as numbers: ``--json`` prints them as they are, the tables format them.
The untagged dispatch tag is ``None`` (JSON ``null``).
"""
from __future__ import annotations

import base64
import dataclasses

from ..config import TOPIC_STATE, TopicConfig
from ..errors import TopicNotFound

# A topic's settings: every TopicConfig field but its state (fdq.config.TOPIC_STATE,
# changed by the operations that own it) and its subscriptions (listed with theirs).
TOPIC_SETTINGS = tuple(f.name for f in dataclasses.fields(TopicConfig) if f.name not in TOPIC_STATE
                       and f.name != "subs")


def _tag(tag: str):
    return tag or None


def topic_row(name: str, stats: dict) -> dict:
    """One line of ``fdq topics``: every setting of the topic, its state, subscriptions
    (names) and counts."""
    config = stats["config"]
    subs = stats["subscriptions"]
    return {
        "name": name,
        **{k: config[k] for k in TOPIC_SETTINGS},
        "paused": config["paused"],
        "resharding_to": config.get("resharding_to"),
        "subscriptions": list(subs),
        "inserted": stats["counters"]["inserted"],
        "pending": stats["counters"]["pending"],
        "backlog": sum(s["backlog"] for s in subs.values()),
    }


def topic_detail(sup, name: str) -> dict:
    """``fdq topics show``: the topic's row, its subscriptions in full (as ``fdq subs``
    lists them: state, counts, every setting under ``config``) instead of their names."""
    stats = sup.stats(name)
    return {**topic_row(name, stats), "subscriptions": subscription_rows(sup, name, stats)}


def topic_rows(sup) -> list:
    rows = []
    for name, _config in sup.topics():
        try:
            rows.append(topic_row(name, sup.stats(name)))
        except TopicNotFound:   # deleted since it was listed
            continue
    return rows


def _consumer_row(sub: str, c: dict, owned: list) -> dict:
    return {
        "subscription": sub,
        "id": c["id"],
        "mode": c.get("mode"),
        "tag": c.get("tag") or None,
        "host": c.get("host"),
        "pid": c.get("pid"),
        "shards": owned,
        "heartbeats": c.get("heartbeats"),
        "heartbeat_age_s": c.get("heartbeat_age_s"),
        "zombie_after_s": c.get("zombie_after_s"),
        "zombie": c.get("zombie"),
    }


def _tag_rows(shards: list) -> list:
    by_tag = {}
    for s in shards:
        t = by_tag.setdefault(s["tag"], {"tag": _tag(s["tag"]), "shards": 0, "backlog": 0,
                                         "in_flight": 0, "delayed": 0})
        t["shards"] += 1
        for k in ("backlog", "in_flight", "delayed"):
            t[k] += s[k]
    return [by_tag[k] for k in sorted(by_tag)]


def stats_row(stats: dict) -> dict:
    """The tables of ``fdq stats`` (its ``--json`` prints ``Supervisor.stats`` as it is):
    the topic's config and counters, then per subscription its counts, live consumers
    (with the shards each owns) and backlog per dispatch tag and per shard."""
    config = stats["config"]
    counters = stats["counters"]
    subs = []
    for sub, s in stats["subscriptions"].items():
        owned = {}
        for sh in s["shards"]:
            if sh["owner"] is not None:
                owned.setdefault(sh["owner"], []).append({"tag": _tag(sh["tag"]), "shard": sh["shard"]})
        subs.append({
            "name": sub,
            "paused": s["paused"],
            "catching_up": s["catching_up"],
            "backlog": s["backlog"],
            "in_flight": s["in_flight"],
            "delayed": s["delayed"],
            "dlq": s["dlq"],
            "emitted": s["emitted"],
            "acked": s["acked"],
            "filtered": s["filtered"],
            "lag_ms": s["lag_ms"],
            "oldest_ready_time_ms": s["oldest_ready_ms"],
            "consumers": [_consumer_row(sub, c, owned.get(c["id"], [])) for c in s["consumers"]],
            "unowned_shards": sum(1 for sh in s["shards"] if sh["owner"] is None),
            "tags": _tag_rows(s["shards"]),
            "per_shard": [{"tag": _tag(sh["tag"]), "shard": sh["shard"], "owner": sh["owner"],
                           "backlog": sh["backlog"], "in_flight": sh["in_flight"],
                           "delayed": sh["delayed"], "emitted": sh["emitted"], "acked": sh["acked"]}
                          for sh in s["shards"]],
        })
    return {
        "topic": stats["topic"],
        "shards": config["shards"],
        "extend": config["extend"],
        "paused": config["paused"],
        "resharding_to": config.get("resharding_to"),
        "max_backlog": config.get("max_backlog"),
        "retention_s": config.get("retention_s"),
        "retention_bytes": config.get("retention_bytes"),
        "dedupe_window_s": config.get("dedupe_window_s"),
        "inserted": counters["inserted"],
        "routed": counters["routed"],
        "pending": counters["pending"],
        "emitted": counters["emitted"],
        "acked": counters["acked"],
        "inserted_bytes": counters["inserted_bytes"],
        "log_bytes": counters["log_bytes"],
        "trimmed": counters["trimmed"],
        "subscriptions": subs,
    }


def consumer_rows(stats: dict) -> list:
    """``fdq consumers``: the registered consumers of every subscription (``zombie``: its
    heartbeat is older than its zombie timeout, e.g. killed with none left to notice)."""
    return [c for s in stats_row(stats)["subscriptions"] for c in s["consumers"]]


def subscription_row(topic: str, info: dict, sub_stats: dict | None) -> dict:
    """``fdq subs``: one subscription, from ``Supervisor.subscription`` (its stored
    config, in full, under ``config``) and its counts from ``Supervisor.stats`` (None:
    deleted since it was listed, counts are None)."""
    config = info["config"].as_dict()
    counts = {k: (sub_stats or {}).get(k) for k in ("backlog", "in_flight", "delayed", "dlq")}
    return {
        "topic": topic,
        "name": info["name"],
        "ephemeral": info["ephemeral"],
        "catching_up": info["catching_up"],
        "paused": info["paused"],
        "deliver_policy": config["deliver_policy"],
        "start_time_ms": config["start_time_ms"],
        "start_position": info["start_position"],
        **counts,
        "consumers": None if sub_stats is None else len(sub_stats["consumers"]),
        "config": config,
    }


def subscription_rows(sup, topic: str, stats: dict | None = None) -> list:
    """Every subscription of ``topic`` (``stats``: its ``Supervisor.stats``, read if None)."""
    subs = (stats or sup.stats(topic))["subscriptions"]
    return [subscription_row(topic, info, subs.get(info["name"])) for info in sup.subscriptions(topic)]


def body_fields(body: bytes) -> dict:
    """A body as text when it is UTF-8, else base64; ``body_encoding`` says which."""
    try:
        return {"body": body.decode("utf-8"), "body_encoding": "utf-8"}
    except UnicodeDecodeError:
        return {"body": base64.b64encode(body).decode("ascii"), "body_encoding": "base64"}


def message_row(m) -> dict:
    """``fdq tail``: one delivered ``fdq.Message``."""
    return {
        "id": m.id,
        "topic": m.topic,
        "subscription": m.subscription,
        "shard": m.shard,
        "tag": _tag(m.tag),
        "shard_key": m.shard_key,
        "msg_id": m.msg_id,
        "insertion_time_ms": m.insertion_time,
        "attempts": m.attempts,
        "replay_of": m.replay_of,
        "headers": dict(m.headers),
        **body_fields(m.body),
    }


def push_row(r) -> dict:
    """``fdq push``: one ``fdq.PushResult``."""
    return {"id": r.id, "topic": r.topic, "shard": r.shard, "duplicate": r.duplicate,
            "trace_id": r.trace_id, "position": r.position}


def dlq_row(d: dict, subscription: str) -> dict:
    """``fdq dlq list``: one dead letter (from ``Supervisor.dlq_list``)."""
    return {"id": d["id"], "subscription": subscription, "reason": d["reason"],
            "consumer": d["consumer"], "attempts": d["attempts"], "shard_key": d["shard_key"],
            "insertion_time_ms": d["insertion_time"], "dead_age_s": d["dead_age_s"], "raw": d["raw"],
            **body_fields(d["body"])}


def peek_row(e: dict, subscription: str) -> dict:
    """``fdq peek``: one message as ``Supervisor.peek`` shows it (keys that do not apply
    to its state are null)."""
    return {"id": e["id"], "subscription": subscription, "state": e["state"], "shard": e["shard"],
            "tag": _tag(e["tag"]), "attempts": e["attempts"],
            "insertion_time_ms": e["insertion_time"], "shard_key": e["shard_key"], "msg_id": e["msg_id"],
            "replay_of": e["replay_of"], "due_in_s": e["due_in_s"], "leased_by": e["leased_by"],
            "ack_wait_s": e["ack_wait_s"], "reason": e["reason"], "consumer": e["consumer"],
            "dead_age_s": e["dead_age_s"], "raw": e["raw"], "headers": e["headers"], **body_fields(e["body"])}


def get_row(info: dict) -> dict:
    """``fdq get``: one message (``Supervisor.get``): its log entry (null once trimmed)
    and, per subscription in creation order, its state and where it is."""
    log = info["log"]
    return {
        "id": info["id"], "topic": info["topic"], "pending": info["pending"],
        "log": None if log is None else {
            "bucket": log["bucket"], "insertion_time_ms": log["insertion_time"], "shard_key": log["shard_key"],
            "msg_id": log["msg_id"], "replay_of": log["replay_of"], "raw": log["raw"], "headers": log["headers"],
            **body_fields(log["body"])},
        "subscriptions": [{"name": sub, "state": s["state"], "places": [peek_row(p, sub) for p in s["places"]]}
                          for sub, s in info["subscriptions"].items()],
        "delayed_unsearched": info["delayed_unsearched"],
    }


# -- column metadata (how render.table shows them) ---------------------------------------

# Which columns a table on a narrow terminal keeps, by header: the highest number goes
# first (then the rightmost of equals); unlisted headers are 1; a table's first column
# always stays. 0: what a row is about and its main counts.
COLUMN_PRIORITY = {
    # identity and what is queued
    "topic": 0, "subscription": 0, "consumer": 0, "id": 0, "field": 0, "value": 0, "backlog": 0,
    "messages": 0, "reason": 0,
    # state and counts
    "shards": 1, "state": 1, "in flight": 1, "dlq": 1, "lag": 1, "heartbeat age": 1, "attempts": 1,
    "inserted": 1, "deliver": 1, "tag": 1, "body": 1, "consumers": 2,
    # detail
    "paused": 2, "pending": 2, "delayed": 2, "catching up": 2, "host": 2, "key": 2, "subscriptions": 2,
    "extend": 3, "mode": 3, "pid": 3, "filtered": 3, "unowned shards": 3, "ack": 3, "ephemeral": 3,
}

# Columns of free text (a body, a reason, a list of names): in a table they shrink to
# the room left, ellipsized ("..."); plain and tsv show them whole.
FREE_TEXT_COLUMNS = frozenset({"subscriptions", "reason", "body", "value", "description"})


__all__ = ["COLUMN_PRIORITY", "FREE_TEXT_COLUMNS", "TOPIC_SETTINGS", "topic_row", "topic_detail", "topic_rows",
           "stats_row", "consumer_rows", "message_row", "push_row", "dlq_row", "body_fields", "subscription_row",
           "subscription_rows", "peek_row", "get_row"]
