"""``fdq.worker``: ``run_worker`` in the caller's process (the command, its signals and
drain under load: tests/cli/test_cli_worker.py) and the ``handler`` decorator."""
from __future__ import annotations

import asyncio
import threading

import pytest

import fdq
import fdq.worker
from fdqtest import FAST, sub_stats, wait_for


def _push(db, n):
    fdq.Supervisor(db).create_topic("orders", shards=2)
    fdq.Supervisor(db).create_subscription("orders", "billing")
    fdq.Producer(db).push_many("orders", [fdq.Envelope(f"m{i}".encode()) for i in range(n)])


def _run_in_thread(db, handler, stop, **kwargs):
    out = {}

    def run():
        try:
            out["worker"] = fdq.worker.run_worker(db, handler, stop=stop, config=FAST, **kwargs)
        except BaseException as e:     # noqa: BLE001 - handed to the test
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_run_worker_takes_the_decorators_defaults_and_returns_when_stopped(db):
    _push(db, 50)
    seen = []

    @fdq.worker.handler(topic="orders", subscription="billing")
    def bill(msg):
        seen.append(msg.body)

    stop = threading.Event()
    t, out = _run_in_thread(db, bill, stop, concurrency=2)
    wait_for(lambda: len(seen) == 50, 30, "50 handled")
    stop.set()
    t.join(30)
    assert not t.is_alive() and "error" not in out
    w = out["worker"]
    assert w.handled == 50 and not w.running
    s = sub_stats(db, "orders", "billing")
    assert s["backlog"] == 0 and s["in_flight"] == 0 and s["consumers"] == []
    assert sub_stats(db, "orders")["backlog"] == 50         # the default subscription: untouched


def test_run_worker_runs_a_coroutine_handler_on_an_event_loop(db):
    _push(db, 30)
    seen = []

    async def bill(msg):
        await asyncio.sleep(0)
        seen.append(msg.body)

    stop = threading.Event()
    t, out = _run_in_thread(db, bill, stop, topic="orders", subscription="billing")
    wait_for(lambda: len(seen) == 30, 30, "30 handled")
    stop.set()
    t.join(30)
    assert "error" not in out and out["worker"].handled == 30
    assert sub_stats(db, "orders", "billing")["in_flight"] == 0


def test_a_deleted_subscription_ends_run_worker(db, sup):
    _push(db, 0)
    stop = threading.Event()
    t, out = _run_in_thread(db, lambda m: None, stop, topic="orders", subscription="billing")
    wait_for(lambda: sub_stats(db, "orders", "billing")["consumers"], 30, "the worker joined")
    sup.delete_subscription("orders", "billing")
    t.join(30)
    assert not t.is_alive(), "still running"
    assert isinstance(out.get("error"), fdq.SubscriptionNotFound)


def test_the_bare_decorator_marks_without_defaults():
    @fdq.worker.handler
    def h(msg):
        return msg

    assert h(1) == 1
    assert fdq.worker.defaults_of(h) == fdq.worker.HandlerDefaults()


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(mode="twice"), fdq.ConfigError, "mode must be one of"),
    (dict(topic="bad name"), fdq.InvalidName, "invalid topic name"),
])
def test_the_decorator_refuses_bad_defaults(kwargs, error, text):
    with pytest.raises(error, match=text):
        fdq.worker.handler(**kwargs)


@pytest.mark.parametrize("handler, kwargs, text", [
    (lambda m: None, {}, "no topic to consume"),
    (3, dict(topic="orders"), "handler must be callable"),
    (lambda m: None, dict(topic="orders", concurrency=0), "concurrency must be"),
])
def test_run_worker_refuses_what_cannot_run(db, handler, kwargs, text):
    with pytest.raises(fdq.ConfigError, match=text):
        fdq.worker.run_worker(db, handler, **kwargs)


def test_a_batch_handler_from_the_decorator_gets_lists(db):
    _push(db, 60)
    sizes = []

    @fdq.worker.handler(topic="orders", subscription="billing", batch=True)
    def bill(msgs):
        sizes.append(len(msgs))

    stop = threading.Event()
    t, out = _run_in_thread(db, bill, stop)
    wait_for(lambda: sum(sizes) == 60, 30, "60 handled")
    stop.set()
    t.join(30)
    assert "error" not in out and out["worker"].handled == 60 and max(sizes) > 1
    assert sub_stats(db, "orders", "billing")["acked"] == 60


def test_a_coroutine_handler_cannot_take_batches(db):
    async def h(msgs):
        pass
    with pytest.raises(fdq.ConfigError, match="batch handlers run on fdq.tail only"):
        fdq.worker.run_worker(db, h, topic="orders", batch=True)


def test_a_coroutine_handler_cannot_be_exactly_once(db):
    async def h(msg):
        pass
    with pytest.raises(fdq.ConfigError, match="coroutine handler cannot"):
        fdq.worker.run_worker(db, h, topic="orders", mode="exactly-once")
