"""Prometheus metrics of an FDQ database, for any service that embeds FDQ (needs the
``prometheus_client`` package: ``pip install 'fdq-queue[metrics]'``).

Example::

    import prometheus_client, fdq, fdq.metrics
    db = fdq.connect("sqlite:///var/lib/app/fdq.db")
    fdq.metrics.register(db)                    # into prometheus_client.REGISTRY
    prometheus_client.start_http_server(9100)

The collector reads the public API (``Supervisor.topics()``, ``Supervisor.stats(name)``)
at most once every ``cache_s`` seconds, so scrapes stay cheap, and yields per topic,
subscription and consumer:

======================================================  =======  ==========================================
``fdq_topic_inserted_messages_total``                   counter  messages pushed into the topic
``fdq_topic_inserted_bytes_total``                      counter  their bodies' bytes
``fdq_topic_trimmed_messages_total``                    counter  log entries retention deleted
``fdq_topic_log_bytes``                                 gauge    the "all" log's size now
``fdq_topic_pending_messages``                          gauge    pushed while paused, not yet routed
``fdq_topic_paused``, ``fdq_topic_shards``              gauge
``fdq_subscription_backlog_messages``                   gauge    ready or delayed, not settled
``fdq_subscription_in_flight_messages``                 gauge    delivered, not yet settled
``fdq_subscription_delayed_messages``                   gauge    waiting to be due
``fdq_subscription_oldest_ready_age_seconds``           gauge    lag: age of the oldest ready message
``fdq_subscription_delivered_messages_total``           counter  deliveries, redeliveries included
``fdq_subscription_acked_messages_total``               counter
``fdq_subscription_redelivered_messages_total``         counter  redeliveries queued (nak, lease expiry)
``fdq_subscription_dead_lettered_messages_total``       counter  sent to the dead-letter queue
``fdq_subscription_filtered_messages_total``            counter  dropped by the subscription's filter
``fdq_subscription_dead_letters``                       gauge    in the dead-letter queue now
``fdq_subscription_paused``                             gauge
``fdq_subscription_consumers{state}``                   gauge    live, zombie or unknown consumers
``fdq_subscription_standby_consumers``                  gauge    live ones owning no shard (all owned)
``fdq_consumer_heartbeat_age_seconds{consumer}``        gauge    (``consumer_labels=False``: left out)
``fdq_consumer_owned_shards{consumer}``                 gauge    (same)
``fdq_consumer_up{consumer}``                           gauge    1 live, 0 zombie (heartbeat older than its
                                                                 timeout); no series before its first
                                                                 heartbeat age is known (same)
======================================================  =======  ==========================================

Those database-wide families must be exported once, not once per process: with
``database_metrics=True`` (the default: a service that knows it is the only exporter)
this process exports them; with ``"leader"`` only the process holding the metrics
leadership does (``fdq.ops.leaders``: a record in the database whose holder beats; the
others take over after seeing the beat stand still for ``leader_timeout_s`` on their own
clocks, e.g. when it is killed); with ``False``, never. Every process exports
``fdq_metrics_leader`` (1 when it exports them: alert when the sum is 0),
``fdq_scrape_duration_seconds`` (its last read of the database) and
``fdq_scrape_errors_total`` (reads that failed: the scrape then has no database
families, rather than failing).

With ``process_metrics=True`` (the default) the collector also registers a hook
(:mod:`fdq.hooks`) timing every push and handler call of this process (any database):

=============================================================  =========  ==========================================
``fdq_push_duration_seconds{topic}``                           histogram  one per ``push``, ``push_async`` or
                                                                          ``push_many`` call and ``push_stream``
                                                                          transaction: its start to its commit
``fdq_pushed_messages_total{topic,outcome}``                   counter    messages: ``ok``, ``duplicate`` (its
                                                                          ``msg_id`` seen in the dedupe window),
                                                                          ``error``, ``cancelled`` (a
                                                                          ``push_async`` future: maybe stored)
``fdq_handler_duration_seconds{topic,subscription,outcome}``   histogram  one per ``fdq.tail``/``fdq.aio.tail``
                                                                          handler call (exactly-once: per attempt)
``fdq_handled_messages_total{topic,subscription,outcome}``     counter    handler calls: ``ack``, ``nak``,
                                                                          ``term``, ``ok`` (nothing to settle: at
                                                                          most once, exactly once), ``error`` (it
                                                                          raised)
``fdq_batch_handler_duration_seconds{topic,subscription,``     histogram  one per batch handler call
``outcome}``                                                              (``batch=True``): ``ok`` (it returned),
                                                                          ``error`` (it raised)
``fdq_batch_handled_messages_total{topic,subscription,``       counter    the messages of those calls, by their
``outcome}``                                                              call's outcome
=============================================================  =========  ==========================================

``process_metrics=False`` leaves them out (and registers no hook: a push then costs what
it costs without ``fdq.metrics``). ``close()`` unregisters the hook.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

from . import hooks
from .errors import ConfigError, TopicNotFound
from .keyspace import Keyspace
from .ops.leaders import Watch, beat_leader, read_leader, release_leader, take_leader
from .supervisor import Supervisor

try:
    from prometheus_client import REGISTRY, Counter, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError as e:        # the optional extra is not installed
    raise ConfigError("fdq.metrics needs the prometheus_client package: pip install 'fdq-queue[metrics]'") from e

log = logging.getLogger("fdq.metrics")

ROLE = "metrics"                # the leadership's name in the database (meta/leaders/metrics)
LEADER_TIMEOUT_S = 10.0         # a leader's beat standing still this long: another takes over
CACHE_S = 5.0
# seconds: a push commits in ~1 ms (embedded engine) to ~10 ms (FoundationDB); handlers vary more
PUSH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HANDLER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)


class FDQCollector(Collector):
    """The metrics of ``db`` (see the module). ``register`` makes one and registers it;
    ``close()`` stops it (it gives the leadership up at once, if it held it)."""

    def __init__(self, db, *, topics=None, database_metrics=True, consumer_labels: bool = True,
                 cache_s: float = CACHE_S, leader_timeout_s: float = LEADER_TIMEOUT_S,
                 keyspace: Keyspace | None = None, process_metrics: bool = True):
        if not (isinstance(database_metrics, bool) or database_metrics == "leader"):
            raise ConfigError(f"database_metrics must be True, False or 'leader', not {database_metrics!r}")
        if not leader_timeout_s > 0:
            raise ConfigError(f"leader_timeout_s must be > 0, not {leader_timeout_s!r}")
        self.db = db
        self.keyspace = keyspace or Keyspace()
        self.supervisor = Supervisor(db, keyspace=self.keyspace)
        self.topics = None if topics is None else set(topics)
        self.mode = database_metrics
        self.consumer_labels = consumer_labels
        self.cache_s = cache_s
        self.leader_timeout_s = leader_timeout_s
        self.id = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self.scrape_errors = 0
        self.scrape_seconds = 0.0
        self._registry = None
        self._cache = None          # (monotonic time read, [stats of each topic])
        self._read_lock = threading.Lock()
        self._lead_lock = threading.Lock()
        self._leader = False
        self._watch = Watch(leader_timeout_s)
        self._stop = threading.Event()
        self._thread = None
        self.process = ProcessMetrics() if process_metrics else None
        if self.process is not None:
            hooks.register(self.process)
        if database_metrics == "leader":
            self._thread = threading.Thread(target=self._lead, name="fdq-metrics-leader", daemon=True)
            self._thread.start()

    # -- leadership -----------------------------------------------------------------------

    def _lead(self):
        """Beat (holding the leadership) or watch the holder, every quarter timeout."""
        interval = self.leader_timeout_s / 4
        while True:
            self.leading()
            if self._stop.wait(interval):
                return

    def leading(self) -> bool:
        """Whether this process exports the database-wide families now. In ``"leader"``
        mode each call beats the leadership (held) or watches its holder (not held),
        taking it over when free or when its beat has stood still for the timeout."""
        if self.mode != "leader":
            return bool(self.mode)
        with self._lead_lock:
            if self._stop.is_set():
                return False
            try:
                if self._leader and beat_leader(self.db, self.keyspace, ROLE, self.id):
                    return True
                seen = read_leader(self.db, self.keyspace, ROLE)
                if seen.holder == self.id:
                    self._leader = beat_leader(self.db, self.keyspace, ROLE, self.id)
                elif seen.holder is None or self._watch.stale(seen, time.monotonic()):
                    self._leader = take_leader(self.db, self.keyspace, ROLE, self.id, self.leader_timeout_s, seen)
                    self._watch.reset()
                    if self._leader:
                        log.info("fdq metrics: %s exports the database-wide metrics (was %s)", self.id, seen.holder)
                else:
                    self._leader = False
            except Exception as e:      # the database unreachable: not leading (others may take over)
                log.debug("fdq metrics: leadership check failed: %s", e)
                self._leader = False
            return self._leader

    def close(self):
        """Stop: no more beats, the leadership released (if held), unregistered from the
        registry ``register`` put it in, the process metrics' hook unregistered."""
        self._stop.set()
        if self.process is not None:
            hooks.unregister(self.process)
        if self._thread is not None:
            self._thread.join(10)
        with self._lead_lock:
            if self._leader:
                try:
                    release_leader(self.db, self.keyspace, ROLE, self.id)
                except Exception as e:      # its beat stands still: another takes over after the timeout
                    log.debug("fdq metrics: releasing the leadership failed: %s", e)
                self._leader = False
        if self._registry is not None:
            try:
                self._registry.unregister(self)
            except KeyError:
                pass
            self._registry = None

    # -- reading ----------------------------------------------------------------------------

    def _read(self) -> list | None:
        """[stats] of the topics, read at most once every ``cache_s``; None (counted in
        ``fdq_scrape_errors_total``) when the database cannot be read."""
        with self._read_lock:
            now = time.monotonic()
            if self._cache is not None and now - self._cache[0] < self.cache_s:
                return self._cache[1]
            t0 = time.perf_counter()
            try:
                out = []
                for name, _config in self.supervisor.topics():
                    if self.topics is not None and name not in self.topics:
                        continue
                    try:
                        out.append(self.supervisor.stats(name))
                    except TopicNotFound:       # deleted since the list was read
                        continue
            except Exception as e:
                self.scrape_errors += 1
                self._cache = None
                log.warning("fdq metrics: reading the database failed: %s: %s", type(e).__name__, e)
                return None
            finally:
                self.scrape_seconds = time.perf_counter() - t0
            self._cache = (now, out)
            return out

    # -- prometheus_client's Collector ----------------------------------------------------------

    def describe(self):
        """Every family's name (for the registry's duplicate check), without reading."""
        yield from self._own(0)
        yield from _database_families([], self.consumer_labels)
        if self.process is not None:
            yield from self.process.collect()

    def collect(self):
        leader = self.leading()
        topics = self._read() if leader else None
        yield from self._own(1 if leader else 0)
        if topics is not None:
            yield from _database_families(topics, self.consumer_labels)
        if self.process is not None:
            yield from self.process.collect()

    def _own(self, leader: int) -> list:
        g = GaugeMetricFamily("fdq_metrics_leader",
                              "1 if this process exports the database-wide fdq_topic_*, fdq_subscription_* and "
                              "fdq_consumer_* families (one process of those serving metrics does)", value=leader)
        d = GaugeMetricFamily("fdq_scrape_duration_seconds", "Seconds the last read of the database's stats took",
                              value=self.scrape_seconds)
        e = CounterMetricFamily("fdq_scrape_errors", "Reads of the database's stats that failed",
                                value=self.scrape_errors)
        return [g, d, e]


