"""Consumers: own an even share of a subscription's shards and deliver their messages.

``Consumer`` is pull style: ``fetch`` leases messages (:mod:`fdq.message`), settled with
``ack()``, ``nak(delay)``, ``term(reason)``, ``release()`` or ``in_progress()``, or
several at once with ``settle``; unsettled ones are redelivered after their lease
expires, dead-lettered after ``max_deliver`` attempts. Its membership of the
subscription (heartbeats, peers, shard ownership, lease expiry) runs in threads of its
own (:mod:`fdq.member`); ``tail`` (:mod:`fdq.tailing`) runs a handler over one in the
background, and ``fdq.aio`` on an event loop.

A round leases from every owned shard that may have work in ONE transaction
(``_lease_many``; exactly-once takes, handlers included, the same way:
``_round_parts``), settlements carried along; shards drained are watched (their
``routed`` counter) instead of polled.
"""
from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import logging
import os
import socket
import threading
import time

from . import hooks
from .config import (DEFAULT_SUBSCRIPTION, ConsumerConfig, SubscriptionConfig, TopicConfig, check_name,
                     effective_consumer_config)
from .engine import Done, after_interrupt, error_types, run_within, transact
from .errors import ConfigError, FDQError, LeaseLost, SubscriptionNotFound, TopicNotFound, is_maybe_committed
from .headers import check_tag
from .keyspace import Keyspace, message_id, vs_from_bytes
from .member import Member
from .message import _check_delay, _new_tuple, _Round, _SettleGroup, _to_message
from .ops import catchup, membership, queue
from .ops import subscriptions as subs
from .ops.queue import SettleRow
from .settlement import ACK, NAK, RELEASE, TERM, TOUCH, Action, Settlement
from .ops.topics import create_topic, read_topic_config

log = logging.getLogger("fdq.consumer")
_monotonic = time.monotonic  # liveness and lease expiry: this host's monotonic clock only

AT_MOST_ONCE, AT_LEAST_ONCE, EXACTLY_ONCE = "at_most_once", "at_least_once", "exactly_once"
# A closing consumer's goodbye (return its leases, leave) is given up after this long: a
# stalled database must not hang shutdown, and what it would have done happens anyway
# (leases expire, peers time the consumer out as a zombie).
_GOODBYE_MS = 10_000
# At most this many shards are visited by one lease transaction (the rest wait for the
# next round): its range reads are sequential, and on a cluster (~1 ms a read) a round over
# thousands of shards (a topic with many dispatch tags) would outlive the 5-second rule
# and be retried for ever.
LEASE_ROUND_SHARDS = 256
# A lease round issues the fence reads of this many shards at once (``queue.round_reads``).
FENCE_WINDOW = 4
# Without on_error, an error identical to one logged less than this long ago is not
# logged again (``Consumer._report``).
REPORT_EVERY_S = 10.0
# ``settle_soon``'s default: how long settlements wait for a fetch's lease transaction to
# carry them before they commit alone.
SETTLE_LINGER_S = 0.005


def _ms_until(deadline: float) -> int:
    return max(1, int((deadline - _monotonic()) * 1000))   # never 0: a timeout of 0 is none


def _settle_rows(items: list) -> list:
    """``queue.settle``'s rows [SettleRow] for settlements [Settlement]."""
    rows = []
    append = rows.append
    for m, action, delay_s, reason in items:
        t = m._taken
        append(_new_tuple(SettleRow, (t.shard, t.vs, t.lease_id, t.lease_key, action,    # SettleRow(...)
                                      reason if action is TERM else delay_s, reason)))
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


def _resolve_soon(soon: list, error):
    """The futures of ``settle_soon`` batches [(items, Future)] committed together:
    each fails with the part of a LeaseLost naming its own messages, or with any other
    ``error``; otherwise it is done."""
    if not soon:
        return
    lost = set(error.ids) if isinstance(error, LeaseLost) else None
    for items, fut in soon:
        if fut.done():      # resolved when they committed; the lease round failed after
            continue
        if error is None:
            fut.set_result(None)
        elif lost is None:
            fut.set_exception(error if isinstance(error, Exception)
                              else FDQError(f"settlements not committed: interrupted ({type(error).__name__})"))
        else:
            ids = [s.message.id for s in items if s.message.id in lost]
            if ids:
                fut.set_exception(LeaseLost(f"lease lost (expired and redelivered, or settled elsewhere): "
                                            f"{', '.join(ids)}", ids))
            else:
                fut.set_result(None)


