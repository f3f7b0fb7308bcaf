"""Consumer roles.

* ``consumer``: ``--mode eo`` exactly-once (the handler records each message through
  the dequeue transaction: a counter ``qt/<topic>/done/<id>`` and a commit-ordered entry
  ``qt/<topic>/order/<shard_key>/<versionstamp> = seq``, so per-key order of
  deliveries is the database's commit order, across processes); ``alo`` / ``amo``
  (``fdq.tail`` at least / at most once), ``aio`` (``fdq.aio.tail``), ``pull``
  (``Consumer.fetch``, batches settled in pieces): an ``H`` line per handler call; at
  most once, a ``T`` line per message a taking transaction may take. Status file:
  handled, retries, owned shards, errors. Prints ``ready``; SIGTERM: clean shutdown.
* ``subs-consumer``: ``--mode exactly`` (the handler counts each message id in its
  dequeue transaction at :func:`common.seen_key`) or ``acking`` (counts it in its own
  transaction, then the message is acked), on subscription ``--sub``.
* ``tag-consumer``: at least once, wanting dispatch tag ``--tag`` (none: untagged),
  config ``--config`` (JSON); a JSON line per delivery in ``--out``. A body ``hang``
  makes a tagged worker's handler block (the message stays leased until the kill).
* ``web-consumer``: at-least-once ``fdq.tail`` of ``--topic``: ``got BODY ATTEMPTS ID``
  per delivery, ``ack BODY`` once handled; a body starting with ``poison`` raises (a
  nak) until the file ``--cure`` exists.
"""
from __future__ import annotations

import json
import os
import threading
import time

from common import ONE, Counters, Log, exactly_once_evidence, parser, seen_key, skew_clock, stop_on_sigterm, write_status


def log_takes(out: Log):
    """At most once: log what each taking transaction may take (``T <id>``), before its
    commit: a superset of what this process removed from the queue."""
    import fdq.keyspace
    import fdq.ops.queue
    original = fdq.ops.queue.take_batch

    def take_batch(*a, **kw):
        taken = original(*a, **kw)
        for t in taken:
            out.write(f"T {fdq.keyspace.message_id(t.vs)}")
        return taken
    fdq.ops.queue.take_batch = take_batch


def consumer(args):
    skew_clock(args.skew_s)
    import fdq
    counters = Counters()
    counters.install()
    db = fdq.connect(args.url)
    out = Log(args.out)
    handled = [0]
    errors = []
    if args.mode == "amo":
        log_takes(out)

    record = exactly_once_evidence(f"qt/{args.topic}/".encode())

    def eo_handler(tr, m):
        seq = int(m.body.decode().rsplit(":", 1)[1])
        record(tr, m, order=(m.shard_key or "").encode() + b"/", value=str(seq).encode())
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
    stop = stop_on_sigterm()

    def status(final=False):
        write_status(args.status, {"handled": handled[0], "retries": counters.snapshot(),
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


def subs_consumer(args):
    import fdq
    db = fdq.connect(args.url)
    sub = args.sub
    config = fdq.ConsumerConfig(heartbeat_interval_s=0.2, zombie_timeout_s=1.5, lease_check_interval_s=0.2,
                                poll_interval_s=0.1, ack_wait_s=3.0)
    if args.mode == "exactly":
        def handler(tr, m):
            tr.add(seen_key(sub, m.id), ONE)
        c = fdq.tail(db, args.topic, handler, transactional=True, consumer_id=args.name, subscription=sub,
                     config=config, batch_size=20, create=False)
    else:
        @fdq.transactional
        def record(tr, mid):
            tr.add(seen_key(sub, mid), ONE)

        def handler(m):
            record(db, m.id)
        c = fdq.tail(db, args.topic, handler, consumer_id=args.name, subscription=sub,
                     config=config, batch_size=20, create=False)
    stop = stop_on_sigterm()
    print("ready", flush=True)
    while not stop.wait(0.1):
        pass
    c.shutdown()
    print("left", flush=True)


def tag_consumer(args):
    import fdq
    out = Log(args.out)
    tag, cid = args.tag, args.name

    def handler(m):
        out.event(event="delivered", consumer=cid, id=m.id, body=m.body.decode(), tag=m.tag,
                  header_tag=m.headers.get("##client_dispatch_tag"), attempts=m.attempts)
        if m.body == b"hang" and tag:
            threading.Event().wait(600)

    db = fdq.connect(args.url)
    config = fdq.ConsumerConfig(**json.loads(args.config))
    stop = stop_on_sigterm()
    c = fdq.tail(db, args.topic, handler, consumer_id=cid, config=config, extend_support=True,
                 desired_tag=tag or None, batch_size=10)
    out.event(event="ready", consumer=cid)
    print("ready", flush=True)
    deadline = 600
    while not stop.wait(0.2) and deadline > 0:   # bounded: a worker never outlives a test run
        deadline -= 0.2
    c.shutdown()


def web_consumer(args):
    import fdq
    out = Log(args.out)

    def handle(msg):
        body = msg.body.decode()
        out.write(f"got {body} {msg.attempts} {msg.id}")
        if body.startswith("poison") and not (args.cure and os.path.exists(args.cure)):
            raise RuntimeError(f"cannot handle {body}")
        out.write(f"ack {body}")

    config = fdq.ConsumerConfig(heartbeat_interval_s=args.hb, zombie_timeout_s=args.zombie,
                                max_deliver=args.max_deliver, poll_interval_s=0.05,
                                lease_check_interval_s=0.1, ack_wait_s=10)
    stop = stop_on_sigterm()
    consumer = fdq.tail(fdq.connect(args.url), args.topic, handle, consumer_id=args.name, config=config,
                        on_error=lambda e: None)
    print("ready", flush=True)
    stop.wait()
    consumer.shutdown()


def main(role, argv):
    ap = parser(role)
    ap.add_argument("--topic", default="t")
    ap.add_argument("--sub", default="default")
    ap.add_argument("--batch", type=int, default=10)
    # consumer: aio = fdq.aio, at least once; pull = Consumer.fetch, batches settled in pieces;
    # subs-consumer: exactly or acking
    ap.add_argument("--mode", choices=["eo", "alo", "amo", "aio", "pull", "exactly", "acking"], default="eo")
    ap.add_argument("--hb", type=float, default=0.2)
    ap.add_argument("--zombie", type=float, default=1.5)
    ap.add_argument("--ack-wait", type=float, default=30.0)
    ap.add_argument("--hold-s", type=float, default=0.0)
    ap.add_argument("--skew-s", type=float, default=0.0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--config", default="{}")
    ap.add_argument("--max-deliver", type=int, default=5)
    ap.add_argument("--cure", default=None)
    if role == "web-consumer":
        ap.set_defaults(hb=0.3, zombie=1.0)
    args = ap.parse_args(argv)
    {"consumer": consumer, "subs-consumer": subs_consumer, "tag-consumer": tag_consumer,
     "web-consumer": web_consumer}[role](args)
