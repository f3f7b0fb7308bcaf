"""OpenTelemetry propagation (fdq.tracing): a push writes the trace context of its
``send`` span into each message, the handler runs in a ``process`` span linked to it.

The spans go to the SDK's in-memory exporter through a provider given to
``fdq.tracing.configure`` (the process's global provider is never set)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import fdq
import fdq.aio
import fdq.tracing
from fdq.errors import InvalidHeader

from fdqtest import FAST, fast, log_records, wait_for

MODES = {"at-least-once": {}, "at-most-once": {"acking": False}, "exactly-once": {"transactional": True}}


class Traced:
    def __init__(self):
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("test")

    def spans(self, name=None) -> list:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]

    def wait_spans(self, name, n=1) -> list:
        wait_for(lambda: len(self.spans(name)) >= n, 30, what=f"{n} span(s) {name!r}")
        return self.spans(name)


@pytest.fixture
def traced():
    t = Traced()
    fdq.tracing.configure(t.provider)
    yield t
    fdq.tracing.configure()     # back to the default hook (global provider)


def _handler(mode, seen, fail=()):
    def handle(m):
        seen.append(m)
        if m.body in fail:
            raise ValueError(f"cannot handle {m.body!r}")

    if mode == "exactly-once":
        return lambda tr, m: handle(m)
    return handle


@pytest.mark.parametrize("extend", [True, False], ids=["extend", "plain"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_push_in_a_request_is_sent_in_its_trace_and_its_handler_span_links_to_it(db, traced, mode, extend):
    fdq.Supervisor(db).create_topic("orders", shards=2, extend=extend)
    with traced.tracer.start_as_current_span("request") as request:
        r = fdq.Producer(db).push("orders", b"o1")
    trace_id = request.get_span_context().trace_id

    send, = traced.spans("send orders")
    assert send.kind is SpanKind.PRODUCER
    assert send.parent.span_id == request.get_span_context().span_id
    assert send.context.trace_id == trace_id
    assert send.attributes["messaging.system"] == "fdq"
    assert send.attributes["messaging.destination.name"] == "orders"
    assert send.attributes["messaging.operation.type"] == "send"
    assert send.attributes["messaging.message.id"] == r.id

    seen = []
    c = fdq.tail(db, "orders", _handler(mode, seen), config=FAST, **MODES[mode])
    try:
        process, = traced.wait_spans("process orders")
    finally:
        c.shutdown()
    m, = seen
    assert m.headers["traceparent"].startswith(f"00-{trace_id:032x}-{send.context.span_id:016x}-")
    assert set(m.headers) <= fdq.headers.PROPAGATION
    assert process.kind is SpanKind.CONSUMER
    link, = process.links
    assert link.context.trace_id == trace_id
    assert link.context.span_id == send.context.span_id
    assert process.context.trace_id != trace_id      # its own trace, linked to the request's
    assert process.status.status_code is StatusCode.UNSET
    assert process.attributes["messaging.consumer.group.name"] == "default"
    assert process.attributes["messaging.destination.partition.id"] == str(r.shard)
    assert process.attributes["messaging.message.id"] == r.id
    assert process.attributes["fdq.attempt"] == 1


@pytest.mark.parametrize("mode", list(MODES))
def test_a_failing_handler_leaves_its_exception_and_error_status_on_the_span(db, traced, mode):
    fdq.Supervisor(db).create_topic("t", shards=1)
    with traced.tracer.start_as_current_span("request"):
        fdq.Producer(db).push("t", b"bad")
    seen = []
    c = fdq.tail(db, "t", _handler(mode, seen, fail={b"bad"}), on_error=lambda e: None,
                 config=fast(max_deliver=2), **MODES[mode])
    try:
        process = traced.wait_spans("process t", 1)[0]
    finally:
        c.shutdown()
    assert process.status.status_code is StatusCode.ERROR
    assert "ValueError: cannot handle b'bad'" in process.status.description
    event, = [e for e in process.events if e.name == "exception"]
    assert event.attributes["exception.type"] == "ValueError"
    assert process.attributes["error.type"] == "ValueError"
    assert process.attributes["fdq.outcome"] == "error"


@pytest.mark.parametrize("mode", list(MODES))
def test_a_batch_handler_runs_in_one_span_linked_to_each_messages_send(db, traced, mode):
    """tail(batch=True): one ``process`` span per handler call, linked to the send span
    of every message of its batch (three requests: three traces), current while it runs;
    a batch handler that raises leaves its error on the span."""
    fdq.Supervisor(db).create_topic("orders", shards=1)
    p = fdq.Producer(db)
    for i in range(3):
        with traced.tracer.start_as_current_span(f"request {i}"):
            p.push("orders", b"o%d" % i)
    sends = {s.context.span_id: s for s in traced.spans("send orders")}
    assert len(sends) == 3 and len({s.context.trace_id for s in sends.values()}) == 3
    batches, gate = [], threading.Event()

    def handle(msgs):
        batches.append([m.body for m in msgs])
        with traced.tracer.start_as_current_span("inside"):
            pass
        if not gate.is_set():
            gate.set()
            if mode == "at-least-once":
                raise ValueError("the first batch fails")

    c = fdq.tail(db, "orders", (lambda tr, msgs: handle(msgs)) if mode == "exactly-once" else handle,
                 batch=True, config=fast(max_deliver=3), on_error=lambda e: None, **MODES[mode])
    try:
        wait_for(lambda: len(batches) >= (2 if mode == "at-least-once" else 1)
                 and len(traced.spans("process orders")) >= len(batches), 30, what="the batch spans")
    finally:
        c.shutdown()
    process = traced.spans("process orders")
    first = process[0]
    assert first.kind is SpanKind.CONSUMER
    assert len(batches[0]) == first.attributes["messaging.batch.message_count"] == 3
    assert {link.context.span_id for link in first.links} == set(sends)
    assert {link.context.trace_id for link in first.links} == {s.context.trace_id for s in sends.values()}
    inside = traced.spans("inside")[0]
    assert inside.parent.span_id == first.context.span_id
    if mode == "at-least-once":
        assert first.status.status_code is StatusCode.ERROR and first.attributes["fdq.outcome"] == "error"
        assert process[1].status.status_code is StatusCode.UNSET and len(process[1].links) == 3
    else:
        assert first.attributes["fdq.outcome"] == "ok"


async def _first_of_aio_messages(db, tracer):
    async with await fdq.aio.Consumer.open(db, "orders", config=FAST) as c:
        with tracer.start_as_current_span("poll") as poll:
            async for m in c.messages(timeout=10):
                m.ack()
                return poll


@pytest.mark.parametrize("how", ["fetch", "messages", "fdq.aio messages"])
def test_a_pull_consumers_lease_records_a_receive_span_linked_to_each_message(db, traced, how):
    fdq.Supervisor(db).create_topic("orders", shards=1)
    p = fdq.Producer(db)
    for i in range(2):
        with traced.tracer.start_as_current_span(f"request {i}"):
            p.push("orders", b"o%d" % i)
    sends = {s.context.span_id for s in traced.spans("send orders")}
    if how == "fdq.aio messages":
        poll = asyncio.run(_first_of_aio_messages(db, traced.tracer))
    else:
        with fdq.Consumer(db, "orders", config=FAST) as c, traced.tracer.start_as_current_span("poll") as poll:
            if how == "fetch":
                got = wait_for(lambda: c.fetch(10, timeout=0.5), 30, what="a fetch")
            else:
                got = [next(iter(c.messages(timeout=10)))]
            for m in got:
                m.ack()
    receive, = traced.spans("receive orders")
    assert receive.kind is SpanKind.CLIENT
    assert receive.parent.span_id == poll.get_span_context().span_id
    assert receive.attributes["messaging.operation.type"] == "receive"
    assert receive.attributes["messaging.batch.message_count"] == 2
    assert {link.context.span_id for link in receive.links} == sends


def test_a_handler_span_is_current_while_it_runs(db, traced):
    """What the handler traces (its own spans, its pushes) belongs to its process span."""
    fdq.Supervisor(db).create_topic("in", shards=1)
    fdq.Supervisor(db).create_topic("out", shards=1)
    p = fdq.Producer(db)
    with traced.tracer.start_as_current_span("request"):
        p.push("in", b"x")

    def handle(m):
        p.push("out", m.body)

    c = fdq.tail(db, "in", handle, config=FAST)
    try:
        process, = traced.wait_spans("process in")
    finally:
        c.shutdown()
    forward, = traced.spans("send out")
    assert forward.parent.span_id == process.context.span_id
    assert forward.context.trace_id == process.context.trace_id


def test_push_many_and_push_async_carry_the_callers_context(db, traced):
    """push_async is committed by the producer's flusher thread: the context is the
    caller's all the same (taken in its thread)."""
    fdq.Supervisor(db).create_topic("t", shards=4, extend=True)
    p = fdq.Producer(db)
    with traced.tracer.start_as_current_span("batch") as batch:
        rs = p.push_many("t", [fdq.Envelope(b"a", headers={"k": 1}), b"b", b"c"])
    many, = traced.spans("send t")
    assert many.parent.span_id == batch.get_span_context().span_id
    assert many.attributes["messaging.batch.message_count"] == 3

    futures = []

    def caller(i):
        with traced.tracer.start_as_current_span(f"request {i}"):
            futures.append(p.push_async("t", b"async %d" % i))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len({f.result(30).id for f in futures}) == 4
    sends = traced.wait_spans("send t", 5)
    requests = {s.context.span_id: s for s in traced.spans() if s.name.startswith("request ")}
    for s in sends[1:]:
        assert s.parent.span_id in requests       # each a child of its own caller's span
        assert s.context.trace_id == requests[s.parent.span_id].context.trace_id
    assert len({s.context.trace_id for s in sends[1:]}) == 4

    parents = {}
    for rec in log_records(db, "t"):
        headers = rec[3]
        parents[rec[4]] = headers["traceparent"].split("-")[2]
    assert {parents[b] for b in (b"a", b"b", b"c")} == {f"{many.context.span_id:016x}"}
    assert {parents[b"async %d" % i] for i in range(4)} == {f"{s.context.span_id:016x}" for s in sends[1:]}
    assert [r.id for r in rs] == sorted(r.id for r in rs)


