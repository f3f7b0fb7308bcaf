"""``Supervisor.count_log_bytes``: the log-byte count of a topic written before the
count was kept, exact when killed midway, run twice at once, or racing a trim."""
from __future__ import annotations

import time

import fdq
from fdq.keyspace import Keyspace

from fdqtest import commit_retrying, database_url, scan, with_faults


def _log_size(db, ts) -> int:
    """The log's bytes by a full scan: its entries' and body chunks' keys and values."""
    return sum(len(k) + len(v) for space in (ts.log, ts.all_chunks) for k, v in scan(db, space.key()))


def _old_topic(db, name: str, shards: int = 4):
    """A topic as an older FDQ left it: a config without ``log_bytes_counted`` and a
    log whose entries the counter does not hold (it counts from some later push on)."""
    ts = Keyspace().topic(name)
    fdq.topic.write_topic_config(db, ts, fdq.TopicConfig(shards=shards, extend=True))
    p = fdq.Producer(db)
    for r in range(2):
        p.push_many(name, [fdq.Envelope(b"p" * (10 + i), shard_key=f"k{i}") for i in range(30)])
        p.push(name, b"id", msg_id=f"m{r}")
        p.push(name, b"h", headers={"a": "b"})
        p.push(name, b"d", delay=60)
        p.push(name, b"L" * 250_000, shard_key="big")        # body chunks
        p.push(name, b"M" * 90_000 + b"m")
    cut_ms = int(time.time() * 1000) + 1    # the above are older, the rest not
    while int(time.time() * 1000) <= cut_ms:
        time.sleep(0.001)
    for i in range(12):
        p.push_many(name, [fdq.Envelope(b"w" * 100, shard_key=f"w{i}-{j}") for j in range(500)])

    @fdq.transactional
    def forget(tr):     # the older FDQ's pushes added nothing
        tr.add(ts.stat("log_bytes"), (-1234567).to_bytes(8, "little", signed=True))
    forget(db)
    return ts, cut_ms


def test_count_log_bytes_killed_midway_with_pushes_and_trims_is_exact(procs, db):
    """A count killed (kill -9) after its first chunk, with a producer process pushing
    all along and a trim by age between the kill and the rerun (deleting entries
    counted and entries not yet counted): the rerun finishes, and log_bytes equals the
    log's bytes, then stays so under more pushes and trims."""
    sup = fdq.Supervisor(db)
    ts, cut_ms = _old_topic(db, "old")
    assert sup.stats("old")["counters"]["log_bytes"] is None
    prod = procs.start("producer", "p1", "--topic", "old", "--count", 3000, "--batch", 5, "--keys", 7,
                       "--sleep", 0.005)
    w = procs.start("count", "count1", "--topic", "old", "--sleep", 0.5)
    assert procs.readline(w, 60).strip() == "start"
    first = procs.readline(w, 60).strip()
    assert first.startswith("chunk "), first
    procs.kill9(w)
    assert not sup.config("old").log_bytes_counted, "the kill did not land mid-way"
    assert sup.stats("old")["counters"]["log_bytes"] is None
    # every bucket's oldest entries: bucket 0's counted, the others' not yet
    def older(): return [k for k, v in scan(db, ts.log.key()) if fdq.log.Record.decode(v).ts_ms < cut_ms]
    assert {ts.log.unpack(k)[0] for k in older()} == {0, 1, 2, 3}
    assert sup.trim("old", before_ms=cut_ms) > 0
    assert older() == []
    w2 = procs.start("count", "count2", "--topic", "old")
    procs.wait(w2, 120)
    assert sup.config("old").log_bytes_counted
    procs.wait(prod, 120)
    assert sup.stats("old")["counters"]["log_bytes"] == _log_size(db, ts)
    assert scan(db, ts.log_count.key()) == []
    fdq.Producer(db).push_many("old", [fdq.Envelope(b"after" * 50, shard_key=f"a{j}") for j in range(100)])
    assert sup.trim("old", before_ms=int(time.time() * 1000) - 1) > 0
    assert sup.stats("old")["counters"]["log_bytes"] == _log_size(db, ts)
    assert sup.count_log_bytes("old") == 0      # counted: nothing to do


def test_two_counts_at_once_under_fault_injection_are_exact(tmp_path):
    """Two counts at once on fault-injecting connections (retryable errors,
    commit_unknown_result, version jumps), while a thread pushes: nothing counted twice."""
    import threading
    url = database_url(tmp_path / "f.db")
    db = fdq.connect(url)
    sup = fdq.Supervisor(db)
    ts, _cut = _old_topic(db, "old", shards=3)
    stop = threading.Event()
    errors = []

    def push():
        p = fdq.Producer(db)
        i = 0
        while not stop.is_set() and i < 2000:
            p.push("old", b"s" * (i % 300), shard_key=f"s{i % 11}")
            i += 1

    def count(seed):
        try:
            fdq.Supervisor(fdq.connect(with_faults(url, 0.3, seed))).count_log_bytes("old")
        except Exception as e:      # reported below
            errors.append(e)
    pusher = threading.Thread(target=push)
    counters = [threading.Thread(target=count, args=(s,)) for s in (3, 4)]
    pusher.start()
    for t in counters:
        t.start()
    for t in counters:
        t.join(120)
    stop.set()
    pusher.join(60)
    assert not errors, errors
    assert sup.config("old").log_bytes_counted
    assert sup.stats("old")["counters"]["log_bytes"] == _log_size(db, ts)


def test_a_count_chunk_and_a_trim_racing_serialize(db):
    """Both orders of a count chunk and a trim chunk over the same entries, interleaved
    by hand: the one committing second conflicts and redoes its decision (the chunk
    does not count what the trim deleted without subtracting; the trim subtracts what
    the chunk counted meanwhile)."""
    from fdq import logcount
    from fdq import supervisor as sv
    sup = fdq.Supervisor(db)
    for order in ("count first", "trim first"):
        name = "race" + str(len(order))
        ts = Keyspace().topic(name)
        fdq.topic.write_topic_config(db, ts, fdq.TopicConfig(shards=1))
        fdq.Producer(db).push_many(name, [fdq.Envelope(b"r" * (50 + i)) for i in range(10)])
        assert logcount.count_begin(db, ts)
        held = db.create_transaction()
        if order == "count first":
            assert logcount.count_chunk(held, ts, 0, 100) == (10, True)        # not committed
            assert sv.trim_bucket_chunk(db, ts, 0, 2 ** 62, 3)[0] == 3
            assert commit_retrying(held, lambda tr: logcount.count_chunk(tr, ts, 0, 100)) == 1
        else:
            assert sv.trim_bucket_chunk(held, ts, 0, 2 ** 62, 3)[0] == 3        # not committed
            assert logcount.count_chunk(db, ts, 0, 100) == (10, True)
            assert commit_retrying(held, lambda tr: sv.trim_bucket_chunk(tr, ts, 0, 2 ** 62, 3)) == 1
        assert logcount.count_finish(db, ts)
        assert len(scan(db, ts.log.key())) == 7
        assert sup.stats(name)["counters"]["log_bytes"] == _log_size(db, ts), order
