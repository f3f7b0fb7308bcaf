"""Tag dispatch as an ownership rule, in one process: new tags get owners without a
join or leave, fallback to untagged consumers and back on join, rebalance (with and
without a shard-count change) applies the same rules, per-tag stats."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

import fdq
import fdq.aio
from fdq.ops import membership
from fdq.headers import DISPATCH_TAG

import fdqtest
from fdqtest import database_url, fast, FAST_STEADY, wait_for


STEADY = fast(FAST_STEADY, poll_interval_s=0.1)


def tagged(tag, body, key=None):
    return fdq.Envelope(body, shard_key=key, headers={DISPATCH_TAG: tag})


def owners(db, topic="t"):
    ts = fdq.Supervisor(db).keyspace.topic(topic)
    return {s: o for s, (o, _e) in membership.read_owners(db, ts, "default").items()}


def drain(consumer, want: set, timeout=30.0) -> list:
    """What ``consumer`` fetches (and acks) until it got every body of ``want``."""
    return fdqtest.drain(consumer, until=want, strict=True, timeout=timeout)


@pytest.fixture
def topic(db):
    fdq.Supervisor(db).create_topic("t", shards=3, extend=True)
    return "t"


def test_new_tag_gets_owner_without_join_or_leave(db, topic):
    u = fdq.Consumer(db, topic, consumer_id="u", extend_support=True, config=STEADY)
    a = fdq.Consumer(db, topic, consumer_id="a", extend_support=True, desired_tag="A", config=STEADY)
    try:
        assert a.owned_shards == []
        p = fdq.Producer(db)
        p.push_many(topic, [tagged("A", b"a%d" % i, f"k{i}") for i in range(9)])
        p.push_many(topic, [tagged("Z", b"z%d" % i) for i in range(6)])    # nobody wants Z
        got_a = drain(a, {b"a%d" % i for i in range(9)})
        got_u = drain(u, {b"z%d" % i for i in range(6)})
        assert {m.tag for m in got_a} == {"A"} and {m.tag for m in got_u} == {"Z"}
        o = owners(db)
        assert {o[("A", n)] for n in range(3)} == {"a"}
        assert {o[("Z", n)] for n in range(3)} == {"u"}
        assert {o[("", n)] for n in range(3)} == {"u"}
    finally:
        a.close()
        u.close()


def test_fallback_then_ownership_moves_back_on_join(db, topic):
    u = fdq.Consumer(db, topic, consumer_id="u", extend_support=True, config=STEADY)
    p = fdq.Producer(db)
    try:
        p.push_many(topic, [tagged("A", b"a%d" % i) for i in range(6)])
        got = drain(u, {b"a%d" % i for i in range(6)})          # no A consumer: untagged gets them
        assert {m.tag for m in got} == {"A"}
        a = fdq.Consumer(db, topic, consumer_id="a", extend_support=True, desired_tag="A", config=STEADY)
        try:
            # The join itself moved the A shards (no wait for a heartbeat).
            assert sorted(a.owned_shards) == [("A", n) for n in range(3)]
            assert {owners(db)[("A", n)] for n in range(3)} == {"a"}
            p.push_many(topic, [tagged("A", b"b%d" % i) for i in range(6)] + [fdq.Envelope(b"plain")])
            drain(a, {b"b%d" % i for i in range(6)})
            got_u = drain(u, {b"plain"})
            assert all(not m.body.startswith(b"b") for m in got_u)
        finally:
            a.close()
        # The last A consumer left: A shards fall back to the untagged consumer at once.
        assert {owners(db)[("A", n)] for n in range(3)} == {"u"}
    finally:
        u.close()


def test_two_consumers_share_a_tag_by_shard(db, topic):
    a1 = fdq.Consumer(db, topic, consumer_id="a1", extend_support=True, desired_tag="A", config=STEADY)
    a2 = fdq.Consumer(db, topic, consumer_id="a2", extend_support=True, desired_tag="A", config=STEADY)
    u = fdq.Consumer(db, topic, consumer_id="u", extend_support=True, config=STEADY)
    try:
        fdq.Producer(db).push_many(topic, [tagged("A", b"m%d" % i, f"key{i % 5}") for i in range(30)])
        got = []

        def step():
            for c in (a1, a2, u):
                for m in c.fetch(100, timeout=0.1):
                    got.append((c.id, m))
                    m.ack()
            return len(got) >= 30
        wait_for(step, 30, "30 A messages")
        assert {cid for cid, _m in got} == {"a1", "a2"}     # both A consumers got a share, u none
        by_key = {}
        for cid, m in got:     # shard-key consistency among the A consumers
            by_key.setdefault(m.shard_key, set()).add(cid)
        assert all(len(v) == 1 for v in by_key.values())
        o = owners(db)
        assert sorted(o[("A", n)] for n in range(3)).count("a1") in (1, 2)
    finally:
        for c in (a1, a2, u):
            c.close()


def test_rebalance_applies_tag_rules(db, topic):
    sup = fdq.Supervisor(db)
    ts = sup.keyspace.topic(topic)
    p = fdq.Producer(db)
    p.push_many(topic, [tagged("A", b"a"), tagged("C", b"c"), fdq.Envelope(b"u")])
    # Consumer records written directly (no background threads to race the check).
    membership.join(db, ts, "default", "u1", {"tag": None})
    membership.join(db, ts, "default", "a1", {"tag": "A"})
    # Scramble ownership against the rules, then rebalance.
    tr = db.create_transaction()
    for n in range(3):
        for tag in ("", "A", "C"):
            tr[ts.shard_records["default"].pack((tag, n))] = fdq.keyspace.codec.pack(["a1" if tag != "A" else "u1", 1])
    tr.commit().wait()
    sup.rebalance(topic)
    o = owners(db)
    assert {o[("A", n)] for n in range(3)} == {"a1"}
    assert {o[("C", n)] for n in range(3)} == {"u1"}
    assert {o[("", n)] for n in range(3)} == {"u1"}
    tags = sup.stats(topic)["subscriptions"]["default"]["tags"]
    assert tags["A"] == {"shards": 3, "backlog": 1, "in_flight": 0, "delayed": 0, "owners": ["a1"],
                         "fallback": False}
    assert tags["C"]["owners"] == ["u1"] and tags["C"]["fallback"] is True and tags["C"]["backlog"] == 1
    assert tags[""]["backlog"] == 1 and tags[""]["fallback"] is False
    cons = {c["id"]: c for c in sup.stats(topic)["subscriptions"]["default"]["consumers"]}
    assert cons["a1"]["tag"] == "A" and cons["a1"]["tag_shards"] == [["A", n] for n in range(3)]
    assert cons["u1"]["tag_shards"] == sorted([t, n] for t in ("", "C") for n in range(3))
    # No untagged consumer: untagged and unwanted-tag shards have no owner, never a tagged one.
    membership.leave(db, ts, "default", "u1")
    sup.rebalance(topic)
    o = owners(db)
    assert {o[("C", n)] for n in range(3)} == {o[("", n)] for n in range(3)} == {None}
    assert {o[("A", n)] for n in range(3)} == {"a1"}


def test_reshard_keeps_tags(db, topic):
    sup = fdq.Supervisor(db)
    p = fdq.Producer(db)
    p.push_many(topic, [tagged("A", b"a%d" % i, f"k{i}") for i in range(20)] +
                [fdq.Envelope(b"u%d" % i, shard_key=f"k{i}") for i in range(20)])
    a = fdq.Consumer(db, topic, consumer_id="a", extend_support=True, desired_tag="A", config=STEADY)
    u = fdq.Consumer(db, topic, consumer_id="u", extend_support=True, config=STEADY)
    try:
        sup.rebalance(topic, shards=5)
        st = sup.stats(topic)["subscriptions"]["default"]["tags"]
        assert st["A"]["shards"] == 5 and st["A"]["backlog"] == 20 and st["A"]["owners"] == ["a"]
        assert st[""]["backlog"] == 20 and st[""]["owners"] == ["u"]
        wait_for(lambda: sorted(a.owned_shards) == [("A", n) for n in range(5)], 20, "a to own A's 5 shards")
        got_a = drain(a, {b"a%d" % i for i in range(20)})
        got_u = drain(u, {b"u%d" % i for i in range(20)})
        assert {m.tag for m in got_a} == {"A"} and {m.tag for m in got_u} == {""}
        assert all(m.shard == fdq.keyspace.codec.shard_of(m.shard_key, 5) for m in got_a + got_u)
    finally:
        a.close()
        u.close()


def test_create_extend_on_existing_plain_topic_is_an_error(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("p")
    with pytest.raises(fdq.TopicExists, match="upgrade_extend"):
        sup.create_topic("p", extend=True)
    assert not sup.config("p").extend
    sup.create_topic("e", extend=True)
    assert sup.create_topic("e").extend        # one-way: re-creating never downgrades


def test_delayed_nak_and_dead_letters_stay_in_the_tag(db, topic):
    sup = fdq.Supervisor(db)
    p = fdq.Producer(db)
    cfg = fdq.ConsumerConfig(heartbeat_interval_s=0.1, poll_interval_s=0.1, max_deliver=5)
    a = fdq.Consumer(db, topic, consumer_id="a", extend_support=True, desired_tag="A", config=cfg)
    u = fdq.Consumer(db, topic, consumer_id="u", extend_support=True, config=cfg)
    try:
        p.push(topic, b"later", delay=0.3, headers={DISPATCH_TAG: "A"})
        p.push(topic, b"retry", headers={DISPATCH_TAG: "A"})
        p.push(topic, b"dead", headers={DISPATCH_TAG: "A"})
        seen = []

        def step():
            for m in a.fetch(10, timeout=0.2):
                seen.append((m.body, m.attempts, m.tag))
                if m.body == b"retry" and m.attempts == 1:
                    m.nak(0)
                elif m.body == b"dead":
                    m.term("bad")
                else:
                    m.ack()
            return {b"later", b"dead"} <= {b for b, _n, _t in seen} and (b"retry", 2, "A") in seen
        wait_for(step, 30, "delayed, nak'd and terminated A messages")
        assert {t for _b, _n, t in seen} == {"A"}
        assert u.fetch(10, timeout=0.3) == []                        # none leaked to untagged
        assert sup.dlq_redrive(topic) == 1
        got = wait_for(lambda: a.fetch(10, timeout=0.2), 20, "the redriven message")
        assert [(m.body, m.tag) for m in got] == [(b"dead", "A")]
        got[0].ack()
        assert u.fetch(10, timeout=0.3) == []
    finally:
        a.close()
        u.close()


def test_tag_dispatch_under_fault_injection(tmp_path):
    """Retryable errors and commit_unknown_result (after a real commit) on every kind of
    transaction: pushes commit once, new tags still get owners, tags stay apart."""
    db = fdq.connect(database_url(tmp_path / "f.db", fault_injection=0.1, seed=7))
    fdq.Supervisor(db).create_topic("t", shards=2, extend=True)
    cfg = fdq.ConsumerConfig(heartbeat_interval_s=0.1, zombie_timeout_s=30.0, ack_wait_s=1.0,
                             poll_interval_s=0.1)
    a = fdq.Consumer(db, "t", consumer_id="a", extend_support=True, desired_tag="A", config=cfg)
    u = fdq.Consumer(db, "t", consumer_id="u", extend_support=True, config=cfg)
    try:
        p = fdq.Producer(db)
        for i in range(10):
            p.push_many("t", [tagged("A", b"a%d-%d" % (i, j)) for j in range(3)] +
                        [tagged("Q", b"q%d" % i), fdq.Envelope(b"u%d" % i)])
        got = {"a": [], "u": []}

        def step():
            for c in (a, u):
                for m in c.fetch(50, timeout=0.1):
                    got[c.id].append(m)
                    try:
                        m.ack()
                    except fdq.LeaseLost:
                        pass    # redelivered later: at least once
            return ({m.body for m in got["a"]} >= {b"a%d-%d" % (i, j) for i in range(10) for j in range(3)}
                    and {m.body for m in got["u"]} >= {b"q%d" % i for i in range(10)} | {b"u%d" % i for i in range(10)})
        wait_for(step, 60, "every message under fault injection")
        assert {m.tag for m in got["a"]} == {"A"}
        assert {m.tag for m in got["u"]} == {"Q", ""}
        assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 50     # each push committed once
    finally:
        a.close()
        u.close()


TAGS = 600          # x 16 shards: 9,616 shards owned by the one consumer


def test_consumer_owning_thousands_of_tag_shards_closes_promptly(db):
    fdq.Supervisor(db).create_topic("t", shards=16, extend=True)
    p = fdq.Producer(db)
    for i in range(0, TAGS, 300):
        p.push_many("t", [fdq.Envelope(b"m%d" % j, headers={DISPATCH_TAG: f"tag{j}"})
                          for j in range(i, i + 300)])
    c = fdq.Consumer(db, "t", extend_support=True, on_error=lambda e: None,
                     config=fdq.ConsumerConfig(heartbeat_interval_s=0.5, poll_interval_s=0.1))
    try:
        assert len(c.owned_shards) == (TAGS + 1) * 16
        got = set()

        def step():
            for m in c.fetch(500, timeout=0.5):
                got.add(m.body)
                m.ack()
            return len(got) == TAGS
        wait_for(step, 120, f"{TAGS} messages of {TAGS} tags")
    finally:
        t0 = time.monotonic()
        c.close()
        took = time.monotonic() - t0
    # Cancelling a watch scanned every watch (quadratic): 24 s for 8,016 watches, ~50 s
    # here, on an idle 2-core machine; ~2 s now.
    assert took < 12, f"close took {took:.1f}s"


KEYS = [f"k{i}" for i in range(4)]


PER_KEY_AND_TAG = 6


class Overlap:
    """Handlers running per key; the most seen at once for any key."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = {}
        self.most = 0
        self.seen = []
        self.max_running = 0

    def enter(self, m):
        with self.lock:
            n = self.running.get(m.shard_key, 0) + 1
            self.running[m.shard_key] = n
            self.most = max(self.most, n)
            self.max_running = max(self.max_running, sum(self.running.values()))

    def leave(self, m):
        with self.lock:
            self.running[m.shard_key] -= 1
            self.seen.append((m.shard_key, m.tag, m.body))


