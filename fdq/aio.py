"""asyncio variants of ``tail``, ``push`` and the pull consumer (``Consumer``, whose
``messages()`` is for ``async for``): coroutine handlers on the caller's event loop,
every engine call in a worker thread, so the loop never blocks on the database.

    async def handle(msg):
        await store(msg.body)              # return = ack, raise = nak (with backoff)

    t = await fdq.aio.tail(db, "orders", handle, config=fdq.ConsumerConfig(max_concurrency=8))
    ...
    await t.shutdown()

Delivery is the pull consumer's (``fdq.Consumer``): each round leases a batch in one
transaction, runs the handlers (never two of one shard number at once, across dispatch
tags, so a key's handlers never overlap and its order per tag is kept; up to
``max_concurrency`` shard numbers at once), and commits the round's settlements in
one transaction. ``msg.ack()``, ``msg.nak(delay)`` and ``msg.term(reason)`` inside a
handler are recorded and committed with the round (they do not block the loop);
``await t.in_progress(msg)`` extends a lease from the loop.

At-most-once (``acking=False``) acks each batch before any handler runs. Exactly-once is
not offered here: its handler runs inside the engine transaction, which is synchronous;
use ``fdq.tail(..., transactional=True)``.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import logging

from . import hooks
from .config import DEFAULT_SUBSCRIPTION, ConsumerConfig
from .consumer import Consumer as _SyncConsumer, check_messages_args
from .tailing import check_delivery_args
from .errors import ConfigError, LeaseLost
from .settlement import RELEASE, Settlement

log = logging.getLogger("fdq.aio")
# The AsyncTail whose handler this task runs (set in each round's handler tasks).
_IN_ROUND = contextvars.ContextVar("fdq_aio_in_round", default=None)


class HandlerCancelled(Exception):
    """A handler raised ``asyncio.CancelledError`` while its task was not being
    cancelled: reported (``on_error``) and the message nak'd, as any handler failure."""


def _cancelled(task) -> bool:
    """Whether ``task`` has a cancellation request pending (Python 3.10 cannot tell:
    then every CancelledError counts as one, as before)."""
    cancelling = getattr(task, "cancelling", None)
    return task is None or cancelling is None or cancelling() > 0


