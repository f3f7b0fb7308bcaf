"""A consumer's life as a member of its subscription, on this host's monotonic clock.

:class:`Member` runs two threads per consumer: the membership loop and a stall watch.
Every heartbeat interval the loop bumps the consumer's heartbeat counter (joining again
if its record vanished), times its peers' counters (one unchanged for the zombie timeout
is declared a zombie: its shards move), re-reads the topic config and the subscription's
(updates apply at once), gives new dispatch tags' shards owners, refreshes the shards it
owns, and helps a catch-up left unfinished. A third thread ticks the topic's maintenance
(``fdq.maintainer``: retention, one process per topic) unless
``ConsumerConfig(maintenance=False)``. Every lease check interval it advances the
topic's clock, keeps long rounds leased (``message._Round``) and expires leases seen
unchanged for their ack wait. The stall watch reports ``ConsumerStalled`` when no
heartbeat round has reached the database, or no shard has been owned, for over three
heartbeats: the loop may be stuck in a database call.
"""
from __future__ import annotations

import logging
import threading
import time

from .config import CHUNK, ConsumerConfig
from .errors import ConsumerStalled, LeaseLost, SubscriptionNotFound
from .keyspace import TopicSpace
from .maintainer import Maintainer
from .ops import catchup, clock, membership, queue
from .ops import subscriptions as subs
from .ops.topics import read_topic_config

log = logging.getLogger("fdq.consumer")
_monotonic = time.monotonic  # liveness and lease expiry: this host's monotonic clock only

# A lease check reads this many shards' lease records per transaction: one transaction
# per shard cost 16 every check interval; all of a consumer's shards in one could
# outlast FDB's 5 s with large backlogs in flight.
LEASE_SCAN_SHARDS = 4
# Heartbeats a subscription may stay catching up (its delivery stopped) before its live
# consumers finish the catch-up themselves (``Member.help_catch_up``).
CATCH_UP_HELP_AFTER = 3


def _peer_timeout(config: ConsumerConfig, record: dict) -> float:
    """How long a peer's heartbeat may stay unchanged before it is a zombie: its own
    timeout (it heartbeats at its own interval) or ours, whichever is longer."""
    theirs = record.get("zombie_after_s")
    return max(config.zombie_after_s, theirs) if isinstance(theirs, (int, float)) else config.zombie_after_s


