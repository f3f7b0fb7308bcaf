"""Pause and play: pushes while paused are held (inserted) and play routes them, in
transactions each under FDB's limit (big messages, delayed ones by their due time),
holds that never block other pushes, a killed play rerun, plays under a steady push
stream or meeting a reshard."""
from __future__ import annotations

import collections
import json
import os
import threading
import time

import pytest

import fdq
from fdq import supervisor as sv
from fdq.keyspace import Keyspace
from fdq.ops.topics import update_topic_config

from fdq.ops.play import play_chunk
from fdqtest import advance_clock, engine_errors, fetch_ids, read_lines, read_version, scan, sub_stats, wait_for
from ophelpers import (check_order, consume, consume_recorded, drain_bodies, fan_out_topic, fetch_acked, push_keys,
                       ready_ids, Recorder, reshard_steps, SUPERVISED)


SUBS = 9        # the default subscription and 8 more


def test_play_routes_a_big_message_after_smaller_ones_within_one_transaction_each(db):
    """A play chunk checked its byte budget (2 MB) only before each message, so a
    message a push had accepted (its copies for every subscription under 9 MB) routed
    after ~2 MB of others took the transaction past FDB's 10 MB: transaction_too_large,
    not retryable, the same chunk on every rerun: the topic could never be played."""
    s = fan_out_topic(db)
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
        assert drain_bodies(db, "t", sub, 2) == [small, big]


def test_play_routes_a_delayed_message_by_its_push_time_due(db):
    """A delayed message pushed while paused waited ``delay`` from the play, not from its
    push: paused for longer than its delay, it still waited the whole delay again."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.pause("t")
    p = fdq.Producer(db)
    soon = p.push("t", b"soon", shard_key="b", delay=1).id
    late = p.push("t", b"later", shard_key="a", delay=600).id
    advance_clock(db, 2000)
    assert sup.play("t") == 2
    st = sub_stats(db, "t", "default")
    assert (st["backlog"], st["delayed"]) == (2, 1)
    assert fetch_ids(db, "t", "default") == [soon]
    advance_clock(db, 600_000)
    assert fetch_ids(db, "t", "default") == [late]


def test_rerun_of_a_drain_keeps_a_later_pause(db):
    """A reshard killed after its finish, before routing what was pushed meanwhile, and
    the topic paused since: running rebalance again leaves it paused (the pending
    messages wait for its play), and play routes them."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    p = fdq.Producer(db)
    sv.reshard_begin(db, ts, 3)
    first = p.push("t", b"first", shard_key="a").id
    reshard_steps(db, ts, 3, 2)
    sup.pause("t")
    sup.rebalance("t")
    config = sup.config("t")
    assert (config.shards, config.resharding_to, config.paused) == (3, None, True)
    assert sup.stats("t")["counters"]["pending"] == 1
    assert sup.play("t") == 1
    got = consume(db, 1, 30)
    assert [i for i, _k, _b in got] == [first]


def test_pause_right_after_play_routed_everything_holds(db):
    """A pause committed just after play's last chunk (which resumes the topic) was
    undone: play took the topic still paused for pushes that landed meanwhile and
    played it again."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.pause("t")
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m", shard_key=f"k{j}") for j in range(10)])

    paused_again = []

    def progress(_n):
        if not paused_again and not sup.config("t").paused:   # play has just resumed it:
            paused_again.append(sup.pause("t"))                # an operator pauses
    assert sup.play("t", progress=progress) == 10
    assert paused_again
    assert sup.config("t").paused, "the later pause was undone"


def test_push_while_paused_that_play_could_never_route_is_refused(db):
    """A push while paused writes the log only, so it took a body that routing to every
    subscription cannot write in one transaction: play then failed on it forever
    (transaction_too_large), the topic stuck paused with everything behind it. Such a
    push is refused now, with a clear error; the rest plays."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    for i in range(9):
        sup.create_subscription("t", f"s{i}")
    sup.pause("t")
    p = fdq.Producer(db)
    with pytest.raises(fdq.MessageTooLarge, match="too large to route"):
        p.push("t", b"y" * (1 << 20))
    small = p.push("t", b"z", shard_key="a").id
    assert sup.play("t") == 1
    assert not sup.config("t").paused
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"]) == (1, 1)
    cons = fdq.Consumer(db, "t", subscription="s3", config=fdq.ConsumerConfig(ack_wait_s=600))
    try:
        got = fetch_acked(cons, 1, 30)
    finally:
        cons.close()
    assert [i for i, _k, _b in got] == [small]


