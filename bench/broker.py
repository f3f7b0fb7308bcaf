"""FDQ's NSQ-compatible broker (``python -m fdq.broker``, embedded engine) beside the real
nsqd 1.3.0 in the same run, both driven by one raw-socket NSQ client (this module's
``Client``: a blocking socket, TCP_NODELAY, pre-encoded frames; no client library).

Run::

    python -m bench.broker             # the issue's cases, median of 3, about 2-3 minutes
    python -m bench.broker --quick     # shorter cases, one round
    python -m bench.broker --markdown  # markdown for bench/RESULTS.md
    python -m bench.broker --json
    python -m bench.broker --profile latency    # py-spy's top frames of FDQ's broker in that case
    python -m bench.broker --cases all          # every case below but channels
    python -m bench.broker --cases channels --channels 1,10,100,300 --rounds 20

The reference: nsqd 1.3.0 with ``--mem-queue-size=0`` (every message through its disk
queue, the closest to FDQ's durability; nsqd fsyncs every 2,500 messages or 2 s, FDQ's
embedded engine commits in WAL mode with synchronous=NORMAL), found or built offline on
first use by ``bench/nsqd.py`` (``--nsqd PATH`` or ``FDQ_BENCH_NSQD`` to name one). Where
it is absent and cannot be built, the run says why and measures FDQ alone.

Each server case runs on a fresh server and data directory, FDQ and nsqd alternated case
by case, ``--repeat`` rounds (3; the median is printed); every case is bounded in count
and time, and its servers and client processes are stopped by PID when it ends or fails.
Bodies are ``--size`` bytes (200). The server's CPU (cores, from /proc/PID/stat over the
timed part) is printed beside each figure, and ``fdq_over_nsqd`` (the median of the rounds'
ratios, each of two runs next to each other in time) with issue 23's target.

Server cases (the first five are the default and carry the targets):

* ``pub1``: PUB one at a time on one connection (send, wait for OK): msgs/s.
* ``pub8``: the same on 8 connections from 8 client *processes* (8 threads in one Python
  process saturate the client's GIL before nsqd does).
* ``mpub100``: MPUB of 100 messages on one connection, 4 outstanding: msgs/s.
* ``consume``: one channel, RDY 200, FIN each, from a backlog published first: msgs/s.
* ``latency``: PUB paced at 1,000 msgs/s while a consumer (RDY 200) FINs: p50/p99
  publish-to-receive (both ends on this host's monotonic clock) and the server's CPU.
  The consumer IDENTIFYs unbuffered: ``output_buffer_timeout`` *and*
  ``output_buffer_size`` -1 (nsqd needs both; -1 timeout alone leaves its 16 KB buffer).
* ``pubwin``: PUB pipelined, 200 outstanding.
* ``latency_buffered``: ``latency`` with the default output buffering (16 KiB / 250 ms):
  at this rate a delivery rarely fills the buffer or reaches RDY, so it waits.
* ``pynsq_pub`` / ``pynsq_mpub`` / ``pynsq_consume``: through pynsq (tornado).

FDQ alone:

* ``client`` (``client_pub1``, ``client_pub8``, ``client_mpub100``, ``client_consume``):
  the raw client against a null server in a process of its own (answers OK at once /
  streams message frames by RDY): what the client can do, so a figure above that reaches
  it is client-bound (nsqd's PUB cases are, on a 2-core machine).
* ``direct``: FDQ's Python API in process, no broker: push_many(100) and fetch(200) +
  ack_many, the ceiling.
* ``channels`` (only when named): PUB round trip against the number of idle channels of
  the topic (``--channels 1,10,100``). One broker process and database; one topic per
  channel count, its channels created by ``/channel/create`` (no consumers). The topics
  are published to in turn, round by round, one PUB at a time: p50/p90 round trip and the
  broker's CPU per PUB. Each channel is an FDQ subscription, and a push writes the message
  into every subscription's shard queue (fan-out on write): the cost grows with channels.
  Then the same in process (``Producer.push``, topics with as many subscriptions) as the
  reference.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter

from bench import nsqd as nsqd_ref
from bench._common import fmt, machine, output, pct, process_cpu_s, stop_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE_LIMIT_S = 20.0

COMPARED = ("pub1", "pub8", "mpub100", "consume", "latency")
SERVER_CASES = COMPARED + ("pubwin", "latency_buffered", "pynsq_pub", "pynsq_mpub", "pynsq_consume")
FDQ_ALONE = ("client", "direct")

# issue 23 part 2: (case, figure) -> (kind, bound); "ratio": fdq/nsqd at least, "max": fdq at most
TARGETS = {
    ("pub1", "msgs_per_s"): ("ratio", 0.15),
    ("pub8", "msgs_per_s"): ("ratio", 0.5),
    ("mpub100", "msgs_per_s"): ("ratio", 0.5),
    ("consume", "msgs_per_s"): ("ratio", 0.5),
    ("latency", "p50_ms"): ("max", 2.0),
    ("latency", "p99_ms"): ("max", 10.0),
    ("latency", "server_cpu"): ("max", 0.35),
}
UNITS = {"msgs_per_s": "msgs/s", "p50_ms": "ms", "p99_ms": "ms", "server_cpu": "cores"}


# -- the raw-socket NSQ client, the same for both servers ---------------------------------

FRAME_RESPONSE, FRAME_ERROR, FRAME_MESSAGE = 0, 1, 2
HEARTBEAT = b"_heartbeat_"
_FRAME = struct.Struct(">Ii")
_U32 = struct.Struct(">I")
_TS = struct.Struct(">q")
UNBUFFERED = {"output_buffer_timeout": -1, "output_buffer_size": -1}


def pub_frame(topic: bytes, body: bytes) -> bytes:
    return b"PUB " + topic + b"\n" + _U32.pack(len(body)) + body


def mpub_frame(topic: bytes, bodies: list) -> bytes:
    payload = _U32.pack(len(bodies)) + b"".join(_U32.pack(len(b)) + b for b in bodies)
    return b"MPUB " + topic + b"\n" + _U32.pack(len(payload)) + payload


def fin_frames(messages) -> bytes:
    """FIN for each message frame's data (its id is bytes 10..26)."""
    return b"".join(b"FIN " + d[10:26] + b"\n" for d in messages)


