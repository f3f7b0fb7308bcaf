"""FDQ's demonstration: ``python -m fdq.demo`` (the README's first command).

Producers and exactly-once consumers in separate OS processes on the embedded engine;
one consumer is killed with SIGKILL mid-run, the survivors take over its shards after
the zombie timeout, and the final counts show every message processed exactly once.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import fdq
from fdq.keyspace import decode_counter

CONSUMER_CONFIG = dict(heartbeat_interval_s=0.25, zombie_timeout_s=1.5, lease_check_interval_s=0.2,
                       poll_interval_s=0.2)


def _consumer(url, topic, name):
    db = fdq.connect(url)
    done = f"demo/{topic}/done/".encode()

    def handler(tr, m):
        # Inside the dequeue transaction: this write and the dequeue commit together.
        tr.add(done + m.id.encode(), (1).to_bytes(8, "little"))
        tr.add(f"demo/{topic}/by/{name}".encode(), (1).to_bytes(8, "little"))
    c = fdq.tail(db, topic, handler, transactional=True, consumer_id=name,
                 config=fdq.ConsumerConfig(**CONSUMER_CONFIG))
    signal.signal(signal.SIGTERM, lambda *a: (c.shutdown(), sys.exit(0)))
    while True:
        time.sleep(1)


def _producer(url, topic, name, count):
    db = fdq.connect(url)
    p = fdq.Producer(db)
    ids = []
    for i in range(0, count, 50):
        envs = [fdq.Envelope(f"{name}:{j}".encode(), shard_key=f"customer-{j % 97}")
                for j in range(i, min(count, i + 50))]
        ids += [r.id for r in p.push_many(topic, envs)]
        time.sleep(0.01)   # a steady stream, so the kill lands mid-run
    print(json.dumps(ids))


def _processed_by(db, topic) -> dict:
    """{consumer: messages it processed} (its handlers' counters)."""
    tr = db.create_transaction()
    try:
        return {kv.key.decode().rsplit("/", 1)[1]: decode_counter(kv.value)
                for kv in tr.snapshot.get_range(f"demo/{topic}/by/".encode(), f"demo/{topic}/by0".encode())}
    finally:
        tr.cancel()


def _spawn(*args):
    return subprocess.Popen([sys.executable, "-m", "fdq.demo", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def _table(title, rows, columns):
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[str(r.get(c, "")) for c in columns])
    Console().print(t)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fdq.demo")
    ap.add_argument("--url", default=None, help="database URL (default: the embedded default)")
    ap.add_argument("--messages", type=int, default=1500, help="messages per producer")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--topic", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    url = args.url or fdq.engine.default_url()
    if args.role == "consumer":
        return _consumer(url, args.topic, args.name)
    if args.role == "producer":
        return _producer(url, args.topic, args.name, args.messages)

    db = fdq.connect(args.url)      # None: the default database, its directory created if new
    topic = f"demo-{int(time.time())}"
    sup = fdq.Supervisor(db)
    sup.create_topic(topic, shards=8)
    print(f"FDQ demo on {url}\ntopic {topic}: 8 shards, 3 exactly-once consumers, 2 producers × "
          f"{args.messages} messages\n")
    consumers = {f"consumer-{i}": _spawn("--role", "consumer", "--url", url, "--topic", topic,
                                         "--name", f"consumer-{i}") for i in range(3)}
    producers = [_spawn("--role", "producer", "--url", url, "--topic", topic, "--name", f"p{i}",
                        "--messages", str(args.messages)) for i in range(2)]
    victim = "consumer-0"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:    # kill it once it is busy: all 3 joined, it handled some
            st = sup.stats(topic)["subscriptions"]["default"]
            if len(st["consumers"]) == 3 and _processed_by(db, topic).get(victim, 0) >= 50:
                break
            time.sleep(0.02)
        st = sup.stats(topic)
        inserted, st = st["counters"]["inserted"], st["subscriptions"]["default"]
        owners = {c["id"]: c["shards"] for c in st["consumers"]}
        print(f"shards before the kill: {owners}")
        print(f"kill -9 {victim} (pid {consumers[victim].pid}) mid-run")
        os.kill(consumers[victim].pid, signal.SIGKILL)
        consumers[victim].wait()
        killed_at = time.monotonic()
        left = sum(sh["backlog"] for sh in sup.stats(topic)["subscriptions"]["default"]["shards"]
                   if sh["owner"] == victim)
        print(f"{victim} died owning {len(owners.get(victim, []))} shards with {left} messages still queued "
              f"({st['acked']} processed by all consumers, {inserted} of {2 * args.messages} pushed so far)")
        took_over = False
        while time.monotonic() - killed_at < 20:
            cs = sup.stats(topic)["subscriptions"]["default"]["consumers"]
            if victim not in {c["id"] for c in cs}:
                print(f"survivors took over {victim}'s shards after {time.monotonic() - killed_at:.1f}s: "
                      f"{ {c['id']: c['shards'] for c in cs} }")
                took_over = True
                break
            time.sleep(0.05)
        if not took_over:
            print(f"{victim}'s shards were not taken over within 20 s")
        pushed = []
        for p in producers:
            out, _ = p.communicate(timeout=120)
            pushed += json.loads(out)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = sup.stats(topic)["subscriptions"]["default"]
            if st["backlog"] == 0:
                break
            time.sleep(0.1)
    finally:
        for p in list(consumers.values()) + producers:
            if p.poll() is None:
                p.terminate()
        for p in list(consumers.values()) + producers:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()

    prefix = f"demo/{topic}/done/".encode()
    counts = {}
    tr = db.create_transaction()
    try:
        for kv in tr.snapshot.get_range(prefix, prefix + b"\xff"):
            counts[kv.key[len(prefix):].decode()] = decode_counter(kv.value)
    finally:
        tr.cancel()
    by = _processed_by(db, topic)
    stats = sup.stats(topic)
    once = sum(1 for i in pushed if counts.get(i) == 1)
    twice = sum(1 for v in counts.values() if v > 1)
    missing = sum(1 for i in pushed if i not in counts)
    _table("processed per consumer", [{"consumer": k, "messages": v} for k, v in sorted(by.items())],
           ["consumer", "messages"])
    _table("exactly-once check", [{
        "pushed": len(pushed), "distinct ids": len(set(pushed)), "inserted": stats["counters"]["inserted"],
        "processed once": once, "processed twice+": twice, "missing": missing,
        "backlog": stats["subscriptions"]["default"]["backlog"]}],
        ["pushed", "distinct ids", "inserted", "processed once", "processed twice+", "missing", "backlog"])
    ok = took_over and once == len(pushed) == len(set(pushed)) == stats["counters"]["inserted"] \
        and not twice and not missing
    print("OK: every message processed exactly once, despite the kill" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
