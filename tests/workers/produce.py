"""Producer roles.

* ``producer``: ``--count`` messages (bodies ``NAME:SEQ``, keys ``NAME-k<seq % keys>``)
  in batches of ``--batch`` (1: ``push``, else ``push_many``), each logged after it
  returned; retries counted in the status file. With ``--until FILE`` it also stops
  once that file exists (a stream the test ends when it has seen what it waits for).
* ``push-ids``: ``--count`` messages to ``--topic`` in batches of 10 with short pauses;
  prints the JSON list of their ids at the end.
* ``spark-producer``: ``--count`` messages of producer number ``--proc`` (bodies,
  keys and headers of :func:`spark_message`) in ``push_many`` batches of ``--batch``,
  ``--pause-ms`` apart; writes each (id, base64 body, shard key, headers) to ``--out``.
"""
from __future__ import annotations

import base64
import json
import os
import time

from common import Counters, Log, parser, skew_clock, write_status


def producer(args):
    import fdq
    skew_clock(args.skew_s)
    counters = Counters()
    counters.install()
    db = fdq.connect(args.url)
    p = fdq.Producer(db)
    out = Log(args.out)
    seq = 0
    while seq < args.count and not (args.until and os.path.exists(args.until)):
        n = min(args.batch, args.count - seq)
        envs = [fdq.Envelope(f"{args.name}:{s}".encode(), shard_key=f"{args.name}-k{s % args.keys}")
                for s in range(seq, seq + n)]
        if args.batch == 1:
            e = envs[0]
            results = [p.push(args.topic, e.body, shard_key=e.shard_key)]
        else:
            results = p.push_many(args.topic, envs)
        for e, r in zip(envs, results):
            out.write(json.dumps({"id": r.id, "key": e.shard_key, "body": e.body.decode()}))
        seq += n
        if args.sleep:
            time.sleep(args.sleep)
    write_status(args.status, {"pushed": seq, "retries": counters.snapshot(), "done": True})


def push_ids(args):
    import fdq
    db = fdq.connect(args.url)
    p = fdq.Producer(db)
    ids = []
    for i in range(0, args.count, 10):
        ids += [r.id for r in p.push_many(args.topic, [fdq.Envelope(f"{j}".encode(), shard_key=f"k{j % 13}")
                                                       for j in range(i, min(args.count, i + 10))])]
        time.sleep(0.004)
    print(json.dumps(ids), flush=True)


def spark_message(proc: int, i: int):
    import fdq
    body = f"p{proc}-m{i}-".encode() + bytes([i % 251]) * (i % 40)
    key = f"k{i % 50}" if i % 10 else None
    headers = None
    if i % 3 == 0:
        headers = {"proc": proc, "i": i, "kind": "a" if i % 2 else "b", "tags": ["x", i % 7]}
    return fdq.Envelope(body, shard_key=key, headers=headers)


def spark_producer(args):
    import fdq
    db = fdq.connect(args.url)
    p = fdq.Producer(db)
    with open(args.out, "w") as f:
        for start in range(0, args.count, args.batch):
            envs = [spark_message(args.proc, i) for i in range(start, min(args.count, start + args.batch))]
            for env, r in zip(envs, p.push_many(args.topic, envs)):
                f.write(json.dumps({"id": r.id, "body": base64.b64encode(env.body).decode(),
                                    "shard_key": env.shard_key,
                                    "headers": dict(env.headers) if env.headers else None}) + "\n")
            f.flush()
            if args.pause_ms:
                time.sleep(args.pause_ms / 1000)


def main(role, argv):
    ap = parser(role)
    ap.add_argument("--topic", default="t")
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--keys", type=int, default=10)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--skew-s", type=float, default=0.0)
    ap.add_argument("--proc", type=int, default=0)
    ap.add_argument("--pause-ms", type=int, default=0)
    ap.add_argument("--until", default=None)
    args = ap.parse_args(argv)
    {"producer": producer, "push-ids": push_ids, "spark-producer": spark_producer}[role](args)
