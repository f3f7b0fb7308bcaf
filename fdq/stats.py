"""Moved to :mod:`fdq.ops.stats` (issue 22); this shim keeps the old import path until
the wrap-up removes it."""
from __future__ import annotations

from .ops.stats import SHARD_COUNTERS, shard_counters, topic_stats

__all__ = ["SHARD_COUNTERS", "shard_counters", "topic_stats"]
