"""Producer guarantees under adverse conditions found in review: a group commit that
gives up after a maybe-committed attempt, dedupe cleanup with skewed producer clocks,
and the limits a push must refuse clearly."""
from __future__ import annotations

import collections
import threading

import fdq
from fdq.errors import EngineError, is_maybe_committed
from fdq.keyspace import Keyspace
from fdq.keyspace.codec import Record

from qhelpers import scan


def _stored_bodies(db, topic: str) -> collections.Counter:
    ts = Keyspace().topic(topic)
    return collections.Counter(Record.decode(v).body for _k, v in scan(db, ts.log.key()))


def test_a_group_commit_that_gives_up_after_a_maybe_committed_attempt_pushes_nothing_twice(db, url):
    # The database's retry limit makes a push give up; when an attempt before may have
    # committed (commit_unknown_result after a real commit), the group commit must not
    # push its messages again in halves (new transactions: duplicates), and a caller
    # told "not committed" must indeed have nothing stored.
    fdq.Supervisor(db).create_topic("t", shards=2)
    faulty = fdq.connect(f"{url}?fault_injection=0.5&seed=3")
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
    stored = _stored_bodies(db, "t")
    twice = sorted(b for b, n in stored.items() if n > 1)
    assert not twice, f"{len(twice)} messages stored more than once, e.g. {twice[:3]}"
    lost = [b for b, r in outcome.items() if isinstance(r, fdq.PushResult) and not stored[b]]
    assert not lost
    wrong = [b for b, r in outcome.items() if isinstance(r, EngineError) and not is_maybe_committed(r) and stored[b]]
    assert not wrong, f"{len(wrong)} pushes reported not committed are stored, e.g. {wrong[:3]}"
    assert sum(isinstance(r, EngineError) for r in outcome.values()), "the scenario made no push give up"
