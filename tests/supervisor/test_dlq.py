"""The dead-letter queue: listing large dead letters whole, redriving them, purging
their chunks; unknown subscriptions refused; ``dlq_redrive_ids`` / ``dlq_purge_ids``
act on the dead letters a person picked (by ``dlq_list``'s ids), as the web dashboard
does."""
from __future__ import annotations

import os
import time

import pytest

import fdq
from fdq.keyspace import Keyspace
from fdq.keyspace.codec import CHUNK_BYTES

from fdqtest import FAST, advance_clock, fetch_until, scan, sub_stats, wait_for


def _fetch(c, n, timeout=30):
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"timed out; fetched {[m.body for m in got]}"
        got += c.fetch(100, timeout=0.2)
    return got


def _dead_letters(db, bodies):
    """Push ``bodies`` and dead-letter each (term); returns {body: dead letter id}."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    for b in bodies:
        p.push("t", b, shard_key=b[:8].hex())
    with fdq.Consumer(db, "t", config=FAST) as c:
        for m in _fetch(c, len(bodies)):
            m.term(f"bad {m.body[:8]!r}")
    return {d["body"]: d["id"] for d in sup.dlq_list("t")}


def test_redrive_ids_moves_only_the_chosen_dead_letters_and_they_are_delivered_again(db):
    ids = _dead_letters(db, [b"a", b"b", b"c"])
    sup = fdq.Supervisor(db)
    assert sup.dlq_redrive_ids("t", "default", [ids[b"a"], ids[b"c"]]) == 2
    assert [d["body"] for d in sup.dlq_list("t")] == [b"b"]
    s = sub_stats(db, "t")
    assert (s["dlq"], s["backlog"]) == (1, 2)
    with fdq.Consumer(db, "t", config=FAST) as c:
        got = _fetch(c, 2)
        assert sorted((m.body, m.attempts, m.id) for m in got) == [(b"a", 1, ids[b"a"]), (b"c", 1, ids[b"c"])]
        for m in got:
            m.ack()
    # already redriven: skipped, not counted, nothing doubled
    assert sup.dlq_redrive_ids("t", "default", [ids[b"a"]]) == 0
    assert sub_stats(db, "t")["backlog"] == 0


def test_purge_ids_deletes_only_the_chosen_ones_with_a_large_bodys_chunks(db):
    big = os.urandom(2 * CHUNK_BYTES + 3)
    ids = _dead_letters(db, [big, b"keep"])
    sup = fdq.Supervisor(db)
    chunks = Keyspace().topic("t").subs["default"]["chunks"].key()
    assert scan(db, chunks) != []
    assert sup.dlq_purge_ids("t", "default", [ids[big], ids[big]]) == 1     # a repeat counts once
    assert [d["body"] for d in sup.dlq_list("t")] == [b"keep"]
    assert scan(db, chunks) == []
    assert sub_stats(db, "t")["dlq"] == 1
    assert sup.dlq_purge_ids("t", "default", [ids[big]]) == 0


def test_dlq_ids_refuses_bad_ids_and_unknown_names_before_changing_anything(db):
    ids = _dead_letters(db, [b"a"])
    sup = fdq.Supervisor(db)
    for call in (sup.dlq_redrive_ids, sup.dlq_purge_ids):
        with pytest.raises(fdq.ConfigError, match="'nothex'"):
            call("t", "default", [ids[b"a"], "nothex"])
        with pytest.raises(fdq.ConfigError, match="invalid message id"):
            call("t", "default", [{"id": ids[b"a"]}])
        with pytest.raises(fdq.ConfigError, match="list of message ids"):
            call("t", "default", ids[b"a"])
        with pytest.raises(fdq.SubscriptionNotFound, match="nope"):
            call("t", "nope", [ids[b"a"]])
        with pytest.raises(fdq.TopicNotFound):
            call("missing", "default", [ids[b"a"]])
    assert [d["id"] for d in sup.dlq_list("t")] == [ids[b"a"]]
    assert sup.dlq_redrive_ids("t", "default", []) == 0


def test_large_dead_letter_listed_whole_and_redriven(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    big = os.urandom(3 * CHUNK_BYTES + 7)
    fdq.Producer(db).push("t", big, shard_key="big")
    with fdq.Consumer(db, "t", config=FAST) as c:
        [m] = fetch_until(c, lambda g: len(g) >= 1, 30)
        m.term("too big to handle")
    [dead] = sup.dlq_list("t")
    assert dead["body"] == big and dead["reason"] == "terminated: too big to handle"
    assert sup.dlq_redrive("t") == 1
    with fdq.Consumer(db, "t", config=FAST) as c:
        [m] = fetch_until(c, lambda g: len(g) >= 1, 30)
        assert m.body == big
        m.ack()
    assert scan(db, Keyspace().topic("t").subs["default"]["chunks"].key()) == []


def test_dlq_of_an_unknown_subscription_is_an_error(db):
    """A misspelt subscription is named in an error (it returned 0 / [] as if its DLQ
    were empty, so a redrive or purge 'succeeded' doing nothing)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    for call in (sup.dlq_list, sup.dlq_redrive, sup.dlq_purge):
        with pytest.raises(fdq.SubscriptionNotFound, match="nope"):
            call("t", "nope")
    assert sup.dlq_list("t") == [] and sup.dlq_redrive("t") == 0 and sup.dlq_purge("t") == 0


