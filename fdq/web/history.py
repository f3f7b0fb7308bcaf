"""The dashboard's memory: every topic's stats sampled every ``interval_s`` and kept for
``keep_s``, so the charts show the last minutes as soon as a page opens; rates are the
counters' differences between samples; ``events`` are what changed between two samples
(consumers joining, leaving, turning zombie; shards moving), for people to read.

Everything here is computed from ``Supervisor.topics`` and ``Supervisor.stats``; the
figures are for display (liveness and ownership are decided by the consumers, not here).
"""
from __future__ import annotations

import collections
import logging
import threading
import time

from ..errors import TopicNotFound
from .rows import consumer_state

log = logging.getLogger("fdq.web")
MAX_EVENTS = 100        # per topic, newest kept


class _Topic:
    __slots__ = ("samples", "events", "last_mono", "last_counters", "owners", "consumers")

    def __init__(self, keep: int):
        self.samples = collections.deque(maxlen=keep)
        self.events = collections.deque(maxlen=MAX_EVENTS)
        self.last_mono = None
        self.last_counters = None
        self.owners = None          # {(sub, tag, shard): owner} of the last sample
        self.consumers = None       # {(sub, id): state}


class History:
    """Samples of every topic's stats. ``start()`` runs the sampler thread,
    ``close()`` stops it; ``record`` takes one topic's stats (the thread's step, and
    tests'). Thread-safe."""

    def __init__(self, supervisor, *, interval_s: float = 1.0, keep_s: float = 600.0):
        self.supervisor = supervisor
        self.interval_s = interval_s
        self.keep_s = keep_s
        self._keep = max(2, int(keep_s / interval_s) + 1)
        self._topics = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    # -- sampling -----------------------------------------------------------------------

    def start(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fdq-web-history", daemon=True)
            self._thread.start()

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self):
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.sample_all()
            except Exception as e:      # the database away for a moment, or any other failure of
                # one round (an engine's own error type, say): the charts go on with the next
                log.warning("sampling stats failed: %s: %s", type(e).__name__, e)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def sample_all(self):
        present = set()
        for name, _config in self.supervisor.topics():
            try:
                self.record(name, self.supervisor.stats(name))
            except TopicNotFound:        # deleted since it was listed
                continue
            present.add(name)
        with self._lock:
            for gone in set(self._topics) - present:
                del self._topics[gone]

    def record(self, name: str, stats: dict, now_mono: float | None = None, now_ms: int | None = None):
        """Add one sample of topic ``name`` from its ``stats`` (``Supervisor.stats``)."""
        now_mono = time.monotonic() if now_mono is None else now_mono
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        counters = stats["counters"]
        subs = stats["subscriptions"]
        with self._lock:
            t = self._topics.get(name)
            if t is None:
                t = self._topics[name] = _Topic(self._keep)
            rates = {"inserted_per_s": None, "acked_per_s": None}
            if t.last_mono is not None and now_mono > t.last_mono:
                dt = now_mono - t.last_mono
                for k in ("inserted", "acked"):
                    d = counters[k] - t.last_counters[k]
                    rates[f"{k}_per_s"] = d / dt if d >= 0 else None    # < 0: the topic was recreated
            t.last_mono, t.last_counters = now_mono, {k: counters[k] for k in ("inserted", "acked")}
            t.samples.append({
                "time_ms": now_ms,
                "inserted": counters["inserted"], "acked": counters["acked"], **rates,
                "backlog": sum(s["backlog"] for s in subs.values()),
                "lag_s": max((s["lag_ms"] for s in subs.values()), default=0) / 1000,
                "subscriptions": {sub: {"backlog": s["backlog"], "in_flight": s["in_flight"],
                                        "lag_s": s["lag_ms"] / 1000} for sub, s in subs.items()},
            })
            self._diff(t, subs, now_ms)

    def _diff(self, t: _Topic, subs: dict, now_ms: int):
        owners = {(sub, sh["tag"], sh["shard"]): sh["owner"] for sub, s in subs.items() for sh in s["shards"]}
        consumers = {(sub, c["id"]): (consumer_state(c), c.get("heartbeat_age_s"))
                     for sub, s in subs.items() for c in s["consumers"]}
        first = t.owners is None
        before_owners, before_consumers = t.owners or {}, t.consumers or {}
        t.owners, t.consumers = owners, {k: v[0] for k, v in consumers.items()}
        if first:
            return

        def event(kind, sub, text, **extra):
            t.events.append({"time_ms": now_ms, "kind": kind, "subscription": sub, "text": text, **extra})

        for (sub, cid), (state, age) in sorted(consumers.items()):
            was = before_consumers.get((sub, cid))
            if was is None:
                event("joined", sub, f"{cid} joined {sub}", consumer=cid)
            elif state == "zombie" and was != "zombie":
                event("zombie", sub, f"{cid} is a zombie: heartbeat {age:.1f} s old", consumer=cid)
        for (sub, cid), was in sorted(before_consumers.items()):
            if (sub, cid) not in consumers:
                how = "was taken over (zombie)" if was == "zombie" else "left"
                event("left", sub, f"{cid} {how}", consumer=cid)
        moves = {}
        for key, owner in owners.items():
            old = before_owners.get(key, owner)
            if old != owner:
                moves.setdefault((key[0], old, owner), []).append(key[2] if not key[1] else f"{key[1]}/{key[2]}")
        for (sub, old, new), shards in sorted(moves.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), str(kv[0][2]))):
            listed = ", ".join(map(str, shards))
            event("moved", sub, f"{sub}: shard{'s' if len(shards) > 1 else ''} {listed} "
                                f"{old or 'unowned'} → {new or 'unowned'}", shards=shards,
                  source=old, target=new)

    # -- reading ------------------------------------------------------------------------

    def samples(self, name: str, since_ms: int | None = None) -> list:
        """The samples of ``name`` (oldest first), those after ``since_ms`` if given."""
        with self._lock:
            t = self._topics.get(name)
            out = list(t.samples) if t is not None else []
        return out if since_ms is None else [s for s in out if s["time_ms"] > since_ms]

    def rates(self, name: str) -> dict:
        with self._lock:
            t = self._topics.get(name)
            last = t.samples[-1] if t is not None and t.samples else {}
        return {k: last.get(k) for k in ("inserted_per_s", "acked_per_s")}

    def events(self, name: str) -> list:
        """What changed, newest first."""
        with self._lock:
            t = self._topics.get(name)
            return list(reversed(t.events)) if t is not None else []


__all__ = ["History", "MAX_EVENTS"]
