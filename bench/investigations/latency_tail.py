"""What makes the slowest 1% of end-to-end latency? The ``latency`` case of queue_bench.py
(a producer process pushing single messages at 1,000/s, a tail consumer process,
at-least-once), with every engine lock wait, commit, WAL restart, GC pass and consumer
membership step of both processes recorded on CLOCK_MONOTONIC.

For the slowest 1% of messages and for 40 median ones it prints the mean time per message
that each kind of event overlapped the message's life (push called -> handler called),
the segments of bench/investigations/latency_trace.py, and the consumer worker thread's CPU time and
run-queue wait (``/proc/thread-self/schedstat``: runnable but not running, i.e. the host's
CPUs were busy) over that life; then each event kind's duration (count, p50, p99, max).

    python -m bench.investigations.latency_tail [--seconds 4] [--switch-interval S]

``--switch-interval`` sets ``sys.setswitchinterval`` in the consumer process (an
experiment: CPython's default is 5 ms).
"""
import argparse
import bisect
import gc
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import fdq
from fdq import consumer as _c
from fdq.ops import membership as _m
from fdq.member import Member
from fdq.engine import sqlite as _eng

from bench._common import FAST, pct
from bench.investigations.latency_trace import push_paced
from bench.queue_bench import SHARDS

_ns = time.monotonic_ns

def schedstat():
    with open("/proc/thread-self/schedstat") as f:
        a = f.read().split()
    return int(a[0]), int(a[1])

def instrument(ev):
    def wrap(obj, name, kind=None, extra=None):
        fn = getattr(obj, name)
        def w(*a, **k):
            s = _ns()
            try:
                return fn(*a, **k)
            finally:
                ev.append((kind or name, threading.current_thread().name[:10], s, _ns()))
        setattr(obj, name, w)
    for n in ("begin_snapshot", "begin_immediate", "restart_wal"):
        wrap(_eng._Store, n)
    wrap(_eng.Transaction, "_commit", "commit")
    gcs = {}
    def gccb(phase, info):
        if phase == "start":
            gcs["s"] = _ns()
        else:
            ev.append((f"gc{info['generation']}", threading.current_thread().name[:10], gcs.get("s", _ns()), _ns()))
    gc.callbacks.append(gccb)

def _producer(url, rate, seconds, out):
    ev = []
    instrument(ev)
    late = []
    done = push_paced(fdq.Producer(fdq.connect(url)), rate, seconds, late)
    out.put((done, ev, pct(late, .5), pct(late, .99)))

def _consumer_proc(url, n, seconds, ready, out, switch_interval):
    if switch_interval:
        sys.setswitchinterval(switch_interval)
    ev = []
    instrument(ev)
    fires = {}
    orig_mark = _c.Consumer._mark
    def _mark(self, shard_id):
        if threading.current_thread().name == "fdq-watches":
            fires.setdefault(shard_id, []).append(_ns())
        return orig_mark(self, shard_id)
    _c.Consumer._mark = _mark
    lease_ev = threading.local()
    worker_ss = []   # (t, cpu_ns, wait_ns) samples of the worker
    orig_lease = _c.Consumer._lease_many
    def _lease_many(self, shards, *a, **k):
        s = _ns(); ss = schedstat()
        worker_ss.append((s,) + ss)
        r = orig_lease(self, shards, *a, **k)
        e = _ns(); se = schedstat()
        worker_ss.append((e,) + se)
        lease_ev.v = (s, e)
        ev.append(("lease_many", "worker", s, e))
        return r
    _c.Consumer._lease_many = _lease_many
    orig_idle = _c.Consumer._idle
    def _idle(self, t):
        s = _ns(); ss = schedstat(); worker_ss.append((s,) + ss)
        r = orig_idle(self, t)
        e = _ns(); se = schedstat(); worker_ss.append((e,) + se)
        ev.append(("idle", "worker", s, e))
        return r
    _c.Consumer._idle = _idle
    for cls, name in ((Member, "check_leases"), (Member, "tick_clock"), (Member, "observe_peers"),
                      (_c.Consumer, "_refresh_owned"), (Member, "observe_subscriptions"),
                      (_c.Consumer, "settle")):
        fn = getattr(cls, name)
        def mk(fn, name):
            def w(self, *a, **k):
                s = _ns()
                try:
                    return fn(self, *a, **k)
                finally:
                    ev.append((name, threading.current_thread().name[:10], s, _ns()))
            return w
        setattr(cls, name, mk(fn, name))
    fn = _m.heartbeat
    def hb(*a, **k):
        s = _ns()
        try:
            return fn(*a, **k)
        finally:
            ev.append(("heartbeat", threading.current_thread().name[:10], s, _ns()))
    _m.heartbeat = hb
    recs = []
    done = threading.Event()
    def handler(m):
        t = _ns()
        s, e = lease_ev.v
        recs.append((int.from_bytes(m.body[8:12], "big"), int.from_bytes(m.body[:8], "big"), t, s, e, (m.tag, m.shard)))
        if len(recs) >= n:
            done.set()
    db = fdq.connect(url)
    c = fdq.tail(db, "lat", handler, config=fdq.ConsumerConfig(**FAST))
    ready.set()
    cpu0 = time.process_time()
    done.wait(seconds)
    cpu = time.process_time() - cpu0
    threads = {}
    tick = os.sysconf("SC_CLK_TCK")
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            threads[t.name[:12]] = round((int(st[11]) + int(st[12])) / tick, 2)
        except (OSError, IndexError, TypeError):
            pass
    c.shutdown()
    out.put((recs, fires, ev, worker_ss, cpu, threads))

