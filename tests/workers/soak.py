"""The roles of the combined-features soak (``tests/guarantees/test_soak.py``). Evidence is
written as by the chaos roles (``chaos.py``).

* ``soak-producer``: 3 threads pushing singles through a producer with ``linger_ms``
  (auto-batching) and a thread pushing ``push_many`` batches; keys from a small set,
  some unkeyed, a few delayed, some with a shared ``msg_id``, some with the dispatch
  tag ``g`` or a ``color`` header the ``flt`` subscription filters on;
* ``soak-consumer``: ``--mode eo`` (tail, exactly-once), ``alo`` (tail, at-least-once:
  ack, nak, term, in_progress, slow), ``fetch`` (pull: ack, ack_many, nak(delay), term,
  left to expire), ``aio`` (``fdq.aio.tail``);
* ``soak-supervisor``: random admin operations (two run at once): pause, play,
  rebalance, reshard, replay, trim, pause/play of one subscription, reset, update, DLQ
  redrive; journaled, and a killed one is run again on restart.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time

from common import Log, exactly_once_evidence, random_parser, random_tail_kwargs, stop_on_sigterm
from operate import apply, chooser, random_ops

TOPIC = "t"
TAG = "g"


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


def producer(args, stop):
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


def consumer(args, stop):
    import fdq
    import fdq.aio
    rng = random.Random(args.seed)
    rng_lock = threading.Lock()
    db = fdq.connect(args.url)
    out = Log(args.out)
    errors = []
    record = exactly_once_evidence(f"so/{args.sub}/".encode())

    def eo_handler(tr, m):
        record(tr, m)

    def outcome():
        with rng_lock:
            r = rng.random()
        return "nak" if r < 0.07 else "term" if r < 0.10 else "slow" if r < 0.105 else \
            "inprog" if r < 0.12 else "ack"

    def begin(m, o):
        """Log the handler call; nak (raise) or term as ``o`` says."""
        out.write(f"H {time.monotonic_ns()} {m.id} {m.attempts} {o}")
        if o == "nak":
            raise RuntimeError("soak nak")
        if o == "term":
            m.term("soak term")

    def handler(m):
        o = outcome()
        begin(m, o)
        if o == "slow":
            time.sleep(args.ack_wait * 1.3)
        elif o == "inprog":
            for _ in range(3):
                time.sleep(args.ack_wait * 0.4)
                m.in_progress()

    async def aio_handler(m):
        o = outcome()
        if o == "inprog":
            o = "ack"
        begin(m, o)
        if o == "slow":
            await asyncio.sleep(args.ack_wait * 1.3)
        elif o != "term":
            await asyncio.sleep(0)

    def on_error(e):
        errors.append(f"{type(e).__name__}: {e}"[:300])

    kw = random_tail_kwargs(fdq, args, rng, on_error,
                            concurrency=rng.choice([1, 2, 4]) if args.mode in ("alo", "aio") else 1,
                            batch_sizes=[1, 5, 10, 50], tag=TAG)
    if args.mode == "eo":
        c = fdq.tail(db, TOPIC, eo_handler, transactional=True, **kw)
        print("ready", flush=True)
        stop.wait()
        c.shutdown()
    elif args.mode == "alo":
        c = fdq.tail(db, TOPIC, handler, acking=True, **kw)
        print("ready", flush=True)
        stop.wait()
        c.shutdown()
    elif args.mode == "aio":
        async def run():
            t = await fdq.aio.tail(db, TOPIC, aio_handler, **kw)
            print("ready", flush=True)
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await t.shutdown()
        asyncio.run(run())
    else:       # fetch: pull style
        batch = kw.pop("batch_size")
        c = fdq.Consumer(db, TOPIC, **kw)
        print("ready", flush=True)
        while not stop.is_set():
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


def supervisor(args, stop):
    import fdq
    db = fdq.connect(args.url)
    sup = fdq.Supervisor(db)
    prod = fdq.Producer(db)
    subs = args.subs.split(",")

    def run(op):
        try:
            return apply(sup, prod, TOPIC, op)
        except fdq.ConfigError as e:    # another supervisor's reshard under way
            return f"ConfigError: {e}"

    choose = chooser([(0.15, "pause"), (0.32, "play"), (0.42, "rebalance"), (0.56, "reshard"), (0.68, "replay"),
                      (0.74, "redrive"), (0.80, "trim"), (0.84, "pause_sub"), (0.88, "play_sub"), (0.96, "reset"),
                      (1.0, "update")], trim_age=args.trim_age, redrive=("alo", "flt", "rsa"), subs=subs)
    random_ops(args, choose, run, stop, wall_time=True)


def main(role, argv):
    stop = stop_on_sigterm()
    ap = random_parser(role, keys=5, modes=["eo", "alo", "fetch", "aio"])
    ap.add_argument("--subs", default="default")
    args = ap.parse_args(argv)
    {"soak-producer": producer, "soak-consumer": consumer, "soak-supervisor": supervisor}[role](args, stop)
