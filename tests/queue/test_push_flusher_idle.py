"""A Producer's flusher thread (push_async) must not outlive its use: one made per
request, say, left a thread waiting forever, holding its Producer and connection."""
from __future__ import annotations

import gc
import threading
import weakref

import fdq

from fdqtest import wait_for


def _flushers() -> int:
    return sum(t.name == "fdq-producer-flush" for t in threading.enumerate())


def test_producers_dropped_after_push_async_leave_no_thread_behind(db):
    fdq.Supervisor(db).create_topic("t", shards=1)
    before = _flushers()
    refs = []
    for i in range(20):
        p = fdq.Producer(db)
        p.push_async("t", b"m%d" % i).result(30)
        refs.append(weakref.ref(p))
        del p

    def gone():
        gc.collect()
        return _flushers() <= before and not any(r() is not None for r in refs)
    wait_for(gone, timeout=30, what="the idle flusher threads to end and their producers to be freed",
             interval=0.2)
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 20


def test_a_producer_whose_flusher_went_idle_pushes_again(db):
    from fdq import producer
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=5))
    for round_ in range(3):
        futures = [p.push_async("t", b"r%d-%d" % (round_, i)) for i in range(50)]
        assert [f.result(30).topic for f in futures] == ["t"] * 50
        wait_for(lambda: p._group._flusher is None, timeout=producer.FLUSHER_IDLE_S + 20,
                 what="the flusher to end when idle")
        assert p.push("t", b"sync").topic == "t"      # a leader hands off to a new flusher
    assert p.flush(timeout=30)
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 153
