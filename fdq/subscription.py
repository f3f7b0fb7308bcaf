"""Moved to :mod:`fdq.ops.subscriptions` and :mod:`fdq.ops.catchup` (issue 22); this
module re-exports their names until the wrap-up removes it. It keeps ``Reaper`` (not an
operation: a watcher on its owner's monotonic clock), which moves with the consumer's
member loop.
"""
from __future__ import annotations

import time

from . import membership
from .config import CHUNK, effective_consumer_config
from .errors import SubscriptionNotFound
from .keyspace import TopicSpace
from .ops.catchup import PURGE_SCAN, begin_reset, catch_up, catch_up_chunk, purge_chunk
from .ops.subscriptions import (create_and_join, create_subscription, declare_zombie, delete_subscription,
                                diff_error, header_text, is_ephemeral, join, leave, matcher, read_subscription,
                                set_subscription_paused, subscription_info, update_subscription)
from .ops.topics import read_topic_config

_diff_error = diff_error


class Reaper:
    """Watches the members of a topic's ephemeral subscriptions for zombies (heartbeat
    counter unchanged for ``zombie_after_s`` on this host's monotonic clock), so a
    subscription whose last consumer was killed is deleted even with no peer left to
    notice. Consumers of the topic run one in their heartbeat; ``Supervisor.reap`` too."""

    def __init__(self, zombie_after_s: float):
        self.zombie_after_s = zombie_after_s
        self.longest_timeout_s = zombie_after_s   # the longest timeout a member advertised
        self._seen = {}          # (sub, cid) -> (hb, since)

    def observe(self, db, ts: TopicSpace, topic_config, now: float, skip: str | None = None) -> list:
        """One observation; returns the subscriptions deleted."""
        deleted = []
        live = set()
        for sub in topic_config.subs:
            if sub == skip:
                continue
            # Read each time (one snapshot read): a subscription deleted and created
            # again under its name may have changed from durable to ephemeral.
            try:
                eph = is_ephemeral(sub, read_subscription(db, ts, sub, snapshot=True, topic_config=topic_config))
            except SubscriptionNotFound:
                continue
            if not eph:
                continue
            members = membership.read_members(db, ts, sub)
            seen_at = max(now, time.monotonic())    # first seen after the read (see Consumer._observe_peers)
            for cid, m in members.items():
                live.add((sub, cid))
                self.longest_timeout_s = max(self.longest_timeout_s, _advertised_timeout(m["record"]))
                seen = self._seen.get((sub, cid))
                if seen is None or seen[0] != m["hb"]:
                    self._seen[(sub, cid)] = (m["hb"], seen_at)
                elif now - seen[1] >= max(self.zombie_after_s, _advertised_timeout(m["record"])):
                    self._seen.pop((sub, cid), None)
                    if declare_zombie(db, ts, sub, cid, seen[0], topic_config) and \
                            sub not in read_topic_config(db, ts, snapshot=True).subs:
                        deleted.append(sub)
        for key in [k for k in self._seen if k not in live]:
            del self._seen[key]
        return deleted


def _advertised_timeout(record: dict) -> float:
    """The zombie timeout a member advertises in its record (it heartbeats at its own
    interval), 0 if it advertises none."""
    t = record.get("zombie_after_s")
    return t if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0

__all__ = ["CHUNK", "PURGE_SCAN", "Reaper", "begin_reset", "catch_up", "catch_up_chunk", "create_and_join",
           "create_subscription", "declare_zombie", "delete_subscription", "effective_consumer_config",
           "header_text", "is_ephemeral", "join", "leave", "matcher", "purge_chunk", "read_subscription",
           "set_subscription_paused", "subscription_info", "update_subscription"]
