"""bench/queue_bench.py's multi-process cases fail at once when one of their processes
dies (it used to wait out every timeout, ~3 minutes), and leave no process behind."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import pytest

import fdqtest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.queue_bench import _await, _reap  # noqa: E402

pytestmark = pytest.mark.skipif(fdqtest.ENGINE != "sqlite", reason="a bench helper, engine-independent: "
                                                                    "the sqlite pass runs it")


def test_a_process_dying_before_it_is_ready_fails_the_wait_at_once():
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    dying = ctx.Process(target=os._exit, args=(3,), name="consumer")
    waiting = ctx.Process(target=time.sleep, args=(60,), name="producer")
    dying.start()
    waiting.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="consumer exited with code 3"):
        _await("start", ready, [dying, waiting], 60)
    assert time.monotonic() - t0 < 20
    _reap([dying, waiting], True)
    assert not waiting.is_alive() and not dying.is_alive()


def test_a_result_is_returned_from_a_queue():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    q.put(("result", 1))
    assert _await("run", q, [], 10) == ("result", 1)
