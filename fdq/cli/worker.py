"""``fdq worker module:attr``: run a handler over a subscription (``fdq.worker.run_worker``)
until SIGTERM or Ctrl-C, then drain and leave."""
from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading

import click

from .. import worker as fdq_worker
from . import app, render
from .app import Failure, cli, one_line, pass_state
from .params import SUBSCRIPTION, TOPIC, Duration, Int


class HandlerSpec(click.ParamType):
    """``module:attr`` (``attr`` may be dotted: ``module:Class.method``)."""

    name = "module:attr"

    def convert(self, value, param, ctx):
        module, sep, attr = str(value).partition(":")
        if not sep or not module or not attr or not all(p.isidentifier() for p in attr.split(".")) \
                or not all(p.isidentifier() for p in module.split(".")):
            self.fail(f"{value!r} is not module:attr (a module's dotted name, a colon, the handler's name: "
                      "handlers:bill)", param, ctx)
        return module, attr


def load_handler(module: str, attr: str, paths=()):
    """The handler ``module:attr``, imported with the current directory and ``paths`` first
    on ``sys.path`` (as dramatiq does). Anything that keeps it from being a callable is a
    Failure (exit 1) naming it."""
    for p in [os.getcwd(), *paths][::-1]:
        p = os.path.abspath(p)
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        obj = importlib.import_module(module)
    except Exception as e:      # not found, or the module raised (a SyntaxError too): its text
        raise Failure(f"cannot import {module}: {type(e).__name__}: {one_line(e)}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise Failure(f"cannot load {module}:{attr}: {type(obj).__name__} {getattr(obj, '__name__', '')!s} "
                          f"has no attribute {part!r}".replace("  ", " ")) from None
    if not callable(obj):
        raise Failure(f"{module}:{attr} is not callable (it is a {type(obj).__name__}): name a handler function")
    return obj


class _Signals:
    """SIGTERM and SIGINT while the worker runs: the first sets ``stop`` (SIGINT also the
    CLI's interrupt flag, so the command ends with exit 130 and its one line); a second
    one sets ``abort`` (``run_worker`` leaves at once: leases back, membership left) and
    the process then ends with that signal's code. The handler only sets flags: it may
    interrupt the main thread anywhere (a write to stderr, a lock held), so it writes
    nothing, waits for nothing and raises nothing (``run_worker`` polls the events)."""

    def __init__(self, stop: threading.Event, abort: threading.Event):
        self.stop, self.abort = stop, abort
        self.first = self.second = None
        self._previous = {}

    def _on_signal(self, signum, _frame):
        if self.first is not None:
            if self.second is None:
                self.second = signum
            self.abort.set()
            return
        self.first = signum
        if signum == signal.SIGINT:
            app._interrupt.set()
        self.stop.set()

    def code(self, signum) -> int:
        return app.EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + signal.SIGTERM

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)


def _exit_now(code: int, line: str | None):
    """A handler still runs (a drain that ran out, or a second signal): its thread would
    hold the interpreter's exit (thread pools are joined at exit); the consumer has left,
    so end the process now."""
    if line:
        render.note(line)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


@cli.command()
@click.argument("handler", type=HandlerSpec())
@click.option("--topic", "-t", type=TOPIC, default=None, metavar="T",
              help="The topic [default: the handler's @fdq.worker.handler(topic=...)].")
@click.option("--subscription", "-s", type=SUBSCRIPTION, default=None, metavar="S",
              help="The subscription [default: the handler's, else 'default'].")
@click.option("--concurrency", "-c", type=Int(min=1), default=None, metavar="N",
              help="Handlers running at once (a shard key's messages never at once) [default: 1].")
@click.option("--mode", type=click.Choice(list(fdq_worker.MODES)), default=None,
              help="Delivery [default: the handler's, else at-least-once]. exactly-once calls "
                   "handler(tr, msg) inside the dequeue transaction.")
@click.option("--exactly-once", is_flag=True,
              help="Short for --mode exactly-once.")
@click.option("--batch", is_flag=True, default=None,
              help="The handler takes a list of messages (a round's, up to 100) [default: the handler's]: "
                   "return acks those it left unsettled, raise naks them.")
@click.option("--drain-timeout", type=Duration(), default=None, metavar="DURATION",
              help="On SIGTERM/Ctrl-C, how long running handlers may take to finish (30s, 1m) "
                   "[default: the ack wait].")
@click.option("--path", "paths", type=click.Path(exists=True, file_okay=False), multiple=True, metavar="DIR",
              help="Also import from DIR (the current directory always). Repeatable.")
@pass_state
def worker(state, handler, topic, subscription, concurrency, mode, exactly_once, batch, drain_timeout, paths):
    """Run HANDLER (module:attr) on a subscription's messages until SIGTERM or Ctrl-C.

    The handler takes a message; returning acks it, raising naks it (redelivered
    with backoff, dead-lettered after max_deliver attempts). A coroutine function
    runs on an event loop (fdq.aio). Decorated with @fdq.worker.handler(topic=...,
    subscription=..., mode=..., batch=...), it gives these options' defaults.

    SIGTERM or Ctrl-C: no new message is leased, running handlers finish (up to
    --drain-timeout; one still running then is cut off, the process exiting, and
    its message redelivered as a failed attempt), the messages no handler began go back at once without
    counting an attempt, and the worker leaves the subscription: exit 0 on SIGTERM,
    130 on Ctrl-C. A second signal stops at once: running handlers are not waited
    for (their messages go back as failed attempts), the rest go back uncounted,
    and the worker leaves before the process exits (143 on SIGTERM, 130 on
    Ctrl-C). A module that cannot be imported, or a name that is not a callable:
    one line, exit 1.
    """
    if exactly_once:
        if mode not in (None, "exactly-once"):
            raise click.UsageError(f"--exactly-once contradicts --mode {mode}")
        mode = "exactly-once"
    module, attr = handler
    fn = load_handler(module, attr, paths)
    if not logging.getLogger().handlers:    # handler failures (tracebacks), warnings: on stderr
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    made = []

    def started(w):
        made.append(w)
        render.note(f"fdq: worker {w.consumer.id}: {module}:{attr} on {w.topic}/{w.subscription}, {w.mode}, "
                    f"concurrency {w.config.max_concurrency}{', batches' if w.batch else ''} "
                    "(SIGTERM or Ctrl-C: drain and stop)")

    state.interrupted = lambda: f"worker stopped after {made[0].handled if made else 0:,} deliveries handled"

    stop, abort = threading.Event(), threading.Event()
    with _Signals(stop, abort) as signals:
        def draining(_w):
            if signals.first is not None:
                render.note(f"fdq: worker: {signal.Signals(signals.first).name}: draining "
                            "(send it again to stop at once)")

        w = fdq_worker.run_worker(state.db, fn, topic=topic, subscription=subscription, mode=mode,
                                  concurrency=concurrency, drain_timeout_s=drain_timeout, stop=stop,
                                  batch=batch, started=started, abort=abort, draining=draining)
    if signals.second is not None:
        _exit_now(signals.code(signals.second),
                  f"fdq: interrupted: {state.interrupted()}; stopped at once, running handlers' "
                  "messages go back as failed attempts")
    if w.running:
        late = "fdq: warning: handlers still running after the drain timeout: their messages go back as failed attempts"
        if signals.first == signal.SIGINT:
            _exit_now(app.EXIT_INTERRUPTED, f"{late}\nfdq: interrupted: {state.interrupted()}")
        _exit_now(0, late)
    if signals.first != signal.SIGINT:
        render.note(f"fdq: worker stopped after {w.handled:,} deliveries handled")
