"""What the worker roles share: the command line every role takes, an event log a kill
cannot fake, a status file, SIGTERM as a clean stop, retry counting, evidence keys.

Imported as ``common`` by the roles (``tests/workers`` is their ``sys.path[0]``) and as
``workers.common`` by the tests (for the evidence keys): stdlib and fdq only."""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import threading
import time

ONE = (1).to_bytes(8, "little")


def parser(role: str) -> argparse.ArgumentParser:
    """The options of every role: the database, the worker's name, its event log and
    status file (both optional)."""
    ap = argparse.ArgumentParser(prog=f"python tests/workers {role}")
    ap.add_argument("--url", required=True)
    ap.add_argument("--name", default="w")
    ap.add_argument("--out")
    ap.add_argument("--status")
    return ap


class Log:
    """One line per event, appended with ``os.write`` to an ``O_APPEND`` file: on disk as
    soon as written, even if the process is killed right after. No path: no log."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if path else None
        self.lock = threading.Lock()

    def write(self, line: str):
        if self.fd is not None:
            with self.lock:
                os.write(self.fd, (line + "\n").encode())

    def event(self, **event):
        self.write(json.dumps(event))


def read_lines(path):
    """The complete lines of ``path`` (a killed writer's last line may be cut)."""
    try:
        with open(path) as f:
            return [line.rstrip("\n") for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def write_status(path, status: dict):
    """``status`` as JSON at ``path``, replaced atomically (a reader never sees half)."""
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(status, f)
        os.replace(tmp, path)


def stop_on_sigterm() -> threading.Event:
    """An event SIGTERM sets (a clean stop); SIGUSR1 dumps every thread's stack.

    The handler sets it from a thread of its own: a handler runs in the main thread,
    which may be inside ``stop.wait()`` holding the event's lock, and ``set()`` there
    would wait for that lock forever."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=stop.set, daemon=True).start())
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return stop


def skew_clock(seconds: float):
    """Shift this process's wall clock by ``seconds`` (a client with a skewed clock)."""
    if seconds:
        real = time.time
        time.time = lambda: real() + seconds


class Counters:
    """Engine errors by code, counted by wrapping ``retry_or_raise`` where FDQ's retry
    loops call it (a conflict is 1020)."""

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
        for mod in (fdq.engine.retry, fdq.consumer):     # (the producer retries in engine.transact)
            mod.retry_or_raise = self.wrap(mod.retry_or_raise)

    def snapshot(self):
        with self.lock:
            return {str(k): v for k, v in self.codes.items()}


def seen_key(sub: str, mid: str) -> bytes:
    """The counter a ``subs-consumer`` adds 1 to for each message ``mid`` of ``sub`` it handles."""
    return f"subs-test/{sub}/seen/{mid}".encode()


def exactly_once_evidence(prefix: bytes):
    """What an exactly-once handler writes through the dequeue transaction: ``record(tr,
    m)`` adds 1 to the counter ``PREFIX done/<id>`` and writes a commit-ordered entry
    ``PREFIX order/<order><versionstamp> = value`` (default: the id), so the order of
    deliveries is the database's commit order, across processes."""
    import weakref

    from fdq.keyspace import vs_key
    user_versions = weakref.WeakKeyDictionary()   # tr -> next user version in its stamp

    def record(tr, m, order: bytes = b"", value: bytes | None = None):
        tr.add(prefix + b"done/" + m.id.encode(), ONE)
        uv = user_versions.get(tr, 0)
        user_versions[tr] = uv + 1
        tr.set_versionstamped_key(vs_key(prefix + b"order/" + order, uv),
                                  m.id.encode() if value is None else value)
    return record


def random_tail_kwargs(fdq, args, rng, on_error, *, concurrency, batch_sizes, tag: str):
    """The ``fdq.tail`` arguments of a chaos or soak consumer: quick liveness, a short
    ack wait (``--ack-wait``), max_deliver 3, handler threads ``concurrency`` and a batch
    size from ``batch_sizes`` (chosen with ``rng``), wanting dispatch tag ``tag`` with
    ``--tag``."""
    config = fdq.ConsumerConfig(heartbeat_interval_s=0.2, zombie_timeout_s=1.0, ack_wait_s=args.ack_wait,
                                max_deliver=3, backoff_s=(0.0, 0.05), lease_check_interval_s=0.1,
                                poll_interval_s=0.2, max_concurrency=concurrency)
    return dict(consumer_id=args.name, subscription=args.sub, config=config,
                batch_size=rng.choice(batch_sizes), on_error=on_error, extend_support=True,
                desired_tag=tag if args.tag else None)


def random_parser(role: str, *, keys: int, modes):
    """The options of the chaos and soak roles."""
    ap = parser(role)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gen", type=int, default=0)
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--keys", type=int, default=keys)
    ap.add_argument("--pace", type=float, default=0.0)    # producers: seconds the pushes should take
    ap.add_argument("--mode", choices=modes, default="eo")
    ap.add_argument("--sub", default="default")
    ap.add_argument("--tag", action="store_true")       # consumers: want the dispatch tag's shards
    ap.add_argument("--ack-wait", type=float, default=0.6)
    ap.add_argument("--trim-age", type=float, default=5.0)    # supervisor: trim the log older than this (s)
    return ap
