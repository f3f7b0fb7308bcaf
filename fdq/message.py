"""Delivered messages and how their settlements are collected before they commit.

A :class:`Message` settles itself (``ack()``, ``nak()``, ``term()``, ``release()``,
``in_progress()``) by making a :class:`~fdq.Settlement`: in a handler's round it joins the
round's list (``_Round``, committed when the round ends); otherwise it is queued with the
other settles made at once by the consumer's ``_SettleGroup``, which commits them in one
transaction (``Consumer.settle``).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import MappingProxyType

from .engine import after_interrupt
from .errors import ConfigError, FDQError, LeaseLost
from .ops.queue import MAX_REASON_CHARS, Taken
from .settlement import ACK, NAK, RELEASE, TERM, TOUCH, Action, Settlement

_monotonic = time.monotonic  # lease timing: this host's monotonic clock only
# A named tuple made from its fields' tuple, skipping the class's Python-level __new__
# (about half the cost): for the settlements and settle rows made per delivered message.
_new_tuple = tuple.__new__


def _check_delay(delay):
    if delay is not None and (isinstance(delay, bool) or not isinstance(delay, (int, float))
                              or not 0 <= delay < 1e9):
        raise ConfigError(f"nak delay must be a number of seconds >= 0, not {delay!r}")


@dataclass
class Message:
    """A delivered message. In at-least-once mode settle it with ``ack()``, ``nak()``,
    ``term()`` or ``release()``; ``in_progress()`` extends its lease. A handler that
    returns acks it. ``attempts``: this delivery's number, 1 for the first, in every mode."""

    id: str
    topic: str
    subscription: str
    shard_key: str | None
    insertion_time: int            # epoch ms, the producer's clock
    headers: MappingProxyType
    body: bytes
    attempts: int
    shard: int = 0
    tag: str = ""
    msg_id: str | None = None
    replay_of: str | None = None
    _consumer: object = field(default=None, repr=False, compare=False)    # its Consumer
    _taken: object = field(default=None, repr=False, compare=False)
    _settled: Action | None = field(default=None, repr=False, compare=False)
    _deferred: list | None = field(default=None, repr=False, compare=False)    # [Settlement] of a round
    _handed: bool = field(default=False, repr=False, compare=False)    # to a handler (``_Round``)
    _in_tr: bool = field(default=False, repr=False, compare=False)     # exactly-once: ``(tr, message)``
    _reason: str | None = field(default=None, repr=False, compare=False)

    def _settle(self, action: Action, delay_s: float | None = None, reason: str | None = None):
        if self._taken is None or self._taken.lease_id is None:
            raise FDQError(f"message {self.id} is not leased: {action.value} needs at-least-once delivery")
        if action is TOUCH:
            self._consumer._settle_group.submit(Settlement(self, action))
            return
        if self._settled is not None:
            raise FDQError(f"message {self.id} is already settled ({self._settled.value})")
        self._settled = action
        settlement = _new_tuple(Settlement, (self, action, delay_s, reason))    # Settlement(...), faster
        if self._deferred is not None:
            self._deferred.append(settlement)   # committed with the batch
            return
        self._consumer._settle_group.submit(settlement)

    def ack(self):
        """Done: remove it for good."""
        self._settle(ACK)

    def nak(self, delay: float | None = None, *, error: BaseException | str | None = None):
        """Redeliver it, after ``delay`` seconds (default: the consumer's backoff).
        ``error``: why this attempt failed (an exception, or text), kept in the dead
        letter's reason if it was the last one (``max_deliver``)."""
        _check_delay(delay)
        if delay is None and self._consumer is not None:
            delay = self._consumer.config.backoff_for(self.attempts)
        self._settle(NAK, delay, _failure(error) if error is not None else None)

    def release(self):
        """Give it back at once without counting an attempt, first in line again: for a
        message fetched but never handed to a handler (one that cannot be processed
        now, say). One a handler had is ``nak()``'d: it was an attempt."""
        if self._handed:
            raise FDQError(f"message {self.id} was handed to a handler: nak() it (release() is for "
                           "messages never handed over)")
        self._settle(RELEASE)

    def term(self, reason: str = "terminated by consumer"):
        """Never redeliver: move it to the subscription's dead-letter queue with ``reason``
        (cut to 1,000 characters). Exactly-once: in the handler's transaction, so the
        message is dead-lettered if and only if the transaction (with the handler's
        writes) commits; the handler then returns as usual (after it returned: an error)."""
        if self._in_tr:
            if self._settled is not None:
                raise FDQError(f"message {self.id} is already settled ({self._settled.value})")
            self._settled, self._reason = TERM, str(reason)
            return
        self._settle(TERM, reason=str(reason))

    def in_progress(self):
        """Still working on it: restart its lease."""
        self._settle(TOUCH)


