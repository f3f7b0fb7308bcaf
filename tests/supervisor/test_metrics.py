"""``fdq.metrics``: a prometheus_client collector of the database, scraped with
``generate_latest`` and parsed with prometheus_client's own parser: its values are
``Supervisor.stats``'s; the database-wide families come from one process in leader
mode; the process metrics (push and handler durations, pushed and handled messages by
outcome) count what this process pushed and handled; without prometheus_client, a
ConfigError naming the extra."""
from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import fdq
import fdq.aio
import fdq.hooks
import fdq.metrics
from fdq.keyspace import Keyspace

from fdqtest import FAST, fetch_until, wait_for


def scrape(registry) -> dict:
    """{(sample name, frozenset of labels): value} of one scrape."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())))


def names(samples) -> set:
    return {name for name, _labels in samples}


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture(autouse=True)
def no_metrics_hook_left():
    """A collector a test leaves open keeps its hook registered in the worker process:
    unregistered after each test (through the hook module's public calls)."""
    yield
    for hook in fdq.hooks.registered():
        if isinstance(hook, fdq.metrics.ProcessMetrics):
            fdq.hooks.unregister(hook)


def test_scraped_backlog_lag_in_flight_redeliveries_and_dead_letters_equal_stats(db, registry):
    sup = fdq.Supervisor(db)
    sup.create_topic("orders", shards=2)
    p = fdq.Producer(db)
    for i in range(10):
        p.push("orders", b"m%d" % i)
    p.push("orders", b"later", delay=3600)
    collector = fdq.metrics.register(db, registry, cache_s=0)
    with fdq.Consumer(db, "orders", config=FAST) as c:
        got = fetch_until(c, lambda g: len(g) >= 10)
        for m in got[:3]:
            m.ack()
        for m in got[3:5]:
            m.nak()                     # queued again: redeliveries
        for m in got[5:7]:
            m.term("bad")               # dead letters
        # got[7:] stay in flight
        wait_for(lambda: sup.stats("orders")["subscriptions"]["default"]["consumers"][0]["heartbeat_age_s"]
                 is not None, what="a heartbeat's age")
        before = time.time()
        st = sup.stats("orders")
        samples = scrape(registry)
        after = time.time()
        s = st["subscriptions"]["default"]
        lab = {"topic": "orders", "subscription": "default"}
        assert value(samples, "fdq_metrics_leader") == 1
        assert value(samples, "fdq_subscription_backlog_messages", **lab) == s["backlog"] == 6
        assert value(samples, "fdq_subscription_in_flight_messages", **lab) == s["in_flight"] == 3
        assert value(samples, "fdq_subscription_delayed_messages", **lab) == s["delayed"] == 1
        assert value(samples, "fdq_subscription_dead_letters", **lab) == s["dlq"] == 2
        redelivered = sum(x["requeued"] for x in s["shards"])
        assert value(samples, "fdq_subscription_redelivered_messages_total", **lab) == redelivered == 2
        assert value(samples, "fdq_subscription_dead_lettered_messages_total", **lab) == 2
        assert value(samples, "fdq_subscription_acked_messages_total", **lab) == s["acked"] == 3
        assert value(samples, "fdq_subscription_delivered_messages_total", **lab) == s["emitted"]
        # the lag: stats' lag_ms, as of the scrape (stats read it a moment before)
        lag = value(samples, "fdq_subscription_oldest_ready_age_seconds", **lab)
        assert s["lag_ms"] > 0
        assert s["lag_ms"] / 1000 - 0.002 <= lag <= s["lag_ms"] / 1000 + (after - before) + 0.002
        assert value(samples, "fdq_topic_inserted_messages_total", topic="orders") == st["counters"]["inserted"] == 11
        assert value(samples, "fdq_topic_log_bytes", topic="orders") == st["counters"]["log_bytes"] > 0
        assert value(samples, "fdq_subscription_consumers", **lab, state="live") == 1
        assert value(samples, "fdq_subscription_consumers", **lab, state="zombie") == 0
        assert value(samples, "fdq_consumer_owned_shards", **lab, consumer=c.id) == 2
        assert value(samples, "fdq_consumer_heartbeat_age_seconds", **lab, consumer=c.id) is not None
        assert value(samples, "fdq_consumer_up", **lab, consumer=c.id) == 1
        assert value(samples, "fdq_scrape_errors_total") == 0
    collector.close()
    assert "fdq_metrics_leader" not in names(scrape(registry))     # unregistered


def test_without_consumer_labels_no_series_names_a_consumer(db, registry):
    fdq.Producer(db).push("t", b"x")
    with fdq.Consumer(db, "t", config=FAST) as c:
        c.fetch(1, timeout=5)
        wait_for(lambda: fdq.Supervisor(db).stats("t")["subscriptions"]["default"]["consumers"][0]["zombie"]
                 is False, what="a heartbeat's age")
        fdq.metrics.register(db, registry, cache_s=0, consumer_labels=False)
        samples = scrape(registry)
    assert value(samples, "fdq_subscription_consumers", topic="t", subscription="default", state="live") == 1
    assert not any(n.startswith("fdq_consumer_") for n in names(samples))


def test_consumers_beyond_the_shard_count_are_standby(db, registry):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    with fdq.Consumer(db, "t", config=FAST) as a, fdq.Consumer(db, "t", config=FAST) as b:
        a.fetch(1, timeout=0.5)
        b.fetch(1, timeout=0.5)
        wait_for(lambda: sup.stats("t")["subscriptions"]["default"]["standby"] == 1, what="one on standby")
        fdq.metrics.register(db, registry, cache_s=0)
        samples = scrape(registry)
    lab = {"topic": "t", "subscription": "default"}
    assert value(samples, "fdq_subscription_standby_consumers", **lab) == 1
    owned = sorted(value(samples, "fdq_consumer_owned_shards", **lab, consumer=c.id) for c in (a, b))
    assert owned == [0, 1]


ZOMBIE = """
import sys, time, fdq
c = fdq.Consumer(fdq.connect(sys.argv[1]), "t", consumer_id="doomed",
                 config=fdq.ConsumerConfig(heartbeat_interval_s=0.2, zombie_timeout_s=1.0))
print("ready", flush=True)
time.sleep(120)
"""


def test_consumer_up_is_1_for_a_live_consumer_and_0_for_a_killed_one(db, url, registry, tmp_path):
    """Consumer liveness: ``fdq_consumer_up`` per consumer, as stats' zombie mark (a
    consumer killed with no peer left to declare it stays registered: 0, not 1)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    script = tmp_path / "consumer.py"
    script.write_text(ZOMBIE)
    p = subprocess.Popen([sys.executable, str(script), url], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"ready\n"
        fdq.metrics.register(db, registry, cache_s=0)
        lab = {"topic": "t", "subscription": "default", "consumer": "doomed"}
        wait_for(lambda: value(scrape(registry), "fdq_consumer_up", **lab) == 1, 30, "doomed up")
        p.kill()
        p.wait(30)
        wait_for(lambda: value(scrape(registry), "fdq_consumer_up", **lab) == 0, 30, "doomed down")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    samples = scrape(registry)
    assert value(samples, "fdq_subscription_consumers", topic="t", subscription="default", state="zombie") == 1


def test_a_scrape_within_the_cache_time_reads_the_database_once(db, registry):
    p = fdq.Producer(db)
    p.push("t", b"1")
    fdq.metrics.register(db, registry, cache_s=3600)
    assert value(scrape(registry), "fdq_topic_inserted_messages_total", topic="t") == 1
    p.push("t", b"2")
    assert value(scrape(registry), "fdq_topic_inserted_messages_total", topic="t") == 1
    fresh = CollectorRegistry()
    fdq.metrics.register(db, fresh, cache_s=0)
    assert value(scrape(fresh), "fdq_topic_inserted_messages_total", topic="t") == 2


def test_topics_option_exports_only_those_topics(db, registry):
    p = fdq.Producer(db)
    p.push("a", b"1")
    p.push("b", b"1")
    fdq.metrics.register(db, registry, topics=["b"], cache_s=0)
    samples = scrape(registry)
    assert value(samples, "fdq_topic_inserted_messages_total", topic="b") == 1
    assert value(samples, "fdq_topic_inserted_messages_total", topic="a") is None


def test_a_database_that_cannot_be_read_counts_an_error_and_the_scrape_still_answers(db, registry):
    fdq.Producer(db).push("t", b"1")
    fdq.metrics.register(db, registry, cache_s=0)

    @fdq.transactional
    def damage(tr):
        tr[Keyspace().topic("t").config_key] = b"\xc1"     # not msgpack
    damage(db)
    samples = scrape(registry)
    assert value(samples, "fdq_scrape_errors_total") == 1
    assert value(samples, "fdq_metrics_leader") == 1
    assert not any(n.startswith(("fdq_topic_", "fdq_subscription_")) for n in names(samples))


def test_database_metrics_false_exports_only_this_process_figures(db, registry):
    fdq.Producer(db).push("t", b"1")
    fdq.metrics.register(db, registry, database_metrics=False)
    samples = scrape(registry)
    assert value(samples, "fdq_metrics_leader") == 0
    assert not any(n.startswith(("fdq_topic_", "fdq_subscription_")) for n in names(samples))


def test_in_leader_mode_one_collector_exports_the_database_and_another_takes_over_when_it_stops(db):
    fdq.Producer(db).push("t", b"1")
    regs = [CollectorRegistry(), CollectorRegistry()]
    collectors = [fdq.metrics.register(db, r, database_metrics="leader", leader_timeout_s=1.0, cache_s=0)
                  for r in regs]
    try:
        def leaders():
            scraped = [scrape(r) for r in regs]
            flags = [value(s, "fdq_metrics_leader") for s in scraped]
            with_db = [value(s, "fdq_topic_inserted_messages_total", topic="t") is not None for s in scraped]
            assert with_db == [f == 1 for f in flags]     # the families with the flag, never without
            return flags
        flags = wait_for(lambda: (lambda f: f if sorted(f) == [0, 1] else None)(leaders()), timeout=30,
                         what="one leader")
        for _ in range(5):
            assert leaders() == flags                   # it stays with the one that holds it
        leader = flags.index(1)
        collectors[leader].close()                      # released: the other takes it without the timeout
        other = 1 - leader
        wait_for(lambda: value(scrape(regs[other]), "fdq_metrics_leader") == 1, timeout=30, what="the takeover")
    finally:
        for c in collectors:
            c.close()


def test_database_metrics_refuses_an_unknown_mode(db):
    with pytest.raises(fdq.ConfigError, match="database_metrics must be True, False or 'leader'"):
        fdq.metrics.register(db, CollectorRegistry(), database_metrics="always")


def test_without_prometheus_client_fdq_metrics_names_the_extra_to_install():
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "try:\n    import fdq.metrics\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == ("ConfigError fdq.metrics needs the prometheus_client package: "
                                  "pip install 'fdq-queue[metrics]'"), out.stderr


# -- the process metrics: this process's pushes and handler calls ---------------------------

def counts(samples, name, **labels) -> dict:
    """{outcome: value} of ``name``'s samples with ``labels``."""
    out = {}
    for (n, labs), v in samples.items():
        labs = dict(labs)
        if n == name and all(labs.get(k) == w for k, w in labels.items()):
            out[labs["outcome"]] = v
    return out


def test_push_durations_and_pushed_messages_count_every_push_call_and_message_by_outcome(db, registry):
    fdq.metrics.register(db, registry)
    p = fdq.Producer(db)
    p.push("t", b"a")
    p.push("t", b"b", msg_id="dup")
    p.push("t", b"b", msg_id="dup")                                         # deduplicated
    p.push_async("t", b"c").result(timeout=30)
    p.push_many("t", [fdq.Envelope(b"m%d" % i) for i in range(4)])         # one call, 4 messages
    stream = list(p.push_stream("t", (fdq.Envelope(b"s%d" % i) for i in range(5)), max_messages=2))
    assert [len(r) for r in stream] == [2, 2, 1]                            # three transactions
    strict = fdq.Producer(db, config=fdq.ProducerConfig(auto_create=False))
    with pytest.raises(fdq.TopicNotFound):
        strict.push("missing", b"x")
    with pytest.raises(fdq.TopicNotFound):
        strict.push_many("missing", [fdq.Envelope(b"x"), fdq.Envelope(b"y")])
    lingering = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=3000))
    future = lingering.push_async("t", b"cancelled")
    assert future.cancel()                  # before its commit (3 s linger): may still be stored
    samples = scrape(registry)
    assert counts(samples, "fdq_pushed_messages_total", topic="t") == {"ok": 1 + 1 + 1 + 4 + 5, "duplicate": 1,
                                                                        "cancelled": 1}
    assert counts(samples, "fdq_pushed_messages_total", topic="missing") == {"error": 1 + 2}
    # one observation per call (push_stream: per transaction), whatever its outcome
    assert value(samples, "fdq_push_duration_seconds_count", topic="t") == 3 + 1 + 1 + 3 + 1
    assert value(samples, "fdq_push_duration_seconds_count", topic="missing") == 2
    assert value(samples, "fdq_push_duration_seconds_bucket", topic="t", le="+Inf") == 9
    assert value(samples, "fdq_push_duration_seconds_sum", topic="t") > 0
    lingering.flush(30)


