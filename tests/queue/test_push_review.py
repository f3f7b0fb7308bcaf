"""Producer guarantees under adverse conditions found in review: a group commit that
gives up after a maybe-committed attempt, dedupe cleanup with skewed producer clocks,
and the limits a push must refuse clearly."""
from __future__ import annotations

import collections
import threading
import time

import fdq
from fdq.errors import EngineError, is_maybe_committed
from fdq.keyspace import Keyspace
from fdq.keyspace.codec import Record

from fdqtest import database_url, engine_errors, kill_all, read, read_version, readline_within, scan, with_faults


def _stored_bodies(db, topic: str) -> collections.Counter:
    ts = Keyspace().topic(topic)
    return collections.Counter(Record.decode(v).body for _k, v in scan(db, ts.log.key()))


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
    stored = _stored_bodies(db, "t")
    twice = sorted(b for b, n in stored.items() if n > 1)
    assert not twice, f"{len(twice)} messages stored more than once, e.g. {twice[:3]}"
    lost = [b for b, r in outcome.items() if isinstance(r, fdq.PushResult) and not stored[b]]
    assert not lost
    wrong = [b for b, r in outcome.items() if isinstance(r, EngineError) and not is_maybe_committed(r) and stored[b]]
    assert not wrong, f"{len(wrong)} pushes reported not committed are stored, e.g. {wrong[:3]}"
    assert sum(isinstance(r, EngineError) for r in outcome.values()), "the scenario made no push give up"


_SKEWED_PUSH = """
import sys, time
real = time.time
time.time = lambda: real() + float(sys.argv[2])
import fdq
p = fdq.Producer(fdq.connect(sys.argv[1]))
print(*[p.push("t", b"skewed", msg_id=m).id for m in sys.argv[3:]])
"""