class AsyncTail:
    """A running asyncio consumer (made by :func:`tail`)."""

    def __init__(self, consumer: _SyncConsumer, handler, acking: bool, poll_s: float):
        self.consumer = consumer
        self.handler = handler
        self._acking = acking
        self._poll_s = poll_s
        self._stopping = False
        self._closed = asyncio.Event()  # set when shutdown() has closed the consumer
        self._close_in_task = False     # shutdown() came from a handler: the task closes
        self._in_fetch = False          # the task awaits a fetch (no round in hand)
        self._slots = asyncio.Semaphore(consumer.config.max_concurrency)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"fdq-aio-{consumer.id}")

    @property
    def id(self) -> str:
        return self.consumer.id

    @property
    def is_acking(self) -> bool:
        return self._acking

    @property
    def batch_size(self) -> int:
        return self.consumer.batch_size

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))

    async def _run(self):
        try:
            await self._consume()
        finally:
            if self._close_in_task:     # shutdown() came from a handler: close here
                try:
                    await self._call(self.consumer.close)
                finally:
                    self._closed.set()

    async def _consume(self):
        while not self._stopping:
            try:
                self._in_fetch = True
                try:
                    # not handed over until a handler begins (``_mark_handed``): what none
                    # began goes back uncounted at close, also past a drain's timeout
                    msgs = await self._call(self.consumer._fetch_tracked, self.batch_size, self._poll_s, None,
                                            False)
                finally:
                    self._in_fetch = False
                if msgs and self._stopping:     # never handed to a handler: back, no attempt counted
                    await self._call(self.consumer.settle, [Settlement(m, RELEASE) for m in msgs
                                                            if m._taken.lease_id is not None])
                elif msgs:
                    await self._round(msgs)
            except asyncio.CancelledError:
                raise
            except Exception as e:      # the database or the topic: report, pause, go on
                self.consumer._report(e)
                await asyncio.sleep(0.05)

    async def _round(self, msgs):
        leased = [m for m in msgs if m._taken.lease_id is not None]     # not: taken (ack_policy none)
        if not self._acking and leased:     # at most once: gone before any handler runs
            try:
                await self._call(self.consumer.ack_many, leased)
            except LeaseLost as e:      # not ours to handle: redelivered elsewhere
                self.consumer._report(e)
                msgs = [m for m in msgs if m.id not in e.ids]
        # kept leased while it runs long (``fdq.message._Round``)
        pending = self.consumer._begin_round(msgs) if self._acking else None
        by_shard = {}
        for m in msgs:
            if self._acking:
                m._deferred = pending
            # by shard number, across dispatch tags: a key's tagged and untagged
            # messages are on shards of one number (``tailing._by_shard_number``)
            by_shard.setdefault(m.shard, []).append(m)
        try:
            await asyncio.gather(*(self._handle_in_order(ms) for ms in by_shard.values()))
        finally:
            if pending is not None:     # waits for a keep's commit (settling elsewhere)
                pending = await asyncio.shield(self._call(self.consumer._end_round, pending))
        if pending:
            try:
                await self._call(self.consumer.settle, pending)
            except LeaseLost as e:
                self.consumer._report(e)

    async def _handle_in_order(self, msgs):
        _IN_ROUND.set(self)     # this task's own context (gather made it a task)
        async with self._slots:
            for m in msgs:
                if self._stopping and self._acking:     # shutting down: not begun, back uncounted
                    m.release()
                    m._deferred = None
                    continue
                self.consumer._mark_handed(m)
                call = hooks.begin_handle(m) if hooks.active else None
                error = None
                try:
                    try:
                        await self.handler(m)
                    except asyncio.CancelledError as e:
                        if _cancelled(asyncio.current_task()):
                            raise       # we are being cancelled (shutdown, loop end)
                        # the handler's own (it awaited something another task
                        # cancelled): a failed handler, not the end of the tail
                        raise HandlerCancelled(f"the handler raised {e!r}") from e
                    if self._acking and m._settled is None:
                        m.ack()
                except Exception as e:
                    error = e
                    if self._acking and m._settled is None:
                        m.nak(error=e)
                    self.consumer._report(e, m)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    m._deferred = None
                    if call is not None:
                        call.end(error)

    async def in_progress(self, msg):
        """Extend ``msg``'s lease now (one transaction, off the loop)."""
        await self._call(msg.in_progress)

    async def shutdown(self):
        """Finish the round in hand: the handlers running finish, the messages no handler
        began go back at once, no attempt counted (as ``fdq.tail``'s ``shutdown()``), its
        settlements commit; then leave: the shards
        go to the other consumers at once, and so do the leases of a fetch under way (it
        ends at once; ``Consumer.close`` waits for its worker thread, also when this
        tail's task was cancelled, so nothing it leased waits for its ack wait).
        Called by a handler (its task cannot wait for the round it is part of), it
        returns at once; the round finishes and the tail's task then closes."""
        if _IN_ROUND.get() is self:
            if not self._stopping:
                self._stopping = self._close_in_task = True
            return
        if self._stopping:      # another call is shutting it down: return when it has
            await self._closed.wait()
            return
        self._stopping = True
        # No round in hand: close now, which ends the fetch the task awaits.
        closing = asyncio.ensure_future(self._call(self.consumer.close)) if self._in_fetch else None
        try:
            await self._task
        finally:
            try:
                await (closing if closing is not None else self._call(self.consumer.close))
            finally:
                self._closed.set()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.shutdown()


class Consumer:
    """:class:`fdq.Consumer` on an event loop: every engine call in a worker thread.

        async with await fdq.aio.Consumer.open(db, "orders") as c:
            async for m in c.messages():
                await store(m.body)
                m.ack()

    ``open`` takes :class:`fdq.Consumer`'s arguments; ``.consumer`` is the consumer."""

    def __init__(self, consumer):
        self.consumer = consumer
        self._batches = set()   # the _Batch of each messages() iterator under way

    @classmethod
    async def open(cls, db, topic: str, **kwargs) -> "Consumer":
        loop = asyncio.get_running_loop()
        return cls(await loop.run_in_executor(None, functools.partial(_SyncConsumer, db, topic, **kwargs)))

    @property
    def id(self) -> str:
        return self.consumer.id

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))

    async def messages(self, batch: int = 100, timeout: float | None = None):
        """As :meth:`fdq.Consumer.messages`, for ``async for``. ``m.ack()``,
        ``m.nak()``, ``m.term()`` of a message of the batch in hand are recorded, not
        committed on the loop: they commit (off the loop) before the next batch is
        leased, when the iterator is closed or the consumer is (``break`` then ``close()``:
        an iterator left by ``break`` is closed only when Python collects it), or within
        half the ack wait if a batch runs long; a message settled after its batch is done
        commits at once (blocking)."""
        check_messages_args(batch, timeout)
        c = self.consumer
        loop = asyncio.get_running_loop()
        last = loop.time()
        b = _Batch()
        self._batches.add(b)
        try:
            while not c._closed:
                wait = 1.0 if timeout is None else min(1.0, max(0.0, last + timeout - loop.time()))
                msgs = await self._call(_settle_and_fetch, c, b.finish(c), batch, wait)
                if not msgs:
                    if timeout is not None and loop.time() - last >= timeout:
                        return
                    continue
                if hooks.active:
                    hooks.received(msgs)    # tracing: a receive span linked to each message's
                b.begin(c, msgs)
                for m in msgs:
                    c._mark_handed(m)
                    b.given += 1
                    yield m
                last = loop.time()
        finally:
            self._batches.discard(b)
            await self._flush(b)

    async def _flush(self, b: "_Batch"):
        """Commit what ``b``'s batch recorded and give back what it did not yield."""
        settlements = b.finish(self.consumer)
        if settlements and not self.consumer._closed:
            try:
                await self._call(self.consumer.settle, settlements)
            except LeaseLost as e:
                self.consumer._report(e)

    async def close(self):
        """Commit the settlements its iterators recorded, give back what they did not
        yield, then leave (:meth:`fdq.Consumer.close`, off the loop)."""
        while self._batches:
            await self._flush(self._batches.pop())
        await self._call(self.consumer.close)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class _Batch:
    """The batch a ``Consumer.messages()`` iterator has in hand: its messages, how many
    it yielded, the round collecting their settlements."""

    __slots__ = ("msgs", "given", "pending")

    def __init__(self):
        self.msgs, self.given, self.pending = [], 0, None

    def begin(self, consumer, msgs):
        leased = [m for m in msgs if m._taken.lease_id is not None]     # not: taken (ack_policy none)
        self.msgs, self.given, self.pending = msgs, 0, consumer._begin_round(leased)
        for m in leased:
            m._deferred = self.pending

    def finish(self, consumer) -> list:
        """The batch is done: its recorded settlements and a release of each message it
        did not yield (to commit); its messages settled from now on commit at once."""
        for m in self.msgs:
            m._deferred = None
        out = consumer._end_round(self.pending) if self.pending is not None else []
        out += [Settlement(m, RELEASE) for m in self.msgs[self.given:]
                if m._taken.lease_id is not None and m._settled is None]
        self.msgs, self.given, self.pending = [], 0, None
        return out