def run(rate=1000, seconds=4.0, switch_interval=None):
    base = tempfile.mkdtemp(prefix="fdq-tail-")
    url = f"sqlite://{base}/lat.db"
    fdq.Supervisor(fdq.connect(url)).create_topic("lat", shards=SHARDS)
    ctx = mp.get_context("spawn")
    q, pq, ready = ctx.Queue(), ctx.Queue(), ctx.Event()
    n = int(rate * seconds)
    cons = ctx.Process(target=_consumer_proc, args=(url, n, seconds + 60, ready, q, switch_interval)); cons.start()
    ready.wait(60); time.sleep(0.5)
    la0 = os.getloadavg()[0]
    prod = ctx.Process(target=_producer, args=(url, rate, seconds, pq)); prod.start()
    done, pev, late50, late99 = pq.get(timeout=seconds + 120)
    recs, fires, ev, wss, cpu, threads = q.get(timeout=seconds + 120)
    prod.join(); cons.join(); shutil.rmtree(base, ignore_errors=True)
    print(f"load {la0:.2f}; producer lateness p50 {late50*1e3:.2f} p99 {late99*1e3:.2f} ms; consumer cpu {cpu:.2f}s; "
          f"CPU s per consumer thread (whole process life): {threads}")
    tot = sorted(((t_h - t_p) / 1e6, i, t_p, t_h, ls, le, sh) for i, t_p, t_h, ls, le, sh in recs)
    print("total p50 %.2f p99 %.2f" % (pct([x[0] for x in tot], .5), pct([x[0] for x in tot], .99)))
    allev = [(k, "P:" + th, s, e) for k, th, s, e in pev] + [(k, "C:" + th, s, e) for k, th, s, e in ev]
    wt = [x[0] for x in wss]
    def window_stats(sel, label):
        agg = {}
        sch = [0, 0, 0]
        for lat, i, t_p, t_h, ls, le, sh in sel:
            c = done[i]
            segs = {"push": c - t_p}
            fl = fires.get(sh, [])
            j = bisect.bisect_left(fl, c)
            if j < len(fl) and fl[j] <= ls:
                segs["to_fire"] = fl[j] - c; segs["to_lease"] = ls - fl[j]
            else:
                segs["to_lease(nofire)"] = ls - c
            segs["lease"] = le - ls
            for k, v in segs.items():
                agg.setdefault("SEG " + k, []).append(v)
            for k, th, s, e in allev:
                o = min(e, t_h) - max(s, t_p)
                if o > 0 and k not in ("idle",):
                    agg.setdefault(f"{th} {k}", []).append(o)
            # worker schedstat between t_p and t_h
            a = bisect.bisect_left(wt, t_p); b = bisect.bisect_right(wt, t_h) - 1
            if 0 <= a < b:
                sch[0] += wss[b][1] - wss[a][1]; sch[1] += wss[b][2] - wss[a][2]; sch[2] += wss[b][0] - wss[a][0]
        m = len(sel)
        print(f"--- {label}: {m} msgs, mean total {sum(x[0] for x in sel)/m:.2f} ms; worker over sampled span: "
              f"cpu {sch[0]/1e6/m:.2f} runqueue-wait {sch[1]/1e6/m:.2f} of {sch[2]/1e6/m:.2f} ms/msg")
        for k, v in sorted(agg.items(), key=lambda kv: -sum(kv[1])):
            if sum(v) / m / 1e6 < 0.05:
                continue
            print(f"  {k:<32} mean {sum(v)/m/1e6:7.2f} ms  (in {len(v)} msgs, max {max(v)/1e6:.1f})")
    window_stats(tot[-max(1, len(tot)//100):], "slowest 1%")
    mid = len(tot)//2
    window_stats(tot[mid-20:mid+20], "median 40")
    # event durations overall
    kinds = {}
    for k, th, s, e in allev:
        kinds.setdefault(f"{th} {k}", []).append((e - s) / 1e6)
    print("--- event durations (count, p50, p99, max ms)")
    for k, v in sorted(kinds.items()):
        v.sort()
        print(f"  {k:<32} {len(v):6d} {pct(v,.5):7.2f} {pct(v,.99):7.2f} {v[-1]:7.2f}")

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--switch-interval", type=float, default=None)
    args = ap.parse_args(argv)
    run(args.rate, args.seconds, args.switch_interval)


if __name__ == "__main__":
    main()
