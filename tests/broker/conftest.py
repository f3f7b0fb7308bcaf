"""Fixtures: broker processes (``python -m fdq.broker``) on port 0, raw NSQ clients."""
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import pytest

from fdq.broker import protocol as p

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class BrokerProc:
    def __init__(self, url, *args, env=None):
        self.url = url
        cmd = [sys.executable, "-m", "fdq.broker", "--url", url, "--tcp-address", "127.0.0.1:0",
               "--http-address", "127.0.0.1:0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                                     env={**os.environ, **(env or {})}, text=True)
        line = self.proc.stdout.readline()          # bounded: the process prints or dies
        if not line.startswith("fdq-broker"):
            self.proc.kill()
            raise RuntimeError(f"broker did not start: {line!r} {self.proc.stderr.read()[-3000:]}")
        parts = dict(kv.split("=") for kv in line.split()[1:])
        self.tcp_port = int(parts["tcp"].rsplit(":", 1)[1])
        self.http_port = int(parts["http"].rsplit(":", 1)[1])
        self.tcp = f"127.0.0.1:{self.tcp_port}"
        self.http = f"127.0.0.1:{self.http_port}"

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
def db_url(tmp_path):
    return f"sqlite:///{tmp_path / 'fdq.db'}"


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
    b = BrokerProc(f"sqlite:///{tmp_path_factory.mktemp('shared') / 'fdq.db'}")
    yield b
    b.stop(timeout=30)
    b.proc.stdout.close()
    b.proc.stderr.close()


class RawClient:
    """A minimal NSQ client on a plain socket: every read is bounded."""

    def __init__(self, addr, magic=p.MAGIC_V2, timeout=30):
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.buf = bytearray()
        self.timeout = timeout
        if magic:
            self.sock.sendall(magic)

    def send(self, data):
        self.sock.sendall(data)

    def frame(self, timeout=None, skip_heartbeats=True):
        """Next frame (type, data); answers heartbeats with NOP; None if the server closed."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            frames = p.decode_frames(self.buf) if len(self.buf) >= 8 else []
            if frames:
                # put back all but the first
                rest = b"".join(struct.pack(">Ii", len(d) + 4, t) + d for t, d in frames[1:])
                self.buf[:0] = rest
                t, d = frames[0]
                if skip_heartbeats and t == p.FRAME_RESPONSE and d == p.HEARTBEAT:
                    self.send(b"NOP\n")
                    continue
                return t, d
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no frame from the broker")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                raise TimeoutError("no frame from the broker") from None
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            self.buf += chunk

    def expect(self, data=p.OK, ftype=p.FRAME_RESPONSE):
        f = self.frame()
        assert f == (ftype, data), f
        return f

    def error(self):
        f = self.frame()
        assert f is not None and f[0] == p.FRAME_ERROR, f
        return f[1].decode()

    def closed(self, timeout=30):
        """True once the server has closed the connection (frames before that are dropped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.frame(timeout=max(0.1, deadline - time.monotonic())) is None:
                    return True
            except TimeoutError:
                return False
        return False

    def identify(self, **kw):
        kw.setdefault("feature_negotiation", True)
        self.send(p.encode_command(b"IDENTIFY", body=json.dumps(kw).encode()))
        t, d = self.frame()
        assert t == p.FRAME_RESPONSE, d
        return json.loads(d) if kw.get("feature_negotiation") else d

    def pub(self, topic, body):
        self.send(p.encode_command(b"PUB", topic.encode(), body=body))
        self.expect()

    def sub(self, topic, channel, rdy=None):
        self.send(f"SUB {topic} {channel}\n".encode())
        self.expect()
        if rdy is not None:
            self.send(f"RDY {rdy}\n".encode())

    def message(self, timeout=None, ext=False):
        f = self.frame(timeout)
        assert f is not None and f[0] == p.FRAME_MESSAGE, f
        return p.decode_message(f[1], ext)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


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


def wait_for(cond, timeout=60, interval=0.05, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")
