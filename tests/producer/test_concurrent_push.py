"""Many callers pushing one message each at once (a web service: threads calling
``push``, asyncio tasks awaiting ``fdq.aio.push``) share commits. Each call returns only
after its own commit; a bad message fails its own caller only; an error of a commit
reaches every caller of it; aio callers on several loops are each resolved on their own
loop; a cancelled aio push is stored all the same and strands nobody."""
from __future__ import annotations

import asyncio
import signal
import sqlite3
import threading

import pytest

import fdq
import fdq.aio
from fdq.errors import EngineError, MessageTooLarge, TopicNotFound, is_maybe_committed
from fdq.keyspace import Keyspace, parse_message_id

from fdqtest import ENGINE, read

LOG = Keyspace().topic("t")


def _stored(db, r) -> bool:
    return read(db, LOG.log_key(r.shard, parse_message_id(r.id))) is not None


def _commits(results) -> int:
    return len({parse_message_id(r.id).tr_version for r in results})


def test_a_bad_push_among_concurrent_threads_fails_only_its_caller(db):
    """Threads pushing at once, some with a body over the topic's limit (refused inside
    the transaction, where the topic's config is read) or to a topic that does not exist
    (the producer does not create topics): each bad push raises its own error in its own
    thread, every other push is stored, and the good ones still share commits."""
    fdq.Supervisor(db).create_topic("t", shards=2, max_message_bytes=1000)
    p = fdq.Producer(db, config=fdq.ProducerConfig(auto_create=False, linger_ms=20))
    threads, rounds = 12, 5
    start = threading.Barrier(threads)
    got = {}

    def run(t):
        start.wait(30)
        for i in range(rounds):
            if t == 0:
                topic, body = "t", b"x" * 2000                  # too large
            elif t == 1:
                topic, body = "missing", b"m"                   # no such topic
            else:
                topic, body = "t", b"%d:%d" % (t, i)
            try:
                got[t, i] = p.push(topic, body, shard_key=f"k{t}")
            except Exception as e:
                got[t, i] = e
    ths = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    assert len(got) == threads * rounds, "a push never returned"
    assert all(isinstance(got[0, i], MessageTooLarge) for i in range(rounds)), [got[0, i] for i in range(rounds)]
    assert all(isinstance(got[1, i], TopicNotFound) for i in range(rounds)), [got[1, i] for i in range(rounds)]
    good = [got[t, i] for t in range(2, threads) for i in range(rounds)]
    assert all(isinstance(r, fdq.PushResult) for r in good), [r for r in good if not isinstance(r, fdq.PushResult)]
    assert all(_stored(db, r) for r in good)
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == len(good)
    assert _commits(good) < len(good)       # they did share commits
    for t in range(2, threads):             # each caller's pushes in its order
        ids = [parse_message_id(got[t, i].id) for i in range(rounds)]
        assert ids == sorted(ids)


def test_aio_pushes_resolve_after_their_commit_with_a_bad_one_failing_alone(db):
    """256 tasks awaiting ``fdq.aio.push`` at once, a few with a body over the limit:
    those raise MessageTooLarge in their own task, every other await returns a result
    whose message is already stored, in each task's order, in shared commits."""
    fdq.Supervisor(db).create_topic("t", shards=4, max_message_bytes=1000)
    p = fdq.Producer(db)
    tasks, rounds = 256, 3

    async def one(t):
        out = []
        for i in range(rounds):
            body = b"x" * 2000 if t % 64 == 0 else b"%d:%d" % (t, i)
            try:
                r = await fdq.aio.push(p, "t", body, shard_key=f"k{t}")
                out.append(r if _stored(db, r) else AssertionError(f"{r.id} not stored when its await returned"))
            except Exception as e:
                out.append(e)
        return out

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(t) for t in range(tasks))), 60)
    got = asyncio.run(main())
    for t, out in enumerate(got):
        if t % 64 == 0:
            assert all(isinstance(e, MessageTooLarge) for e in out), out
        else:
            assert all(isinstance(r, fdq.PushResult) for r in out), out
            ids = [parse_message_id(r.id) for r in out]
            assert ids == sorted(ids)
    good = [r for t, out in enumerate(got) if t % 64 for r in out]
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == len(good)
    assert _commits(good) < len(good)       # they did share commits (a batch with a bad one splits)


