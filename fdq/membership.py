"""Moved: membership is :mod:`fdq.ops.membership`'s, the database clock (and the heartbeat
age stats show) :mod:`fdq.ops.clock`'s. These names stay importable from here until the
wrap-up of issue 22, ``assign_shards``, ``join``, ``leave`` and ``declare_zombie`` with
their old signatures (a topic config they never used: the assignment reads the stored
one). A patch of an attribute here reaches only callers that look it up here."""
from __future__ import annotations

from .engine import transactional
from .ops import membership as _membership
from .ops.clock import advance_clock, heartbeat_age, read_clock
from .ops.membership import (assign_new_tags, ensure_owner, heartbeat, ownership_pools, plan_assignment, read_members,
                             read_owned, read_owners, read_tags, replaced, shard_ids)


@transactional
def assign_shards(tr, ts, sub, _config=None):
    return _membership.assign_shards(tr, ts, sub)


@transactional
def join(tr, ts, sub, consumer_id, record, _config):
    return _membership.join(tr, ts, sub, consumer_id, record)


@transactional
def leave(tr, ts, sub, consumer_id, _config, incarnation=None):
    return _membership.leave(tr, ts, sub, consumer_id, incarnation)


@transactional
def declare_zombie(tr, ts, sub, consumer_id, observed_hb, _config):
    return _membership.declare_zombie(tr, ts, sub, consumer_id, observed_hb)


__all__ = ["read_clock", "advance_clock", "heartbeat_age", "shard_ids", "read_tags", "ownership_pools",
           "read_members", "read_owners", "plan_assignment", "assign_shards", "assign_new_tags", "join",
           "read_owned", "replaced", "leave", "heartbeat", "declare_zombie", "ensure_owner"]
