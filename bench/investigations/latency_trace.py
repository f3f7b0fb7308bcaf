"""Where does end-to-end latency go? The ``latency`` case of queue_bench.py, instrumented.

A producer process pushes single messages at ``--rate``/s; a consumer process (tail,
at-least-once) handles them. Both stamp events on CLOCK_MONOTONIC (shared by the
processes of one machine), and each message's latency is split into segments:

* ``push``: push called → its commit returned (producer);
* ``to_fire``: commit returned → the consumer's watch for that shard fired (the watch
  thread's ``_mark``); ``-`` when the message was found without a watch firing after
  its commit (a re-visit or sweep already under way);
* ``to_lease``: fire → the lease transaction that took it started (the worker waking);
* ``lease``: the lease transaction (start → end);
* ``to_handler``: lease end → handler called (earlier handlers of the batch, settles).

Run::

    python -m bench.investigations.latency_trace [--rate 1000] [--seconds 4]

Prints p50/p90/p99 per segment. Tracing only wraps methods (a few µs per event).
"""
from __future__ import annotations

import argparse
import bisect
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time

import fdq
import fdq.engine.retry
from fdq import consumer as _consumer

from bench._common import FAST, pct
from bench.queue_bench import BODY, SHARDS

_ns = time.monotonic_ns


def push_paced(p, rate, seconds, late=None) -> list:
    """Push ``rate`` single messages a second for ``seconds`` to topic ``lat`` (keys over
    64 shards; a body starts with the push's start time in ns and its number); returns
    when each push returned (ns). ``late``: appended how late each push started (s)."""
    interval = 1.0 / rate
    n = int(rate * seconds)
    done = [0] * n
    t0 = time.monotonic()
    for i in range(n):
        target = t0 + i * interval
        now = time.monotonic()
        if target > now:
            time.sleep(target - now)
        if late is not None:
            late.append(time.monotonic() - target)
        p.push("lat", _ns().to_bytes(8, "big") + i.to_bytes(4, "big") + BODY, shard_key=f"k{i % 64}")
        done[i] = _ns()
    return done


def _producer(url, rate, seconds, out):
    done = push_paced(fdq.Producer(fdq.connect(url)), rate, seconds)
    print(f"producer cpu_s {time.process_time():.2f}", flush=True)
    out.put(done)


