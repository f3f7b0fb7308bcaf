"""Worker processes of the combined-features soak (``test_soak.py``): ``python
soak_worker.py ROLE ...``. Evidence is written as in ``chaos_worker.py`` (an ``O_APPEND``
line per event; exactly-once consumers write through the dequeue transaction).

Roles:

* ``producer``: 3 threads pushing singles through a producer with ``linger_ms``
  (auto-batching) and a thread pushing ``push_many`` batches; keys from a small set,
  some unkeyed, a few delayed, some with a shared ``msg_id``, some with the dispatch
  tag ``g`` or a ``color`` header the ``flt`` subscription filters on;
* ``consumer``: ``--mode eo`` (tail, exactly-once), ``alo`` (tail, at-least-once:
  ack, nak, term, in_progress, slow), ``fetch`` (pull: ack, ack_many, nak(delay), term,
  left to expire), ``aio`` (``fdq.aio.tail``);
* ``supervisor``: random admin operations (two run at once): pause, play, rebalance,
  reshard, replay, trim, pause/play of one subscription, DLQ redrive; journaled, and a
  killed one is run again on restart.
"""
from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import random
import signal
import sys
import threading
import time
import weakref

TOPIC = "t"
TAG = "g"
STOP = threading.Event()


class Log:
    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, line: str):
        os.write(self.fd, (line + "\n").encode())


