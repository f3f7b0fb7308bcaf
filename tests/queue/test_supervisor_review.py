"""Supervisor operations interrupted or overlapping (found in review): retention that
would delete messages not yet routed, the window between a reshard's finish and its
play, a play or argument-less rebalance run while a reshard is unfinished, and the
counters of shards a shrinking reshard removes."""
from __future__ import annotations

import collections
import json
import threading
import time

import pytest

import fdq
from fdq import supervisor as sv
from fdq.keyspace import Keyspace
from fdq.keyspace.codec import shard_of

from fdqtest import engine_errors, read_lines, read_version, sub_stats, wait_for


def _fetch_until(c, want: int, timeout: float) -> list:
    """Fetch (and ack) until ``want`` messages came or ``timeout`` passed."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        for m in c.fetch(want - len(got), timeout=0.2):
            got.append((m.id, m.shard_key, m.body))
            m.ack()
    return got


def _consume(db, want: int, timeout: float) -> list:
    """``_fetch_until`` with a consumer of its own (leases of 10 minutes), closed after."""
    cons = fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=600))
    try:
        return _fetch_until(cons, want, timeout)
    finally:
        cons.close()


def _reshard_steps(db, ts, shards: int, old: int):
    """What ``rebalance(shards=...)`` commits before its play: begin, every chunk, finish
    (a run kill -9'd right after ``reshard_finish`` leaves exactly this state)."""
    sv.reshard_begin(db, ts, shards)
    for n in range(max(old, shards)):
        for area in ("ready", "delayed", "leased"):
            after = None
            while True:
                _r, after, done = sv.reshard_chunk(db, ts, "default", "", n, area, shards, sv.CHUNK, after)
                if done:
                    break
    sv.reshard_finish(db, ts)


@pytest.mark.parametrize("how", ["age", "size"])
def test_trim_keeps_messages_pushed_while_paused(db, how):
    """Retention deleted log entries still waiting in the pending area (pushed while
    paused): play then found no entry and dropped them, lost for good (inserted >
    routed forever). Big bodies too: their chunks are needed to route them."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4, retention_bytes=1000 if how == "size" else None)
    p = fdq.Producer(db)
    before = [r.id for r in p.push_many("t", [fdq.Envelope(b"o" * 300, shard_key=f"k{j}") for j in range(10)])]
    sup.pause("t")
    paused = [r.id for r in p.push_many("t", [fdq.Envelope(b"x" * 300, shard_key=f"k{j}") for j in range(10)])]
    big = b"B" * 250_000    # split into body chunks
    paused.append(p.push("t", big, shard_key="k0").id)
    sup.trim("t", before_ms=2 ** 62 if how == "age" else None)
    assert sup.play("t") == len(paused)
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (21, 21, 0)
    got = _consume(db, 21, 30)
    assert sorted(i for i, _k, _b in got) == sorted(before + paused)
    assert [b for i, _k, b in got if i == paused[-1]] == [big]


def test_reshard_killed_after_finish_keeps_key_order(db):
    """Messages pushed during a reshard wait in the pending area until the play that
    follows ``reshard_finish``. The finish made the topic route again at once, so a push
    between the finish and that play (or after a kill between them) went straight to
    a ready queue and was consumed before the older pending message of its key, which
    stayed stranded until someone ran rebalance again."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    key = next(f"k{i}" for i in range(100) if shard_of(f"k{i}", 2) != shard_of(f"k{i}", 3))
    p = fdq.Producer(db)
    sv.reshard_begin(db, ts, 3)
    first = p.push("t", b"first", shard_key=key).id      # during the reshard: pending
    _reshard_steps(db, ts, 3, 2)                          # ... and killed before its play
    second = p.push("t", b"second", shard_key=key).id
    cons = fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=600))
    try:
        early = _fetch_until(cons, 1, 1.5)     # nothing may overtake the pending message
        sup.rebalance("t", shards=3)            # the rerun finishes the job
        got = early + _fetch_until(cons, 2 - len(early), 30)
    finally:
        cons.close()
    assert [i for i, _k, _b in got] == [first, second], "per-key order broken"
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"]) == (2, 2)
    assert sup.config("t").resharding_to is None and sup.config("t").shards == 3