class Member:
    """The membership of ``consumer`` (see the module): its threads and what they time."""

    def __init__(self, consumer):
        self.consumer = consumer
        self.peers = {}                 # consumer id -> (heartbeat, since)
        self.last_hb = 0.0
        self.last_lease_check = 0.0
        self.stalled_since = None
        self.hb_ok = _monotonic()       # last heartbeat round that reached the database
        self.last_error = None
        self.noshard_since = None
        self.stall_reported = False
        self.standby = False            # owns no shard: every shard has a live owner (``observe_standby``)
        self.reaper = Reaper(consumer.config.zombie_after_s)
        self.catching_up_since = None   # when this consumer first saw its subscription catching up
        self.catch_up_helper = None
        self.clock_base = None          # (topic clock ms, this host's monotonic s) last seen
        self.reassigned = threading.Event()  # the assignment watch fired (``Consumer._assignment_changed``)
        self.thread = None
        self.watchdog = None
        self.maintainer = None          # the topic's maintenance (``_maintain``)
        self.maintenance = None

    def start(self):
        """Advance the topic's clock once, then start the loop and the stall watch."""
        c = self.consumer
        self.tick_clock(_monotonic())
        self.thread = threading.Thread(target=self._loop, name=f"fdq-member-{c.id}", daemon=True)
        self.thread.start()
        self.watchdog = threading.Thread(target=self._stall_watch, name=f"fdq-watchdog-{c.id}", daemon=True)
        self.watchdog.start()
        if c.config.maintenance:
            self.maintainer = Maintainer(c.db, c.keyspace, c._ts, c.id, c.config.zombie_after_s)
            self.maintenance = threading.Thread(target=self._maintain, name=f"fdq-maintain-{c.id}", daemon=True)
            self.maintenance.start()

    def join(self, timeout: float):
        """Wait for the loop (and the maintenance) to end (after the consumer's ``_stop``
        is set)."""
        deadline = _monotonic() + timeout       # one bound for both: they stop together
        for t in (self.thread, self.maintenance):
            if t is not None:
                t.join(timeout=max(0.0, deadline - _monotonic()))

    def _maintain(self):
        """Tick the topic's maintenance (a thread of its own: a pass never holds up a
        heartbeat); give its role up at a clean stop."""
        c, m = self.consumer, self.maintainer
        try:
            while not c._stop.wait(m.tick_interval_s):
                try:
                    m.tick(_monotonic(), c._stop)
                except Exception as e:      # the next tick tries again
                    log.warning("consumer %s: maintenance of %s: %s: %s", c.id, c.topic, type(e).__name__, e)
        finally:
            try:
                m.release()
            except Exception as e:          # its beat stands still: another takes over
                log.warning("consumer %s: releasing the maintenance of %s: %s", c.id, c.topic, e)

    @property
    def stalled_s(self) -> float:
        """Seconds the loop has been unable to reach the database (0 if fine)."""
        return 0.0 if self.stalled_since is None else _monotonic() - self.stalled_since

    def _loop(self):
        c = self.consumer
        cfg = c.config
        tick = min(cfg.heartbeat_interval_s, cfg.lease_check_interval_s) / 2
        while not c._stop.wait(tick):
            try:
                now = _monotonic()
                if self.reassigned.is_set():
                    self.reassigned.clear()
                    c._refresh_owned()
                if now - self.last_hb >= cfg.heartbeat_interval_s:
                    self.last_hb = now
                    if c._replaced:
                        continue
                    if not membership.heartbeat(c.db, c._ts, c.subscription, c.id, c._incarnation):
                        if membership.replaced(c.db, c._ts, c.subscription, c.id, c._incarnation):
                            c._refresh_owned()   # owns nothing, reports it once
                            continue
                        c._rejoin()
                    members = self.observe_peers(now)
                    c._topic_config = read_topic_config(c.db, c._ts, snapshot=True)
                    self.help_catch_up(now)
                    membership.assign_new_tags(c.db, c._ts, c.subscription)  # new tags
                    c._refresh_owned()
                    self.observe_standby(members)
                    self.observe_subscriptions(now)
                    self.hb_ok = _monotonic()
                    self.last_error = None     # what the stall alarm names: since the last heartbeat
                if now - self.last_lease_check >= cfg.lease_check_interval_s:
                    self.last_lease_check = now
                    self.tick_clock(now)
                    # Rounds in hand first: a check run late (a loaded host) would expire
                    # the leases a keep is about to touch.
                    for r in list(c._rounds.values()):
                        r.keep(now)
                    self.check_leases(now)
                self.stalled_since = None
            except Exception as e:  # keep heartbeating through transient trouble
                c._report(e)
                self.last_error = e
                if self.stalled_since is None:
                    self.stalled_since = _monotonic()

    def help_catch_up(self, now: float):
        """A start point left unfinished (a ``reset`` or ``create_subscription`` killed
        midway) stops the subscription's delivery until someone finishes it: after
        ``CATCH_UP_HELP_AFTER`` heartbeats, live consumers do (``catch_up_chunk`` is
        resumable and safe to run from several processes), in a thread of their own so
        heartbeats go on."""
        c = self.consumer
        config = c._topic_config
        if c.subscription not in config.catchup or not config.routing:
            self.catching_up_since = None
            return
        if self.catching_up_since is None:
            self.catching_up_since = now
        if now - self.catching_up_since < CATCH_UP_HELP_AFTER * c.config.heartbeat_interval_s:
            return
        if self.catch_up_helper is None or not self.catch_up_helper.is_alive():
            self.catch_up_helper = threading.Thread(target=self._run_catch_up, daemon=True,
                                                    name=f"fdq-catch-up-{c.id}")
            self.catch_up_helper.start()

    def _run_catch_up(self):
        c = self.consumer
        try:
            while not c._stop.is_set():
                if catchup.catch_up_chunk(c.db, c._ts, c.subscription, CHUNK) < 0:
                    return
        except Exception as e:      # the next heartbeat tries again
            c._report(e)

    def observe_subscriptions(self, now: float):
        """Pick up updates of the subscription's config; reap zombies of the topic's
        ephemeral subscriptions (another's last member may have been killed)."""
        c = self.consumer
        if c.subscription not in c._topic_config.subs:
            return
        config = subs.read_subscription(c.db, c._ts, c.subscription, snapshot=True, topic_config=c._topic_config)
        if config != c.sub_config:
            c._apply_subscription(config)
        self.reaper.observe(c.db, c._ts, c._topic_config, now, skip=c.subscription)

    def _stall_watch(self):
        """A thread of its own: the membership loop may be stuck in a database call."""
        c = self.consumer
        while not c._stop.wait(c.config.heartbeat_interval_s / 2):
            self.check_stall(_monotonic())

    def observe_standby(self, members: dict):
        """Whether this consumer is on standby: it owns no shard because every shard of
        its subscription has a live owner (more consumers than shards). Not a stall: it
        takes a shard when one frees. Logged once each time it begins."""
        c = self.consumer
        with c._owned_lock:
            owned = bool(c._owned)
        standby = False
        if not owned:
            owners = membership.read_owners(c.db, c._ts, c.subscription)
            standby = bool(owners) and all(o is not None and o != c.id and o in members
                                           for o, _e in owners.values())
            if standby and not self.standby:
                log.info("consumer %s of %s/%s is on standby: %d consumers share %d shards; it takes one "
                         "when one frees (more shards let more consumers work: fdq rebalance %s --shards N)",
                         c.id, c.topic, c.subscription, len(members), len(owners), c.topic)
        self.standby = standby

    def check_stall(self, now: float):
        """The heartbeat alarm: report ``ConsumerStalled`` once (again after a recovery)
        when no heartbeat round has reached the database, or this consumer has owned no
        shard while not on standby (``observe_standby``), for over 3 heartbeats."""
        c = self.consumer
        with c._owned_lock:
            owned = bool(c._owned)
        self.noshard_since = None if owned or self.standby else (self.noshard_since or now)
        limit = 3 * c.config.heartbeat_interval_s
        unreachable = now - self.hb_ok
        no_shard = now - self.noshard_since if self.noshard_since is not None else 0.0
        if unreachable <= limit and no_shard <= limit:
            self.stall_reported = False
            return
        if not self.stall_reported:
            self.stall_reported = True
            err = self.last_error
            why, since = (("has not completed a heartbeat" + (f" ({type(err).__name__}: {err})" if err else
                                                               " (cannot reach the database)"), unreachable)
                          if unreachable > limit else ("owns no shard", no_shard))
            c._report(ConsumerStalled(f"consumer {c.id} of {c.topic}/{c.subscription} {why} "
                                      f"for {since:.2f}s (over 3 heartbeats)"))

    def tick_clock(self, now: float):
        """Advance the topic's clock (delays are due by it) by the time that passed on
        this host's monotonic clock since this consumer last saw it: never by versions
        (they jump on recoveries), never by wall clocks (they disagree)."""
        c = self.consumer
        candidate = 0
        if self.clock_base is not None:
            base, since = self.clock_base
            candidate = base + int((now - since) * 1000)
        self.clock_base = (clock.advance_clock(c.db, c._ts.clock_key, candidate, c._ts.clock_version_key), now)

    def observe_peers(self, now: float):
        """Time each peer's heartbeat counter; a peer's unchanged for its timeout is a
        zombie (its shards move). One member declares it: the live one (by this
        member's observation) with the smallest id, so hundreds of consumers do not all
        declare the same zombie at once; any member does once it has stayed unchanged
        for twice its timeout (observations can differ). Returns the members read."""
        c = self.consumer
        members = membership.read_members(c.db, c._ts, c.subscription)
        # A heartbeat value first seen now is timed from after the read that saw it, not
        # from ``now`` (taken before this round's heartbeat, which a database stall can
        # hold up for seconds while the peer's commits too). Timeouts keep ``now``: late.
        seen_at = max(now, _monotonic())
        for cid in list(self.peers):
            if cid not in members:
                del self.peers[cid]
        stale = {}
        for cid, m in members.items():
            if cid == c.id:
                continue
            seen = self.peers.get(cid)
            if seen is None or seen[0] != m["hb"]:
                self.peers[cid] = (m["hb"], seen_at)
            elif now - seen[1] >= _peer_timeout(c.config, m["record"]):
                stale[cid] = (seen, _peer_timeout(c.config, m["record"]))
        declarer = min(cid for cid in members if cid not in stale) if c.id in members else c.id
        for cid, (seen, timeout) in stale.items():
            if declarer != c.id and now - seen[1] < 2 * timeout:
                continue        # the declarer's to do
            if subs.declare_zombie(c.db, c._ts, c.subscription, cid, seen[0]):
                log.info("consumer %s: %s is a zombie (heartbeat %d unchanged for %.1fs)",
                         c.id, cid, seen[0], now - seen[1])
            self.peers.pop(cid, None)
            c._refresh_owned()
        return members

    def check_leases(self, now: float):
        """Expire leases of owned shards seen unchanged (same lease, same touches) for
        their ack wait on this host's monotonic clock: per lease record, one transaction
        for all of its messages that are due (a batch nobody settled expires at once).
        The owned shards' lease records are read in one snapshot transaction (one per
        shard was a burst of 16 transactions every check, competing with the worker)."""
        c = self.consumer
        with c._owned_lock:
            owned = dict(c._owned)
        spaces = {shard_id: c._ts.shard(c.subscription, *shard_id) for shard_id in owned}
        scans, ids = {}, list(spaces)
        for i in range(0, len(ids), LEASE_SCAN_SHARDS):     # a few shards per read-only transaction
            scans.update(queue.scan_shards_leases(c.db, {s: spaces[s] for s in ids[i:i + LEASE_SCAN_SHARDS]}))
        # A lease state first seen now is timed from after the read that saw it: ``now``
        # was taken before this round's heartbeat and these reads, which a database stall
        # can hold up for seconds while a touch commits (timed from ``now``, it expired
        # early by the stall). Due checks keep ``now``: they err late, never early.
        seen_at = max(now, _monotonic())
        leases = c._leases      # ((tag, n), 12-byte vs) -> [lease_id, touches, since, ack_wait_s, record key, handed]
        for shard_id, epoch in owned.items():
            shard = spaces[shard_id]
            current = scans[shard_id]
            live_keys = set()
            due = {}        # (record key, lease id) -> [(vs, touches)]
            with c._leases_lock:
                for rkey, vs, lease_id, touches, ack_wait_ms in current:
                    key = (shard_id, vs.to_bytes())
                    live_keys.add(key)
                    seen = leases.get(key)
                    if seen is None or seen[0] != lease_id or seen[1] != touches:
                        # (the last field: handed to the application, ``Consumer._lease_many``)
                        handed = seen is not None and seen[0] == lease_id and seen[5]
                        leases[key] = [lease_id, touches, seen_at, ack_wait_ms / 1000, rkey, handed]
                    elif now - seen[2] >= seen[3]:
                        due.setdefault((rkey, lease_id), []).append((vs, touches))
            for (rkey, lease_id), expiring in due.items():
                try:
                    outcome = queue.expire_leases(c.db, c._ts, shard, c.id, epoch, rkey, lease_id, expiring,
                                                  c.config.max_deliver, c.config.backoff_s)
                except LeaseLost:
                    c._refresh_owned()
                    return
                with c._leases_lock:
                    for vs, _t in expiring:
                        leases.pop((shard_id, vs.to_bytes()), None)
                if any(o is not queue.Expiry.CHANGED for o in outcome.values()):
                    c._mark(shard_id)
            with c._leases_lock:
                for key in [k for k in leases if k[0] == shard_id and k not in live_keys]:
                    del leases[key]


