"""One damaged record never stops its shard: a queued record that does not decode is
moved to the dead-letter queue (its bytes kept, the reason naming what failed) by the
transaction that meets it, and the shard delivers the rest, in every delivery mode.
Readers of the "all" log skip such an entry with one warning."""
from __future__ import annotations

import logging
import threading

import pytest

import fdq
from fdq.errors import FDQError
from fdq.keyspace import Keyspace, message_id

from fdqtest import FAST_STEADY, scan, sub_stats, wait_for

N, SHARDS = 2000, 4


def _damage(db, key: bytes, bad: bytes):
    tr = db.create_transaction()
    tr[key] = bad
    tr.commit().wait()


def _damage_two(db, topic: str, sub: str = "default") -> dict:
    """Two queued records of shards 1 and 3 damaged through the engine: one byte
    appended to one, three bytes flipped at the start of the other. -> {id: bad bytes}"""
    ts = Keyspace().topic(topic)
    damaged = {}
    for n, mangle in ((1, lambda v: v + b"\x00"), (3, lambda v: bytes(b ^ 0xFF for b in v[:3]) + v[3:])):
        shard = ts.shard(sub, "", n)
        rows = scan(db, shard.ready.key())
        key, value = rows[len(rows) // 2]
        bad = mangle(bytes(value))
        _damage(db, key, bad)
        damaged[message_id(shard.ready.unpack(key)[0])] = bad
    return damaged


@pytest.mark.parametrize("mode", ["at_most_once", "at_least_once", "exactly_once"])
def test_two_damaged_records_are_dead_lettered_and_every_shard_delivers_the_rest(db, mode, caplog):
    """2,000 messages on 4 shards, two damaged: a tail delivers the other 1,998, the two
    are in the DLQ with their bytes as stored and the decode failure as the reason, and
    no error is reported (before: the damaged shards' batches failed to decode at every
    round, ~19 errors a second, and delivered nothing)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=SHARDS)
    p = fdq.Producer(db)
    for i in range(0, N, 500):
        p.push_many("t", [fdq.Envelope(b"m%d" % j, shard_key=f"k{j}") for j in range(i, i + 500)])
    damaged = _damage_two(db, "t")
    got, errors, lock = [], [], threading.Lock()

    def handle(m):
        with lock:
            got.append(m.id)
    kwargs = dict(config=FAST_STEADY, on_error=errors.append)
    if mode == "exactly_once":
        c = fdq.tail(db, "t", lambda tr, m: handle(m), transactional=True, **kwargs)
    else:
        c = fdq.tail(db, "t", handle, acking=mode == "at_least_once", **kwargs)
    try:
        wait_for(lambda: len(got) >= N - 2, 120, what=f"{N - 2} messages delivered")
        wait_for(lambda: sub_stats(db, "t")["dlq"] == 2, 30, what="the two damaged records dead-lettered")
    finally:
        c.shutdown()
    assert len(got) == len(set(got)) == N - 2 and not set(got) & set(damaged)
    assert errors == []
    dead = sup.dlq_list("t")
    assert {d["id"]: d["body"] for d in dead} == damaged
    for d in dead:
        assert d["reason"].startswith("undecodable message record: "), d["reason"]
        assert d["raw"] is True and d["insertion_time"] == 0
    s = sub_stats(db, "t")
    assert s["backlog"] == 0 and s["in_flight"] == 0 and s["dlq"] == 2


def test_a_raw_dead_letter_is_refused_by_redrive_and_purged(db):
    """A dead letter holding an undecodable record cannot be redriven (nothing to put
    back): the redrive says which and what to do; a purge deletes it."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=SHARDS)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % j, shard_key=f"k{j}") for j in range(40)])
    damaged = _damage_two(db, "t")
    with fdq.Consumer(db, "t", config=FAST_STEADY) as c:
        got = []
        while len(got) < 38:
            ms = c.fetch(100, timeout=5)
            assert ms, f"fetched only {len(got)}"
            got += ms
            c.ack_many(ms)
    assert sub_stats(db, "t")["dlq"] == 2
    first = sorted(damaged)[0]
    with pytest.raises(FDQError, match=f"dead letter {first} of t/default holds undecodable bytes"):
        sup.dlq_redrive("t")
    assert sup.dlq_purge("t") == 2
    assert sub_stats(db, "t")["dlq"] == 0


def test_log_readers_skip_a_damaged_entry_with_one_warning(db, caplog):
    """A damaged "all" log entry: a window read and a column scan skip it, the others
    read, one warning line (before: msgpack's error ended the scan)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % j, shard_key=f"k{j}") for j in range(50)])
    ts = Keyspace().topic("t")
    rows = scan(db, ts.log.key())
    _damage(db, rows[10][0], bytes(rows[10][1]) + b"\x00")
    fdq.log._warned.clear()
    with caplog.at_level(logging.WARNING, logger="fdq.log"):
        bodies = [rec.body for _vs, _b, rec in fdq.log.iter_window(db, ts, fdq.log.log_buckets(db, ts), None, None,
                                                                   chunk=8)]
        assert len(bodies) == 49
        cols = {}
        for keys, raws in fdq.log.scan_entries(db, ts, ts.log.range().start, ts.log.range().stop):
            cols = fdq.log.decode_entries(db, ts, keys, raws)
        assert len(cols["body"]) == 49 and sorted(cols["body"]) == sorted(bodies)
    warnings = [r for r in caplog.records if r.name == "fdq.log"]
    assert len(warnings) == 1 and "do not decode" in warnings[0].getMessage()


def test_a_damaged_lease_record_is_dead_lettered_whole_by_its_expiry(db):
    """A lease record damaged while its batch is out: settling its messages finds their
    lease lost, the owner's lease check moves the record whole to the DLQ (raw, under
    its first message's id), and the shard goes on delivering."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(b"m%d" % j) for j in range(5)])
    ts = Keyspace().topic("t")
    with fdq.Consumer(db, "t", config=FAST_STEADY) as c:
        got = []
        while len(got) < 5:
            got += c.fetch(5, timeout=5)
        [(key, value)] = scan(db, ts.shard("default", "", 0).leased.key())
        _damage(db, key, bytes(value)[:-1])
        with pytest.raises(fdq.LeaseLost):
            c.ack_many(got)
        wait_for(lambda: sub_stats(db, "t")["dlq"] == 1, 30, what="the damaged lease record dead-lettered")
        p.push("t", b"after")
        later = []
        while not later:
            later += c.fetch(5, timeout=5)
        assert [m.body for m in later] == [b"after"]
        later[0].ack()
    [dead] = sup.dlq_list("t")
    assert dead["id"] == got[0].id and dead["body"] == bytes(value)[:-1]
    assert dead["reason"].startswith("undecodable lease record: ")
    assert sub_stats(db, "t")["in_flight"] == 0     # its five, as its array header says