def _lines(path):
    try:
        with open(path) as f:
            return [line.rstrip("\n") for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _envelope(fdq, rng, args, s):
    body = f"{args.name}.{args.gen}:{s}".encode()
    r = rng.random()
    delay = key = msg_id = None
    if r < 0.04:
        delay = rng.uniform(0.05, 0.8)
        key = f"d-{args.name}.{args.gen}:{s}"
    elif r < 0.15:
        key = None
    else:
        key = f"k{rng.randrange(args.keys)}"
    headers = {}
    if rng.random() < 0.12:
        headers["##client_dispatch_tag"] = TAG
        if key is not None and not key.startswith("d-"):
            key = "g" + key
    if rng.random() < 0.3:
        headers["color"] = rng.choice(["red", "blue"])
    if rng.random() < 0.08:
        msg_id = f"m{rng.randrange(args.count // 4 + 1)}"
    return fdq.Envelope(body, shard_key=key, delay=delay, msg_id=msg_id, headers=headers or None)


def producer(args):
    import fdq
    db = fdq.connect(args.url)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=2))
    out = Log(args.out)
    lock = threading.Lock()
    seq = [0]
    errors = []

    def next_seqs(n):
        with lock:
            n = min(n, args.count - seq[0])
            s = seq[0]
            seq[0] += n
            return range(s, s + n)

    def record(e, r):
        out.write(json.dumps({"id": r.id, "key": e.shard_key, "body": e.body.decode(), "msg_id": e.msg_id,
                              "delay": e.delay, "dup": bool(r.duplicate), "headers": dict(e.headers or {})}))

    def single(i):
        rng = random.Random(args.seed * 10 + i)
        try:
            while True:
                ss = next_seqs(1)
                if not ss:
                    return
                # a key's pushes from two threads at once have no order: one thread per key
                e = _envelope(fdq, rng, args, ss[0])
                if e.shard_key is not None and not e.shard_key.startswith("d-"):
                    e = fdq.Envelope(e.body, shard_key=f"{e.shard_key}.{i}", delay=e.delay, msg_id=e.msg_id,
                                     headers=e.headers)
                r = p.push(TOPIC, e.body, shard_key=e.shard_key, msg_id=e.msg_id, delay=e.delay,
                           headers=e.headers)
                record(e, r)
                time.sleep(rng.uniform(0, 2 * args.pace / max(args.count, 1) * 4))
        except BaseException as ex:     # noqa: BLE001 - reported below
            errors.append(repr(ex))

    def many():
        rng = random.Random(args.seed * 10 + 9)
        try:
            while True:
                ss = next_seqs(rng.randint(2, 20))
                if not ss:
                    return
                envs = [_envelope(fdq, rng, args, s) for s in ss]
                for e, r in zip(envs, p.push_many(TOPIC, envs)):
                    record(e, r)
                time.sleep(rng.uniform(0, 2 * args.pace / max(args.count, 1) * 10))
        except BaseException as ex:     # noqa: BLE001
            errors.append(repr(ex))

    print("ready", flush=True)
    threads = [threading.Thread(target=single, args=(i,)) for i in range(3)] + [threading.Thread(target=many)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        print("\n".join(errors), file=sys.stderr)
        sys.exit(3)
    print("done", flush=True)


def consumer(args):
    import fdq
    import fdq.aio
    from fdq.keyspace import vs_key
    rng = random.Random(args.seed)
    rng_lock = threading.Lock()
    db = fdq.connect(args.url)
    out = Log(args.out)
    errors = []
    user_versions = weakref.WeakKeyDictionary()
    prefix = f"so/{args.sub}/".encode()

    def eo_handler(tr, m):
        tr.add(prefix + b"done/" + m.id.encode(), (1).to_bytes(8, "little"))
        uv = user_versions.get(tr, 0)
        user_versions[tr] = uv + 1
        tr.set_versionstamped_key(vs_key(prefix + b"order/", uv), m.id.encode())

    def outcome():
        with rng_lock:
            r = rng.random()
        return "nak" if r < 0.07 else "term" if r < 0.10 else "slow" if r < 0.105 else \
            "inprog" if r < 0.12 else "ack"

    def handler(m):
        o = outcome()
        out.write(f"H {time.monotonic_ns()} {m.id} {m.attempts} {o}")
        if o == "nak":
            raise RuntimeError("soak nak")
        if o == "term":
            m.term("soak term")
        elif o == "slow":
            time.sleep(args.ack_wait * 1.3)
        elif o == "inprog":
            for _ in range(3):
                time.sleep(args.ack_wait * 0.4)
                m.in_progress()

    async def aio_handler(m):
        o = outcome()
        if o == "inprog":
            o = "ack"
        out.write(f"H {time.monotonic_ns()} {m.id} {m.attempts} {o}")
        if o == "nak":
            raise RuntimeError("soak nak")
        if o == "term":
            m.term("soak term")
        elif o == "slow":
            await asyncio.sleep(args.ack_wait * 1.3)
        else:
            await asyncio.sleep(0)

    def on_error(e):
        errors.append(f"{type(e).__name__}: {e}"[:300])

    config = fdq.ConsumerConfig(heartbeat_interval_s=0.2, zombie_timeout_s=1.0, ack_wait_s=args.ack_wait,
                                max_deliver=3, backoff_s=(0.0, 0.05), lease_check_interval_s=0.1,
                                poll_interval_s=0.2,
                                max_concurrency=rng.choice([1, 2, 4]) if args.mode in ("alo", "aio") else 1)
    kw = dict(consumer_id=args.name, subscription=args.sub, config=config,
              batch_size=rng.choice([1, 5, 10, 50]), on_error=on_error, extend_support=True,
              desired_tag=TAG if args.tag else None)
    if args.mode == "eo":
        c = fdq.tail(db, TOPIC, eo_handler, transactional=True, **kw)
        print("ready", flush=True)
        STOP.wait()
        c.shutdown()
    elif args.mode == "alo":
        c = fdq.tail(db, TOPIC, handler, acking=True, **kw)
        print("ready", flush=True)
        STOP.wait()
        c.shutdown()
    elif args.mode == "aio":
        async def run():
            t = await fdq.aio.tail(db, TOPIC, aio_handler, **kw)
            print("ready", flush=True)
            while not STOP.is_set():
                await asyncio.sleep(0.05)
            await t.shutdown()
        asyncio.run(run())
    else:       # fetch: pull style
        batch = kw.pop("batch_size")
        c = fdq.Consumer(db, TOPIC, **kw)
        print("ready", flush=True)
        while not STOP.is_set():
            try:
                ms = c.fetch(batch, timeout=0.3)
            except fdq.FDQError as e:
                on_error(e)
                time.sleep(0.1)
                continue
            acks = []
            for m in ms:
                with rng_lock:
                    r = rng.random()
                o = "nak" if r < 0.07 else "term" if r < 0.10 else "expire" if r < 0.11 else \
                    "inprog" if r < 0.13 else "ack"
                out.write(f"H {time.monotonic_ns()} {m.id} {m.attempts} {o}")
                try:
                    if o == "nak":
                        m.nak(rng.choice([0, 0.05, 0.2]))
                    elif o == "term":
                        m.term("soak term")
                    elif o == "inprog":
                        m.in_progress()
                        m.ack()
                    elif o == "ack":
                        acks.append(m)
                except fdq.FDQError as e:
                    on_error(e)
            try:
                if acks:
                    c.ack_many(acks)
            except fdq.FDQError as e:
                on_error(e)
        c.close()
    if errors:
        print("\n".join(errors[-20:]), file=sys.stderr)
    print("stopped", flush=True)


def supervisor(args):
    import fdq
    rng = random.Random(args.seed)
    db = fdq.connect(args.url)
    sup = fdq.Supervisor(db)
    prod = fdq.Producer(db)
    journal = Log(args.out)
    subs = args.subs.split(",")

    def run(op):
        journal.write("B " + json.dumps(op) + f" {time.monotonic_ns()}")
        kind = op[0]
        result = None
        try:
            if kind == "pause":
                sup.pause(TOPIC)
            elif kind == "play":
                sup.play(TOPIC)
            elif kind == "rebalance":
                sup.rebalance(TOPIC, shards=op[1])
            elif kind == "replay":
                result = prod.replay(TOPIC, op[1], op[2])
            elif kind == "redrive":
                result = sup.dlq_redrive(TOPIC, op[1])
            elif kind == "trim":
                result = sup.trim(TOPIC, before_ms=op[1])
            elif kind == "pause_sub":
                result = sup.pause_subscription(TOPIC, op[1])
            elif kind == "play_sub":
                result = sup.play_subscription(TOPIC, op[1])
            elif kind == "reset":       # "rst" (exactly-once) or "rsa": rewind, or skip to now
                sup.play(TOPIC)         # (refused while paused)
                result = sup.reset(TOPIC, op[2] if len(op) > 2 else "rst", op[1])
            elif kind == "update":
                result = sup.update_subscription(TOPIC, "flt", **op[1]).max_ack_pending
        except fdq.ConfigError as e:    # another supervisor's reshard under way
            result = f"ConfigError: {e}"
        journal.write(f"E {time.monotonic_ns()} {int(time.time() * 1000)} {json.dumps(result)}")

    lines = _lines(args.out)
    if lines and lines[-1].startswith("B "):
        run(json.loads(lines[-1][2:].rsplit(" ", 1)[0]))
    print("ready", flush=True)
    while not STOP.is_set():
        r = rng.random()
        if r < 0.15:
            op = ["pause"]
        elif r < 0.32:
            op = ["play"]
        elif r < 0.42:
            op = ["rebalance", None]
        elif r < 0.56:
            op = ["rebalance", rng.randint(2, 9)]
        elif r < 0.68:
            now = int(time.time() * 1000)
            start = now - rng.randint(200, 3000)
            op = ["replay", start, start + rng.randint(20, 300)]
        elif r < 0.74:
            op = ["redrive", rng.choice(["alo", "flt", "rsa"])]
        elif r < 0.80:
            op = ["trim", int((time.time() - args.trim_age) * 1000)]
        elif r < 0.84:
            op = ["pause_sub", rng.choice(subs)]
        elif r < 0.88:
            op = ["play_sub", rng.choice(subs)]
        elif r < 0.96:
            op = ["reset", rng.choice([None, int(time.time() * 1000) - rng.randint(0, 3000)]),
                  rng.choice(["rst", "rsa"])]
        else:
            op = ["update", {"max_ack_pending": rng.choice([1, 2, 3, None]),
                             "ack_wait_s": rng.choice([None, 0.4, 0.8])}]
        run(op)
        STOP.wait(rng.uniform(0.05, 0.4))
    print("stopped", flush=True)


def main(argv=None):
    signal.signal(signal.SIGTERM, lambda *a: STOP.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["producer", "consumer", "supervisor"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gen", type=int, default=0)
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--keys", type=int, default=5)
    ap.add_argument("--pace", type=float, default=0.0)
    ap.add_argument("--mode", choices=["eo", "alo", "fetch", "aio"], default="eo")
    ap.add_argument("--sub", default="default")
    ap.add_argument("--subs", default="default")
    ap.add_argument("--tag", action="store_true")
    ap.add_argument("--ack-wait", type=float, default=0.6)
    ap.add_argument("--trim-age", type=float, default=5.0)
    args = ap.parse_args(argv)
    {"producer": producer, "consumer": consumer, "supervisor": supervisor}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