def test_play_during_unfinished_reshard_does_not_spin(procs, db):
    """``play`` of a paused topic whose reshard was killed midway looped forever (each
    play chunk returns at once while resharding, the topic stays paused); and
    ``rebalance`` without a count (the CLI's plain ``fdq rebalance``) left the reshard
    unfinished, the topic consuming nothing. Play now says to finish the reshard, and
    an argument-less rebalance finishes it."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    ids = [r.id for r in p.push_many("t", [fdq.Envelope(b"m", shard_key=f"k{j}") for j in range(20)])]
    sup.pause("t")
    ts = Keyspace().topic("t")
    sv.reshard_begin(db, ts, 3)                # a rebalance killed right after it began
    ids.append(p.push("t", b"late", shard_key="k1").id)
    w = procs.start("play", "play", "--topic", "t")
    rc = w.wait(timeout=30)                   # the old code never returns (killed at teardown)
    assert rc != 0 and "rebalance" in procs.stderr(w), procs.stderr(w)
    sup.rebalance("t")                         # no count: finishes the reshard to 3
    config = sup.config("t")
    assert (config.shards, config.resharding_to, config.paused) == (3, None, True)
    assert sup.play("t") == 1
    got = _consume(db, 21, 30)
    assert sorted(i for i, _k, _b in got) == sorted(ids)


def test_shrinking_reshard_keeps_subscription_counters(db):
    """The subscription's emitted / acked / done counters are sums over the current
    shards: a reshard to fewer shards dropped those of the removed shards from stats."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(b"m", shard_key=f"k{j}") for j in range(40)])
    assert len(_consume(db, 30, 30)) == 30
    p.push_many("t", [fdq.Envelope(b"n", shard_key=f"k{j}") for j in range(5)])
    before = sub_stats(db, "t")
    assert (before["emitted"], before["acked"], before["backlog"]) == (30, 30, 15)
    sup.rebalance("t", shards=2)
    after = sub_stats(db, "t")
    assert (after["emitted"], after["acked"], after["backlog"], after["in_flight"]) == (30, 30, 15, 0)
    assert sum(s["done"] for s in after["shards"]) == 30
    sup.rebalance("t", shards=2)              # a rerun changes nothing
    assert sub_stats(db, "t")["acked"] == 30


def test_stats_and_max_backlog_count_a_growing_reshards_new_shards(db):
    """Midway through a reshard to more shards, the messages already moved sit in shards
    beyond the old count: stats' backlog and max_backlog counted only the old ones."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, max_backlog=40)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(b"m", shard_key=f"k{j}") for j in range(40)])
    ts = Keyspace().topic("t")
    sv.reshard_begin(db, ts, 6)
    after = None
    while True:       # shard 0's ready queue moved to the new layout, shard 1's not yet
        _r, after, done = sv.reshard_chunk(db, ts, "default", "", 0, "ready", 6, sv.CHUNK, after)
        if done:
            break
    st = sub_stats(db, "t")
    assert st["backlog"] == 40 and any(s["backlog"] for s in st["shards"] if s["shard"] >= 2)
    with pytest.raises(fdq.BacklogFull):
        p.push("t", b"over", shard_key="k0")
    sup.rebalance("t")                         # finishes the reshard
    assert sup.config("t").shards == 6 and sub_stats(db, "t")["backlog"] == 40


def test_dlq_redrive_during_reshard_is_not_stranded(db):
    """A DLQ redrive committed during a reshard, after the reshard's pass over the
    message's old shard, put it in that shard's ready queue by the old count: with
    fewer shards that shard is gone and the message was never delivered again."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    key = next(f"k{i}" for i in range(100) if shard_of(f"k{i}", 2) == 1)
    pushed = fdq.Producer(db).push("t", b"x", shard_key=key).id
    c = fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=600))
    try:
        [m] = _fetch_until_leased(c, 1, 30)
        m.term("bad")
        assert sub_stats(db, "t")["dlq"] == 1
        ts = Keyspace().topic("t")
        sv.reshard_begin(db, ts, 1)
        for n in range(2):
            for area in ("ready", "delayed", "leased"):
                sv.reshard_chunk(db, ts, "default", "", n, area, 1, sv.CHUNK)
        assert sup.dlq_redrive("t") == 1          # while the reshard runs
        sv.reshard_finish(db, ts)                 # the reshard's own next steps
        sup.play("t")
        got = _fetch_until(c, 1, 10)
    finally:
        c.close()
    assert [i for i, _k, _b in got] == [pushed], f"stranded; stats {sub_stats(db, 't')}"
    s = sub_stats(db, "t")
    assert (s["dlq"], s["backlog"]) == (0, 0)


