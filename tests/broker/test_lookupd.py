"""nsqlookupd registration (``--lookupd-tcp-address``): brokers register every topic and
subscription of the database with every lookupd (a stand-in speaking lookupd's TCP V1
and HTTP), follow creations and deletions, come back after a lookupd restart, and NSQ
clients discovering producers through lookupd consume from them."""
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request

import pytest

from fdqtest import kill_all, wait_for
from lookupd_standin import LookupdStandin

HERE = os.path.dirname(os.path.abspath(__file__))
WAIT_S = 30       # the brokers list the database every 5 s; generous for a busy machine


@pytest.fixture
def lookupds():
    started = []

    def start(tcp_port=0, http_port=0):
        s = LookupdStandin().start(tcp_port, http_port)
        started.append(s)
        return s
    yield start
    for s in started:
        if s._thread.is_alive():
            s.stop()


def lookup(standin, topic):
    try:
        with urllib.request.urlopen(f"http://{standin.http}/lookup?topic={topic}", timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        assert e.code == 404
        return None


def registered(standin, broker):
    return standin.registrations().get(("127.0.0.1", broker.tcp_port), set())


def register_flags(*standins):
    flags = ["--broadcast-address", "127.0.0.1"]
    for s in standins:
        flags += ["--lookupd-tcp-address", s.tcp]
    return flags


def test_every_broker_registers_every_topic_and_channel_with_every_lookupd(broker_factory, lookupds):
    l1, l2 = lookupds(), lookupds()
    b1 = broker_factory(*register_flags(l1, l2))
    assert b1.http_req("/channel/create?topic=orders&channel=billing", b"")[0] == 200
    assert b1.http_req("/topic/create?topic=bare", b"")[0] == 200
    b2 = broker_factory(*register_flags(l1, l2))       # another broker of the database: the same names
    want = {("orders", ""), ("orders", "billing"), ("bare", "")}
    for s in (l1, l2):
        for b in (b1, b2):
            wait_for(lambda: registered(s, b) == want, WAIT_S, f"{b.tcp} registered on {s.tcp}")
        found = lookup(s, "orders")
        assert found["channels"] == ["billing"]
        assert sorted((p["broadcast_address"], p["tcp_port"], p["http_port"]) for p in found["producers"]) == \
            sorted(("127.0.0.1", b.tcp_port, b.http_port) for b in (b1, b2))      # the bound ports
        assert all(p["version"].startswith("1.3.0") for p in found["producers"])
    assert l1.lines()[0].startswith("IDENTIFY")


def test_created_and_deleted_topics_and_channels_are_registered_and_unregistered(broker_factory, lookupds):
    s = lookupds()
    b = broker_factory(*register_flags(s))
    assert b.http_req("/channel/create?topic=t&channel=c1", b"")[0] == 200
    wait_for(lambda: registered(s, b) == {("t", ""), ("t", "c1")}, WAIT_S, "the channel registered")
    assert b.http_req("/channel/create?topic=t&channel=c2", b"")[0] == 200
    assert b.http_req("/channel/delete?topic=t&channel=c1", b"")[0] == 200
    wait_for(lambda: registered(s, b) == {("t", ""), ("t", "c2")}, WAIT_S, "c1 unregistered, c2 registered")
    assert "UNREGISTER t c1" in s.lines() and "REGISTER t c2" in s.lines()
    assert b.http_req("/topic/delete?topic=t", b"")[0] == 200
    wait_for(lambda: registered(s, b) == set(), WAIT_S, "the topic unregistered")
    assert lookup(s, "t") is None


def test_a_restarted_lookupd_gets_identify_and_every_register_again(broker_factory, lookupds):
    s = lookupds()
    b = broker_factory(*register_flags(s))
    assert b.http_req("/channel/create?topic=back&channel=c", b"")[0] == 200
    wait_for(lambda: registered(s, b) == {("back", ""), ("back", "c")}, WAIT_S, "registered")
    tcp_port, http_port = s.tcp_port, s.http_port
    s.stop()
    s2 = lookupds(tcp_port, http_port)                 # the same addresses, no state
    wait_for(lambda: registered(s2, b) == {("back", ""), ("back", "c")}, WAIT_S, "registered again")
    assert s2.lines()[0].startswith("IDENTIFY")


def test_pynsq_reader_finds_the_brokers_through_lookupd(broker_factory, lookupds):
    pytest.importorskip("nsq", reason="pynsq is not installed (pip install -e '.[test]')")
    s = lookupds()
    b1 = broker_factory(*register_flags(s))
    b2 = broker_factory(*register_flags(s))
    n = 30
    assert b1.http_req("/channel/create?topic=found&channel=ch", b"")[0] == 200
    pub = subprocess.run([sys.executable, os.path.join(HERE, "pynsq_client.py"), "pub", b1.tcp, "found", str(n)],
                         capture_output=True, text=True, timeout=200)
    assert json.loads(pub.stdout.strip().splitlines()[-1])["ok"] == n, pub.stderr[-3000:]
    for b in (b1, b2):
        wait_for(lambda: ("found", "ch") in registered(s, b), WAIT_S, "both brokers registered")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "pynsq_client.py"), "sub", f"http://{s.http}",
                             "found", "ch", str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=200)
    finally:
        kill_all([proc])
    assert proc.returncode == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["bad"] == [] and r["finished"] == n and sorted(int(k) for k in r["seen"]) == list(range(n))
    assert sorted(r["conns"]) == sorted([b1.tcp, b2.tcp])       # connected to both, found through lookupd


def test_lookupd_without_http_needs_a_broadcast_http_port(db_url, lookupds):
    s = lookupds()
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "fdq"), "--url", db_url, "broker", "--tcp-address", "127.0.0.1:0", "--http-address", "",
                          "--lookupd-tcp-address", s.tcp], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--broadcast-http-port" in out.stderr, out.stderr


def test_the_broker_pings_its_lookupds(broker_factory, lookupds):
    s = lookupds()
    broker_factory(*register_flags(s))
    wait_for(lambda: "PING" in s.lines(), 40, "a PING (every 15 s)", interval=0.5)


NSQLOOKUPD = os.environ.get("FDQ_NSQLOOKUPD") or shutil.which("nsqlookupd")


@pytest.mark.skipif(not NSQLOOKUPD, reason="no nsqlookupd binary (set FDQ_NSQLOOKUPD or put it on PATH)")
def test_the_real_nsqlookupd_lists_the_broker(broker_factory, tmp_path):
    log = tmp_path / "nsqlookupd.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([NSQLOOKUPD, "--tcp-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        def listening():
            found = dict(re.findall(r"(TCP|HTTP): listening on 127\.0\.0\.1:(\d+)", log.read_text()))
            return {k: int(v) for k, v in found.items()} if len(found) == 2 else None
        ports = wait_for(listening, 30, "nsqlookupd's listening lines")
        b = broker_factory("--broadcast-address", "127.0.0.1", "--lookupd-tcp-address", f"127.0.0.1:{ports['TCP']}")
        assert b.http_req("/channel/create?topic=real&channel=ch", b"")[0] == 200

        def found():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports['HTTP']}/lookup?topic=real", timeout=10) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError:
                return None
        data = wait_for(found, WAIT_S, "the topic in nsqlookupd")
        assert data["channels"] == ["ch"]
        assert [(x["broadcast_address"], x["tcp_port"], x["http_port"]) for x in data["producers"]] == \
            [("127.0.0.1", b.tcp_port, b.http_port)]
    finally:
        kill_all([proc])
