"""Benchmarks of the NSQ-compatible broker (``python -m fdq.broker``) on the embedded engine.

Run::

    python -m bench.broker             # about 1-2 minutes, every case bounded in count and time
    python -m bench.broker --quick     # smaller counts
    python -m bench.broker --markdown  # a markdown table for bench/RESULTS.md
    python -m bench.broker --json
    python -m bench.broker --cases channels --channels 1,10,100,300 --rounds 20

Cases (a fresh database and broker process for each):

* ``pub1``: PUB one at a time (send, wait for OK, repeat): msgs/s and p50/p99 round trip.
* ``pubwin``: PUB pipelined, 200 outstanding (the broker's group commit shares transactions).
* ``mpub100``: MPUB of 100 messages, 4 outstanding: msgs/s.
* ``consume``: one channel, RDY 200, FIN each: msgs/s from a pre-filled backlog.
* ``latency``: PUB paced at 1,000 msgs/s for a few seconds while a consumer (RDY 200)
  FINs: p50/p99 publish-to-receive latency (both ends on this host's monotonic clock).
  The consumer IDENTIFYs with ``output_buffer_timeout: -1`` (no output buffering wait).
* ``latency_buffered``: the same with nsqd's default output buffering (16 KiB / 250 ms):
  at this rate a delivery rarely fills the buffer or reaches RDY, so it waits for the
  timeout, as on nsqd.
* ``pynsq_pub`` / ``pynsq_mpub`` / ``pynsq_consume``: the same through pynsq (tornado).
* ``client_*``: the raw client alone against a null server (answers OK at once /
  streams pre-built message frames by RDY): what the client can do, so the broker
  numbers above are not client-bound.
* ``channels`` (only when named: ``--cases channels``): PUB round trip against the number
  of idle channels of the topic (``--channels 1,10,100``). One broker process and
  database; one topic per channel count, its channels created by ``/channel/create`` (no
  consumers). The topics are published to in turn, round by round (same run, same
  machine load), one PUB at a time (send, wait for OK): p50/p90 round trip and the
  broker's CPU per PUB (from /proc, the rounds of each topic alone). Each channel is an
  FDQ subscription, and a push writes the message into every subscription's shard queue
  (fan-out on write): the cost grows with channels. Then the same in process
  (``Producer.push`` one at a time, topics with as many subscriptions, a database of its
  own) as the reference: what the push itself costs.

The raw client is a plain blocking socket with pre-encoded frames.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from fdq.broker import protocol as p

from bench._common import pct

CASE_LIMIT_S = 20.0


class Broker:
    """A broker process on a fresh database in ``tmp``, on free ports (``port``: TCP,
    ``http``: its HTTP address)."""

    def __init__(self, tmp):
        self.proc = subprocess.Popen([sys.executable, "-m", "fdq.broker", "--url", f"sqlite:///{tmp}/fdq.db",
                                      "--tcp-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"],
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        line = self.proc.stdout.readline()
        if not line.startswith("fdq-broker"):
            raise RuntimeError(f"broker did not start: {line!r}")
        parts = dict(kv.split("=") for kv in line.split()[1:])
        self.port = int(parts["tcp"].rsplit(":", 1)[1])
        self.http = parts["http"]

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Client:
    def __init__(self, port, identify=None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.sock.sendall(p.MAGIC_V2)
        if identify is not None:
            self.sock.sendall(p.encode_command(b"IDENTIFY", body=json.dumps(identify).encode()))
            self.frames(1)

    def frames(self, n=1, deadline=None):
        """Read until at least ``n`` frames (answering heartbeats); return them."""
        out = []
        while len(out) < n:
            if deadline is not None and time.monotonic() > deadline:
                return out
            for t, d in p.decode_frames(self.buf):
                if t == p.FRAME_RESPONSE and d == p.HEARTBEAT:
                    self.sock.sendall(b"NOP\n")
                    continue
                if t == p.FRAME_ERROR:
                    raise RuntimeError(d.decode())
                out.append((t, d))
            if len(out) >= n:
                break
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise RuntimeError("connection closed")
            self.buf += chunk
        return out


def pub_one_at_a_time(port, n):
    c = Client(port)
    frame = p.encode_command(b"PUB", b"bench", body=b"x" * 100)
    lat = []
    t0 = time.perf_counter()
    for i in range(n):
        s = time.perf_counter()
        c.sock.sendall(frame)
        c.frames(1)
        lat.append(time.perf_counter() - s)
        if time.perf_counter() - t0 > CASE_LIMIT_S:
            break
    el = time.perf_counter() - t0
    return {"msgs": len(lat), "msgs_per_s": len(lat) / el, "p50_ms": pct(lat, .5) * 1e3, "p99_ms": pct(lat, .99) * 1e3}


def pipelined(port, n, frame, per_frame, window):
    c = Client(port)
    sent = done = 0
    t0 = time.perf_counter()
    total = n // per_frame
    while done < total and time.perf_counter() - t0 < CASE_LIMIT_S:
        while sent < total and sent - done < window:
            c.sock.sendall(frame)
            sent += 1
        got = c.frames(1)
        done += len(got)
    while done < sent:
        done += len(c.frames(1))
    el = time.perf_counter() - t0
    return {"msgs": done * per_frame, "msgs_per_s": done * per_frame / el}


def fill(port, n, topic=b"bench"):
    c = Client(port)
    for i in range(0, n, 100):
        c.sock.sendall(p.encode_mpub(topic, [b"y" * 100] * 100))
    c.frames(n // 100)


def consume(port, n, rdy=200, topic="bench"):
    c = Client(port, {"heartbeat_interval": 5000, "msg_timeout": 60000})
    c.sock.sendall(f"SUB {topic} default\n".encode())
    c.frames(1)
    c.sock.sendall(f"RDY {rdy}\n".encode())
    got = 0
    t0 = time.perf_counter()
    while got < n and time.perf_counter() - t0 < CASE_LIMIT_S:
        frames = c.frames(1)
        fins = b"".join(b"FIN " + d[10:26] + b"\n" for t, d in frames if t == p.FRAME_MESSAGE)
        got += len(frames)
        c.sock.sendall(fins)
    el = time.perf_counter() - t0
    return {"msgs": got, "msgs_per_s": got / el}


def latency(port, rate=1000, seconds=5.0, output_buffer_timeout=-1):
    # -1: no output buffer wait (what a latency-sensitive NSQ client asks for); with
    # nsqd's default (250 ms) a message that neither fills the buffer nor reaches RDY
    # waits for that timeout, here as on nsqd
    c = Client(port, {"heartbeat_interval": 5000, "msg_timeout": 60000,
                      "output_buffer_timeout": output_buffer_timeout})
    c.sock.sendall(b"SUB lat default\n")
    c.frames(1)
    c.sock.sendall(b"RDY 200\n")
    lats = []
    n = int(rate * seconds)
    stop = threading.Event()

    def publish():
        pc = Client(port)
        t0 = time.monotonic()
        for i in range(n):
            due = t0 + i / rate
            d = due - time.monotonic()
            if d > 0:
                time.sleep(d)
            pc.sock.sendall(p.encode_command(b"PUB", b"lat", body=struct.pack(">q", time.monotonic_ns()) + b"z" * 92))
            if stop.is_set():
                break
        pc.frames(n, time.monotonic() + CASE_LIMIT_S)
    t = threading.Thread(target=publish, daemon=True)
    t.start()
    deadline = time.monotonic() + seconds + CASE_LIMIT_S
    while len(lats) < n and time.monotonic() < deadline:
        frames = c.frames(1, deadline)
        now = time.monotonic_ns()
        fins = []
        for t_, d in frames:
            if t_ == p.FRAME_MESSAGE:
                lats.append((now - struct.unpack(">q", d[26:34])[0]) / 1e6)
                fins.append(b"FIN " + d[10:26] + b"\n")
        c.sock.sendall(b"".join(fins))
    stop.set()
    return {"msgs": len(lats), "rate": rate, "p50_ms": pct(lats, .5), "p99_ms": pct(lats, .99)}


# -- reference: FDQ's Python API directly, same machine, same run ---------------------

def direct(n):
    """push_many(100) and fetch(200) + ack_many, in-process, no broker: the ceiling."""
    import fdq
    with tempfile.TemporaryDirectory() as tmp:
        db = fdq.connect(f"sqlite:///{tmp}/fdq.db")
        prod = fdq.Producer(db)
        t0 = time.perf_counter()
        done = 0
        while done < n and time.perf_counter() - t0 < CASE_LIMIT_S:
            prod.push_many("bench", [b"x" * 100] * 100)
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


# -- null server: the client alone ------------------------------------------------------

def null_server(mode):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve():
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        parser = p.Parser(max_body_size=64 << 20)
        ok = p.response()
        msg = p.message(time.time_ns(), 1, b"0123456789abcdef", b"y" * 100)
        rdy = 0
        inflight = 0
        while True:
            try:
                data = conn.recv(1 << 20)
            except OSError:
                return
            if not data:
                return
            out = []
            for cmd in parser.feed(data):
                if isinstance(cmd, p.ProtocolError):
                    return
                if cmd.name in (b"PUB", b"MPUB", b"IDENTIFY", b"SUB"):
                    out.append(ok)
                elif cmd.name == b"RDY":
                    rdy = int(cmd.params[0])
                elif cmd.name == b"FIN":
                    inflight -= 1
            if mode == "consume":
                k = rdy - inflight
                if k > 0:
                    out.append(msg * k)
                    inflight += k
            if out:
                conn.sendall(b"".join(out))
    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


# -- pynsq -----------------------------------------------------------------------------

PYNSQ = r'''
import sys, time, json, nsq, tornado.ioloop
mode, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
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
            if per == 1: w.pub("pyb", b"x" * 100, cb)
            else: w.mpub("pyb", [b"x" * 100] * 100, cb)
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


def pynsq(mode, port, n):
    r = subprocess.run([sys.executable, "-c", PYNSQ, mode, str(port), str(n)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    if r.returncode != 0 or not r.stdout.strip():
        return {"error": r.stderr[-300:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- channels: PUB round trip against the topic's idle channels ----------------------

def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def channels(counts, rounds, per_round, size):
    """The ``channels`` case: {"broker": {count: row}, "in_process": {count: row}}."""
    body = b"x" * size
    with tempfile.TemporaryDirectory() as tmp:
        b = Broker(tmp)
        try:
            for n in counts:
                for i in range(n):
                    req = urllib.request.Request(f"http://{b.http}/channel/create?topic=t{n}&channel=c{i}", data=b"")
                    urllib.request.urlopen(req, timeout=30).read()
            s = socket.create_connection(("127.0.0.1", b.port), timeout=30)
            s.sendall(b"  V2")
            frames = {n: f"PUB t{n}\n".encode() + struct.pack(">I", len(body)) + body for n in counts}

            def pub(n):
                s.sendall(frames[n])
                got = b""
                while len(got) < 10:
                    got += s.recv(10 - len(got))
            broker = _rounds(counts, rounds, per_round, pub, lambda: cpu_s(b.proc.pid))
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--cases", default="")
    ap.add_argument("--channels", default="1,10,100", help="channels: the channel counts")
    ap.add_argument("--rounds", type=int, default=15, help="channels: rounds of --per-round PUBs per count")
    ap.add_argument("--per-round", type=int, default=40)
    ap.add_argument("--size", type=int, default=100, help="channels: the body size")
    args = ap.parse_args()
    k = 0.25 if args.quick else 1.0
    want = set(args.cases.split(",")) if args.cases else None
    results = {}

    def case(name, fn):
        if want and name not in want:
            return
        print(f"... {name}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            b = Broker(tmp)
            try:
                results[name] = fn(b.port)
            finally:
                b.stop()
        print(f"    {results[name]}", file=sys.stderr, flush=True)

    if not want or "direct" in want:
        print("... direct", file=sys.stderr, flush=True)
        results["direct"] = direct(int(100000 * k))
        print(f"    {results['direct']}", file=sys.stderr, flush=True)
    case("pub1", lambda port: pub_one_at_a_time(port, int(3000 * k)))
    case("pubwin", lambda port: pipelined(port, int(20000 * k), p.encode_command(b"PUB", b"bench", body=b"x" * 100), 1, 200))
    case("mpub100", lambda port: pipelined(port, int(100000 * k), p.encode_mpub(b"bench", [b"x" * 100] * 100), 100, 4))
    case("consume", lambda port: (fill(port, int(50000 * k)), consume(port, int(50000 * k)))[1])
    case("latency", lambda port: latency(port, 1000, 5.0 if not args.quick else 2.0))
    case("latency_buffered", lambda port: latency(port, 1000, 5.0 if not args.quick else 2.0, 0))
    case("pynsq_pub", lambda port: pynsq("pub", port, int(5000 * k)))
    case("pynsq_mpub", lambda port: pynsq("mpub", port, int(50000 * k)))
    case("pynsq_consume", lambda port: (fill(port, int(30000 * k)), pynsq("consume", port, int(30000 * k)))[1])
    if not want or "client" in want:
        for name, fn in (("client_pub1", lambda port: pub_one_at_a_time(port, 20000)),
                         ("client_mpub100", lambda port: pipelined(port, 500000, p.encode_mpub(b"bench", [b"x" * 100] * 100), 100, 4)),
                         ("client_consume", lambda port: consume(port, 300000))):
            print(f"... {name}", file=sys.stderr, flush=True)
            results[name] = fn(null_server("consume" if "consume" in name else "pub"))
            print(f"    {results[name]}", file=sys.stderr, flush=True)
    if want and "channels" in want:
        print("... channels", file=sys.stderr, flush=True)
        results["channels"] = channels([int(x) for x in args.channels.split(",")],
                                       max(1, int(args.rounds * k)), args.per_round, args.size)
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()}
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
    elif args.markdown:
        d = results.get("direct")
        if d:
            print(f"Reference, same run (FDQ API in-process, no broker): push_many(100) "
                  f"{d['push_many100_per_s']:,.0f} msgs/s; fetch(200) + ack_many {d['fetch200_ack_per_s']:,.0f} msgs/s\n")
        print("| case | msgs | msgs/s | p50 ms | p99 ms |\n|---|---:|---:|---:|---:|")
        for name, r in results.items():
            if name in ("direct", "channels"):
                continue
            f = lambda v: "" if v is None else (f"{v:,.0f}" if v >= 100 else f"{v:.2f}")  # noqa: E731
            print(f"| {name} | {r.get('msgs', '')} | {f(r.get('msgs_per_s'))} | {f(r.get('p50_ms'))} | {f(r.get('p99_ms'))} |")
    else:
        for name, r in results.items():
            if name != "channels":
                print(f"{name:16} {r}")
    if "channels" in results and not args.json:
        print(f"\nload average {os.getloadavg()[0]:.2f}; {args.size}-byte PUBs, one at a time")
        for where, rows in results["channels"].items():
            what, cpu, per = ("channels", "broker CPU", "PUB") if where == "broker" else ("subscriptions", "CPU", "push")
            if where != "broker":
                print("in process (Producer.push, the reference):")
            for n, r in rows.items():
                print(f"{n:>5} {what}: p50 {r['p50_ms']:6.2f} ms ({r['of_first']:4.1f}x)  p90 {r['p90_ms']:6.2f} ms"
                      f"  {cpu} {r['cpu_ms_per_call']:5.2f} ms/{per}")


if __name__ == "__main__":
    main()