def test_a_producer_clock_days_ahead_neither_stalls_dedupe_cleanup_nor_stretches_the_window(db, url):
    # Dedupe entries keep their producer's clock (so a version jump cannot shorten the
    # window). A producer whose clock is a day ahead must not make its entry young for
    # a day: trim stopped at it (cleanup of every later id stalled) and the id counted
    # as a duplicate for a day.
    import subprocess
    import sys
    from fdqtest import wait_for
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1, dedupe_window_s=0.5)
    out = subprocess.run([sys.executable, "-c", _SKEWED_PUSH, url, str(86400), "id-skewed", "id-only-skewed"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first = out.stdout.split()[0]
    p = fdq.Producer(db)
    for i in range(5):
        p.push("t", b"x", msg_id=f"id-{i}")
    ts = Keyspace().topic("t")
    first_version = int(first[:16], 16)
    wait_for(lambda: read_version(db) - first_version > 600_000,
             timeout=10, what="the window to pass by versions")
    # Past the window by versions and by this producer's clock: the id is new again
    # (and id-only-skewed, never pushed again, must not stop the cleanup below).
    r = p.push("t", b"again", msg_id="id-skewed")
    assert not r.duplicate and r.id != first

    def cleaned():
        sup.trim("t")
        return not scan(db, ts.dedupe.key()) and not scan(db, ts.dedupe_by_version.key())
    wait_for(cleaned, timeout=10, what="trim to expire every dedupe entry past its window", interval=0.2)


class _Interrupt(BaseException):
    pass


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


_ASYNC_THEN_EXIT = """
import sys, fdq
p = fdq.Producer(fdq.connect(sys.argv[1]), config=fdq.ProducerConfig(linger_ms=float(sys.argv[3])))
for i in range(int(sys.argv[2])):
    p.push_async("t", b"m%d" % i)
"""


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


def test_a_body_the_config_allows_but_no_transaction_can_hold_is_refused_clearly(db):
    # max_message_bytes may be set up to 8 MiB, but a push writes the body to the log
    # and to every subscription's queue in one transaction (10 MB): a 6 MiB body must be
    # a MessageTooLarge naming why, not a raw transaction_too_large engine error.
    import os
    import pytest
    sup = fdq.Supervisor(db)
    sup.create_topic("big", shards=1, max_message_bytes=8 << 20)
    p = fdq.Producer(db)
    with pytest.raises(fdq.MessageTooLarge, match="subscription"):
        p.push("big", os.urandom(6 << 20))
    f = p.push_async("big", os.urandom(6 << 20))
    with pytest.raises(fdq.MessageTooLarge):
        f.result(60)
    body = os.urandom(4 << 20)
    p.push("big", body)
    assert sup.stats("big")["counters"]["inserted"] == 1


def test_more_messages_than_a_versionstamp_can_number_are_refused_clearly(db):
    # A message's id is its commit's versionstamp plus a 2-byte index in the
    # transaction: one transaction holds at most 65,536 messages. Beyond that, an
    # OverflowError escaped (not an FDQError); a max_batch beyond it broke every push.
    import pytest
    p = fdq.Producer(db)
    with pytest.raises(fdq.InvalidMessage, match="65,536"):
        p.push_many("t", [fdq.Envelope(b"x") for _ in range(65_537)])
    with pytest.raises(fdq.ConfigError, match="max_batch"):
        fdq.ProducerConfig(max_batch=100_000)
    assert fdq.ProducerConfig(max_batch=65_536).max_batch == 65_536


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
    stored = _stored_bodies(db, name)
    assert max(stored.values()) == 1 and len(stored) == 5000 + 6 * 3000
    # Expiry (what trim does once markers are 600 s old) removes every part.
    from fdq.supervisor import expire_index_chunk
    ts = Keyspace().topic(name)
    assert len(scan(db, ts.marks.key())) > len(scan(db, ts.marks_by_version.key()))   # split ones
    while expire_index_chunk(db, ts.marks_by_version, 1 << 62, 100, ts.marks) == 100:
        pass
    assert scan(db, ts.marks.key()) == [] and scan(db, ts.marks_by_version.key()) == []


_DEDUPE_WORKER = """
import json, sys, threading, fdq
url, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = fdq.Producer(fdq.connect(url))
out = {}
def run(t):
    for i in range(t, n, 4):      # 4 threads: auto-batched pushes of the shared ids
        r = p.push("t", f"{name}:{i}".encode(), msg_id=f"id-{i}")
        out[f"id-{i}"] = r.id
ths = [threading.Thread(target=run, args=(t,)) for t in range(4)]
[t.start() for t in ths]
[t.join(120) for t in ths]
rs = p.push_many("t", [fdq.Envelope(f"{name}:many{i}".encode(), msg_id=f"m-{i}") for i in range(n)])
out.update({f"m-{i}": r.id for i, r in enumerate(rs)})
print(json.dumps(out))
"""


def test_the_same_msg_ids_pushed_by_concurrent_processes_under_faults_are_stored_once(db, url):
    import json
    import subprocess
    import sys
    fdq.Supervisor(db).create_topic("t", shards=4, dedupe_window_s=600)
    n = 150
    procs = [subprocess.Popen([sys.executable, "-c", _DEDUPE_WORKER, with_faults(url, 0.2, s),
                               f"p{s}", str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in range(3)]
    outs = []
    try:
        for pr in procs:
            so, se = pr.communicate(timeout=300)
            assert pr.returncode == 0, se[-2000:]
            outs.append(json.loads(so))
    finally:
        kill_all(procs)
    ts = Keyspace().topic("t")
    recs = [Record.decode(v) for _k, v in scan(db, ts.log.key())]
    per_id = collections.Counter(r.msg_id for r in recs)
    assert len(per_id) == 2 * n and max(per_id.values()) == 1, per_id.most_common(3)
    for mid in outs[0]:
        assert outs[0][mid] == outs[1][mid] == outs[2][mid], mid    # every process was told the stored id


def test_a_topic_auto_created_by_a_push_records_the_layout_format(tmp_path):
    # Creating a topic writes meta/format (the layout version a later FDQ checks and
    # migrates from); a push that auto-creates the first topic of a fresh database did
    # not, so a later version would take the database for an empty one.
    db = fdq.connect(database_url(tmp_path / "fresh.db"))
    fdq.Producer(db).push("t", b"x")
    ks = Keyspace()
    raw = read(db, ks.format_key, snapshot=False)
    assert raw != None  # noqa: E711


def test_an_infinite_delay_is_refused_at_the_call_and_fails_no_other_push(db):
    # delay=inf (or one whose milliseconds overflow a float) passed validation, then
    # raised OverflowError inside the group commit: every push of that transaction,
    # other callers' included, failed with it.
    import pytest
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=300))
    good = [p.push_async("t", b"ok%d" % i) for i in range(3)]
    for bad in (float("inf"), 1e307):
        with pytest.raises(fdq.InvalidMessage, match="delay"):
            p.push_async("t", b"bad", delay=bad).result(30)
    assert [f.result(30).topic for f in good] == ["t"] * 3


def test_a_shard_key_or_msg_id_without_utf8_form_is_refused_at_the_call(db):
    # A lone surrogate passed validation, then raised UnicodeEncodeError inside the
    # group commit: every other push of that transaction failed with it.
    import pytest
    fdq.Supervisor(db).create_topic("t", shards=2)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=300))
    good = [p.push_async("t", b"ok%d" % i, shard_key="clé", msg_id=f"ïd-{i}") for i in range(3)]
    for kw in (dict(msg_id="\ud800"), dict(shard_key="k\udc00")):
        with pytest.raises(fdq.InvalidMessage, match="UTF-8"):
            p.push_async("t", b"bad", **kw).result(30)
    assert [f.result(30).duplicate for f in good] == [False] * 3


