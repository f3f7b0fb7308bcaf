"""Per-batch lease records (at-least-once): a leased batch is one record per shard (split
under FDB's value limit), settled whole with one delete or in part by rewriting it; a
touch restarts one message's ack wait only; expiry, resharding, a subscription reset, a
retried settle or expiry, and lease rows of the older per-message format."""
from __future__ import annotations

import time

import pytest

import fdq
from fdq import delivery
from fdq.engine.sqlite import VALUE_SIZE_LIMIT
from fdq.keyspace import decode_counter, Keyspace, parse_message_id
from fdq.keyspace.codec import LEASE_RECORD_BYTES, Record, shard_of

from fdqtest import drain, FAST, fast, fetch_n, sub_stats, wait_for


def _records(db, topic="t", sub="default", shards=1, tag=""):
    """{shard n: [(key, LeaseRecord)]} of every lease record."""
    ts = Keyspace().topic(topic)
    tr = db.create_transaction()
    return {n: delivery.read_leases(tr.snapshot, ts.shard(sub, tag, n)) for n in range(shards)}


def _leased_ids(db, **kw) -> list:
    return [bytes(e[0]).hex() for recs in _records(db, **kw).values() for _k, lr in recs for e in lr.entries]


def _counts(db) -> tuple:
    s = sub_stats(db, "t")
    return s["backlog"], s["in_flight"], s["dlq"], s["delayed"], fdq.Supervisor(db).stats("t")["counters"]["acked"]


def test_whole_batch_is_one_record_and_one_ack_deletes_it(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i, shard_key=f"k{i}") for i in range(50)])
    with fdq.Consumer(db, "t", config=FAST) as c:
        got = fetch_n(c, 50, timeout=10)
        [(key, lr)] = _records(db)[0]
        assert [bytes(e[0]).hex() for e in lr.entries] == [m.id for m in got]
        assert key == Keyspace().topic("t").shard("default", "", 0).leased.pack(
            (parse_message_id(got[0].id), lr.lease_id))
        assert all(m.attempts == 1 for m in got) and sub_stats(db, "t")["in_flight"] == 50
        c.ack_many(got)
        assert _records(db)[0] == []
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["dlq"]) == (0, 0, 0)


def test_partial_settles_rewrite_the_record(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i, shard_key=f"k{i}") for i in range(10)])
    with fdq.Consumer(db, "t", config=fast(max_deliver=5)) as c:
        got = fetch_n(c, 10, timeout=10)
        got[0].ack()
        got[3].ack()
        assert _leased_ids(db) == [m.id for i, m in enumerate(got) if i not in (0, 3)]
        # One transaction: a nak, a term, a touch and an ack of the same batch.
        c.settle([(got[1], "nak", 0), (got[2], "term", "bad"), (got[4], "touch", None), (got[5], "ack", None)])
        [(_k, lr)] = _records(db)[0]
        assert [bytes(e[0]).hex() for e in lr.entries] == [m.id for m in got[4:5] + got[6:]]
        assert [e[2] for e in lr.entries] == [1, 0, 0, 0, 0]      # the touch is that message's alone
        s = sub_stats(db, "t")
        assert (s["backlog"], s["in_flight"], s["dlq"]) == (6, 5, 1)     # backlog: in flight included
        [again] = fetch_n(c, 1, timeout=10)
        assert (again.id, again.attempts, again.body) == (got[1].id, 2, b"m1")
        [dead] = fdq.Supervisor(db).dlq_list("t")
        assert dead["id"] == got[2].id and dead["attempts"] == 1 and dead["reason"] == "terminated: bad"
        # settling one twice: the second finds it gone
        got[0]._settled = None
        with pytest.raises(fdq.LeaseLost) as e:
            got[0].ack()
        assert e.value.ids == (got[0].id,)
        c.ack_many(got[4:5] + got[6:] + [again])
    assert _records(db)[0] == []
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["dlq"]) == (0, 0, 1)