def test_dlq_purge_removes_large_bodies_chunks(db):
    """A purged dead letter of a large body leaves nothing behind: its chunks (kept in
    the subscription's chunk area with the DLQ entry) go with it; other chunks stay."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    big, kept = os.urandom(2 * CHUNK_BYTES + 1), os.urandom(CHUNK_BYTES + 9)
    p = fdq.Producer(db)
    p.push("t", big, shard_key="k")
    with fdq.Consumer(db, "t", config=FAST) as c:
        [m] = fetch_until(c, lambda g: len(g) >= 1, 30)
        m.term("purge me")
    p.push("t", kept, shard_key="k")         # queued: its chunks must survive the purge
    chunks = Keyspace().topic("t").subs["default"]["chunks"]
    assert len(scan(db, chunks.key())) == 3 + 2
    assert sup.dlq_purge("t") == 1
    assert sup.dlq_list("t") == [] and len(scan(db, chunks.key())) == 2
    with fdq.Consumer(db, "t", config=FAST) as c:
        [m] = fetch_until(c, lambda g: len(g) >= 1, 30)
        assert m.body == kept
        m.ack()
    assert scan(db, chunks.key()) == []


@pytest.mark.parametrize("limit", ["x", -1, 0, 1.5, None, True, 100_001, 10**30])
def test_dlq_list_refuses_a_limit_that_is_not_a_count_it_can_read(db, limit):
    """``limit='x'`` raised ValueError from the engine and ``limit=-1`` an EngineError
    2006 (invalid_option_value); 0 listed every dead letter (0 = no limit to the
    engine). Each is a ConfigError naming the range; 1 and 100,000 list."""
    ids = _dead_letters(db, [b"a", b"b"])
    sup = fdq.Supervisor(db)
    with pytest.raises(fdq.ConfigError, match=r"limit must be an integer from 1 to 100,000"):
        sup.dlq_list("t", limit=limit)
    assert [d["id"] for d in sup.dlq_list("t", limit=1)] == [min(ids.values())]
    assert len(sup.dlq_list("t", limit=100_000)) == 2


def _term(db, body: bytes) -> str:
    """Push ``body`` to "t" and dead-letter it (term); its id."""
    mid = fdq.Producer(db).push("t", body, shard_key=body.decode()).id
    with fdq.Consumer(db, "t", config=FAST) as c:
        [m] = fetch_until(c, lambda g: len(g) >= 1, 30)
        m.term("old or new")
    return mid


def test_dead_letters_age_by_the_database_clock_and_go_by_age(db):
    """A dead letter records when it was dead-lettered (the database clock and the
    read version): ``dead_age_s`` grows as the clock moves on, and ``older_than_s``
    redrives or purges only those dead-lettered that long ago."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    old = _term(db, b"old")
    advance_clock(db, 2 * 3600 * 1000)              # two hours later, by the database clock
    young = _term(db, b"young")
    ages = {d["id"]: d["dead_age_s"] for d in sup.dlq_list("t")}
    assert ages[old] >= 7200 and ages[young] < 600, ages
    assert sup.dlq_redrive("t", older_than_s=3600) == 1
    assert [d["id"] for d in sup.dlq_list("t")] == [young]
    assert sub_stats(db, "t")["backlog"] == 1
    assert sup.dlq_purge("t", older_than_s=3600) == 0 and sup.dlq_redrive("t", older_than_s=3600) == 0
    advance_clock(db, 2 * 3600 * 1000)
    assert sup.dlq_purge("t", older_than_s=3600) == 1
    assert sup.dlq_list("t") == [] and sub_stats(db, "t")["dlq"] == 0
    with pytest.raises(fdq.ConfigError, match="older_than_s"):
        sup.dlq_purge("t", older_than_s=-1)


def test_a_dead_letters_age_grows_with_no_consumer_running(db):
    """With no consumer to advance the database clock, the age goes on by versions (as
    a heartbeat's), so --older-than still finds what was dead-lettered long ago."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    _term(db, b"a")
    first = sup.dlq_list("t")[0]["dead_age_s"]
    wait_for(lambda: sup.dlq_list("t")[0]["dead_age_s"] >= first + 1.0, 30, what="the age growing")
    assert sup.dlq_purge("t", older_than_s=first + 1.0) == 1