__all__ = ["Member"]


class Reaper:
    """Watches the members of a topic's ephemeral subscriptions for zombies (heartbeat
    counter unchanged for ``zombie_after_s`` on this host's monotonic clock), so a
    subscription whose last consumer was killed is deleted even with no peer left to
    notice. Consumers of the topic run one in their heartbeat; ``Supervisor.reap`` too,
    with ``every_subscription``: the members of durable subscriptions as well (a killed
    consumer with no live peer to notice would stay registered). ``declared``: the
    (sub, cid) its last observation declared zombies."""

    def __init__(self, zombie_after_s: float, every_subscription: bool = False):
        self.zombie_after_s = zombie_after_s
        self.every_subscription = every_subscription
        self.longest_timeout_s = zombie_after_s   # the longest timeout a member advertised
        self._seen = {}          # (sub, cid) -> (hb, since)
        self.declared = []

    def observe(self, db, ts: TopicSpace, topic_config, now: float, skip: str | None = None) -> list:
        """One observation; returns the subscriptions deleted."""
        deleted = []
        self.declared = []
        live = set()
        for sub in topic_config.subs:
            if sub == skip:
                continue
            # Read each time (one snapshot read): a subscription deleted and created
            # again under its name may have changed from durable to ephemeral.
            try:
                eph = subs.is_ephemeral(sub, subs.read_subscription(db, ts, sub, snapshot=True, topic_config=topic_config))
            except SubscriptionNotFound:
                continue
            if not eph and not self.every_subscription:
                continue
            members = membership.read_members(db, ts, sub)
            seen_at = max(now, time.monotonic())    # first seen after the read (see Consumer._observe_peers)
            for cid, m in members.items():
                live.add((sub, cid))
                self.longest_timeout_s = max(self.longest_timeout_s, _advertised_timeout(m["record"]))
                seen = self._seen.get((sub, cid))
                if seen is None or seen[0] != m["hb"]:
                    self._seen[(sub, cid)] = (m["hb"], seen_at)
                elif now - seen[1] >= max(self.zombie_after_s, _advertised_timeout(m["record"])):
                    self._seen.pop((sub, cid), None)
                    if subs.declare_zombie(db, ts, sub, cid, seen[0]):
                        self.declared.append((sub, cid))
                        if sub not in read_topic_config(db, ts, snapshot=True).subs:
                            deleted.append(sub)
        for key in [k for k in self._seen if k not in live]:
            del self._seen[key]
        return deleted


def _advertised_timeout(record: dict) -> float:
    """The zombie timeout a member advertises in its record (it heartbeats at its own
    interval), 0 if it advertises none."""
    t = record.get("zombie_after_s")
    return t if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0
