"""A push retried after a maybe-committed attempt stores its messages once: the retry
marker of a group commit that gives up, and of a push_many of thousands."""
from __future__ import annotations

import threading

import fdq
from fdq.errors import EngineError, is_maybe_committed
from fdq.keyspace import Keyspace

from fdqtest import scan, stored_bodies, with_faults


def test_a_group_commit_that_gives_up_after_a_maybe_committed_attempt_pushes_nothing_twice(db, url):
    # The database's retry limit makes a push give up; when an attempt before may have
    # committed (commit_unknown_result after a real commit), the group commit must not
    # push its messages again in halves (new transactions: duplicates), and a caller
    # told "not committed" must indeed have nothing stored.
    fdq.Supervisor(db).create_topic("t", shards=2)
    faulty = fdq.connect(with_faults(url, 0.5, 3))
    faulty.options.set_transaction_retry_limit(1)
    p = fdq.Producer(faulty)
    threads, per_thread = 4, 25
    outcome = {}
    start = threading.Barrier(threads)

    def run(t):
        start.wait(30)
        for i in range(per_thread):
            body = f"{t}:{i}".encode()
            try:
                outcome[body] = p.push("t", body)
            except EngineError as e:
                outcome[body] = e
    ths = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(120)
    assert len(outcome) == threads * per_thread
    stored = stored_bodies(db, "t")
    twice = sorted(b for b, n in stored.items() if n > 1)
    assert not twice, f"{len(twice)} messages stored more than once, e.g. {twice[:3]}"
    lost = [b for b, r in outcome.items() if isinstance(r, fdq.PushResult) and not stored[b]]
    assert not lost
    wrong = [b for b, r in outcome.items() if isinstance(r, EngineError) and not is_maybe_committed(r) and stored[b]]
    assert not wrong, f"{len(wrong)} pushes reported not committed are stored, e.g. {wrong[:3]}"
    assert sum(isinstance(r, EngineError) for r in outcome.values()), "the scenario made no push give up"


def test_push_many_of_thousands_fits_its_retry_marker(db, url):
    # A push transaction's retry marker (its results, read back after
    # commit_unknown_result) is one value: it overflowed FDB's 100,000-byte limit from
    # ~1,400 messages on a topic with a 64-character name, ~20,000 on any topic, and
    # ~3,000 re-sent msg_ids (each a duplicate naming its first id): the push could
    # never commit. Large markers are split over several keys, read back whole on a
    # retry and removed whole by trim.
    name = "n" * 64
    fdq.Supervisor(db).create_topic(name, shards=4, dedupe_window_s=600)
    p = fdq.Producer(db)
    first = p.push_many(name, [fdq.Envelope(b"b%d" % i, msg_id=f"id-{i}") for i in range(5000)])
    again = p.push_many(name, [fdq.Envelope(b"b%d" % i, msg_id=f"id-{i}") for i in range(5000)])
    assert all(r.duplicate for r in again) and [r.id for r in again] == [r.id for r in first]
    assert len(p.push_many("t", [fdq.Envelope(b"x") for _ in range(30_000)])) == 30_000
    # Retries after commit_unknown_result read the split marker back: exact results.
    faulty = fdq.Producer(fdq.connect(with_faults(url, 0.3, 5)))
    for k in range(6):
        envs = [fdq.Envelope(f"{k}:{i}".encode(), msg_id=f"f{k}-{i % 3000}") for i in range(4000)]
        rs = faulty.push_many(name, envs)
        assert [r.duplicate for r in rs] == [i >= 3000 for i in range(4000)]
        assert [r.id for r in rs[3000:]] == [r.id for r in rs[:1000]]
    stored = stored_bodies(db, name)
    assert max(stored.values()) == 1 and len(stored) == 5000 + 6 * 3000
    # Expiry (what trim does once markers are 600 s old) removes every part.
    from fdq.ops.retention import expire_markers_chunk
    ts = Keyspace().topic(name)
    assert len(scan(db, ts.marks.key())) > len(scan(db, ts.marks_by_version.key()))   # split ones
    while expire_markers_chunk(db, ts, 1 << 62, 100) == 100:
        pass
    assert scan(db, ts.marks.key()) == [] and scan(db, ts.marks_by_version.key()) == []
