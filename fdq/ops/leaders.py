"""Database-wide roles held by one process at a time (the metrics leader: the process
that exports the database-wide metrics when several serve them).

A role is a record (``meta/leaders/<role>``: its holder and the timeout it advertises)
and a beat counter beside it. The holder bumps the counter (``beat_leader``) every
interval; a process that wants the role watches (holder, beat) and takes it over
(``take_leader``) once it has seen both unchanged for the timeout on its own monotonic
clock (``Watch``), as consumers find zombies: no wall clock is compared across hosts
and an FDB version jump moves nothing. A take is conditional on what was seen (read
with a conflict), so two candidates never both win, and a beat reads the holder with a
conflict, so a holder taken over learns it at its next beat. A clean stop releases the
role (``release_leader``) for the next candidate to take at once.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine import transactional
from ..keyspace import Keyspace, counter, decode_counter
from ..keyspace.codec import decode_leader, encode_leader


@dataclass(frozen=True)
class Seen:
    """A role as read: its ``holder`` (None when free), the ``timeout_s`` that holder
    advertises, and its ``beat`` counter."""

    holder: str | None
    timeout_s: float
    beat: int


def _read(reader, ks: Keyspace, role: str) -> Seen:
    record = decode_leader(reader[ks.leader_key(role)]) or {}
    timeout = record.get("timeout_s")
    return Seen(record.get("holder"), float(timeout) if isinstance(timeout, (int, float)) else 0.0,
                decode_counter(reader[ks.leader_beat_key(role)]))


@transactional
def read_leader(tr, ks: Keyspace, role: str) -> Seen:
    """Who holds ``role`` now (snapshot reads: a watcher never conflicts)."""
    return _read(tr.snapshot, ks, role)


@transactional
def take_leader(tr, ks: Keyspace, role: str, me: str, timeout_s: float, seen: Seen,
                requires: bytes | None = None) -> bool:
    """Make ``me`` the holder of ``role`` (advertising ``timeout_s``) if its holder and
    beat are still as ``seen`` (read with a conflict: of two candidates, one wins).
    ``requires``: the key the role lives with (a topic's config, for its maintainer),
    read with a conflict: while it is absent the role is not taken, and a delete of it
    racing the take retries the take (whose write the delete would not have cleared).
    Returns whether ``me`` holds it now."""
    if requires is not None and tr[requires] == None:  # noqa: E711
        return False
    now = _read(tr, ks, role)
    if now.holder == me:
        return True
    if (now.holder, now.beat) != (seen.holder, seen.beat):
        return False
    tr[ks.leader_key(role)] = encode_leader(me, timeout_s)
    tr.add(ks.leader_beat_key(role), counter(1))
    return True


@transactional
def beat_leader(tr, ks: Keyspace, role: str, me: str) -> bool:
    """Bump ``role``'s beat if ``me`` holds it (the holder read with a conflict: a beat
    racing a takeover retries and sees it). Returns whether ``me`` holds it."""
    record = decode_leader(tr[ks.leader_key(role)])
    if record is None or record.get("holder") != me:
        return False
    tr.add(ks.leader_beat_key(role), counter(1))
    return True


@transactional
def release_leader(tr, ks: Keyspace, role: str, me: str) -> bool:
    """Give ``role`` up if ``me`` holds it (the next candidate takes it without waiting).
    Returns whether it did."""
    record = decode_leader(tr[ks.leader_key(role)])
    if record is None or record.get("holder") != me:
        return False
    del tr[ks.leader_key(role)]
    return True


class Watch:
    """One candidate's view of a role held by another: ``stale(seen, now)`` is True once
    the same (holder, beat) has been seen for the longer of ``timeout_s`` and the
    holder's advertised timeout, ``now`` being this process's monotonic clock."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._first = None          # ((holder, beat), monotonic time first seen)

    def stale(self, seen: Seen, now: float) -> bool:
        key = (seen.holder, seen.beat)
        if self._first is None or self._first[0] != key:
            self._first = (key, now)
            return False
        return now - self._first[1] >= max(self.timeout_s, seen.timeout_s)

    def reset(self):
        self._first = None


__all__ = ["Seen", "Watch", "read_leader", "take_leader", "beat_leader", "release_leader"]
