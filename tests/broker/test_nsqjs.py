"""nsqjs (npm, run with node), unchanged, against the broker: publish (PUB, MPUB,
DPUB) and consume (FIN, REQ with delay, TOUCH); two channels each get every message.

nsqjs is installed into tests/broker/nsqjs/node_modules (``make nsqjs`` or, failing
that, by this test's fixture with ``npm install``); without node/npm the test skips."""
import json
import os
import shutil
import subprocess

import pytest

from fdqtest import kill_all

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nsqjs")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nsqjs():
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node/npm not installed: the nsqjs client test needs them")
    if not os.path.isdir(os.path.join(HERE, "node_modules", "nsqjs")):
        r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--omit=optional"], cwd=HERE,
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            pytest.skip(f"npm install nsqjs failed (no registry?): {r.stderr[-500:]}")
    return node


def run(node, *args, timeout=200):
    r = subprocess.run([node, os.path.join(HERE, "client.js"), *map(str, args)], cwd=HERE,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_nsqjs_publish_and_consume(nsqjs, broker):
    n = 60
    for ch in ("a", "b"):
        assert broker.http_req(f"/channel/create?topic=js&channel={ch}", b"")[0] == 200
    res = run(nsqjs, "pub", "127.0.0.1", broker.tcp_port, "js", n)
    assert res["ok"] == n and not res["errors"], res
    procs = [subprocess.Popen([nsqjs, os.path.join(HERE, "client.js"), "sub", "127.0.0.1", str(broker.tcp_port),
                               "js", ch, str(n)], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for ch in ("a", "b")]
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=200)
            assert proc.returncode == 0, (out[-2000:], err[-3000:])
            r = json.loads(out.strip().splitlines()[-1])
            seen = {int(k): v for k, v in r["seen"].items()}
            assert r["bad"] == [] and r["finished"] == n
            assert sorted(seen) == list(range(n))
            for i, attempts in seen.items():
                assert attempts == ([1, 2] if i % 10 == 3 else [1]), (i, attempts)
    finally:
        kill_all(procs)
