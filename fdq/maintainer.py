"""A topic's maintenance, continuously: its retention (age, size, count), its time index,
and push markers and dedupe ids past their windows, by the processes already running.

Every consumer (``ConsumerConfig(maintenance=True)``, the default) runs a
:class:`Maintainer` of its topic in a thread of its own (``fdq.member``): one process
per topic holds the topic's maintenance role (``fdq.ops.leaders``, role
``TopicSpace.maintenance_role``) and does the work; the others watch its beat and take
the role over once it has stood still for their zombie timeout on their own monotonic
clock (a holder killed with ``kill -9``). Work is a pass of :func:`retention_steps`
and :func:`ttl_steps` (messages whose TTL ended, removed from every queue):
each step one transaction of at most ``CHUNK`` entries at batch priority, resumable
(each deletes what it did); the holder beats between steps and stops at once when
another took over. A pass runs at most ``PASS_STEPS`` steps of the sweep under way
(the next tick goes on with it: "behind"); sweeps come every ``MIN_INTERVAL_S`` while
they remove something, backing off to ``MAX_INTERVAL_S`` while they remove nothing.
``Supervisor.trim`` runs the same retention steps to the end. Progress:
``Supervisor.stats(name)["maintenance"]``. :class:`Maintenance` is the same for every
topic of the database, for a process running no consumer of them (the broker).
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from itertools import chain

from .config import CHUNK, TopicConfig
from .errors import ConfigError
from .keyspace import VERSIONS_PER_S, Keyspace, TopicSpace
from .log import log_buckets, read_chunk
from .ops.leaders import Watch, beat_leader, read_leader, release_leader, take_leader
from .ops.push import MARKER_TTL_S
from .ops.membership import read_tags
from .ops.retention import (expire_dedupe_chunk, expire_markers_chunk, expire_ready_chunk, read_version,
                            record_maintenance_pass, trim_bucket_chunk, trim_index_chunk, trim_oldest_chunk,
                            trim_time_index_before)
from .ops.topics import list_topics, read_topic_config

log = logging.getLogger("fdq.maintainer")

MAINT_LEASE_S = 10.0     # Maintenance: a holder's beat standing still this long, another takes over
MIN_INTERVAL_S = 1.0     # between passes while they find work
MAX_INTERVAL_S = 30.0    # ... backing off (doubling) to this while they find none
PASS_STEPS = 50          # transactions per pass at most (more: the next tick goes on)


def retention_steps(db, ts: TopicSpace, config: TopicConfig, *, before_ms: int | None = None,
                    limit: int = CHUNK):
    """Apply ``config``'s retention to the "all" log, one transaction per step (yields
    the log entries each deleted): by age (``before_ms``, default now minus
    ``retention_s``), then by size (``retention_bytes``) and count
    (``retention_messages``), the oldest first; then the time index entries that point
    before the oldest entry left, and push markers and dedupe ids past their windows.
    Stopping between steps loses nothing: running the steps again finishes."""
    if before_ms is None and config.retention_s is not None:
        before_ms = int((time.time() - config.retention_s) * 1000)
    buckets = log_buckets(db, ts)     # a reshard to fewer shards leaves buckets behind
    if before_ms is not None:
        # Versions advance at least VERSIONS_PER_S (recoveries jump ahead): an entry
        # committed at or after this version was committed after before_ms.
        young_from = read_version(db) - max(0, int(time.time() * 1000) - before_ms) * (VERSIONS_PER_S // 1000)
        for b in buckets:
            after, done = None, False
            while not done:
                n, _freed, after, done = trim_bucket_chunk(db, ts, b, before_ms, limit, after, young_from)
                yield n
        trim_time_index_before(db, ts, before_ms)
    if config.retention_bytes is not None or config.retention_messages is not None:
        cursors = {}
        buckets = log_buckets(db, ts)
        while True:
            rows = read_chunk(db, ts, buckets, cursors, limit)
            if not rows:
                break
            n, _freed, done = trim_oldest_chunk(db, ts, [(b, vs) for vs, b, _rec, _raw in rows],
                                                config.retention_bytes, config.retention_messages)
            yield n
            if done:
                break       # fits, or reached messages not routed yet: they and later ones stay
    while not trim_index_chunk(db, ts, limit)[1]:
        yield 0
    rv = read_version(db)
    while expire_markers_chunk(db, ts, rv - int(MARKER_TTL_S * VERSIONS_PER_S), limit) == limit:
        yield 0
    window_s, now_ms = config.dedupe_window_s, int(time.time() * 1000)
    # an id is young by versions or by the producers' clock, either way (as push judges it)
    keep = (now_ms - int(window_s * 1000), now_ms + int(window_s * 1000))
    while expire_dedupe_chunk(db, ts, rv - int(window_s * VERSIONS_PER_S), limit, *keep) == limit:
        yield 0
    yield 0


def ttl_steps(db, ts: TopicSpace, config: TopicConfig, *, limit: int = CHUNK):
    """Remove the messages whose TTL ended from the head (``limit`` messages) of every
    ready queue of every subscription, one transaction per shard (yields how many each
    removed): a subscription nobody consumes shrinks too."""
    tags = read_tags(db, ts)
    for sub in config.subs:
        for tag in tags:
            for n in range(max(config.shards, config.resharding_to or 0)):
                yield expire_ready_chunk(db, ts, ts.shard(sub, tag, n), limit)


class Maintainer:
    """One candidate for the maintenance of topic ``ts`` (of keyspace ``ks``), named
    ``me`` (a consumer's id): ``tick(now)`` (this process's monotonic clock, every
    ``tick_interval_s``) takes the role
    when it is free or its holder's beat stood still for ``lease_s``, beats it while
    holding it, and runs a pass when one is due. ``release()`` gives it up (a clean
    stop: the next candidate takes it at once)."""

    def __init__(self, db, ks: Keyspace, ts: TopicSpace, me: str, lease_s: float):
        self.db, self.ks, self.ts, self.me = db, ks, ts, me
        self.lease_s = lease_s
        self.watch = Watch(lease_s)
        self.holding = False
        self.last_beat = 0.0
        self.next_pass = 0.0
        self.interval = MIN_INTERVAL_S
        self._sweep = None              # the steps of the sweep under way (a generator)
        self._swept = 0                 # what it removed so far

    @property
    def tick_interval_s(self) -> float:
        """How often ``tick`` should run: a beat every quarter of the lease at least."""
        return min(MIN_INTERVAL_S, self.lease_s / 4)

    def tick(self, now: float, stop=None):
        """One tick (see the class); ``stop``: an Event ending a pass between steps."""
        if not self.holding:
            seen = read_leader(self.db, *self._role())
            if seen.holder is not None and not self.watch.stale(seen, now):
                return
            if not take_leader(self.db, *self._role(), self.me, self.lease_s, seen, requires=self.ts.config_key):
                read_topic_config(self.db, self.ts, snapshot=True)   # TopicNotFound: no role for it
                return
            log.info("%s maintains topic %s (the role was %s)", self.me, self.ts.name,
                     f"held by {seen.holder}, its beat still for {self.lease_s}s" if seen.holder else "free")
            self.holding, self.last_beat, self.next_pass = True, now, now
            self.watch.reset()
        elif not self._beat(now):
            return
        if now >= self.next_pass:
            self.run_pass(stop)

    def _role(self):
        return self.ks, self.ts.maintenance_role

    def _beat(self, now: float) -> bool:
        """Beat the role (every quarter lease); whether this still holds it."""
        if now - self.last_beat >= self.lease_s / 4:
            self.last_beat = now
            if not beat_leader(self.db, *self._role(), self.me):
                log.info("%s no longer maintains topic %s (taken over)", self.me, self.ts.name)
                self.holding, self._sweep = False, None
        return self.holding

    def run_pass(self, stop=None) -> int:
        """Run up to ``PASS_STEPS`` steps of the current sweep (``retention_steps`` then
        ``ttl_steps``, begun when the last one ended: a sweep spans passes), beating
        between them; returns what they removed. Schedules the next pass: at once while
        the sweep goes on ("behind"), else after the interval (backing off while
        sweeps remove nothing)."""
        if self._sweep is None:
            config = read_topic_config(self.db, self.ts, snapshot=True)
            self._sweep = chain(retention_steps(self.db, self.ts, config), ttl_steps(self.db, self.ts, config))
            self._swept = 0
        removed, behind = 0, True
        for _ in range(PASS_STEPS):
            n = next(self._sweep, None)
            if n is None:
                behind, self._sweep = False, None
                break
            removed += n
            self._swept += n
            if (stop is not None and stop.is_set()) or not self._beat(time.monotonic()):
                return removed
        now = time.monotonic()
        if not behind:
            self.interval = MIN_INTERVAL_S if self._swept else min(MAX_INTERVAL_S, self.interval * 2)
        self.next_pass = now if behind else now + self.interval
        record_maintenance_pass(self.db, self.ts, self.me, removed, behind)
        return removed

    def release(self):
        """Give the role up if held (the next candidate takes it at once)."""
        self._sweep = None
        if self.holding:
            self.holding = False
            release_leader(self.db, *self._role(), self.me)


class Maintenance:
    """This process's part in the maintenance of every topic of the database (or of
    ``topics``), for a service that runs no consumer of them (the broker): a
    :class:`Maintainer` per topic, named ``name`` (default host-pid-random), ticked by
    one thread of its own; the topic list is read again every ``REFRESH_S`` (a topic
    created or deleted since). ``lease_s``: how long a holder's beat must stand still
    before this process takes a topic's maintenance over. ``close()`` stops it and
    gives up what it holds.

    Example::

        m = fdq.Maintenance(db)     # ... m.close()
    """

    REFRESH_S = 5.0

    def __init__(self, db, *, name: str | None = None, topics=None, lease_s: float = MAINT_LEASE_S,
                 keyspace: Keyspace | None = None):
        if not (isinstance(lease_s, (int, float)) and lease_s > 0):
            raise ConfigError(f"lease_s must be seconds above 0, not {lease_s!r}")
        self.db, self.ks = db, keyspace or Keyspace()
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        self.topics = None if topics is None else set(topics)
        self.lease_s = lease_s
        self.maintainers = {}           # topic -> Maintainer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fdq-maintenance-{self.name}", daemon=True)
        self._thread.start()

    def _refresh(self):
        names = {name for name, _c in list_topics(self.db, self.ks)}
        if self.topics is not None:
            names &= self.topics
        for name in [n for n in self.maintainers if n not in names]:
            self.maintainers.pop(name).release()
        for name in names - set(self.maintainers):
            self.maintainers[name] = Maintainer(self.db, self.ks, self.ks.topic(name), self.name, self.lease_s)

    def _run(self):
        tick = min(MIN_INTERVAL_S, self.lease_s / 4)
        refreshed = None
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                try:
                    if refreshed is None or now - refreshed >= self.REFRESH_S:
                        self._refresh()
                        refreshed = now
                except Exception as e:      # the next tick tries again
                    log.warning("maintenance %s: listing topics: %s: %s", self.name, type(e).__name__, e)
                for name, m in list(self.maintainers.items()):
                    try:
                        m.tick(time.monotonic(), self._stop)
                    except Exception as e:  # the next tick tries again
                        log.warning("maintenance %s of %s: %s: %s", self.name, name, type(e).__name__, e)
                self._stop.wait(tick)
        finally:
            for m in self.maintainers.values():
                try:
                    m.release()
                except Exception as e:      # its beat stands still: another takes over
                    log.warning("maintenance %s: releasing %s: %s", self.name, m.ts.name, e)

    def close(self, timeout: float = 10.0):
        """Stop (after the step under way) and give up every topic held."""
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["Maintenance", "MAINT_LEASE_S", "Maintainer", "retention_steps", "ttl_steps", "MIN_INTERVAL_S",
           "MAX_INTERVAL_S", "PASS_STEPS"]
