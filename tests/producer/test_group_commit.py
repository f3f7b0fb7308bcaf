"""Group commit (push_async, linger): many threads' pushes share commits, and no caller
is stranded: the flusher thread does not outlive its use, a leader interrupted while
lingering, a cancelled future, pushes and flushes from callbacks, pending futures at a
normal exit, an interrupt of the committing thread."""
from __future__ import annotations

import gc
import threading
import weakref

import fdq
from fdq.errors import EngineError, is_maybe_committed
from fdq.keyspace import Keyspace, parse_message_id

from fdqtest import read, scan, wait_for


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


class _Interrupt(BaseException):
    pass


_ASYNC_THEN_EXIT = """
import sys, fdq
p = fdq.Producer(fdq.connect(sys.argv[1]), config=fdq.ProducerConfig(linger_ms=float(sys.argv[3])))
for i in range(int(sys.argv[2])):
    p.push_async("t", b"m%d" % i)
"""


def test_a_leader_interrupted_while_lingering_does_not_strand_later_pushes(db):
    # A push interrupted by a signal handler's exception (KeyboardInterrupt, say) while
    # it leads a group commit must hand the queue on: else the group stays "led" by
    # nobody and every later push() waits forever.
    import signal
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=1000))

    def interrupt(_sig, _frame):
        raise _Interrupt()
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            p.push("t", b"interrupted")
        except _Interrupt:
            pass
        else:
            raise AssertionError("the alarm did not interrupt the lingering push")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    p2 = fdq.Producer(db)   # (another producer works meanwhile: the database is fine)
    p2.push("t", b"other")
    got = []
    th = threading.Thread(target=lambda: got.append(p.push("t", b"later")), daemon=True)
    th.start()
    th.join(15)
    assert got, "push() after an interrupted leader never returned"


def test_a_push_after_one_interrupted_while_waiting_returns_only_after_its_own_commit(db):
    """A push interrupted while it waits for another thread's commit (a signal handler's
    exception) is committed later all the same, and that commit wakes its thread after
    it left. The thread's next push, waiting for another commit, must not take that
    wake-up for its own (a caller waits on its thread's reused waiter: it returned at
    once, with no result)."""
    import signal
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=1500))

    def leader(body):
        """A thread leading the next commit (lingering), once it leads."""
        th = threading.Thread(target=p.push, args=("t", body), daemon=True)
        th.start()
        wait_for(lambda: p._group._leading, 10)
        return th

    def interrupt(_sig, _frame):
        raise _Interrupt()
    first = leader(b"first leader")
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            p.push("t", b"interrupted")     # waits for the leader's commit
        except _Interrupt:
            pass
        else:
            raise AssertionError("the alarm did not interrupt the waiting push")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    first.join(30)      # its commit took the interrupted push: woke this thread's waiter
    assert not first.is_alive()
    second = leader(b"second leader")
    r = p.push("t", b"after")   # waits for the second leader's commit
    assert r is not None
    assert read(db, Keyspace().topic("t").log_key(r.shard, parse_message_id(r.id))) is not None
    second.join(30)
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 4


_PUSH_WITHOUT_FDS = """
import os, resource, sys, threading, time
import fdq
db = fdq.connect(sys.argv[1])
fdq.Supervisor(db).create_topic("t", shards=1)
p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=1000))
leader = threading.Thread(target=p.push, args=("t", b"leader"))
leader.start()      # leads the next commit (lingering 1 s)
deadline = time.monotonic() + 10
while not p._group._leading and time.monotonic() < deadline:
    time.sleep(0.001)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
fillers = []
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
    while True:
        fillers.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
got = []

def follower():
    try:
        got.append(p.push("t", b"no fd left"))
    except Exception as e:
        got.append(e)
t = threading.Thread(target=follower)
t.start()       # its first push: no file descriptor left for its waiter
while len(p._group._queue) < 2 and not got and time.monotonic() < deadline:
    time.sleep(0.001)
for fd in fillers:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
t.join(30)
leader.join(30)
print(repr(got[0]) if got else "no result")
"""


