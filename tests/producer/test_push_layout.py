"""What a push writes, byte for byte: the producer builds its stamped keys from prepared
prefixes (``vs_key_parts``) instead of tuple-packing each one, and encodes plain
records directly; the keys must stay exactly the layout's tuple encoding and the records
exactly ``Record.encode()``, for every subscription, keyed and unkeyed, and the counters
must add up."""
from __future__ import annotations

import os
import time

import fdb.tuple
import pytest
from fdb.tuple import Versionstamp

import fdq
from fdq.keyspace import INDEX_PARTS, PUSH_COUNTERS, chunk_part, counters, decode_counters, index_part
from fdq.keyspace import decode_counter, Keyspace, vs_key, vs_key_parts
from fdq.keyspace.codec import Record

from fdqtest import scan


@pytest.mark.parametrize("prefix", [b"", b"\x02fdq\x00", Keyspace().topic("o").log_prefix(7),
                                    Keyspace().topic("o").shard("default", "", 3).ready_prefix])
@pytest.mark.parametrize("uv", [0, 1, 99, 255, 256, 65535])
def test_vs_key_parts_build_the_tuple_layers_incomplete_versionstamp_key(prefix, uv):
    head, offset = vs_key_parts(prefix)
    expected = fdb.tuple.pack_with_versionstamp((Versionstamp(user_version=uv),), prefix=prefix)
    assert head + uv.to_bytes(2, "big") + offset == expected
    assert vs_key(prefix, uv) == expected


