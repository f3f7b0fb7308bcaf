"""Core state changes (producer, membership, supervisor) found in an independent review:
long operations whose chunks could exceed FDB's 10 MB per transaction, a shard
assignment computed from a consumer's stale copy of the topic config, ..."""
from __future__ import annotations

import os
import time

import fdq
from fdq import membership
from fdq.keyspace import Keyspace, parse_message_id
from fdq.keyspace.codec import shard_of
from fdqtest import drain


SUBS = 9        # the default subscription and 8 more


def _fan_out_topic(db, name: str = "t"):
    s = fdq.Supervisor(db)
    s.create_topic(name, shards=2)
    for i in range(1, SUBS):
        s.create_subscription(name, f"s{i}")
    assert len(s.config(name).subs) == SUBS
    return s


def _drain_bodies(db, topic: str, sub: str, want: int, timeout: float = 30.0) -> list:
    return [m.body for m in drain(db, topic, sub, until=want, batch=None, timeout=timeout,
                                  config=fdq.ConsumerConfig(ack_wait_s=600))]


def test_play_routes_a_big_message_after_smaller_ones_within_one_transaction_each(db):
    """A play chunk checked its byte budget (2 MB) only before each message, so a
    message a push had accepted (its copies for every subscription under 9 MB) routed
    after ~2 MB of others took the transaction past FDB's 10 MB: transaction_too_large,
    not retryable, the same chunk on every rerun: the topic could never be played."""
    s = _fan_out_topic(db)
    p = fdq.Producer(db)
    s.pause("t")
    small, big = os.urandom(222_000), os.urandom(900_000)
    p.push("t", small, shard_key="k")
    p.push("t", big, shard_key="k")
    assert s.play("t") == 2
    counters = s.stats("t")["counters"]
    assert (counters["inserted"], counters["routed"], counters["pending"]) == (2, 2, 0)
    assert not s.config("t").paused
    for sub in ("default", "s8"):
        assert _drain_bodies(db, "t", sub, 2) == [small, big]


def test_replay_of_a_big_message_after_smaller_ones_fits_its_transactions(db):
    """Same budget in a replay: a batch under 2 MB took one more message (its log copy
    and one per subscription) before checking, up to ~11 MB: the replay failed with
    transaction_too_large, and again on every rerun."""
    s = _fan_out_topic(db)
    p = fdq.Producer(db)
    start = int(time.time() * 1000) - 1
    small, big = os.urandom(199_000), os.urandom(900_000)
    p.push("t", small, shard_key="k")
    p.push("t", big, shard_key="k")
    assert _drain_bodies(db, "t", "s3", 2) == [small, big]
    assert p.replay("t", start) == 2
    assert _drain_bodies(db, "t", "s3", 2) == [small, big]
    assert fdq.Supervisor(db).stats("t")["subscriptions"]["s5"]["backlog"] == 4


def test_a_consumer_leaving_with_a_config_from_before_a_reshard_leaves_no_shard_unowned(db):
    """Join, leave and zombie takeover re-divided the shards with the caller's cached
    topic config: a consumer that left (or declared a peer a zombie) before its next
    heartbeat refreshed that copy after a reshard to more shards planned the old count
    and set the new shards' owner to nobody. No later event re-assigns an existing
    record, so their messages were never delivered while the survivor ran."""
    s = fdq.Supervisor(db)
    s.create_topic("t", shards=4)
    slow = fdq.ConsumerConfig(heartbeat_interval_s=30, ack_wait_s=600)   # cached config stays as read
    a = fdq.Consumer(db, "t", consumer_id="a", config=slow)
    b = fdq.Consumer(db, "t", consumer_id="b", config=slow)
    ts = Keyspace().topic("t")
    try:
        s.rebalance("t", shards=8)
        b.close()
        owners = membership.read_owners(db, ts, "default")
        assert sorted(owners) == [("", n) for n in range(8)]
        assert {o for o, _e in owners.values()} == {"a"}, owners
        keys = [next(f"k{i}" for i in range(1000) if shard_of(f"k{i}", 8) == n) for n in range(8)]
        fdq.Producer(db).push_many("t", [fdq.Envelope(k.encode(), shard_key=k) for k in keys])
        got = []
        deadline = time.monotonic() + 20
        while len(got) < len(keys) and time.monotonic() < deadline:
            for m in a.fetch(len(keys), timeout=0.2):
                got.append(m.body)
                m.ack()
        assert sorted(got) == sorted(k.encode() for k in keys)
    finally:
        a.close()
        b.close()


