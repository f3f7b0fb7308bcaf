"""``Producer.push_stream``: a stream of messages pushed in order, in transactions sized by
the one rule (``ops.push.TX_WRITE_BYTES`` of writes, every copy counted by the topic's
config read in that transaction, and ``max_messages``), each transaction's results
yielded once committed."""
from __future__ import annotations

import fdq
from fdq.ops.push import TX_WRITE_BYTES, write_bytes
from fdq.ops.topics import read_topic_config
from fdq.keyspace import Keyspace

from fdqtest import log_records, read, stored_bodies, with_faults


def test_transactions_hold_what_fits_every_copy_counted_and_keep_the_order(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    sup.create_subscription("t", "second")
    copies = 1 + len(read_topic_config(db, Keyspace().topic("t")).subs)
    big = [fdq.Envelope(b"%d-" % i + b"x" * 300_000, shard_key=f"k{i}") for i in range(7)]
    small = [fdq.Envelope(b"s%d" % i) for i in range(1200)]
    envs = big + small
    batches = list(fdq.Producer(db).push_stream("t", envs, max_messages=500))
    assert sum(map(len, batches)) == len(envs)
    done = 0
    for results in batches:
        assert 1 <= len(results) <= 500
        # each transaction's bodies, with their copies, within the budget
        assert sum(len(e.body) for e in envs[done:done + len(results)]) * copies <= TX_WRITE_BYTES
        done += len(results)
    assert [len(r) for r in batches[:3]] == [2, 2, 2]     # 300 KB x 3 copies: two fit
    ids = [r.id for results in batches for r in results]
    assert ids == sorted(ids)     # pushed in order: commit order
    assert [fields[4] for fields in log_records(db, "t")] == [e.body[:90_000] if len(e.body) <= 90_000 else b""
                                                               for e in envs]    # (big bodies: chunked)


def test_a_message_over_the_budget_goes_alone_and_none_commits_what_is_pending(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, max_message_bytes=2_000_000)
    sup.create_subscription("t", "second")
    body = b"b" * 1_500_000
    assert write_bytes(len(body), read_topic_config(db, Keyspace().topic("t"))) > TX_WRITE_BYTES
    seen = []

    def source():
        yield fdq.Envelope(b"first")
        yield None      # nothing more to read yet: what came before is committed now
        seen.append(stored_bodies(db, "t")[b"first"])
        yield fdq.Envelope(body)
        yield b"last"   # a plain body is an Envelope's
    batches = list(fdq.Producer(db).push_stream("t", source()))
    assert seen == [1]
    assert [len(r) for r in batches] == [1, 1, 1]
    assert stored_bodies(db, "t") == {b"first": 1, b"": 1, b"last": 1}   # (the big one: in chunks)


def test_push_stream_under_fault_injection_pushes_each_message_once(db, url):
    fdq.Supervisor(db).create_topic("t", shards=3)
    faulty = fdq.connect(with_faults(url, 0.3, 7))
    envs = [fdq.Envelope(b"m%d" % i, shard_key=None if i % 3 else f"k{i}") for i in range(600)]
    results = [r for batch in fdq.Producer(faulty).push_stream("t", envs, max_messages=50) for r in batch]
    assert len(results) == len(envs) and len({r.id for r in results}) == len(envs)
    assert stored_bodies(db, "t") == {e.body: 1 for e in envs}


def test_the_also_hook_runs_in_each_push_transaction_and_a_refusal_pushes_nothing(db):
    """``Producer._push_items(also=)`` (a replay advancing its progress): what ``also``
    writes commits with the pushes it was given, and an exception from it fails that
    transaction whole."""
    fdq.Supervisor(db).create_topic("t", shards=2)
    p = fdq.Producer(db)
    progress = b"qt/progress"

    def advance(tr, taken):
        tr[progress] = taken[-1][1].body
        if taken[-1][1].body == b"stop":
            raise fdq.errors.ReplayTakenOver("fenced")
    envs = [("t", fdq.Envelope(b"m%d" % i)) for i in range(7)]
    sizes = [len(r) for r in p._push_items(iter(envs), max_messages=3, also=advance)]
    assert sizes == [3, 3, 1]
    assert read(db, progress) == b"m6"
    try:
        list(p._push_items(iter([("t", fdq.Envelope(b"x")), ("t", fdq.Envelope(b"stop"))]), also=advance))
    except fdq.errors.ReplayTakenOver:
        pass
    else:
        raise AssertionError("the hook's exception must fail the push")
    assert read(db, progress) == b"m6"
    assert sorted(stored_bodies(db, "t")) == sorted(e.body for _t, e in envs)