def _settle_and_fetch(consumer, settled, batch, wait) -> list:
    """In a worker thread: commit the last batch's settlements, lease the next batch
    (not handed over: released at close unless yielded, ``Consumer.messages``)."""
    if settled:
        try:
            consumer.settle(settled)
        except LeaseLost as e:
            consumer._report(e)
    return consumer._fetch_tracked(batch, wait, None, handed=False)


async def tail(db, topic: str, handler, acking: bool | None = None, transactional: bool = False,
               batch_size: int = 100, consumer_id: str | None = None,
               subscription: str = DEFAULT_SUBSCRIPTION, config: ConsumerConfig | None = None,
               **kwargs) -> AsyncTail:
    """As :func:`fdq.tail`, with ``handler`` a coroutine function ``async def h(msg)``;
    consumes on the running loop until ``await t.shutdown()``. ``acking=False`` is
    at-most-once, otherwise at-least-once (at-most-once on a subscription with
    ``ack_policy='none'``, where ``acking=True`` is refused). Other keyword arguments go to
    :class:`fdq.Consumer` (``extend_support``, ``desired_tag``, ``on_error``, ...)."""
    check_delivery_args(acking, transactional)
    if transactional:
        raise ConfigError("fdq.aio.tail has no exactly-once mode: its handler runs inside the engine "
                          "transaction, which is synchronous; use fdq.tail(..., transactional=True)")
    if not asyncio.iscoroutinefunction(handler) and not asyncio.iscoroutinefunction(
            getattr(handler, "__call__", None)):
        raise ConfigError("fdq.aio.tail needs a coroutine function (async def handler(msg)); "
                          "for a plain function use fdq.tail")
    poll_s = (config or ConsumerConfig()).poll_interval_s
    loop = asyncio.get_running_loop()
    consumer = await loop.run_in_executor(None, functools.partial(
        _SyncConsumer, db, topic, subscription=subscription, consumer_id=consumer_id, config=config,
        batch_size=batch_size, **kwargs))
    if consumer.sub_config.ack_policy == "none":
        # As ``fdq.tail``: its messages are taken, not leased (nothing to ack): at most once.
        if acking is True:
            await loop.run_in_executor(None, consumer.close)
            raise ConfigError(f"acking=True needs ack_policy='explicit' (subscription "
                              f"{subscription!r} has ack_policy='none')")
        acking = False
    return AsyncTail(consumer, handler, acking is not False, poll_s)


async def push(producer, topic: str, body: bytes, *, shard_key: str | None = None, msg_id: str | None = None,
               delay: float | None = None, headers=None, ttl: float | None = None):
    """``await`` a push (:meth:`fdq.Producer.push`'s arguments) without blocking the
    loop: queued with the producer's other pending pushes (group commit, committed by its
    flusher thread), resolved on this loop after its commit. Returns the PushResult.
    Cancelling the awaiting task does not recall the push (it may still be stored); the
    push counts as cancelled (``fdq.hooks``' push_end gets no results and no error, as
    for a cancelled ``push_async`` future), not as pushed."""
    loop = asyncio.get_running_loop()
    return await producer._push_async(loop.create_future(), loop, topic, body, shard_key, msg_id, delay,
                                      headers, ttl)


__all__ = ["tail", "push", "AsyncTail", "Consumer"]