def _kind(m) -> str:
    return m.body.split(b"-")[0].decode()


KINDS = {"plain": 2, "slow": 2, "nak": 2, "term": 2, "error": 2}
SLOW_S = 0.06


def push_kinds(db, topic):
    p = fdq.Producer(db)
    for kind, n in KINDS.items():
        for i in range(n):
            p.push(topic, f"{kind}-{i}".encode())


def handled_as_tallied(registry, tally, lock, topic, expected):
    """Wait until the handlers' own tally holds ``expected`` (at least) and the scraped
    counters equal it; returns the scrape."""
    def done():
        with lock:
            now = dict(tally)
        if any(now.get(k, 0) < n for k, n in expected.items()):
            return None
        samples = scrape(registry)
        return samples if counts(samples, "fdq_handled_messages_total", topic=topic) == now else None
    return wait_for(done, timeout=60, what=f"handled {expected}")


def check_histograms(samples, topic, tally):
    """Each outcome's histogram count equals its counter; the slow handlers (ack or ok)
    lie above the 0.05 s bucket."""
    lab = {"topic": topic, "subscription": "default"}
    for outcome, n in tally.items():
        assert value(samples, "fdq_handler_duration_seconds_count", **lab, outcome=outcome) == n, outcome
        assert value(samples, "fdq_handler_duration_seconds_bucket", **lab, outcome=outcome, le="+Inf") == n
    slow = "ok" if "ok" in tally else "ack"
    assert value(samples, "fdq_handler_duration_seconds_bucket", **lab, outcome=slow, le="0.05") \
        <= tally[slow] - KINDS["slow"]
    assert value(samples, "fdq_handler_duration_seconds_sum", **lab, outcome=slow) >= KINDS["slow"] * SLOW_S


