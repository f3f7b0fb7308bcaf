"""Hooks: code run around every push and every handler call (tracing, metrics).

A hook is an object with any of these methods (:class:`Hook` has them all, doing nothing)::

    push_begin(topic, envelopes) -> state
        in the pushing thread, before the push; ``envelopes`` is a list the hook may
        change in place (an ``Envelope`` with more headers, say: what is pushed)
    push_end(state, topic, envelopes, results, error, seconds)
        when the push's outcome is known (``push_async``: in the thread that committed
        it; ``fdq.aio.push``: on its event loop, ordered with a cancel): ``results`` the PushResults (``push_stream``: of the messages this
        transaction took, maybe fewer) or None, ``error`` the exception or None (both
        None: a ``push_async`` future cancelled first; the push may still be stored),
        ``seconds`` since ``push_begin``
    handle_begin(message) -> state
        in the thread (``fdq.aio``: the task) about to run a ``tail`` handler on ``message``
    handle_end(state, message, outcome, error, seconds)
        in the same thread or task once the handler returned or raised and the
        message is settled: ``outcome`` is ``"error"`` (it raised), else the settlement
        (``"ack"``, ``"nak"``, ``"term"``) or ``"ok"`` (nothing to settle: at-most-once,
        exactly-once)

    handle_batch_begin(messages) -> state
    handle_batch_end(state, messages, outcome, error, seconds)
        the same around a batch handler's call (``tail(batch=True)``: one call on a
        round's messages); ``outcome`` is ``"error"`` (it raised) or ``"ok"``

    receive(messages)
        in the thread of a pull consumer's ``fetch()`` (or ``messages()``'s lease;
        ``fdq.aio.Consumer.messages()``: on its event loop) that leased ``messages``
        (one call, nothing to finish)

A hook whose ``*_begin`` returns :data:`SKIP` has nothing to finish: its ``*_end`` is not
called for that push or handler call (the tracing hook without a tracer provider); when
every hook skips, the call costs nothing more (no clock read, no call object).

Call sites: :class:`fdq.Producer`'s ``push``, ``push_async``, ``push_many`` and
``push_stream`` (one ``push_begin`` per call, ``push_stream``: per transaction); each
delivery mode of ``fdq.tail`` and ``fdq.aio.tail`` around the handler. A hook that
raises is logged (once per hook and method) and otherwise ignored: it never fails a push
or a handler.

With nothing registered a push or a handler call costs one module attribute test
(``active``). Making a :class:`fdq.Producer` or a consumer loads the defaults
(:func:`load_defaults`): :mod:`fdq.tracing` when ``opentelemetry-api`` is importable
(nothing is imported otherwise).
"""
from __future__ import annotations

import importlib
import logging
import threading
from time import perf_counter

from .settlement import ACK, NAK, RELEASE, TERM

log = logging.getLogger("fdq.hooks")

_hooks: tuple = ()      # what is registered, in order
_loaded = False         # the defaults were looked for
_lock = threading.Lock()
_reported = set()       # (hook id, method) already logged
active = True           # a hook is registered, or the defaults are not loaded yet: call sites test it

_OUTCOMES = {ACK: "ack", NAK: "nak", TERM: "term", RELEASE: "release"}
SKIP = object()     # a ``*_begin``'s answer: no ``*_end`` for this call


class Hook:
    """A hook doing nothing: subclass it and override what you need."""

    def push_begin(self, topic: str, envelopes: list):
        return None

    def push_end(self, state, topic: str, envelopes: list, results, error, seconds: float):
        pass

    def handle_begin(self, message):
        return None

    def handle_end(self, state, message, outcome: str, error, seconds: float):
        pass

    def handle_batch_begin(self, messages: list):
        return None

    def receive(self, messages: list):
        pass

    def handle_batch_end(self, state, messages: list, outcome: str, error, seconds: float):
        pass


def register(hook) -> None:
    """Run ``hook`` around pushes and handlers of this process from now on (after the
    hooks registered before it; registered twice: once)."""
    global _hooks, active
    load_defaults()
    with _lock:
        if hook not in _hooks:
            _hooks = _hooks + (hook,)
        active = True


def unregister(hook) -> None:
    """Stop running ``hook`` (not registered: nothing happens)."""
    global _hooks, active
    load_defaults()
    with _lock:
        _hooks = tuple(h for h in _hooks if h is not hook)
        active = bool(_hooks)


def registered() -> tuple:
    """The hooks registered now, in the order they run."""
    load_defaults()
    return _hooks


def load_defaults():
    """Once per process: register the default hooks whose package is importable
    (:mod:`fdq.tracing` with ``opentelemetry-api``). A :class:`fdq.Producer` and a
    consumer call it when they are made: the import (~15 ms with ``opentelemetry-api``)
    is then not part of the first push's or handler call's latency."""
    global _loaded, _hooks, active
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        try:
            tracing = importlib.import_module("fdq.tracing")
        except ImportError as e:
            if not (e.name or "").startswith("opentelemetry"):
                raise       # fdq.tracing's own bug: not a missing package
            tracing = None
        if tracing is not None:
            _hooks = _hooks + (tracing.default_hook(),)
        active = bool(_hooks)
        _loaded = True