class ProcessMetrics(hooks.Hook):
    """The hook behind the process metrics (see the module): histograms and counters of
    this process's pushes and handler calls, in no registry (``collect()`` yields them).
    Each label set's children are looked up once and kept (``labels()`` takes a lock and
    builds a tuple each call)."""

    def __init__(self):
        self.push_seconds = Histogram(
            "fdq_push_duration_seconds", "Seconds a push call (push_stream: a transaction) took to commit",
            ["topic"], buckets=PUSH_BUCKETS, registry=None)
        self.pushed = Counter(
            "fdq_pushed_messages", "Messages pushed by this process, by outcome (ok, duplicate, error, cancelled)",
            ["topic", "outcome"], registry=None)
        self.handler_seconds = Histogram(
            "fdq_handler_duration_seconds", "Seconds a tail handler call took, by outcome",
            ["topic", "subscription", "outcome"], buckets=HANDLER_BUCKETS, registry=None)
        self.handled = Counter(
            "fdq_handled_messages", "Handler calls of this process's tails, by outcome "
            "(ack, nak, term, ok: nothing to settle, error: it raised)",
            ["topic", "subscription", "outcome"], registry=None)
        self.batch_seconds = Histogram(
            "fdq_batch_handler_duration_seconds", "Seconds a tail's batch handler call took, by outcome",
            ["topic", "subscription", "outcome"], buckets=HANDLER_BUCKETS, registry=None)
        self.batch_handled = Counter(
            "fdq_batch_handled_messages", "Messages given to batch handler calls of this process's tails, "
            "by the call's outcome (ok: it returned, error: it raised)",
            ["topic", "subscription", "outcome"], registry=None)
        self._push = {}         # topic: its histogram's child
        self._pushed = {}       # (topic, outcome): counter child
        self._handle = {}       # (topic, subscription, outcome): (histogram child, counter child)
        self._batch = {}        # the same, of batch handler calls

    def __repr__(self):
        return "fdq.metrics.ProcessMetrics()"

    def collect(self):
        for metric in (self.push_seconds, self.pushed, self.handler_seconds, self.handled, self.batch_seconds,
                       self.batch_handled):
            yield from metric.collect()

    def _count(self, topic: str, outcome: str, n: int):
        child = self._pushed.get((topic, outcome))
        if child is None:
            child = self._pushed[(topic, outcome)] = self.pushed.labels(topic, outcome)
        child.inc(n)

    def push_end(self, state, topic: str, envelopes: list, results, error, seconds: float):
        child = self._push.get(topic)
        if child is None:
            child = self._push[topic] = self.push_seconds.labels(topic)
        child.observe(seconds)
        if results:
            duplicates = sum(1 for r in results if r.duplicate)
            if duplicates:
                self._count(topic, "duplicate", duplicates)
            if len(results) > duplicates:
                self._count(topic, "ok", len(results) - duplicates)
        elif error is not None:
            self._count(topic, "error", len(envelopes))
        elif results is None:       # a push_async future cancelled before its commit
            self._count(topic, "cancelled", len(envelopes))

    def handle_end(self, state, message, outcome: str, error, seconds: float):
        key = (message.topic, message.subscription, outcome)
        children = self._handle.get(key)
        if children is None:
            children = self._handle[key] = (self.handler_seconds.labels(*key), self.handled.labels(*key))
        children[0].observe(seconds)
        children[1].inc()

    def handle_batch_end(self, state, messages: list, outcome: str, error, seconds: float):
        key = (messages[0].topic, messages[0].subscription, outcome)
        children = self._batch.get(key)
        if children is None:
            children = self._batch[key] = (self.batch_seconds.labels(*key), self.batch_handled.labels(*key))
        children[0].observe(seconds)
        children[1].inc(len(messages))