def check_messages_args(batch, timeout):
    """``messages()``'s arguments (sync and ``fdq.aio``): ``batch`` an integer >= 1,
    ``timeout`` None or seconds >= 0."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch must be an integer >= 1, not {batch!r:.80}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 <= timeout < float("inf")):
        raise ConfigError(f"timeout must be None or a number of seconds >= 0, not {timeout!r:.80}")


class ShardTake:
    """One shard's part of a round (``Consumer._round_parts``).

    ``taken``: what the round took from it ([Taken]). ``drained``: fewer than asked, no
    selection in the way: not visited again until its watch fires. A drained shard's
    ``watch_key`` (its ``routed`` counter; None if it has a watch already, or is out of
    watches) gets a ``watch``, set in the round's transaction."""

    __slots__ = ("shard_id", "taken", "drained", "watch_key", "watch")

    def __init__(self, shard_id, taken):
        self.shard_id = shard_id
        self.taken = taken
        self.drained = False
        self.watch_key = None
        self.watch = None


class LeaseRound:
    """What one attempt of a round's transaction did (``Consumer._lease_many``, and the
    exactly-once ``TailConsumer._process_exactly_once``): its ``parts`` [ShardTake] in
    visiting order (a shard no longer ours left out: ``lost``; those the limit did not
    reach: ``unreached``, their ids), whether it ``took`` anything, its take ``mark`` (at
    most once: ``queue.mark_take``) and the carried settlements whose lease it found lost
    (``settle_lost``)."""

    __slots__ = ("parts", "unreached", "lost", "took", "mark", "settle_lost")

    def __init__(self):
        self.parts = []
        self.unreached = []
        self.lost = False
        self.took = False
        self.mark = None
        self.settle_lost = None


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
                 extend_support: bool | None = None, desired_tag: str | None = None,
                 on_error=None, batch_size: int = 100,
                 subscription_config: SubscriptionConfig | None = None, ephemeral: bool = False):
        self.db = db
        self.topic = check_name(topic)
        self.subscription = check_name(subscription, "subscription")
        hooks.load_defaults()   # now, not in the first handler call's latency
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
        self._reported = {}          # (error type, text) -> when ``_report`` last logged it
        self._ts = self.keyspace.topic(self.topic)
        self._topic_config = self._load_topic(create, extend_support)
        # None (the default): as the topic is; an explicit value must match it.
        if extend_support and not self._topic_config.extend:
            raise ConfigError(f"topic {self.topic!r} has no extend support: connect without extend_support")
        if self._topic_config.extend and extend_support is False:
            raise ConfigError(f"topic {self.topic!r} has extend support: extend_support=False cannot consume it "
                              "(leave it out, or set it True)")
        self.extend_support = self._topic_config.extend
        if desired_tag is not None and self._topic_config.extend:
            check_tag(desired_tag)
        self.desired_tag = desired_tag if self._topic_config.extend else None   # plain: ignored
        self._owned = {}             # (tag, n) -> epoch
        self._owned_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._watches = {}           # (tag, n) -> watch future on the shard's "routed" counter
        self._assign_watch = None    # watch on the subscription's assignment counter (``_refresh_owned``)
        self._unwatched = set()      # shards whose watch hit the watch limit: polled for now
        # ((tag, n), 12-byte vs) -> [lease_id, touches, since, ack_wait_s, record key, handed
        # (``_lease_many``)]; bytes, not the Versionstamp: its hash is Python code, two per
        # message on the hot path
        self._leases = {}
        self._leases_lock = threading.Lock()
        self._settle_group = _SettleGroup(self.settle)
        # settle_soon: [([Settlement], Future)] for the next lease transaction, when they
        # commit alone at the latest (None: nothing waits), the thread doing that
        self._soon = []
        self._soon_cond = threading.Condition()
        self._soon_deadline = None
        self._soon_stopped = False
        self._linger = None
        self._rounds = {}            # id -> _Round in hand (kept leased by the membership thread)
        self._lease_prefix, self._lease_seq = os.urandom(8), 0
        self._rr_after = None        # the last shard the last round reached: the next starts after it
        self._dirty = set()          # shards that may have work (new, signalled, swept)
        self._last_sweep = 0.0
        self._closed = False
        self._close_lock = threading.RLock()     # one close at a time (``close``)
        self._fetching = []          # idents of the threads inside fetch(), under _fetch_done
        self._fetch_done = threading.Condition()
        self._member = Member(self)  # heartbeats, peers, lease expiry: threads of its own
        joined = self._bind_subscription(create, subscription_config, ephemeral)
        if not joined:
            self._join()
        try:
            if joined:
                self._refresh_owned()
            self._member.start()
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
                subs.read_subscription(self.db, self._ts, self.subscription)  # raises
            if subs.is_ephemeral(self.subscription, given or SubscriptionConfig()):
                subs.create_and_join(self.db, self._ts, self.subscription, given, self.id, self._record())
                joined = True
            else:
                subs.create_subscription(self.db, self._ts, self.subscription, given)
        try:
            self._apply_subscription(subs.read_subscription(self.db, self._ts, self.subscription))
            if given is not None and given != self.sub_config:
                raise subs.diff_error(self._ts, self.subscription, self.sub_config, given)
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
        waits for it to play): the membership loop finishes it then (``Member.help_catch_up``)."""
        for _attempt in range(3):
            if self.subscription not in self._topic_config.catchup or not self._topic_config.routing:
                return
            try:
                catchup.catch_up(self.db, self._ts, self.subscription)
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
        self.config = effective_consumer_config(self._own_config, config)
        self._sel = None
        if config.max_ack_pending is not None or config.ordered or subs.matcher(config):
            self._sel = queue.Selection(config.max_ack_pending, config.ordered, subs.matcher(config))

    def _record(self) -> dict:
        return {"id": self.id, "host": socket.gethostname(), "pid": os.getpid(), "mode": self.mode,
                "tag": self.desired_tag, "extend": self.extend_support, "batch_size": self.batch_size,
                "zombie_after_s": self.config.zombie_after_s, "incarnation": self._incarnation}

    def _join(self):
        plan = subs.join(self.db, self._ts, self.subscription, self.id, self._record())
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
            config = subs.read_subscription(self.db, self._ts, self.subscription)
        except (TopicNotFound, SubscriptionNotFound) as e:
            self._gone = e      # reported (on_error) each heartbeat until created again
            raise
        if config != self.sub_config:
            self._apply_subscription(config)    # raises on another ack_policy
        subs.join(self.db, self._ts, self.subscription, self.id, self._record(), expect=config)
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
            run_within(self.db, _GOODBYE_MS, subs.leave, self._ts, self.subscription, self.id,
                       self._incarnation)
        except FDQError as e:
            self._report(e)

    def _refresh_owned(self):
        """Read the shards this consumer owns; with no live watch on the subscription's
        assignment counter, set one in the same read (its firing has the membership
        loop call this again: ``_assignment_changed``)."""
        w = self._assign_watch
        if w is None or w.is_ready():
            mine, w = membership.read_owned_watched(self.db, self._ts, self.subscription, self.id,
                                                    self._incarnation)
            with self._owned_lock:
                old, self._assign_watch = self._assign_watch, w
            if old is not None and old is not w:
                old.cancel()
            w.on_ready(self._assignment_changed)
        else:
            mine = membership.read_owned(self.db, self._ts, self.subscription, self.id, self._incarnation)
        if mine is None:        # another instance joined under this id: it owns them now
            mine = {}
            if not self._replaced:
                self._replaced = True
                self._report(ConfigError(f"consumer {self.id} of {self.topic}/{self.subscription}: another "
                                         "consumer joined with this consumer_id; this one stops consuming"))
        with self._owned_lock:
            lost = set(self._owned) - set(mine)
            new = [s for s in mine if s not in self._owned or self._owned[s] != mine[s]]
            self._owned = mine
            if new:
                self._dirty.update(new)
                self._wake.set()
        for s in lost:
            w = self._watches.pop(s, None)
            if w is not None:
                w.cancel()

    def _assignment_changed(self, watch):
        """The assignment watch ended: fired (ownership changed) or failed (cancelled,
        or FDB's watch limit: the heartbeat's refresh arms it again)."""
        try:
            watch.wait()
        except error_types():
            return
        self._member.reassigned.set()

    @property
    def owned_shards(self) -> list:
        with self._owned_lock:
            return sorted(self._owned)

    def _begin_round(self, msgs) -> _Round:
        """A round of ``msgs`` (leased, about to be handled): its settlements collect in
        the returned ``_Round`` (``Message._deferred``), kept leased by the membership
        loop while it runs long."""
        r = _Round(self, msgs)
        self._rounds[id(r)] = r
        return r

    def _end_round(self, r: _Round) -> list:
        """The round's settlements still to commit (``_Round.finish``)."""
        self._rounds.pop(id(r), None)
        return r.finish()

    def _report(self, e: BaseException, message=None):
        """Hand ``e`` to ``on_error``. Without one: a handler's failure on ``message`` is
        logged as an error with its traceback; any other error as one warning line, an
        error identical to one logged less than ``REPORT_EVERY_S`` ago left out (a
        failure met every round must not flood the log)."""
        if self.on_error is not None:
            try:
                self.on_error(e)
            except Exception:
                log.exception("on_error callback failed")
            return
        if message is not None:
            log.error("consumer %s: handler failed on %s/%s message %s (attempt %d of %d)", self.id, self.topic,
                      self.subscription, message.id, message.attempts, self.config.max_deliver, exc_info=e)
            return
        key, now = (type(e), str(e)), _monotonic()
        last = self._reported.get(key)
        if last is not None and now - last < REPORT_EVERY_S:
            return
        if len(self._reported) >= 64:       # bounded: the ones logged long ago go
            self._reported = {k: t for k, t in self._reported.items() if now - t < REPORT_EVERY_S}
        self._reported[key] = now
        log.warning("consumer %s: %s: %s", self.id, type(e).__name__, e)

    @property
    def stalled_s(self) -> float:
        """Seconds this consumer has been unable to reach the database (0 if fine)."""
        return self._member.stalled_s

    # -- leasing ---------------------------------------------------------------------

    def _mark(self, *shard_ids):
        """Shards ``shard_ids`` may have work: visit them on the next round."""
        with self._owned_lock:
            self._dirty.update(shard_ids)
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
            # Set with ``_dirty`` (under this lock), cleared as it is taken: a wake left
            # from a shard this takes ended the next ``_idle`` at once with nothing to
            # do, and a tail then committed its carried acks alone (1-13% of the rounds
            # at one message per round: a writing commit each).
            self._wake.clear()
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
                    settlements: list = (), handed: bool = False, settled=None) -> list:
        """Lease (or, with ack policy "none", take) up to ``limit`` messages from
        ``shards`` [(shard_id, epoch)], in that order, in ONE transaction: a transaction
        per shard made the worker's round cost a commit per dirty shard, which bounded
        end-to-end latency (bench/investigations/latency_trace.py).

        A shard drained by it (fewer messages than asked, no selection in the way) is not
        visited again until its watch fires; one that filled its share, or that the limit
        did not reach, is visited again next round. A shard no longer ours is skipped
        (its fence read raised before any write) and ownership re-read.

        Watches: set in this transaction, on the shard's ``routed`` counter, which every
        push to the shard adds to without a write conflict range (``push.add_routed``):
        a push committed meanwhile does not abort the round (a watch is a read with a
        conflict range), and fires the watch (its value differs from the baseline this
        transaction read). One transaction per round (watches used to be set after the
        commit in a read-only one).

        ``settlements`` [Settlement] (the previous round's, see
        ``TailConsumer._process_at_least_once``) commit first in the same transaction: one
        commit per round. A lease lost among them is not raised (this round's messages
        are leased and handed over): ``settled(LeaseLost or None)`` is called once they
        committed; without ``settled`` a lost lease is reported (``on_error``).

        ``handed``: the messages go to the application as they are (``fetch``): each is
        an attempt, and one left unsettled at ``close()`` is nak'd; otherwise (a tail's
        round, which gives back what no handler got) one left at ``close()`` is released."""
        if not shards:
            if settlements:
                try:
                    self.settle(list(settlements))
                except LeaseLost as e:      # committed: as below
                    self._settle_outcome(settled, e)
                else:
                    self._settle_outcome(settled, None)
            return []
        rows = _settle_rows(settlements) if settlements else None
        none = take or self.sub_config.ack_policy == "none"    # delivered = done: nothing to lease
        lease_id = self._next_lease_id()
        ack_wait_s = self.config.ack_wait_s if ack_wait_s is None else ack_wait_s
        ack_wait_ms = int(ack_wait_s * 1000)
        max_deliver = self.config.max_deliver
        maybe_lost = []     # lost sets of settle attempts that may have committed

        if none:
            def one(tr, shard, epoch, left, reads):
                return queue.take_batch(tr, self._ts, shard, self.id, epoch, left,
                                        max_deliver=max_deliver, sel=self._sel, reads=reads)
        else:
            def one(tr, shard, epoch, left, reads):
                return queue.lease_batch(tr, self._ts, shard, self.id, epoch, left, lease_id, ack_wait_ms,
                                         max_deliver=max_deliver, sel=self._sel, reads=reads)

        def body(tr, attempt) -> LeaseRound:
            rnd = LeaseRound()
            if rows:
                rnd.settle_lost = queue.settle(tr, self._ts, rows, max_deliver)
            left = self._round_parts(tr, rnd, shards, limit, one)
            if none and left < limit:
                # what this attempt took is ours if it committed: recorded, so a check after
                # commit_unknown_result can tell even once the shards moved (one mark per attempt)
                rnd.mark = lease_id + attempt.number.to_bytes(4, "big")
                queue.mark_take(tr, self._ts, self.subscription, self.id, rnd.mark)
            rnd.took = left < limit
            self._watch_drained(tr, rnd)
            return rnd

        def committed(rnd: LeaseRound) -> bool:
            if none:
                return queue.take_committed(self.db, self._ts, self.subscription, self.id, rnd.mark)
            return all(queue.batch_leased(self.db, t.taken[0].shard, {m.lease_key for m in t.taken}, lease_id)
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
            self._settle_outcome(settled, self._settled(list(settlements), rnd.settle_lost, maybe_lost))
        self._round_committed(rnd)
        out = []
        now = _monotonic()
        for part in rnd.parts:
            taken = part.taken
            if not taken:
                continue
            if not none:
                with self._leases_lock:
                    for t in taken:
                        self._leases[(part.shard_id, t.vs.to_bytes())] = [lease_id, 0, now, ack_wait_s, t.lease_key,
                                                                          handed]
            out += [_to_message(t, self.topic, self.subscription, self) for t in taken]
        return out

    def _round_parts(self, tr, rnd: LeaseRound, shards, limit: int, one) -> int:
        """The shards' part of a round's transaction: ``one(tr, shard, epoch, left, reads)``
        takes or leases up to ``left`` messages from each of ``shards`` [(shard_id,
        epoch)] in turn (``rnd.parts``, in that order) until ``limit`` are taken or
        ``LEASE_ROUND_SHARDS`` are visited (the rest: ``rnd.unreached``); returns how many
        of ``limit`` are left. A shard no longer ours (its fence raised ``LeaseLost``
        before any write) is left out (``rnd.lost``). The fences of the next shards, the
        config and the clock are read at once (26.3), a window at a time: a round that a
        backlog fills at its first shard reads few fences it does not use."""
        left = limit
        reads = None
        sub, space = self.subscription, self._ts.shard
        for i, (shard_id, epoch) in enumerate(shards):
            if left <= 0 or i >= LEASE_ROUND_SHARDS:
                rnd.unreached = [s for s, _e in shards[i:]]     # visited next round
                break
            shard = space(sub, *shard_id)
            if reads is None or shard not in reads.records:
                # The first shard's fence alone (a backlog fills the round there), then
                # FENCE_WINDOW at a time.
                ahead = 1 if reads is None else FENCE_WINDOW
                window = [space(sub, *s) for s, _e in shards[i:min(i + ahead, LEASE_ROUND_SHARDS)]]
                reads = queue.round_reads(tr, self._ts, window, reads)
            try:
                taken = one(tr, shard, epoch, left, reads)
            except LeaseLost:
                rnd.lost = True
                continue
            part = ShardTake(shard_id, taken)
            part.drained = not taken.more and (not taken or (self._sel is None and len(taken) < left))
            if part.drained:
                part.watch_key = self._watch_key(shard_id)
            rnd.parts.append(part)
            left -= len(taken)
        return left

    @staticmethod
    def _watch_drained(tr, rnd: LeaseRound):
        """Watch the round's drained shards in its own transaction (``_lease_many``)."""
        for part in rnd.parts:
            if part.watch_key is not None:
                part.watch = tr.watch(part.watch_key)

    def _round_committed(self, rnd: LeaseRound):
        """After a round's commit: its watches kept, the shards it did not drain visited
        again next round, the next round started after the last shard this one reached,
        and ownership re-read if a shard was no longer ours."""
        if rnd.parts:
            self._rr_after = rnd.parts[-1].shard_id
        for part in rnd.parts:
            if part.watch is not None:
                self._keep_watch(part.shard_id, part.watch)
        again = [part.shard_id for part in rnd.parts if not part.drained] + rnd.unreached
        if again:
            self._mark(*again)
        if rnd.lost:
            self._refresh_owned()

    def _settle_outcome(self, settled, error):
        """``_lease_many``'s carried settlements committed: ``settled(error)``, or
        ``error`` (a LeaseLost) reported."""
        if settled is not None:
            settled(error)
        elif error is not None:
            self._report(error)

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
        """Until a shard is marked (``_mark``), the consumer closes, or ``timeout``."""
        if not self._stop.is_set() and self._wake.wait(timeout):
            self._wake.clear()

    def fetch(self, max_messages: int = 100, timeout: float = 1.0, *, ack_wait_s: float | None = None) -> list:
        """Lease up to ``max_messages`` messages, waiting up to ``timeout`` seconds for
        the first. Settle each with ack/nak/term; unsettled ones are redelivered after
        ``ack_wait_s`` (this fetch's lease length; default the consumer config's).

        Settlements queued with ``settle_soon`` commit in its lease transactions.

        ``close()`` from another thread ends a waiting fetch at once (``[]``) and waits
        for one in the middle of a lease, so it returns that lease too; a fetch after
        ``close()`` returns ``[]`` without leasing."""
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
            raise ConfigError(f"max_messages must be an integer >= 1, not {max_messages!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout:
            raise ConfigError(f"timeout must be a number of seconds, not {timeout!r:.80}")
        if ack_wait_s is not None:
            ConsumerConfig(ack_wait_s=ack_wait_s)   # validates
        msgs = self._fetch_tracked(max_messages, timeout, ack_wait_s, handed=True)
        if msgs and hooks.active:
            hooks.received(msgs)    # tracing: a receive span linked to each message's
        return msgs

    def _fetch_tracked(self, max_messages: int, timeout: float, ack_wait_s: float | None, handed: bool) -> list:
        """``_fetch``, known to ``close()`` (``_await_fetches``). ``handed``: as
        ``_lease_many``'s (False: the caller marks each message as it hands it over,
        ``_mark_handed``; those it never did are released at ``close()``)."""
        return self._tracked([], self._fetch, max_messages, timeout, ack_wait_s, handed)

    def _tracked(self, if_closed, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` (a lease), known to ``close()`` (``_await_fetches``):
        a close waits for it, so it returns those leases too; none begins once the
        consumer is closed (``if_closed`` is returned)."""
        me = threading.get_ident()
        with self._fetch_done:
            if self._closed:
                return if_closed
            self._fetching.append(me)
        try:
            return fn(*args, **kwargs)
        finally:
            with self._fetch_done:
                self._fetching.remove(me)
                self._fetch_done.notify_all()

    def messages(self, batch: int = 100, timeout: float | None = None):
        """Leased messages one at a time (a generator)::

            for m in consumer.messages():
                handle(m.body); m.ack()

        Leases up to ``batch`` at once; the ones waiting their turn are kept leased
        while the application works on those before them (touched every half ack wait,
        as a tail's round). Each message yielded is an attempt: settle it (``ack()``,
        ``nak()``, ``term()``; ``release()`` is refused: it was handed over); one left
        unsettled is redelivered after its ack wait, or nak'd at ``close()``. Ends when
        the consumer is closed, or after ``timeout`` seconds without a message (None:
        never). Leaving the loop early (``break``, an exception) gives the messages of
        the batch not yet yielded back at once, no attempt counted."""
        check_messages_args(batch, timeout)
        last = _monotonic()
        while not self._closed:
            wait = 1.0 if timeout is None else min(1.0, max(0.0, last + timeout - _monotonic()))
            msgs = self._fetch_tracked(batch, wait, None, handed=False)
            if msgs and hooks.active:
                hooks.received(msgs)
            if not msgs:
                if timeout is not None and _monotonic() - last >= timeout:
                    return
                continue
            last = _monotonic()
            rnd, given = self._begin_round([m for m in msgs if m._taken.lease_id is not None]), 0
            try:
                for m in msgs:
                    self._mark_handed(m)
                    given += 1
                    yield m
            finally:
                self._end_round(rnd)
                self._give_back(msgs[given:])
            last = _monotonic()

    def _give_back(self, msgs: list):
        """Release ``msgs`` (leased, never handed over); after ``close()`` it did."""
        msgs = [m for m in msgs if m._taken.lease_id is not None]     # not: taken (ack_policy none)
        if not msgs or self._closed:
            return
        try:
            self.release(msgs)
        except LeaseLost as e:
            self._report(e)

    def _fetch(self, max_messages: int, timeout: float, ack_wait_s: float | None, handed: bool = True) -> list:
        deadline = _monotonic() + max(0.0, timeout)
        while True:
            if self._stop.is_set():         # closing: lease nothing more
                return []
            shards = self._next_shards()
            soon = self._take_soon() if shards else []     # no lease to carry them: they linger
            try:
                out = self._lease_many(shards, max_messages, ack_wait_s, handed=handed,
                                       settlements=[s for items, _f in soon for s in items],
                                       settled=lambda e, soon=soon: _resolve_soon(soon, e))
            except BaseException as e:
                after_interrupt()
                self._mark(*(s for s, _e in shards))
                _resolve_soon(soon, e)
                raise
            left = deadline - _monotonic()
            if out or left <= 0 or self._stop.is_set():
                return out
            self._idle(min(left, self._idle_for()))

    def settle(self, items):
        """Commit settlements [:class:`~fdq.Settlement`] in one transaction. Raises
        LeaseLost naming the messages whose lease moved on (they will be redelivered)."""
        items = self._checked(items)
        if not items:
            return
        rows = _settle_rows(items)
        maybe_lost = []     # lost sets of attempts that may have committed

        def on_error(e, attempt):
            _note_maybe_lost(maybe_lost, e, attempt.result)

        lost = transact(self.db, lambda tr, _attempt: queue.settle(tr, self._ts, rows, self.config.max_deliver),
                        on_error=on_error)
        error = self._settled(items, lost, maybe_lost)
        if error is not None:
            raise error

    @staticmethod
    def _checked(items) -> list:
        """``items`` as a list of Settlement of leased messages, or ConfigError/FDQError."""
        items = list(items)
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
        return items

    def settle_soon(self, items, linger_s: float = SETTLE_LINGER_S) -> concurrent.futures.Future:
        """Commit settlements [:class:`~fdq.Settlement`] in the next lease transaction of
        a ``fetch`` on this consumer (one commit for both; a fetch waiting for messages
        carries them when its next lease runs), or alone once ``linger_s`` seconds passed
        without one. Returns at once a ``concurrent.futures.Future``: its result is None
        once they committed; its exception is what ``settle`` would have raised (LeaseLost
        naming those of ``items`` whose lease moved on, or the error that stopped the
        commit). For a server that fetches in a loop and settles what it delivered: one
        commit per round instead of two. After ``close()`` the future fails (the
        consumer's leases were returned)."""
        items = self._checked(items)
        if isinstance(linger_s, bool) or not isinstance(linger_s, (int, float)) or not 0 <= linger_s <= 60:
            raise ConfigError(f"linger_s must be a number of seconds from 0 to 60, not {linger_s!r:.80}")
        fut = concurrent.futures.Future()
        if not items:
            fut.set_result(None)
            return fut
        with self._soon_cond:
            if self._soon_stopped:
                fut.set_exception(FDQError(f"consumer {self.id} is closed: its leases were returned, "
                                           f"settle before close()"))
                return fut
            self._soon.append((items, fut))
            deadline = _monotonic() + linger_s
            if self._soon_deadline is None or deadline < self._soon_deadline:
                self._soon_deadline = deadline
                self._soon_cond.notify()
            if self._linger is None:
                self._linger = threading.Thread(target=self._commit_lingering, daemon=True,
                                                name=f"fdq-settle-soon-{self.id}")
                self._linger.start()
        return fut

    def _take_soon(self) -> list:
        """The ``settle_soon`` settlements waiting, taken for a commit: [(items, Future)]."""
        if not self._soon:
            return []
        with self._soon_cond:
            soon, self._soon, self._soon_deadline = self._soon, [], None
        return soon

    def _commit_lingering(self):
        """``settle_soon``'s thread: commits what no lease transaction carried within
        its linger; at ``close()``, what is left."""
        while True:
            with self._soon_cond:
                while not self._soon_stopped:
                    left = None if self._soon_deadline is None else self._soon_deadline - _monotonic()
                    if left is not None and left <= 0:
                        break
                    self._soon_cond.wait(left)
                stopping = self._soon_stopped
                soon, self._soon, self._soon_deadline = self._soon, [], None
            if soon:
                items = [s for its, _f in soon for s in its]
                try:
                    self.settle(items)
                except Exception as e:
                    _resolve_soon(soon, e)
                else:
                    _resolve_soon(soon, None)
            if stopping:
                return

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

    def release(self, messages):
        """Give ``messages`` back at once, in one transaction, without counting an
        attempt (``Message.release()`` of each): fetched messages the application never
        began on (a reader gone, a shutdown before their turn)."""
        self.settle([Settlement(m, RELEASE) for m in messages])

    # -- lifecycle -------------------------------------------------------------------

    def close(self):
        """Leave the subscription: shards go to the other consumers now; leases this
        consumer still holds are returned to their queues at once. A close under way in
        another thread is waited for: it returns once the consumer has left."""
        with self._close_lock:
            self._close()

    def _close(self):
        if self._closed:
            return
        with self._fetch_done:
            self._closed = True
        self._stop.set()
        self._wake.set()
        self._member.join(timeout=10)
        deadline = _monotonic() + _GOODBYE_MS / 1000
        self._await_fetches(deadline)
        self._settle_soon_now(deadline)
        self._settle_rounds(deadline)
        self._return_leases(deadline)
        for w in [*self._watches.values(), self._assign_watch]:
            if w is not None:
                w.cancel()
        try:
            run_within(self.db, _ms_until(deadline), subs.leave, self._ts, self.subscription, self.id,
                       self._incarnation)
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

    def _settle_soon_now(self, deadline):
        """Commit what waits for ``settle_soon``'s linger now (its thread does, then
        ends), so ``_return_leases`` does not return what was settled."""
        with self._soon_cond:
            self._soon_stopped = True
            self._soon_cond.notify()
            thread = self._linger
        if thread is not None:
            thread.join(max(0.0, deadline - _monotonic()))

    def _settle_rounds(self, deadline):
        """Commit what the rounds still in hand recorded (a handler still running when a
        tail's close stopped waiting: the acks of the messages its round finished, the
        releases of those it gave back), so ``_return_leases`` naks only what a handler
        still has. Taken from the round: its owner, ending it later, does not commit
        them again."""
        items = []
        for r in list(self._rounds.values()):
            taken = self._end_round(r)
            del r[:len(taken)]
            items += taken
        if not items:
            return
        try:
            lost = run_within(self.db, _ms_until(deadline), queue.settle, self._ts, _settle_rows(items),
                              self.config.max_deliver)
            error = self._settled(items, lost, [])
            if error is not None:
                self._report(error)
        except FDQError as e:
            self._report(e)

    def _mark_handed(self, m):
        """``m`` goes to a handler (a tail's round): from now on it is an attempt, nak'd if
        the consumer closes with it unsettled (``_return_leases``), never released."""
        m._handed = True
        with self._leases_lock:
            lease = self._leases.get(((m.tag, m.shard), m._taken.vs.to_bytes()))
            if lease is not None:
                lease[5] = True

    def _return_leases(self, deadline):
        """Give back what this consumer leased and did not settle: a message ``fetch``
        handed to the application is nak'd (delay 0; it was an attempt, dead-lettered if it
        was the last, ``max_deliver``), one never handed over (a tail's round cut short)
        is released (no attempt counted). Only its own leases (its lease-id prefix):
        ``_leases`` also holds what its lease check observes of other consumers' leases in
        its shards (a live previous owner's, still being worked on), and returning those
        would redeliver them before their ack wait."""
        with self._leases_lock:
            mine = [(k, v) for k, v in self._leases.items() if v[0] is not None and v[0][:8] == self._lease_prefix]
        rows = []
        for (shard_id, vs12), (lease_id, _t, _s, _w, key, handed) in mine:
            rows.append(SettleRow(self._ts.shard(self.subscription, *shard_id), vs_from_bytes(vs12), lease_id, key,
                                  NAK if handed else RELEASE, 0, "not settled (consumer closed)"))
        if rows:
            try:
                run_within(self.db, _ms_until(deadline), queue.settle, self._ts, rows, self.config.max_deliver)
            except FDQError as e:
                self._report(e)

    def shutdown(self):
        """Same as ``close()`` (a method, so subclasses' ``close`` is the one called)."""
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["Consumer", "AT_MOST_ONCE", "AT_LEAST_ONCE", "EXACTLY_ONCE"]