def _failed(hook, method: str, e: BaseException):
    key = (id(hook), method)
    if key not in _reported:
        _reported.add(key)
        log.error("fdq hook %r failed in %s (ignored; logged once): %s: %s", hook, method,
                  type(e).__name__, e, exc_info=e)


class PushCall:
    """One push between ``push_begin`` and ``push_end`` (:func:`begin_push`)."""

    __slots__ = ("topic", "envelopes", "hooks", "states", "t0")

    def end(self, results, error=None):
        """Tell the hooks how the push ended (``results`` None on an error)."""
        seconds = perf_counter() - self.t0
        for hook, state in zip(self.hooks, self.states):
            if state is SKIP:
                continue
            try:
                hook.push_end(state, self.topic, self.envelopes, results, error, seconds)
            except Exception as e:
                _failed(hook, "push_end", e)

    def end_future(self, future):
        """``end`` from a ``push_async`` future's done callback."""
        if future.cancelled():
            self.end(None, None)
            return
        error = future.exception()
        self.end(None if error is not None else [future.result()], error)


def _begin(method: str, *args):
    """Run every hook's ``method`` (``push_begin`` / ``handle_begin``): ``(hooks, their
    states)``, or None if none is registered or every one skipped."""
    if not _loaded:
        load_defaults()
    hooks = _hooks
    if not hooks:
        return None
    states = []
    for hook in hooks:
        fn = getattr(hook, method, None)
        if fn is None:      # a hook without this method (written before it existed): skips
            states.append(SKIP)
            continue
        try:
            states.append(fn(*args))
        except Exception as e:
            _failed(hook, method, e)
            states.append(None)
    if states.count(SKIP) == len(states):
        return None
    return hooks, states


def begin_push(topic: str, envelopes: list) -> PushCall | None:
    """Run the hooks' ``push_begin`` on ``envelopes`` (a list they may change in place);
    None if no hook is registered."""
    begun = _begin("push_begin", topic, envelopes)
    if begun is None:
        return None
    call = PushCall()
    call.topic, call.envelopes = topic, envelopes
    call.hooks, call.states = begun
    call.t0 = perf_counter()
    return call


class HandleCall:
    """One handler call between ``handle_begin`` and ``handle_end`` (:func:`begin_handle`)."""

    __slots__ = ("message", "hooks", "states", "t0")

    def end(self, error=None):
        """Tell the hooks how the handler ended (in the thread or task that began it)."""
        seconds = perf_counter() - self.t0
        m = self.message
        outcome = "error" if error is not None else _OUTCOMES.get(m._settled, "ok")
        for hook, state in zip(reversed(self.hooks), reversed(self.states)):    # nested: last in, first out
            if state is SKIP:
                continue
            try:
                hook.handle_end(state, m, outcome, error, seconds)
            except Exception as e:
                _failed(hook, "handle_end", e)


def begin_handle(message) -> HandleCall | None:
    """Run the hooks' ``handle_begin`` for ``message``; None if no hook is registered."""
    begun = _begin("handle_begin", message)
    if begun is None:
        return None
    hooks, states = begun
    call = HandleCall()
    call.message, call.hooks, call.states = message, hooks, states
    call.t0 = perf_counter()
    return call


class HandleBatchCall:
    """One batch handler call between ``handle_batch_begin`` and ``handle_batch_end``
    (:func:`begin_handle_batch`)."""

    __slots__ = ("messages", "hooks", "states", "t0")

    def end(self, error=None):
        """Tell the hooks how the batch handler ended (in the thread that began it)."""
        seconds = perf_counter() - self.t0
        outcome = "error" if error is not None else "ok"
        for hook, state in zip(reversed(self.hooks), reversed(self.states)):
            if state is SKIP:
                continue
            try:
                hook.handle_batch_end(state, self.messages, outcome, error, seconds)
            except Exception as e:
                _failed(hook, "handle_batch_end", e)


def begin_handle_batch(messages: list) -> HandleBatchCall | None:
    """Run the hooks' ``handle_batch_begin`` for ``messages`` (a batch handler's list);
    None if no hook is registered (or a hook without the method: it skips)."""
    begun = _begin("handle_batch_begin", messages)
    if begun is None:
        return None
    hooks, states = begun
    call = HandleBatchCall()
    call.messages, call.hooks, call.states = messages, hooks, states
    call.t0 = perf_counter()
    return call


def received(messages: list) -> None:
    """Run the hooks' ``receive`` for ``messages`` a pull consumer leased."""
    if not _loaded:
        load_defaults()
    for hook in _hooks:
        fn = getattr(hook, "receive", None)
        if fn is None:
            continue
        try:
            fn(messages)
        except Exception as e:
            _failed(hook, "receive", e)


__all__ = ["Hook", "SKIP", "load_defaults", "received", "register", "unregister", "registered", "begin_push",
           "begin_handle", "begin_handle_batch"]
