"""The roles of the chaos test (``tests/guarantees/test_chaos.py``), each a real FDQ client
the test ``kill -9``s and restarts at random. Every random choice comes from
``random.Random(--seed)``. Evidence survives the kill:

* ``chaos-producer`` logs each push *after* it returned (an acknowledged push);
* ``chaos-consumer``: at least / at most once, each handler call (``H``) and, at most
  once, what each taking transaction may take (``T``, before its commit); exactly once,
  through the dequeue transaction: a counter ``ch/done/<id>`` and a commit-ordered
  entry ``ch/order/<versionstamp> = id``;
* ``chaos-supervisor`` journals ``B <op>`` before and ``E <t> <result>`` after each
  operation, and on start reruns an operation a kill left unfinished.
"""
from __future__ import annotations

import json
import random
import sys
import threading
import time

from common import Log, exactly_once_evidence, random_parser, random_tail_kwargs, stop_on_sigterm
from consume import log_takes
from operate import apply, chooser, random_ops

TOPIC = "t"
TAG = "g"                     # the dispatch tag some messages carry and some consumers want


def producer(args, stop):
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


def consumer(args, stop):
    import fdq
    rng = random.Random(args.seed)
    rng_lock = threading.Lock()
    db = fdq.connect(args.url)
    out = Log(args.out)
    errors = []
    if args.mode == "amo":
        log_takes(out)
    record = exactly_once_evidence(b"ch/")

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
        record(tr, m)

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
    kw = random_tail_kwargs(fdq, args, rng, on_error, concurrency=concurrency, batch_sizes=[1, 5, 10, 10, 50],
                            tag=TAG)
    if args.mode == "eo":
        c = fdq.tail(db, TOPIC, eo_handler, transactional=True, **kw)
    else:
        c = fdq.tail(db, TOPIC, handler, acking=(args.mode == "alo"), **kw)
    print("ready", flush=True)
    stop.wait()
    c.shutdown()
    if errors:
        print("\n".join(errors[-20:]), file=sys.stderr)
    print("stopped", flush=True)


def supervisor(args, stop):
    """Random admin operations until SIGTERM (the one under way finishes first): pause,
    play, rebalance, reshard, replay a window, redrive ``alo`` or ``alu``, trim the log
    older than ``--trim-age``."""
    import fdq
    db = fdq.connect(args.url)
    sup = fdq.Supervisor(db)
    prod = fdq.Producer(db)

    def run(op):
        try:
            return apply(sup, prod, TOPIC, op)
        except fdq.ConfigError:
            if op[0] != "play":
                raise
            sup.rebalance(TOPIC)        # a reshard under way (a kill left it): finish it
            sup.play(TOPIC)
            return None

    choose = chooser([(0.22, "pause"), (0.44, "play"), (0.56, "rebalance"), (0.72, "reshard"), (0.86, "replay"),
                      (0.94, "redrive"), (1.0, "trim")], trim_age=args.trim_age, redrive=("alo", "alu"))
    random_ops(args, choose, run, stop)


def main(role, argv):
    stop = stop_on_sigterm()       # before anything else
    ap = random_parser(role, keys=6, modes=["eo", "alo", "amo"])
    ap.add_argument("--total", type=int, default=1)     # producers: the pushes --pace spreads
    args = ap.parse_args(argv)
    {"chaos-producer": producer, "chaos-consumer": consumer, "chaos-supervisor": supervisor}[role](args, stop)
