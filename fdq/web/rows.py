"""Rows: what the dashboard shows, built from ``Supervisor``'s results (no queue logic).

As ``fdq.cli.rows``: plain dicts with stable snake_case keys, units in the names, numbers
as numbers; the untagged dispatch tag is ``None``. The page renders them as they are.
"""
from __future__ import annotations

import base64

BODY_PREVIEW_BYTES = 512        # characters (or bytes, base64) of a dead letter's body in a listing


def _tag(tag: str):
    return tag or None


def consumer_state(c: dict) -> str:
    """``zombie`` (its heartbeat is older than its zombie timeout: killed, with no live
    peer that has taken its shards yet), ``standby`` (live, owning no shard: every shard
    has a live owner), ``live``, or ``unknown`` (no age to judge by)."""
    if c.get("zombie") is None:
        return "unknown"
    return "zombie" if c["zombie"] else "standby" if c.get("standby") else "live"


def consumer_row(sub: str, c: dict) -> dict:
    return {
        "subscription": sub,
        "id": c["id"],
        "state": consumer_state(c),
        "mode": c.get("mode"),
        "tag": _tag(c.get("tag") or ""),
        "host": c.get("host"),
        "pid": c.get("pid"),
        "heartbeats": c.get("heartbeats"),
        "heartbeat_age_s": c.get("heartbeat_age_s"),
        "zombie_after_s": c.get("zombie_after_s"),
        "shards": [{"tag": _tag(t), "shard": n} for t, n in c.get("tag_shards", [])],
    }


def subscription_row(name: str, s: dict) -> dict:
    """One subscription of ``Supervisor.stats``: its counts, consumers, and who owns
    each shard (the assignment picture)."""
    return {
        "name": name,
        "paused": s["paused"],
        "catching_up": s["catching_up"],
        "backlog": s["backlog"],
        "in_flight": s["in_flight"],
        "delayed": s["delayed"],
        "redeliveries": sum(sh.get("requeued", 0) for sh in s["shards"]),
        "dlq": s["dlq"],
        "emitted": s["emitted"],
        "acked": s["acked"],
        "lag_ms": s["lag_ms"],
        "oldest_ready_time_ms": s["oldest_ready_ms"],
        "consumers": [consumer_row(name, c) for c in s["consumers"]],
        "assignment": [{"tag": _tag(sh["tag"]), "shard": sh["shard"], "owner": sh["owner"],
                        "backlog": sh["backlog"], "in_flight": sh["in_flight"]} for sh in s["shards"]],
    }


SETTINGS = ("shards", "hash", "extend", "paused", "resharding_to", "max_backlog", "dedupe_window_s",
            "retention_s", "retention_bytes", "max_message_bytes")


def topic_summary(stats: dict, rates: dict | None = None) -> dict:
    """One line of the topics table: settings in brief, totals over its subscriptions,
    and the latest rates (``History.rates``: None until two samples exist)."""
    config, counters = stats["config"], stats["counters"]
    subs = stats["subscriptions"].values()
    consumers = [c for s in subs for c in s["consumers"]]
    rates = rates or {}
    return {
        "name": stats["topic"],
        "shards": config["shards"],
        "extend": config["extend"],
        "paused": config["paused"],
        "resharding_to": config.get("resharding_to"),
        "subscriptions": len(stats["subscriptions"]),
        "consumers": len(consumers),
        "zombies": sum(1 for c in consumers if c.get("zombie")),
        "inserted": counters["inserted"],
        "acked": counters["acked"],
        "pending": counters["pending"],
        "backlog": sum(s["backlog"] for s in subs),
        "in_flight": sum(s["in_flight"] for s in subs),
        "dlq": sum(s["dlq"] for s in subs),
        "lag_ms": max((s["lag_ms"] for s in subs), default=0),
        "inserted_per_s": rates.get("inserted_per_s"),
        "acked_per_s": rates.get("acked_per_s"),
    }


def topic_detail(stats: dict, rates: dict | None = None) -> dict:
    """The topic page: settings, counters, and each subscription's row."""
    config = stats["config"]
    return {
        "summary": topic_summary(stats, rates),
        "settings": {k: config.get(k) for k in SETTINGS},
        "counters": dict(stats["counters"]),
        "subscriptions": [subscription_row(name, s) for name, s in stats["subscriptions"].items()],
    }


def dlq_row(d: dict) -> dict:
    """A dead letter of ``Supervisor.dlq_list``: its body cut to ``BODY_PREVIEW_BYTES``
    as text when UTF-8, else base64 (``body_encoding`` says which)."""
    body = d["body"]
    try:
        text, encoding = body.decode("utf-8")[:BODY_PREVIEW_BYTES], "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(body[:BODY_PREVIEW_BYTES]).decode("ascii"), "base64"
    return {"id": d["id"], "reason": d["reason"], "attempts": d["attempts"], "consumer": d["consumer"],
            "shard_key": d["shard_key"], "insertion_time_ms": d["insertion_time"], "raw": d["raw"],
            "body_bytes": len(body), "body": text, "body_encoding": encoding,
            "body_truncated": len(body) > BODY_PREVIEW_BYTES}


__all__ = ["consumer_row", "consumer_state", "subscription_row", "topic_summary", "topic_detail", "dlq_row"]