def test_play_finishes_under_a_steady_push_stream(procs, db, monkeypatch, tmp_path):
    """``play``'s last chunk reads the whole pending area to resume the topic in the
    same transaction; every push landing there meanwhile made it conflict, so under a
    steady stream play retried until a gap in the pushes (forever, for a service that
    keeps pushing hard). Its brief hold lets it finish, without one conflict, while 3
    producer processes push (each still pushing when it returned: they stop only when
    told), nothing lost, each key in push order."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    sup.pause("t")
    stop = tmp_path / "stop"
    prods = [procs.start("producer", f"p{i}", "--count", 60000, "--batch", 1, "--keys", 5,
                         "--sleep", 0.002, "--until", stop) for i in range(3)]
    try:
        wait_for(lambda: sup.stats("t")["counters"]["inserted"] >= 600, 60, what="pushes under way")
        retries = collections.Counter()     # this process's retries: the play's (producers are processes)
        real = fdq.engine.retry.retry_or_raise     # where transact (under transactional) retries

        def counted(tr, e):
            retries[getattr(e, "code", None)] += 1
            return real(tr, e)
        monkeypatch.setattr(fdq.engine.retry, "retry_or_raise", counted)
        done = []
        player = threading.Thread(target=lambda: done.append(sup.play("t")), daemon=True)
        player.start()
        player.join(60)
        assert done, "play did not finish within 60 s"
        pushing = [p.poll() is None for p in prods]
    finally:
        stop.touch()    # the producers end their stream
    assert all(pushing), "play finished only once the pushes stopped"
    assert not retries, f"play retried: {dict(retries)}"
    assert not sup.config("t").paused
    for p in prods:
        procs.wait(p, 120)
    pushed = [json.loads(line) for p in prods for line in read_lines(p.out)]
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (len(pushed), len(pushed), 0)
    got = consume(db, len(pushed), 60)
    assert sorted(i for i, _k, _b in got) == sorted(x["id"] for x in pushed)
    order = collections.defaultdict(list)
    for _i, key, body in got:
        order[key].append(int(body.decode().rsplit(":", 1)[1]))
    assert all(seqs == sorted(seqs) for seqs in order.values()), "a key out of push order"


def test_play_ending_on_a_pause_does_not_route_twice(db):
    """A play whose hold a pause ended routes what it reads and returns; that chunk
    added no read conflict for what it routed, so a second play routing the same
    pending messages meanwhile (a full chunk, no config write) let it commit too: each
    message routed twice (routed > inserted, a backlog of phantom messages for good)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    ts = Keyspace().topic("t")
    p = fdq.Producer(db)
    sup.pause("t")
    p.push_many("t", [fdq.Envelope(b"a%d" % j, shard_key="k") for j in range(3)])
    moved, done, hold = sv.play_chunk(db, ts, sv.CHUNK)      # play A: routes, holds
    assert (moved, done) == (3, False) and hold is not None
    sup.pause("t")                                           # ends A's hold
    p.push_many("t", [fdq.Envelope(b"b%d" % j, shard_key="k") for j in range(3)])
    tr_a = db.create_transaction()                           # A's next chunk, not committed yet
    assert sv.play_chunk(tr_a, ts, sv.CHUNK, hold)[:2] == (3, True)
    p.push_many("t", [fdq.Envelope(b"c%d" % j, shard_key="k") for j in range(3)])
    assert sv.play_chunk(db, ts, 6)[:2] == (6, False)        # play B: a full chunk, the same 3 first
    try:
        tr_a.commit().wait()                                 # A commits after B: must conflict
        committed = True
    except engine_errors() as e:
        assert e.code == 1020
        committed = False
    sup.play("t")
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (9, 9, 0), f"A committed: {committed}"
    got = consume(db, 9, 30)
    assert len(got) == 9 and sub_stats(db, "t")["backlog"] == 0


def test_play_of_a_running_topic_writes_no_config(db):
    """``play`` (NSQ's /topic/unpause) of a topic that is not paused held and unheld it:
    two config writes, each making every push and consumer transaction in flight that
    read the config conflict and retry. Nothing to route and nothing to resume: no write."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    fdq.Producer(db).push("t", b"x")
    tr = db.create_transaction()
    tr[b"\x01probe"] = tr[ts.config_key]     # read the config, as a push does
    assert sup.play("t") == 0
    tr.commit().wait()                                # EngineError 1020 if play wrote it
    assert sup.config("t").held_at is None and not sup.config("t").paused


def test_a_hold_from_another_version_space_does_not_block_pushes(db):
    """``held_at`` is a version of the database that wrote it: a topic paused with one
    (a play killed mid-hold) restored or copied into a database whose versions are
    lower held every push to it until that one's versions caught up (the producer
    retries TopicHeld without end). A hold ahead of the read version is not one."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    ts = Keyspace().topic("t")
    sup.pause("t")
    rv = read_version(db)
    update_topic_config(db, ts, held_at=rv + 10 ** 12)    # as restored elsewhere
    out = []
    t = threading.Thread(target=lambda: out.append(fdq.Producer(db).push("t", b"x")), daemon=True)
    t.start()
    t.join(10)
    assert out, "push held by a hold from another database's versions"
    assert sup.play("t") == 1 and sup.config("t").held_at is None