def test_a_push_works_with_no_file_descriptor_left_for_its_threads_waiter(url):
    """A caller's thread waits on a file descriptor of its own (an eventfd): one a thread
    cannot get (the process at its descriptor limit: many threads, many sockets) waits
    on a lock instead; the push must not fail for it."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _PUSH_WITHOUT_FDS, url], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("PushResult("), out.stdout + out.stderr


def test_push_async_futures_left_pending_at_a_normal_exit_are_committed(db, url):
    # push_async hands back futures; a process that exits normally without waiting for
    # them must not drop its queued pushes (the flusher thread is a daemon: it was
    # stopped with the interpreter, and every queued push was silently lost).
    import subprocess
    import sys
    fdq.Supervisor(db).create_topic("t", shards=2)
    for linger in (0, 5):
        before = fdq.Supervisor(db).stats("t")["counters"]["inserted"]
        out = subprocess.run([sys.executable, "-c", _ASYNC_THEN_EXIT, url, "500", str(linger)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] - before == 500


def test_producer_flush_waits_for_its_pending_async_pushes(db):
    fdq.Supervisor(db).create_topic("t", shards=2)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=200))
    futures = [p.push_async("t", b"m%d" % i) for i in range(50)]
    assert p.flush(timeout=30)
    assert all(f.done() for f in futures)
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 50
    assert p.flush(timeout=0)     # nothing pending: at once


def test_an_interrupt_of_the_committing_thread_is_not_raised_in_the_other_callers(db, db_path):
    # The thread leading a group commit is interrupted (a signal handler's exception,
    # KeyboardInterrupt say) while its commit waits for SQLite's write lock. The other
    # callers of that transaction got the interrupt raised in their own threads; they
    # must get an error of their own that says the push may have committed.
    import signal
    import sqlite3
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=1000))
    blocker = sqlite3.connect(str(db_path), isolation_level=None, timeout=0)
    other = []

    def push_other():
        try:
            other.append(p.push("t", b"other"))
        except BaseException as e:
            other.append(e)
    th = threading.Thread(target=push_other, daemon=True)

    def interrupt(_sig, _frame):
        if not p._group._committing:    # still lingering: interrupt its commit, not this
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            return
        raise _Interrupt()

    def start_other(_sig, _frame):    # while the leader lingers (1 s): the other push joins it
        th.start()
        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # then interrupt the leader's commit
    old = signal.signal(signal.SIGALRM, start_other)
    try:
        blocker.execute("BEGIN IMMEDIATE")          # another writer holds the database
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        try:
            p.push("t", b"leader")
        except _Interrupt:
            pass
        else:
            raise AssertionError("the alarm did not interrupt the leader's commit")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        blocker.execute("ROLLBACK")
        blocker.close()
    th.join(30)
    assert len(other) == 1
    assert isinstance(other[0], EngineError) and is_maybe_committed(other[0]), repr(other[0])


def test_a_push_from_a_push_async_callback_does_not_hang_the_producer(db):
    """A ``push_async`` future's done callbacks run in the thread that sets its result:
    the thread committing the batch. A ``push`` from such a callback queued its message
    and waited for the committing thread, which was itself: it hung for good, and every
    later push of that producer with it."""
    import threading
    fdq.Supervisor(db).create_topic("t", shards=2)
    p = fdq.Producer(db)
    chained = {}
    done = threading.Event()

    def on_done(f):
        try:
            chained["result"] = p.push("t", b"chained:" + f.result().id.encode())
        finally:
            done.set()

    futures = [p.push_async("t", b"%d" % i) for i in range(5)]
    futures[0].add_done_callback(on_done)
    for f in futures:
        f.result(timeout=10)
    assert done.wait(10), "the push from the callback hung"
    assert chained["result"].id
    assert p.push("t", b"after").id                 # the producer still works
    assert p.flush(timeout=10)
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 7


def test_flush_from_a_push_async_callback_is_refused_not_a_hang(db):
    """``flush()`` from a done callback runs in the thread committing the batch it would
    wait for: it waited for itself (for good without a timeout). It is refused with a
    ConfigError naming the cause; the pushes still commit and the producer still works."""
    import threading
    fdq.Supervisor(db).create_topic("t", shards=2)
    p = fdq.Producer(db)
    pushed = 0
    for _attempt in range(20):
        seen = {}
        done = threading.Event()

        def on_done(_f, seen=seen, done=done):
            seen["thread"] = threading.current_thread()
            try:
                seen["flushed"] = p.flush(timeout=5)
            except fdq.ConfigError as e:
                seen["error"] = str(e)
            finally:
                done.set()

        futures = [p.push_async("t", b"%d" % i) for i in range(3)]
        pushed += 3
        futures[0].add_done_callback(on_done)
        assert done.wait(10), "flush from the callback did not return"
        for f in futures:
            assert f.result(timeout=10).id
        if seen["thread"] is not threading.current_thread():
            break       # else committed before the callback was added: it ran here, try again
    else:
        raise AssertionError("the callback never ran in the committing thread in 20 attempts")
    assert "push_async callback" in seen.get("error", ""), seen
    assert p.flush(timeout=10)
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == pushed


def test_auto_batching_from_8_threads(db):
    fdq.Supervisor(db).create_topic("t", shards=4)
    p = fdq.Producer(db)
    ts = Keyspace().topic("t")
    per_thread, threads = 150, 8
    ids, errors = [], []
    start = threading.Barrier(threads)

    def run(t):
        start.wait(30)
        try:
            for i in range(per_thread):
                r = p.push("t", f"{t}:{i}".encode(), shard_key=f"k{t}")
                # The call returns after its commit: a new transaction sees the message.
                raw = read(db, ts.log_key(r.shard, parse_message_id(r.id)))
                if raw == None:  # noqa: E711
                    errors.append(f"{r.id} not committed when push returned")
                ids.append(r.id)
        except Exception as e:
            errors.append(repr(e))
    ths = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    assert not errors, errors[:3]
    total = per_thread * threads
    assert len(set(ids)) == total
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == total
    transactions = len(scan(db, ts.marks_by_version.key()))   # one marker per push transaction
    print(f"\nauto-batching: {total} pushes from {threads} threads in {transactions} transactions")
    assert transactions < total


def test_a_cancelled_push_async_future_does_not_strand_the_other_pushes_of_its_commit(db):
    # concurrent.futures lets its owner cancel a pending future; the group commit must
    # still release every other push of that commit (a caller of push() returns), and
    # the cancelled push is stored all the same (a cancel cannot recall it).
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=500))
    f = p.push_async("t", b"async")            # the flusher lingers 500 ms, then commits
    assert f.cancel()
    result = []
    t = threading.Thread(target=lambda: result.append(p.push("t", b"sync")), daemon=True)
    t.start()
    t.join(30)
    assert result and result[0].id, "push() never returned"
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 2


def test_delayed_pushes_to_two_topics_in_one_commit_are_due_by_their_own_topics_clocks(db, sup):
    """A commit of several callers' pushes spans topics; each has its own clock. The
    transaction read the first delayed push's topic's clock and counted every other
    topic's due times from it (here, 1,000 s late)."""
    from fdq.ops.clock import advance_clock
    sup.create_topic("a", shards=1)
    sup.create_topic("b", shards=1)
    ks = Keyspace()
    advance_clock(db, ks.topic("a").clock_key, 1_000_000)        # a's consumers ran 1,000 s
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=200))
    for _ in range(20):         # until both land in one commit (the group commit decides)
        fa, fb = p.push_async("a", b"x", delay=5), p.push_async("b", b"y", delay=5)
        ra, rb = fa.result(30), fb.result(30)
        if parse_message_id(ra.id).tr_version == parse_message_id(rb.id).tr_version:
            break
    else:
        raise AssertionError("the two pushes never shared a commit")
    [da] = [m for m in sup.peek("a", states=["delayed"]) if m["id"] == ra.id]
    [db_] = [m for m in sup.peek("b", states=["delayed"]) if m["id"] == rb.id]
    assert 4 <= da["due_in_s"] <= 6 and 4 <= db_["due_in_s"] <= 6, (da["due_in_s"], db_["due_in_s"])