def _fetch_until_leased(c, want: int, timeout: float) -> list:
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += c.fetch(want - len(got), timeout=0.2)
    return got


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
    _reshard_steps(db, ts, 3, 2)
    sup.pause("t")
    sup.rebalance("t")
    config = sup.config("t")
    assert (config.shards, config.resharding_to, config.paused) == (3, None, True)
    assert sup.stats("t")["counters"]["pending"] == 1
    assert sup.play("t") == 1
    got = _consume(db, 1, 30)
    assert [i for i, _k, _b in got] == [first]


def test_new_reshard_after_an_unfinished_drain(db):
    """A reshard killed before routing what was pushed meanwhile, then a reshard to yet
    another count: it finishes the first one's routing, then changes the count."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    ts = Keyspace().topic("t")
    p = fdq.Producer(db)
    ids = [r.id for r in p.push_many("t", [fdq.Envelope(b"a", shard_key=f"k{j}") for j in range(20)])]
    sv.reshard_begin(db, ts, 3)
    ids += [r.id for r in p.push_many("t", [fdq.Envelope(b"b", shard_key=f"k{j}") for j in range(20)])]
    _reshard_steps(db, ts, 3, 2)
    assert sup.rebalance("t", shards=5).shards == 5
    config = sup.config("t")
    assert (config.shards, config.resharding_to, config.paused) == (5, None, False)
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"]) == (40, 40)
    got = _consume(db, 40, 30)
    assert sorted(i for i, _k, _b in got) == sorted(ids)
    want = {}
    for i, k, _b in got:
        want.setdefault(k, []).append(i)
    assert all(v == sorted(v) for v in want.values()), "per-key order broken"


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


def test_replay_racing_a_trim_pushes_no_empty_bodies(db):
    """A replay reads the log in pages and each large body's chunks apart: a trim
    committed in between (here: after the replay's first chunk) left entries the replay
    had read whose chunks were gone, and it replayed them with an empty body."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    big = [bytes([65 + i]) * 150_000 for i in range(20)]
    p = fdq.Producer(db)
    for b in big:
        p.push("t", b, shard_key="k")
    trimmed = []

    def progress(_n):
        if not trimmed:
            trimmed.append(sup.trim("t", before_ms=2 ** 62))
    n = p.replay("t", 0, progress=progress)
    assert trimmed[0] > 20      # the originals and what the replay pushed so far
    got = _consume(db, 20 + n, 30)
    assert len(got) == 20 + n
    assert all(b in big for _i, _k, b in got), "a replayed message lost its body"
    assert 0 < n < 20       # those trimmed before the replay reached them are not replayed


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
        got = _fetch_until(cons, 1, 30)
    finally:
        cons.close()
    assert [i for i, _k, _b in got] == [small]


def test_play_finishes_under_a_steady_push_stream(procs, db, monkeypatch):
    """``play``'s last chunk reads the whole pending area to resume the topic in the
    same transaction; every push landing there meanwhile made it conflict, so under a
    steady stream play retried until a gap in the pushes (forever, for a service that
    keeps pushing hard). Its brief hold lets it finish, without one conflict, while 3
    producer processes push (pushes landed after it returned), nothing lost, each key
    in push order."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    sup.pause("t")
    prods = [procs.start("producer", f"p{i}", "--count", 4000, "--batch", 1, "--keys", 5) for i in range(3)]
    wait_for(lambda: sup.stats("t")["counters"]["inserted"] >= 600, 60, what="pushes under way")
    retries = collections.Counter()     # this process's retries: the play's (producers are processes)
    real = fdq.engine.retry_or_raise

    def counted(tr, e):
        retries[getattr(e, "code", None)] += 1
        return real(tr, e)
    monkeypatch.setattr(fdq.engine, "retry_or_raise", counted)
    done = []
    player = threading.Thread(target=lambda: done.append(sup.play("t")), daemon=True)
    player.start()
    player.join(60)
    assert done, "play did not finish within 60 s"
    at_play = sup.stats("t")["counters"]["inserted"]
    assert not retries, f"play retried: {dict(retries)}"
    assert not sup.config("t").paused
    for p in prods:
        procs.wait(p, 120)
    pushed = [json.loads(line) for p in prods for line in read_lines(p.out)]
    assert len(pushed) == 12000 and at_play < 12000, "play finished only once the pushes stopped"
    c = sup.stats("t")["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (12000, 12000, 0)
    got = _consume(db, 12000, 60)
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
    got = _consume(db, 9, 30)
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
    fdq.topic.update_topic_config(db, ts, held_at=rv + 10 ** 12)    # as restored elsewhere
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
    got = _consume(db, len(ids), 30)
    assert sorted(i for i, _k, _b in got) == sorted(ids)