def test_a_message_already_carrying_a_traceparent_keeps_it(db, traced):
    fdq.Supervisor(db).create_topic("t", shards=1, extend=True)
    theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with traced.tracer.start_as_current_span("request"):
        fdq.Producer(db).push("t", b"x", headers={"traceparent": theirs, "region": "eu"})
    headers, = [rec[3] for rec in log_records(db, "t")]
    assert headers == {"traceparent": theirs, "region": "eu"}


def test_a_plain_topic_stores_the_trace_context_headers_and_refuses_any_other(db):
    fdq.Supervisor(db).create_topic("plain", shards=1)
    p = fdq.Producer(db)
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    p.push("plain", b"x", headers={"traceparent": tp, "tracestate": "k=v", "baggage": "user=7"})
    with pytest.raises(InvalidHeader, match="has no extend support: headers are refused"):
        p.push("plain", b"y", headers={"traceparent": tp, "region": "eu"})
    c = fdq.Consumer(db, "plain", config=FAST)
    try:
        m, = c.fetch(10, timeout=5)
    finally:
        c.close()
    assert dict(m.headers) == {"traceparent": tp, "tracestate": "k=v", "baggage": "user=7"}


def test_an_aio_handler_runs_in_a_process_span(db, traced):
    fdq.Supervisor(db).create_topic("t", shards=2)
    with traced.tracer.start_as_current_span("request") as request:
        fdq.Producer(db).push_many("t", [b"ok", b"bad"])

    async def main():
        async def handle(m):
            if m.body == b"bad":
                raise ValueError("bad")

        t = await fdq.aio.tail(db, "t", handle, on_error=lambda e: None, config=FAST)
        try:
            deadline = asyncio.get_running_loop().time() + 30
            while len(traced.spans("process t")) < 2:
                assert asyncio.get_running_loop().time() < deadline, "no process spans"
                await asyncio.sleep(0.02)
        finally:
            await t.shutdown()

    asyncio.run(main())
    spans = traced.spans("process t")[:2]
    assert {s.links[0].context.trace_id for s in spans} == {request.get_span_context().trace_id}
    by_id = {s.attributes["messaging.message.body.size"]: s for s in spans}
    assert by_id[2].status.status_code is StatusCode.UNSET       # b"ok"
    assert by_id[3].status.status_code is StatusCode.ERROR       # b"bad"


