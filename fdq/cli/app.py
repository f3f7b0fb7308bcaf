"""The ``fdq`` command's click group: the state every command shares (the URL, the
database once needed), the options they share, and how a command ends.

Exit codes: 0 success; 1 an ``FDQError`` (one line ``fdq: error: <message>`` on stderr,
unknown topics included); 2 a usage error (bad option or value, click's message); 130
Ctrl-C (SIGINT: one line ``fdq: interrupted: <what was done, how to finish>`` on stderr,
every command alike); 141 stdout closed by its reader (``fdq tail t | head -1``: no
message, the status a shell reports for ``seq`` or ``cat`` killed by SIGPIPE there).
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading

import click

from .. import Supervisor, connect
from ..config import DEFAULT_SUBSCRIPTION
from ..errors import FDQError
from .params import SUBSCRIPTION, TOPIC


class Failure(click.ClickException):
    """An FDQError as the command line reports it: one line, exit code 1."""

    exit_code = 1

    def show(self, file=None):
        click.echo(f"fdq: error: {self.format_message()}", err=True, file=file)


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def confirm(question: str, refused: str):
    """Ask ``question`` on stderr; a no (or no terminal to answer on: stdin closed or at
    its end) is a Failure saying ``refused`` and how to skip the question."""
    try:
        click.confirm(question, abort=True, err=True)
    except click.Abort:
        raise Failure(f"not confirmed: {refused} (give --yes to skip the question)") from None


EXIT_INTERRUPTED = 128 + signal.SIGINT      # 130, as a shell reports a command Ctrl-C stopped
EXIT_PIPE_CLOSED = 128 + signal.SIGPIPE     # 141, as a shell reports `seq 9999999 | head -1`'s seq


def _silence_closed_output():
    """stdout's reader is gone (``| head -1``): point descriptor 1 (and 2, if writing to
    it fails too: ``2>&1 | head``) at /dev/null, so what is still buffered and the
    interpreter's last flush go nowhere instead of raising another BrokenPipeError."""
    def point_at_devnull(stream):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError, AttributeError):   # closed, or not a file
            pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        point_at_devnull(sys.stdout)
        try:
            if sys.stderr is not None:
                sys.stderr.flush()
        except (BrokenPipeError, ValueError):
            point_at_devnull(sys.stderr)
    finally:
        os.close(devnull)


def exit_interrupted(what=None):
    """Ctrl-C: one line ``fdq: interrupted[: what()]`` on stderr, exit 130."""
    text = what() if what else None
    try:
        click.echo("fdq: interrupted" + (f": {text}" if text else ""), err=True)
    except BrokenPipeError:
        _silence_closed_output()
    raise click.exceptions.Exit(EXIT_INTERRUPTED) from None


# SIGINT, however it arrives. The handler sets this flag, then raises KeyboardInterrupt
# as Python's own does; but a KeyboardInterrupt raised while Python runs a __del__ (a
# transaction dropped: FDQ's and FoundationDB's binding's have one) is printed as
# "Exception ignored" and lost, and the command would run on to exit 0. The flag
# survives: long commands call check_interrupt between chunks (render.progress's
# advance) and before their success line.
_interrupt = threading.Event()


def _on_sigint(_signum, _frame):
    _interrupt.set()
    raise KeyboardInterrupt


def _quiet_unraisable(unraisable, previous=sys.unraisablehook):
    """An interrupt swallowed by a finalizer: no "Exception ignored" traceback (the flag
    has it); anything else as Python reports it."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        return
    previous(unraisable)


def check_interrupt():
    """Raise KeyboardInterrupt if SIGINT arrived during this command, also one a
    finalizer swallowed; not while an exception is already on its way (called from an
    ``except`` block: the interrupt, or another error, is being handled)."""
    if _interrupt.is_set() and sys.exc_info()[1] is None:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _sigint_flag():
    """Install the SIGINT handler for one command (the main thread only: signals go
    there; click's test runner invokes commands in the test's process, so restore)."""
    _interrupt.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous, previous_hook = signal.signal(signal.SIGINT, _on_sigint), sys.unraisablehook
    sys.unraisablehook = functools.partial(_quiet_unraisable, previous=previous_hook)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook


def resumable(state, what: str):
    """Ctrl-C during a chunked operation: say it is left part-way and a rerun finishes it
    (each chunk is its own transaction; the operation is safe to re-run)."""
    state.interrupted = lambda: f"{what} stopped part-way; run the same command again to finish it"


class FDQGroup(click.Group):
    """The root group: turns an FDQError raised by any command into a Failure, Ctrl-C
    into exit 130 with one line saying what was done (``State.interrupted``), a
    closed stdout into a silent exit 141, and another I/O error (a full disk) into a
    Failure."""

    def invoke(self, ctx):
        with _sigint_flag():
            return self._invoke(ctx)

    def _invoke(self, ctx):
        try:
            result = super().invoke(ctx)
            check_interrupt()       # a swallowed interrupt no chunk boundary saw
            return result
        except FDQError as e:
            raise Failure(one_line(e)) from None
        except KeyboardInterrupt:
            exit_interrupted(ctx.obj.interrupted if isinstance(ctx.obj, State) else None)
        except BrokenPipeError:
            _silence_closed_output()
            raise click.exceptions.Exit(EXIT_PIPE_CLOSED) from None
        except OSError as e:    # e.g. writing stdout to a full disk (fdq tail t > out): one line
            if e.errno is None:
                raise
            try:
                sys.stdout.flush()
            except (OSError, ValueError, AttributeError):   # what failed to write stays buffered:
                _silence_closed_output()                    # no second error at exit
            raise Failure(f"I/O error: {e.strerror or e}") from None


class State:
    """Per invocation: the URL and, once a command needs it, the database."""

    def __init__(self, url: str | None):
        self.url = url
        self._db = None
        # A command that runs long sets this: () -> what it did so far and how to finish,
        # the line Ctrl-C prints (after "fdq: interrupted: ").
        self.interrupted = None

    @property
    def db(self):
        if self._db is None:
            self._db = connect(self.url)
        return self._db

    @property
    def supervisor(self) -> Supervisor:
        return Supervisor(self.db)


pass_state = click.make_pass_decorator(State)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON (stable keys) for scripts.")
topic_argument = click.argument("topic", type=TOPIC)
subscription_option = click.option("--subscription", "-s", type=SUBSCRIPTION, default=DEFAULT_SUBSCRIPTION,
                                   show_default=True, metavar="S", help="The subscription.")


@click.group(name="fdq", cls=FDQGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", envvar="FDQ_URL", metavar="URL",
              help="Database URL: sqlite:///path.db or fdb:///path/fdb.cluster "
                   "[env FDQ_URL; default: the embedded database, $FDQ_HOME/fdq.db].")
@click.version_option(package_name="fdq-queue", prog_name="fdq")
@click.pass_context
def cli(ctx, url):
    """FDQ: a message queue on FoundationDB (or its embedded engine).

    Data goes to stdout, messages and progress to stderr. Exit codes: 0 ok,
    1 error (one line on stderr), 2 usage error, 130 Ctrl-C (one line saying
    what was done; run a chunked command again to finish it), 141 stdout's
    reader went away (| head: nothing on stderr).
    """
    ctx.obj = State(url or None)


def main(argv=None):
    """The console script ``fdq``."""
    cli.main(args=argv, prog_name="fdq")