def test_aio_pushes_from_two_loops_in_one_commit_resolve_each_on_its_own_loop(db):
    """Two event loops in two threads push through one producer while it lingers: their
    pushes share a commit, and each await returns on its own loop's thread."""
    fdq.Supervisor(db).create_topic("t", shards=2)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=300))
    ready = threading.Barrier(2)
    got = {}

    def loop_thread(name):
        async def main():
            ready.wait(30)
            rs = await asyncio.wait_for(asyncio.gather(*(fdq.aio.push(p, "t", b"%s%d" % (name, i))
                                                         for i in range(20))), 60)
            return rs, threading.current_thread()
        got[name] = asyncio.run(main())
    ths = [threading.Thread(target=loop_thread, args=(n,), daemon=True) for n in (b"a", b"b")]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    assert set(got) == {b"a", b"b"}, "a loop's pushes never resolved"
    for th, name in zip(ths, (b"a", b"b")):
        rs, resolved_in = got[name]
        assert resolved_in is th
        assert all(_stored(db, r) for r in rs)
    assert _commits(got[b"a"][0] + got[b"b"][0]) < 40
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 40


def test_a_cancelled_aio_push_is_stored_and_strands_no_other_await(db):
    """A task awaiting ``fdq.aio.push`` is cancelled while its push waits for the commit:
    the push is stored all the same (a cancel cannot recall it) and the other awaits of
    that commit return."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=300))

    async def main():
        doomed = asyncio.ensure_future(fdq.aio.push(p, "t", b"cancelled"))
        others = [asyncio.ensure_future(fdq.aio.push(p, "t", b"m%d" % i)) for i in range(5)]
        await asyncio.sleep(0)      # (the pushes are queued when their tasks first run)
        doomed.cancel()
        rs = await asyncio.wait_for(asyncio.gather(*others), 30)
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return rs
    rs = asyncio.run(main())
    assert all(_stored(db, r) for r in rs)
    assert p.flush(timeout=30)
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 6


class _Interrupt(BaseException):
    pass


@pytest.mark.skipif(ENGINE != "sqlite", reason="holds SQLite's write lock from outside (an embedded-engine "
                                                 "file); the FDB pass has no such lock to hold")
def test_an_interrupted_commit_reaches_every_aio_caller_of_its_batch(db, db_path):
    """The thread leading a group commit is interrupted (a signal handler's exception)
    while its commit waits for SQLite's write lock; the aio pushes of another loop that
    joined its batch must each get an error of their own saying the push may have
    committed (not hang, not get the interrupt)."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=1000))
    blocker = sqlite3.connect(str(db_path), isolation_level=None, timeout=0)
    got = []

    def aio_thread():
        async def main():
            return await asyncio.wait_for(asyncio.gather(
                *(fdq.aio.push(p, "t", b"a%d" % i) for i in range(5)), return_exceptions=True), 60)
        got.extend(asyncio.run(main()))
    th = threading.Thread(target=aio_thread, daemon=True)

    def interrupt(_sig, _frame):
        if not p._group._committing:    # still lingering: interrupt its commit, not this
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            return
        raise _Interrupt()

    def start_others(_sig, _frame):   # while the leader lingers: the aio pushes join it
        th.start()
        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # then interrupt the leader's commit
    old = signal.signal(signal.SIGALRM, start_others)
    try:
        blocker.execute("BEGIN IMMEDIATE")          # another writer holds the database
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(_Interrupt):
            p.push("t", b"leader")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        blocker.execute("ROLLBACK")
        blocker.close()
    th.join(60)
    assert len(got) == 5, "an aio push of the interrupted batch never resolved"
    assert all(isinstance(e, EngineError) and is_maybe_committed(e) for e in got), got


def test_aio_pushes_of_one_commit_wake_their_loop_once(db):
    """The aio pushes of one commit are resolved on their loop by one call from the
    committing thread (``call_soon_threadsafe``: a write to the loop's self-pipe and a
    wake-up), not one per push: 100 pushes in one commit woke the loop 100 times."""
    fdq.Supervisor(db).create_topic("t", shards=2)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=300))
    wakes = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(*args, **kwargs):     # (the loop's own method, counted)
            if threading.current_thread() is not threading.main_thread():
                wakes.append(args[0])
            return real(*args, **kwargs)
        loop.call_soon_threadsafe = counted
        try:
            return await asyncio.wait_for(asyncio.gather(*(fdq.aio.push(p, "t", b"m%d" % i)
                                                           for i in range(100))), 60)
        finally:
            del loop.call_soon_threadsafe
    rs = asyncio.run(main())
    commits = _commits(rs)
    assert commits <= 10, commits       # the linger gathers them
    assert len(wakes) == commits, (len(wakes), commits)