_AUTOCREATE_WORKER = """
import sys, fdq
url, name, shards = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = fdq.Producer(fdq.connect(url), config=fdq.ProducerConfig(auto_create=fdq.TopicConfig(shards=shards)))
for i in range(40):
    topic = f"new-{i % 5}"
    if i % 2:
        p.push(topic, f"{name}:{i}".encode(), shard_key=f"k{i}")
    else:
        p.push_many(topic, [fdq.Envelope(f"{name}:{i}:{j}".encode()) for j in range(3)])
print("done")
"""


def test_topics_auto_created_by_racing_processes_have_one_config_and_every_message(db, url):
    # Three processes push (with different auto_create shard counts) into five topics
    # none of them exists yet, under fault injection: each topic is created once (the
    # losers of the race retry with the winner's config) and keeps every message.
    import subprocess
    import sys
    procs = [subprocess.Popen([sys.executable, "-c", _AUTOCREATE_WORKER, with_faults(url, 0.2, s),
                               f"p{s}", str(2 + s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in range(3)]
    try:
        for pr in procs:
            so, se = pr.communicate(timeout=300)
            assert pr.returncode == 0 and so.strip() == "done", se[-2000:]
    finally:
        kill_all(procs)
    sup = fdq.Supervisor(db)
    assert sorted(name for name, _c in sup.topics()) == [f"new-{i}" for i in range(5)]
    total = 0
    for i in range(5):
        topic = f"new-{i}"
        shards = sup.config(topic).shards
        stored = _stored_bodies(db, topic)
        assert max(stored.values()) == 1
        total += len(stored)
        ts = Keyspace().topic(topic)
        # every message is in a ready queue of a shard the topic's config has
        ready = sum(len(scan(db, ts.shard("default", "", n).ready_prefix)) for n in range(shards))
        assert ready == len(stored) == sup.stats(topic)["counters"]["inserted"]
    assert total == 3 * (20 * 1 + 20 * 3)



def test_an_interrupt_of_the_committing_thread_is_not_raised_in_the_other_callers(db, db_path):
    # The thread leading a group commit is interrupted (a signal handler's exception,
    # KeyboardInterrupt say) while its commit waits for SQLite's write lock. The other
    # callers of that transaction got the interrupt raised in their own threads; they
    # must get an error of their own that says the push may have committed.
    import signal
    import sqlite3
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=300))
    blocker = sqlite3.connect(str(db_path), isolation_level=None, timeout=0)
    other = []

    def push_other():
        try:
            other.append(p.push("t", b"other"))
        except BaseException as e:
            other.append(e)
    th = threading.Thread(target=push_other, daemon=True)

    def interrupt(_sig, _frame):
        raise _Interrupt()

    def start_other(_sig, _frame):    # while the leader lingers: the other push joins it
        th.start()
        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.6)   # then interrupt the leader's commit
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


_TAGGED_STREAM = """
import sys, time, fdq
p = fdq.Producer(fdq.connect(sys.argv[1]))
print("ready", flush=True)
deadline = time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < deadline and n < 200_000:
    p.push("t", b"x", headers={"##client_dispatch_tag": "blue"})
    n += 1
"""


def test_a_steady_stream_of_tagged_pushes_does_not_conflict_with_shard_assignment(db, url):
    # A tagged push wrote the topic's tag key blind in every transaction; shard
    # assignment reads the tags (to give each tag's shards owners) with a conflict
    # range, so every assignment attempt conflicted with the stream: consumers could
    # not join or take over while tagged messages kept coming.
    import subprocess
    import sys
    from fdq import membership
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, extend=True)
    fdq.Producer(db).push("t", b"first", headers={"##client_dispatch_tag": "blue"})
    ts = Keyspace().topic("t")
    config = sup.config("t")
    stream = subprocess.Popen([sys.executable, "-c", _TAGGED_STREAM, url, "20"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert readline_within(stream, 60, "ready").strip() == "ready"
        before = sup.stats("t")["counters"]["inserted"]
        from fdqtest import wait_for
        wait_for(lambda: sup.stats("t")["counters"]["inserted"] > before + 50, timeout=20, what="the stream")
        conflicts = 0
        for _ in range(20):
            tr = db.create_transaction()
            while True:
                try:
                    membership.assign_shards(tr, ts, "default", config)
                    time.sleep(0.005)     # a transaction that takes a few ms, as under load
                    tr.commit().wait()
                    break
                except engine_errors() as e:
                    assert e.code == 1020, e
                    conflicts += 1
                    assert conflicts < 20, "shard assignment keeps conflicting with tagged pushes"
                    tr.on_error(e).wait()
    finally:
        stream.kill()
        stream.wait(30)