def _push_backlog(db):
    """Each key's tagged ("gpu") and untagged messages, pushed interleaved."""
    fdq.Supervisor(db).create_topic("t", shards=4, extend=True)
    envs = []
    for i in range(PER_KEY_AND_TAG):
        for k in KEYS:
            envs.append(fdq.Envelope(b"%s-u%d" % (k.encode(), i), shard_key=k))
            envs.append(fdq.Envelope(b"%s-g%d" % (k.encode(), i), shard_key=k, headers={DISPATCH_TAG: "gpu"}))
    fdq.Producer(db).push_many("t", envs)
    return len(envs)


def _per_tag_order_kept(seen):
    for k in KEYS:
        for tag, letter in (("", b"u"), ("gpu", b"g")):
            bodies = [b for key, t, b in seen if key == k and (t or "") == tag]
            assert bodies == [b"%s-%s%d" % (k.encode(), letter, i) for i in range(PER_KEY_AND_TAG)]


@pytest.mark.parametrize("mode", ["at_least_once", "at_most_once"])
def test_tail_never_runs_one_key_twice_across_tags(db, mode):
    total = _push_backlog(db)
    ov = Overlap()

    def handler(m):
        ov.enter(m)
        time.sleep(0.01)        # long enough for the pool's other threads to start theirs
        ov.leave(m)
    c = fdq.tail(db, "t", handler, acking=(mode == "at_least_once"), extend_support=True, batch_size=3,
                 config=fast(FAST_STEADY, max_concurrency=8))
    try:
        wait_for(lambda: len(ov.seen) >= total, 60, f"{total} deliveries")
    finally:
        c.shutdown()
    assert len(ov.seen) == total
    assert ov.max_running > 1, "handlers never ran concurrently: the test shows nothing"
    assert ov.most == 1, f"{ov.most} handlers of one shard key ran at once"
    _per_tag_order_kept(ov.seen)


def test_aio_tail_never_runs_one_key_twice_across_tags(db):
    total = _push_backlog(db)
    ov = Overlap()

    async def main():
        async def handler(m):
            ov.enter(m)
            await asyncio.sleep(0.01)
            ov.leave(m)
        t = await fdq.aio.tail(db, "t", handler, extend_support=True,
                               config=fast(FAST_STEADY, max_concurrency=8))
        try:
            deadline = time.monotonic() + 60
            while len(ov.seen) < total and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        finally:
            await t.shutdown()
    asyncio.run(main())
    assert len(ov.seen) == total
    assert ov.max_running > 1, "handlers never ran concurrently: the test shows nothing"
    assert ov.most == 1, f"{ov.most} handlers of one shard key ran at once"
    _per_tag_order_kept(ov.seen)