def test_handled_messages_and_durations_by_outcome_at_least_once(db, registry):
    push_kinds(db, "t")
    fdq.metrics.register(db, registry)
    tally, lock = collections.Counter(), threading.Lock()

    def handler(m):
        kind = _kind(m)
        if kind == "slow":
            time.sleep(SLOW_S)
        first = m.attempts == 1
        if kind == "error" and first:
            with lock:
                tally["error"] += 1
            raise ValueError("first attempt fails")
        outcome = "nak" if kind == "nak" and first else "term" if kind == "term" else "ack"
        with lock:
            tally[outcome] += 1
        if outcome == "nak":
            m.nak()
        elif outcome == "term":
            m.term("bad")
        # else: returned: acked

    t = fdq.tail(db, "t", handler, config=FAST, on_error=lambda e: None)
    try:
        expected = {"ack": 2 + 2 + 2 + 2, "nak": 2, "term": 2, "error": 2}    # nak'd, failed: acked next time
        samples = handled_as_tallied(registry, tally, lock, "t", expected)
    finally:
        t.shutdown()
    assert dict(tally) == expected
    check_histograms(samples, "t", tally)


def test_handled_messages_and_durations_by_outcome_at_most_once(db, registry):
    push_kinds(db, "t")
    fdq.metrics.register(db, registry)
    tally, lock = collections.Counter(), threading.Lock()

    def handler(m):
        kind = _kind(m)
        if kind == "slow":
            time.sleep(SLOW_S)
        with lock:
            tally["error" if kind == "error" else "ok"] += 1
        if kind == "error":
            raise ValueError("gone anyway")

    t = fdq.tail(db, "t", handler, acking=False, config=FAST, on_error=lambda e: None)
    try:
        expected = {"ok": 8, "error": 2}                    # at most once: nothing to settle, no second try
        samples = handled_as_tallied(registry, tally, lock, "t", expected)
    finally:
        t.shutdown()
    assert dict(tally) == expected
    check_histograms(samples, "t", tally)


