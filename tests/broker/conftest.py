"""Fixtures: broker processes (``python -m fdq.broker``) on port 0, raw NSQ clients."""
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from fdq.broker import protocol as p
from fdqtest import database_url, readline_within, wait_for  # noqa: F401 - wait_for re-exported to this directory's tests
from nsqclient import RawClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class BrokerProc:
    def __init__(self, url, *args, env=None):
        self.url = url
        cmd = [sys.executable, "-m", "fdq.broker", "--url", url, "--tcp-address", "127.0.0.1:0",
               "--http-address", "127.0.0.1:0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                                     env={**os.environ, **(env or {})}, text=True)
        try:
            line = readline_within(self.proc, 60, "the broker's address line")
        except AssertionError:
            line = ""
        if not line.startswith("fdq-broker"):
            self.proc.kill()
            self.proc.wait(30)
            raise RuntimeError(f"broker did not start: {line!r} {self.proc.stderr.read()[-3000:]}")
        parts = dict(kv.split("=") for kv in line.split()[1:])
        self.tcp_port = int(parts["tcp"].rsplit(":", 1)[1])
        self.http_port = int(parts["http"].rsplit(":", 1)[1])
        self.tcp = f"127.0.0.1:{self.tcp_port}"
        self.http = f"127.0.0.1:{self.http_port}"
        self.https = parts["https"] if "https" in parts else None      # --https-address

    def http_req(self, path, body=None, method=None, headers=None, timeout=30):
        req = urllib.request.Request(f"http://{self.http}{path}", data=body, method=method or ("POST" if body is not None else "GET"),
                                     headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def stop(self, sig=signal.SIGTERM, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture
def broker_factory(db_url):
    procs = []

    def start(*args, url=None, env=None):
        b = BrokerProc(url or db_url, *args, env=env)
        procs.append(b)
        return b
    yield start
    for b in procs:
        b.stop(signal.SIGKILL if b.proc.poll() is None else signal.SIGTERM, timeout=10)
        b.proc.stdout.close()
        b.proc.stderr.close()


@pytest.fixture
def broker(broker_factory):
    return broker_factory()


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory):
    """One broker for a module whose tests use distinct topics (saves a start per test)."""
    b = BrokerProc(database_url(tmp_path_factory.mktemp("shared") / "fdq.db"))
    yield b
    b.stop(timeout=30)
    b.proc.stdout.close()
    b.proc.stderr.close()


@pytest.fixture
def raw(broker):
    clients = []

    def connect(magic=p.MAGIC_V2, addr=None):
        c = RawClient(addr or broker.tcp, magic)
        clients.append(c)
        return c
    yield connect
    for c in clients:
        c.close()


@pytest.fixture
def cert(tmp_path):
    """(certificate, key) files of a self-signed certificate for 127.0.0.1 (openssl)."""
    key, crt = tmp_path / "key.pem", tmp_path / "cert.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                        "-out", str(crt), "-days", "2", "-subj", "/CN=127.0.0.1"],
                       check=True, capture_output=True, timeout=60)
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        pytest.skip(f"openssl cannot make a test certificate: {e}")
    return str(crt), str(key)
