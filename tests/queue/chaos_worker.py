"""Worker processes of the chaos test (``python chaos_worker.py ROLE ...``), each a real
FDQ client the test ``kill -9``s and restarts at random. Every random choice comes from
``random.Random(seed)``. Evidence survives the kill:

* a line per event appended with ``os.write`` to an ``O_APPEND`` file (on disk as soon
  as written): producers log each push *after* it returned (an acknowledged push),
  at-least-once / at-most-once consumers log each handler call (``H``) and, at most
  once, what each taking transaction may take (``T``, before its commit);
* exactly-once consumers write through the dequeue transaction: a counter
  ``ch/done/<id>`` and a commit-ordered entry ``ch/order/<versionstamp> = id``;
* the supervisor journals ``B <op>`` before and ``E <t> <result>`` after each operation,
  and on start reruns an operation a kill left unfinished (as the README says to).
"""
from __future__ import annotations

import argparse
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
TAG = "g"                     # the dispatch tag some messages carry and some consumers want
STOP = threading.Event()      # set by SIGTERM (installed before anything else)


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


def producer(args):
    """Push ``--count`` messages (bodies ``<name>.<gen>:<seq>``): singles and batches,
    shard keys from a small set, some without a key, a few delayed (keys of their own,
    so they do not take part in the per-key order), some with a ``msg_id`` that this
    producer or another one pushes again, some with dispatch tag ``g`` (keys ``gk<n>``
    of their own: a tag's shards are not the untagged ones)."""
    import fdq
    rng = random.Random(args.seed)
    db = fdq.connect(args.url)
    p = fdq.Producer(db)
    out = Log(args.out)
    seq = 0
    print("ready", flush=True)
    while seq < args.count:
        n = 1 if rng.random() < 0.4 else rng.randint(2, 20)
        n = min(n, args.count - seq)
        envs = []
        for s in range(seq, seq + n):
            body = f"{args.name}.{args.gen}:{s}".encode()
            r = rng.random()
            delay = key = msg_id = None
            if r < 0.03:
                delay = rng.uniform(0.05, 0.5)
                key = f"d-{args.name}.{args.gen}:{s}" if rng.random() < 0.5 else None
            elif r < 0.15:
                key = None
            else:
                key = f"k{rng.randrange(args.keys)}"
            headers = None
            if rng.random() < 0.15:
                headers = {"##client_dispatch_tag": TAG}
                if key is not None and not key.startswith("d-"):
                    key = "g" + key
            if rng.random() < 0.08:
                # a shared pool: several producers (and restarts) push the same ids
                msg_id = f"m{rng.randrange(args.count // 4 + 1)}"
            if rng.random() < 0.01:     # a body split across keys (over FDB's value limit)
                size = rng.randint(100_000, 300_000)
                body += b"|%d|" % size + bytes([97 + s % 26]) * size
            envs.append(fdq.Envelope(body, shard_key=key, delay=delay, msg_id=msg_id, headers=headers))
        if n == 1:
            e = envs[0]
            results = [p.push(TOPIC, e.body, shard_key=e.shard_key, msg_id=e.msg_id, delay=e.delay,
                              headers=e.headers)]
        else:
            results = p.push_many(TOPIC, envs)
        for e, r in zip(envs, results):
            out.write(json.dumps({"id": r.id, "key": e.shard_key, "body": e.body.split(b"|")[0].decode(),
                                  "msg_id": e.msg_id, "delay": e.delay, "dup": bool(r.duplicate)}))
        seq += n
        if args.pace:     # spread the pushes over the chaos (mean 7 messages a push)
            time.sleep(rng.uniform(0, 2 * args.pace * 7 / args.total))
    print("done", flush=True)


