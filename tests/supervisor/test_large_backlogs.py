"""Long operations over a backlog of large messages: every chunk stays under FDB's
10 MB per transaction (``CHUNK_WRITE_BYTES``), whatever its message count. Before, a
chunk of 500 messages of 80 KB failed with transaction_too_large (2101, not retried) on
every run: a paused topic could never play again, a reshard left the topic resharding."""
from __future__ import annotations

import time

import fdq

from fdqtest import drain, key_on_shard, sub_stats


BIG = 80_000
N = 150


def _fill(db, key="k"):
    p = fdq.Producer(db)
    for i in range(N // 10):
        p.push_many("t", [fdq.Envelope(b"%05d" % (10 * i + j) + b"x" * BIG, shard_key=key) for j in range(10)])


def _drain(db, sub="default", n=N, term=False):
    """The first 5 bytes of the ``n`` next messages of ``sub``, each acked (or terminated)."""
    return [m.body[:5] for m in drain(db, "t", sub, until=n, strict=True, settle="term" if term else "ack",
                                      reason="x", create=False)]


def test_play_replay_redrive_catch_up_and_reshard_of_large_messages(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    want = [b"%05d" % i for i in range(N)]
    start = int(time.time() * 1000) - 1000

    sup.pause("t")
    _fill(db)
    assert sup.play("t") == N
    assert _drain(db, term=True) == want                  # play, in order; all to the DLQ
    assert sup.dlq_redrive("t") == N
    assert sorted(_drain(db)) == want

    sup.create_subscription("t", "late")                  # catch-up copies the log
    assert sorted(_drain(db, "late")) == want

    assert fdq.Producer(db).replay("t", start) == N
    assert sorted(_drain(db)) == want

    key = key_on_shard(1, 2)
    _fill(db, key)
    sup.rebalance("t", shards=2)
    assert sup.config("t").resharding_to is None and sup.config("t").shards == 2
    assert _drain(db) == want                             # moved to shard 1, in order
    assert sub_stats(db, "t")["backlog"] == 0
