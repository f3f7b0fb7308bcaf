"""``fdq.metrics``: a prometheus_client collector of the database, scraped with
``generate_latest`` and parsed with prometheus_client's own parser: its values are
``Supervisor.stats``'s; the database-wide families come from one process in leader
mode; without prometheus_client, a ConfigError naming the extra."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import fdq
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
