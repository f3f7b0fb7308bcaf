"""``run_worker``: run a handler over a subscription until told to stop, then drain.

    @fdq.worker.handler(topic="orders", subscription="billing")
    def bill(msg):
        charge(msg.body)            # return = ack, raise = nak (with backoff)

    fdq.worker.run_worker(db, bill, concurrency=4, stop=stop_event, drain_timeout_s=30)

The handler runs on ``fdq.tail`` (a coroutine function on ``fdq.aio.tail``, its event
loop in a thread of its own), in one of the three delivery modes (exactly-once: a plain
function ``handler(tr, msg)``). ``fdq worker module:attr`` is this on the command line.

Stopping (``stop`` set, or an exception such as KeyboardInterrupt while it waits): no new
batch is leased; the handlers running finish (up to ``drain_timeout_s``) and their
messages are settled as usual; the messages of their batches no handler began go back at
once, no attempt counted; then the consumer leaves the subscription. A handler still
running after the drain timeout keeps its message, which goes back as a failed attempt
(nak). An exception while draining (a second Ctrl-C), or ``abort`` set (``fdq worker``'s
second signal), ends the drain at once: the handlers running are not waited for (their
messages nak'd: failed attempts), the rest released, and the consumer leaves, all before
``run_worker`` returns (within ``AT_ONCE_S``; a database out of reach that long: the
leases come back when their ack wait runs out, as a killed worker's do).

The drain runs in a thread of its own while the calling thread waits in short ticks:
a signal or an exception there lands in that wait, never inside the drain's database
calls (a close cut in the middle kept leases held until their ack wait ran out).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time

from . import aio
from .config import DEFAULT_SUBSCRIPTION, ConsumerConfig, check_name
from .consumer import AT_LEAST_ONCE, AT_MOST_ONCE, EXACTLY_ONCE
from .errors import ConfigError
from .tailing import tail

# The delivery modes as written (the CLI's --mode); -> fdq.tail's.
MODES = {"at-least-once": AT_LEAST_ONCE, "at-most-once": AT_MOST_ONCE, "exactly-once": EXACTLY_ONCE}
# How often a waiting worker looks at its stop event and its consumer.
TICK_S = 0.2
# How long leaving at once (leases back, membership left) may take before ``abort``
# returns anyway: the database out of reach; the leases then expire as a killed worker's.
AT_ONCE_S = 10.0


@dataclasses.dataclass(frozen=True)
class HandlerDefaults:
    """What ``@fdq.worker.handler(...)`` says about a handler: the defaults of
    ``run_worker``'s (and ``fdq worker``'s) options."""

    topic: str | None = None
    subscription: str | None = None
    mode: str | None = None
    batch: bool | None = None


def _check_mode(mode):
    if mode is not None and mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, not {mode!r:.80}")
    return mode


def handler(fn=None, *, topic: str | None = None, subscription: str | None = None, mode: str | None = None,
            batch: bool | None = None):
    """Mark ``fn`` as a worker's handler with defaults for its topic, subscription,
    delivery mode and whether it takes a batch (a list of messages: ``fdq.tail``'s
    ``batch=True``) (``@fdq.worker.handler(topic="orders")``; bare
    ``@fdq.worker.handler`` marks it only). Returns ``fn`` itself: it can still be
    called directly."""
    if batch is not None and not isinstance(batch, bool):
        raise ConfigError(f"batch must be True or False, not {batch!r:.80}")
    defaults = HandlerDefaults(None if topic is None else check_name(topic),
                               None if subscription is None else check_name(subscription, "subscription"),
                               _check_mode(mode), batch)

    def mark(f):
        if not callable(f):
            raise ConfigError(f"@fdq.worker.handler marks a function, not {type(f).__name__}")
        f.fdq_worker = defaults
        return f
    return mark if fn is None else mark(fn)


def defaults_of(fn) -> HandlerDefaults:
    """The defaults ``@fdq.worker.handler`` gave ``fn`` (none: all None)."""
    found = getattr(fn, "fdq_worker", None)
    return found if isinstance(found, HandlerDefaults) else HandlerDefaults()


def is_coroutine_handler(fn) -> bool:
    return asyncio.iscoroutinefunction(fn) or asyncio.iscoroutinefunction(getattr(fn, "__call__", None))


class Worker:
    """A handler consuming a subscription (``run_worker`` runs one): ``start()``, then
    ``stop(drain_timeout_s)`` (or ``abort()``). ``handled``: deliveries whose handler call
    ended (returned or raised)."""

    def __init__(self, db, handler, *, topic: str | None = None, subscription: str | None = None,
                 mode: str | None = None, concurrency: int | None = None, config: ConsumerConfig | None = None,
                 batch_size: int = 100, consumer_id: str | None = None, on_error=None, batch: bool | None = None):
        if not callable(handler):
            raise ConfigError(f"handler must be callable, not {type(handler).__name__}")
        defaults = defaults_of(handler)
        self.db, self.handler = db, handler
        self.topic = topic or defaults.topic
        if self.topic is None:
            raise ConfigError("no topic to consume: give one (--topic), or in @fdq.worker.handler(topic=...)")
        self.subscription = subscription or defaults.subscription or DEFAULT_SUBSCRIPTION
        self.mode = _check_mode(mode or defaults.mode or "at-least-once")
        self.is_async = is_coroutine_handler(handler)
        self.batch = bool(batch if batch is not None else defaults.batch)
        if self.is_async and self.batch:
            raise ConfigError("batch handlers run on fdq.tail only: make it a plain function handler(messages)")
        if self.is_async and self.mode == "exactly-once":
            raise ConfigError("exactly-once runs the handler inside the engine transaction, which is "
                              "synchronous: a coroutine handler cannot; make it a plain function handler(tr, msg)")
        config = config or ConsumerConfig()
        if concurrency is not None:
            if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
                raise ConfigError(f"concurrency must be an integer >= 1, not {concurrency!r:.80}")
            config = dataclasses.replace(config, max_concurrency=concurrency)
        self.config = config
        self.batch_size = batch_size
        self.consumer_id = consumer_id
        self.on_error = on_error
        self.handled = 0
        self._count_lock = threading.Lock()     # handlers end in several threads at once
        self._tail = None       # the TailConsumer, or fdq.aio's AsyncTail
        self._loop = None       # the event loop of a coroutine handler, in its own thread
        self._loop_thread = None
        self._cut_off = False   # a coroutine handler was left running (its loop stopped under it)
        self._aborting = threading.Event()  # abort(): a drain under way stops waiting

    @property
    def consumer(self):
        """The consumer (a :class:`fdq.tailing.TailConsumer`, or ``fdq.aio``'s consumer)."""
        return None if self._tail is None else getattr(self._tail, "consumer", self._tail)

    def _ended(self, arg):
        with self._count_lock:
            self.handled += len(arg) if self.batch else 1

    def _counted(self):
        """The handler, counting the messages whose call ended (``handled``)."""
        h, ended = self.handler, self._ended
        if self.is_async:
            async def run(m):
                try:
                    return await h(m)
                finally:
                    ended(m)
        elif self.mode == "exactly-once":
            def run(tr, m):
                try:
                    return h(tr, m)
                finally:
                    ended(m)
        else:
            def run(m):
                try:
                    return h(m)
                finally:
                    ended(m)
        return run

    @property
    def _acking(self):
        return False if self.mode == "at-most-once" else None     # (None: at least once, as the subscription allows)

    def start(self):
        kwargs = dict(batch_size=self.batch_size, consumer_id=self.consumer_id, subscription=self.subscription,
                      config=self.config, on_error=self.on_error)
        if not self.is_async:
            self._tail = tail(self.db, self.topic, self._counted(), acking=self._acking,
                              transactional=self.mode == "exactly-once", batch=self.batch, **kwargs)
            return self
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="fdq-worker-loop", daemon=True)
        self._loop_thread.start()
        try:
            self._tail = asyncio.run_coroutine_threadsafe(
                aio.tail(self.db, self.topic, self._counted(), acking=self._acking, **kwargs), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise
        return self

    def check(self):
        """Raise what ended the worker's consumer: its topic or subscription deleted
        (the consumer rejoins if it is created again before this looks)."""
        gone = getattr(self.consumer, "_gone", None)
        if gone is not None:
            raise gone

    def stop(self, drain_timeout_s: float | None = None) -> bool:
        """Drain and leave (see the module); True if every handler returned within
        ``drain_timeout_s`` (None: the consumer's ack wait, as the subscription makes it).
        ``abort()`` from another thread cuts the wait short."""
        if self._tail is None:
            return True
        ack_wait_s = self.consumer.config.ack_wait_s      # the subscription's, if it sets one
        timeout = ack_wait_s if drain_timeout_s is None else max(0.0, drain_timeout_s)
        if not self.is_async:
            self._tail.close(timeout)       # (a later close(0): abort)
            return not self._tail.running
        fut = asyncio.run_coroutine_threadsafe(self._tail.shutdown(), self._loop)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    fut.result(max(0.0, min(TICK_S, deadline - time.monotonic())))
                    return True
                except concurrent.futures.TimeoutError:
                    if self._aborting.is_set() or time.monotonic() >= deadline:
                        break
            self._cut_off = True
            self._tail.consumer.close()     # its leases back (started: nak), membership left
            return False
        finally:
            self._stop_loop()

    def abort(self, timeout: float | None = AT_ONCE_S) -> bool:
        """Leave at once: no handler waited for (theirs nak'd), unstarted messages
        released, the membership left; a drain under way (``stop`` in another thread)
        stops waiting, and this returns once the consumer has left, whichever thread
        did it, or after ``timeout`` seconds (None: no bound), returning whether it left."""
        self._aborting.set()
        if self._tail is None:
            return True
        leaving = threading.Thread(target=self._leave_now, name="fdq-worker-abort", daemon=True)
        leaving.start()
        leaving.join(timeout)
        return not leaving.is_alive()

    def _leave_now(self):
        if not self.is_async:
            self._tail.close(0)
            return
        self._cut_off = not self._tail._task.done()
        try:
            self._tail.consumer.close()
        finally:
            self._stop_loop()

    def _stop_loop(self):
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)

    @property
    def running(self) -> bool:
        """Whether a handler may still run (after a drain that ran out, or ``abort``)."""
        if self._tail is None:
            return False
        if self.is_async:
            return self._cut_off
        return self._tail.running


