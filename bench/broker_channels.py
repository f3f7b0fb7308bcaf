"""PUB round trip through the broker against the number of idle channels of the topic.

Run::

    python bench/broker_channels.py               # 1, 10, 100 channels, 15 rounds of 40 PUBs
    python bench/broker_channels.py --channels 1,10,100,300 --rounds 20

One broker process and database; one topic per channel count, its channels created by
``/channel/create`` (no consumers). The topics are published to in turn, round by round
(same run, same machine load), one PUB at a time (send, wait for OK). Reported: p50/p90
round trip and the broker's CPU seconds per PUB (from /proc, the rounds of each topic
alone). Each channel is an FDQ subscription, and a push writes the message into every
subscription's shard queue (design.md, fan-out on write): the cost grows with channels.
Then the same in process (``Producer.push`` one at a time, topics with as many
subscriptions, a database of its own) as the reference: what the push itself costs.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--channels", default="1,10,100")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--per-round", type=int, default=40)
    ap.add_argument("--size", type=int, default=100)
    a = ap.parse_args()
    counts = [int(x) for x in a.channels.split(",")]
    d = tempfile.mkdtemp()
    proc = subprocess.Popen([sys.executable, "-m", "fdq.broker", "--url", f"sqlite:///{d}/fdq.db",
                             "--tcp-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        parts = dict(kv.split("=") for kv in proc.stdout.readline().split()[1:])
        tcp, http = parts["tcp"], parts["http"]
        for n in counts:
            for i in range(n):
                req = urllib.request.Request(f"http://{http}/channel/create?topic=t{n}&channel=c{i}", data=b"")
                urllib.request.urlopen(req, timeout=30).read()
        host, port = tcp.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(b"  V2")
        body = b"x" * a.size
        frames = {n: f"PUB t{n}\n".encode() + struct.pack(">I", len(body)) + body for n in counts}
        lat = {n: [] for n in counts}
        cpu = {n: 0.0 for n in counts}
        deadline = time.monotonic() + 600
        for _ in range(a.rounds):
            for n in counts:
                c0 = cpu_s(proc.pid)
                for _ in range(a.per_round):
                    t0 = time.perf_counter()
                    s.sendall(frames[n])
                    got = b""
                    while len(got) < 10:
                        got += s.recv(10 - len(got))
                    lat[n].append(time.perf_counter() - t0)
                cpu[n] += cpu_s(proc.pid) - c0
            if time.monotonic() > deadline:
                break
        print(f"load average {os.getloadavg()[0]:.2f}; {a.size}-byte PUBs, one at a time")
        report(counts, lat, cpu, "channels", "broker CPU", "PUB")
    finally:
        proc.terminate()
        proc.wait(30)
    inprocess(counts, a.rounds, a.per_round, body)


def inprocess(counts, rounds, per_round, body):
    sys.path.insert(0, ROOT)
    from fdq import Producer, Supervisor, connect
    db = connect(f"sqlite:///{tempfile.mkdtemp()}/ref.db")
    sup = Supervisor(db)
    for n in counts:
        sup.create_topic(f"t{n}", subs=tuple(f"c{i}" for i in range(n)))
    prod = Producer(db)
    lat = {n: [] for n in counts}
    cpu = {n: 0.0 for n in counts}
    for _ in range(rounds):
        for n in counts:
            c0 = time.process_time()
            for _ in range(per_round):
                t0 = time.perf_counter()
                prod.push(f"t{n}", body)
                lat[n].append(time.perf_counter() - t0)
            cpu[n] += time.process_time() - c0
    print("in process (Producer.push, the reference):")
    report(counts, lat, cpu, "subscriptions", "CPU", "push")


def report(counts, lat, cpu, what, cpu_name, per):
    """One line per count: p50 (and its ratio to the first count's), p90, CPU per call."""
    base = statistics.median(lat[counts[0]])
    for n in counts:
        r = sorted(lat[n])
        p50 = statistics.median(r)
        print(f"{n:>5} {what}: p50 {p50 * 1e3:6.2f} ms ({p50 / base:4.1f}x)"
              f"  p90 {r[int(len(r) * .9)] * 1e3:6.2f} ms"
              f"  {cpu_name} {cpu[n] / len(r) * 1e3:5.2f} ms/{per}")


if __name__ == "__main__":
    main()