def test_pushed_keys_and_records_are_the_layouts_tuple_encoding(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("o", shards=4)
    sup.create_subscription("o", "second")
    p = fdq.Producer(db)
    envs = [fdq.Envelope(f"m{i}".encode(), shard_key=f"k{i % 3}" if i % 2 else None) for i in range(250)]
    results = p.push_many("o", envs)
    results += [p.push("o", b"single"), p.push("o", b"keyed", shard_key="k1")]
    envs += [fdq.Envelope(b"single"), fdq.Envelope(b"keyed", shard_key="k1")]
    rows = dict(scan(db, fdb.tuple.pack(("fdq",))))
    routed = {}
    for env, r in zip(envs, results):
        vs = Versionstamp.from_bytes(bytes.fromhex(r.id))
        record = rows[fdb.tuple.pack(("fdq", "topic", "o", "all", "log", r.shard, vs))]
        decoded = Record.decode(record)
        # an unkeyed message keeps its home shard in the shard key's slot (Record.home)
        home = None if env.shard_key is not None else r.shard
        assert (decoded.shard_key, decoded.home) == (env.shard_key, home)
        assert record == Record(decoded.ts_ms, env.shard_key, None, None, env.body, home=home).encode()
        for sub in ("default", "second"):
            assert rows[fdb.tuple.pack(("fdq", "topic", "o", "subs", sub, "shards", "", r.shard, "ready", vs))] \
                == record
            routed[(sub, r.shard)] = routed.get((sub, r.shard), 0) + 1
    assert sum(1 for k in rows if k.startswith(fdb.tuple.pack(("fdq", "topic", "o", "all", "log")))) == len(envs)

    def counter(*path):
        return decode_counter(rows.get(fdb.tuple.pack(("fdq", "topic", "o") + path)))
    # the topic's push counters are one packed key per part (one add per push transaction,
    # its part by its txid), summed by stats
    parts = scan(db, fdb.tuple.pack(("fdq", "topic", "o", "all", "stats", "push")))
    sums = [sum(col) for col in zip(*(decode_counters(v, len(PUSH_COUNTERS)) for _k, v in parts))]
    st = sup.stats("o")["counters"]
    assert dict(zip(PUSH_COUNTERS, sums)) == {k: st[k] for k in PUSH_COUNTERS}
    assert st["inserted"] == st["routed"] == len(envs)
    assert st["inserted_bytes"] == sum(len(e.body) for e in envs)
    for (sub, n), count in routed.items():
        assert counter("subs", sub, "shards", "", n, "stats", "routed") == count


def test_the_marker_and_dedupe_indexes_have_no_single_append_point(db):
    """Every push transaction appends a marker entry to a by-version index, every message
    with a msg_id a dedupe entry: one range each would be one append point for every push
    (one storage team on a cluster). They are split by a hash of the txid / msg_id over
    INDEX_PARTS ranges: 40 transactions and 400 ids land in many parts, each part in
    version order."""
    p = fdq.Producer(db)
    for t in range(40):
        p.push_many("o", [fdq.Envelope(b"x", msg_id=f"m{t}-{i}") for i in range(10)])
    ts = Keyspace().topic("o")
    marks = scan(db, ts.marks_by_version.key())
    dedupe = scan(db, ts.dedupe_by_version.key())
    assert len(marks) == 40 and len(dedupe) == 400
    for index, rows in ((ts.marks_by_version, marks), (ts.dedupe_by_version, dedupe)):
        parts = {}
        for key, value in rows:
            part, vs = index.unpack(key)
            assert part == index_part(bytes(value)) and 0 <= part < INDEX_PARTS
            parts.setdefault(part, []).append(vs)
        assert len(parts) >= 8, sorted(parts)
        assert all(vss == sorted(vss) for vss in parts.values())


@pytest.mark.parametrize("amounts", [[(1, 1, 100, 130)], [(5, 0, 7, 9), (0, 5, 0, -9)],
                                     [(0, 0, 0, -(2 ** 40))] + [(3, 3, 2 ** 33, 2 ** 40 // 3 + 1)] * 3,
                                     [(-1, 2 ** 62, -(2 ** 62), -1), (1, 0, 2 ** 62, 1)]])
def test_packed_counters_keep_each_slot_exact_through_adds_and_negative_amounts(db, amounts):
    """The push counters share one key and one atomic add (``keyspace.counters``): the
    engine's add carries over the whole value, a negative amount (trim's log_bytes)
    borrows from the next slot, and ``decode_counters`` gives each slot back exactly."""
    key = b"packed-counter-test"
    for a in amounts:
        tr = db.create_transaction()
        tr.add(key, counters(a))
        tr.commit().wait()
    tr = db.create_transaction()
    got = decode_counters(tr[key], 4)
    tr.cancel()
    assert got == [sum(col) for col in zip(*amounts)]


def test_large_bodies_chunks_are_spread_over_parts_found_from_their_record(db):
    """A large body's chunks are appended under a part (``keyspace.chunk_part``: by its
    shard key, or its home shard) in the log and in every subscription, not under one
    prefix per topic: 10 bodies use at least 4 parts. Whoever holds the record finds
    them: the bodies come back whole from both subscriptions, and acks and a trim leave
    no chunk behind."""
    sup = fdq.Supervisor(db)
    sup.create_topic("o", shards=4)
    sup.create_subscription("o", "second")
    p = fdq.Producer(db)
    bodies = {}
    for i in range(10):
        body = os.urandom(150_000 + i)
        bodies[p.push("o", body, shard_key=f"big{i}" if i % 3 else None).id] = body
    ts = Keyspace().topic("o")
    chunk_areas = (ts.all_chunks, ts.subs["default"]["chunks"], ts.subs["second"]["chunks"])
    parts = set()
    for _k, raw in scan(db, ts.log.key()):
        rec = Record.decode(raw)
        assert rec.nchunks
        parts.add(chunk_part(rec))
    for area in chunk_areas:
        assert {area.unpack(k)[0] for k, _v in scan(db, area.key())} == parts
    assert len(parts) >= 4
    for sub in ("default", "second"):
        c = fdq.Consumer(db, "o", subscription=sub, consumer_id=f"c-{sub}")
        try:
            got = {}
            deadline = time.monotonic() + 30
            while len(got) < len(bodies) and time.monotonic() < deadline:
                ms = c.fetch(10, timeout=0.5)
                got.update((m.id, m.body) for m in ms)
                c.ack_many(ms)
        finally:
            c.close()
        assert got == bodies
    sup.trim("o", before_ms=int(time.time() * 1000) + 600_000)
    for area in chunk_areas:
        assert scan(db, area.key()) == []