def test_touch_of_one_message_leaves_its_siblings_to_expire(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i, shard_key="k") for i in range(6)])
    with fdq.Consumer(db, "t", config=fast(ack_wait_s=1.5)) as c:
        got = fetch_n(c, 6, timeout=10)
        kept = got[2]
        back = []
        deadline = time.monotonic() + 30
        while len(back) < 5:
            assert time.monotonic() < deadline, f"siblings not redelivered: {[m.body for m in back]}"
            kept.in_progress()
            back += c.fetch(10, timeout=0.2)
        assert sorted(m.body for m in back) == sorted(m.body for m in got if m is not kept)
        assert all(m.attempts == 2 for m in back)
        kept.ack()      # still leased: no LeaseLost
        c.ack_many(back)
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["dlq"]) == (0, 0, 0)


def test_batch_over_the_value_limit_is_split(db):
    """3 messages of 45,000 bytes: one record would be ~135 KB, over FDB's 100,000-byte
    value limit; and 300 small ones: ~40 KB, split at LEASE_RECORD_BYTES."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(bytes([65 + i]) * 45_000, shard_key="big") for i in range(3)])
    p.push_many("t", [fdq.Envelope(b"s%03d" % i + b"." * 100, shard_key=f"k{i}") for i in range(300)])
    with fdq.Consumer(db, "t", config=FAST) as c:
        got = fetch_n(c, 303, timeout=10)
        tr = db.create_transaction()
        r = Keyspace().topic("t").shard("default", "", 0).leased.range()
        raw = [bytes(kv.value) for kv in tr.snapshot.get_range(r.start, r.stop)]
        assert len(raw) >= 3 + 300 * 120 // LEASE_RECORD_BYTES, len(raw)
        assert max(len(v) for v in raw) < VALUE_SIZE_LIMIT
        assert sorted(_leased_ids(db)) == sorted(m.id for m in got)      # each message in one record
        assert [m.body for m in got[:3]] == [bytes([65 + i]) * 45_000 for i in range(3)]
        # settle across records in one transaction: some acked, one nak'd from the middle
        c.settle([(m, "ack", None) for m in got[:150]] + [(got[200], "nak", 0)])
        [again] = fetch_n(c, 1, timeout=10)
        assert again.id == got[200].id and again.attempts == 2
        c.ack_many([m for m in got[150:] if m is not got[200]] + [again])
    assert _records(db)[0] == []
    assert sub_stats(db, "t")["in_flight"] == 0


def test_unsettled_batch_expires_together_then_dead_letters(db, monkeypatch):
    fdq.Supervisor(db).create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i, shard_key=f"k{i}") for i in range(40)])
    calls = []
    real = delivery.expire_leases

    def counted(*a, **kw):
        out = real(*a, **kw)
        calls.append(len(out))
        return out
    monkeypatch.setattr(delivery, "expire_leases", counted)    # counts, the real expiry runs
    with fdq.Consumer(db, "t", config=fast(ack_wait_s=0.5, max_deliver=2)) as c:
        first = fetch_n(c, 40, timeout=10)
        second = fetch_n(c, 40, timeout=30)       # all expired: redelivered
        assert sorted(m.id for m in second) == sorted(m.id for m in first)
        assert all(m.attempts == 2 for m in second)
        wait_for(lambda: sub_stats(db, "t")["dlq"] == 40, 30, what="the second expiry to dead-letter all")
    assert calls[:1] == [40], calls     # one transaction for the whole expired batch
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["dlq"]) == (0, 0, 40)
    dead = fdq.Supervisor(db).dlq_list("t")
    assert {d["attempts"] for d in dead} == {2} and all("lease expired" in d["reason"] for d in dead)


def test_retried_settle_and_expiry_apply_once(db):
    """What a retry after commit_unknown_result sees: the same settle or expiry run again
    after it committed finds those messages gone and changes nothing."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i, shard_key=f"k{i}") for i in range(6)])
    ks = Keyspace()
    ts = ks.topic("t")
    with fdq.Consumer(db, "t", config=FAST) as c:
        got = fetch_n(c, 6, timeout=10)
        rows = fdq.consumer._settle_rows([(got[0], "nak", 0), (got[1], "ack", None), (got[2], "term", "x")])
        assert delivery.settle(db, ts, rows, 10) == []
        before = _counts(db)
        assert delivery.settle(db, ts, rows, 10) == rows      # all lost: nothing applied twice
        assert _counts(db) == before == (4, 3, 1, 0, 1)
        shard = ts.shard("default", "", 0)
        [(key, lr)] = _records(db)[0]
        epoch = c._owned[("", 0)]
        expiring = [(parse_message_id(m.id), 0) for m in got[3:5]]
        out = delivery.expire_leases(db, ts, shard, c.id, epoch, key, lr.lease_id, expiring, 10)
        assert set(out.values()) == {"requeued"}
        mid = _counts(db)
        again = delivery.expire_leases(db, ts, shard, c.id, epoch, key, lr.lease_id, expiring, 10)
        assert set(again.values()) == {"changed"} and _counts(db) == mid == (4, 1, 1, 0, 1)
        assert _leased_ids(db) == [got[5].id]


