"""A topic's clock: what its delays are due by, and the heartbeat age stats show.

Delays (delayed pushes, nak delays, backoff) are due by this clock, not by database
versions (an FDB recovery jumps versions ~100 s at once) nor by a wall clock (hosts
disagree). The topic's live consumers advance it by the time that passed on their own
monotonic clocks (:func:`advance_clock`), so it never runs ahead of real time; a due time is
counted from :func:`due_base` (the clock plus versions since its last advance), so a
delay may end a lease check late, never early. It stands still while none of them runs (nobody
to deliver to). One per topic (``TopicSpace.clock_key``): a single key for the whole
database was written by every consumer 4 times a second.
"""
from __future__ import annotations

from ..engine import transactional
from ..keyspace import VERSIONS_PER_S, decode_counter


def read_clock(tr, clock_key: bytes) -> int:
    """The clock, in milliseconds (snapshot read: never conflicts)."""
    return decode_counter(tr.snapshot[clock_key])


def due_base(tr, clock_key: bytes, version_key: bytes) -> int:
    """The clock reading a due time is counted from (a delayed push, a nak's delay): the
    clock plus the time since its last advance by versions (``version_key``: the read
    version of that advance). The clock alone lags real time by up to a lease-check
    interval (more on a loaded host, whose consumers advance it late), and a delay
    counted from it ended that much early. Versions advance at least ``VERSIONS_PER_S``
    a second, so this is never behind the clock's next advances: a delay ends late,
    never early (a version jump since the last advance makes it longer, never shorter).
    Snapshot reads."""
    advanced = tr.snapshot[version_key]
    return base_at(read_clock(tr, clock_key),
                   None if advanced == None else decode_counter(advanced),  # noqa: E711
                   tr.get_read_version().wait())


def base_at(clock: int, clock_version: int | None, read_version: int) -> int:
    """``due_base`` from what it reads: the clock, the read version of its last advance
    (None: never advanced, no consumer has run yet) and the read version now."""
    if clock_version is None:
        return clock
    return clock + max(0, read_version - clock_version) * 1000 // VERSIONS_PER_S


@transactional
def advance_clock(tr, clock_key: bytes, candidate_ms: int, version_key: bytes | None = None) -> int:
    """Move the clock to at least ``candidate_ms`` (a blind atomic max, so consumers
    never conflict over it). Returns the clock's new value as seen here.
    With ``version_key`` (``TopicSpace.clock_version_key``), an advance also records its
    read version there (a blind max too): how long ago, in versions, the clock last
    moved (``heartbeat_age``)."""
    current = read_clock(tr, clock_key)
    if candidate_ms > current:
        tr.max(clock_key, int(candidate_ms).to_bytes(8, "little"))
        if version_key is not None:
            tr.max(version_key, tr.get_read_version().wait().to_bytes(8, "little"))
    return max(current, candidate_ms)


def heartbeat_age(hb_clock, hb_version, clock: int, clock_version, read_version: int):
    """Seconds since a consumer's last heartbeat, for display (``Supervisor.stats``), from
    what it recorded (``hb_clock``: the topic's clock then; ``hb_version``: the read
    version then; None if absent) and the database now (its ``clock``, the read version
    of the clock's last advance ``clock_version`` or None, and ``read_version``). None
    before the first heartbeat. Liveness never uses it (see ``fdq.ops.membership``).

    No single read can time a heartbeat exactly: versions jump ~100 s at an FDB recovery,
    the client's wall clock is any host's, and the topic's clock only moves while some
    consumer of it runs. So the age is split at the clock's last advance: up to it, the
    topic's clock (advanced by live consumers' monotonic clocks: immune to version
    jumps and clock skew; it lags real time by at most a lease-check interval); after
    it (or from the heartbeat, if the clock has not moved since), versions (~1,000,000 a
    second). While any consumer of the database runs, the clock advances every
    ``lease_check_interval_s``, so the figure is right to within that interval and a
    version jump shows only until the next advance (a fraction of a second); with no
    consumer running (all killed), the clock stands still and the age grows by versions,
    as it should. A jump that happens while no consumer runs adds ~100 s to it."""
    if hb_version is None or hb_clock is None:
        return None
    # by versions from the later of the heartbeat and the clock's last advance
    since = max(hb_version, clock_version if clock_version is not None else 0)
    return round(max(0, clock - hb_clock) / 1000 + max(0, read_version - since) / VERSIONS_PER_S, 3)


__all__ = ["read_clock", "due_base", "base_at", "advance_clock", "heartbeat_age"]