def test_a_reshard_beginning_during_play_is_reported(db):
    """A reshard beginning while a paused topic's play routes stopped the play, which
    returned as if done: the topic stayed paused and the rebalance did not play it."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.pause("t")
    p = fdq.Producer(db)
    ids = [r.id for r in p.push_many("t", [fdq.Envelope(b"m", shard_key=f"k{j % 9}") for j in range(sv.CHUNK + 100)])]
    ts = Keyspace().topic("t")
    began = []

    def progress(_n):
        if not began:
            began.append(sv.reshard_begin(db, ts, 3))     # another operator's rebalance starts
    with pytest.raises(fdq.ConfigError, match="rebalance"):
        sup.play("t", progress=progress)
    assert sup.config("t").paused
    sup.rebalance("t")                         # finishes the reshard to 3 (paused: no play)
    assert sup.play("t") == 100 and not sup.config("t").paused
    got = consume(db, len(ids), 30)
    assert sorted(i for i, _k, _b in got) == sorted(ids)


def test_pause_play_inserted_vs_routed(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    first = push_keys(db, "t", 100, 10, "a")
    sup.pause("t")
    paused = push_keys(db, "t", 300, 10, "b")
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (400, 100, 300)
    assert sub_stats(db, "t")["backlog"] == 100
    rec = Recorder()
    consumer = fdq.tail(db, "t", rec, transactional=True, config=SUPERVISED)
    try:
        time.sleep(0.5)   # a paused topic delivers nothing, even what was routed before
        assert rec.committed(db) == {}
        assert sup.play("t") == 300
        assert not sup.config("t").paused
        c = sup.stats("t")["counters"]
        assert (c["inserted"], c["routed"], c["pending"]) == (400, 400, 0)
        wait_for(lambda: len(rec.committed(db)) == 400, 60, what="all 400 consumed")
    finally:
        consumer.shutdown()
    assert set(rec.committed(db).values()) == {1}
    check_order(first + paused, rec.seen(db))


@pytest.mark.slow
def test_play_killed_midway_and_rerun(procs, db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    sup.pause("t")
    pushed = push_keys(db, "t", 8000, 40)
    assert sup.stats("t")["counters"]["pending"] == 8000
    p = procs.start("play", "play", "--topic", "t")
    assert procs.readline(p, 60).strip() == "start"
    assert procs.readline(p, 60).startswith("chunk")     # at least one chunk committed
    procs.kill9(p)
    c = sup.stats("t")["counters"]
    assert 0 < c["pending"] < 8000, f"the kill did not land midway: {c}"
    assert sup.config("t").paused
    assert sup.play("t") == c["pending"]
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (8000, 8000, 0)
    ready = ready_ids(db)
    assert len(ready) == 8000 and set(ready) == {i for i, _k, _b in pushed}
    assert sub_stats(db, "t")["backlog"] == 8000
    rec = consume_recorded(db)
    counts = rec.committed(db)
    assert len(counts) == 8000 and set(counts.values()) == {1}
    check_order(pushed, rec.seen(db))


def test_play_merges_the_pending_buckets_gap_free_in_push_order(db):
    """Messages pushed while paused are kept per log bucket (no single append point a
    paused topic's pushes share); play merges the buckets by versionstamp at its one
    read version, so every chunk routes the oldest pending messages and never one
    before an older one is routed: after each chunk (40 messages, more than it reads of
    each bucket, buckets of uneven lengths), what is routed is a prefix of the push order."""
    s = fdq.Supervisor(db)
    s.create_topic("t", shards=8)
    s.create_subscription("t", "default")
    p = fdq.Producer(db)
    s.pause("t")
    # a run in one bucket longer than a chunk reads of each bucket (16), then all of them
    keys = ["hot"] * 30 + [f"k{i % 11}" for i in range(60)]
    ids = [p.push("t", b"m%d" % i, shard_key=k).id for i, k in enumerate(keys)]
    ts = Keyspace().topic("t")

    def pending():
        return [ts.pending.unpack(k) for k, _v in scan(db, ts.pending.key())]
    assert len({b for b, _vs in pending()}) >= 4
    order = sorted(ids)
    hold, done, chunks = None, False, 0
    while not done:
        chunks += 1
        assert chunks < 100
        _n, done, hold = play_chunk(db, ts, 40, hold)
        left = {vs.to_bytes().hex() for _b, vs in pending()}
        routed = [i for i in order if i not in left]
        assert routed == order[:len(routed)], f"chunk {chunks} routed past an older pending message"
    assert pending() == [] and s.stats("t")["counters"]["routed"] == len(ids)
    assert sorted(fetch_ids(db, "t", "default")) == order