def _failure(error: BaseException | str) -> str:
    """How an attempt failed, for a dead letter's reason: ``failed: <type>: <message>``
    of an exception (or ``failed: <text>``), on one line, at most ``MAX_REASON_CHARS``."""
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    return ("failed: " + " ".join(text.split()))[:MAX_REASON_CHARS]


class _Round(list):
    """A round's settlements (``Message._deferred``: ``tail``'s, ``fdq.aio``'s), committed
    when it ends (``tail``: with the next round's lease). A round that runs longer than
    half the ack wait is kept leased by the membership thread (``keep``): from then on
    its settlements commit at each lease check, and the messages not yet handed to a
    handler are touched every half ack wait. Else the messages handled (their acks not
    committed) and those waiting expired and were redelivered while the consumer had
    them in hand (an aio round longer than the ack wait never completed: every message
    dead-lettered). A handler gets at least about half the ack wait for its message;
    longer work calls ``in_progress()``."""

    def __init__(self, consumer, msgs):
        super().__init__()
        self._consumer, self._msgs = consumer, msgs
        # the ack wait its leases were taken with (a subscription update may change the
        # consumer's meanwhile: waiting for half a longer one, they expired in hand)
        self._half = consumer.config.ack_wait_s / 2
        self._leased = self._touched = _monotonic()
        self._committing = threading.Lock()     # a keep's commit vs ``finish``
        self._finished = False

    def keep(self, now: float):
        """The membership thread's part (see the class)."""
        half = self._half
        if now - self._leased < half:
            return
        with self._committing:
            if self._finished:
                return
            n = len(self)       # the handlers' thread appends meanwhile: take the first n
            settled = self[:n]
            del self[:n]
            touch = now - self._touched >= half and self._progressing(now)
            waiting = [m for m in self._msgs if not m._handed and m._settled is None] if touch else []
            if not settled and not waiting:
                return
            try:
                self._consumer.settle(settled + [Settlement(m, TOUCH) for m in waiting])
            except LeaseLost as e:
                self._consumer._report(e)
            except Exception as e:      # not committed: at the round's end
                self[:0] = settled
                self._consumer._report(e)
                return
            if touch:
                self._touched = now

    def _progressing(self, now: float) -> bool:
        """Whether every message in a handler's hands is within its lease (handed over,
        or touched by ``in_progress()``, less than its ack wait ago, as this consumer
        saw it). A handler stuck past it lets its message expire: the messages waiting
        behind it expire too, not kept leased by a round that does not move."""
        c = self._consumer
        with c._leases_lock:
            for m in self._msgs:
                if m._handed and m._settled is None:
                    seen = c._leases.get(((m.tag, m.shard), m._taken.vs.to_bytes()))
                    if seen is None or now - seen[2] >= seen[3]:
                        return False
        return True

    def finish(self) -> list:
        """The round's settlements not committed yet; ``keep`` does nothing after."""
        with self._committing:
            self._finished = True
            return list(self)


_LEAD = object()     # a waiting settle's turn to commit the queue (``_SettleGroup``)


class _Waiter:
    """A settlement queued in a ``_SettleGroup``: ``done`` is released with its
    ``outcome`` (None: committed; an error; or ``_LEAD``: its turn to commit the queue)."""

    __slots__ = ("settlement", "done", "outcome")

    def __init__(self, settlement: Settlement):
        self.settlement = settlement
        self.done = threading.Lock()
        self.done.acquire()
        self.outcome = None


