"""A channel the broker serves: one (topic, NSQ channel = FDQ subscription, desired tag),
its pull ``fdq.Consumer`` and the connections subscribed to it, to which it dispatches
messages by RDY; FIN, REQ and TOUCH settle through it."""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING

from .. import Consumer, ConsumerConfig
from ..config import SubscriptionConfig
from ..errors import ConfigError, FDQError, LeaseLost
from ..settlement import Action, Settlement
from .quantile import Quantile
from .protocol import ProtocolError, fatal, nonfatal

if TYPE_CHECKING:
    from .server import Broker

log = logging.getLogger("fdq.broker")

MAX_DELIVER = 0xFFFF           # NSQ never dead-letters: attempts is a uint16
FETCH_WAIT_S = 0.5
# FIN/REQ wait this long for the pump's next fetch to carry them in its lease transaction
# (one commit for both) before they commit alone: a FIN on an idle channel is acked
# within it.
SETTLE_LINGER_S = 0.005


class ChannelStats:
    def __init__(self, percentiles: tuple = (), window_s: float = 600.0):
        self.e2e = Quantile(percentiles, window_s)
        self.message_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        self.published = {}        # topic -> messages published on this connection
        self.finish_count = 0


class Channel:
    """One (topic, channel, tag) served by this broker: a pull consumer and the
    connections subscribed to it."""

    def __init__(self, broker: "Broker", topic: str, name: str, tag: str | None, extend: bool):
        self.broker = broker
        self.topic = topic
        self.name = name
        self.tag = tag
        self.extend = extend
        self.consumer = None
        self.conns = []
        self.stats = broker.stats_for(topic, name)
        self.wake = asyncio.Event()
        self._rr = 0
        self._settles = []
        self._handing = False
        self._pending = set()          # settle_soon futures not known done
        self._task = None
        self.closed = False

    async def open(self):
        b = self.broker
        cfg = ConsumerConfig(ack_wait_s=b.options.limits.msg_timeout_ms / 1000, max_deliver=MAX_DELIVER,
                             maintenance=False)     # the broker's fdq.Maintenance does it
        kwargs = dict(subscription=self.name, config=cfg, create=False, batch_size=100)
        if self.extend:
            kwargs.update(extend_support=True, desired_tag=self.tag)
        new = await b.run(b.ensure_channel, self.topic, self.name, not self.name.endswith("#ephemeral"))
        if new is not None:     # an ephemeral channel: created and joined in one transaction
            kwargs.update(create=True, subscription_config=new, ephemeral=True)
        else:                   # refused before joining: a waiting ephemeral one would be deleted
            self._check_acknowledged((await b.run(b.supervisor.subscription, self.topic, self.name))["config"])
        try:
            self.consumer = await b.run(functools.partial(Consumer, b.db, self.topic, **kwargs))
        except ConfigError:
            if new is None or self.name not in (await b.run(b.supervisor.config, self.topic)).subs:
                raise
            # another broker created it meanwhile, with the start point of a later channel
            kwargs.update(create=False, subscription_config=None, ephemeral=False)
            self.consumer = await b.run(functools.partial(Consumer, b.db, self.topic, **kwargs))
        try:        # created again meanwhile: refused before anything is fetched
            self._check_acknowledged(self.consumer.sub_config)
        except ProtocolError:
            consumer, self.consumer = self.consumer, None
            await b.run(consumer.close)
            raise
        self._task = asyncio.get_running_loop().create_task(self._pump())

    def _check_acknowledged(self, config: SubscriptionConfig):
        """An NSQ channel is acknowledged (FIN/REQ/TOUCH). A subscription with ack_policy
        none takes its messages when fetched: FIN would fail, and what the broker hands
        back (no connection can take it, paused during a fetch) would be lost. A live
        channel's subscription created again with ack_policy none is refused by its
        consumer (it does not rejoin)."""
        if config.ack_policy == "none":
            raise fatal("E_BAD_CHANNEL", f"SUB channel {self.name!r} of topic {self.topic!r} has ack_policy "
                                         f"'none' (messages are taken when delivered, never acknowledged): "
                                         f"an NSQ channel is acknowledged with FIN/REQ/TOUCH; use a "
                                         f"subscription with ack_policy 'explicit'")

    def add(self, conn):
        self.conns.append(conn)
        self.wake.set()

    async def remove(self, conn):
        if conn in self.conns:
            self.conns.remove(conn)
        if not self.conns and not self.closed:
            await self.broker._drop_channel(self)

    async def close(self):
        self.closed = True
        self.wake.set()
        if self._task is not None:
            # let a fetch under way finish (bounded by FETCH_WAIT_S) so what it leased is
            # returned below, rather than left to expire
            done, _ = await asyncio.wait([self._task], timeout=FETCH_WAIT_S + 10)
            if not done:
                self._task.cancel()
        await self.flush()
        if self.consumer is not None:
            await self.broker.run(self.consumer.close)

    def _pick(self, batch: bool = True, max_timeout_ms: int | None = None):
        if (self.topic, self.name) in self.broker.paused:
            return None
        # A connection is served when a worthwhile batch fits (a quarter of its RDY, at
        # most 50) or it has nothing in flight: one lease transaction per FIN would
        # otherwise bound throughput at one message per transaction.
        ready = [c for c in self.conns
                 if c.capacity > 0 and (not batch or not c.in_flight or c.capacity >= min(50, max(1, c.rdy // 4)))
                 and (max_timeout_ms is None or c.ident.msg_timeout_ms <= max_timeout_ms)]
        if not ready:
            return None
        self._rr = (self._rr + 1) % len(ready)
        return ready[self._rr]

    async def _pump(self):
        b = self.broker
        while not self.closed:
            target = self._pick()
            if target is None:
                self.wake.clear()
                if self._pick() is None:
                    await self.wake.wait()
                continue
            n = min(target.capacity, 500)
            lease_ms = target.ident.msg_timeout_ms
            try:
                msgs = await b.run(functools.partial(self.consumer.fetch, n, FETCH_WAIT_S,
                                                     ack_wait_s=lease_ms / 1000))
            except Exception as e:      # keep serving: the consumer retries, leases expire
                log.warning("channel %s/%s: fetch failed: %s: %s", self.topic, self.name, type(e).__name__, e)
                await asyncio.sleep(0.2)
                continue
            if not msgs:
                continue
            if self.closed or (self.topic, self.name) in b.paused:
                rest = msgs      # paused while we fetched: back to the queue
            else:
                rest = target.deliver(msgs) if target.capacity > 0 else msgs
            while rest:
                # only to a connection whose msg_timeout fits in these leases: a longer
                # one would see them expire and be redelivered while it still holds them
                other = self._pick(batch=False, max_timeout_ms=lease_ms)
                if other is None:
                    break
                rest = other.deliver(rest)
            for m in rest:           # nobody can take it now: back to the queue at once, no attempt counted
                self.settle(None, m, "release")

    # -- settlements, carried by the pump's next fetch --------------------------------

    def settle(self, conn, m, action, arg=None, nsq_id: bytes = b""):
        """Settle ``m`` (FIN: "ack", REQ: "nak" with ``arg`` seconds of delay, TOUCH,
        "release": never delivered). Those of one turn of the loop are handed together to
        ``Consumer.settle_soon``: the pump's next fetch commits them in its lease
        transaction, or they commit alone after SETTLE_LINGER_S (a TOUCH at once). A
        lease lost at commit answers ``conn`` E_FIN_FAILED / E_REQ_FAILED /
        E_TOUCH_FAILED."""
        self._settles.append((conn, m, action, arg, nsq_id))
        if not self._handing:
            self._handing = True
            asyncio.get_running_loop().call_soon(self._hand)

    def _hand(self):
        self._handing = False
        batch, self._settles = self._settles, []
        if not batch:
            return
        items = [Settlement(m, Action(a), x) for _c, m, a, x, _i in batch]
        linger = 0 if any(a == "touch" for _c, _m, a, _x, _i in batch) else SETTLE_LINGER_S
        try:
            fut = self.consumer.settle_soon(items, linger)
        except FDQError as e:
            self._failed(batch, str(e))
            return
        self._pending = {f for f in self._pending if not f.done()}
        self._pending.add(fut)
        loop = asyncio.get_running_loop()

        def done(f):        # in the thread that committed them
            e = f.exception()
            if e is not None:
                loop.call_soon_threadsafe(self._settled, batch, e)
        fut.add_done_callback(done)

    def _settled(self, batch, e):
        if isinstance(e, LeaseLost):
            lost = set(e.ids)
            self._failed([t for t in batch if t[1].id in lost], "lease lost")
        else:
            self._failed(batch, str(e))

    @staticmethod
    def _failed(batch, why):
        for conn, _m, action, _x, nsq_id in batch:
            if conn is not None:
                code = {"ack": "E_FIN_FAILED", "nak": "E_REQ_FAILED", "touch": "E_TOUCH_FAILED"}[action]
                verb = {"ack": "FIN", "nak": "REQ", "touch": "TOUCH"}[action]
                conn.send_error(nonfatal(code, f"{verb} {nsq_id.decode()} failed {why}"))

    async def flush(self):
        """Wait until the settlements handed so far committed (or failed)."""
        self._hand()
        pending = [asyncio.wrap_future(f) for f in self._pending if not f.done()]
        self._pending = set()
        if pending:
            await asyncio.wait(pending)