def test_handled_messages_and_durations_by_outcome_exactly_once(db, registry):
    push_kinds(db, "t")
    fdq.metrics.register(db, registry)
    tally, lock = collections.Counter(), threading.Lock()

    def handler(tr, m):
        kind = _kind(m)
        if kind == "slow":
            time.sleep(SLOW_S)
        if kind == "error" and m.attempts == 1:
            with lock:
                tally["error"] += 1
            raise ValueError("first attempt fails")
        with lock:
            tally["term" if kind == "term" else "ok"] += 1
        if kind == "term":
            m.term("bad")

    # one message per transaction: a handler runs again only when its transaction is retried
    t = fdq.tail(db, "t", handler, transactional=True, batch_size=1, config=FAST, on_error=lambda e: None)
    try:
        expected = {"ok": 2 + 2 + 2 + 2, "term": 2, "error": 2}
        samples = handled_as_tallied(registry, tally, lock, "t", expected)
    finally:
        t.shutdown()
    assert set(tally) == set(expected)      # (more only if a transaction was retried: counted as run)
    check_histograms(samples, "t", tally)
    assert fdq.Supervisor(db).stats("t")["subscriptions"]["default"]["dlq"] == 2


def test_handled_messages_by_outcome_in_fdq_aio_tail(db, registry):
    push_kinds(db, "t")
    fdq.metrics.register(db, registry)
    tally, lock = collections.Counter(), threading.Lock()

    async def handler(m):
        kind = _kind(m)
        if kind == "slow":
            await asyncio.sleep(SLOW_S)
        first = m.attempts == 1
        if kind == "error" and first:
            with lock:
                tally["error"] += 1
            raise ValueError("first attempt fails")
        outcome = "nak" if kind == "nak" and first else "term" if kind == "term" else "ack"
        with lock:
            tally[outcome] += 1
        if outcome == "nak":
            m.nak()
        elif outcome == "term":
            m.term("bad")

    expected = {"ack": 8, "nak": 2, "term": 2, "error": 2}

    async def main():
        t = await fdq.aio.tail(db, "t", handler, config=FAST, on_error=lambda e: None)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with lock:
                    if dict(tally) == expected:
                        break
                await asyncio.sleep(0.02)
        finally:
            await t.shutdown()

    asyncio.run(main())
    samples = handled_as_tallied(registry, tally, lock, "t", expected)
    assert dict(tally) == expected
    check_histograms(samples, "t", tally)