class Client:
    """One NSQ TCP connection on 127.0.0.1:``port`` (IDENTIFY with ``identify`` if given)."""

    def __init__(self, port, identify=None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.sock.sendall(b"  V2")
        if identify is not None:
            body = json.dumps(identify).encode()
            self.sock.sendall(b"IDENTIFY\n" + _U32.pack(len(body)) + body)
            self.frames(1)

    def frames(self, n=1, deadline=None):
        """Read until at least ``n`` frames (answering heartbeats) or ``deadline``; return
        them as [(type, data)]. An error frame raises."""
        out = []
        while len(out) < n:
            if deadline is not None and time.monotonic() > deadline:
                return out
            buf = self.buf
            pos = 0
            while len(buf) - pos >= 8:
                size, ftype = _FRAME.unpack_from(buf, pos)
                if len(buf) - pos < 4 + size:
                    break
                data = bytes(buf[pos + 8:pos + 4 + size])
                pos += 4 + size
                if ftype == FRAME_RESPONSE and data == HEARTBEAT:
                    self.sock.sendall(b"NOP\n")
                elif ftype == FRAME_ERROR:
                    raise RuntimeError(data.decode(errors="replace"))
                else:
                    out.append((ftype, data))
            del buf[:pos]
            if len(out) >= n:
                break
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise RuntimeError("connection closed")
            buf += chunk
        return out

    def close(self):
        self.sock.close()


# -- servers: a fresh one per case -------------------------------------------------------

class FdqBroker:
    """``python -m fdq.broker`` on a fresh database in ``tmp``, loopback, free ports;
    ``root``: the checkout whose broker runs (its .venv's Python if it has one)."""

    name = "fdq"

    def __init__(self, tmp, root=ROOT):
        python = os.path.join(root, ".venv", "bin", "python")
        python = python if root != ROOT and os.path.exists(python) else sys.executable
        self.log = open(os.path.join(tmp, "broker.log"), "w+")
        self.proc = subprocess.Popen([python, "-m", "fdq.broker", "--url", f"sqlite:///{tmp}/fdq.db",
                                      "--tcp-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=root)
        self.pid = self.proc.pid
        line = self.proc.stdout.readline()
        if not line.startswith("fdq-broker"):
            self.stop()
            self.log.seek(0)
            raise RuntimeError(f"broker did not start: {line!r} {self.log.read()[-500:]}")
        parts = dict(kv.split("=") for kv in line.split()[1:])
        self.port = int(parts["tcp"].rsplit(":", 1)[1])
        self.http = parts["http"]

    def stop(self):
        stop_process(self.proc)
        self.proc.stdout.close()
        self.log.close()


class CpuWindow:
    """The server's CPU in cores from now (a case's timed part begins) to ``cores()``; a
    server to be profiled (``run_case``) gets its py-spy here, so the profile covers the
    timed part."""

    def __init__(self, srv):
        self.pid = srv.pid
        if getattr(srv, "profile_in", None) and srv.spy is None:
            srv.spy = Profile(srv.pid, srv.profile_in)
        self.c0, self.t0 = process_cpu_s(self.pid), time.perf_counter()

    def cores(self) -> float:
        return (process_cpu_s(self.pid) - self.c0) / (time.perf_counter() - self.t0)


# -- the server cases: fn(srv) -> figures ---------------------------------------------------

def pub_one_at_a_time(srv, n, seconds, body):
    c = Client(srv.port)
    frame = pub_frame(b"bench", body)
    lat = []
    cpu = CpuWindow(srv)
    t0 = time.perf_counter()
    deadline = t0 + seconds
    for _ in range(n):
        s = time.perf_counter()
        c.sock.sendall(frame)
        c.frames(1)
        lat.append(time.perf_counter() - s)
        if s > deadline:
            break
    el = time.perf_counter() - t0
    r = {"msgs": len(lat), "msgs_per_s": len(lat) / el, "server_cpu": cpu.cores(),
         "p50_ms": pct(lat, .5) * 1e3, "p99_ms": pct(lat, .99) * 1e3}
    c.close()
    return r


def pub_worker(port, n, seconds, size):
    """One client process of ``pub_processes``: connect, say ready, wait for 'go', PUB one
    at a time, print {"msgs", "elapsed"}."""
    c = Client(int(port))
    frame = pub_frame(b"bench", b"x" * int(size))
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    t0 = time.perf_counter()
    deadline = t0 + float(seconds)
    done = 0
    while done < int(n) and time.perf_counter() < deadline:
        c.sock.sendall(frame)
        c.frames(1)
        done += 1
    print(json.dumps({"msgs": done, "elapsed": time.perf_counter() - t0}), flush=True)


WORKER = "import sys; from bench.broker import pub_worker; pub_worker(*sys.argv[1:])"


def pub_processes(srv, k, n, seconds, body):
    """PUB one at a time on ``k`` connections, one per client process, all started together."""
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(srv.port), str(n), str(seconds), str(len(body))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, cwd=ROOT)
             for _ in range(k)]
    try:
        deadline = time.monotonic() + CASE_LIMIT_S
        for pr in procs:
            if not select.select([pr.stdout], [], [], max(0.0, deadline - time.monotonic()))[0] \
                    or pr.stdout.readline() != b"ready\n":
                raise RuntimeError("a client process did not connect")
        cpu = CpuWindow(srv)
        for pr in procs:
            pr.stdin.write(b"go\n")
            pr.stdin.flush()
        results = []
        for pr in procs:
            pr.wait(seconds + CASE_LIMIT_S)
            results.append(json.loads(pr.stdout.read()))
        cores = cpu.cores()
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait(30)
            pr.stdin.close()
            pr.stdout.close()
    msgs = sum(r["msgs"] for r in results)
    return {"msgs": msgs, "msgs_per_s": msgs / max(r["elapsed"] for r in results), "server_cpu": cores,
            "clients": f"{k} processes"}


def pipelined(srv, n, frame, per_frame, window, seconds):
    c = Client(srv.port)
    sent = done = 0
    cpu = CpuWindow(srv)
    t0 = time.perf_counter()
    total = n // per_frame
    while done < total and time.perf_counter() - t0 < seconds:
        while sent < total and sent - done < window:
            c.sock.sendall(frame)
            sent += 1
        done += len(c.frames(1))
    while done < sent:
        done += len(c.frames(1, time.monotonic() + CASE_LIMIT_S))
    el = time.perf_counter() - t0
    r = {"msgs": done * per_frame, "msgs_per_s": done * per_frame / el, "server_cpu": cpu.cores()}
    c.close()
    return r


def fill(port, n, body, topic=b"bench"):
    c = Client(port)
    frame = mpub_frame(topic, [body] * 100)
    for _ in range(0, n, 100):
        c.sock.sendall(frame)
    got = c.frames(n // 100, time.monotonic() + CASE_LIMIT_S * 3)
    c.close()
    if len(got) < n // 100:
        raise RuntimeError(f"fill: {len(got)} of {n // 100} MPUBs answered")


def channel_with(port, n, body, topic=b"bench"):
    """The channel 'default' of ``topic`` created (SUB), then ``n`` messages published."""
    c = Client(port)
    c.sock.sendall(b"SUB " + topic + b" default\n")
    c.frames(1)
    fill(port, n, body, topic)
    c.close()


def consume(srv, n, seconds, body=None, rdy=200, topic="bench"):
    """Subscribe (RDY 0), publish ``n`` ``body``s (if given) into the channel, then time
    receiving ``n`` with RDY ``rdy``, FIN each."""
    c = Client(srv.port, {"heartbeat_interval": 5000, "msg_timeout": 60000})
    c.sock.sendall(f"SUB {topic} default\n".encode())
    c.frames(1)
    if body is not None:
        fill(srv.port, n, body, topic.encode())
    cpu = CpuWindow(srv)
    c.sock.sendall(f"RDY {rdy}\n".encode())
    got = 0
    t0 = time.perf_counter()
    while got < n and time.perf_counter() - t0 < seconds:
        frames = c.frames(1)
        got += len(frames)
        c.sock.sendall(fin_frames(d for t, d in frames if t == FRAME_MESSAGE))
    el = time.perf_counter() - t0
    r = {"msgs": got, "msgs_per_s": got / el, "server_cpu": cpu.cores()}
    c.close()
    return r


def latency(srv, rate, seconds, size, buffering=None):
    """PUB at ``rate`` for ``seconds`` on one connection while another consumes (RDY 200,
    FIN each): p50/p99 publish-to-receive and the server's CPU meanwhile. ``buffering``:
    IDENTIFY's output buffer keys (None: the server's defaults)."""
    c = Client(srv.port, {"heartbeat_interval": 5000, "msg_timeout": 60000, **(buffering or {})})
    c.sock.sendall(b"SUB lat default\n")
    c.frames(1)
    c.sock.sendall(b"RDY 200\n")
    lats = []
    n = int(rate * seconds)
    stop = threading.Event()
    pad = b"z" * max(0, size - _TS.size)

    def publish():
        pc = Client(srv.port)
        t0 = time.monotonic()
        for i in range(n):
            d = t0 + i / rate - time.monotonic()
            if d > 0:
                time.sleep(d)
            pc.sock.sendall(pub_frame(b"lat", _TS.pack(time.monotonic_ns()) + pad))
            if stop.is_set():
                break
        pc.frames(n, time.monotonic() + CASE_LIMIT_S)
        pc.close()
    cpu = CpuWindow(srv)
    t = threading.Thread(target=publish, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + seconds + CASE_LIMIT_S
        while len(lats) < n and time.monotonic() < deadline:
            frames = c.frames(1, deadline)
            now = time.monotonic_ns()
            msgs = [d for t_, d in frames if t_ == FRAME_MESSAGE]
            lats.extend((now - _TS.unpack_from(d, 26)[0]) / 1e6 for d in msgs)
            c.sock.sendall(fin_frames(msgs))
        cores = cpu.cores()
    finally:
        stop.set()
        t.join(CASE_LIMIT_S)
        c.close()
    return {"msgs": len(lats), "rate": rate, "p50_ms": pct(lats, .5), "p99_ms": pct(lats, .99), "server_cpu": cores}


PYNSQ = r'''
import sys, time, json, nsq, tornado.ioloop
mode, port, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
body = b"x" * size
loop = tornado.ioloop.IOLoop.current()
st = {"done": 0, "t0": None}
def finish():
    el = time.perf_counter() - st["t0"]
    print(json.dumps({"msgs": st["done"], "msgs_per_s": st["done"] / el})); loop.stop()
if mode in ("pub", "mpub"):
    w = nsq.Writer(["127.0.0.1:%d" % port])
    per = 1 if mode == "pub" else 100
    window = 200 if mode == "pub" else 4
    st["sent"] = 0
    def cb(conn, data):
        st["done"] += per
        if st["done"] >= n or time.perf_counter() - st["t0"] > 20: return finish()
        send()
    def send():
        if st["sent"] < n:
            st["sent"] += per
            if per == 1: w.pub("pyb", body, cb)
            else: w.mpub("pyb", [body] * 100, cb)
    def start():
        if not w.conns: return loop.call_later(0.1, start)
        st["t0"] = time.perf_counter()
        for _ in range(window): send()
    loop.call_later(0.3, start)
else:
    def h(m):
        if st["t0"] is None: st["t0"] = time.perf_counter()
        st["done"] += 1
        if st["done"] >= n or time.perf_counter() - st["t0"] > 20: loop.add_callback(finish)
        return True
    r = nsq.Reader(topic="bench", channel="default", message_handler=h, nsqd_tcp_addresses=["127.0.0.1:%d" % port],
                   max_in_flight=200, heartbeat_interval=5)
loop.call_later(60, loop.stop)
loop.start()
'''


def pynsq(mode, srv, n, size):
    cpu = CpuWindow(srv)
    r = subprocess.run([sys.executable, "-c", PYNSQ, mode, str(srv.port), str(n), str(size)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    if r.returncode != 0 or not r.stdout.strip():
        raise RuntimeError(f"pynsq {mode}: {r.stderr[-300:]}")
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "server_cpu": cpu.cores()}


def server_cases(k, size):
    """name -> fn(srv): the server cases at scale ``k`` (1 full, 0.25 quick)."""
    body = b"x" * size
    s = 3.0 if k == 1 else 1.0            # seconds per timed case
    n_consume = int(50000 * k) // 100 * 100
    return {
        "pub1": lambda srv: pub_one_at_a_time(srv, 100_000, s, body),
        "pub8": lambda srv: pub_processes(srv, 8, 100_000, s, body),
        "mpub100": lambda srv: pipelined(srv, int(600_000 * k), mpub_frame(b"bench", [body] * 100), 100, 4, s),
        "consume": lambda srv: consume(srv, n_consume, CASE_LIMIT_S, body),
        "latency": lambda srv: latency(srv, 1000, 5.0 if k == 1 else 1.5, size, UNBUFFERED),
        "pubwin": lambda srv: pipelined(srv, int(100_000 * k), pub_frame(b"bench", body), 1, 200, s),
        "latency_buffered": lambda srv: latency(srv, 1000, 5.0 if k == 1 else 1.5, size),
        "pynsq_pub": lambda srv: pynsq("pub", srv, int(5000 * k), size),
        "pynsq_mpub": lambda srv: pynsq("mpub", srv, int(50000 * k), size),
        "pynsq_consume": lambda srv: (channel_with(srv.port, int(30000 * k) // 100 * 100, body),
                                      pynsq("consume", srv, int(30000 * k) // 100 * 100, size))[1],
    }


# -- py-spy on FDQ's broker ----------------------------------------------------------------

def py_spy() -> str | None:
    return shutil.which("py-spy") or next((p for p in [os.path.join(os.path.dirname(sys.executable), "py-spy")]
                                           if os.access(p, os.X_OK)), None)


RATE = 200        # py-spy's samples a second


class Profile:
    """py-spy recording process ``pid`` until ``summary()``: 200 times a second, the
    thread holding the GIL (a Python broker is bound by it long before it has two cores),
    without pausing the broker to read its stacks."""

    def __init__(self, pid, tmp):
        self.out = os.path.join(tmp, "py-spy.txt")
        self.err = open(os.path.join(tmp, "py-spy.err"), "w+")
        self.proc = subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--rate", str(RATE), "--format", "raw",
                                      "--output", self.out, "--threads", "--gil", "--nonblocking"],
                                     stdout=subprocess.PIPE, stderr=self.err, bufsize=0)
        # it says "py-spy> Sampling process ..." once attached
        ready = select.select([self.proc.stdout], [], [], CASE_LIMIT_S)[0] and self.proc.stdout.readline()
        if not ready or not ready.startswith(b"py-spy> Sampling"):
            self.stop()
            self.err.seek(0)
            raise RuntimeError(f"py-spy did not attach to {pid}: {self.err.read()[:300]}")
        self.t0 = time.perf_counter()

    def stop(self):
        stop_process(self.proc, stop=lambda p: p.send_signal(signal.SIGINT))
        self.proc.stdout.close()
        self.err.close()

    def summary(self, top=12) -> dict:
        """Shares of the samples: by thread (a pool's threads together), by function on top
        of the stack (self), by FDQ's functions anywhere in the stack (inclusive)."""
        seconds = time.perf_counter() - self.t0
        self.stop()
        threads, own, incl = Counter(), Counter(), Counter()
        total = 0
        with open(self.out) as f:
            for line in f:
                stack, _, count = line.rstrip("\n").rpartition(" ")
                if not stack:
                    continue
                count = int(count)
                frames = stack.split(";")
                thread = next((fr for fr in frames if fr.startswith("thread (")), "?")
                funcs = [fr for fr in frames if not fr.startswith(("thread (", "process "))]
                total += count
                threads[re.sub(r"^thread \(\d+\): |_\d+$", "", thread)] += count
                if funcs:
                    own[_function(funcs[-1])] += count
                for fn in {_function(fr) for fr in funcs if "/fdq/" in fr or " (fdq/" in fr}:
                    incl[fn] += count
        share = lambda c: [(k, round(v / max(total, 1), 3)) for k, v in c.most_common(top)]  # noqa: E731
        return {"samples": total, "gil_held": total / (RATE * seconds), "threads": share(threads),
                "self": share(own), "inclusive": share(incl)}


def _function(frame: str) -> str:
    """'fn (path/to/file.py:12)' -> 'fn (file.py)'."""
    name, _, where = frame.partition(" (")
    return f"{name} ({os.path.basename(where.rsplit(':', 1)[0].rstrip(')'))})"


# -- FDQ alone: the client against a null server, FDQ's API in process --------------------

def serve_null(mode, size):
    """A null NSQ server (run by ``NullServer`` in a process of its own, so it does not
    share the client's GIL) on a free loopback port, printed: it answers OK to everything
    with a body (PUB, MPUB, IDENTIFY) and SUB, and (``mode`` 'consume') streams message
    frames as RDY allows; a thread per connection; until its stdin closes."""
    size = int(size)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    ok = _FRAME.pack(6, FRAME_RESPONSE) + b"OK"
    data = struct.pack(">qH", time.time_ns(), 1) + b"0123456789abcdef" + b"y" * size
    msg = _FRAME.pack(4 + len(data), FRAME_MESSAGE) + data

    def serve(conn):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        rdy = inflight = 0
        while True:
            try:
                chunk = conn.recv(1 << 20)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            out = []
            while True:           # one command: a line, and for PUB/MPUB/IDENTIFY a sized body
                if buf[:4] == b"  V2":
                    del buf[:4]
                nl = buf.find(b"\n")
                if nl < 0:
                    break
                name = bytes(buf[:nl]).split(b" ", 1)[0]
                if name in (b"PUB", b"MPUB", b"IDENTIFY"):
                    if len(buf) < nl + 5 or len(buf) < nl + 5 + _U32.unpack_from(buf, nl + 1)[0]:
                        break
                    del buf[:nl + 5 + _U32.unpack_from(buf, nl + 1)[0]]
                    out.append(ok)
                    continue
                line = bytes(buf[:nl]).split()
                del buf[:nl + 1]
                if name == b"SUB":
                    out.append(ok)
                elif name == b"RDY":
                    rdy = int(line[1])
                elif name == b"FIN":
                    inflight -= 1
            if mode == "consume" and rdy - inflight > 0:
                out.append(msg * (rdy - inflight))
                inflight = rdy
            if out:
                conn.sendall(b"".join(out))

    def accept():
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    print(srv.getsockname()[1], flush=True)
    sys.stdin.read()


class NullServer:
    """``serve_null`` in a process of its own; ``port``, ``pid``, ``stop()`` by PID."""

    def __init__(self, mode, size):
        self.proc = subprocess.Popen([sys.executable, "-c", "import sys; from bench.broker import serve_null; "
                                      "serve_null(*sys.argv[1:])", mode, str(size)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, cwd=ROOT)
        self.pid = self.proc.pid
        line = select.select([self.proc.stdout], [], [], CASE_LIMIT_S)[0] and self.proc.stdout.readline()
        if not line:
            self.stop()
            raise RuntimeError("the null server did not start")
        self.port = int(line)

    def stop(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()


def on_null(mode, size, fn):
    srv = NullServer(mode, size)
    try:
        return fn(srv)
    finally:
        srv.stop()


def client_cases(size):
    """The raw client alone (server_cpu: the null server's)."""
    body = b"x" * size
    return {
        "client_pub1": lambda: on_null("pub", size, lambda srv: pub_one_at_a_time(srv, 100_000, 3.0, body)),
        "client_pub8": lambda: on_null("pub", size, lambda srv: pub_processes(srv, 8, 100_000, 3.0, body)),
        "client_mpub100": lambda: on_null("pub", size, lambda srv: pipelined(
            srv, 2_000_000, mpub_frame(b"bench", [body] * 100), 100, 4, 3.0)),
        "client_consume": lambda: on_null("consume", size, lambda srv: consume(srv, 300_000, 3.0)),
    }


def direct(n, size):
    """push_many(100) and fetch(200) + ack_many, in-process, no broker: the ceiling."""
    import fdq
    with tempfile.TemporaryDirectory() as tmp:
        db = fdq.connect(f"sqlite:///{tmp}/fdq.db")
        prod = fdq.Producer(db)
        t0 = time.perf_counter()
        done = 0
        while done < n and time.perf_counter() - t0 < CASE_LIMIT_S:
            prod.push_many("bench", [b"x" * size] * 100)
            done += 100
        push = done / (time.perf_counter() - t0)
        c = fdq.Consumer(db, "bench", config=fdq.ConsumerConfig(ack_wait_s=60))
        got = 0
        t0 = time.perf_counter()
        while got < done and time.perf_counter() - t0 < CASE_LIMIT_S:
            ms = c.fetch(200, timeout=1.0)
            c.ack_many(ms)
            got += len(ms)
        consume_rate = got / (time.perf_counter() - t0)
        c.close()
    return {"msgs": done, "push_many100_per_s": push, "fetch200_ack_per_s": consume_rate}


# -- channels: PUB round trip against the topic's idle channels ----------------------

def channels(counts, rounds, per_round, size, root=ROOT):
    """The ``channels`` case: {"broker": {count: row}, "in_process": {count: row}}."""
    body = b"x" * size
    with tempfile.TemporaryDirectory() as tmp:
        b = FdqBroker(tmp, root)
        try:
            for n in counts:
                for i in range(n):
                    req = urllib.request.Request(f"http://{b.http}/channel/create?topic=t{n}&channel=c{i}", data=b"")
                    urllib.request.urlopen(req, timeout=30).read()
            s = socket.create_connection(("127.0.0.1", b.port), timeout=30)
            s.sendall(b"  V2")
            frames = {n: pub_frame(f"t{n}".encode(), body) for n in counts}

            def pub(n):
                s.sendall(frames[n])
                got = b""
                while len(got) < 10:
                    got += s.recv(10 - len(got))
            broker = _rounds(counts, rounds, per_round, pub, lambda: process_cpu_s(b.pid))
            s.close()
        finally:
            b.stop()
    import fdq
    with tempfile.TemporaryDirectory() as tmp:
        db = fdq.connect(f"sqlite:///{tmp}/ref.db")
        sup = fdq.Supervisor(db)
        for n in counts:
            sup.create_topic(f"t{n}", subs=tuple(f"c{i}" for i in range(n)))
        prod = fdq.Producer(db)
        in_process = _rounds(counts, rounds, per_round, lambda n: prod.push(f"t{n}", body), time.process_time)
    return {"broker": broker, "in_process": in_process}


def _rounds(counts, rounds, per_round, call, cpu, limit_s=600):
    """``rounds`` of ``per_round`` calls of ``call(count)`` for each count in turn: per
    count, p50 (and its ratio to the first count's), p90, CPU ms per call."""
    lat = {n: [] for n in counts}
    spent = {n: 0.0 for n in counts}
    deadline = time.monotonic() + limit_s
    for _ in range(rounds):
        for n in counts:
            c0 = cpu()
            for _ in range(per_round):
                t0 = time.perf_counter()
                call(n)
                lat[n].append(time.perf_counter() - t0)
            spent[n] += cpu() - c0
        if time.monotonic() > deadline:
            break
    base = pct(lat[counts[0]], .5)
    return {n: {"p50_ms": pct(lat[n], .5) * 1e3, "of_first": pct(lat[n], .5) / base,
                "p90_ms": pct(lat[n], .9) * 1e3, "cpu_ms_per_call": spent[n] / len(lat[n]) * 1e3} for n in counts}


# -- the run -------------------------------------------------------------------------------

def run_case(fn, make_server, parent, profile=False):
    """``fn(server)`` on a fresh server in a fresh directory (``profile``: py-spy on it over
    the case's timed part, its summary in the result); the server and py-spy stopped by PID
    however it ends."""
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        srv = make_server(tmp)
        srv.profile_in, srv.spy = (tmp if profile else None), None
        try:
            r = fn(srv)
            if srv.spy:
                r["profile"] = srv.spy.summary()
            return r
        finally:
            if srv.spy:
                srv.spy.stop()
            srv.stop()


def median_of(runs: list) -> dict:
    """Each numeric figure's median over the runs (the other keys from the first run)."""
    out = dict(runs[0])
    for key, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def comparison_rows(runs: dict, cases) -> list:
    """One row per (case, figure): nsqd's and FDQ's medians, fdq_over_nsqd (the median of
    each round's ratio: the two runs of a round are next to each other in time, so a
    machine's load drift cancels), the issue's target and whether FDQ meets it, and each
    server's CPU beside throughput figures."""
    medians = {key: median_of(rs) for key, rs in runs.items()}
    rows = []
    for case in cases:
        fdq, ref = medians.get(("fdq", case)), medians.get(("nsqd", case))
        if fdq is None and ref is None:
            continue
        figures = ("p50_ms", "p99_ms", "server_cpu") if case.startswith("latency") else ("msgs_per_s",)
        for fig in figures:
            row = {"case": case, "figure": UNITS[fig] if fig != "server_cpu" else "server CPU, cores"}
            if fig in ("p50_ms", "p99_ms"):
                row["figure"] = f"{fig[:3]} ms"
            if ref is not None:
                row["nsqd"] = ref[fig]
            if fdq is not None:
                row["fdq"] = fdq[fig]
            pairs = zip(runs.get(("fdq", case), ()), runs.get(("nsqd", case), ()))
            ratios = [f[fig] / n[fig] for f, n in pairs if n[fig]]
            if ratios:
                row["fdq_over_nsqd"] = statistics.median(ratios)
            if fig == "msgs_per_s":
                for who, r in (("nsqd", ref), ("fdq", fdq)):
                    if r is not None:
                        row[f"{who}_cpu"] = r["server_cpu"]
            kind, bound = TARGETS.get((case, fig), (None, None))
            if kind == "ratio":
                row["target"] = f">= {bound}x nsqd"
                if "fdq_over_nsqd" in row:
                    row["met"] = "yes" if row["fdq_over_nsqd"] >= bound else "no"
            elif kind == "max":
                row["target"] = f"fdq <= {bound} {'core' if fig == 'server_cpu' else 'ms'}"
                if fdq is not None:
                    row["met"] = "yes" if fdq[fig] <= bound else "no"
            rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter cases, one round")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--dir", default=None, help="where the servers' temporary data directories go")
    ap.add_argument("--cases", default="", help=f"comma-separated (default {','.join(COMPARED)}; 'all': every "
                                                f"case but channels): {','.join(SERVER_CASES + FDQ_ALONE)},channels")
    ap.add_argument("--servers", default="fdq,nsqd", help="which servers run the server cases")
    ap.add_argument("--repeat", type=int, default=None, help="rounds of the server cases (3; --quick 1): the median")
    ap.add_argument("--size", type=int, default=200, help="message body bytes")
    ap.add_argument("--nsqd", default=None, help="the nsqd 1.3 binary (default: FDQ_BENCH_NSQD, the cache "
                                                 "~/.cache/fdq-bench/nsqd, PATH, else built there: bench/nsqd.py)")
    ap.add_argument("--fdq-root", default=ROOT, help="the checkout whose broker runs (its .venv if any)")
    ap.add_argument("--profile", default=None, metavar="CASE",
                    help="one more run of CASE with py-spy (if installed) on FDQ's broker: its top frames")
    ap.add_argument("--channels", default="1,10,100", help="channels: the channel counts")
    ap.add_argument("--rounds", type=int, default=15, help="channels: rounds of --per-round PUBs per count")
    ap.add_argument("--per-round", type=int, default=40)
    args = ap.parse_args()
    k = 0.25 if args.quick else 1.0
    repeat = args.repeat or (1 if args.quick else 3)
    want = [c for c in args.cases.split(",") if c] or list(COMPARED)
    if want == ["all"]:
        want = list(SERVER_CASES + FDQ_ALONE)
    unknown = set(want) - set(SERVER_CASES + FDQ_ALONE + ("channels",))
    if unknown:
        ap.error(f"unknown cases: {', '.join(sorted(unknown))}")
    if args.profile and args.profile not in SERVER_CASES:
        ap.error(f"--profile takes a server case: {', '.join(SERVER_CASES)}")
    started = datetime.datetime.now(datetime.timezone.utc)
    load0 = os.getloadavg()
    skipped = {}
    makers = {}
    for name in args.servers.split(","):
        if name == "fdq":
            makers["fdq"] = lambda tmp: FdqBroker(tmp, os.path.abspath(args.fdq_root))
        elif name == "nsqd" and not set(want) & set(SERVER_CASES):
            continue                    # no server case: no nsqd to find or build
        elif name == "nsqd":
            binary, what = nsqd_ref.find(args.nsqd)
            if binary:
                makers["nsqd"] = lambda tmp, binary=binary: nsqd_ref.Nsqd(binary, tmp)
                nsqd_version = what
            else:
                skipped["nsqd"] = what
                print(f"nsqd skipped: {what}", file=sys.stderr, flush=True)
        else:
            ap.error(f"unknown server {name!r} (fdq, nsqd)")
    if args.profile and not py_spy():
        skipped["profile"] = "py-spy is not installed (pip install py-spy)"
        print(f"profile skipped: {skipped['profile']}", file=sys.stderr, flush=True)

    # the server cases: FDQ and nsqd alternated case by case, round by round
    fns = server_cases(k, args.size)
    chosen = [c for c in want if c in SERVER_CASES]
    runs = {}
    for rnd in range(repeat if chosen else 0):
        for i, case in enumerate(chosen):
            order = list(makers) if (rnd + i) % 2 == 0 else list(makers)[::-1]
            for server in order:
                print(f"... {case} {server} (round {rnd + 1}/{repeat})", file=sys.stderr, flush=True)
                r = run_case(fns[case], makers[server], args.dir)
                runs.setdefault((server, case), []).append(r)
                print(f"    {r}", file=sys.stderr, flush=True)
    profile = None
    if args.profile and "profile" not in skipped and "fdq" in makers:
        # a run of its own: sampling slows the broker, the figures above are without it
        print(f"... {args.profile} fdq under py-spy", file=sys.stderr, flush=True)
        r = run_case(fns[args.profile], makers["fdq"], args.dir, profile=True)
        profile = {"case": args.profile, **r.pop("profile"), "figures": _brief(r)}
    rows = comparison_rows(runs, chosen)

    alone = {}
    if "client" in want:
        for name, fn in client_cases(args.size).items():
            print(f"... {name}", file=sys.stderr, flush=True)
            alone[name] = fn()
    if "direct" in want:
        print("... direct", file=sys.stderr, flush=True)
        alone["direct"] = direct(int(100000 * k), args.size)
    chan = None
    if "channels" in want:
        print("... channels", file=sys.stderr, flush=True)
        chan = channels([int(x) for x in args.channels.split(",")], max(1, int(args.rounds * k)), args.per_round,
                        args.size, os.path.abspath(args.fdq_root))

    meta = {"date": started.strftime("%Y-%m-%d %H:%M UTC"),
            "load": f"{load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end (1-min load average)",
            "nsqd": nsqd_version if "nsqd" in makers else None,
            "fdq": _commit(args.fdq_root), "body_bytes": args.size, "repeat": repeat,
            "client": "one raw-socket NSQ client (bench/broker.py Client); pub8: 8 client processes"}
    if args.json:
        print(json.dumps({"machine": machine(), "meta": meta, "skipped": skipped, "rows": rows,
                          "runs": {f"{s}/{c}": rs for (s, c), rs in runs.items()},
                          "fdq_alone": alone, "profile": profile, "channels": chan}, indent=1, default=str))
        return
    md = args.markdown
    ref = f"{meta['nsqd']} with --mem-queue-size=0" if meta["nsqd"] else "nsqd not run"
    print(f"{'' if not md else '_'}{meta['date']}; load {meta['load']}; {ref}; "
          f"FDQ {meta['fdq']}; {args.size}-byte bodies; {f'median of {repeat}; ' if rows else ''}"
          f"{meta['client']}{'' if not md else '_'}\n")
    for what, why in skipped.items():
        print(f"{what} skipped: {why}\n")
    if rows:
        output(args, "FDQ's broker and nsqd, same run", rows,
               ["case", "figure", "nsqd", "fdq", "fdq_over_nsqd", "target", "met", "nsqd_cpu", "fdq_cpu"],
               text_columns=("case", "figure", "target", "met"))
    if alone:
        print()
        output(args, "The client alone (null server), FDQ's API in process", [{"case": n, **r} for n, r in alone.items()],
               ["case", "msgs", "msgs_per_s", "p50_ms", "p99_ms", "server_cpu", "push_many100_per_s",
                "fetch200_ack_per_s"])
    if profile:
        _print_profile(profile)
    if chan:
        _print_channels(chan, args.size)


def _brief(r: dict) -> str:
    return ", ".join(f"{k} {fmt(v)}" for k, v in r.items() if k in ("msgs_per_s", "p50_ms", "p99_ms", "server_cpu"))


def _commit(root) -> str:
    r = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def _print_profile(profile):
    print(f"\npy-spy on FDQ's broker, case {profile['case']} (a run of its own: {profile['figures']}): "
          f"{profile['samples']} samples of the thread holding the GIL at {RATE} Hz: held at "
          f"{profile['gil_held']:.0%} of the ticks (py-spy may miss ticks on a loaded machine); shares of the "
          f"samples")
    for part, what in (("threads", "by thread"), ("self", "on top of the stack"),
                       ("inclusive", "FDQ's functions anywhere in the stack")):
        print(f"  {what}:")
        for name, share in profile[part]:
            print(f"    {share:6.1%}  {name}")


def _print_channels(chan, size):
    print(f"\nload average {os.getloadavg()[0]:.2f}; {size}-byte PUBs, one at a time")
    for where, rows in chan.items():
        what, cpu, per = ("channels", "broker CPU", "PUB") if where == "broker" else ("subscriptions", "CPU", "push")
        if where != "broker":
            print("in process (Producer.push, the reference):")
        for n, r in rows.items():
            print(f"{n:>5} {what}: p50 {r['p50_ms']:6.2f} ms ({r['of_first']:4.1f}x)  p90 {r['p90_ms']:6.2f} ms"
                  f"  {cpu} {r['cpu_ms_per_call']:5.2f} ms/{per}")


if __name__ == "__main__":
    main()
