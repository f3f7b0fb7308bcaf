"""The broker's /metrics (prometheus_client): two broker processes on one database
export the database-wide families from exactly one of them (the metrics leader) and
their own process figures each; the leader killed (kill -9), the other takes over once
its beat has stood still for the timeout; stopped cleanly, at once. OpenMetrics when
the scraper asks for it; 501 naming the extra without prometheus_client."""
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from fdqtest import readline_within, wait_for

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROCESS_FAMILIES = ("process_cpu_seconds_total", "process_resident_memory_bytes", "python_info",
                    "python_gc_collections_total", "fdq_broker_connections", "fdq_broker_published_messages_total")


def scrape(broker) -> dict:
    status, body = broker.http_req("/metrics")
    assert status == 200, body[:300]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def exports_database(samples) -> bool:
    return ("fdq_topic_inserted_messages_total", (("topic", "m"),)) in samples


def leader_flags(brokers) -> list:
    """Each broker's fdq_metrics_leader, checked against the families it exports."""
    flags = []
    for b in brokers:
        s = scrape(b)
        flag = s[("fdq_metrics_leader", ())]
        assert exports_database(s) == (flag == 1), (flag, sorted(k[0] for k in s))
        assert set(PROCESS_FAMILIES) <= {name for name, _labels in s}, sorted(k[0] for k in s)
        flags.append(flag)
    return flags


def one_leader(brokers, timeout=60):
    return wait_for(lambda: (lambda f: f if sorted(f) == [0] * (len(f) - 1) + [1] else None)(leader_flags(brokers)),
                    timeout=timeout, what="exactly one metrics leader").index(1)


def test_two_brokers_export_the_database_once_and_the_survivor_of_a_kill_9_takes_over(broker_factory):
    a, b = broker_factory("--metrics-leader-timeout", "3s"), broker_factory("--metrics-leader-timeout", "3s")
    assert a.http_req("/pub?topic=m", b"x") == (200, b"OK")
    brokers = [a, b]
    leader = one_leader(brokers)
    for _ in range(5):          # it stays where it is while the leader lives
        last_scrape = time.monotonic()      # the leader beats at each scrape: its last beat is after this
        assert leader_flags(brokers).index(1) == leader
    killed, survivor = brokers[leader], brokers[1 - leader]
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait(30)
    wait_for(lambda: leader_flags([survivor]) == [1], timeout=60, what="the survivor's takeover")
    took = time.monotonic() - last_scrape
    assert took >= 3.0, f"took over {took:.1f} s after the leader's last beat: before its 3 s timeout"


def test_a_leader_stopped_cleanly_hands_over_without_waiting_for_its_timeout(broker_factory):
    a, b = broker_factory("--metrics-leader-timeout", "5m"), broker_factory("--metrics-leader-timeout", "5m")
    assert a.http_req("/pub?topic=m", b"x") == (200, b"OK")
    leader = one_leader([a, b])
    t0 = time.monotonic()
    assert [a, b][leader].stop() == 0
    survivor = [a, b][1 - leader]
    wait_for(lambda: leader_flags([survivor]) == [1], timeout=60, what="the takeover")
    assert time.monotonic() - t0 < 60


def test_metrics_database_always_and_never(broker_factory):
    always, never = broker_factory("--metrics-database", "always"), broker_factory("--metrics-database", "never")
    assert always.http_req("/pub?topic=m", b"x") == (200, b"OK")
    assert leader_flags([always, never]) == [1, 0]


def test_the_fdq_command_takes_the_metrics_options(tmp_path, db_url):
    fdq_command = os.path.join(os.path.dirname(sys.executable), "fdq")
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME")}
    proc = subprocess.Popen([fdq_command, "--url", db_url, "broker", "--tcp-address", "127.0.0.1:0",
                             "--http-address", "127.0.0.1:0", "--metrics-database", "never",
                             "--metrics-leader-timeout", "2s"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, text=True)
    try:
        line = ""
        for _ in range(20):
            line = readline_within(proc, 60, "fdq broker's listening line")
            if line.startswith("fdq broker: listening ") or not line:
                break
        http = line.split("http=")[1].split()[0]
        with urllib.request.urlopen(f"http://{http}/metrics", timeout=30) as r:
            samples = {s.name: s.value for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}
        assert samples["fdq_metrics_leader"] == 0
        assert "process_cpu_seconds_total" in samples
        bad = subprocess.run([fdq_command, "--url", db_url, "broker", "--metrics-database", "sometimes"],
                             capture_output=True, text=True, env=env, timeout=120)
        assert bad.returncode == 2 and "'sometimes' is not one of 'leader', 'always', 'never'" in bad.stderr
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()


def test_openmetrics_when_the_scraper_asks_for_it(broker_factory):
    b = broker_factory()
    assert b.http_req("/pub?topic=m", b"x") == (200, b"OK")
    req = urllib.request.Request(f"http://{b.http}/metrics",
                                 headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(req, timeout=30) as r:
        ctype, body = r.headers["Content-Type"], r.read().decode()
    assert ctype.startswith("application/openmetrics-text")
    samples = {s.name: s.value for f in openmetrics_families(body) for s in f.samples}
    assert samples["fdq_broker_published_messages_total"] == 1
    assert samples["fdq_metrics_leader"] == 1
    status, plain = b.http_req("/metrics")
    assert status == 200 and not plain.decode().rstrip().endswith("# EOF")


def test_without_prometheus_client_metrics_answers_501_naming_the_extra(db_url):
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "from fdq.broker.__main__ import main\n"
            f"main(['--url', {db_url!r}, '--tcp-address', '127.0.0.1:0', '--http-address', '127.0.0.1:0'])\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, text=True)
    try:
        line = readline_within(proc, 60, "the broker's address line")
        http = line.split("http=")[1].strip()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://{http}/metrics", timeout=30)
        assert e.value.code == 501
        assert e.value.read() == b"/metrics needs the prometheus_client package: pip install 'fdq-queue[metrics]'\n"
        with urllib.request.urlopen(f"http://{http}/ping", timeout=30) as r:
            assert r.read() == b"OK"
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
