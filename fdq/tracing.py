"""OpenTelemetry trace context propagation (needs ``opentelemetry-api``: ``fdq-queue[otel]``).

Loaded by :mod:`fdq.hooks` when a process makes its first producer or consumer, where
``opentelemetry`` is importable, and registered there as a hook with the global tracer
provider; where it is not importable nothing is imported, no header written, nothing run.

* A push (``push``, ``push_async``, ``push_many``, a ``push_stream`` transaction) runs in
  a PRODUCER span ``send <topic>``, child of the caller's current span, and writes that
  span's context into each message's headers as the global propagator writes it (by
  default W3C ``traceparent``, ``tracestate`` and ``baggage``; only those names are
  carried: ``fdq.headers.PROPAGATION``, stored on every topic, extend support or not).
  A message that already carries a ``traceparent`` (an NSQ ``PUB_EXT``'s, say) keeps it.
* ``fdq.tail`` (each mode) and ``fdq.aio.tail`` run the handler in a CONSUMER span
  ``process <topic>``, current while it runs (spans the handler starts are its children),
  linked to the context the message carries; a handler that raises leaves the exception
  on the span and its status ERROR. Exactly-once: one span per attempt of the
  transaction. A batch handler (``tail(batch=True)``) runs in one such span linked to
  the context of each message of its batch (``messaging.batch.message_count``).
* A pull consumer's ``fetch()`` (and each lease of ``messages()``) that leased messages
  records a CLIENT span ``receive <topic>``, child of the caller's current span, linked
  to each message's context (what the application then does is its own to trace).

Without an SDK (no tracer provider set) nothing records: the hook returns at once,
writing no header (unless the caller's context carries a valid span: then that context
is passed on, as OpenTelemetry's API does). :func:`configure` replaces the registered hook
(an explicit tracer provider, or ``enabled=False``).
"""
from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from . import hooks
from .envelope import Envelope
from .errors import InvalidHeader
from .headers import PROPAGATION

TRACER_NAME = "fdq"
_UNKNOWN = object()
SYSTEM = "fdq"


class OpenTelemetryHook(hooks.Hook):
    """The tracing hook (see the module). ``tracer_provider``: None for the global one."""

    def __init__(self, tracer_provider=None):
        self.tracer_provider = tracer_provider
        self._tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
        self._global_set = False
        if tracer_provider is None:
            trace.get_tracer_provider()     # loads a provider named by OTEL_PYTHON_TRACER_PROVIDER

    def __repr__(self):
        return f"OpenTelemetryHook(tracer_provider={self.tracer_provider!r})"

    def _records(self) -> bool:
        """Whether a span started now may be recorded: an explicit provider, or a global
        one set (the API's proxy delegates to a no-op tracer until then; set once, it
        stays). ``trace.get_tracer_provider()`` looks up an environment variable on each
        call until a provider is set (~3 us): the API module's global is read instead."""
        if self.tracer_provider is not None or self._global_set:
            return True
        provider = getattr(trace, "_TRACER_PROVIDER", _UNKNOWN)
        if provider is None:
            return False
        if provider is _UNKNOWN:        # (an API without that global: the public call)
            provider = trace.get_tracer_provider()
            if isinstance(provider, trace.ProxyTracerProvider):
                return False
        self._global_set = True
        return True

    def push_begin(self, topic: str, envelopes: list):
        if not self._records() and not trace.get_current_span().get_span_context().is_valid:
            return hooks.SKIP   # nothing records a span, no context to pass on
        attributes = {"messaging.system": SYSTEM, "messaging.destination.name": topic,
                      "messaging.operation.type": "send", "messaging.operation.name": "send"}
        if len(envelopes) > 1:
            attributes["messaging.batch.message_count"] = len(envelopes)
        span = self._tracer.start_span(f"send {topic}", kind=SpanKind.PRODUCER, attributes=attributes)
        carrier = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        carrier = {k: v for k, v in carrier.items() if k in PROPAGATION and isinstance(v, str)}
        if carrier:
            for i, env in enumerate(envelopes):
                if not env.headers or "traceparent" not in env.headers:
                    envelopes[i] = _with_context(env, carrier)
        return span

    def push_end(self, span, topic: str, envelopes: list, results, error, seconds: float):
        if span is None:    # (its push_begin failed: logged by fdq.hooks)
            return
        if results:
            if len(results) == 1:
                span.set_attribute("messaging.message.id", results[0].id)
            elif len(results) != len(envelopes):    # a push_stream transaction took fewer
                span.set_attribute("messaging.batch.message_count", len(results))
        if error is not None:
            _failed(span, error)
        span.end()

    def handle_begin(self, message):
        if not self._records():
            return hooks.SKIP
        sent = _sent_context(message)
        links = [Link(sent)] if sent is not None else None
        attributes = {"messaging.system": SYSTEM, "messaging.destination.name": message.topic,
                      "messaging.operation.type": "process", "messaging.operation.name": "process",
                      "messaging.consumer.group.name": message.subscription,
                      "messaging.destination.subscription.name": message.subscription,
                      "messaging.destination.partition.id": str(message.shard),
                      "messaging.message.id": message.id,
                      "messaging.message.body.size": len(message.body),
                      "fdq.attempt": message.attempts}
        if message.tag:
            attributes["fdq.tag"] = message.tag
        span = self._tracer.start_span(f"process {message.topic}", kind=SpanKind.CONSUMER, links=links,
                                       attributes=attributes)
        return span, otel_context.attach(trace.set_span_in_context(span))

    def handle_end(self, state, message, outcome: str, error, seconds: float):
        if state is None:   # (its handle_begin failed: logged by fdq.hooks)
            return
        span, token = state
        otel_context.detach(token)
        span.set_attribute("fdq.outcome", outcome)
        if error is not None:
            _failed(span, error)
        span.end()

    def handle_batch_begin(self, messages: list):
        if not self._records() or not messages:
            return hooks.SKIP
        links, attributes = _batch_span(messages, "process")
        span = self._tracer.start_span(f"process {messages[0].topic}", kind=SpanKind.CONSUMER, links=links,
                                       attributes=attributes)
        return span, otel_context.attach(trace.set_span_in_context(span))

    def handle_batch_end(self, state, messages: list, outcome: str, error, seconds: float):
        self.handle_end(state, None, outcome, error, seconds)

    def receive(self, messages: list):
        if not self._records() or not messages:
            return
        links, attributes = _batch_span(messages, "receive")
        if len(messages) == 1:
            attributes["messaging.message.id"] = messages[0].id
        self._tracer.start_span(f"receive {messages[0].topic}", kind=SpanKind.CLIENT, links=links,
                                attributes=attributes).end()