def run_worker(db, handler, *, topic: str | None = None, subscription: str | None = None,
               mode: str | None = None, concurrency: int | None = None, drain_timeout_s: float | None = None,
               stop: threading.Event | None = None, config: ConsumerConfig | None = None, batch_size: int = 100,
               consumer_id: str | None = None, on_error=None, batch: bool | None = None, started=None,
               abort: threading.Event | None = None, draining=None) -> Worker:
    """Run ``handler`` over ``topic``'s ``subscription`` (defaults: ``@handler``'s; the
    subscription ``default``; at-least-once) until ``stop`` is set or an exception
    (KeyboardInterrupt) arrives while it waits, then drain (the module's docstring) and
    return the stopped :class:`Worker` (``running``: a handler outlived the drain); the
    exception is raised again after the drain. An exception once stopping (a second
    Ctrl-C), or ``abort`` set, leaves at once (``Worker.abort``). ``concurrency``:
    handlers at once (shards of one number never at once: a key's order holds).
    ``started(worker)`` is called once consuming, ``draining(worker)`` once the drain
    begins (both in the calling thread). A topic or subscription deleted under it ends
    it (raised). ``batch``: the handler takes each round's messages as a list
    (``fdq.tail``'s ``batch=True``).

    ``stop`` and ``abort`` are only read here (``is_set``, every ``TICK_S``), never
    waited on: a signal handler may set them (``Event.set`` in a handler that
    interrupted a wait on the same event would deadlock on its lock)."""
    w = Worker(db, handler, topic=topic, subscription=subscription, mode=mode, concurrency=concurrency,
               config=config, batch_size=batch_size, consumer_id=consumer_id, on_error=on_error, batch=batch)
    w.start()
    try:
        if started is not None:
            started(w)
        while not (stop is not None and stop.is_set()):
            w.check()
            time.sleep(TICK_S)
    except BaseException:
        _drain(w, drain_timeout_s, abort, draining)     # the first request: drain, then raise it
        raise
    _drain(w, drain_timeout_s, abort, draining)
    return w


def _drain(w: Worker, drain_timeout_s, abort, draining):
    """``w.stop(drain_timeout_s)`` in a thread of its own, this one waiting in ticks (what
    the drain raised is raised here); an exception here (a second Ctrl-C) or ``abort``
    set leaves at once."""
    failed = []

    def run():
        try:
            w.stop(drain_timeout_s)
        except BaseException as e:
            failed.append(e)

    drain = threading.Thread(target=run, name="fdq-worker-drain", daemon=True)
    try:
        if draining is not None:
            draining(w)
        drain.start()
        while drain.is_alive():
            if abort is not None and abort.is_set():
                w.abort()
                return
            drain.join(TICK_S)
    except BaseException:
        w.abort()
        raise
    if failed:
        raise failed[0]


__all__ = ["run_worker", "handler", "Worker", "HandlerDefaults", "defaults_of", "MODES", "AT_ONCE_S"]