def consumer(args):
    import fdq
    import fdq.delivery
    from fdq.keyspace import vs_key
    rng = random.Random(args.seed)
    rng_lock = threading.Lock()
    db = fdq.connect(args.url)
    out = Log(args.out)
    errors = []

    if args.mode == "amo":
        original = fdq.delivery.take_batch

        def take_batch(*a, **kw):
            taken = original(*a, **kw)
            for t in taken:
                out.write(f"T {fdq.keyspace.message_id(t.vs)}")
            return taken
        fdq.delivery.take_batch = take_batch

    user_versions = weakref.WeakKeyDictionary()

    def bad(m):
        """Whether ``m``'s body is not what its producer pushed (a large one: its size and fill)."""
        parts = m.body.split(b"|", 2)
        if len(parts) == 1:
            return False
        seq = int(parts[0].rsplit(b":", 1)[1])
        return len(parts) != 3 or parts[2] != bytes([97 + seq % 26]) * int(parts[1])

    def eo_handler(tr, m):
        if bad(m):
            tr.add(b"ch/bad/" + m.id.encode(), (1).to_bytes(8, "little"))
        tr.add(b"ch/done/" + m.id.encode(), (1).to_bytes(8, "little"))
        uv = user_versions.get(tr, 0)
        user_versions[tr] = uv + 1
        tr.set_versionstamped_key(vs_key(b"ch/order/", uv), m.id.encode())

    def handler(m):
        if bad(m):
            out.write(f"BAD {m.id} {len(m.body)}")
        with rng_lock:
            r = rng.random()
        if args.mode == "amo":
            out.write(f"H {time.monotonic_ns()} {m.id} {m.attempts} ack")
            return
        outcome = "nak" if r < 0.08 else "term" if r < 0.11 else "slow" if r < 0.115 else "ack"
        out.write(f"H {time.monotonic_ns()} {m.id} {m.attempts} {outcome}")
        if outcome == "nak":
            raise RuntimeError("chaos nak")
        if outcome == "term":
            m.term("chaos term")
        elif outcome == "slow":
            time.sleep(args.ack_wait * 1.3)     # its lease expires: redelivered

    def on_error(e):
        errors.append(f"{type(e).__name__}: {e}"[:300])

    # a batch size and, at least once, handler threads (a pool: settles commit on their own) at random
    concurrency = rng.choice([1, 1, 2, 4]) if args.mode == "alo" else 1
    config = fdq.ConsumerConfig(heartbeat_interval_s=0.2, zombie_timeout_s=1.0, ack_wait_s=args.ack_wait,
                                max_deliver=3, backoff_s=(0.0, 0.05), lease_check_interval_s=0.1,
                                poll_interval_s=0.2, max_concurrency=concurrency)
    kw = dict(consumer_id=args.name, subscription=args.sub, config=config,
              batch_size=rng.choice([1, 5, 10, 10, 50]), on_error=on_error,
              extend_support=True, desired_tag=TAG if args.tag else None)
    if args.mode == "eo":
        c = fdq.tail(db, TOPIC, eo_handler, transactional=True, **kw)
    else:
        c = fdq.tail(db, TOPIC, handler, acking=(args.mode == "alo"), **kw)
    print("ready", flush=True)
    STOP.wait()
    c.shutdown()
    if errors:
        print("\n".join(errors[-20:]), file=sys.stderr)
    print("stopped", flush=True)


def supervisor(args):
    """Random admin operations until SIGTERM (the one under way finishes first). A
    journaled operation without its end (a kill) is run again first."""
    import fdq
    rng = random.Random(args.seed)
    db = fdq.connect(args.url)
    sup = fdq.Supervisor(db)
    prod = fdq.Producer(db)
    journal = Log(args.out)
    stop = STOP

    def run(op):
        journal.write("B " + json.dumps(op) + f" {time.monotonic_ns()}")
        kind = op[0]
        result = None
        if kind == "pause":
            sup.pause(TOPIC)
        elif kind == "play":
            try:
                sup.play(TOPIC)
            except fdq.ConfigError:     # a reshard under way (a kill left it): finish it
                sup.rebalance(TOPIC)
                sup.play(TOPIC)
        elif kind == "rebalance":
            sup.rebalance(TOPIC, shards=op[1])
        elif kind == "replay":
            result = prod.replay(TOPIC, op[1], op[2])
        elif kind == "redrive":         # dead letters of an at-least-once subscription
            result = sup.dlq_redrive(TOPIC, op[1])
        elif kind == "trim":            # the log older than --trim-age, while consumers consume
            result = sup.trim(TOPIC, before_ms=op[1])
        journal.write(f"E {time.monotonic_ns()} {json.dumps(result)}")

    lines = _lines(args.out)
    if lines and lines[-1].startswith("B "):
        run(json.loads(lines[-1][2:].rsplit(" ", 1)[0]))
    print("ready", flush=True)
    while not stop.is_set():
        r = rng.random()
        if r < 0.22:
            op = ["pause"]
        elif r < 0.44:
            op = ["play"]
        elif r < 0.56:
            op = ["rebalance", None]
        elif r < 0.72:
            op = ["rebalance", rng.randint(2, 9)]
        elif r < 0.86:
            now = int(time.time() * 1000)
            start = now - rng.randint(200, 3000)
            op = ["replay", start, start + rng.randint(20, 300)]
        elif r < 0.94:
            op = ["redrive", rng.choice(["alo", "alu"])]
        else:
            op = ["trim", int((time.time() - args.trim_age) * 1000)]
        run(op)
        stop.wait(rng.uniform(0.05, 0.4))
    print("stopped", flush=True)


def main(argv=None):
    signal.signal(signal.SIGTERM, lambda *a: STOP.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # a stack dump if it hangs
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["producer", "consumer", "supervisor"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gen", type=int, default=0)
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--keys", type=int, default=6)
    ap.add_argument("--pace", type=float, default=0.0)    # producers: seconds the --total pushes should take
    ap.add_argument("--total", type=int, default=1)
    ap.add_argument("--mode", choices=["eo", "alo", "amo"], default="eo")
    ap.add_argument("--sub", default="default")
    ap.add_argument("--tag", action="store_true")       # consumers: want the dispatch tag's shards
    ap.add_argument("--ack-wait", type=float, default=0.6)
    ap.add_argument("--trim-age", type=float, default=5.0)    # supervisor: trim the log older than this (s)
    args = ap.parse_args(argv)
    {"producer": producer, "consumer": consumer, "supervisor": supervisor}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
