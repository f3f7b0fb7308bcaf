"""Consumers: own an even share of a subscription's shards and deliver their messages.

``Consumer`` is pull style (``fetch`` returns leased messages); ``tail`` runs a handler in
the background in one of three modes:

* at-most-once (``acking=False``): a batch is removed in one transaction, then handled;
* at-least-once (default): each message is leased for ``ack_wait_s``; handler return →
  ack, exception → nak with backoff; ``ack()``, ``nak(delay)``, ``term(reason)``,
  ``in_progress()``; redelivered after its lease expires; dead-lettered after
  ``max_deliver`` attempts. A batch's settlements commit in one transaction: in
  ``tail`` (without a thread pool) the next round's lease transaction, so a round costs
  one commit (see ``TailConsumer._process_at_least_once`` for when an ack is durable);
* exactly-once (``transactional=True``): the handler gets ``(tr, message)`` and runs
  inside the dequeue transaction; its writes through ``tr`` commit with the dequeue or
  not at all. Effects outside the transaction (HTTP calls, files) may repeat on retry.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType

from .ops import clock, membership, queue
from .ops.queue import SettleRow
from . import subscription as _subs
from .config import DEFAULT_SUBSCRIPTION, ConsumerConfig, SubscriptionConfig, TopicConfig, check_name
from .engine import Again, Done, after_interrupt, error_types, run_within, transact
from .errors import (ConfigError, ConsumerStalled, EngineError, FDQError, LeaseLost, SubscriptionNotFound,
                     TopicNotFound, is_maybe_committed)
from .headers import check_tag
from .keyspace import Keyspace, message_id, vs_from_bytes
from .settlement import ACK, NAK, RELEASE, TERM, TOUCH, Action, Settlement
from .topic import create_topic, read_topic_config

log = logging.getLogger("fdq.consumer")
_monotonic = time.monotonic  # liveness and lease expiry: this host's monotonic clock only

AT_MOST_ONCE, AT_LEAST_ONCE, EXACTLY_ONCE = "at_most_once", "at_least_once", "exactly_once"
# How long a tail worker with nothing to do keeps its last batch's settlements for the
# next round's lease transaction before committing them on their own.
ACK_LINGER_S = 0.005
# A closing consumer's goodbye (return its leases, leave) is given up after this long: a
# stalled database must not hang shutdown, and what it would have done happens anyway
# (leases expire, peers time the consumer out as a zombie).
_GOODBYE_MS = 10_000
# A lease check reads this many shards' lease records per transaction: one transaction
# per shard cost 16 every check interval; all of a consumer's shards in one could
# outlast FDB's 5 s with large backlogs in flight.
LEASE_SCAN_SHARDS = 4
# At most this many shards are visited by one lease transaction (the rest wait for the
# next round): a round's reads are sequential, and on a cluster (~1 ms a read) a round over
# thousands of shards (a topic with many dispatch tags) would outlive the 5-second rule
# and be retried for ever.
LEASE_ROUND_SHARDS = 256
# Heartbeats a subscription may stay catching up (its delivery stopped) before its live
# consumers finish the catch-up themselves (``Consumer._help_catch_up``).
CATCH_UP_HELP_AFTER = 3


# A named tuple made from its fields' tuple, skipping the class's Python-level __new__
# (about half the cost): for the settlements and settle rows made per delivered message.
_new_tuple = tuple.__new__


def _ms_until(deadline: float) -> int:
    return max(1, int((deadline - _monotonic()) * 1000))   # never 0: a timeout of 0 is none


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
    _consumer: "Consumer" = field(default=None, repr=False, compare=False)
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

    def nak(self, delay: float | None = None):
        """Redeliver it, after ``delay`` seconds (default: the consumer's backoff)."""
        _check_delay(delay)
        if delay is None and self._consumer is not None:
            delay = self._consumer.config.backoff_for(self.attempts)
        self._settle(NAK, delay)

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


def _to_message(taken: queue.Taken, topic: str, sub: str, consumer) -> Message:
    """``attempts`` is this delivery's number in every mode, 1 for the first: a lease
    counted it in the record (``lease_batch``); a take (at most once, exactly once)
    leaves the record as queued, which counts failed attempts only."""
    rec = taken.record
    headers = rec.headers
    attempts = rec.attempts if taken.lease_id is not None else rec.attempts + 1
    return Message(taken.vs.to_bytes().hex(), topic, sub, rec.shard_key, rec.ts_ms,     # message_id()
                   MappingProxyType(headers) if headers else _NO_HEADERS, taken.body, attempts,
                   taken.shard.n, taken.shard.tag, rec.msg_id, rec.replay_of, consumer, taken)


def _settle_rows(items: list) -> list:
    """``queue.settle``'s rows [SettleRow] for settlements [Settlement]."""
    rows = []
    append = rows.append
    for m, action, delay_s, reason in items:
        t = m._taken
        append(_new_tuple(SettleRow, (t.shard, t.vs, t.lease_id, t.lease_key, action,    # SettleRow(...)
                                      reason if action is TERM else delay_s)))
    return rows


def _row_id(row) -> tuple:
    """A settle row's message across attempts (a row object is made once per call)."""
    return row.shard.sub, row.shard.tag, row.shard.n, row.vs


def _note_maybe_lost(maybe_lost: list, e, lost):
    """An attempt that settled (finding ``lost`` lost; None: it did not get that far) and
    then failed with an error that may have committed: remember which leases it found
    lost (see ``Consumer._settled``)."""
    if is_maybe_committed(e) and lost is not None:
        maybe_lost.append({_row_id(r) for r in lost})


def _raw(value):
    """A read's value as bytes, or None if absent."""
    return bytes(value) if value.present() else None


class ShardTake:
    """One shard's part of a lease round (``Consumer._lease_many``).

    ``taken``: what the round took from it ([Taken]; None: the round's limit left it
    out, visited next round). ``drained``: fewer than asked, no selection in the way: not
    visited again until its watch fires. A drained shard's ``watch_key`` (its ``routed``
    counter; None if it has a watch already, or is out of watches) gets a ``watch``: set
    in the lease transaction if that took nothing, else after its commit by ``_arm``,
    which compares the counter with ``seen``, the value the lease transaction read."""

    __slots__ = ("shard_id", "taken", "drained", "watch_key", "seen", "watch")

    def __init__(self, shard_id):
        self.shard_id = shard_id
        self.taken = None
        self.drained = False
        self.watch_key = None
        self.seen = None
        self.watch = None

    @property
    def armed(self) -> bool:
        """No watch left to set (``_arm``)."""
        return self.watch_key is None or self.watch is not None


class LeaseRound:
    """What one attempt of ``Consumer._lease_many``'s transaction did: its ``parts``
    [ShardTake] in visiting order (a shard no longer ours left out: ``lost``), whether it
    ``took`` anything, its take ``mark`` (at most once: ``queue.mark_take``) and the
    carried settlements whose lease it found lost (``settle_lost``)."""

    __slots__ = ("parts", "lost", "took", "mark", "settle_lost")

    def __init__(self):
        self.parts = []
        self.lost = False
        self.took = False
        self.mark = None
        self.settle_lost = None


def _peer_timeout(config: ConsumerConfig, record: dict) -> float:
    """How long a peer's heartbeat may stay unchanged before it is a zombie: its own
    timeout (it heartbeats at its own interval) or ours, whichever is longer."""
    theirs = record.get("zombie_after_s")
    return max(config.zombie_after_s, theirs) if isinstance(theirs, (int, float)) else config.zombie_after_s


class Consumer:
    """A member of a subscription that owns an even share of its shards.

    Pull style::

        c = fdq.Consumer(db, "orders")
        for m in c.fetch(100, timeout=1.0):
            handle(m.body); m.ack()
        c.close()
    """

    mode = AT_LEAST_ONCE

    def __init__(self, db, topic: str, *, subscription: str = DEFAULT_SUBSCRIPTION,
                 consumer_id: str | None = None, config: ConsumerConfig | None = None,
                 keyspace: Keyspace | None = None, create: bool = True,
                 extend_support: bool = False, desired_tag: str | None = None,
                 on_error=None, batch_size: int = 100,
                 subscription_config: SubscriptionConfig | None = None, ephemeral: bool = False):
        self.db = db
        self.topic = check_name(topic)
        self.subscription = check_name(subscription, "subscription")
        self.config = config or ConsumerConfig()
        if not isinstance(self.config, ConsumerConfig):
            raise ConfigError(f"config must be a fdq.ConsumerConfig, not {type(self.config).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be an integer >= 1, not {batch_size!r}")
        self.batch_size = batch_size
        self.keyspace = keyspace or Keyspace()
        if consumer_id is not None and (not isinstance(consumer_id, str) or not 0 < len(consumer_id) <= 128
                                        or not consumer_id.isprintable()):
            raise ConfigError(f"consumer_id must be a printable str of 1 to 128 characters, not {consumer_id!r:.80}")
        self.id = consumer_id or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        # this instance, as opposed to another one started under the same id (membership.join)
        self._incarnation = os.urandom(8).hex()
        self._replaced = False
        self._gone = None                # TopicNotFound or SubscriptionNotFound met rejoining
        self.on_error = on_error
        self._ts = self.keyspace.topic(self.topic)
        self._topic_config = self._load_topic(create, extend_support)
        if extend_support and not self._topic_config.extend:
            raise ConfigError(f"topic {self.topic!r} has no extend support: connect without extend_support")
        if self._topic_config.extend and not extend_support:
            raise ConfigError(f"topic {self.topic!r} has extend support: consumers must set extend_support=True")
        self.extend_support = extend_support
        if desired_tag is not None and self._topic_config.extend:
            check_tag(desired_tag)
        self.desired_tag = desired_tag if self._topic_config.extend else None   # plain: ignored
        self._owned = {}             # (tag, n) -> epoch
        self._owned_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._watches = {}           # (tag, n) -> watch future on the shard's "routed" counter
        self._unwatched = set()      # shards whose watch hit the watch limit: polled for now
        self._unarmed = []           # a round's watches still to set (``_lease_many(defer_arm=True)``)
        # ((tag, n), 12-byte vs) -> [lease_id, touches, since, ack_wait_s, record key]; bytes,
        # not the Versionstamp: its hash is Python code, two per message on the hot path
        self._leases = {}
        self._leases_lock = threading.Lock()
        self._settle_group = _SettleGroup(self.settle)
        self._rounds = {}            # id -> _Round in hand (kept leased by the membership thread)
        self._lease_prefix, self._lease_seq = os.urandom(8), 0
        self._peers = {}             # consumer id -> (heartbeat, since)
        self._rr_after = None        # the last shard the last round reached: the next starts after it
        self._dirty = set()          # shards that may have work (new, signalled, swept)
        self._last_sweep = 0.0
        self._last_hb = 0.0
        self._last_lease_check = 0.0
        self._stalled_since = None
        self._hb_ok = _monotonic()       # last heartbeat round that reached the database
        self._last_error = None
        self._noshard_since = None
        self._stall_reported = False
        self._reaper = _subs.Reaper(self.config.zombie_after_s)
        self._catching_up_since = None   # when this consumer first saw its subscription catching up
        self._catch_up_helper = None
        self._closed = False
        self._fetching = []          # idents of the threads inside fetch(), under _fetch_done
        self._fetch_done = threading.Condition()
        self._clock_base = None      # (database clock ms, this host's monotonic s) last seen
        self._thread = None
        joined = self._bind_subscription(create, subscription_config, ephemeral)
        if not joined:
            self._join()
        try:
            if joined:
                self._refresh_owned()
            self._tick_clock(_monotonic())
            self._thread = threading.Thread(target=self._membership_loop, name=f"fdq-member-{self.id}",
                                            daemon=True)
            self._thread.start()
            self._watchdog = threading.Thread(target=self._stall_watch, name=f"fdq-watchdog-{self.id}",
                                              daemon=True)
            self._watchdog.start()
            self._finish_catch_up()
        except BaseException:
            after_interrupt()
            Consumer.close(self)
            raise

    # -- membership --------------------------------------------------------------------

    def _load_topic(self, create: bool, extend: bool) -> TopicConfig:
        """The topic's config; a missing topic is created (``create``), with extend
        support if this consumer has it."""
        try:
            config = read_topic_config(self.db, self._ts)
        except TopicNotFound:
            if not create:
                raise
            config = create_topic(self.db, self.keyspace, self.topic, TopicConfig(extend=bool(extend)))
        return config

    def _bind_subscription(self, create: bool, given: SubscriptionConfig | None, ephemeral: bool) -> bool:
        """Bind to the subscription (creating it if ``create``; a given config must
        equal the stored one) and apply its config: redelivery policy, ack policy, flow
        control, order, filter. Returns True if it joined as well: an ephemeral
        subscription is created and joined in one transaction, so it never exists
        without a member (its creator killed in between left one no reaper deletes:
        reapers look for zombie members)."""
        if given is not None and not isinstance(given, SubscriptionConfig):
            raise ConfigError(f"subscription_config must be a fdq.SubscriptionConfig, not {type(given).__name__}")
        if ephemeral and not (given and given.ephemeral):
            given = dataclasses.replace(given or SubscriptionConfig(), ephemeral=True)
        joined = False
        if self.subscription not in self._topic_config.subs:
            if not create:
                _subs.read_subscription(self.db, self._ts, self.subscription)  # raises
            if _subs.is_ephemeral(self.subscription, given or SubscriptionConfig()):
                _subs.create_and_join(self.db, self._ts, self.subscription, given, self.id, self._record())
                joined = True
            else:
                _subs.create_subscription(self.db, self._ts, self.subscription, given)
        try:
            self._apply_subscription(_subs.read_subscription(self.db, self._ts, self.subscription))
            if given is not None and given != self.sub_config:
                raise _subs._diff_error(self._ts, self.subscription, self.sub_config, given)
            self._topic_config = read_topic_config(self.db, self._ts)
        except BaseException:
            after_interrupt()
            if joined:
                self._leave()
            raise
        return joined

    def _finish_catch_up(self):
        """Copy the subscription's start point into its queues if that is pending (a
        new subscription, a reset). After joining and with heartbeats running: a long
        catch-up must not look like a dead member (an ephemeral subscription's would be
        deleted under it). Not while the topic is paused or resharding (the catch-up
        waits for it to play): the membership loop finishes it then (``_help_catch_up``)."""
        for _attempt in range(3):
            if self.subscription not in self._topic_config.catchup or not self._topic_config.routing:
                return
            try:
                _subs.catch_up(self.db, self._ts, self.subscription)
            except ConfigError:     # paused or resharding since: looked at again
                pass
            self._topic_config = read_topic_config(self.db, self._ts)

    def _apply_subscription(self, config: SubscriptionConfig):
        bound = getattr(self, "sub_config", None)
        if bound is not None and config.ack_policy != bound.ack_policy:
            # Not updatable: the subscription was deleted and created again under its name.
            # This consumer's delivery mode was chosen for the policy it bound to (a leasing
            # consumer taking messages at most once lost them): it neither applies nor joins.
            raise ConfigError(f"consumer {self.id}: subscription {self.subscription!r} of topic "
                              f"{self.topic!r} was deleted and created again with ack_policy="
                              f"{config.ack_policy!r} (this consumer bound to ack_policy="
                              f"{bound.ack_policy!r}): not joining it; start a new consumer")
        self.sub_config = config
        if not hasattr(self, "_own_config"):
            self._own_config = self.config
        self.config = _subs.effective_consumer_config(self._own_config, config)
        self._sel = None
        if config.max_ack_pending is not None or config.ordered or _subs.matcher(config):
            self._sel = queue.Selection(config.max_ack_pending, config.ordered, _subs.matcher(config))

    def _record(self) -> dict:
        return {"id": self.id, "host": socket.gethostname(), "pid": os.getpid(), "mode": self.mode,
                "tag": self.desired_tag, "extend": self.extend_support, "batch_size": self.batch_size,
                "zombie_after_s": self.config.zombie_after_s, "incarnation": self._incarnation}

    def _join(self):
        plan = _subs.join(self.db, self._ts, self.subscription, self.id, self._record(),
                                 self._topic_config)
        self._refresh_owned()
        return plan

    def _rejoin(self):
        """Join again after this consumer's record vanished: declared a zombie, or its
        subscription or topic deleted (and perhaps created again under its name, with
        another config; while it is gone, TopicNotFound or SubscriptionNotFound is
        reported each heartbeat, and its creation again is logged). The config is read
        and applied before joining, so no round runs with
        an old filter, order or flow control on the shards it gets; a subscription
        whose ``ack_policy`` is no longer the one this consumer bound to is refused
        (ConfigError, reported each heartbeat; it joins nothing): its delivery mode was
        chosen for that policy (a leasing consumer taking messages at most once lost
        them)."""
        try:
            config = _subs.read_subscription(self.db, self._ts, self.subscription)
        except (TopicNotFound, SubscriptionNotFound) as e:
            self._gone = e      # reported (on_error) each heartbeat until created again
            raise
        if config != self.sub_config:
            self._apply_subscription(config)    # raises on another ack_policy
        _subs.join(self.db, self._ts, self.subscription, self.id, self._record(), self._topic_config,
                   expect=config)
        gone, self._gone = self._gone, None
        if isinstance(gone, TopicNotFound):
            log.warning("consumer %s: topic %r was created again: joined it", self.id, self.topic)
        elif gone is not None:
            log.warning("consumer %s: subscription %r of topic %r was created again: joined it",
                        self.id, self.subscription, self.topic)
        else:   # no read between saw it gone: a peer's zombie declaration, or a deletion
            log.warning("consumer %s: its membership record was gone (declared a zombie, or its "
                        "subscription or topic deleted and created again): joined again", self.id)
        self._refresh_owned()

    def _leave(self):
        try:
            run_within(self.db, _GOODBYE_MS, _subs.leave, self._ts, self.subscription, self.id,
                       self._topic_config, self._incarnation)
        except FDQError as e:
            self._report(e)

    def _refresh_owned(self):
        mine = membership.read_owned(self.db, self._ts, self.subscription, self.id, self._incarnation)
        if mine is None:        # another instance joined under this id: it owns them now
            mine = {}
            if not self._replaced:
                self._replaced = True
                self._report(ConfigError(f"consumer {self.id} of {self.topic}/{self.subscription}: another "
                                         "consumer joined with this consumer_id; this one stops consuming"))
        with self._owned_lock:
            lost = set(self._owned) - set(mine)
            self._dirty.update(s for s in mine if s not in self._owned or self._owned[s] != mine[s])
            self._owned = mine
        for s in lost:
            w = self._watches.pop(s, None)
            if w is not None:
                w.cancel()
        if mine != {}:
            self._wake.set()

    @property
    def owned_shards(self) -> list:
        with self._owned_lock:
            return sorted(self._owned)

    def _membership_loop(self):
        cfg = self.config
        tick = min(cfg.heartbeat_interval_s, cfg.lease_check_interval_s) / 2
        while not self._stop.wait(tick):
            try:
                now = _monotonic()
                if now - self._last_hb >= cfg.heartbeat_interval_s:
                    self._last_hb = now
                    if self._replaced:
                        continue
                    if not membership.heartbeat(self.db, self._ts, self.subscription, self.id, self._incarnation):
                        if membership.replaced(self.db, self._ts, self.subscription, self.id, self._incarnation):
                            self._refresh_owned()   # owns nothing, reports it once
                            continue
                        self._rejoin()
                    self._observe_peers(now)
                    self._topic_config = read_topic_config(self.db, self._ts, snapshot=True)
                    self._help_catch_up(now)
                    membership.assign_new_tags(self.db, self._ts, self.subscription)  # new tags
                    self._refresh_owned()
                    self._observe_subscriptions(now)
                    self._hb_ok = _monotonic()
                    self._last_error = None     # what the stall alarm names: since the last heartbeat
                if now - self._last_lease_check >= cfg.lease_check_interval_s:
                    self._last_lease_check = now
                    self._tick_clock(now)
                    # Rounds in hand first: a check run late (a loaded host) would expire
                    # the leases a keep is about to touch.
                    for r in list(self._rounds.values()):
                        r.keep(now)
                    self._check_leases(now)
                self._stalled_since = None
            except Exception as e:  # keep heartbeating through transient trouble
                self._report(e)
                self._last_error = e
                if self._stalled_since is None:
                    self._stalled_since = _monotonic()

    def _help_catch_up(self, now: float):
        """A start point left unfinished (a ``reset`` or ``create_subscription`` killed
        midway) stops the subscription's delivery until someone finishes it: after
        ``CATCH_UP_HELP_AFTER`` heartbeats, live consumers do (``catch_up_chunk`` is
        resumable and safe to run from several processes), in a thread of their own so
        heartbeats go on."""
        config = self._topic_config
        if self.subscription not in config.catchup or not config.routing:
            self._catching_up_since = None
            return
        if self._catching_up_since is None:
            self._catching_up_since = now
        if now - self._catching_up_since < CATCH_UP_HELP_AFTER * self.config.heartbeat_interval_s:
            return
        if self._catch_up_helper is None or not self._catch_up_helper.is_alive():
            self._catch_up_helper = threading.Thread(target=self._run_catch_up, daemon=True,
                                                     name=f"fdq-catch-up-{self.id}")
            self._catch_up_helper.start()

    def _run_catch_up(self):
        try:
            while not self._stop.is_set():
                if _subs.catch_up_chunk(self.db, self._ts, self.subscription, _subs.CHUNK) < 0:
                    return
        except Exception as e:      # the next heartbeat tries again
            self._report(e)

    def _observe_subscriptions(self, now: float):
        """Pick up updates of the subscription's config; reap zombies of the topic's
        ephemeral subscriptions (another's last member may have been killed)."""
        if self.subscription not in self._topic_config.subs:
            return
        config = _subs.read_subscription(self.db, self._ts, self.subscription, snapshot=True,
                                                topic_config=self._topic_config)
        if config != self.sub_config:
            self._apply_subscription(config)
        self._reaper.observe(self.db, self._ts, self._topic_config, now, skip=self.subscription)

    def _stall_watch(self):
        """A thread of its own: the membership loop may be stuck in a database call."""
        while not self._stop.wait(self.config.heartbeat_interval_s / 2):
            self._check_stall(_monotonic())

    def _check_stall(self, now: float):
        """ADR-15's heartbeat alarm: report ``ConsumerStalled`` once (again after a
        recovery) when no heartbeat round has reached the database, or this consumer has
        owned no shard, for over 3 heartbeats."""
        with self._owned_lock:
            owned = bool(self._owned)
        self._noshard_since = None if owned else (self._noshard_since or now)
        limit = 3 * self.config.heartbeat_interval_s
        unreachable = now - self._hb_ok
        no_shard = now - self._noshard_since if self._noshard_since is not None else 0.0
        if unreachable <= limit and no_shard <= limit:
            self._stall_reported = False
            return
        if not self._stall_reported:
            self._stall_reported = True
            err = self._last_error
            why, since = (("has not completed a heartbeat" + (f" ({type(err).__name__}: {err})" if err else
                                                               " (cannot reach the database)"), unreachable)
                          if unreachable > limit else ("owns no shard", no_shard))
            self._report(ConsumerStalled(f"consumer {self.id} of {self.topic}/{self.subscription} {why} "
                                         f"for {since:.1f}s (over 3 heartbeats)"))

    def _tick_clock(self, now: float):
        """Advance the database clock (delays are due by it) by the time that passed on
        this host's monotonic clock since this consumer last saw it: never by versions
        (they jump on recoveries), never by wall clocks (they disagree)."""
        candidate = 0
        if self._clock_base is not None:
            base, since = self._clock_base
            candidate = base + int((now - since) * 1000)
        self._clock_base = (clock.advance_clock(self.db, self._ts.clock_key, candidate,
                                                     self._ts.clock_version_key), now)

    def _observe_peers(self, now: float):
        members = membership.read_members(self.db, self._ts, self.subscription)
        # A heartbeat value first seen now is timed from after the read that saw it, not
        # from ``now`` (taken before this round's heartbeat, which a database stall can
        # hold up for seconds while the peer's commits too). Timeouts keep ``now``: late.
        seen_at = max(now, _monotonic())
        for cid in list(self._peers):
            if cid not in members:
                del self._peers[cid]
        for cid, m in members.items():
            if cid == self.id:
                continue
            seen = self._peers.get(cid)
            if seen is None or seen[0] != m["hb"]:
                self._peers[cid] = (m["hb"], seen_at)
            elif now - seen[1] >= _peer_timeout(self.config, m["record"]):
                if _subs.declare_zombie(self.db, self._ts, self.subscription, cid, seen[0],
                                               self._topic_config):
                    log.info("consumer %s: %s is a zombie (heartbeat %d unchanged for %.1fs)",
                             self.id, cid, seen[0], now - seen[1])
                self._peers.pop(cid, None)
                self._refresh_owned()

    def _check_leases(self, now: float):
        """Expire leases of owned shards seen unchanged (same lease, same touches) for
        their ack wait on this host's monotonic clock: per lease record, one transaction
        for all of its messages that are due (a batch nobody settled expires at once).
        The owned shards' lease records are read in one snapshot transaction (one per
        shard was a burst of 16 transactions every check, competing with the worker)."""
        with self._owned_lock:
            owned = dict(self._owned)
        spaces = {shard_id: self._ts.shard(self.subscription, *shard_id) for shard_id in owned}
        scans, ids = {}, list(spaces)
        for i in range(0, len(ids), LEASE_SCAN_SHARDS):     # a few shards per read-only transaction
            scans.update(queue.scan_shards_leases(self.db, {s: spaces[s] for s in ids[i:i + LEASE_SCAN_SHARDS]}))
        # A lease state first seen now is timed from after the read that saw it: ``now``
        # was taken before this round's heartbeat and these reads, which a database stall
        # can hold up for seconds while a touch commits (timed from ``now``, it expired
        # early by the stall). Due checks keep ``now``: they err late, never early.
        seen_at = max(now, _monotonic())
        for shard_id, epoch in owned.items():
            shard = spaces[shard_id]
            current = scans[shard_id]
            live_keys = set()
            due = {}        # (record key, lease id) -> [(vs, touches)]
            with self._leases_lock:
                for rkey, vs, lease_id, touches, ack_wait_ms in current:
                    key = (shard_id, vs.to_bytes())
                    live_keys.add(key)
                    seen = self._leases.get(key)
                    if seen is None or seen[0] != lease_id or seen[1] != touches:
                        self._leases[key] = [lease_id, touches, seen_at, ack_wait_ms / 1000, rkey]
                    elif now - seen[2] >= seen[3]:
                        due.setdefault((rkey, lease_id), []).append((vs, touches))
            for (rkey, lease_id), expiring in due.items():
                try:
                    outcome = queue.expire_leases(self.db, self._ts, shard, self.id, epoch, rkey, lease_id,
                                                     expiring, self.config.max_deliver, self.config.backoff_s)
                except LeaseLost:
                    self._refresh_owned()
                    return
                with self._leases_lock:
                    for vs, _t in expiring:
                        self._leases.pop((shard_id, vs.to_bytes()), None)
                if any(o is not queue.Expiry.CHANGED for o in outcome.values()):
                    self._mark(shard_id)
            with self._leases_lock:
                for key in [k for k in self._leases if k[0] == shard_id and k not in live_keys]:
                    del self._leases[key]

    def _begin_round(self, msgs) -> _Round:
        """A round of ``msgs`` (leased, about to be handled): its settlements collect in
        the returned ``_Round`` (``Message._deferred``), kept leased while it runs long."""
        r = _Round(self, msgs)
        self._rounds[id(r)] = r
        return r

    def _end_round(self, r: _Round) -> list:
        """The round's settlements still to commit (``_Round.finish``)."""
        self._rounds.pop(id(r), None)
        return r.finish()

    def _report(self, e: BaseException):
        if self.on_error is not None:
            try:
                self.on_error(e)
            except Exception:
                log.exception("on_error callback failed")
        else:
            log.warning("consumer %s: %s: %s", self.id, type(e).__name__, e)

    @property
    def stalled_s(self) -> float:
        """Seconds this consumer has been unable to reach the database (0 if fine)."""
        return 0.0 if self._stalled_since is None else _monotonic() - self._stalled_since

    # -- leasing ---------------------------------------------------------------------

    def _mark(self, shard_id):
        """Shard ``shard_id`` may have work: visit it on the next round."""
        with self._owned_lock:
            self._dirty.add(shard_id)
        self._wake.set()

    def _next_shards(self):
        """The owned shards that may have work, rotated for fairness: those a watch
        signalled, that had work last round, or that are new; every ``poll_interval_s``
        all of them (delayed messages fall due without a push). Visiting only these
        keeps one push from costing a transaction per owned shard."""
        now = _monotonic()
        with self._owned_lock:
            if now - self._last_sweep >= self.config.poll_interval_s:
                self._last_sweep = now
                self._dirty.update(self._owned)
                self._unwatched.clear()     # a watch may be free again: try one
            shards = sorted((s, e) for s, e in self._owned.items() if s in self._dirty)
            self._dirty.clear()
        if shards and self._rr_after is not None:
            # Start after the last shard the last round reached: those its limit (or
            # LEASE_ROUND_SHARDS) left out go first, so no shard waits for long.
            i = bisect.bisect_right([s for s, _e in shards], self._rr_after)
            shards = shards[i:] + shards[:i]
        return shards

    def _idle_for(self) -> float:
        return max(0.0, self._last_sweep + self.config.poll_interval_s - _monotonic())

    def _next_lease_id(self) -> bytes:
        """A lease id no other round of any consumer uses: a random 8-byte prefix drawn
        once per consumer and a counter (``os.urandom`` per round was a syscall costing
        ~0.2 ms on this VM)."""
        with self._owned_lock:
            self._lease_seq += 1
            return self._lease_prefix + self._lease_seq.to_bytes(8, "big")

    def _lease_many(self, shards, limit: int, ack_wait_s: float | None = None, take: bool = False,
                    settlements: list = (), defer_arm: bool = False) -> list:
        """Lease (or, with ack policy "none", take) up to ``limit`` messages from
        ``shards`` [(shard_id, epoch)], in that order, in ONE transaction: a transaction
        per shard made the worker's round cost a commit per dirty shard, which bounded
        end-to-end latency (bench/investigations/latency_trace.py).

        A shard drained by it (fewer messages than asked, no selection in the way) is not
        visited again until its watch fires; one that filled its share, or that the limit
        did not reach, is visited again next round. A shard no longer ours is skipped
        (its fence read raised before any write) and ownership re-read.

        Watches: a watch counts as a read of the shard's ``routed`` counter, which every
        push to the shard changes: in a transaction that writes, it would make pushes
        abort it. So watches are set in this transaction only when it took nothing (it
        commits read-only); otherwise ``_arm`` sets them after the commit, in a read-only
        transaction, and a shard whose counter moved between the two read versions (a
        push this transaction did not see) is visited again.

        ``settlements`` [Settlement] (the previous round's, see
        ``TailConsumer._process_at_least_once``) commit first in the same transaction: one
        commit per round. A lease lost among them is reported (``on_error``), not raised:
        this round's messages are leased and handed over.

        ``defer_arm``: leave ``_arm``'s transaction to the caller (``_arm_pending``, after
        the handlers ran and before the next round or an idle wait), so the round's
        messages reach the handler without waiting for it; a push it detects is then
        found by the next round just the same."""
        if not shards:
            if settlements:
                try:
                    self.settle(list(settlements))
                except LeaseLost as e:      # committed: report, as below
                    self._report(e)
            return []
        rows = _settle_rows(settlements) if settlements else None
        none = take or self.sub_config.ack_policy == "none"    # delivered = done: nothing to lease
        lease_id = self._next_lease_id()
        ack_wait_s = self.config.ack_wait_s if ack_wait_s is None else ack_wait_s
        ack_wait_ms = int(ack_wait_s * 1000)
        spaces = {s: self._ts.shard(self.subscription, *s) for s, _e in shards}
        maybe_lost = []     # lost sets of settle attempts that may have committed

        def body(tr, attempt) -> LeaseRound:
            rnd = LeaseRound()
            if rows:
                rnd.settle_lost = queue.settle(tr, self._ts, rows, self.config.max_deliver)
            left = limit
            for i, (shard_id, epoch) in enumerate(shards):
                part = ShardTake(shard_id)
                if left <= 0 or i >= LEASE_ROUND_SHARDS:
                    rnd.parts.append(part)      # not reached: visited next round
                    continue
                try:
                    if none:
                        taken = queue.take_batch(tr, self._ts, spaces[shard_id], self.id, epoch, left,
                                                    sel=self._sel)
                    else:
                        taken = queue.lease_batch(tr, self._ts, spaces[shard_id], self.id, epoch, left,
                                                     lease_id, ack_wait_ms, sel=self._sel)
                except LeaseLost:
                    rnd.lost = True
                    continue
                part.taken = taken
                part.drained = not taken or (self._sel is None and len(taken) < left)
                if part.drained:
                    part.watch_key = self._watch_key(shard_id)
                rnd.parts.append(part)
                left -= len(taken)
            if none and left < limit:
                # what this attempt took is ours if it committed: recorded, so a check after
                # commit_unknown_result can tell even once the shards moved (one mark per attempt)
                rnd.mark = lease_id + attempt.number.to_bytes(4, "big")
                queue.mark_take(tr, self._ts, self.subscription, self.id, rnd.mark)
            rnd.took = left < limit
            read_only = not rnd.took and not rows
            for part in rnd.parts:
                if part.watch_key is None:
                    continue
                if read_only:           # the watches cannot abort it
                    part.watch = tr.watch(part.watch_key)
                else:                   # the counter as this transaction saw it (snapshot: no conflict)
                    part.seen = _raw(tr.snapshot[part.watch_key])
            return rnd

        def committed(rnd: LeaseRound) -> bool:
            if none:
                return queue.take_committed(self.db, self._ts, self.subscription, self.id, rnd.mark)
            return all(queue.batch_leased(self.db, spaces[t.shard_id], {m.lease_key for m in t.taken}, lease_id)
                       for t in rnd.parts if t.taken)

        def on_error(e, attempt):
            rnd = attempt.result            # None: the body did not finish
            if rnd is None or not is_maybe_committed(e):
                return None
            if rnd.took and committed(rnd):
                # our commit took them: hand them over; no watches (visit all again)
                for part in rnd.parts:
                    part.watch_key = part.watch = None
                    part.drained = False
                return Done(rnd)
            _note_maybe_lost(maybe_lost, e, rnd.settle_lost)
            return None

        rnd = transact(self.db, body, on_error=on_error)
        if rows:
            error = self._settled(list(settlements), rnd.settle_lost, maybe_lost)
            if error is not None:
                self._report(error)
        self._rr_after = next((t.shard_id for t in reversed(rnd.parts) if t.taken is not None), self._rr_after)
        if not defer_arm:
            self._arm(rnd.parts)
        out = []
        now = _monotonic()
        for part in rnd.parts:
            if part.armed:
                self._keep_watch(part.shard_id, part.watch)
                if not part.drained:
                    self._mark(part.shard_id)
            else:       # the watch is left to ``_arm_pending``
                self._unarmed.append(part)
            taken = part.taken
            if not taken:
                continue
            if not none:
                with self._leases_lock:
                    for t in taken:
                        self._leases[(part.shard_id, t.vs.to_bytes())] = [lease_id, 0, now, ack_wait_s, t.lease_key]
            out += [_to_message(t, self.topic, self.subscription, self) for t in taken]
        if rnd.lost:
            self._refresh_owned()
        return out

    def _arm(self, parts: list):
        """``_lease_many``'s watches for a transaction that took messages: set in a
        read-only transaction; a shard whose ``routed`` counter differs from what the
        leasing transaction saw got a push it did not see: it is marked not drained.
        If this fails, every such shard is visited again (no watch): one attempt, not
        retried (a failed one costs those shards a visit)."""
        pending = [t for t in parts if not t.armed]
        if not pending:
            return

        def body(tr, _attempt):
            return [(t, tr.watch(t.watch_key), _raw(tr.snapshot[t.watch_key])) for t in pending]

        def give_up(e, _attempt):
            return Done(None) if isinstance(e, error_types()) else None

        armed = transact(self.db, body, on_error=give_up)
        if armed is None:
            for t in pending:
                t.watch_key = None
                t.drained = False
            return
        for t, watch, now in armed:
            t.watch = watch
            t.drained = now == t.seen

    def _arm_pending(self):
        """Set the watches a ``_lease_many(defer_arm=True)`` round left (see ``_arm``)."""
        if not self._unarmed:
            return
        pending, self._unarmed = self._unarmed, []
        with self._owned_lock:      # a shard lost meanwhile needs no watch
            pending = [t for t in pending if t.shard_id in self._owned]
        self._arm(pending)
        for part in pending:
            self._keep_watch(part.shard_id, part.watch)
            if not part.drained:
                self._mark(part.shard_id)

    def _watch_key(self, shard_id):
        w = self._watches.get(shard_id)
        if w is not None and not w.is_ready():
            return None     # one watch per shard is enough
        if shard_id in self._unwatched:
            return None     # out of watches: polled until the next sweep
        return self._ts.shard(self.subscription, *shard_id).stat("routed")

    def _keep_watch(self, shard_id, watch):
        if watch is None:
            return
        self._watches[shard_id] = watch
        watch.on_ready(lambda f: self._watch_ended(shard_id, f))

    def _watch_ended(self, shard_id, watch):
        """A watch fired, or failed. ``too_many_watches`` (1032: on FDB, one process's
        Database shares 10,000 watches among all its consumers) leaves the shard to the
        sweep every ``poll_interval_s``, with no new watch until then: visiting it at
        once would set the next watch, fail again, and loop. Any other end marks it."""
        try:
            watch.wait()
        except error_types() as e:
            if e.code == 1032:
                with self._owned_lock:
                    self._unwatched.add(shard_id)
                return
        self._mark(shard_id)

    def _idle(self, timeout: float):
        if self._wake.wait(timeout):
            self._wake.clear()

    def fetch(self, max_messages: int = 100, timeout: float = 1.0, *, ack_wait_s: float | None = None) -> list:
        """Lease up to ``max_messages`` messages, waiting up to ``timeout`` seconds for
        the first. Settle each with ack/nak/term; unsettled ones are redelivered after
        ``ack_wait_s`` (this fetch's lease length; default the consumer config's).

        ``close()`` from another thread ends a waiting fetch at once (``[]``) and waits
        for one in the middle of a lease, so it returns that lease too; a fetch after
        ``close()`` returns ``[]`` without leasing."""
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
            raise ConfigError(f"max_messages must be an integer >= 1, not {max_messages!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout:
            raise ConfigError(f"timeout must be a number of seconds, not {timeout!r:.80}")
        if ack_wait_s is not None:
            ConsumerConfig(ack_wait_s=ack_wait_s)   # validates
        me = threading.get_ident()
        with self._fetch_done:
            if self._closed:
                return []
            self._fetching.append(me)
        try:
            return self._fetch(max_messages, timeout, ack_wait_s)
        finally:
            with self._fetch_done:
                self._fetching.remove(me)
                self._fetch_done.notify_all()

    def _fetch(self, max_messages: int, timeout: float, ack_wait_s: float | None) -> list:
        deadline = _monotonic() + max(0.0, timeout)
        while True:
            if self._stop.is_set():         # closing: lease nothing more
                return []
            shards = self._next_shards()
            try:
                out = self._lease_many(shards, max_messages, ack_wait_s)
            except BaseException:
                after_interrupt()
                for s, _e in shards:
                    self._mark(s)
                raise
            left = deadline - _monotonic()
            if out or left <= 0 or self._stop.is_set():
                return out
            self._idle(min(left, self._idle_for()))

    def settle(self, items):
        """Commit settlements [:class:`~fdq.Settlement`] in one transaction. Raises
        LeaseLost naming the messages whose lease moved on (they will be redelivered)."""
        items = list(items)
        if not items:
            return
        for s in items:
            if not isinstance(s, Settlement) or not isinstance(s.action, Action):
                raise ConfigError(f"settle takes fdq.Settlement(message, fdq.Action.X, ...) items, "
                                  f"not {s!r:.80}")
            taken = getattr(s.message, "_taken", None)
            if taken is None or taken.lease_id is None:     # as Message._settle (it was a TypeError)
                raise FDQError(f"message {getattr(s.message, 'id', s.message)} is not leased: "
                               f"{s.action.value} needs at-least-once delivery")
            if s.action is NAK:
                _check_delay(s.delay_s)
        rows = _settle_rows(items)
        maybe_lost = []     # lost sets of attempts that may have committed

        def on_error(e, attempt):
            _note_maybe_lost(maybe_lost, e, attempt.result)

        lost = transact(self.db, lambda tr, _attempt: queue.settle(tr, self._ts, rows, self.config.max_deliver),
                        on_error=on_error)
        error = self._settled(items, lost, maybe_lost)
        if error is not None:
            raise error

    def _settled(self, items: list, lost: list, maybe_lost: list):
        """After the commit of settlements ``items``: forget their leases, visit their
        shards again where that may free work; returns the LeaseLost to raise, if any."""
        for earlier in maybe_lost:
            # A lease that attempt settled (if it committed) is gone on retry: lost only
            # if every attempt that may have committed found it lost too.
            lost = [r for r in lost if _row_id(r) in earlier]
        now = _monotonic()
        revisit = set()     # back in a queue, or (flow control, ordered keys) room freed
        selecting = self._sel is not None
        leases = self._leases
        with self._leases_lock:
            for m, action, _d, _r in items:
                shard_id = (m.tag, m.shard)
                key = (shard_id, m._taken.vs.to_bytes())
                if action is TOUCH:
                    seen = leases.get(key)
                    if seen is not None:
                        seen[1] += 1
                        seen[2] = now
                else:
                    leases.pop(key, None)
                if action is not ACK or selecting:
                    revisit.add(shard_id)
        for shard_id in revisit:
            self._mark(shard_id)
        if lost:
            ids = [message_id(r.vs) for r in lost]
            return LeaseLost(f"lease lost (expired and redelivered, or settled elsewhere): {', '.join(ids)}", ids)
        return None

    def ack_many(self, messages):
        self.settle([Settlement(m, ACK) for m in messages])

    # -- lifecycle -------------------------------------------------------------------

    def close(self):
        """Leave the subscription: shards go to the other consumers now; leases this
        consumer still holds are returned to their queues at once."""
        if self._closed:
            return
        with self._fetch_done:
            self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        deadline = _monotonic() + _GOODBYE_MS / 1000
        self._await_fetches(deadline)
        self._return_leases(deadline)
        for w in self._watches.values():
            w.cancel()
        try:
            run_within(self.db, _ms_until(deadline), _subs.leave, self._ts, self.subscription, self.id,
                       self._topic_config, self._incarnation)
        except FDQError as e:
            self._report(e)

    def _await_fetches(self, deadline):
        """Wait (until ``deadline``) for fetches other threads are in the middle of: a
        lease one commits after ``_return_leases`` looked would otherwise stay taken
        until its ack wait ran out (``fdq.aio``'s fetch in a worker thread, cancelled)."""
        me = threading.get_ident()
        with self._fetch_done:
            self._fetch_done.wait_for(lambda: all(t == me for t in self._fetching),
                                      max(0.0, deadline - _monotonic()))

    def _return_leases(self, deadline):
        """Nak (delay 0) what this consumer leased and did not settle. Only its own
        leases (its lease-id prefix): ``_leases`` also holds what its lease check observes
        of other consumers' leases in its shards (a live previous owner's, still being
        worked on), and returning those would redeliver them before their ack wait."""
        with self._leases_lock:
            mine = [(k, v) for k, v in self._leases.items() if v[0][:8] == self._lease_prefix]
        rows = []
        for (shard_id, vs12), (lease_id, _t, _s, _w, key) in mine:
            rows.append(SettleRow(self._ts.shard(self.subscription, *shard_id), vs_from_bytes(vs12), lease_id, key,
                                  NAK, 0))
        if rows:
            try:
                run_within(self.db, _ms_until(deadline), queue.settle, self._ts, rows, 1 << 30)
            except FDQError as e:
                self._report(e)

    def shutdown(self):
        """Same as ``close()`` (a method, so subclasses' ``close`` is the one called)."""
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _OnceAttempt:
    """The attempt of ``TailConsumer._process_exactly_once``'s transaction under way: what
    it took, the message whose handler runs (None between them), its watch."""

    __slots__ = ("taken", "current", "watch")

    def __init__(self):
        self.taken, self.current, self.watch = [], None, None


class _HeadFailure:
    """``_process_exactly_once`` gave up on its transaction: ``taken`` (None: no message
    to blame) fails in place with ``reason`` (dead-lettered at once if ``dead``)."""

    __slots__ = ("taken", "reason", "dead")

    def __init__(self, taken, reason: str = "", dead: bool = False):
        self.taken, self.reason, self.dead = taken, reason, dead


class TailConsumer(Consumer):
    """A consumer that runs ``handler`` on its shards' messages in the background."""

    def __init__(self, db, topic, handler, *, mode: str, **kwargs):
        if not callable(handler):
            raise ConfigError("handler must be callable")
        self.handler = handler
        self.mode = mode
        explicit_acking = kwargs.pop("_explicit_acking", False)
        self._carried = []      # the last batch's settlements, committed by the next round
        self._in_round = threading.local()  # .active: this thread runs a round (and handlers)
        self._close_in_worker = False       # shutdown() came from a handler: the worker closes
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
                    done = sum(self._pool.map(self._visit_group, _by_shard_number(shards)))
                elif self.mode != EXACTLY_ONCE:
                    done = self._visit(shards) if shards else 0    # one transaction for them all
                else:
                    done = sum(self._visit([s]) for s in shards)
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

    def _visit_group(self, group) -> int:
        """Visit shards of one shard number (``_by_shard_number``) in this thread, one
        after the other: a key's messages of several dispatch tags never run at once."""
        if self.mode != EXACTLY_ONCE:
            return self._visit(group)       # one transaction for them all
        return sum(self._visit([s]) for s in group)

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
        """Process shards [(shard_id, epoch)] (several only in one transaction: not
        exactly-once). A shard that filled its batch (or failed) is visited again next
        round; one it drained waits for its watch or the next sweep."""
        self._in_round.active = True
        try:
            return self._process(shards)
        except Exception as e:
            self._report(e)
            for shard_id, _e in shards:
                self._mark(shard_id)
            self._stop.wait(0.05)
            return 0
        finally:
            self._in_round.active = False

    def _process(self, shards) -> int:
        if self._stop.is_set():
            return 0
        try:
            if self.mode == EXACTLY_ONCE:
                (shard_id, epoch), = shards
                n = self._process_exactly_once(shard_id, epoch)
                if n:
                    self._mark(shard_id)
                return n
            if self.mode == AT_MOST_ONCE:
                return self._process_at_most_once(shards)
            return self._process_at_least_once(shards)
        except LeaseLost:
            self._refresh_owned()
            return 0

    def _process_at_most_once(self, shards) -> int:
        # After commit_unknown_result: if the take's attempt marker is there, our commit
        # took the batch: hand it over (else it would be lost unhandled), shards moved or not.
        defer = self._pool is None
        msgs = self._lease_many(shards, self.batch_size, take=True, defer_arm=defer)
        try:
            for m in msgs:
                try:
                    self.handler(m)
                except Exception as e:  # at most once: the message is gone either way
                    self._report(e)
        finally:
            if defer:
                self._arm_pending()
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
        defer = self._pool is None
        try:
            msgs = self._lease_many(shards, self.batch_size, settlements=carried, defer_arm=defer)
        except BaseException:
            after_interrupt()
            self._carried = carried + self._carried    # not committed: settle them later
            raise
        pending = self._begin_round(msgs)
        try:
            for i, m in enumerate(msgs):
                if self._stop.is_set():     # shutting down: the rest go back uncounted
                    for rest in msgs[i:]:
                        rest._deferred = pending
                        rest.release()
                        rest._deferred = None
                    break
                m._handed = True
                m._deferred = pending
                try:
                    self.handler(m)
                    if m._settled is None:
                        m.ack()
                except Exception as e:
                    if m._settled is None:
                        m.nak()
                    self._report(e)
                m._deferred = None
        finally:
            pending = self._end_round(pending)
            if defer:
                self._arm_pending()
        if self._pool is None and not self._stop.is_set():
            self._carried = pending
            return len(msgs)
        try:
            self.settle(pending)
        except LeaseLost as e:
            self._report(e)
        return len(msgs)

    def _process_exactly_once(self, shard_id, epoch) -> int:
        """Take a batch and run the handler on each message inside the taking
        transaction; returns how many messages it settled (0: none there).

        Too slow or too big to commit (1007, 2101): the batch is halved and run again;
        one message alone that cannot commit fails in place (``_fail_head``: an attempt
        counted; too large never fits: dead-lettered). A handler that raises fails its
        message, after the messages before it commit without it (run again: their
        transaction was discarded); its attempt is counted then, without running it
        again (it ran i + 1 times per attempt, and those before it as often, when it was
        retried until it came first)."""
        shard = self._ts.shard(self.subscription, *shard_id)
        limit = self.batch_size
        failed = None       # (taken, reason): a message whose handler raised behind the ones retried
        run = _OnceAttempt()

        def body(tr, _attempt) -> int:
            run.taken, run.current, run.watch = [], None, None
            run.taken = queue.take_batch(tr, self._ts, shard, self.id, epoch, limit, finish=True, sel=self._sel)
            for t in run.taken:
                run.current = t
                m = _to_message(t, self.topic, self.subscription, self)
                m._in_tr = True
                try:
                    self.handler(tr, m)
                finally:
                    m._in_tr = False    # term() only in its handler (then: not leased)
                if m._settled is TERM:
                    queue.dead_letter_taken(tr, self._ts, t, f"terminated: {m._reason}", self.id)
            run.current = None
            key = self._watch_key(shard_id) if not run.taken else None
            run.watch = tr.watch(key) if key is not None else None
            return len(run.taken)

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
            self._report(e)
            if current is None:
                return Done(_HeadFailure(None))
            reason = f"handler raised {type(e).__name__}: {e}"
            i = next(i for i, t in enumerate(taken) if t is current)
            if i > 0:
                limit, failed = i, (current, reason)
                return Again()
            return Done(_HeadFailure(current, reason))

        n = transact(self.db, body, on_error=on_error)
        if isinstance(n, _HeadFailure):
            if n.taken is not None:
                self._fail_head(shard, epoch, n.taken, n.reason, dead=n.dead)
            return 1
        self._keep_watch(shard_id, run.watch)
        if failed is not None:      # its attempt, not run again (once per attempt)
            self._fail_head(shard, epoch, *failed)
            return n + 1
        return n

    def _fail_head(self, shard, epoch, taken, reason, dead=False):
        max_deliver = 1 if dead else self.config.max_deliver
        queue.fail_in_place(self.db, self._ts, shard, self.id, epoch, taken.vs, max_deliver, reason,
                               taken.record.attempts, taken.delayed_key)

    def close(self):
        """Stop consuming and leave. Called by a handler (``shutdown()`` from inside a
        round: the worker or a pool thread, which cannot wait for itself), it returns at
        once; the worker finishes the round (the message in hand settled as usual, the
        rest of the batch given back) and then closes the consumer."""
        if self._closed:
            return
        self._stop.set()
        self._wake.set()
        if getattr(self._in_round, "active", False):
            self._close_in_worker = True
            return
        self._finish_close()

    def _finish_close(self):
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout=max(30.0, self.config.ack_wait_s))
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        super().close()


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
         subscription: str = DEFAULT_SUBSCRIPTION, config: ConsumerConfig | None = None, **kwargs):
    """Consume ``topic`` in the background until ``shutdown()``.

    ``transactional=True``: exactly-once, ``handler(tr, message)``. Otherwise
    ``acking=False`` is at-most-once and ``acking=None``/``True`` at-least-once,
    ``handler(message)``. Combining ``transactional=True`` with ``acking`` is an error.
    """
    check_delivery_args(acking, transactional)
    mode = EXACTLY_ONCE if transactional else (AT_MOST_ONCE if acking is False else AT_LEAST_ONCE)
    return TailConsumer(db, topic, handler, mode=mode, batch_size=batch_size, consumer_id=consumer_id,
                        subscription=subscription, config=config, _explicit_acking=acking is True, **kwargs)


__all__ = ["Consumer", "TailConsumer", "Message", "tail", "AT_MOST_ONCE", "AT_LEAST_ONCE", "EXACTLY_ONCE"]