def test_with_the_api_alone_nothing_is_written_and_no_span_made(db_url, tmp_path):
    """opentelemetry-api without an SDK (no provider set, no span current): the default
    hook is registered and returns at once."""
    out = _run(db_url, "")
    assert out["hooks"] == ["OpenTelemetryHook(tracer_provider=None)"]
    assert out["headers"] == [None, {"a": 1}]
    assert out["handled"] == [{}, {"a": 1}]


GLOBAL = """
import sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
import fdq
from fdqtest import log_records

db = fdq.connect(sys.argv[1])
fdq.Supervisor(db).create_topic("t", shards=1)
p = fdq.Producer(db)
p.push("t", b"before")      # the default hook (loaded by Producer) has no provider yet
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
p.push("t", b"after")
print([rec[3] and sorted(rec[3]) for rec in log_records(db, "t")], [s.name for s in exporter.get_finished_spans()])
"""


def test_the_global_provider_is_used_once_set(db_url):
    r = subprocess.run([sys.executable, "-c", GLOBAL, db_url], capture_output=True, text=True, timeout=120,
                       env=_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[None, ['traceparent']] ['send t']"


def test_without_opentelemetry_nothing_is_imported_and_records_are_unchanged(db_url):
    out = _run(db_url, 'sys.modules["opentelemetry"] = None\n')
    assert out["hooks"] == []
    assert out["imported"] == []
    assert out["headers"] == [None, {"a": 1}]
    assert out["handled"] == [{}, {"a": 1}]
    assert out["plain_record_is_the_plain_encoding"]


MADE = """
import sys
import fdq
db = fdq.connect(sys.argv[1])
fdq.Supervisor(db).create_topic("t", shards=1)
before = "fdq.tracing" in sys.modules
made = fdq.Producer(db) if sys.argv[2] == "producer" else fdq.Consumer(db, "t")
print(before, "fdq.tracing" in sys.modules)
if sys.argv[2] == "consumer":
    made.close()
"""


@pytest.mark.parametrize("what", ["producer", "consumer"])
def test_making_a_producer_or_consumer_loads_the_default_hook_before_any_push_or_handler(db_url, what):
    """The import (~15 ms) is not part of the first push's or handler call's latency."""
    r = subprocess.run([sys.executable, "-c", MADE, db_url, what], capture_output=True, text=True, timeout=120,
                       env=_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]


SCRIPT = """
import json, sys, time
{prelude}
import fdq, fdq.hooks
from fdq.keyspace import Keyspace
from fdq.keyspace.codec import packer
from fdqtest import FAST, log_records, scan, wait_for

db = fdq.connect(sys.argv[1])
sup = fdq.Supervisor(db)
sup.create_topic("plain", shards=1)
sup.create_topic("ext", shards=1, extend=True)
p = fdq.Producer(db)
p.push("plain", b"x")
p.push("ext", b"y", headers={{"a": 1}})
handled = []
for topic in ("plain", "ext"):
    c = fdq.tail(db, topic, lambda m: handled.append(dict(m.headers)), config=FAST)
    wait_for(lambda: len(handled) == ("plain", "ext").index(topic) + 1, 30, what="the handler")
    c.shutdown()
plain, = log_records(db, "plain")
ext, = log_records(db, "ext")
(_key, raw), = scan(db, Keyspace().topic("plain").log.key())
print(json.dumps({{
    "hooks": [repr(h) for h in fdq.hooks.registered()],
    "imported": sorted(k for k, v in sys.modules.items()
                       if v is not None and (k.startswith("opentelemetry") or k == "fdq.tracing")),
    "headers": [plain[3], ext[3]],
    "handled": handled,
    "plain_record_is_the_plain_encoding": raw == packer()([plain[0], 0, None, None, b"x"]),
}}))
"""


def _env() -> dict:
    """This environment, with the tests' directory on the path (fdqtest in a subprocess)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([tests] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def _run(db_url, prelude) -> dict:
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(prelude="import sys\n" + prelude), db_url],
                       capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])
