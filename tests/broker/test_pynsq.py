"""pynsq (with tornado), unchanged, against the broker: publish with PUB/MPUB/DPUB,
consume with FIN, REQ with delay and TOUCH; two channels each get every message."""
import json
import os
import subprocess
import sys
import time

import pytest

from fdqtest import kill_all

pytest.importorskip("nsq", reason="pynsq is not installed (pip install -e '.[test]')")
pytest.importorskip("tornado")

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.slow


def run_client(*args, timeout=200, env=None):
    out = subprocess.run([sys.executable, os.path.join(HERE, "pynsq_client.py"), *map(str, args)],
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pynsq_publish_and_consume_two_channels(broker):
    n = 60
    # channels exist before publishing (as with nsqd, a channel gets what is published after it exists)
    assert broker.http_req("/channel/create?topic=py&channel=a", b"")[0] == 200
    assert broker.http_req("/channel/create?topic=py&channel=b", b"")[0] == 200
    t0 = time.time_ns()
    res = run_client("pub", broker.tcp, "py", n)
    t1 = time.time_ns()
    assert res["ok"] == n, res
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "pynsq_client.py"), "sub", broker.tcp, "py", ch,
                               str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for ch in ("a", "b")]
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=200)
            assert proc.returncode == 0, err[-3000:]
            r = json.loads(out.strip().splitlines()[-1])
            seen = {int(k): v for k, v in r["seen"].items()}
            assert r["bad"] == [] and r["finished"] == n
            assert sorted(seen) == list(range(n))                 # every body, byte-identical
            for i, attempts in seen.items():
                if i % 10 == 3:
                    assert attempts == [1, 2], (i, attempts)      # REQ'd once, redelivered once
                else:
                    assert attempts == [1], (i, attempts)         # FIN'd (or TOUCHed past msg_timeout) once
            assert t0 - 1_000_000_000 <= r["ts_min"] <= r["ts_max"] <= t1 + 1_000_000_000
    finally:
        kill_all(procs)
    st = json.loads(broker.http_req("/stats?format=json&topic=py")[1])
    chans = {c["channel_name"]: c for c in st["topics"][0]["channels"]}
    for ch in ("a", "b"):
        assert chans[ch]["depth"] == 0 and chans[ch]["in_flight_count"] == 0


def check(r, n):
    seen = {int(k): v for k, v in r["seen"].items()}
    assert r["bad"] == [] and r["finished"] == n and sorted(seen) == list(range(n))
    for i, attempts in seen.items():
        assert attempts == ([1, 2] if i % 10 == 3 else [1]), (i, attempts)


def test_pynsq_with_deflate(broker):
    env = {"PYNSQ_DEFLATE": "1"}
    assert broker.http_req("/channel/create?topic=pyz&channel=c", b"")[0] == 200
    assert run_client("pub", broker.tcp, "pyz", 30, env=env)["ok"] == 30
    r = run_client("sub", broker.tcp, "pyz", "c", 30, env=env)
    check(r, 30)
    assert r["deflate"] is True, r
    st = json.loads(broker.http_req("/stats?format=json&topic=pyz")[1])
    assert st["topics"][0]["message_count"] == 30


def test_pynsq_with_snappy(broker):
    pytest.importorskip("snappy", reason="pynsq's snappy needs python-snappy (pip install -e '.[test]')")
    env = {"PYNSQ_SNAPPY": "1"}
    assert broker.http_req("/channel/create?topic=pys&channel=c", b"")[0] == 200
    assert run_client("pub", broker.tcp, "pys", 30, env=env)["ok"] == 30
    r = run_client("sub", broker.tcp, "pys", "c", 30, env=env)
    check(r, 30)
    assert r["snappy"] is True, r          # negotiated: pynsq upgraded its socket


def test_pynsq_with_tls(broker_factory, cert):
    crt, key = cert
    b = broker_factory("--tls-cert", crt, "--tls-key", key, "--tls-required")
    env = {"PYNSQ_TLS": "1"}
    assert b.http_req("/channel/create?topic=pyt&channel=c", b"")[0] == 200
    assert run_client("pub", b.tcp, "pyt", 30, env=env)["ok"] == 30
    check(run_client("sub", b.tcp, "pyt", "c", 30, env=env), 30)
