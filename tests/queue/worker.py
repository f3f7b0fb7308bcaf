"""Worker processes for the queue guarantee tests (run as ``python worker.py ROLE ...``).

Each role is a real FDQ client in its own OS process, so tests can ``kill -9`` it.
Evidence is written where a crash cannot fake it:

* exactly-once consumers record each message *through the dequeue transaction*: a
  counter ``qt/<topic>/done/<id>`` and a commit-ordered entry
  ``qt/<topic>/order/<shard_key>/<versionstamp> = seq`` (so per-key order of
  deliveries is the database's commit order, across processes);
* other roles append one line per event to an ``O_APPEND`` file (``os.write``, no
  buffering: a line written is on disk even if the process is then killed);
* conflict retries (FDB error 1020) are counted by wrapping ``retry_or_raise`` where
  FDQ's retry loops call it, and reported in a status file (atomic rename).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import faulthandler
import threading
import time
import weakref


def _skew_clock(seconds: float):
    if seconds:
        real = time.time
        time.time = lambda: real() + seconds


class Counters:
    def __init__(self):
        self.lock = threading.Lock()
        self.codes = {}

    def wrap(self, fn):
        def counted(tr, e):
            with self.lock:
                code = getattr(e, "code", None)
                self.codes[code] = self.codes.get(code, 0) + 1
            return fn(tr, e)
        return counted

    def install(self):
        import fdq.consumer
        import fdq.engine.retry
        import fdq.producer
        for mod in (fdq.engine.retry, fdq.consumer, fdq.producer):
            mod.retry_or_raise = self.wrap(mod.retry_or_raise)

    def snapshot(self):
        with self.lock:
            return {str(k): v for k, v in self.codes.items()}


class Log:
    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if path else None

    def write(self, line: str):
        if self.fd is not None:
            os.write(self.fd, (line + "\n").encode())


def _write_status(path, status: dict):
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(status, f)
        os.replace(tmp, path)


def producer(args):
    import fdq
    _skew_clock(args.skew_s)
    counters = Counters()
    counters.install()
    db = fdq.connect(args.url)
    p = fdq.Producer(db)
    out = Log(args.out)
    seq = 0
    while seq < args.count:
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
    _write_status(args.status, {"pushed": seq, "retries": counters.snapshot(), "done": True})


def consumer(args):
    _skew_clock(args.skew_s)
    import fdq
    import fdq.delivery
    from fdq.keyspace import vs_key
    counters = Counters()
    counters.install()
    db = fdq.connect(args.url)
    out = Log(args.out)
    handled = [0]
    errors = []

    if args.mode == "amo":
        # Log what each at-most-once batch takes, before its commit: a superset of
        # what this process removed from the queue.
        original = fdq.delivery.take_batch

        def take_batch(*a, **kw):
            taken = original(*a, **kw)
            for t in taken:
                out.write(f"T {fdq.keyspace.message_id(t.vs)}")
            return taken
        fdq.delivery.take_batch = take_batch

    prefix = f"qt/{args.topic}/".encode()
    user_versions = weakref.WeakKeyDictionary()   # tr -> next user version in its stamp

    def eo_handler(tr, m):
        tr.add(prefix + b"done/" + m.id.encode(), (1).to_bytes(8, "little"))
        key = (m.shard_key or "").encode()
        seq = int(m.body.decode().rsplit(":", 1)[1])
        uv = user_versions.get(tr, 0)
        user_versions[tr] = uv + 1
        tr.set_versionstamped_key(vs_key(prefix + b"order/" + key + b"/", uv), str(seq).encode())
        handled[0] += 1
        if args.hold_s:
            time.sleep(args.hold_s)

    def handler(m):
        out.write(f"H {m.id} {m.attempts} {m.shard_key} {m.body.decode()}")
        handled[0] += 1
        if args.hold_s:
            time.sleep(args.hold_s)

    def on_error(e):
        errors.append(f"{type(e).__name__}: {e}"[:300])

    config = fdq.ConsumerConfig(heartbeat_interval_s=args.hb, zombie_timeout_s=args.zombie,
                                ack_wait_s=args.ack_wait, lease_check_interval_s=min(0.2, args.hb),
                                poll_interval_s=0.2)
    pump = None
    if args.mode == "pull":
        c = fdq.Consumer(db, args.topic, consumer_id=args.name, config=config, on_error=on_error)
        pump = threading.Thread(target=_pull, args=(c, args, handler, on_error), daemon=True)
    elif args.mode == "eo":
        c = fdq.tail(db, args.topic, eo_handler, transactional=True, consumer_id=args.name,
                     config=config, batch_size=args.batch, on_error=on_error)
    elif args.mode == "aio":
        async def async_handler(m):
            handler(m)
        c = _AsyncTail(db, args.topic, async_handler, consumer_id=args.name, config=config,
                       batch_size=args.batch, on_error=on_error)
    else:
        c = fdq.tail(db, args.topic, handler, acking=(args.mode == "alo"), consumer_id=args.name,
                     config=config, batch_size=args.batch, on_error=on_error)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # a stack dump if it hangs

    def status(final=False):
        _write_status(args.status, {"handled": handled[0], "retries": counters.snapshot(),
                                    "owned": [list(s) for s in c.owned_shards],
                                    "errors": errors[-20:], "final": final, "pid": os.getpid(),
                                    "cpu_s": time.process_time()})
    status()
    if pump is not None:
        pump.start()
    print("ready", flush=True)
    while not stop.wait(0.1):
        status()
    if pump is not None:
        c._stop.set()
        pump.join(60)
    c.shutdown()
    status(final=True)


def _pull(c, args, handler, on_error):
    """The pull consumer settling each batch in pieces: every other message acked alone
    (its batch's lease record rewritten), the others touched, then acked together."""
    import fdq
    while not c._stop.is_set():
        try:
            msgs = c.fetch(args.batch, timeout=0.2)
        except fdq.FDQError as e:
            on_error(e)
            continue
        for m in msgs:
            handler(m)
        try:
            for m in msgs[0::2]:
                m.ack()
            for m in msgs[1::2]:
                m.in_progress()
            c.ack_many(msgs[1::2])
        except fdq.FDQError as e:   # LeaseLost: redelivered after its ack wait
            on_error(e)


class _AsyncTail:
    """fdq.aio.tail on an event loop in its own thread, seen as fdq.tail's consumer is."""

    def __init__(self, db, topic, handler, **kwargs):
        import asyncio
        import fdq.aio
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.tail = asyncio.run_coroutine_threadsafe(fdq.aio.tail(db, topic, handler, **kwargs),
                                                     self.loop).result(60)

    @property
    def owned_shards(self):
        return self.tail.consumer.owned_shards

    def shutdown(self):
        import asyncio
        asyncio.run_coroutine_threadsafe(self.tail.shutdown(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)


def play(args):
    import fdq
    db = fdq.connect(args.url)
    sup = fdq.Supervisor(db)
    print("start", flush=True)
    total = sup.play(args.topic, progress=lambda n: print(f"chunk {n}", flush=True))
    print(f"done {total}", flush=True)


def rebalance(args):
    import fdq
    db = fdq.connect(args.url)
    sup = fdq.Supervisor(db)
    print("start", flush=True)
    sup.rebalance(args.topic, shards=args.count, progress=lambda n: print(f"chunk {n}", flush=True))
    print("done", flush=True)


def replay(args):
    import fdq
    db = fdq.connect(args.url)
    print("start", flush=True)
    total = fdq.Producer(db).replay(args.topic, 0, progress=lambda n: print(f"chunk {n}", flush=True))
    print(f"done {total}", flush=True)


def trim(args):
    """``Supervisor.trim`` of the topic (by its retention config, or before ``--before-ms``),
    printing each chunk's deletions."""
    import fdq
    db = fdq.connect(args.url)
    print("start", flush=True)
    total = fdq.Supervisor(db).trim(args.topic, before_ms=args.before_ms,
                                    progress=lambda n: print(f"chunk {n}", flush=True))
    print(f"done {total}", flush=True)


def count(args):
    """Supervisor.count_log_bytes of --topic (--sleep seconds after each chunk),
    printing each chunk's entries counted."""
    import fdq
    db = fdq.connect(args.url)
    print("start", flush=True)

    def chunk(n):
        print(f"chunk {n}", flush=True)
        time.sleep(args.sleep)
    total = fdq.Supervisor(db).count_log_bytes(args.topic, progress=chunk)
    print(f"done {total}", flush=True)


def jumper(args):
    """Commit tiny transactions on a fault-injecting connection until killed: the engine
    injects version jumps of 100,000,000 (an FDB recovery) into the shared database."""
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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["producer", "consumer", "play", "rebalance", "replay", "trim", "count", "jumper"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--topic", default="t")
    ap.add_argument("--name", default="w")
    ap.add_argument("--out")
    ap.add_argument("--status")
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--keys", type=int, default=10)
    ap.add_argument("--sleep", type=float, default=0.0)
    # aio: fdq.aio, at least once; pull: Consumer.fetch, batches settled in pieces
    ap.add_argument("--mode", choices=["eo", "alo", "amo", "aio", "pull"], default="eo")
    ap.add_argument("--hb", type=float, default=0.2)
    ap.add_argument("--zombie", type=float, default=1.5)
    ap.add_argument("--ack-wait", type=float, default=30.0)
    ap.add_argument("--hold-s", type=float, default=0.0)
    ap.add_argument("--skew-s", type=float, default=0.0)
    ap.add_argument("--before-ms", type=int, default=None)
    args = ap.parse_args(argv)
    {"producer": producer, "consumer": consumer, "play": play, "rebalance": rebalance,
     "replay": replay, "trim": trim, "count": count, "jumper": jumper}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
