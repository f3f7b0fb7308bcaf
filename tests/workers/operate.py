"""Supervisor roles, each printing ``start``, ``chunk N`` per chunk and ``done [TOTAL]``:
``play``, ``rebalance`` (to ``--count`` shards), ``replay`` (from 0), ``trim`` (by the
retention config, or before ``--before-ms``). ``jumper`` commits tiny transactions until killed, on a
fault-injecting connection: the engine injects version jumps (an FDB recovery).

:func:`random_ops` is the random operation loop of the chaos and soak supervisors, and
:func:`apply` the operations it runs.
"""
from __future__ import annotations

import json
import random
import time

from common import Log, parser, read_lines


def _progress(n):
    print(f"chunk {n}", flush=True)


def play(args):
    import fdq
    sup = fdq.Supervisor(fdq.connect(args.url))
    print("start", flush=True)
    total = sup.play(args.topic, progress=_progress)
    print(f"done {total}", flush=True)


def rebalance(args):
    import fdq
    sup = fdq.Supervisor(fdq.connect(args.url))
    print("start", flush=True)
    sup.rebalance(args.topic, shards=args.count, progress=_progress)
    print("done", flush=True)


def replay(args):
    import fdq
    db = fdq.connect(args.url)
    print("start", flush=True)
    total = fdq.Producer(db).replay(args.topic, 0, progress=_progress)
    print(f"done {total}", flush=True)


def trim(args):
    import fdq
    db = fdq.connect(args.url)
    print("start", flush=True)
    total = fdq.Supervisor(db).trim(args.topic, before_ms=args.before_ms, progress=_progress)
    print(f"done {total}", flush=True)


def jumper(args):
    import fdq
    db = fdq.connect(args.url)
    key = b"qt/jumper"
    print("ready", flush=True)
    while True:
        tr = db.create_transaction()
        # Half its commits fail (fault injection): without a cap, on_error's backoff grows to
        # 1 s and the jumper commits a few times a second (a jump every ~7 s).
        tr.options.set_max_retry_delay(50)
        while True:
            try:
                tr.add(key, (1).to_bytes(8, "little"))
                tr.commit().wait()
                break
            except fdq.engine.error_types() as e:
                try:
                    tr.on_error(e.code).wait()
                except fdq.engine.error_types():
                    break
        time.sleep(0.002)


def apply(sup, prod, topic: str, op: list):
    """Run the operation ``op`` (``[kind, *arguments]``, JSON) on ``topic``; returns its result."""
    kind = op[0]
    if kind == "pause":
        sup.pause(topic)
    elif kind == "play":
        sup.play(topic)
    elif kind == "rebalance":
        sup.rebalance(topic, shards=op[1])
    elif kind == "replay":
        return prod.replay(topic, op[1], op[2])
    elif kind == "redrive":               # the dead letters of a subscription
        return sup.dlq_redrive(topic, op[1])
    elif kind == "trim":                  # the log older than a time, while consumers consume
        return sup.trim(topic, before_ms=op[1])
    elif kind == "pause_sub":
        return sup.pause_subscription(topic, op[1])
    elif kind == "play_sub":
        return sup.play_subscription(topic, op[1])
    elif kind == "reset":                 # "rst" (exactly-once) or "rsa": rewind, or skip to now
        sup.play(topic)                 # (refused while paused)
        return sup.reset(topic, op[2] if len(op) > 2 else "rst", op[1])
    elif kind == "update":
        return sup.update_subscription(topic, "flt", **op[1]).max_ack_pending
    else:
        raise ValueError(f"unknown operation {op!r}")
    return None


def make_op(kind: str, rng, *, trim_age: float = 5.0, redrive=("default",), subs=("default",)) -> list:
    """A random operation of ``kind`` (its arguments drawn with ``rng``), as :func:`apply`
    takes it: ``reshard`` is a rebalance to 2-9 shards, ``replay`` a window of the last
    3 s, ``trim`` the log older than ``trim_age`` s, ``redrive`` one of ``redrive``,
    ``pause_sub`` / ``play_sub`` one of ``subs``, ``reset`` of ``rst`` or ``rsa`` (rewound
    or skipped to now), ``update`` of ``flt``'s max_ack_pending and ack wait."""
    if kind in ("pause", "play"):
        return [kind]
    if kind == "rebalance":
        return ["rebalance", None]
    if kind == "reshard":
        return ["rebalance", rng.randint(2, 9)]
    if kind == "replay":
        now = int(time.time() * 1000)
        start = now - rng.randint(200, 3000)
        return ["replay", start, start + rng.randint(20, 300)]
    if kind == "redrive":
        return ["redrive", rng.choice(list(redrive))]
    if kind == "trim":
        return ["trim", int((time.time() - trim_age) * 1000)]
    if kind in ("pause_sub", "play_sub"):
        return [kind, rng.choice(list(subs))]
    if kind == "reset":
        return ["reset", rng.choice([None, int(time.time() * 1000) - rng.randint(0, 3000)]),
                rng.choice(["rst", "rsa"])]
    if kind == "update":
        return ["update", {"max_ack_pending": rng.choice([1, 2, 3, None]),
                           "ack_wait_s": rng.choice([None, 0.4, 0.8])}]
    raise ValueError(f"unknown operation {kind!r}")


def chooser(table, **options):
    """``choose(rng)`` for :func:`random_ops`: ``table`` is [(upper bound, kind)], in
    increasing bounds up to 1; one draw picks the kind, :func:`make_op` its arguments."""
    def choose(rng):
        r = rng.random()
        kind = next((k for bound, k in table if r < bound), table[-1][1])
        return make_op(kind, rng, **options)
    return choose


def random_ops(args, choose, run, stop, wall_time: bool = False):
    """Operations ``choose(rng)`` run with ``run(op)`` until ``stop`` is set (the one under
    way finishes first), ``random.Random(--seed)`` choosing them and the pauses between.
    The journal (``--out``) has ``B <op> <t>`` before and ``E <t> [<wall ms>] <result>``
    after each (monotonic ns); an operation journaled without its end (a kill) is run
    again first, as the README says to."""
    rng = random.Random(args.seed)
    journal = Log(args.out)

    def journaled(op):
        journal.write("B " + json.dumps(op) + f" {time.monotonic_ns()}")
        result = run(op)
        wall = f" {int(time.time() * 1000)}" if wall_time else ""
        journal.write(f"E {time.monotonic_ns()}{wall} {json.dumps(result)}")

    lines = read_lines(args.out)
    if lines and lines[-1].startswith("B "):
        journaled(json.loads(lines[-1][2:].rsplit(" ", 1)[0]))
    print("ready", flush=True)
    while not stop.is_set():
        journaled(choose(rng))
        stop.wait(rng.uniform(0.05, 0.4))
    print("stopped", flush=True)


def main(role, argv):
    ap = parser(role)
    ap.add_argument("--topic", default="t")
    ap.add_argument("--count", type=int, default=100)    # rebalance: the shard count
    ap.add_argument("--before-ms", type=int, default=None)
    args = ap.parse_args(argv)
    {"play": play, "rebalance": rebalance, "replay": replay, "trim": trim,
     "jumper": jumper}[role](args)
