"""fdq broker: the installed console script runs the NSQ-compatible broker in its own
process; a raw NSQ V2 client publishes; fdq's Python API sees the message. Bad flags
are usage errors (exit 2); a broker that cannot start is an error (exit 1)."""
from __future__ import annotations

import json
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import fdq

FDQ = Path(sys.executable).parent / "fdq"


def read_exactly(sock, n, deadline):
    buf = b""
    while len(buf) < n:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AssertionError(f"broker closed the connection after {buf!r}")
        buf += chunk
    return buf


@pytest.mark.slow
def test_installed_fdq_broker_takes_an_nsq_pub(tmp_path, url, db, sup):
    assert FDQ.exists(), f"no console script at {FDQ}: pip install -e . first"
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME")}
    proc = subprocess.Popen([str(FDQ), "--url", url, "broker", "--tcp-address", "127.0.0.1:0",
                             "--http-address", "127.0.0.1:0", "--msg-timeout", "30s",
                             "--e2e-processing-latency-percentile", "0.5,0.99", "--no-snappy",
                             "--output-buffer-timeout", "100ms"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.decode()) for line in proc.stderr], daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        ready = None
        while ready is None:
            try:
                line = lines.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("no ready line from fdq broker within 60 s") from None
            if line.startswith("fdq broker: listening "):
                ready = line.split()
            assert proc.poll() is None, f"fdq broker exited {proc.returncode}: {line}"
        fields = dict(f.split("=", 1) for f in ready[3:])
        tcp_host, tcp_port = fields["tcp"].rsplit(":", 1)
        http_host, http_port = fields["http"].rsplit(":", 1)
        assert tcp_host == http_host == "127.0.0.1" and int(tcp_port) > 0 and int(http_port) > 0

        body = "caf\u00e9 over NSQ".encode()
        with socket.create_connection((tcp_host, int(tcp_port)), timeout=30) as s:
            s.sendall(b"  V2" + b"PUB orders\n" + struct.pack(">I", len(body)) + body)
            deadline = time.monotonic() + 30
            size, frame_type = struct.unpack(">Ii", read_exactly(s, 8, deadline))
            assert (frame_type, read_exactly(s, size - 4, deadline)) == (0, b"OK")   # a response frame

        with urllib.request.urlopen(f"http://{http_host}:{http_port}/ping", timeout=30) as r:
            assert r.read() == b"OK"
        with urllib.request.urlopen(f"http://{http_host}:{http_port}/stats?format=json", timeout=30) as r:
            [topic] = [t for t in json.loads(r.read())["topics"] if t["topic_name"] == "orders"]
        # the flags reached the broker: percentiles tracked (nothing FINed yet)
        assert topic["e2e_processing_latency"] == {"count": 0, "percentiles": [{"quantile": 0.5, "value": 0.0},
                                                                              {"quantile": 0.99, "value": 0.0}]}

        assert sup.stats("orders")["counters"]["inserted"] == 1
        # a broker topic has channels only (no "default"): read it as a new one from the start
        with fdq.Consumer(db, "orders", subscription="reader",
                          subscription_config=fdq.SubscriptionConfig(deliver_policy="all")) as c:
            [m] = c.fetch(10, timeout=10)
            c.ack_many([m])
        assert m.body == body and m.topic == "orders"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            raise
    assert code == 0
    assert proc.stdout.read() == b""                      # data channel: nothing to say
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert rest[-1:] == ["fdq broker: stopped\n"], rest


USAGE_ERRORS = [  # (flags, text of the one "Error:" line)
    (["--msg-timeout", "0"], "'0': a duration must be > 0"),
    (["--msg-timeout", "soon"], "'soon' is not a duration: give a number of seconds or numbers with units"),
    (["--max-req-timeout", "1x"], "'1x' is not a duration"),
    (["--msg-timeout", "2h"], "--msg-timeout must not exceed --max-msg-timeout"),
    (["--msg-timeout", "5ms"], "--msg-timeout must be at least 10ms (a delivery's lease), not 5ms"),
    (["--tcp-address", "4150"], "address must be host:port, not '4150'"),
    (["--http-address", "127.0.0.1:99999"], "port 99999 of '127.0.0.1:99999' is above 65535"),
    (["--max-msg-size", "0"], "0 is not in the range x>=1"),
    (["--max-rdy-count", "many"], "'many' is not a valid integer"),
    (["--max-deflate-level", "10"], "10 is not in the range 1<=x<=9"),
    (["--tls-cert", "/nonexistent/cert.pem"], "'/nonexistent/cert.pem' does not exist"),
    (["--tls-required"], "--tls-required needs --tls-cert and --tls-key"),
    (["--auth-file", "/nonexistent/auth.json"], "'/nonexistent/auth.json' does not exist"),
    (["--log-level", "LOUD"], "'LOUD' is not one of"),
    (["--max-msg-timeout", "1s"], "--msg-timeout must not exceed --max-msg-timeout"),
    (["--e2e-processing-latency-percentile", "1.5"], "e2e processing latency percentile 1.5 must be in (0, 1]"),
    (["--e2e-processing-latency-percentile", "p99"], "e2e processing latency percentile 'p99' is not a number"),
    (["--output-buffer-timeout", "10ms"], "--output-buffer-timeout must be within --min/--max-output-buffer-timeout"),
    (["--max-output-buffer-size", "10"], "10 is not in the range x>=64"),
    (["--frobnicate"], "No such option '--frobnicate'"),
]


@pytest.mark.parametrize("flags,text", USAGE_ERRORS, ids=[" ".join(f)[:40] for f, _t in USAGE_ERRORS])
def test_bad_flags_exit_2(run, flags, text, tmp_path):
    r = run("broker", *flags, code=2)
    assert r.stdout == ""
    error_lines = [line for line in r.stderr.splitlines() if line.startswith("Error: ")]
    assert len(error_lines) == 1 and text in error_lines[0], r.stderr


def test_tls_cert_without_key_exit_2(run, tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("not really")
    r = run("broker", "--tls-cert", cert, code=2)
    assert "Error: --tls-cert and --tls-key go together" in r.stderr


def test_a_broker_that_cannot_start_exits_1(run, tmp_path):
    bad_auth = tmp_path / "auth.json"
    bad_auth.write_text("{not json")
    r = run("broker", "--tcp-address", "127.0.0.1:0", "--http-address", "", "--auth-file", bad_auth, code=1)
    assert r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"fdq: error: --auth-file {str(bad_auth)!r} is not valid JSON")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = run("broker", "--tcp-address", f"127.0.0.1:{port}", "--http-address", "", code=1)
    assert r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith("fdq: error: cannot start the broker: ") and str(port) in r.stderr
