"""Producers: push messages into a topic.

``Producer`` is the entry point: it batches concurrent pushes into shared transactions
(group commit), runs each through the one retry loop and turns their results into
``PushResult`` s. What a push transaction writes, and how much it may, is
:mod:`fdq.ops.push`'s; where a message goes, :mod:`fdq.ops.routing`'s.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from _thread import allocate_lock as _allocate_lock
from _thread import get_ident
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future as _ConcurrentFuture
from concurrent.futures import InvalidStateError

from fdb.tuple import Versionstamp

from .config import ProducerConfig, check_name
from .engine import Again, Done, after_interrupt, transact
from .envelope import Envelope, PushResult, _plain_envelope, _plain_result
from .errors import (ConfigError, EngineError, FDQError, InvalidMessage, MessageTooLarge, TopicHeld,
                     is_maybe_committed)
from .headers import trace_id
from .keyspace import Keyspace, message_id
from .ops.push import TX_WRITE_BYTES, fits, push_batch, read_marker
from .ops.routing import spread_start
from . import hooks
from .supervisor import replay_window
from .times import to_ms
from .ops.topics import HOLD_WAIT_S
# Re-exported at their old names until the wrap-up (other partitions import them here).
from .envelope import MAX_DELAY_S, MAX_SHARD_KEY_BYTES  # noqa: E402,F401
from .ops.push import route_message  # noqa: E402,F401

MAX_PER_TRANSACTION = 1 << 16   # a versionstamp's user version (2 bytes) numbers them


def check_messages(call: str, envelopes) -> Iterable:
    """``envelopes`` if it is an iterable of messages; an ``InvalidMessage`` naming the
    call if it is not one, or is one message (bytes, an ``Envelope``) or a str or mapping
    (iterating them would give characters, ints or keys)."""
    if isinstance(envelopes, (bytes, bytearray, memoryview, Envelope)):
        raise InvalidMessage(f"{call} takes an iterable of Envelope or bytes, not one message "
                             f"({type(envelopes).__name__}): push one message with push, or pass [message]")
    if isinstance(envelopes, (str, Mapping)) or not isinstance(envelopes, Iterable):
        raise InvalidMessage(f"{call} takes an iterable of Envelope or bytes, not {type(envelopes).__name__}")
    return envelopes


def _envelope(body, shard_key, delay, msg_id, headers, ttl) -> Envelope:
    """The ``Envelope`` of a ``push``: a plain one (bytes, no option: the common case of
    one push per request) made without the dataclass's checks (~3 µs of a push's Python)."""
    if type(body) is bytes and shard_key is None and delay is None and msg_id is None and headers is None \
            and ttl is None:
        return _plain_envelope(body)
    return Envelope(body, shard_key, delay, msg_id, headers, ttl)


_EVENTFD = hasattr(os, "eventfd")


class _Waiter:
    """A thread's wait for the commit of its ``push`` (one per thread, reused): an
    eventfd the committing thread writes. Written with the GIL released, so the woken
    thread, if it runs at once, runs Python instead of preempting a committer that
    holds the GIL (a lock released under the GIL did: the committer then waited for a
    CPU holding the GIL, ~60% of its samples with 64 threads pushing)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def __del__(self, _close=os.close):
        _close(self.fd)


_waiters = threading.local()    # the calling thread's _Waiter (``_waiter``)


def _waiter():
    """The calling thread's ``_Waiter``; without one (not Linux, or no file descriptor
    left for it), a lock held until the push is committed, one per push."""
    if _EVENTFD:
        try:
            return _waiters.w
        except AttributeError:
            try:
                w = _waiters.w = _Waiter(os.eventfd(0, os.EFD_CLOEXEC))
                return w
            except OSError:     # (EMFILE: a push still works, as it did with locks)
                pass
    lock = _allocate_lock()
    lock.acquire()
    return lock


def _wait(item):
    """Return once ``item`` is committed or failed (its ``done`` written). A write left by
    an earlier push of this thread whose wait was interrupted is read and waited past."""
    done = item.done
    if type(done) is not _Waiter:
        done.acquire()
        return
    fd = done.fd
    while True:
        os.eventfd_read(fd)
        if item.result is not None or item.error is not None:
            return


