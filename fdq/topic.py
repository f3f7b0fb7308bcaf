"""Moved to :mod:`fdq.ops.topics` (issue 22); this shim keeps the old import path until
the wrap-up removes it."""
from __future__ import annotations

from .ops.topics import (HOLD_VERSIONS, HOLD_WAIT_S, check_hold, create_topic, delete_topic, held, list_topics,
                         load_config, read_topic_config, stamp_subscription_start, update_topic_config,
                         write_new_topic_config, write_subscription_record, write_topic_config)

__all__ = ["HOLD_VERSIONS", "HOLD_WAIT_S", "check_hold", "create_topic", "delete_topic", "held", "list_topics",
           "load_config", "read_topic_config", "stamp_subscription_start", "update_topic_config",
           "write_new_topic_config", "write_subscription_record", "write_topic_config"]