class _SettleGroup:
    """Settles of one consumer's messages made one by one (``ack()`` and the others
    outside a handler's round: pull style, often from several threads) commit together
    when they come at once: the first caller commits every settle queued meanwhile in one
    transaction, the others wait for it, then the next waiting caller commits what queued
    during that commit. Each call still returns after its own settle committed, and fails
    alone when its lease was lost. One at a time, siblings of a leased batch each rewrote
    the batch's lease record and conflicted with each other."""

    def __init__(self, commit):
        self._commit = commit       # commit([Settlement]): Consumer.settle
        self._lock = threading.Lock()
        self._queue = []            # [_Waiter]
        self._leading = False

    def submit(self, settlement: Settlement):
        waiter = _Waiter(settlement)
        with self._lock:
            self._queue.append(waiter)
            lead = not self._leading
            self._leading = True
        if not lead:
            try:
                waiter.done.acquire()   # released with its outcome, or with _LEAD: commit
            except BaseException:       # interrupted (a signal handler raised): unqueue
                with self._lock:        # it, or pass on the turn it was given
                    lead = waiter.outcome is _LEAD
                    if not lead and waiter in self._queue:
                        self._queue.remove(waiter)
                        if settlement.action is not TOUCH:
                            settlement.message._settled = None     # not committed: may settle again
                if lead:
                    self._lead()
                raise
            if waiter.outcome is not _LEAD:
                if waiter.outcome is not None:
                    raise waiter.outcome
                return
        self._lead()
        if waiter.outcome is not None:
            raise waiter.outcome

    def _lead(self):
        with self._lock:
            batch, seen = [], set()
            for waiter in self._queue:  # one settle per message id per transaction (a
                mid = waiter.settlement.message.id     # lost lease is reported by id)
                if mid in seen:
                    break
                seen.add(mid)
                batch.append(waiter)
            del self._queue[:len(batch)]
        outcomes = None
        try:
            outcomes = self._outcomes(batch)
        except BaseException as e:     # KeyboardInterrupt, SystemExit: this thread's
            after_interrupt()
            outcomes = [e] + [FDQError(f"settle of {w.settlement.message.id} not committed: the thread "
                                       f"committing it was interrupted ({type(e).__name__})") for w in batch[1:]]
        finally:
            if outcomes is None:
                outcomes = [FDQError("settle not committed: interrupted")] * len(batch)
            with self._lock:
                nxt = self._queue[0] if self._queue else None
                self._leading = nxt is not None
                if nxt is not None:
                    nxt.outcome = _LEAD
            for waiter, outcome in zip(batch, outcomes):
                waiter.outcome = outcome
                waiter.done.release()
            if nxt is not None:
                nxt.done.release()

    def _outcomes(self, batch) -> list:
        """Commit ``batch`` [_Waiter]; -> each one's error or None."""
        try:
            self._commit([w.settlement for w in batch])
            return [None] * len(batch)
        except LeaseLost as e:      # the others committed
            lost = set(e.ids)
            return [LeaseLost(f"lease lost (expired and redelivered, or settled elsewhere): {mid}", [mid])
                    if mid in lost else None for mid in (w.settlement.message.id for w in batch)]
        except Exception as e:
            if len(batch) == 1:
                return [e]
        # Not committed: each alone, so that an error is its own settle's only.
        return [self._outcomes([waiter])[0] for waiter in batch]


_NO_HEADERS = MappingProxyType({})     # read-only and empty: shared by every message without headers


def _to_message(taken: Taken, topic: str, sub: str, consumer) -> Message:
    """``attempts`` is this delivery's number in every mode, 1 for the first: a lease
    counted it in the record (``lease_batch``); a take (at most once, exactly once)
    leaves the record as queued, which counts failed attempts only."""
    rec = taken.record
    headers = rec.headers
    attempts = rec.attempts if taken.lease_id is not None else rec.attempts + 1
    return Message(taken.vs.to_bytes().hex(), topic, sub, rec.shard_key, rec.ts_ms,     # message_id()
                   MappingProxyType(headers) if headers else _NO_HEADERS, taken.body, attempts,
                   taken.shard.n, taken.shard.tag, rec.msg_id, rec.replay_of, consumer, taken)


__all__ = ["Message"]