def _wake(done):
    if type(done) is _Waiter:
        os.eventfd_write(done.fd, 1)
    else:
        done.release()


class _Item:
    """One queued push. A caller of ``push`` waits (``_wait``) on ``done``, its thread's
    ``_Waiter``, written once the push is committed or failed (``_wake``). An
    asynchronous push has no waiter but a ``future``:
    a ``concurrent.futures.Future`` (``push_async``), or with ``loop`` an asyncio future
    of that loop (``fdq.aio.push``: resolved on it, ``_resolve_on_loop``); ``call``: the
    hooks' (``fdq.hooks.PushCall``) of an ``fdq.aio.push``, ended on its loop with the
    future."""

    __slots__ = ("topic", "env", "result", "error", "future", "done", "loop", "call")

    def __init__(self, topic: str, env: Envelope, future=None, loop=None, call=None):
        self.topic, self.env, self.future, self.loop, self.call = topic, env, future, loop, call
        self.result = self.error = None
        self.done = _waiter() if future is None else None


def _resolve_on_loop(items: list):
    """On an event loop: resolve the asyncio futures of ``items`` (``fdq.aio.push``
    calls of one commit, all of this loop) and end their hooks' calls. A future its
    task cancelled is left: the push is stored all the same (as a cancelled
    ``push_async`` future), and its call ends as one (no results, no error: counted
    ``cancelled`` by ``fdq.metrics``). Ended here, where a cancel and the outcome are
    ordered (the loop's thread); the committing thread could not tell."""
    for it in items:
        future = it.future
        if future.done():
            if it.call is not None:
                it.call.end(None, None)
            continue
        if it.error is not None:
            future.set_exception(it.error)
        else:
            future.set_result(it.result)
        if it.call is not None:
            it.call.end(None if it.error is not None else [it.result], it.error)


def _end_calls(items: list):
    """End the hooks' calls of ``items`` (``fdq.aio.push``) with their outcome, in this
    thread: their loop is closed (nobody awaits them)."""
    for it in items:
        if it.call is not None:
            it.call.end(None if it.error is not None else [it.result], it.error)


def _deliver_async(batch: list):
    """Deliver the outcome (``result`` / ``error``) of the asynchronous pushes of
    ``batch``: a ``push_async`` future is set here (its done callbacks run here), an
    ``fdq.aio.push`` future on its loop, by one ``call_soon_threadsafe`` per loop (not
    one per push: each is a write to the loop's self-pipe and a wake-up)."""
    loops = None
    for it in batch:
        future = it.future
        if future is None:
            continue
        if it.loop is None:
            try:
                if it.error is not None:
                    future.set_exception(it.error)
                else:
                    future.set_result(it.result)
            except InvalidStateError:
                pass    # cancelled by its owner: the push is stored all the same
            continue
        if loops is None:
            loops = {}
        mine = loops.get(it.loop)
        if mine is None:
            loops[it.loop] = [it]
        else:
            mine.append(it)
    if loops:
        for loop, items in loops.items():
            try:
                loop.call_soon_threadsafe(_resolve_on_loop, items)
            except RuntimeError:
                _end_calls(items)   # the loop is closed: nobody awaits these


