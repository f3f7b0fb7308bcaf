"""Found in the review of the session's diff (rv-diff9): each test failed before its fix."""
from __future__ import annotations

import fdq

from qhelpers import sub_stats, wait_for

FAST = dict(heartbeat_interval_s=0.2, zombie_timeout_s=1.5, poll_interval_s=0.05, lease_check_interval_s=0.05)


def test_exactly_once_failing_message_inside_a_batch_runs_once_per_attempt(db):
    """Exactly-once, a handler failing on a message that is not first in its batch: the
    messages before it commit without it, and its attempt is counted. It was rerun
    until it became the head of a batch: isolated with a batch of one, the next visit
    ran the whole batch again up to it, so a message at index i ran i + 1 times for its
    first attempt and the messages before it up to i + 1 times each (batch_size²/2
    handler runs for a failure at the end of a batch)."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    bodies = [b"ok0", b"ok1", b"ok2", b"poison", b"ok3", b"ok4"]
    fdq.Producer(db).push_many("t", [fdq.Envelope(b, shard_key="k") for b in bodies])
    calls = []

    def handler(tr, m):
        calls.append((m.body, m.attempts))
        if m.body == b"poison":
            raise RuntimeError("cannot handle")
        tr[b"qt/ok/" + m.body] = b"1"
    c = fdq.tail(db, "t", handler, transactional=True, batch_size=10,
                 config=fdq.ConsumerConfig(max_deliver=3, **FAST), on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 60, what="the queue emptied")
    finally:
        c.shutdown()
    assert [a for b, a in calls if b == b"poison"] == [1, 2, 3], calls
    for b in (b"ok0", b"ok1", b"ok2"):      # run in the failed batch, then in the one that committed
        assert [x for x, _a in calls if x == b] == [b, b], calls
    for b in (b"ok3", b"ok4"):
        assert [x for x, _a in calls if x == b] == [b], calls
    [dead] = fdq.Supervisor(db).dlq_list("t")
    assert (dead["body"], dead["attempts"]) == (b"poison", 3)
    tr = db.create_transaction()
    wrote = sorted(kv.key for kv in tr.snapshot.get_range(b"qt/ok/", b"qt/ok0"))
    tr.cancel()
    assert wrote == sorted(b"qt/ok/" + b for b in bodies if b != b"poison")
