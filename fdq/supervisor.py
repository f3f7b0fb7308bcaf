"""The supervisor: topics, pause / play, rebalance and reshard, stats, retention, replay.

A facade over the operations of ``fdq.ops``: each long operation (play, reshard,
replay, trim, catch-up, DLQ redrive/purge) is a loop here over an operation's chunks,
transactions of at most ``CHUNK`` messages (and ``CHUNK_WRITE_BYTES``) each, well under
FDB's 5 s and 10 MB, and resumable: each chunk removes what it has done, so a killed
run finishes when run again, with nothing lost or doubled.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time

from .config import (CHUNK, SubscriptionConfig, TopicConfig, check_name, check_replay_id, check_topic_options,
                     default_replay_id, shown)
from .engine import Again, Done, after_interrupt, transact
from .errors import ConfigError, MessageNotFound, TopicExists, TopicHeld
from .keyspace import Keyspace, TopicSpace, message_id, parse_message_id, version_of
from .log import body_of, iter_window, log_buckets
from .maintainer import retention_steps
from .ops.retention import read_version
from .member import Reaper
from .ops import dlq, membership, peek
from .ops.catchup import begin_reset, catch_up
from .ops.play import play_chunk, resharding
from .ops.push import PushItem, fits, message_bytes
from .ops.replay import (Replayed, replay_beat, replay_begin, replay_chunk,
                         replay_count, replay_done, replay_finish, replay_runs)
from .ops.reshard import (AREAS, Rebalanced, fold_shard_counters, queued_messages, reshard_begin, reshard_chunk,
                          reshard_finish)
from .ops.stats import topic_stats
from .ops.subscriptions import (create_subscription, delete_subscription, matcher, read_subscription,
                                set_subscription_paused, subscription_info, update_subscription)
from .ops.topics import (HOLD_WAIT_S, create_topic, delete_topic, list_topics, read_topic_config,
                         update_topic_config)
from .times import to_ms


class Supervisor:
    """Admin operations on topics.

    Example::

        s = fdq.Supervisor(db)
        s.create_topic("orders", shards=16)
        s.pause("orders"); s.play("orders")
        s.rebalance("orders", shards=32)
        print(s.stats("orders")["subscriptions"]["default"]["backlog"])
    """

    def __init__(self, db, *, keyspace: Keyspace | None = None):
        self.db = db
        self.keyspace = keyspace or Keyspace()

    def _ts(self, name: str) -> TopicSpace:
        return self.keyspace.topic(check_name(name))

    def config(self, name: str) -> TopicConfig:
        return read_topic_config(self.db, self._ts(name), snapshot=True)

    def create_topic(self, name: str, shards: int | None = None, **options) -> TopicConfig:
        """Create a topic (``shards`` defaults to 16). A no-op if it exists, unless
        ``shards`` is given and differs from its count: that is ``TopicExists`` (change
        a topic's shard count with ``rebalance``). ``options``: ``TopicConfig``'s, but
        not its state (``fdq.config.TOPIC_STATE``: the error names the operation)."""
        check_topic_options(name, options)
        config = TopicConfig(**options) if shards is None else TopicConfig(shards=shards, **options)
        result = create_topic(self.db, self.keyspace, check_name(name), config, strict_shards=shards is not None)
        if config.extend and not result.extend:    # never a silent no-op: say how to get it
            raise TopicExists(f"topic {name!r} already exists without extend support: "
                              "upgrade it with upgrade_extend (one-way)")
        return result

    def delete_topic(self, name: str):
        """Delete a topic: its config, consumers, queues, log and counters."""
        self.config(name)
        delete_topic(self.db, self._ts(name))

    def topics(self) -> list:
        """[(name, TopicConfig)] by name."""
        return list_topics(self.db, self.keyspace)

    def upgrade_extend(self, name: str) -> TopicConfig:
        """Give a topic extend support (headers, tag dispatch). One-way; messages
        already stored stay readable (a plain record is an extend record without
        headers). Consumers must then connect with ``extend_support=True``."""
        return update_topic_config(self.db, self._ts(name), extend=True)

    def update_topic(self, name: str, **changes) -> TopicConfig:
        """Change a topic's retention and limits (``fdq.config.UPDATABLE_TOPIC_FIELDS``;
        None clears an optional one), e.g. of a topic a push created with the defaults:
        pushes read them from their next transaction on, ``trim`` at its next run.
        Returns the new config."""
        check_topic_options(name, changes, update=True)
        return update_topic_config(self.db, self._ts(name), **changes)

    def pause(self, name: str) -> TopicConfig:
        """Stop routing and consumption: pushes still land in the "all" log."""
        return update_topic_config(self.db, self._ts(name), paused=True, held_at=None)   # (ends a play's hold)

    def play(self, name: str, progress=None) -> int:
        """Route what arrived while paused, in order, then resume. Resumable. Refused
        while a reshard is moving queues (run rebalance again to finish it); a reshard
        that begins meanwhile stops it with the same error (the topic stays paused)."""
        ts = self._ts(name)
        config = self.config(name)
        if resharding(config):
            raise ConfigError(f"topic {name!r} is being resharded to {config.resharding_to} shards: "
                              "finish that first (run rebalance again)")
        total = 0
        hold = None
        while True:
            n, done, hold = play_chunk(self.db, ts, CHUNK, hold)
            total += n
            if progress:
                progress(n)
            if done:     # resumed in the chunk that routed the last one: a pause since holds
                config = self.config(name)
                if resharding(config):
                    raise ConfigError(f"topic {name!r} began resharding to {config.resharding_to} shards "
                                      f"during play ({total:,} routed): it stays paused; finish the reshard "
                                      "(run rebalance again), then play")
                return total

    def rebalance(self, name: str, shards: int | None = None, progress=None) -> Rebalanced:
        """Re-divide shards among live consumers now; with ``shards=N`` change the shard
        count, re-routing every backlog with each shard key's order kept. Resumable.
        ``progress(n)``: n more queued messages handled (moved, or read where they stay;
        a message moved to a shard not yet processed is counted once): with nothing
        settled meanwhile they add up to ``Rebalanced.queued``. Returns ``Rebalanced``
        (the config once done, the count before, messages queued and moved)."""
        ts = self._ts(name)
        config = self.config(name)
        from_shards = config.shards
        if shards is None and config.resharding_to is not None:
            shards = config.resharding_to      # finish a reshard a killed run left
        if shards is None or (shards == config.shards and not resharding(config)):
            config = reshard_finish(self.db, ts)    # no-op unless paused while draining
            for sub in config.subs:
                membership.assign_shards(self.db, ts, sub)
            if not config.paused:
                self.play(name)   # a rerun after a reshard killed before its play
            return Rebalanced(self.config(name), from_shards)
        TopicConfig(shards=shards)   # validates
        if config.resharding_to is not None and not resharding(config):
            # the last reshard's drain, unfinished (killed): end it before this one
            if reshard_finish(self.db, ts).resharding_to is not None:
                self.play(name)
        config = reshard_begin(self.db, ts, shards)
        from_shards = config.shards
        queued = queued_messages(self.db, ts)
        old = max(config.shards, shards)
        tags = membership.read_tags(self.db, ts)
        moved = 0
        for sub in config.subs:
            for tag in tags:
                arrived = {}    # (area, n): messages moved into shard n, not processed yet
                for n in range(old):
                    for area in AREAS:
                        reread = arrived.pop((area, n), 0)
                        after = None
                        while True:
                            chunk = reshard_chunk(self.db, ts, sub, tag, n, area, shards, CHUNK, after)
                            after = chunk.last
                            went = sum(chunk.moves.values())
                            for m, k in chunk.moves.items():
                                if m > n:
                                    arrived[(area, m)] = arrived.get((area, m), 0) + k
                            again = min(reread, chunk.messages - went)   # read again where they stay
                            reread -= again
                            moved += went
                            if progress:
                                progress(chunk.messages - again)
                            if chunk.done:
                                break
                    if n >= shards:
                        fold_shard_counters(self.db, ts, sub, tag, n, shards)
        config = reshard_finish(self.db, ts, shards)
        if not config.paused:
            self.play(name)
        # as stored now (the play above ended resharding_to)
        return Rebalanced(self.config(name), from_shards, queued, moved)

    def stats(self, name: str) -> dict:
        """Counters, backlog per shard, in-flight, DLQ, consumers and lag; from counters
        and a few point reads (O(shards + consumers), never O(backlog)). A consumer's
        ``heartbeat_age_s`` is for display (``membership.heartbeat_age``: the database
        clock, then versions); liveness does not use it. Its ``zombie`` is that age past
        its ``zombie_after_s`` (None if either is unknown): a consumer that died (kill -9)
        stays registered, owning its shards, until a live peer of its subscription finds
        it a zombie, so with none running it is listed for good. A consumer on ``standby``
        owns no shard because every shard has a live owner (a subscription's ``standby``
        counts them): it takes one when one frees; more shards let more consumers work
        (``rebalance(name, shards=N)``)."""
        return topic_stats(self.db, self._ts(name), int(time.time() * 1000))

    def trim(self, name: str, *, before_ms: int | None = None, progress=None) -> int:
        """Apply retention to the "all" log: delete what was inserted before ``before_ms``
        (default: ``retention_s`` of the config), then, with ``retention_bytes``, the oldest
        entries (in log order) until the log's size (``TopicConfig``: its ``log_bytes``
        counter) is at most ``retention_bytes``; drop time index entries that point before
        the oldest entry left; and expire push markers and dedupe ids past their windows
        (``fdq.maintainer.retention_steps``: what the topic's consumers run continuously;
        with ``retention_messages``, the oldest entries past that count go too).
        Returns the log entries deleted. Queued messages are untouched, and so is every
        entry from the oldest one not routed yet (pushed while paused) on.

        By age, "inserted" is the producer's clock (a record's ``ts_ms``): an entry
        stamped at or after ``before_ms`` is kept, and the scan of its bucket goes on
        past it while entries were committed before ``before_ms`` by the database's
        versions (a producer clock running ahead), stopping at the first one committed
        since (an entry of a clock running behind is deleted by a later trim). Chunked
        and resumable: a trim killed mid-way leaves the counter equal to the log's size,
        and running it again finishes. ``before_ms``: epoch ms or a datetime; anything
        else is a ConfigError (a NaN, never compared as newer, deleted the whole log)."""
        before_ms = to_ms(before_ms)
        deleted = 0
        for n in retention_steps(self.db, self._ts(name), self.config(name), before_ms=before_ms):
            deleted += n
            if progress and n:
                progress(n)
        return deleted

    # -- subscriptions (fdq.ops.subscriptions, fdq.ops.catchup) ---------------------------

    def create_subscription(self, name: str, subscription: str, config=None, *, ephemeral: bool = False,
                            progress=None) -> dict:
        """Create a subscription of topic ``name`` (defaults when ``config`` is None) and
        copy its start point (``deliver_policy``) from the "all" log before returning;
        then its consumers deliver. Re-running with the same config is a no-op that
        finishes an interrupted catch-up; a different config is an error listing the
        differing fields. Returns ``subscription_info``."""
        ts = self._ts(name)
        check_name(subscription, "subscription")
        config = config if config is not None else SubscriptionConfig()
        if isinstance(config, dict):
            config = SubscriptionConfig.from_dict(config)
        if not isinstance(config, SubscriptionConfig):
            raise ConfigError(f"config must be a fdq.SubscriptionConfig, not {type(config).__name__}")
        if ephemeral and not config.ephemeral:
            config = dataclasses.replace(config, ephemeral=True)
        create_subscription(self.db, ts, subscription, config)
        catch_up(self.db, ts, subscription, progress=progress)
        return self.subscription(name, subscription)

    def delete_subscription(self, name: str, subscription: str):
        """Delete a subscription and all its state (queues, leases, DLQ, counters,
        consumers); nothing else. Its consumers get SubscriptionNotFound."""
        self.subscription(name, subscription)   # raises SubscriptionNotFound; checked apart so a
        delete_subscription(self.db, self._ts(name), subscription)  # retry after 1021 is no error

    def pause_subscription(self, name: str, subscription: str) -> bool:
        """Stop delivering to one subscription (pushes still fill its queues); the other
        subscriptions go on. Returns whether it was already paused."""
        return set_subscription_paused(self.db, self._ts(name), check_name(subscription, "subscription"), True)

    def play_subscription(self, name: str, subscription: str) -> bool:
        """Resume delivering to a paused subscription. Returns whether it was paused."""
        return set_subscription_paused(self.db, self._ts(name), check_name(subscription, "subscription"), False)

    def update_subscription(self, name: str, subscription: str, **changes):
        """Change updatable fields of a subscription (``fdq.config.UPDATABLE_SUBSCRIPTION_FIELDS``);
        its consumers apply them at their next heartbeat. Returns the new config."""
        return update_subscription(self.db, self._ts(name), subscription, **changes)

    def reset(self, name: str, subscription: str, to_time=None, progress=None) -> int:
        """Move a subscription's start to ``to_time`` (epoch ms or datetime; None: now),
        backwards (rewind: messages inserted since are delivered again) or forwards
        (skip). Its ready and delayed messages are replaced by the "all" log's messages
        inserted at ``to_time`` or later (within retention); leases and the DLQ are left
        alone. Messages pushed meanwhile are kept, exactly once. Returns messages copied."""
        ts = self._ts(name)
        begin_reset(self.db, ts, subscription, to_ms(to_time))
        return catch_up(self.db, ts, subscription, progress=progress)

    def subscription(self, name: str, subscription: str) -> dict:
        """{"name", "config", "ephemeral", "catching_up", "start_position"}."""
        return subscription_info(self.db, self._ts(name), subscription)

    def subscriptions(self, name: str) -> list:
        """``subscription`` of each of the topic's subscriptions, in creation order."""
        return [self.subscription(name, sub) for sub in self.config(name).subs]

    def reap(self, name: str, zombie_after_s: float = 3.0) -> dict:
        """Declare zombies the topic's consumers (of every subscription) whose heartbeat
        counter stays unchanged for ``zombie_after_s``, or a member's own longer timeout,
        watched on this host's monotonic clock (blocking that long): each is removed and
        its shards divided among its subscription's live consumers, as a live peer would
        (a consumer killed with none left to notice stays registered, owning its shards,
        until this runs). An ephemeral subscription left without consumers is deleted.
        Returns ``{"zombies": [{"subscription", "id"}], "deleted_subscriptions": [...]}``."""
        reaper = Reaper(zombie_after_s, every_subscription=True)
        ts = self._ts(name)
        reaper.observe(self.db, ts, self.config(name), time.monotonic())
        deadline = time.monotonic() + reaper.longest_timeout_s
        while time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        deleted = reaper.observe(self.db, ts, self.config(name), time.monotonic())
        return {"zombies": [{"subscription": sub, "id": cid} for sub, cid in reaper.declared],
                "deleted_subscriptions": deleted}

    PEEK_MAX = 10_000
    PEEK_STATES = peek.STATES

    def peek(self, name: str, subscription: str = "default", *, states=peek.STATES, limit: int = 20,
             from_time=None) -> list:
        """Look at a subscription's messages without consuming them: the first ``limit``
        (1 to ``PEEK_MAX``) of those in ``states`` (of ``PEEK_STATES``: "ready",
        "delayed", "in_flight", "dead"), by id (push order). Reads only, at one read
        version (snapshot reads: no write, no conflict with consumers or producers); up
        to ``limit`` entries read per shard and state. Each a dict: ``id``, ``state``,
        ``shard`` and ``tag`` (None for a dead letter), ``attempts`` (an in-flight one's
        counts its current delivery), ``insertion_time`` (epoch ms), ``shard_key``,
        ``msg_id``, ``headers``, ``body``, ``replay_of``, ``raw`` (True: a stored record
        that does not decode, its bytes as ``body``); delayed: ``due_in_s`` (by the
        database clock; ``due_ms`` that clock's reading); in flight: ``leased_by`` (the
        consumer holding it) and ``ack_wait_s`` (its lease runs for that since the last
        delivery or touch, timed by the shard owner's clock: the database keeps no
        expiry time); dead: ``reason``, ``consumer``, ``dead_age_s``. Keys that do not
        apply are None. ``from_time`` (epoch ms or a datetime, naive = UTC): only
        messages inserted then or later. Delayed messages are read by due time: per
        shard, the ``limit`` due soonest."""
        states = self._states(states)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= self.PEEK_MAX:
            raise ConfigError(f"limit must be an integer from 1 to {self.PEEK_MAX:,}, not {shown(limit)}")
        ts = self._ts(name)
        self.subscription(name, subscription)      # TopicNotFound, SubscriptionNotFound
        return [_peeked(e) for e in peek.peek(self.db, ts, subscription, states, limit, to_ms(from_time))]

    def _states(self, states) -> tuple:
        if isinstance(states, str):
            states = (states,)
        states = tuple(states)
        bad = [s for s in states if s not in peek.STATES]
        if bad or not states:
            raise ConfigError(f"states must be some of {', '.join(peek.STATES)}, not {shown(list(states))}")
        return states

    def get(self, name: str, id: str) -> dict:
        """Message ``id`` (a message id as ``push`` returns it): ``{"id", "topic", "log",
        "pending", "subscriptions"}``. ``log``: its entry in the topic's log (``bucket``,
        ``insertion_time``, ``shard_key``, ``msg_id``, ``headers``, ``body``,
        ``replay_of``, ``raw``), None once trimmed; ``pending``: pushed while the topic
        was paused, not yet routed. ``subscriptions`` {name: {"state", "places"}}:
        ``state`` one of "ready", "delayed", "in_flight", "dead" (where it is: ``places``
        are ``peek``'s dicts, one but for a copy being moved), else "pending", "catching_up"
        (not queued there yet) or "done" (acked, taken, filtered, expired, or older than
        the subscription). Found without scanning a backlog: point reads at its shard and
        dead-letter keys, its shard's lease records and at most ``DELAYED_SCAN`` entries
        of its shard's delayed area (a subscription whose area is larger is listed in
        ``delayed_unsearched``: it may be there, shown "done"); a trimmed message is
        looked for in every shard. One read-only transaction of snapshot reads.
        ``MessageNotFound`` if there is no trace of it."""
        try:
            vs = parse_message_id(id)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        ts = self._ts(name)
        self.config(name)                           # TopicNotFound
        got = peek.get(self.db, ts, vs)
        subs = {}
        for sub, info in got["subscriptions"].items():
            places = [_peeked(e) for e in info["places"]]
            state = (places[0]["state"] if places else "pending" if got["pending"]
                     else "catching_up" if info["catching_up"] else "done")
            subs[sub] = {"state": state, "places": places}
        log = None
        if got["log"] is not None:
            bucket, rec, raw = got["log"]
            log = {"bucket": bucket, "insertion_time": None if raw else rec.ts_ms, "shard_key": rec.shard_key,
                   "msg_id": rec.msg_id, "headers": rec.headers, "body": rec.body, "replay_of": rec.replay_of,
                   "raw": raw}
        if log is None and not got["pending"] and not any(s["places"] for s in subs.values()):
            raise MessageNotFound(f"message {id} of topic {name!r} not found: not in its log (trimmed, or "
                                  f"never pushed) nor queued or dead-lettered in any subscription")
        return {"id": message_id(vs), "topic": name, "log": log, "pending": got["pending"], "subscriptions": subs,
                "delayed_unsearched": got["delayed_unsearched"]}

    DLQ_LIST_MAX = 100_000

    def dlq_list(self, name: str, subscription: str = "default", limit: int = 100) -> list:
        """The subscription's first ``limit`` dead letters (oldest first), read in one
        transaction (FDB's 5 s): ``limit`` is an integer from 1 to ``DLQ_LIST_MAX``. A
        dead letter whose stored record did not decode has ``raw`` True: ``body`` is the
        bytes as stored (no insertion time, attempts or shard key; it cannot be redriven)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= self.DLQ_LIST_MAX:
            raise ConfigError(f"limit must be an integer from 1 to {self.DLQ_LIST_MAX:,} (dead letters listed "
                              f"in one transaction), not {shown(limit)}")
        ts = self._ts(name)
        self.subscription(name, subscription)      # TopicNotFound, SubscriptionNotFound
        return [{"id": message_id(vs), "reason": reason, "consumer": cid, "attempts": rec.attempts,
                 "shard_key": rec.shard_key, "insertion_time": rec.ts_ms, "body": rec.body, "raw": raw,
                 "dead_age_s": age}
                for vs, rec, reason, cid, _k, raw, age in dlq.dlq_list(self.db, ts, subscription, limit)]

    def dlq_redrive(self, name: str, subscription: str = "default", progress=None, *,
                    older_than_s: float | None = None) -> int:
        """Move the subscription's dead letters back to their shards' ready queues
        (attempts reset), in chunks; resumable. A dead letter whose message is queued
        already (a ``reset`` rewound over it) leaves the DLQ without a second copy: the
        queued one delivers it. ``older_than_s``: only those dead-lettered at least that
        many seconds ago (``dlq_list``'s ``dead_age_s``; the whole DLQ is read, in
        chunks: dead letters are kept in message order, not by age). Returns the dead
        letters moved."""
        ts = self._ts(name)
        self.subscription(name, subscription)
        if older_than_s is not None:
            return self._dlq_older(ts, subscription, _seconds(older_than_s), progress,
                                   lambda vss: self._redrive_vss(ts, subscription, vss, older_than_s))
        total = 0
        while True:
            n, done = dlq.dlq_redrive_chunk(self.db, ts, subscription, CHUNK)
            total += n
            if progress:
                progress(n)
            if done:
                return total

    def dlq_purge(self, name: str, subscription: str = "default", *, older_than_s: float | None = None) -> int:
        """Delete the subscription's dead letters (``older_than_s``: only those
        dead-lettered at least that many seconds ago, as ``dlq_redrive``). Returns how
        many."""
        ts = self._ts(name)
        self.subscription(name, subscription)
        if older_than_s is not None:
            return self._dlq_older(ts, subscription, _seconds(older_than_s), None,
                                   lambda vss: dlq.dlq_purge_ids(self.db, ts, subscription, vss, older_than_s))
        total = 0
        while True:
            n = dlq.dlq_purge_chunk(self.db, ts, subscription, CHUNK)
            total += n
            if n < CHUNK:
                return total

    def dlq_redrive_ids(self, name: str, subscription: str, ids) -> int:
        """Move the dead letters of ``ids`` (``dlq_list``'s ``id``) back to their shards'
        ready queues, attempts reset, as ``dlq_redrive`` moves all of them; an id no
        longer in the DLQ (redriven or purged meanwhile) is skipped. In chunks of at most
        ``CHUNK`` ids (and ``CHUNK_WRITE_BYTES``). Returns the dead letters moved; an id
        that is not a message id is a ``ConfigError``, nothing moved."""
        ts, vss = self._dlq_ids(name, subscription, ids)
        return self._redrive_vss(ts, subscription, vss)

    def _redrive_vss(self, ts: TopicSpace, subscription: str, vss: list, older_than_s: float | None = None) -> int:
        total = 0
        while vss:
            moved, looked = dlq.dlq_redrive_ids(self.db, ts, subscription, vss[:CHUNK], older_than_s)
            total += moved
            vss = vss[looked:]
        return total

    def _dlq_older(self, ts: TopicSpace, subscription: str, older_than_s: float, progress, act) -> int:
        """``act(vss)`` on the dead letters at least ``older_than_s`` old, chunk by chunk
        (``dlq.dlq_older``); its total."""
        total, after = 0, None
        while True:
            vss, after = dlq.dlq_older(self.db, ts, subscription, older_than_s, CHUNK, after)
            n = act(vss) if vss else 0
            total += n
            if progress:
                progress(n)
            if after is None:
                return total

    def dlq_purge_ids(self, name: str, subscription: str, ids) -> int:
        """Delete the dead letters of ``ids`` (``dlq_list``'s ``id``), skipping those no
        longer in the DLQ, ``CHUNK`` per transaction. Returns how many were deleted; an
        id that is not a message id is a ``ConfigError``, nothing deleted."""
        ts, vss = self._dlq_ids(name, subscription, ids)
        total = 0
        for i in range(0, len(vss), CHUNK):
            total += dlq.dlq_purge_ids(self.db, ts, subscription, vss[i:i + CHUNK])
        return total

    def _dlq_ids(self, name: str, subscription: str, ids) -> tuple:
        if isinstance(ids, (str, bytes)):
            raise ConfigError(f"ids must be a list of message ids, not one {type(ids).__name__}")
        vss, seen = [], set()
        for mid in ids:
            try:
                vs = parse_message_id(mid)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if vs.to_bytes() not in seen:        # each once, in the order given
                seen.add(vs.to_bytes())
                vss.append(vs)
        ts = self._ts(name)
        self.subscription(name, subscription)      # TopicNotFound, SubscriptionNotFound
        return ts, vss

    def replay(self, name: str, start, end=None, *, replay_id: str | None = None, again: bool = False,
               include_replays: bool = False, dry_run: bool = False, progress=None):
        """Push again the "all" log's messages inserted in ``[start, end)`` (epoch ms or
        datetimes, naive = UTC; ``end=None``: up to when the replay begins), as
        ``Producer.replay`` does, with its options: ``replay_id`` names the replay
        (default: its window, ``"<start_ms>:<end_ms>"`` or ``"<start_ms>:open"``); a replay
        that finished before does nothing (``Replayed.finished`` says when, and how many it
        replayed) unless ``again``; an interrupted one is resumed. Copies pushed by earlier
        replays are left out (counted in ``skipped_replays``) unless ``include_replays``.
        Returns a ``Replayed``; ``dry_run``: changes nothing and returns what it would do
        (``fdq.supervisor.replay_plan``'s dict)."""
        if dry_run:
            return replay_plan(self.db, self.keyspace, name, to_ms(start), to_ms(end), replay_id=replay_id,
                               again=again, include_replays=include_replays)
        return run_replay(self.db, self.keyspace, name, to_ms(start), to_ms(end), progress, replay_id=replay_id,
                          again=again, include_replays=include_replays)

    def consumers(self, name: str) -> list:
        st = self.stats(name)
        return [dict(c, subscription=sub) for sub, s in st["subscriptions"].items() for c in s["consumers"]]


def _seconds(s) -> float:
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < float("inf"):
        raise ConfigError(f"older_than_s must be a finite number of seconds >= 0, not {shown(s)}")
    return float(s)


def _peeked(e: dict) -> dict:
    """A ``peek.peek`` / ``peek.get`` entry as ``Supervisor.peek`` returns it."""
    return {"id": message_id(e["vs"]), "state": e["state"], "shard": e["shard"], "tag": e["tag"],
            "attempts": e["attempts"], "insertion_time": e["inserted_ms"], "shard_key": e["shard_key"],
            "msg_id": e["msg_id"], "headers": e["headers"], "body": e["body"], "replay_of": e["replay_of"],
            "raw": e["raw"], "due_ms": e.get("due_ms"), "due_in_s": e.get("due_in_s"),
            "leased_by": e.get("leased_by"), "ack_wait_s": e.get("ack_wait_s"), "reason": e.get("reason"),
            "consumer": e.get("consumer"), "dead_age_s": e.get("dead_age_s")}


REPLAY_HEARTBEAT_S = 0.5   # a running replay bumps its heartbeat counter this often
REPLAY_ORPHAN_S = 3.0      # a replay whose heartbeat stays unchanged this long was killed


def replay_window(db, ks: Keyspace, topic: str, start_ms, end_ms, progress=None, *, replay_id: str | None = None,
                  again: bool = False, include_replays: bool = False) -> int:
    """``run_replay``; returns how many this call pushed (``Producer.replay``)."""
    return run_replay(db, ks, topic, start_ms, end_ms, progress, replay_id=replay_id, again=again,
                      include_replays=include_replays).replayed


def _replay_window(ks: Keyspace, topic: str, start_ms, end_ms, replay_id):
    start_ms, end_ms = to_ms(start_ms, refuse_seconds=False), to_ms(end_ms, refuse_seconds=False)
    if start_ms is not None and end_ms is not None and end_ms < start_ms:
        raise ConfigError(f"replay window ends ({end_ms}) before it starts ({start_ms})")
    replay_id = check_replay_id(default_replay_id(start_ms, end_ms) if replay_id is None else replay_id)
    return ks.topic(check_name(topic)), start_ms, end_ms, replay_id


def run_replay(db, ks: Keyspace, topic: str, start_ms, end_ms, progress=None, *, replay_id: str | None = None,
               again: bool = False, include_replays: bool = False) -> Replayed:
    """Push again every logged message inserted in ``[start_ms, end_ms)`` and committed
    before the replay began, in log order, ``CHUNK`` per transaction at most, once per
    replay id (``ops.replay``): copies pushed by earlier replays (``replay_of`` set) are
    left out unless ``include_replays`` (so replaying a window twice never replays its
    own copies); a replay that has finished before does nothing (``Replayed.finished``)
    unless ``again``.

    Each call is a *run* with its own progress record (``ops.replay.replay_begin``) and a
    heartbeat (a counter a thread bumps every ``REPLAY_HEARTBEAT_S``); each chunk pushes
    and advances the run's progress in one transaction (``ops.replay.replay_chunk``),
    fenced by the run's owner, so a retry after ``commit_unknown_result`` pushes nothing
    twice. Resumable: a call that finds a run of the same replay whose heartbeat stays
    unchanged for ``REPLAY_ORPHAN_S`` on its own monotonic clock (killed) takes it over
    and finishes what it left; a run that is alive is left alone, and this call replays
    the window on its own (so two calls at once replay it twice). A finished run removes
    its progress and records the replay's finish."""
    ts, start_ms, end_ms, window = _replay_window(ks, topic, start_ms, end_ms, replay_id)
    read_topic_config(db, ts, snapshot=True)     # TopicNotFound for an unknown topic
    owner = os.urandom(8).hex()
    run, state = None, None
    for orphan in _orphaned_runs(db, ts, window):
        got = replay_begin(db, ts, window, owner, start_ms, end_ms, claim=orphan)
        if got is not None:
            run, state = got
            break
    if run is None:
        run, state = replay_begin(db, ts, window, owner, start_ms, end_ms, again=again)
        if run is None:
            return Replayed(window, 0, finished=state)
    stop = threading.Event()
    beat = threading.Thread(target=_replay_heartbeat, args=(db, ts, window, run, stop),
                            name=f"fdq-replay-{run}", daemon=True)
    beat.start()
    skipped = 0
    try:
        after = state["after"]
        time_index = {}
        batch, first, count, size = [], state["count"], state["count"], 0

        def flush():
            nonlocal count, size
            while batch:
                try:
                    # the progress's count, not what the last attempt pushed: an attempt that
                    # committed and reported commit_unknown_result leaves its retry nothing to do
                    now, taken = _replay_chunk(db, ks, ts, (window, run, owner), batch, time_index)
                    if progress:
                        progress(now - count)
                    count = now
                except BaseException:
                    # Interrupted (Ctrl-C lands right after a commit as easily as anywhere)
                    # or failed: the chunk may have committed; progress hears what did.
                    after_interrupt()
                    now = _committed_count(db, ts, window, run, owner)
                    if progress and now is not None and now > count:
                        progress(now - count)
                    raise
                del batch[:taken]
            size = 0
        for vs, _b, rec in iter_window(db, ts, log_buckets(db, ts), start_ms, end_ms):
            if version_of(vs) > state["stop"]:
                break       # committed after the replay began (its own pushes among them)
            if after is not None and vs.to_bytes() <= after:
                continue    # replayed by an earlier run of this replay
            if rec.replay_of is not None and not include_replays:
                skipped += 1
                continue    # an earlier replay's copy
            body = body_of(db, ts, vs, rec, strict=True)
            if body is None:
                continue    # trimmed since read: no longer in the log, not replayed
            item = PushItem(body, rec.shard_key, rec.headers, replay_of=message_id(vs), due_at=rec.due)
            batch.append((vs, item))
            size += message_bytes(item)
            # the chunk takes what fits by the sizing rule: more than its bodies alone cannot
            if len(batch) >= CHUNK or not fits(0, size):
                flush()
        flush()
        stop.set()
        beat.join()     # no beat after the finish (it would leave its key behind)
        replay_finish(db, ts, window, run, owner, int(time.time() * 1000))
    finally:
        stop.set()
        beat.join()
    return Replayed(window, count - first, skipped)


def replay_plan(db, ks: Keyspace, topic: str, start_ms, end_ms, *, replay_id: str | None = None,
                again: bool = False, include_replays: bool = False) -> dict:
    """What ``run_replay`` with these arguments would push, read-only (snapshot reads;
    nothing written): {"replay_id", "window_ms": [start, end], "finished" (the done
    record, if it finished before: nothing would be pushed without ``again``),
    "messages", "bytes" (bodies), "skipped_replays", "trimmed", "resumes" (runs of it
    left unfinished: a real run would take one over and push only what it left),
    "subscriptions": {name: how many its filter would let through}}. A message pushed
    meanwhile may change the figures."""
    ts, start_ms, end_ms, window = _replay_window(ks, topic, start_ms, end_ms, replay_id)
    config = read_topic_config(db, ts, snapshot=True)
    matchers = {sub: matcher(read_subscription(db, ts, sub, snapshot=True, topic_config=config))
                for sub in config.subs}
    finished = replay_done(db, ts, window)
    out = {"replay_id": window, "window_ms": [start_ms, end_ms], "finished": finished, "messages": 0,
           "bytes": 0, "skipped_replays": 0, "trimmed": 0, "resumes": len(replay_runs(db, ts, window)),
           "subscriptions": {sub: 0 for sub in config.subs}}
    if finished is not None and not again:
        return out
    stop = read_version(db)
    for vs, _b, rec in iter_window(db, ts, log_buckets(db, ts), start_ms, end_ms):
        if version_of(vs) > stop:
            break
        if rec.replay_of is not None and not include_replays:
            out["skipped_replays"] += 1
            continue
        body = body_of(db, ts, vs, rec, strict=True)
        if body is None:
            out["trimmed"] += 1
            continue
        out["messages"] += 1
        out["bytes"] += len(body)
        for sub, match in matchers.items():
            if match is None or match(rec):
                out["subscriptions"][sub] += 1
    return out


def _replay_chunk(db, ks: Keyspace, ts: TopicSpace, run: tuple, batch: list, time_index: dict) -> tuple:
    """``ops.replay.replay_chunk`` in its own transaction (retried, and after a play's
    hold: ``TopicHeld``, nothing written), with its push's id and time chosen once."""
    txid, now_ms = os.urandom(16), int(time.time() * 1000)

    def on_error(e, _attempt):
        if isinstance(e, TopicHeld):        # a play finishing (~ms; lapses by itself)
            time.sleep(HOLD_WAIT_S)
            return Again()
        return None
    return transact(db, lambda tr, _attempt: replay_chunk(tr, ks, ts, run, batch, txid, now_ms, time_index),
                    on_error=on_error)


def _replay_heartbeat(db, ts: TopicSpace, window: str, run: str, stop):
    while not stop.wait(REPLAY_HEARTBEAT_S):
        try:
            replay_beat(db, ts, window, run)
        except Exception:       # a database hiccup: the next beat tries again
            pass


def _orphaned_runs(db, ts: TopicSpace, window: str) -> list:
    """[(run, owner, heartbeat)] of the runs of ``window`` whose owner and heartbeat stay
    unchanged for ``REPLAY_ORPHAN_S`` (their callers were killed), oldest watched first;
    returns at once when there are none or all are alive."""
    seen = replay_runs(db, ts, window)
    deadline = time.monotonic() + REPLAY_ORPHAN_S
    while seen and time.monotonic() < deadline:
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        now = replay_runs(db, ts, window)
        seen = {run: v for run, v in seen.items() if now.get(run) == v}
    return [(run, *v) for run, v in seen.items()]


def _committed_count(db, ts: TopicSpace, window: str, run: str, owner: str) -> int | None:
    """How many run ``run`` has pushed by its progress record (None if it is not
    ``owner``'s any more, or cannot be read now): what an interrupted replay reports.
    One attempt: an error is not worth a retry here (it is the interrupt's report)."""
    return transact(db, lambda tr, _attempt: replay_count(tr, ts, window, run, owner),
                    on_error=lambda _e, _attempt: Done(None))


__all__ = ["Supervisor", "replay_window", "run_replay", "replay_plan"]
