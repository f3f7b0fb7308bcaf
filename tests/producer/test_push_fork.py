"""A Producer used on both sides of a fork() (a pre-fork server, multiprocessing's
fork start method): the child's pushes must neither hang nor share the parent's
transaction ids (the retry marker of one process read as the other's commit)."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

import fdq

from fdqtest import ON_FDB, stored_bodies, with_faults


pytestmark = pytest.mark.skipif(ON_FDB, reason="fork(): FoundationDB's client cannot be used in a forked child, "
                                               "which FDQ refuses (ClientForked: tests/engine/test_fdb_client.py)")


def _reap(pid: int, timeout: float) -> int | None:
    """The child's exit status, or None (killed -9) if it did not exit within timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_a_producer_shared_over_fork_never_takes_the_other_process_commit_for_its_own(db, url, tmp_path):
    # Parent and child continued one sequence of transaction ids (the same session, the
    # same counter): a push whose attempt failed with commit_unknown_result (fault
    # injection: not applied) read the marker the other process had committed under
    # that id, and returned that process's message id as its own: acknowledged, never
    # stored.
    fdq.Supervisor(db).create_topic("t", shards=2)
    faulty = fdq.connect(with_faults(url, 0.2, 7))
    p = fdq.Producer(faulty)
    p.push("t", b"before")
    n = 40
    out = tmp_path / "child.json"
    pid = os.fork()
    if pid == 0:    # the child: push, write the ids, leave at once
        code = 1
        try:
            ids = {f"c{i}": p.push("t", f"c{i}".encode()).id for i in range(n)}
            out.write_text(json.dumps(ids))
            code = 0
        finally:
            os._exit(code)
    assert _reap(pid, 120) == 0, "the child's pushes failed or hung"
    child_ids = json.loads(out.read_text())
    parent_ids = {f"p{i}": p.push("t", f"p{i}".encode()).id for i in range(n)}
    stored = stored_bodies(db, "t")
    lost = sorted(b for b in list(child_ids) + list(parent_ids) if stored[b.encode()] != 1)
    assert not lost, f"{len(lost)} acknowledged pushes not stored exactly once, e.g. {lost[:3]}"
    ids = list(child_ids.values()) + list(parent_ids.values())
    assert len(set(ids)) == len(ids), "two pushes were given one message id"


def test_a_child_forked_while_its_producer_lingers_can_push_and_flush(db, tmp_path):
    # Forked while the parent's flusher thread led a group commit (lingering, a
    # push_async queued): the child inherited "leading" without the thread, so its
    # push() queued behind a leader that does not exist there and waited forever,
    # and its copy of the parent's pending future never resolved.
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=1500))
    pending = p.push_async("t", b"parent-async")
    out = tmp_path / "child.json"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            r = p.push("t", b"child")
            resolved = pending.done() or p.flush(timeout=10)
            out.write_text(json.dumps({"id": r.id, "flushed": resolved, "future_done": pending.done()}))
            code = 0
        finally:
            os._exit(code)
    status = _reap(pid, 30)
    assert pending.result(30).id
    assert status == 0, "the child's push after the fork hung (killed after 30 s)"
    got = json.loads(out.read_text())
    assert got["flushed"] and got["future_done"]
    stored = stored_bodies(db, "t")
    assert stored == {b"parent-async": 1, b"child": 1}   # the parent's push once: not by the child


def test_a_child_forked_while_its_producer_commits_fails_the_copied_futures(db, tmp_path):
    # Forked while the parent's flusher was committing a push_async (waiting out a
    # play's hold): the child's copy of that future was neither queued nor committed
    # there, and never resolved; the child's flush() said all was done meanwhile.
    from fdq.keyspace import Keyspace as _Ks
    from fdq.supervisor import play_chunk
    from fdqtest import wait_for
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    sup.pause("t")
    ts = _Ks().topic("t")
    p = fdq.Producer(db)
    for attempt in range(5):    # (a machine too loaded to push within the hold: again)
        sup.pause("t")
        _n, done, hold = play_chunk(db, ts, 100)     # a play's hold: pushes wait ~1 s of versions
        assert not done and hold is not None
        pending = p.push_async("t", b"held-%d" % attempt)
        wait_for(lambda: not p._group._queue, timeout=10, what="the flusher to take the push")
        if not pending.done():
            break
    else:
        raise AssertionError("no push was held by the play's hold")
    out = tmp_path / "child.json"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            flushed = p.flush(timeout=5)
            try:
                got = pending.exception(timeout=5)
                state = type(got).__name__ if got is not None else "result"
            except Exception as e:   # concurrent.futures.TimeoutError: never resolved
                state = type(e).__name__
            out.write_text(json.dumps({"flushed": flushed, "state": state}))
            code = 0
        finally:
            os._exit(code)
    assert _reap(pid, 30) == 0
    assert pending.result(30).id    # the parent commits it (once the hold lapses)
    got = json.loads(out.read_text())
    assert got == {"flushed": True, "state": "EngineError"}, got
    sup.play("t")
    assert stored_bodies(db, "t") == {b"held-%d" % i: 1 for i in range(attempt + 1)}