def _batch_span(messages: list, operation: str) -> tuple:
    """The links (to each message's sender, None if none has one) and attributes of a
    span over ``messages`` (of one topic and subscription)."""
    first = messages[0]
    links = [Link(sent) for sent in map(_sent_context, messages) if sent is not None]
    attributes = {"messaging.system": SYSTEM, "messaging.destination.name": first.topic,
                  "messaging.operation.type": operation, "messaging.operation.name": operation,
                  "messaging.consumer.group.name": first.subscription,
                  "messaging.destination.subscription.name": first.subscription,
                  "messaging.batch.message_count": len(messages)}
    return links or None, attributes


def _sent_context(message):
    """The span context a message carries (its ``traceparent``), or None."""
    if not message.headers or "traceparent" not in message.headers:
        return None
    sent = trace.get_current_span(propagate.extract(message.headers)).get_span_context()
    return sent if sent.is_valid else None


def _failed(span, error: BaseException):
    span.record_exception(error)
    span.set_attribute("error.type", type(error).__qualname__)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


def _with_context(env: Envelope, carrier: dict) -> Envelope:
    """``env`` with the trace context headers added; as it was if they do not fit its
    headers' limits (``baggage`` is dropped first): tracing never fails a push."""
    for extra in (carrier, {k: v for k, v in carrier.items() if k != "baggage"}):
        if not extra:
            break
        try:
            return Envelope(env.body, env.shard_key, env.delay, env.msg_id, {**(env.headers or {}), **extra})
        except InvalidHeader:
            continue
    return env


def default_hook() -> OpenTelemetryHook:
    """The hook :mod:`fdq.hooks` registers by default: the global tracer provider."""
    return OpenTelemetryHook()


def configure(tracer_provider=None, *, enabled: bool = True) -> OpenTelemetryHook | None:
    """Replace this process's tracing hook: one using ``tracer_provider`` (None: the
    global one), or none (``enabled=False``: FDQ writes no trace header and starts no
    span). Returns the hook registered."""
    for hook in hooks.registered():
        if isinstance(hook, OpenTelemetryHook):
            hooks.unregister(hook)
    if not enabled:
        return None
    hook = OpenTelemetryHook(tracer_provider)
    hooks.register(hook)
    return hook


__all__ = ["OpenTelemetryHook", "configure", "default_hook"]
