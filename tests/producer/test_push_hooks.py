"""fdq.hooks around pushes: every way to push calls push_begin in the caller's thread
and push_end with the outcome, and a hook's envelopes are what is pushed."""
from __future__ import annotations

import logging
import threading

import pytest

import fdq
from fdq import hooks
from fdq.errors import MessageTooLarge

from fdqtest import log_records


class Recorder(hooks.Hook):
    def __init__(self):
        self.calls = []

    def push_begin(self, topic, envelopes):
        return (topic, len(envelopes), threading.current_thread())

    def push_end(self, state, topic, envelopes, results, error, seconds):
        self.calls.append({"state": state, "topic": topic, "results": results, "error": error,
                           "seconds": seconds})


@pytest.fixture
def recorder():
    r = Recorder()
    hooks.register(r)
    yield r
    hooks.unregister(r)


def test_each_way_to_push_runs_the_hooks_in_the_callers_thread(db, recorder):
    fdq.Supervisor(db).create_topic("t", shards=2, max_message_bytes=1000)
    p = fdq.Producer(db)
    me = threading.current_thread()
    one = p.push("t", b"a")
    many = p.push_many("t", [b"b", b"c"])
    later = p.push_async("t", b"d").result(30)
    streamed = [r for rs in p.push_stream("t", [b"e", b"f", b"g"], max_messages=2) for r in rs]
    with pytest.raises(MessageTooLarge):
        p.push("t", b"x" * 2000)

    calls = recorder.calls
    assert [c["state"] for c in calls] == [("t", 1, me), ("t", 2, me), ("t", 1, me), ("t", 2, me),
                                           ("t", 1, me), ("t", 1, me)]
    assert [c["results"] for c in calls[:5]] == [[one], many, [later], streamed[:2], streamed[2:]]
    assert all(c["error"] is None and c["seconds"] > 0 for c in calls[:5])
    assert isinstance(calls[5]["error"], MessageTooLarge) and calls[5]["results"] is None


def test_an_aio_push_runs_the_hooks_begun_in_the_loops_thread_ended_with_its_outcome(db, recorder):
    """``fdq.aio.push``: push_begin in the awaiting task's thread, push_end once per
    push with its result or its error (resolved on the loop only after)."""
    import asyncio
    import fdq.aio
    fdq.Supervisor(db).create_topic("t", shards=2, max_message_bytes=1000)
    p = fdq.Producer(db)
    me = threading.current_thread()

    async def main():
        good = await asyncio.gather(*(fdq.aio.push(p, "t", b"m%d" % i) for i in range(3)))
        with pytest.raises(MessageTooLarge):
            await fdq.aio.push(p, "t", b"x" * 2000)
        return good
    good = asyncio.run(main())
    calls = recorder.calls
    assert [c["state"] for c in calls] == [("t", 1, me)] * 4
    assert sorted(c["results"][0].id for c in calls[:3]) == sorted(r.id for r in good)
    assert isinstance(calls[3]["error"], MessageTooLarge) and calls[3]["results"] is None


def test_a_cancelled_aio_push_ends_its_hooks_call_as_cancelled_as_a_cancelled_push_async(db, recorder):
    """A task awaiting ``fdq.aio.push`` is cancelled before the commit: its push_end gets
    neither results nor an error (what a ``push_async`` future cancelled first gets:
    ``fdq.metrics`` counts it ``cancelled``, not ``ok``); the push is stored all the
    same. The other push of that commit ends with its result."""
    import asyncio
    import fdq.aio
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=300))    # both in one commit

    async def main():
        doomed = asyncio.ensure_future(fdq.aio.push(p, "t", b"cancelled"))
        kept = asyncio.ensure_future(fdq.aio.push(p, "t", b"kept"))
        await asyncio.sleep(0)      # (queued when their tasks first run)
        doomed.cancel()
        r = await asyncio.wait_for(kept, 30)
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return r
    kept = asyncio.run(main())
    assert p.flush(timeout=30)
    ends = sorted(((c["results"] is None, c["error"] is None) for c in recorder.calls), reverse=True)
    assert ends == [(True, True), (False, True)]
    assert [c["results"] for c in recorder.calls if c["results"] is not None] == [[kept]]
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 2


def test_a_cancelled_aio_push_counts_as_cancelled_in_the_process_metrics(db):
    import asyncio
    import fdq.aio
    import fdq.metrics
    from prometheus_client import CollectorRegistry
    registry = CollectorRegistry()
    collector = fdq.metrics.register(db, registry, database_metrics=False)
    try:
        p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=300))

        async def main():
            doomed = asyncio.ensure_future(fdq.aio.push(p, "t", b"cancelled"))
            kept = asyncio.ensure_future(fdq.aio.push(p, "t", b"kept"))
            await asyncio.sleep(0)
            doomed.cancel()
            await asyncio.wait_for(kept, 30)
        asyncio.run(main())
        assert p.flush(timeout=30)
        counted = {s.labels["outcome"]: s.value for f in registry.collect() for s in f.samples
                   if s.name == "fdq_pushed_messages_total" and s.labels.get("topic") == "t"}
        assert counted == {"ok": 1, "cancelled": 1}
    finally:
        collector.close()


def test_a_hook_may_replace_the_envelopes_pushed(db):
    class Stamp(hooks.Hook):
        def push_begin(self, topic, envelopes):
            envelopes[:] = [fdq.Envelope(e.body, headers={"stamped": True}) for e in envelopes]

    fdq.Supervisor(db).create_topic("t", shards=1, extend=True)
    stamp = Stamp()
    hooks.register(stamp)
    try:
        fdq.Producer(db).push("t", b"x")
        fdq.Producer(db).push_many("t", [b"y"])
    finally:
        hooks.unregister(stamp)
    assert [rec[3] for rec in log_records(db, "t")] == [{"stamped": True}] * 2


def test_a_failing_hook_is_logged_once_and_the_push_goes_on(db, caplog):
    class Broken(hooks.Hook):
        def push_begin(self, topic, envelopes):
            raise RuntimeError("broken hook")

    fdq.Supervisor(db).create_topic("t", shards=1)
    broken = Broken()
    hooks.register(broken)
    try:
        with caplog.at_level(logging.ERROR, logger="fdq.hooks"):
            for _ in range(3):
                fdq.Producer(db).push("t", b"x")
    finally:
        hooks.unregister(broken)
    assert len(log_records(db, "t")) == 3
    assert [r.getMessage() for r in caplog.records if "broken hook" in r.getMessage()] == [
        f"fdq hook {broken!r} failed in push_begin (ignored; logged once): RuntimeError: broken hook"]


def test_a_hook_that_skips_is_not_called_at_the_end(db, recorder):
    class Skipper(hooks.Hook):
        ended = 0

        def push_begin(self, topic, envelopes):
            return hooks.SKIP

        def push_end(self, *args):
            Skipper.ended += 1

    fdq.Supervisor(db).create_topic("t", shards=1)
    skipper = Skipper()
    hooks.register(skipper)
    try:
        fdq.Producer(db).push("t", b"x")
    finally:
        hooks.unregister(skipper)
    assert Skipper.ended == 0
    assert len(recorder.calls) == 1     # the other hook's end all the same