def _database_families(topics: list, consumer_labels: bool) -> list:
    """The database-wide families of ``topics`` (each a ``Supervisor.stats``)."""
    now_ms = time.time() * 1000
    tl, sl, cl = ["topic"], ["topic", "subscription"], ["topic", "subscription", "consumer"]
    fam = {}

    def family(kind, name, doc, labels):
        fam[name] = kind(name, doc, labels=labels)

    family(CounterMetricFamily, "fdq_topic_inserted_messages", "Messages pushed into the topic", tl)
    family(CounterMetricFamily, "fdq_topic_inserted_bytes", "Bytes of the bodies pushed into the topic", tl)
    family(CounterMetricFamily, "fdq_topic_trimmed_messages", "Log entries deleted by retention", tl)
    family(GaugeMetricFamily, "fdq_topic_log_bytes", "Size of the topic's log now", tl)
    family(GaugeMetricFamily, "fdq_topic_pending_messages", "Messages pushed while paused, not yet routed", tl)
    family(GaugeMetricFamily, "fdq_topic_paused", "1 if the topic is paused", tl)
    family(GaugeMetricFamily, "fdq_topic_shards", "Shards of the topic", tl)
    family(GaugeMetricFamily, "fdq_subscription_backlog_messages", "Messages ready or delayed, not yet settled", sl)
    family(GaugeMetricFamily, "fdq_subscription_in_flight_messages", "Messages delivered, not yet settled", sl)
    family(GaugeMetricFamily, "fdq_subscription_delayed_messages", "Messages waiting to be due", sl)
    family(GaugeMetricFamily, "fdq_subscription_oldest_ready_age_seconds",
           "Age of the oldest ready message (the subscription's lag; 0 when none is ready)", sl)
    family(CounterMetricFamily, "fdq_subscription_delivered_messages", "Deliveries, redeliveries included", sl)
    family(CounterMetricFamily, "fdq_subscription_acked_messages", "Messages acknowledged", sl)
    family(CounterMetricFamily, "fdq_subscription_redelivered_messages",
           "Messages queued again for delivery (nak, lease expiry)", sl)
    family(CounterMetricFamily, "fdq_subscription_dead_lettered_messages", "Messages sent to the dead-letter queue", sl)
    family(CounterMetricFamily, "fdq_subscription_filtered_messages", "Messages dropped by the subscription's filter", sl)
    family(GaugeMetricFamily, "fdq_subscription_dead_letters", "Messages in the dead-letter queue now", sl)
    family(GaugeMetricFamily, "fdq_subscription_paused", "1 if the subscription is paused", sl)
    family(GaugeMetricFamily, "fdq_subscription_consumers",
           "Registered consumers by state (zombie: heartbeat older than its timeout; unknown: no age yet)",
           sl + ["state"])
    family(GaugeMetricFamily, "fdq_subscription_standby_consumers",
           "Consumers owning no shard because every shard has a live owner (more shards: rebalance)", sl)
    if consumer_labels:
        family(GaugeMetricFamily, "fdq_consumer_heartbeat_age_seconds",
               "Seconds since the consumer's last heartbeat (as of the last read)", cl)
        family(GaugeMetricFamily, "fdq_consumer_owned_shards", "Shards the consumer owns", cl)
        family(GaugeMetricFamily, "fdq_consumer_up",
               "1 if the consumer is live, 0 if a zombie (its heartbeat older than its timeout)", cl)
    for st in topics:
        t, c, cfg = st["topic"], st["counters"], st["config"]
        fam["fdq_topic_inserted_messages"].add_metric([t], c["inserted"])
        fam["fdq_topic_inserted_bytes"].add_metric([t], c["inserted_bytes"])
        fam["fdq_topic_trimmed_messages"].add_metric([t], c["trimmed"])
        fam["fdq_topic_log_bytes"].add_metric([t], c["log_bytes"])
        fam["fdq_topic_pending_messages"].add_metric([t], c["pending"])
        fam["fdq_topic_paused"].add_metric([t], 1 if cfg.get("paused") else 0)
        fam["fdq_topic_shards"].add_metric([t], cfg.get("shards") or 0)
        for sub, s in sorted(st["subscriptions"].items()):
            ls = [t, sub]
            shards = s["shards"]
            oldest = s["oldest_ready_ms"]
            fam["fdq_subscription_backlog_messages"].add_metric(ls, s["backlog"])
            fam["fdq_subscription_in_flight_messages"].add_metric(ls, s["in_flight"])
            fam["fdq_subscription_delayed_messages"].add_metric(ls, s["delayed"])
            # now, not as of the read (the cache may be a few seconds old): stats' lag_ms
            fam["fdq_subscription_oldest_ready_age_seconds"].add_metric(
                ls, max(0.0, now_ms - oldest) / 1000 if oldest is not None else 0.0)
            fam["fdq_subscription_delivered_messages"].add_metric(ls, s["emitted"])
            fam["fdq_subscription_acked_messages"].add_metric(ls, s["acked"])
            fam["fdq_subscription_redelivered_messages"].add_metric(ls, sum(x["requeued"] for x in shards))
            fam["fdq_subscription_dead_lettered_messages"].add_metric(ls, sum(x["dead"] for x in shards))
            fam["fdq_subscription_filtered_messages"].add_metric(ls, s["filtered"])
            fam["fdq_subscription_dead_letters"].add_metric(ls, s["dlq"])
            fam["fdq_subscription_paused"].add_metric(ls, 1 if s["paused"] else 0)
            states = {"live": 0, "zombie": 0, "unknown": 0}
            for con in s["consumers"]:
                states["unknown" if con["zombie"] is None else "zombie" if con["zombie"] else "live"] += 1
                if consumer_labels:
                    lc = ls + [con["id"]]
                    if con["heartbeat_age_s"] is not None:
                        fam["fdq_consumer_heartbeat_age_seconds"].add_metric(lc, con["heartbeat_age_s"])
                    fam["fdq_consumer_owned_shards"].add_metric(lc, len(con["tag_shards"]))
                    if con["zombie"] is not None:
                        fam["fdq_consumer_up"].add_metric(lc, 0 if con["zombie"] else 1)
            for state, n in states.items():
                fam["fdq_subscription_consumers"].add_metric(ls + [state], n)
            fam["fdq_subscription_standby_consumers"].add_metric(ls, s["standby"])
    return list(fam.values())