def test_a_deduplicated_push_reports_the_shard_of_the_message_it_duplicates(db):
    """A push deduplicated by ``msg_id`` returned the first message's id but the shard
    of its own would-be placement (for a message without a shard key, any shard):
    ``PushResult`` then named a shard the message is not in."""
    fdq.Supervisor(db).create_topic("t", shards=16)
    p = fdq.Producer(db)
    firsts = [p.push("t", b"x", msg_id=f"id-{i}") for i in range(8)]
    for i, first in enumerate(firsts):
        again = p.push("t", b"x", msg_id=f"id-{i}")
        assert (again.id, again.shard, again.duplicate) == (first.id, first.shard, True)
    # duplicates within one transaction too
    rs = p.push_many("t", [fdq.Envelope(b"y", msg_id="same")] + [fdq.Envelope(b"z")] * 300
                     + [fdq.Envelope(b"y", msg_id="same")])
    assert (rs[-1].id, rs[-1].shard, rs[-1].duplicate) == (rs[0].id, rs[0].shard, True)
    # and that shard is where the message is queued
    ts = Keyspace().topic("t")
    for r in firsts + rs[:1]:
        key = ts.shard("default", "", r.shard).ready_key(parse_message_id(r.id))
        assert db[key] != None, r  # noqa: E711


def test_a_consumer_id_joining_again_fences_off_its_earlier_instance(db):
    """A consumer started with the ``consumer_id`` of one still running (a replacement
    for an instance that looked dead: a stable pod name, a partition) shared its
    identity: both owned every shard with the same epochs, so the earlier instance
    kept taking messages from shards it no longer solely owned (the fence checks the
    owner id and epoch only), and closing it removed the replacement's membership."""
    fdq.Supervisor(db).create_topic("t", shards=4)
    cfg = fdq.ConsumerConfig(ack_wait_s=600)
    old = fdq.Consumer(db, "t", consumer_id="w", config=cfg)
    assert len(old.owned_shards) == 4
    new = fdq.Consumer(db, "t", consumer_id="w", config=cfg)
    ts = Keyspace().topic("t")
    try:
        assert len(new.owned_shards) == 4
        deadline = time.monotonic() + 10
        while old.owned_shards and time.monotonic() < deadline:
            time.sleep(0.05)
        assert old.owned_shards == []
        fdq.Producer(db).push_many("t", [fdq.Envelope(b"%d" % i, shard_key=f"k{i}") for i in range(20)])
        assert old.fetch(20, timeout=0.5) == []
        old.close()         # leaves nothing of the replacement's membership
        assert set(membership.read_members(db, ts, "default")) == {"w"}
        assert {o for o, _e in membership.read_owners(db, ts, "default").values()} == {"w"}
        got = []
        deadline = time.monotonic() + 20
        while len(got) < 20 and time.monotonic() < deadline:
            for m in new.fetch(20, timeout=0.2):
                got.append(m.body)
                m.ack()
        assert sorted(got) == sorted(b"%d" % i for i in range(20))
    finally:
        old.close()
        new.close()


def test_a_peer_heartbeat_seen_after_a_held_up_round_is_timed_from_when_it_was_seen(db):
    """The membership loop takes ``now`` before its heartbeat and then observes its
    peers with it. A round held up in its heartbeat (an FDB recovery stalls commits for
    seconds; the peers' too) stamped a peer's heartbeat first seen after the stall with
    the time from before it: a peer that then went one heartbeat interval without
    beating again had been "unchanged" for the stall plus that interval and was
    declared a zombie while alive. The loop's steps are run by hand here, in its order,
    with the stall as a sleep."""
    fdq.Supervisor(db).create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    obs = fdq.Consumer(db, "t", consumer_id="obs", config=fdq.ConsumerConfig(heartbeat_interval_s=0.5))
    try:
        obs._stop.set()                 # its own loop stops: this test runs the rounds
        obs._thread.join(10)
        assert obs.config.zombie_after_s == 1.5
        membership.join(db, ts, "default", "peer", {"id": "peer", "zombie_after_s": 1.5}, None)
        obs._observe_peers(time.monotonic())            # a round sees the peer
        now = time.monotonic()                          # the next round starts
        time.sleep(2.0)                                 # its heartbeat held up 2 s ...
        assert membership.heartbeat(db, ts, "default", "peer")     # ... the peer's went through
        obs._observe_peers(now)                         # the round observes (its `now`)
        time.sleep(0.3)                                 # one round later, the peer beat 0.3 s ago
        obs._observe_peers(time.monotonic())
        assert "peer" in membership.read_members(db, ts, "default")
    finally:
        obs.close()