def test_reshard_with_batch_leases_in_flight(db):
    """Leased batches split by their messages' new shards (4 -> 7), and parts of one
    batch merged again (7 -> 3); every leased message stays leased exactly once, in its
    shard, with the in-flight counters right; all of them are delivered afterwards."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    keys = [f"k{i}" for i in range(40)]
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i, shard_key=keys[i % 40]) for i in range(200)])
    # Expiry counts a lease's ack wait (3 s, from its record) from when the owner first
    # sees it: c2 below, however long the reshards take.
    c = fdq.Consumer(db, "t", config=fast(ack_wait_s=3))
    got = fetch_n(c, 200, timeout=10)
    c.ack_many(got[::2])
    held = {m.id: m.shard_key for m in got[1::2]}
    c._stop.set()           # its lease check stopped first (it refills _leases from the
    c._thread.join(10)      # shards' records), then keep its leases through close (as a
    c._leases.clear()       # crash would)
    c.close()
    for shards in (7, 3):
        sup.rebalance("t", shards=shards)
        ts = Keyspace().topic("t")
        seen = []
        for n, recs in _records(db, shards=max(shards, 7)).items():
            for _k, lr in recs:
                for vs12, rec, _t in lr.entries:
                    mid = bytes(vs12).hex()
                    seen.append(mid)
                    assert shard_of(Record.decode(rec).shard_key, shards) == n
            tr = db.create_transaction()
            in_flight = decode_counter(tr.snapshot[ts.shard("default", "", n).stat("in_flight")])
            assert in_flight == sum(len(lr.entries) for _k, lr in recs), (shards, n)
        assert sorted(seen) == sorted(held), f"after resharding to {shards}"
    # A consumer with a short ack wait gets every held message back (its leases expire).
    back = {}
    with fdq.Consumer(db, "t", config=FAST) as c2:
        deadline = time.monotonic() + 60
        while set(back) != set(held):
            assert time.monotonic() < deadline, f"{len(back)} of {len(held)} came back"
            ms = c2.fetch(100, timeout=0.2)
            assert not {m.id for m in ms} & set(back), "delivered twice"
            back.update((m.id, m) for m in ms)
            c2.ack_many(ms)
        assert all(m.attempts == 2 for m in back.values())
    s = sub_stats(db, "t")
    assert (s["backlog"], s["in_flight"], s["dlq"]) == (0, 0, 0)


def test_reset_skips_every_leased_message_of_a_batch(db):
    """A subscription reset leaves leased messages alone, those in the middle of a batch's
    record too (its key names only the first)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    sup.create_subscription("t", "r")
    ids = [r.id for r in fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i, shard_key="k") for i in range(8)])]
    c = fdq.Consumer(db, "t", subscription="r", config=FAST)
    try:
        first = fetch_n(c, 3, timeout=10)
        first[0].ack()
        sup.reset("t", "r", 0)
        rest = drain(c, first_wait_s=0.3, wait_s=0.3, settle="ack_many")   # until a fetch comes back empty
        assert sorted(m.id for m in rest) == sorted(set(ids) - {first[1].id, first[2].id})
        c.ack_many(first[1:])
    finally:
        c.close()
    st = sup.stats("t")["subscriptions"]["r"]
    assert st["in_flight"] == 0 and st["backlog"] == 0
