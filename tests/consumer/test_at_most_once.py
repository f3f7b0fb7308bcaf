"""At most once: nothing delivered twice, nothing lost but what a killed consumer took.

At most once: a take whose commit reports ``commit_unknown_result`` although it
committed, followed by its shard moving before the consumer could check (found by the
chaos test, seed 245: a clean-running at-most-once consumer lost 5 messages it had
taken). The check used to ask whether the taken messages were gone while the shard was
still ours; with the shard gone it could not tell, raised LeaseLost, and the batch was
dropped though the consumer's own commit had taken it. Now the take transaction records
its attempt id (one key per consumer, outside the range membership reads) and the check
reads that: the batch is handed over."""
from __future__ import annotations

import threading

import fdq
from fdq import supervisor
from fdq.ops import queue
from fdq.engine import sqlite as engine
from fdq.errors import EngineError
from fdq.keyspace import Keyspace

from fdqtest import embedded_only, FAST, read, sub_stats, wait_for, with_faults


@embedded_only      # injects commit_unknown_result into one chosen commit of the embedded engine
def test_take_committed_then_shard_moved_is_handed_over(db, monkeypatch):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    ts = Keyspace().topic("t")
    fired = threading.Event()
    doomed = []     # the transaction whose real commit reports 1021

    take_batch = queue.take_batch

    def take_then_doom(tr, *a, **kw):
        taken = take_batch(tr, *a, **kw)
        if taken and not fired.is_set() and isinstance(tr, engine.Transaction):
            doomed.append(tr)
        return taken
    monkeypatch.setattr(queue, "take_batch", take_then_doom)

    commit = engine.Transaction._commit

    def commit_then_unknown(self):
        commit(self)
        if self in doomed and not fired.is_set():
            fired.set()
            # the shard moves before the consumer can look: a reshard begins (its fence)
            supervisor.reshard_begin(db, ts, 2)
            err = EngineError(1021)
            self._fail(err)
            raise err
    monkeypatch.setattr(engine.Transaction, "_commit", commit_then_unknown)

    seen = []
    c = fdq.tail(db, "t", lambda m: seen.append(m.body), acking=False, batch_size=10,
                 config=FAST)
    try:
        wait_for(lambda: c.owned_shards, 30, what="the consumer to own the shard")
        fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i) for i in range(5)])
        wait_for(fired.is_set, 30, what="the take's commit")
        sup.rebalance("t", shards=2)       # the reshard finishes; the consumer gets shards again
        fdq.Producer(db).push("t", b"after")
        wait_for(lambda: b"after" in seen, 30, what="the consumer to go on")
    finally:
        c.shutdown()
    assert sorted(seen) == [b"after"] + [b"m%d" % i for i in range(5)], seen
    assert read(db, ts.take_marker_key("default", c.id), snapshot=False) is None, \
        "the marker outlived its consumer"  # noqa: E711
    st = sup.stats("t")["subscriptions"]["default"]
    assert (st["backlog"], st["emitted"], st["acked"]) == (0, 6, 6)


def test_at_most_once_under_fault_injection_loses_nothing(db, url):
    """With no consumer killed, at-most-once under injected faults (commit_unknown_result
    after a real commit included) still hands every message over exactly once."""
    p = fdq.Producer(db)
    fdq.Supervisor(db).create_topic("t", shards=2)
    pushed = [r.id for r in p.push_many("t", [fdq.Envelope(f"{i}".encode()) for i in range(600)])]
    faulty = fdq.connect(with_faults(url, 0.1, 21))
    handled = []
    c = fdq.tail(faulty, "t", lambda m: handled.append(m.id), acking=False, batch_size=10,
                 config=FAST, on_error=lambda e: None)
    try:
        wait_for(lambda: sub_stats(db, "t")["backlog"] == 0, 60, what="the queue emptied")
        wait_for(lambda: len(handled) >= len(pushed), 10, what="every message handled")
    finally:
        c.shutdown()
    assert sorted(handled) == sorted(pushed)