def test_a_push_many_too_big_for_one_transaction_is_refused_clearly_and_harms_nothing(db):
    """A push_many within the documented message count (65,536) but over FDB's 10 MB
    per transaction failed with a raw engine error (transaction_too_large) that did not
    say which call or what to do; it is a MessageTooLarge naming both, nothing stored."""
    s = fdq.Supervisor(db)
    s.create_topic("t", shards=16)
    p = fdq.Producer(db)
    p.push("t", b"before", shard_key="k")
    for envs in ([fdq.Envelope(b"x" * 10, shard_key=f"k{i}") for i in range(65_536)],
                 [fdq.Envelope(os.urandom(1 << 20), shard_key="k") for _ in range(12)]):
        try:
            p.push_many("t", envs)
        except fdq.errors.MessageTooLarge as e:
            assert f"push_many of {len(envs):,} messages" in str(e) and "smaller batches" in str(e)
        else:
            raise AssertionError("push_many over 10 MB was not refused")
    assert s.stats("t")["counters"]["inserted"] == 1
    assert len(p.push_many("t", [fdq.Envelope(b"x" * 10, shard_key=f"k{i}") for i in range(1000)])) == 1000


def test_a_push_from_a_push_async_callback_does_not_hang_the_producer(db):
    """A ``push_async`` future's done callbacks run in the thread that sets its result:
    the thread committing the batch. A ``push`` from such a callback queued its message
    and waited for the committing thread, which was itself: it hung for good, and every
    later push of that producer with it."""
    import threading
    fdq.Supervisor(db).create_topic("t", shards=2)
    p = fdq.Producer(db)
    chained = {}
    done = threading.Event()

    def on_done(f):
        try:
            chained["result"] = p.push("t", b"chained:" + f.result().id.encode())
        finally:
            done.set()

    futures = [p.push_async("t", b"%d" % i) for i in range(5)]
    futures[0].add_done_callback(on_done)
    for f in futures:
        f.result(timeout=10)
    assert done.wait(10), "the push from the callback hung"
    assert chained["result"].id
    assert p.push("t", b"after").id                 # the producer still works
    assert p.flush(timeout=10)
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 7


def test_flush_from_a_push_async_callback_is_refused_not_a_hang(db):
    """``flush()`` from a done callback runs in the thread committing the batch it would
    wait for: it waited for itself (for good without a timeout). It is refused with a
    ConfigError naming the cause; the pushes still commit and the producer still works."""
    import threading
    fdq.Supervisor(db).create_topic("t", shards=2)
    p = fdq.Producer(db)
    pushed = 0
    for _attempt in range(20):
        seen = {}
        done = threading.Event()

        def on_done(_f, seen=seen, done=done):
            seen["thread"] = threading.current_thread()
            try:
                seen["flushed"] = p.flush(timeout=5)
            except fdq.ConfigError as e:
                seen["error"] = str(e)
            finally:
                done.set()

        futures = [p.push_async("t", b"%d" % i) for i in range(3)]
        pushed += 3
        futures[0].add_done_callback(on_done)
        assert done.wait(10), "flush from the callback did not return"
        for f in futures:
            assert f.result(timeout=10).id
        if seen["thread"] is not threading.current_thread():
            break       # else committed before the callback was added: it ran here, try again
    else:
        raise AssertionError("the callback never ran in the committing thread in 20 attempts")
    assert "push_async callback" in seen.get("error", ""), seen
    assert p.flush(timeout=10)
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == pushed