def _consumer_proc(url, n, seconds, ready, out):
    fires = {}       # shard id -> sorted fire times (watch thread's _mark)
    lease_ev = threading.local()
    recs = []        # (i, t_push, t_handler, lease_start, lease_end, shard)
    counts = {"lease_tx": 0, "lease_empty": 0, "settle_tx": 0, "wakes": 0}

    orig_mark = _consumer.Consumer._mark

    def _mark(self, shard_id):
        if threading.current_thread().name == "fdq-watches":
            fires.setdefault(shard_id, []).append(_ns())
        return orig_mark(self, shard_id)
    _consumer.Consumer._mark = _mark

    # _lease_many (one transaction for the round's shards); before it, _lease_from (one per shard)
    lease_name = "_lease_many" if hasattr(_consumer.Consumer, "_lease_many") else "_lease_from"
    orig_lease = getattr(_consumer.Consumer, lease_name)

    def _lease_many(self, shards, *a, **k):
        s = _ns()
        r = orig_lease(self, shards, *a, **k)
        lease_ev.v = (s, _ns())
        rounds["lease_many"].append(lease_ev.v[1] - s)
        counts["lease_tx"] += 1
        counts["lease_empty"] += not r
        return r
    setattr(_consumer.Consumer, lease_name, _lease_many)

    orig_settle = _consumer.Consumer.settle
    rounds = {"lease_many": [], "arm": [], "settle": []}

    def settle(self, items):
        counts["settle_tx"] += bool(items)
        s = _ns()
        try:
            return orig_settle(self, items)
        finally:
            rounds["settle"].append(_ns() - s)
    _consumer.Consumer.settle = settle

    from fdq.engine import sqlite as _eng
    for name in ("begin_snapshot", "begin_immediate"):   # the engine's lock waits
        rounds[name] = []

        def wrap(fn, lst):
            def timed(*a, **k):
                s = _ns()
                try:
                    return fn(*a, **k)
                finally:
                    lst.append(_ns() - s)
            return timed
        setattr(_eng._Store, name, wrap(getattr(_eng._Store, name), rounds[name]))

    orig_arm = getattr(_consumer.Consumer, "_arm", None)

    def _arm(self, got):
        s = _ns()
        try:
            return orig_arm(self, got)
        finally:
            rounds["arm"].append(_ns() - s)
    if orig_arm is not None:
        _consumer.Consumer._arm = _arm

    orig_retry = fdq.engine.retry.retry_or_raise    # where transact retries the consumer's loops

    def retry_or_raise(tr, e):
        counts[f"retry_{getattr(e, 'code', '?')}"] = counts.get(f"retry_{getattr(e, 'code', '?')}", 0) + 1
        return orig_retry(tr, e)
    fdq.engine.retry.retry_or_raise = retry_or_raise

    orig_idle = _consumer.Consumer._idle

    def _idle(self, timeout):
        counts["wakes"] += 1
        return orig_idle(self, timeout)
    _consumer.Consumer._idle = _idle

    if os.environ.get("FDQ_TRACE_PROFILE"):   # cProfile the worker and watch threads
        import cProfile
        import pstats
        from fdq.engine import sqlite as _eng
        profs = []

        def profiled(fn):
            def run(*a, **k):
                pr = cProfile.Profile()
                profs.append((threading.current_thread().name, pr))
                pr.enable()
                try:
                    return fn(*a, **k)
                finally:
                    pr.disable()
            return run
        fdq.tailing.TailConsumer._work_loop = profiled(fdq.tailing.TailConsumer._work_loop)
        _eng._WatchManager._run = profiled(_eng._WatchManager._run)

        def dump():
            for name, pr in profs:
                print(f"--- profile of thread {name}", file=sys.stderr)
                pstats.Stats(pr, stream=sys.stderr).sort_stats(os.environ.get("FDQ_TRACE_PROFILE", "tottime")).print_stats(40)
    done = threading.Event()

    def handler(m):
        t = _ns()
        s, e = lease_ev.v
        recs.append((int.from_bytes(m.body[8:12], "big"), int.from_bytes(m.body[:8], "big"), t, s, e,
                     (m.tag, m.shard)))
        if len(recs) >= n:
            done.set()
    db = fdq.connect(url)
    c = fdq.tail(db, "lat", handler, config=fdq.ConsumerConfig(**FAST))
    ready.set()
    done.wait(seconds)
    c.shutdown()
    counts["cpu_s"] = round(time.process_time(), 2)
    for k, v in rounds.items():
        counts[f"{k}_p50_ms"] = round(pct(v, .5) / 1e6, 2)
        counts[f"{k}_p90_ms"] = round(pct(v, .9) / 1e6, 2)
        counts[f"{k}_sum_s"] = round(sum(v) / 1e9, 2)
    if os.environ.get("FDQ_TRACE_PROFILE"):
        dump()
    out.put((recs, fires, counts))


def run(rate, seconds):
    base = tempfile.mkdtemp(prefix="fdq-lat-")
    try:
        url = f"sqlite://{base}/lat.db"
        fdq.Supervisor(fdq.connect(url)).create_topic("lat", shards=SHARDS)
        ctx = mp.get_context("spawn")
        q, pq, ready = ctx.Queue(), ctx.Queue(), ctx.Event()
        n = int(rate * seconds)
        cons = ctx.Process(target=_consumer_proc, args=(url, n, seconds + 60, ready, q))
        cons.start()
        ready.wait(60)
        time.sleep(0.5)
        prod = ctx.Process(target=_producer, args=(url, rate, seconds, pq))
        prod.start()
        done = pq.get(timeout=seconds + 120)
        recs, fires, counts = q.get(timeout=seconds + 120)
        prod.join(30)
        cons.join(30)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    seg = {k: [] for k in ("total", "push", "to_fire", "to_lease", "lease", "to_handler")}
    no_fire = 0
    for i, t_push, t_h, ls, le, shard in recs:
        c = done[i]
        seg["total"].append(t_h - t_push)
        seg["push"].append(c - t_push)
        seg["lease"].append(le - ls)
        seg["to_handler"].append(t_h - le)
        fl = fires.get(shard, [])
        j = bisect.bisect_left(fl, c)
        if j < len(fl) and fl[j] <= ls:
            seg["to_fire"].append(fl[j] - c)
            seg["to_lease"].append(ls - fl[j])
        else:
            no_fire += 1
    print(f"rate {rate}/s, {len(recs)} delivered of {len(done)}; found without a watch fire: {no_fire}; "
          f"consumer: {counts}", flush=True)
    print(f"{'segment':<12}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}  n")
    for k, v in seg.items():
        v = [x / 1e6 for x in v]
        print(f"{k:<12}{pct(v, .5):9.2f}{pct(v, .9):9.2f}{pct(v, .99):9.2f}"
              f"{(max(v) if v else float('nan')):9.2f}  {len(v)}")
    return seg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=4)
    args = ap.parse_args(argv)
    run(args.rate, args.seconds)


if __name__ == "__main__":
    main()