def test_batch_handler_calls_and_their_messages_by_outcome(db, registry):
    """A batch handler call is one observation of its own histogram; its messages are
    counted by the call's outcome (ok: returned, error: raised, then redelivered)."""
    fdq.Supervisor(db).create_topic("b", shards=1)
    p = fdq.Producer(db)
    p.push_many("b", [b"m%d" % i for i in range(6)])
    fdq.metrics.register(db, registry)
    calls, lock = [], threading.Lock()

    def handler(msgs):
        with lock:
            failing = not calls
            calls.append(("error" if failing else "ok", len(msgs)))
        if failing:
            raise ValueError("the first call fails")

    def handled(outcome):
        with lock:
            return sum(n for o, n in calls if o == outcome)

    t = fdq.tail(db, "b", handler, batch=True, config=FAST, on_error=lambda e: None)
    try:
        wait_for(lambda: handled("ok") >= 6, timeout=60, what="every message handled by a call that returned")
    finally:
        t.shutdown()
    lab = {"topic": "b", "subscription": "default"}
    samples = scrape(registry)
    for outcome in ("ok", "error"):
        n_calls = sum(1 for o, _n in calls if o == outcome)
        assert value(samples, "fdq_batch_handler_duration_seconds_count", **lab, outcome=outcome) == n_calls
        assert value(samples, "fdq_batch_handled_messages_total", **lab, outcome=outcome) == handled(outcome)
    assert handled("error") >= 1
    assert not any(n.startswith("fdq_handled_messages") for n in names(samples))   # not per-message calls


def test_process_metrics_false_registers_no_hook_and_exports_no_push_or_handler_family(db, registry):
    fdq.metrics.register(db, registry, process_metrics=False)
    fdq.Producer(db).push("t", b"x")
    assert not any(isinstance(h, fdq.metrics.ProcessMetrics) for h in fdq.hooks.registered())
    assert not any(n.startswith(("fdq_push_", "fdq_pushed_", "fdq_handle", "fdq_batch_")) for n in names(scrape(registry)))


def test_closing_the_collector_unregisters_its_hook(db, registry):
    collector = fdq.metrics.register(db, registry)
    assert collector.process in fdq.hooks.registered()
    collector.close()
    assert collector.process not in fdq.hooks.registered()
    fdq.Producer(db).push("t", b"x")
    assert value(scrape(registry), "fdq_pushed_messages_total", topic="t", outcome="ok") is None    # unregistered
    assert [s for family in collector.process.collect() for s in family.samples] == []              # not counted


def test_a_collector_the_registry_refuses_leaves_no_hook(db, registry):
    first = fdq.metrics.register(db, registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        fdq.metrics.register(db, registry)              # the same families twice in one registry
    assert [h for h in fdq.hooks.registered() if isinstance(h, fdq.metrics.ProcessMetrics)] == [first.process]
    fdq.Producer(db).push("t", b"x")
    assert value(scrape(registry), "fdq_pushed_messages_total", topic="t", outcome="ok") == 1     # counted once