def register(db, registry=REGISTRY, *, topics=None, database_metrics=True, consumer_labels: bool = True,
             cache_s: float = CACHE_S, leader_timeout_s: float = LEADER_TIMEOUT_S,
             keyspace: Keyspace | None = None, process_metrics: bool = True) -> FDQCollector:
    """Register the metrics of ``db`` in ``registry`` (default: prometheus_client's
    global one) and return the collector (``close()`` it to stop).

    ``topics``: names to export (default every topic); ``database_metrics``: True (this
    process exports the database-wide families), ``"leader"`` (only while it holds the
    metrics leadership: several processes serving metrics of one database) or False;
    ``consumer_labels``: export the per-consumer families (one series per consumer id);
    ``cache_s``: the longest a scrape reuses the last read of the database;
    ``leader_timeout_s``: how long the leader's beat may stand still before another
    process takes over (it beats every quarter of it); ``process_metrics``: also time
    and count this process's pushes and handler calls (``fdq_push_duration_seconds``,
    ``fdq_pushed_messages_total``, ``fdq_handler_duration_seconds``,
    ``fdq_handled_messages_total``), through a hook (``fdq.hooks``)."""
    collector = FDQCollector(db, topics=topics, database_metrics=database_metrics, consumer_labels=consumer_labels,
                             cache_s=cache_s, leader_timeout_s=leader_timeout_s, keyspace=keyspace,
                             process_metrics=process_metrics)
    try:
        registry.register(collector)
    except Exception:
        collector.close()
        raise
    collector._registry = registry
    return collector


__all__ = ["FDQCollector", "ProcessMetrics", "register", "ROLE", "LEADER_TIMEOUT_S", "PUSH_BUCKETS",
           "HANDLER_BUCKETS"]
