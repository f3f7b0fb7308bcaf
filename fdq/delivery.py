"""Moved: the queue's transactional functions are :mod:`fdq.ops.queue`'s, the dead-letter
queue's :mod:`fdq.ops.dlq`'s. These names stay importable from here until the wrap-up of
issue 22 (a patch of an attribute here changes nothing: patch ``fdq.ops.queue``)."""
from __future__ import annotations

from .engine import transactional
from .ops.dlq import dlq_list, dlq_purge_chunk, dlq_purge_ids, dlq_redrive_ids, dlq_size
from .ops.dlq import dlq_redrive_chunk as _dlq_redrive_chunk
from .ops.queue import (MAX_REASON_CHARS, SCAN_LIMIT, Expiry, Fate, Selection, SettleRow, Taken, batch_leased,
                        dead_letter_taken, expire_leases, fail_in_place, in_shard, lease_batch, mark_take,
                        promote_due, read_leases, scan_leases, scan_shards_leases, settle, take_batch,
                        take_committed)


@transactional
def dlq_redrive_chunk(tr, ts, sub, _config, limit):
    """The old signature (an unused ``config``) of ``fdq.ops.dlq.dlq_redrive_chunk``."""
    return _dlq_redrive_chunk(tr, ts, sub, limit)


__all__ = ["Taken", "Selection", "SettleRow", "Expiry", "Fate", "MAX_REASON_CHARS", "SCAN_LIMIT", "promote_due",
           "read_leases", "in_shard", "take_batch", "mark_take", "take_committed", "batch_leased", "lease_batch",
           "dead_letter_taken", "settle", "scan_leases", "scan_shards_leases", "expire_leases", "fail_in_place",
           "dlq_list", "dlq_redrive_chunk", "dlq_redrive_ids", "dlq_purge_ids", "dlq_purge_chunk", "dlq_size"]