class _GroupCommit:
    """Group commit. A caller that finds nobody committing commits what is queued itself
    (one thread: no hand-off, no wake-up); callers arriving meanwhile queue and wait. If
    pushes are queued when its commit ends, it hands them to the producer's flusher
    thread and returns (to push again): the flusher keeps committing while pushes keep
    coming, each commit carrying every caller waiting, and gives up leading when the
    queue stays empty. Asynchronous pushes (no caller waiting) are always led by it."""

    def __init__(self, flush, max_batch: int, linger_s: float):
        self._flush = flush
        self._max_batch = max_batch
        self._linger_s = linger_s
        self._lock = threading.Lock()
        self._queue = []
        self._leading = False
        self._flusher = None
        self._flusher_go = threading.Event()
        self._commit_s = 0.0
        self._async_pending = 0  # asynchronous pushes queued or being committed
        self._idle = threading.Condition(self._lock)
        self._committer = None   # the id of the thread committing a batch (one leads at a time)
        self._committing = []    # the batches being committed (a forked child fails their futures)
        _LIVE_GROUPS.add(self)

    def submit(self, item: _Item):
        """Queue ``item`` and return once it is committed (or failed)."""
        if self._committer == get_ident():
            # Called by the thread committing a batch: from a push_async future's done
            # callback (run where the result is set). It would wait for itself while
            # nobody else may lead: commit this push now, alone.
            item.done = None
            self._flush([item])
            return
        with self._lock:
            self._queue.append(item)
            lead = not self._leading
            if lead:
                self._leading = True
        if not lead:
            _wait(item)
            return
        item.done = None    # (first in the batch it commits: nobody to wake)
        self._lead(rounds=1)

    def submit_async(self, item: _Item):
        """Queue ``item`` without waiting; its ``future`` resolves after the commit."""
        with self._lock:
            self._queue.append(item)
            self._async_pending += 1
            if self._leading:
                return
            self._leading = True
        self._wake_flusher()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every asynchronous push queued so far is committed or failed
        (and those queued meanwhile); False if ``timeout`` passed first. From the
        thread committing a batch (a ``push_async`` future's done callback) it would
        wait for itself: a ``ConfigError`` says so instead."""
        if self._committer == get_ident():
            raise ConfigError("Producer.flush() called from a push_async callback: the callback runs in the "
                              "thread committing the pushes it would wait for; flush from another thread")
        with self._idle:
            return self._idle.wait_for(lambda: not self._async_pending, timeout)

    def _wake_flusher(self):
        with self._lock:    # (with the flusher's idle exit: a wake-up is never left unread)
            self._flusher_go.set()
            if self._flusher is None or not self._flusher.is_alive():
                self._flusher = threading.Thread(target=self._flusher_loop, name="fdq-producer-flush",
                                                 daemon=True)
                self._flusher.start()

    def _flusher_loop(self):
        while True:
            if not self._flusher_go.wait(FLUSHER_IDLE_S):
                # Idle: end (a thread waiting forever would hold its Producer and
                # connection: one made per request left one each). The next wake-up
                # starts another.
                with self._lock:
                    if not self._flusher_go.is_set():
                        if self._flusher is threading.current_thread():
                            self._flusher = None
                        return
                continue
            self._flusher_go.clear()
            try:
                self._lead(rounds=None)
            except BaseException:   # delivered to the items' futures by the flush
                pass

    def _lead(self, rounds: int | None):
        """Commit queued pushes, ``rounds`` times (None: until the queue stays empty),
        then hand what is left to the flusher."""
        released = 0    # callers the last commit released (they push again)
        n = 0
        try:
            while rounds is None or n < rounds:
                n += 1
                if self._linger_s:
                    time.sleep(self._linger_s)
                elif released and len(self._queue) < min(released, self._max_batch):
                    self._gather(min(released, self._max_batch))
                with self._lock:
                    batch = self._queue[:self._max_batch]
                    del self._queue[:self._max_batch]
                    if not batch:
                        self._leading = False
                        return
                t0 = time.perf_counter()
                self._committing.append(batch)
                try:
                    self._committer = get_ident()
                    self._flush(batch)
                finally:
                    self._committer = None
                    self._committing.remove(batch)
                    n_async = sum(it.future is not None for it in batch)
                    if n_async:
                        with self._lock:
                            self._async_pending -= n_async
                            if not self._async_pending:
                                self._idle.notify_all()
                self._commit_s = time.perf_counter() - t0
                released = len(batch) - n_async
        except BaseException:
            after_interrupt()
            # Interrupted (a signal handler's exception while lingering, say): the
            # flusher takes over what is queued, or nobody would lead it again.
            self._handoff()
            raise
        self._handoff()

    def _gather(self, callers: int):
        """Give the ``callers`` the last commit released (waiting for the GIL meanwhile)
        the time to push again before the next commit takes the queue: until as many are
        queued, for at most a fifth of the last commit's time (and 1 ms). Else the
        callers split into groups that alternate, each commit carrying one group."""
        deadline = time.perf_counter() + min(0.001, self._commit_s / 5)
        while len(self._queue) < callers and time.perf_counter() < deadline:
            time.sleep(0)

    def _reset_in_child(self):
        """After fork(), in the child: its locks may have been held by a thread of the
        parent, its queue is the parent's (committed there), and nobody leads it. The
        futures of the pushes queued or being committed (the parent's, copied) fail here:
        the parent commits them."""
        queued, self._queue = self._queue, []
        for batch in self._committing:    # being committed by a thread of the parent's
            queued += batch
        self._committing = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._leading = False
        self._flusher = None
        self._flusher_go = threading.Event()
        self._async_pending = 0
        self._committer = None
        err = EngineError(1021, "this push was queued before the process forked: the parent process "
                                "commits it, not this one (it may have committed)")
        for it in queued:
            it.error = err
        _deliver_async(queued)

    def _handoff(self):
        with self._lock:
            if not self._queue:
                self._leading = False
                return
        self._wake_flusher()


_LIVE_GROUPS = weakref.WeakSet()
FLUSHER_IDLE_S = 2.0    # a producer's flusher thread ends after this long without work
_LIVE_PRODUCERS = weakref.WeakSet()
EXIT_FLUSH_S = 60.0     # at interpreter exit, how long pending push_async calls may take
CHECKED_NAMES = 1024    # topic names a Producer remembers as checked


def _after_fork_in_child():
    """A Producer used on both sides of a fork(): the child gets a session of its own
    (the parent's would give both processes the same transaction ids, and a retry after
    commit_unknown_result would take the other's marker for its own commit) and a group
    commit with no leader (the parent's flusher thread is not in the child)."""
    global _waiters
    _waiters = threading.local()    # (the parent's eventfds: shared with it)
    for producer in list(_LIVE_PRODUCERS):
        producer._session = os.urandom(8)
        producer._seq_lock = threading.Lock()
    for group in list(_LIVE_GROUPS):
        group._reset_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _flush_at_exit():
    """The flusher is a daemon thread (it must not keep a process alive): at a normal
    exit, commit what ``push_async`` callers left queued before it is stopped."""
    deadline = time.monotonic() + EXIT_FLUSH_S
    for group in list(_LIVE_GROUPS):
        group.flush(max(0.0, deadline - time.monotonic()))


class Producer:
    """Pushes messages. Thread-safe; concurrent ``push`` calls share transactions.

    Example::

        p = fdq.Producer(db)
        r = p.push("orders", b"body", shard_key="cust-42")
        p.push_many("orders", [fdq.Envelope(b"a", shard_key="x"), fdq.Envelope(b"b")])
    """

    def __init__(self, db, *, config: ProducerConfig | None = None, keyspace: Keyspace | None = None):
        self.db = db
        self.config = config or ProducerConfig()
        self.keyspace = keyspace or Keyspace()
        self._time_index = {}
        # Marker ids: a random session plus a sequence, so a producer's markers are
        # neighbours in the key space (one B-tree page, not a random one per push).
        self._session = os.urandom(8)
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._names = set()     # topic names checked (``_check_topic``)
        self._group = _GroupCommit(self._flush, self.config.max_batch, self.config.linger_ms / 1000)
        hooks.load_defaults()   # now, not in the first push's latency
        _LIVE_PRODUCERS.add(self)
        # atexit runs handlers last-registered first: registered again here, the exit flush
        # runs before the handler of FoundationDB's binding (registered when fdb.impl was
        # imported, before any Database existed) stops its network thread.
        atexit.unregister(_flush_at_exit)
        atexit.register(_flush_at_exit)

    def push(self, topic: str, body: bytes, *, shard_key: str | None = None, msg_id: str | None = None,
             delay: float | None = None, headers: Mapping | None = None, ttl: float | None = None) -> PushResult:
        """Push one message; returns after it is committed. A call interrupted (by a
        signal handler's exception) may still commit its push, as a cancelled future.
        ``ttl``: seconds (or a timedelta) after which it is never delivered (default the
        topic's ``ttl_s``; ``TopicConfig.ttl_action`` says what becomes of it)."""
        if type(topic) is not str or topic not in self._names:
            topic = self._check_topic(topic)
        env = _envelope(body, shard_key, delay, msg_id, headers, ttl)
        call = None
        if hooks.active:
            envs = [env]
            call = hooks.begin_push(topic, envs)
            env = envs[0]
        item = _Item(topic, env)
        self._group.submit(item)
        if call is not None:
            call.end(None if item.error is not None else [item.result], item.error)
        if item.error is not None:
            raise item.error
        return item.result

    def _check_topic(self, topic) -> str:
        """``check_name(topic)``, remembered (up to ``CHECKED_NAMES`` names): a push of one
        message checks its topic's name once, not per call."""
        topic = check_name(topic)
        if type(topic) is str and len(self._names) < CHECKED_NAMES:
            self._names.add(topic)
        return topic

    def push_async(self, topic: str, body: bytes, *, shard_key: str | None = None,
                   msg_id: str | None = None, delay: float | None = None,
                   headers: Mapping | None = None, ttl: float | None = None) -> _ConcurrentFuture:
        """As ``push`` without waiting: returns a ``concurrent.futures.Future`` of the
        ``PushResult``, resolved after the commit. Pending pushes share transactions
        (committed by one background thread per producer). Cancelling the future does
        not recall the push."""
        return self._push_async(_ConcurrentFuture(), None, topic, body, shard_key, msg_id, delay, headers, ttl)

    def _push_async(self, future, loop, topic: str, body: bytes, shard_key: str | None = None,
                    msg_id: str | None = None, delay: float | None = None, headers: Mapping | None = None,
                    ttl: float | None = None):
        """Queue a push whose outcome goes to ``future``: a ``concurrent.futures.Future``
        (``loop`` None), or an asyncio future of ``loop`` (``fdq.aio.push``), resolved on
        it after the commit. Returns ``future``."""
        if type(topic) is not str or topic not in self._names:
            topic = self._check_topic(topic)
        env = _envelope(body, shard_key, delay, msg_id, headers, ttl)
        call = None
        if hooks.active:
            envs = [env]
            call = hooks.begin_push(topic, envs)
            env = envs[0]
        if loop is None:
            item = _Item(topic, env, future)
            if call is not None:    # (before the commit can resolve it: run in the committing thread)
                future.add_done_callback(call.end_future)
        else:
            item = _Item(topic, env, future, loop, call)
        self._group.submit_async(item)
        return future

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every ``push_async`` made so far is committed (or failed); False
        if ``timeout`` (seconds) passed first. Also done at a normal interpreter exit
        (for up to ``EXIT_FLUSH_S``), so queued pushes are not dropped with the process."""
        return self._group.flush(timeout)

    def push_many(self, topic: str, envelopes) -> list:
        """Push several messages in one transaction (all or none). More than one
        transaction can hold (FDB's 10 MB: each message is written to the log and to
        every subscription) is refused with ``MessageTooLarge``, nothing pushed."""
        check_name(topic)
        envs = [e if isinstance(e, Envelope) else Envelope(e) for e in check_messages("push_many", envelopes)]
        if not envs:
            return []
        if len(envs) > MAX_PER_TRANSACTION:
            raise InvalidMessage(f"push_many of {len(envs):,} messages: one transaction holds at most "
                                 f"{MAX_PER_TRANSACTION:,} (a message id numbers it in 2 bytes)")
        try:
            return self._commit_hooked([(topic, e) for e in envs])
        except EngineError as e:
            if e.code != 2101 or len(envs) == 1:
                raise
            # (one message too big is refused by push_batch with its own reason)
            raise MessageTooLarge(f"push_many of {len(envs):,} messages ({sum(len(x.body) for x in envs):,} "
                                  f"bytes of bodies) does not fit one transaction (FDB's 10 MB, each message "
                                  f"written to the log and to every subscription's queue): nothing was "
                                  f"pushed; push them in smaller batches") from e

    def _flush(self, batch: list):
        interrupted = None
        try:
            self._commit_group(batch)
        except Exception as e:
            for it in batch:
                if it.result is None and it.error is None:
                    it.error = e
        except BaseException as e:
            after_interrupt()
            # The committing thread was interrupted (KeyboardInterrupt, a signal
            # handler's exception): that is its own to raise, once every push of the
            # batch is released with an error of its own, which cannot say more than
            # "may have committed" (the interrupt may have come after the commit).
            interrupted = e
            err = EngineError(1021, f"the thread committing this push was interrupted ({e!r}): "
                                    "it may have committed")
            for it in batch:
                if it.result is None and it.error is None:
                    it.error = err
        try:
            _deliver_async(batch)
        finally:    # (whatever a future's callback does, no caller waits for good)
            for it in batch:
                if it.done is not None:
                    _wake(it.done)
        if interrupted is not None:
            raise interrupted

    def _commit_group(self, batch: list):
        """Commit queued pushes together. One bad push must not fail the others: a
        refused batch is split in halves until the bad ones stand alone (O(log n) more
        transactions per bad push, not one per message)."""
        try:
            results = self._commit([(it.topic, it.env) for it in batch])
        except FDQError as e:
            if len(batch) == 1 or is_maybe_committed(e):
                # Maybe committed: the whole batch shares the outcome; pushing halves
                # again would store its messages twice.
                for it in batch:
                    it.error = e
                return
            half = len(batch) // 2
            self._commit_group(batch[:half])
            self._commit_group(batch[half:])
            return
        for it, r in zip(batch, results):
            it.result = r

    def push_stream(self, topic: str, envelopes: Iterable, *, max_messages: int = 500) -> Iterator[list]:
        """Push ``envelopes`` in order, in as few transactions as the sizing rule allows,
        and yield each committed transaction's results (a list of ``PushResult``).

        A transaction holds at most ``max_messages`` messages and ``ops.push.TX_WRITE_BYTES``
        of writes, every copy counted (the log's and one per subscription, by the topic's
        config read in that transaction); a message bigger than that goes alone (up to
        ``ROUTE_BYTES`` of copies). ``None`` in ``envelopes`` commits what is pending at
        once (a live source with nothing more to read yet). Items that are not an
        ``Envelope`` are bodies. On an error it raises: what it yielded is committed,
        nothing after it."""
        check_name(topic)
        if not 0 < max_messages <= MAX_PER_TRANSACTION:
            raise ConfigError(f"max_messages must be from 1 to {MAX_PER_TRANSACTION:,}, not {max_messages!r}")

        items = (None if e is None else (topic, e if isinstance(e, Envelope) else Envelope(e))
                 for e in check_messages("push_stream", envelopes))
        return self._push_items(items, max_messages=max_messages)

    def _push_items(self, items: Iterable, *, max_messages: int = 500, also=None) -> Iterator[list]:
        """``push_stream`` over ``(topic, Envelope or ops.push.PushItem)`` items (``None``:
        commit what is pending). ``also(tr, taken)``, if given, runs inside each push
        transaction after its pushes (``taken``: the items it pushed), on every attempt,
        also on a retry that finds the first attempt committed (its marker): it must be
        idempotent (a replay advancing its progress to ``taken[-1]``, fencing its owner)."""
        pending = []
        body_bytes = 0
        for item in items:
            if item is not None:
                pending.append(item)
                body_bytes += len(item[1].body)
                # bodies alone past the budget: surely full, whatever the copies
                if len(pending) < max_messages and fits(0, body_bytes):
                    continue
            while pending:
                results = self._commit_hooked(pending, budget=TX_WRITE_BYTES, also=also)
                del pending[:len(results)]
                body_bytes = sum(len(it[1].body) for it in pending)
                yield results
                if item is not None and len(pending) < max_messages and fits(0, body_bytes):
                    break   # room again: read on
        while pending:
            results = self._commit_hooked(pending, budget=TX_WRITE_BYTES, also=also)
            del pending[:len(results)]
            yield results

    def _commit_hooked(self, items: list, budget: int | None = None, also=None) -> list:
        """``_commit`` of one caller's messages to one topic (``push_many``, a
        ``push_stream`` transaction: committed in the caller's thread) between the hooks'
        ``push_begin`` and ``push_end`` (``fdq.hooks``; ``push``/``push_async`` call them
        themselves, in the caller's thread: the group commit commits in another one)."""
        call = None
        if hooks.active:
            topic = items[0][0]
            envs = [e for _t, e in items]
            call = hooks.begin_push(topic, envs)
            if call is not None:
                items = [(topic, e) for e in envs]      # (a copy: the caller's list keeps what did not fit)
        if call is None:
            return self._commit(items, budget, also)
        try:
            results = self._commit(items, budget, also)
        except BaseException as e:
            call.end(None, e)
            raise
        call.end(results)
        return results

    def _commit(self, items: list, budget: int | None = None, also=None) -> list:
        """Push ``items`` [(topic, envelope)] in one transaction through the retry loop;
        their results (with ``budget``: of the first ones that fit, ``ops.push.push_batch``;
        ``also``: as ``_push_items``'s).
        A retry after an attempt that may have committed finds its marker first, so no
        message is pushed twice; giving up then asks the marker (``_resolve``)."""
        now_ms = int(time.time() * 1000)
        with self._seq_lock:
            self._seq += 1
            txid = self._session + self._seq.to_bytes(8, "big")
        spread = spread_start()
        held = [None]   # the transaction, alive until its versionstamp is read (FDB
        #                 cancels the futures of a transaction it destroys)

        def body(tr, attempt):
            held[0] = tr
            pushed = push_batch(tr, self.keyspace, items, txid, spread, self.config.auto_create,
                                now_ms, self._time_index, attempt.maybe_committed, budget)
            if also is not None:
                also(tr, items[:len(pushed[0])])
            return pushed

        def on_error(e, attempt):
            if isinstance(e, TopicHeld):    # a play finishing (~ms; lapses by itself): not written
                time.sleep(HOLD_WAIT_S)
                return Again()
            if attempt.gave_up is not None and attempt.maybe_committed:
                # Given up (retry limit, timeout) after an attempt that may have
                # committed: its marker says whether it did. Never report such a push
                # as not committed (the caller, or the group commit's split, would
                # push it again).
                return Done(self._resolve(items[0][0], txid, attempt.in_flight, attempt.gave_up))
            return None
        results, stamp = transact(self.db, body, on_error=on_error)
        stamp = stamp if type(stamp) is bytes else bytes(stamp.wait())
        held[0] = None
        out = []
        stamp_hex = stamp.hex()
        for (topic, uv, n, dup_of), (_t, env) in zip(results, items):
            if dup_of is None and not env.headers:
                # message_id(Versionstamp(stamp, uv)), without the objects
                out.append(_plain_result(f"{stamp_hex}{uv:04x}", topic, n))
                continue
            if isinstance(dup_of, int):
                dup_of = message_id(Versionstamp(stamp, dup_of))
            mid = dup_of or message_id(Versionstamp(stamp, uv))
            trace = trace_id(env.headers)   # digits only, as NSQ's PUB_EXT echoes it
            out.append(PushResult(mid, topic, n, dup_of is not None, trace,
                                  mid if trace is not None else None))
        return out

    def _resolve(self, topic: str, txid: bytes, in_flight: bool, final: Exception):
        """The outcome of a push transaction that gave up after an attempt that may have
        committed: ``(results, stamp)`` from its marker if it committed; ``final`` if it
        surely did not (its unknown attempts are no longer in flight, and the marker is
        absent); else a ``commit_unknown_result`` EngineError (maybe committed)."""
        ts = self.keyspace.topic(topic)
        try:
            found = transact(self.db, lambda tr, _attempt: read_marker(tr, ts, txid))
        except FDQError as e:
            raise EngineError(1021, f"push gave up ({final}) after an attempt that may have committed; "
                                    f"its outcome could not be read ({e})") from final
        if found is not None:
            return found
        if in_flight:
            raise EngineError(1021, f"push gave up ({final}) while a commit may still be in flight: "
                                    "it may have committed") from final
        raise final

    def replay(self, topic: str, start, end=None, *, progress=None) -> int:
        """Re-deliver the "all" log's messages with insertion time in ``[start, end)``
        (epoch milliseconds or ``datetime``, naive = UTC; ``end=None``: no bound)
        (committed before the replay began) to the topic's subscriptions, in order, as
        new messages (new ids; the record keeps the original id in ``replay_of``; a
        delayed message not due yet stays delayed until its due time), once per call:
        two calls at once replay the window twice. Resumable: the same call after a
        crash takes over the killed run (once its heartbeat has stood still for
        ``fdq.supervisor.REPLAY_ORPHAN_S``) and continues where it stopped; nothing is
        pushed twice. ``start``/``end``: epoch ms or datetimes (naive = UTC); ``end``
        before ``start`` is a ConfigError. Returns how many this call replayed."""
        return replay_window(self.db, self.keyspace, topic, to_ms(start), to_ms(end), progress=progress)


__all__ = ["Producer", "Envelope", "PushResult", "push_batch", "route_message", "to_ms", "MAX_DELAY_S",
           "MAX_SHARD_KEY_BYTES"]
