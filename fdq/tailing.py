"""``tail``: a consumer that runs a handler on its shards' messages in the background.

One worker thread visits the shards that may have work, in one of three modes:

* at-most-once (``acking=False``): a batch is removed in one transaction, then handled;
* at-least-once (default): each message is leased for ``ack_wait_s``; handler return →
  ack, exception → nak with backoff; ``ack()``, ``nak(delay)``, ``term(reason)``,
  ``in_progress()``; redelivered after its lease expires; dead-lettered after
  ``max_deliver`` attempts. A batch's settlements commit in one transaction: (without a
  thread pool) the next round's lease transaction, so a round costs one commit (see
  ``TailConsumer._process_at_least_once`` for when an ack is durable);
* exactly-once (``transactional=True``): the handler gets ``(tr, message)`` and runs
  inside the dequeue transaction; its writes through ``tr`` commit with the dequeue or
  not at all. Effects outside the transaction (HTTP calls, files) may repeat on retry.

(The module is not named ``tail``: ``fdq.tail`` is the function, and a submodule of that
name would be shadowed by it for ``fdq.tail.X`` lookups such as ``mock.patch``'s.)
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor

from . import hooks
from .config import DEFAULT_SUBSCRIPTION, ConsumerConfig
from .consumer import AT_LEAST_ONCE, AT_MOST_ONCE, EXACTLY_ONCE, Consumer, LeaseRound
from .engine import Again, Done, after_interrupt, error_types, transact
from .errors import ConfigError, EngineError, LeaseLost
from .message import _to_message
from .ops import queue
from .settlement import TERM

_monotonic = time.monotonic

# How long a tail worker with nothing to do keeps its last batch's settlements for the
# next round's lease transaction before committing them on their own.
ACK_LINGER_S = 0.005

# How long a closing tail waits for its worker's round (at least the ack wait): a handler
# still running after it keeps its message, which the close hands back as an attempt.
WORKER_JOIN_S = 30.0
# How often a closing tail looks whether a later close cut its wait short.
CLOSE_POLL_S = 0.05


class _OnceAttempt:
    """The attempt of ``TailConsumer._process_exactly_once``'s transaction under way: its
    ``round`` (``LeaseRound``: what it took from each shard, the watches of those it
    drained), what it took in handling order (``taken``), the message whose handler runs
    (None between them; ``message``: as the handler got it)."""

    __slots__ = ("round", "taken", "current", "message", "in_batch")

    def __init__(self):
        self.round, self.taken, self.current, self.message = None, [], None, None
        self.in_batch = False   # a batch handler runs (``handler(tr, messages)``)


class _HeadFailure:
    """``_process_exactly_once`` gave up on its transaction: ``taken`` (None: no message
    to blame) fails in place with ``reason`` (dead-lettered at once if ``dead``)."""

    __slots__ = ("taken", "reason", "dead")

    def __init__(self, taken, reason: str = "", dead: bool = False):
        self.taken, self.reason, self.dead = taken, reason, dead


class TailConsumer(Consumer):
    """A consumer that runs ``handler`` on its shards' messages in the background."""

    def __init__(self, db, topic, handler, *, mode: str, batch: bool = False, **kwargs):
        if not callable(handler):
            raise ConfigError("handler must be callable")
        if not isinstance(batch, bool):
            raise ConfigError(f"batch must be True or False, not {batch!r:.80}")
        self.handler = handler
        self.mode = mode
        self.batch = batch      # the handler takes a round's messages as one list
        explicit_acking = kwargs.pop("_explicit_acking", False)
        self._carried = []      # the last batch's settlements, committed by the next round
        self._in_round = threading.local()  # .active: this thread runs a round (and handlers)
        self._close_in_worker = False       # shutdown() came from a handler: the worker closes
        self._close_by = float("inf")       # when the closes under way stop waiting for the worker
        self._close_by_lock = threading.Lock()
        super().__init__(db, topic, **kwargs)
        if self.sub_config.ack_policy == "none" and self.mode == AT_LEAST_ONCE:
            if explicit_acking:
                Consumer.close(self)
                raise ConfigError(f"acking=True needs ack_policy='explicit' (subscription "
                                  f"{self.subscription!r} has ack_policy='none')")
            self.mode = AT_MOST_ONCE
        self._pool = (ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix=f"fdq-{self.id}")
                      if self.config.max_concurrency > 1 else None)
        self._worker = threading.Thread(target=self._work_loop, name=f"fdq-tail-{self.id}", daemon=True)
        self._worker.start()

    @property
    def is_acking(self) -> bool:
        return self.mode == AT_LEAST_ONCE

    def _work_loop(self):
        try:
            while not self._stop.is_set():
                shards = self._next_shards()
                if self._pool is not None and len(shards) > 1:
                    try:
                        done = sum(self._pool.map(self._visit, _by_shard_number(shards)))
                    except (CancelledError, RuntimeError):
                        if not self._stop.is_set():
                            raise
                        break       # a close that stopped waiting shut the pool: visits not begun
                else:
                    done = self._visit(shards) if shards else 0    # one transaction for them all
                if not done and self._carried:
                    # Nothing to do now: wait a moment for a watch, whose round commits
                    # the acks with its lease, else commit them on their own.
                    self._idle(min(self._idle_for(), ACK_LINGER_S))
                    if not self._has_dirty():
                        self._flush_carried()
                elif not done:
                    self._idle(self._idle_for())
        finally:
            self._flush_carried()
            if self._close_in_worker:
                self._finish_close()

    def _has_dirty(self) -> bool:
        with self._owned_lock:
            return bool(self._dirty)

    def _flush_carried(self):
        """Commit the settlements of the last batch that no lease round took along."""
        if not self._carried:
            return
        items, self._carried = self._carried, []
        try:
            self.settle(items)
        except Exception as e:  # LeaseLost, or not settled: redelivered after the ack wait
            self._report(e)

    def _visit(self, shards) -> int:
        """Process shards [(shard_id, epoch)] in one transaction. A shard that filled its
        batch (or failed) is visited again next round; one it drained waits for its watch
        or the next sweep."""
        self._in_round.active = True
        try:
            return self._process(shards)
        except Exception as e:
            self._report(e)
            self._mark(*(shard_id for shard_id, _e in shards))
            self._stop.wait(0.05)
            return 0
        finally:
            self._in_round.active = False

    def _process(self, shards) -> int:
        if self._stop.is_set():
            return 0
        try:
            if self.mode == EXACTLY_ONCE:
                return self._process_exactly_once(shards)
            if self.mode == AT_MOST_ONCE:
                return self._process_at_most_once(shards)
            return self._process_at_least_once(shards)
        except LeaseLost:
            self._refresh_owned()
            return 0

    def _process_at_most_once(self, shards) -> int:
        # After commit_unknown_result: if the take's attempt marker is there, our commit
        # took the batch: hand it over (else it would be lost unhandled), shards moved or not.
        msgs = self._lease_many(shards, self.batch_size, take=True)
        if self.batch and msgs:
            try:
                self._call_batch(list(msgs))
            except Exception as e:  # at most once: the messages are gone either way
                self._report(e, msgs[0])
        for m in (msgs if not self.batch else ()):
            call = hooks.begin_handle(m) if hooks.active else None
            error = None
            try:
                self.handler(m)
            except Exception as e:  # at most once: the message is gone either way
                error = e
                self._report(e, m)
            except BaseException as e:
                error = e
                raise
            finally:
                if call is not None:
                    call.end(error)
        return len(msgs)

    def _process_at_least_once(self, shards) -> int:
        """Lease a batch, run the handler on each message, collect the settlements.
        Without a thread pool they are carried into the next round's lease transaction
        (``_lease_many``): one commit per round, and an ack is durable before the handler
        is given the next batch, as when it had a commit of its own. A round that leases
        nothing still commits them; a worker with nothing to do commits them after
        ``ACK_LINGER_S`` unless a watch starts a round first, and before it stops
        (``_flush_carried``). So an ack is durable before the next batch is handed over
        or within ~5 ms, whichever comes first; a crash before that redelivers the
        message (at least once). Explicit ``ack()`` etc. after the handler returned
        commit at once. A round that runs past half its ack wait is kept leased
        (``_Round``); ``shutdown()`` gives back what no handler got yet."""
        carried, self._carried = self._carried, []
        try:
            msgs = self._lease_round(shards, carried)
        except BaseException:
            after_interrupt()
            self._carried = carried + self._carried    # not committed: settle them later
            raise
        if msgs is None:    # closed meanwhile: nothing leased
            self._carried = carried + self._carried
            return 0
        pending = self._begin_round(msgs)
        try:
            if self.batch:
                self._handle_batch(msgs, pending)
            for i, m in enumerate(msgs if not self.batch else ()):
                if self._stop.is_set():     # shutting down: the rest go back uncounted
                    for rest in msgs[i:]:
                        rest._deferred = pending
                        rest.release()
                        rest._deferred = None
                    break
                self._mark_handed(m)
                m._deferred = pending
                call = hooks.begin_handle(m) if hooks.active else None
                error = None
                try:
                    self.handler(m)
                    if m._settled is None:
                        m.ack()
                except Exception as e:
                    error = e
                    if m._settled is None:
                        m.nak(error=e)
                    self._report(e, m)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    if call is not None:
                        call.end(error)
                m._deferred = None
        finally:
            pending = self._end_round(pending)
        if self._pool is None and not self._stop.is_set():
            self._carried = pending
            return len(msgs)
        try:
            self.settle(pending)
        except LeaseLost as e:
            self._report(e)
        return len(msgs)

    def _lease_round(self, shards, carried) -> list | None:
        """``_lease_many`` for a round, known to ``close()`` as a fetch is
        (``Consumer._tracked``): a close that stops waiting for this thread (a second
        signal's ``close(0)``) still waits for a lease under way, so it returns those
        leases too, and none begins once the consumer closes (None)."""
        return self._tracked(None, self._lease_many, shards, self.batch_size, settlements=carried)

    def _call_batch(self, msgs: list, tr=None):
        """The batch handler on ``msgs`` (exactly once: with ``tr``), inside the hooks'
        ``handle_batch_begin``/``_end`` (tracing: one span linked to each message's)."""
        call = hooks.begin_handle_batch(msgs) if hooks.active else None
        error = None
        try:
            if tr is None:
                self.handler(msgs)
            else:
                self.handler(tr, msgs)
        except BaseException as e:
            error = e
            raise
        finally:
            if call is not None:
                call.end(error)

    def _handle_batch(self, msgs, pending):
        """At least once, ``batch=True``: the handler gets the round's messages as one
        list; return → the unsettled ones acked, raise → nak'd with the error (each an
        attempt). A shutdown before it began gives them back uncounted."""
        if not msgs:
            return
        if self._stop.is_set():
            for m in msgs:
                m._deferred = pending
                m.release()
                m._deferred = None
            return
        for m in msgs:
            self._mark_handed(m)
            m._deferred = pending
        try:
            self._call_batch(list(msgs))
            for m in msgs:
                if m._settled is None:
                    m.ack()
        except Exception as e:
            for m in msgs:
                if m._settled is None:
                    m.nak(error=e)
            self._report(e, msgs[0])
        finally:
            for m in msgs:
                m._deferred = None

    def _process_exactly_once(self, shards) -> int:
        """Take a batch from ``shards`` [(shard_id, epoch)] in ONE transaction (up to
        ``batch_size`` in all, shard after shard: ``Consumer._round_parts``, as a lease
        round) and run the handler on each message inside it; returns how many messages
        it settled (0: none there). A shard drained is watched in the same transaction.

        Too slow or too big to commit (1007, 2101): the batch is halved and run again;
        one message alone that cannot commit fails in place (``_fail_head``: an attempt
        counted; too large never fits: dead-lettered). A handler that raises fails its
        message, after the messages before it commit without it (run again: their
        transaction was discarded); its attempt is counted then, without running it
        again (it ran i + 1 times per attempt, and those before it as often, when it was
        retried until it came first)."""
        limit = self.batch_size
        failed = None       # (taken, reason): a message whose handler raised behind the ones retried
        run = _OnceAttempt()
        max_deliver = self.config.max_deliver

        def one(tr, shard, epoch, left, reads):
            return queue.take_batch(tr, self._ts, shard, self.id, epoch, left, finish=True,
                                    max_deliver=max_deliver, sel=self._sel, reads=reads)

        def body(tr, _attempt) -> int:
            run.taken, run.current, run.in_batch, run.round = [], None, False, LeaseRound()
            self._round_parts(tr, run.round, shards, limit, one)
            taken = run.taken = [t for part in run.round.parts if part.taken for t in part.taken]
            if self.batch and taken:
                self._run_batch_in(tr, run)
            for t in (taken if not self.batch else ()):
                run.current = t
                m = run.message = _to_message(t, self.topic, self.subscription, self)
                m._in_tr = True
                call = hooks.begin_handle(m) if hooks.active else None
                error = None
                try:
                    self.handler(tr, m)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    m._in_tr = False    # term() only in its handler (then: not leased)
                    if call is not None:
                        call.end(error)
                if m._settled is TERM:
                    queue.dead_letter_taken(tr, self._ts, t, f"terminated: {m._reason}", self.id)
            run.current = None
            # A push meanwhile neither aborts this transaction (it adds to ``routed``
            # without a write conflict range) nor runs the handlers again; it fires the watch.
            self._watch_drained(tr, run.round)
            # (more: dead letters moved, not drained)
            return len(taken) or int(any(part.taken.more for part in run.round.parts))

        def on_error(e, attempt):
            nonlocal limit, failed
            if isinstance(e, LeaseLost):
                return None
            taken, current = run.taken, run.current
            if isinstance(e, error_types()):
                too_slow_or_big = e.code in (1007, 2101)
                if too_slow_or_big and limit > 1 and len(taken) != 1:
                    limit = max(1, min(limit, len(taken) or limit) // 2)   # halve
                    failed = None           # not behind what commits now: it runs again
                    return Again()
                head = current or (taken[0] if len(taken) == 1 else None)
                if too_slow_or_big and head is not None:
                    # One message that cannot commit (raised by the handler's reads or at
                    # commit). Too large never fits: dead-letter it now. Too old may be a
                    # slow moment (a recovery, a loaded host): count it as an attempt.
                    return Done(_HeadFailure(head, f"handler cannot finish within one transaction "
                                                   f"({EngineError(e.code).name})", e.code == 2101))
                return None
            reason = f"handler raised {type(e).__name__}: {e}"
            if run.in_batch:    # the batch handler raised: halve until the message is alone
                if len(taken) > 1:
                    limit, failed = max(1, len(taken) // 2), None
                    return Again()
                self._report(e, run.message)
                return Done(_HeadFailure(taken[0], reason))
            self._report(e, run.message if current is not None else None)
            if current is None:
                return Done(_HeadFailure(None))
            i = next(i for i, t in enumerate(taken) if t is current)
            if i > 0:
                limit, failed = i, (current, reason)
                return Again()
            return Done(_HeadFailure(current, reason))

        n = transact(self.db, body, on_error=on_error)
        if isinstance(n, _HeadFailure):
            if n.taken is not None:
                self._fail_head(dict(shards), n.taken, n.reason, dead=n.dead)
            self._mark(*(shard_id for shard_id, _e in shards))
            return 1
        self._round_committed(run.round)
        if failed is not None:      # its attempt, not run again (once per attempt)
            taken, reason = failed
            self._fail_head(dict(shards), taken, reason)
            self._mark((taken.shard.tag, taken.shard.n))
            n += 1
        return n

    def _run_batch_in(self, tr, run):
        """Exactly once, ``batch=True``: ``handler(tr, messages)`` on what ``run`` took;
        a message ``term()``'d in it is dead-lettered in the transaction. The handler
        raising fails the attempt (``_process_exactly_once``'s ``on_error``: the batch is
        halved and run again until the message it fails on is alone, which fails in place)."""
        msgs = [_to_message(t, self.topic, self.subscription, self) for t in run.taken]
        run.message = msgs[0]
        for m in msgs:
            m._in_tr = True
        run.in_batch = True
        try:
            self._call_batch(msgs, tr)
        finally:
            for m in msgs:
                m._in_tr = False
        run.in_batch = False
        for t, m in zip(run.taken, msgs):
            if m._settled is TERM:
                queue.dead_letter_taken(tr, self._ts, t, f"terminated: {m._reason}", self.id)

    def _fail_head(self, epochs: dict, taken, reason, dead=False):
        """Count an attempt on ``taken`` where it lies, in its shard (fenced by its epoch
        in ``epochs`` {shard_id: epoch}): ``queue.fail_in_place``."""
        max_deliver = 1 if dead else self.config.max_deliver
        shard = taken.shard
        queue.fail_in_place(self.db, self._ts, shard, self.id, epochs[(shard.tag, shard.n)], taken.vs, max_deliver,
                            reason, taken.record.attempts, taken.delayed_key)

    def close(self, timeout: float | None = None):
        """Stop consuming and leave: the handlers running finish their messages (settled
        as usual), the rest of their batches go back uncounted. Waits up to ``timeout``
        seconds for them (default: ``WORKER_JOIN_S`` or the ack wait, the longer); a
        handler still running then keeps its message, which the close hands back as an
        attempt (nak). Called by a handler (``shutdown()`` from inside a round: the
        worker or a pool thread, which cannot wait for itself), it returns at once; the
        worker finishes the round and then closes the consumer.

        Closes in several threads (a drain, then a second signal's ``close(0)``) are one
        close: its wait for the handlers ends at the earliest of their deadlines, and
        each returns once the consumer has left (its leases back), whichever thread
        did the leaving."""
        if getattr(self._in_round, "active", False):
            if not self._closed:
                self._stop.set()
                self._wake.set()
                self._close_in_worker = True
            return
        self._stop.set()
        self._wake.set()
        if self._closed:            # left, or leaving in another thread: wait for that
            super().close()
            return
        self._finish_close(timeout)

    def _finish_close(self, timeout: float | None = None):
        if threading.current_thread() is not self._worker:
            self._await_worker(max(WORKER_JOIN_S, self.config.ack_wait_s) if timeout is None else timeout)
        if self._pool is not None:
            # a handler still running past the wait is not waited for (its worker thread
            # is then still in the pool's map): the pool's idle threads end, its own later
            done = threading.current_thread() is self._worker or not self._worker.is_alive()
            self._pool.shutdown(wait=done, cancel_futures=True)
        super().close()

    def _await_worker(self, timeout: float):
        """Wait for the worker thread to end, until the earliest deadline of the closes
        under way (a later ``close(0)`` cuts an earlier one's wait short)."""
        with self._close_by_lock:
            self._close_by = min(self._close_by, _monotonic() + max(0.0, timeout))
        while self._worker.is_alive():
            left = self._close_by - _monotonic()
            if left <= 0:
                return
            self._worker.join(min(left, CLOSE_POLL_S))

    @property
    def running(self) -> bool:
        """Whether its worker (and so a handler) still runs: after ``close(timeout)``
        ran out, a handler that did not return."""
        return self._worker.is_alive()


def _by_shard_number(shards) -> list:
    """[(shard_id, epoch)] grouped by shard number, across dispatch tags: a shard key
    maps to the same number in every tag's shards (``shard_of``), so handlers running one
    group at a time per thread never run two messages of one key at once, tagged or not."""
    groups = {}
    for s in shards:
        groups.setdefault(s[0][1], []).append(s)
    return list(groups.values())


def check_delivery_args(acking, transactional):
    """``tail``'s mode arguments: ``acking`` None or a bool, ``transactional`` a bool
    (``acking=0`` was at-least-once: only ``False`` selects at-most-once), not both."""
    if acking is not None and not isinstance(acking, bool):
        raise ConfigError(f"acking must be True, False or None, not {acking!r:.80}")
    if not isinstance(transactional, bool):
        raise ConfigError(f"transactional must be True or False, not {transactional!r:.80}")
    if transactional and acking is not None:
        raise ConfigError("transactional=True is exactly-once delivery: it cannot be combined with acking=")


def tail(db, topic: str, handler, acking: bool | None = None, transactional: bool = False,
         batch_size: int = 100, consumer_id: str | None = None,
         subscription: str = DEFAULT_SUBSCRIPTION, config: ConsumerConfig | None = None, *,
         keyspace=None, create: bool = True, extend_support: bool | None = None, desired_tag: str | None = None,
         on_error=None, subscription_config=None, ephemeral: bool = False, batch: bool = False) -> TailConsumer:
    """Consume ``topic`` in the background until ``shutdown()``.

    ``transactional=True``: exactly-once, ``handler(tr, message)``. Otherwise
    ``acking=False`` is at-most-once and ``acking=None``/``True`` at-least-once,
    ``handler(message)``. Combining ``transactional=True`` with ``acking`` is an error.
    The other arguments are :class:`fdq.Consumer`'s: ``extend_support`` follows the
    topic unless given (an extend topic's messages carry headers, ``desired_tag`` picks
    the dispatch tag this consumer takes), ``on_error(exception)`` hears what goes wrong
    in the background (default: logged). ``batch=True``: the handler takes a round's
    messages as one list (``handler(messages)``; exactly-once ``handler(tr, messages)``):
    at least once, its return acks those it left unsettled and its exception naks them;
    exactly once, an exception halves the batch until the message it fails on is alone.
    """
    check_delivery_args(acking, transactional)
    mode = EXACTLY_ONCE if transactional else (AT_MOST_ONCE if acking is False else AT_LEAST_ONCE)
    return TailConsumer(db, topic, handler, mode=mode, batch_size=batch_size, consumer_id=consumer_id,
                        subscription=subscription, config=config, keyspace=keyspace, create=create,
                        extend_support=extend_support, desired_tag=desired_tag, on_error=on_error,
                        subscription_config=subscription_config, ephemeral=ephemeral,
                        batch=batch, _explicit_acking=acking is True)


__all__ = ["TailConsumer", "tail", "check_delivery_args"]
