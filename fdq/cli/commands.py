"""The ``fdq`` command: click commands that call fdq's Python API, build rows
(:mod:`.rows`) and render them (:mod:`.render`).

Exit codes: 0 success; 1 an ``FDQError`` (one line ``fdq: error: <message>`` on stderr,
unknown topics included); 2 a usage error (bad option or value, click's message); 130
Ctrl-C (SIGINT: one line ``fdq: interrupted: <what was done, how to finish>`` on stderr,
every command alike); 141 stdout closed by its reader (``fdq tail t | head -1``: no
message, the status a shell reports for ``seq`` or ``cat`` killed by SIGPIPE there).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import ssl
import sys
import time

import click

from ..broker import __main__ as broker_main
from ..config import (ACK_POLICIES, DELIVER_POLICIES, DEFAULT_SUBSCRIPTION, UPDATABLE_SUBSCRIPTION_FIELDS,
                      UPDATABLE_TOPIC_FIELDS,
                      SubscriptionConfig, TopicConfig)
from ..consumer import Consumer
from ..engine import after_interrupt, connect
from ..errors import ConfigError, ConsumerStalled, FDQError, LeaseLost, SubscriptionNotFound, TopicNotFound
from ..keyspace.codec import ROUTE_BYTES
from ..producer import Envelope, Producer
from ..supervisor import Supervisor
from ..times import as_datetime, iso_ms
from . import render, rows
from .params import (CLEARED, SUBSCRIPTION, TOPIC, Address, Duration, FilterHeader, Header, OrNone, Seconds,
                     SecondsList, Shards, Tag, Time, TimeOrNow, envelope_callback, filter_headers_callback,
                     headers_callback, subscription_config_callback, topic_config_callback)

PUSH_BATCH = 500                 # stdin lines per transaction
PUSH_BATCH_BYTES = ROUTE_BYTES   # ... and at most this many bytes written (FDB: 10 MB): each
PUSH_LINE_BYTES = 100            # line's body, headers and keys (~100 bytes), once in the log
                                 # and once per subscription
TAIL_BATCH = 100


class Failure(click.ClickException):
    """An FDQError as the command line reports it: one line, exit code 1."""

    exit_code = 1

    def show(self, file=None):
        click.echo(f"fdq: error: {self.format_message()}", err=True, file=file)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _confirm(question: str, refused: str):
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


def _exit_interrupted(what=None):
    """Ctrl-C: one line ``fdq: interrupted[: what()]`` on stderr, exit 130."""
    text = what() if what else None
    try:
        click.echo("fdq: interrupted" + (f": {text}" if text else ""), err=True)
    except BrokenPipeError:
        _silence_closed_output()
    raise click.exceptions.Exit(EXIT_INTERRUPTED) from None


def _resumable(state, what: str):
    """Ctrl-C during a chunked operation: say it is left part-way and a rerun finishes it
    (each chunk is its own transaction; the operation is safe to re-run)."""
    state.interrupted = lambda: f"{what} stopped part-way; run the same command again to finish it"


class FDQGroup(click.Group):
    """The root group: turns an FDQError raised by any command into a Failure, Ctrl-C
    into exit 130 with one line saying what was done (``State.interrupted``), a
    closed stdout into a silent exit 141, and another I/O error (a full disk) into a
    Failure."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except FDQError as e:
            raise Failure(_one_line(e)) from None
        except KeyboardInterrupt:
            _exit_interrupted(ctx.obj.interrupted if isinstance(ctx.obj, State) else None)
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
@click.version_option(package_name="fdq", prog_name="fdq")
@click.pass_context
def cli(ctx, url):
    """FDQ: a message queue on FoundationDB (or its embedded engine).

    Data goes to stdout, messages and progress to stderr. Exit codes: 0 ok,
    1 error (one line on stderr), 2 usage error, 130 Ctrl-C (one line saying
    what was done; run a chunked command again to finish it), 141 stdout's
    reader went away (| head: nothing on stderr).
    """
    ctx.obj = State(url or None)


# -- topics -------------------------------------------------------------------------

TOPIC_COLUMNS = [
    ("topic", lambda r: r["name"]),
    ("shards", lambda r: r["shards"] if r["resharding_to"] in (None, r["shards"])
        else f"{r['shards']}→{r['resharding_to']}"),
    ("extend", lambda r: r["extend"]),
    ("paused", lambda r: r["paused"]),
    ("subscriptions", lambda r: ", ".join(r["subscriptions"])),
    ("inserted", lambda r: r["inserted"]),
    ("backlog", lambda r: r["backlog"]),
    ("pending", lambda r: r["pending"]),
]


@cli.group(invoke_without_command=True)
@json_option
@pass_state
@click.pass_context
def topics(ctx, state, as_json):
    """List topics (or create, update, delete, upgrade one).

    Columns: shards, extend support, paused, subscriptions, messages inserted,
    backlog (routed, not yet done, summed over subscriptions), pending (pushed
    while paused or resharding, not yet routed).
    """
    if ctx.invoked_subcommand is not None:
        return
    data = rows.topic_rows(state.supervisor)
    if as_json:
        render.emit_json(data)
    elif not data:
        render.note("no topics")
    else:
        render.table(None, TOPIC_COLUMNS, data)


def _show_topic(state, name, as_json):
    row = rows.topic_row(name, state.supervisor.stats(name))
    if as_json:
        render.emit_json(row)
    return row


@topics.command("create")
@click.argument("name", type=TOPIC)
@click.option("--shards", type=Shards(), default=None,
              help=f"Number of shards [default: {TopicConfig().shards}]; an existing topic with "
                   "another count is an error (use rebalance).")
@click.option("--extend", is_flag=True, help="Extend support: headers and tag dispatch.")
@click.option("--max-backlog", type=int, default=None, metavar="N", callback=topic_config_callback,
              help="Refuse pushes beyond this backlog per subscription.")
@click.option("--retention-s", type=Seconds(), default=None, metavar="S", callback=topic_config_callback,
              help="Keep the \"all\" log this many seconds (applied by fdq trim).")
@click.option("--retention-bytes", type=int, default=None, metavar="N", callback=topic_config_callback,
              help="Keep at most this many bytes of the \"all\" log, the newest (applied by fdq trim).")
@click.option("--dedupe-window-s", type=Seconds(), default=None, metavar="S", callback=topic_config_callback,
              help=f"Remember msg-ids this long [default: {TopicConfig().dedupe_window_s:g}].")
@json_option
@pass_state
def topics_create(state, name, shards, extend, max_backlog, retention_s, retention_bytes, dedupe_window_s,
                  as_json):
    """Create topic NAME (nothing changes if it already exists).

    Change its retention and limits later with fdq topics update."""
    sup = state.supervisor
    existed = any(n == name for n, _c in sup.topics())
    options = {"max_backlog": max_backlog, "retention_s": retention_s, "retention_bytes": retention_bytes,
               "dedupe_window_s": dedupe_window_s}
    config = sup.create_topic(name, shards=shards, extend=extend,
                              **{k: v for k, v in options.items() if v is not None})
    if existed:
        render.note(f"topic {name!r} already exists ({config.shards} shards, "
                    f"extend {'on' if config.extend else 'off'}): unchanged")
    else:
        render.note(f"created topic {name!r}: {config.shards} shards, extend {'on' if config.extend else 'off'}")
    _show_topic(state, name, as_json)


def _settings_row(name: str, config: TopicConfig) -> dict:
    return {"topic": name, **{k: getattr(config, k) for k in UPDATABLE_TOPIC_FIELDS}}


class TopicUpdateCommand(click.Command):
    """``fdq topics update``: ``--shards`` gets told that ``fdq rebalance`` changes it."""

    def parse_args(self, ctx, args):
        given = list(args)      # click's parser consumes the list it is given
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            if e.option_name != "--shards":
                raise
            args, shards, rest, i = given, "N", [], 0
            while i < len(args):
                if args[i] == "--shards":
                    shards = args[i + 1] if i + 1 < len(args) else shards
                    i += 2
                    continue
                if args[i].startswith("--shards="):
                    shards = args[i].split("=", 1)[1]
                else:
                    rest.append(args[i])
                i += 1
            try:
                super().parse_args(ctx, rest)
                name = ctx.params.get("name") or "NAME"
            except click.UsageError:
                name = "NAME"
            raise click.UsageError(f"--shards cannot be updated here: a topic's shard count changes with "
                                   f"fdq rebalance {name} --shards {shards} (it moves the queued messages)",
                                   ctx) from None


@topics.command("update", cls=TopicUpdateCommand)
@click.argument("name", type=TOPIC)
@click.option("--max-backlog", type=OrNone(click.INT), default=None, metavar="N|none",
              callback=topic_config_callback, help="Refuse pushes beyond this backlog per subscription.")
@click.option("--dedupe-window-s", type=Seconds(), default=None, metavar="S", callback=topic_config_callback,
              help="Remember msg-ids this long.")
@click.option("--retention-s", type=OrNone(Seconds()), default=None, metavar="S|none",
              callback=topic_config_callback, help="Keep the \"all\" log this many seconds.")
@click.option("--retention-bytes", type=OrNone(click.INT), default=None, metavar="N|none",
              callback=topic_config_callback, help="Keep at most this many bytes of the \"all\" log.")
@click.option("--max-message-bytes", type=int, default=None, metavar="N", callback=topic_config_callback,
              help="The largest body a push accepts.")
@json_option
@pass_state
def topics_update(state, name, as_json, **changes):
    """Change topic NAME's retention and limits (none clears one).

    E.g. for a topic a push created with the defaults: pushes apply the limits
    from then on, fdq trim the retention at its next run."""
    changes = {k: (None if v is CLEARED else v) for k, v in changes.items() if v is not None}
    if not changes:
        raise click.UsageError("nothing to update: give one of "
                               + ", ".join("--" + k.replace("_", "-") for k in UPDATABLE_TOPIC_FIELDS))
    config = state.supervisor.update_topic(name, **changes)
    render.note(f"updated topic {name!r}: " + ", ".join(f"{k}={getattr(config, k)!r}" for k in changes))
    if as_json:
        render.emit_json(_settings_row(name, config))


@topics.command("delete")
@click.argument("name", type=TOPIC)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@pass_state
def topics_delete(state, name, yes):
    """Delete topic NAME with all its messages, consumers and counters."""
    sup = state.supervisor
    row = rows.topic_row(name, sup.stats(name))    # unknown topic: exit 1 before asking
    if not yes:
        _confirm(f"Delete topic {name!r} with {row['inserted']:,} messages inserted and a backlog "
                 f"of {row['backlog']:,}?", f"topic {name!r} not deleted")
    sup.delete_topic(name)
    render.note(f"deleted topic {name!r}")


@topics.command("upgrade")
@click.argument("name", type=TOPIC)
@click.option("--extend", is_flag=True, help="Give the topic extend support (one-way).")
@json_option
@pass_state
def topics_upgrade(state, name, extend, as_json):
    """Give topic NAME extend support (--extend).

    --extend: headers and tag dispatch. One-way; stored messages stay readable;
    consumers must then connect with extend support."""
    if not extend:
        raise click.UsageError("nothing to upgrade: give --extend")
    state.supervisor.upgrade_extend(name)
    render.note(f"topic {name!r} has extend support")
    _show_topic(state, name, as_json)


# -- stats and consumers --------------------------------------------------------------

CONSUMER_COLUMNS = [
    ("subscription", lambda c: c["subscription"]),
    ("consumer", lambda c: c["id"]),
    ("mode", lambda c: c["mode"]),
    ("tag", lambda c: c["tag"]),
    ("host", lambda c: c["host"]),
    ("pid", lambda c: None if c["pid"] is None else str(c["pid"])),
    ("shards", lambda c: render.shard_list(c["shards"])),
    ("heartbeat age", lambda c: "-" if c["heartbeat_age_s"] is None
        else f"{c['heartbeat_age_s']:.1f} s" + (" (zombie)" if c["zombie"] else "")),
]


@cli.command()
@topic_argument
@json_option
@pass_state
def stats(state, topic, as_json):
    """Show TOPIC's counters, backlog, consumers and lag.

    Per subscription: backlog, in flight, delayed, DLQ, lag; consumers with the
    shards each owns and heartbeat age (a zombie: older than its zombie timeout,
    e.g. killed, its shards not yet taken over); backlog per dispatch tag.
    --json adds per-shard counters."""
    data = rows.stats_row(state.supervisor.stats(topic))
    if as_json:
        render.emit_json(data)
        return
    state_text = "paused" if data["paused"] else "running"
    if data["resharding_to"] == data["shards"]:     # reshard_finish done, not its play
        state_text += ", resharded: routing what was pushed meanwhile (run rebalance if stuck)"
    elif data["resharding_to"] is not None:
        state_text += f", resharding to {data['resharding_to']}"
    render.table(f"topic {topic}: {data['shards']} shards, extend {'on' if data['extend'] else 'off'}, "
                 f"{state_text}",
                 [(k, lambda d, k=k: d[k]) for k in ("inserted", "routed", "pending", "emitted", "acked")],
                 [data])
    subs = data["subscriptions"]
    render.table("subscriptions", [
        ("subscription", lambda s: s["name"]),
        ("state", lambda s: "paused" if s["paused"] else "catching up" if s["catching_up"] else "running"),
        ("backlog", lambda s: s["backlog"]),
        ("in flight", lambda s: s["in_flight"]),
        ("delayed", lambda s: s["delayed"]),
        ("dlq", lambda s: s["dlq"]),
        ("lag", lambda s: render.duration_ms(s["lag_ms"])),
        ("consumers", lambda s: len(s["consumers"])),
        ("unowned shards", lambda s: s["unowned_shards"]),
    ], subs)
    consumers = [c for s in subs for c in s["consumers"]]
    if consumers:
        render.table("consumers", CONSUMER_COLUMNS, consumers)
    tags = [dict(t, subscription=s["name"]) for s in subs for t in s["tags"]]
    if any(t["tag"] is not None for t in tags):
        render.table("backlog per tag", [
            ("subscription", lambda t: t["subscription"]),
            ("tag", lambda t: t["tag"] or "(untagged)"),
            ("shards", lambda t: t["shards"]),
            ("backlog", lambda t: t["backlog"]),
            ("in flight", lambda t: t["in_flight"]),
            ("delayed", lambda t: t["delayed"]),
        ], tags)


@cli.command()
@topic_argument
@json_option
@pass_state
def consumers(state, topic, as_json):
    """List TOPIC's consumers, their shards, heartbeat age.

    A consumer whose heartbeat is older than its zombie timeout is marked a
    zombie (killed, or stalled): it owns its shards until a live consumer of
    its subscription takes them over."""
    data = rows.consumer_rows(state.supervisor.stats(topic))
    if as_json:
        render.emit_json(data)
    elif not data:
        render.note(f"topic {topic!r} has no consumers")
    else:
        render.table(None, CONSUMER_COLUMNS, data)


# -- push and tail --------------------------------------------------------------------

def _stdin_lines(stream):
    """The lines of binary ``stream`` (each with its newline, the last maybe without),
    and ``None`` whenever no more input is ready yet: a pipe or terminal whose writer is
    still open (``tail -f log | fdq push logs -``), so what was read can be pushed before
    waiting. A stream without a file descriptor is read as it is."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        yield from stream
        return
    parts = []                      # the current line's pieces so far
    while True:
        if not select.select([fd], [], [], 0)[0]:
            yield None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            parts.append(chunk[start:end + 1])
            yield b"".join(parts)
            parts = []
            start = end + 1
        if start < len(chunk):
            parts.append(chunk[start:])
    if parts:
        yield b"".join(parts)


def _encode_arg(text: str) -> bytes:
    # argv is decoded with surrogateescape on POSIX: this gives back the original bytes.
    return text.encode("utf-8", "surrogateescape")


@cli.command()
@topic_argument
@click.argument("data", required=False)
@click.option("--key", "-k", "shard_key", metavar="K", callback=envelope_callback,
              help="Shard key (messages of one key keep their order).")
@click.option("--delay", type=Seconds(), default=None, callback=envelope_callback,
              help="Deliver after this many seconds.")
@click.option("--header", "-H", "headers", type=Header(), multiple=True, callback=headers_callback,
              help="A header name=value (extend topics); the value is JSON if it parses, "
                   "else a string. Repeatable.")
@click.option("--msg-id", metavar="ID", callback=envelope_callback,
              help="Your id: a repeat within the topic's dedupe window is stored once.")
@click.option("--keep-empty", is_flag=True,
              help="Push blank stdin lines as empty messages [default: skip them].")
@json_option
@pass_state
def push(state, topic, data, shard_key, delay, headers, msg_id, keep_empty, as_json):
    """Push DATA (or stdin lines) to TOPIC; print the ids.

    TOPIC is created if missing.

    With DATA "-" (or no DATA), push one message per line of stdin (newline, or
    CR LF, stripped; nothing else), in batches of one transaction each (a batch
    is pushed once no more input is ready: lines of a live pipe go out as they
    come); prints one id per line. Blank lines (nothing before the newline) are
    skipped and counted in the summary; --keep-empty pushes them as empty
    messages. A line of spaces is data, pushed as it is.
    """
    producer = Producer(state.db)
    show = render.emit_json_line if as_json else (lambda r: click.echo(r["id"]))
    if data is not None and data != "-":
        r = producer.push(topic, _encode_arg(data), shard_key=shard_key, msg_id=msg_id, delay=delay,
                          headers=headers)
        if r.duplicate:
            render.note(f"msg-id {msg_id!r} was pushed before: not stored again")
        show(rows.push_row(r))
        return
    if msg_id is not None:
        raise click.UsageError("--msg-id names one message: give DATA, not stdin lines")
    try:
        copies = 1 + len(state.supervisor.config(topic).subs)
    except TopicNotFound:
        copies = 2                  # push creates it with one subscription
    line_bytes = PUSH_LINE_BYTES + (len(json.dumps(headers, ensure_ascii=False).encode()) if headers else 0)
    if sys.stdin is None:                   # started with descriptor 0 closed
        raise Failure("stdin is closed: give DATA, or lines on stdin")
    stdin = sys.stdin.buffer
    pushed = skipped = 0
    batch, size = [], 0
    pushing = False             # a batch's transaction under way

    def interrupted():
        maybe = f"; the {len(batch):,} lines being pushed may be stored too" if pushing else ""
        return f"pushed {pushed:,} messages to {topic!r} (ids printed){maybe}"
    state.interrupted = interrupted

    def flush(advance):
        nonlocal pushed, size, pushing
        if not batch:
            return
        pushing = True
        try:
            results = producer.push_many(topic, batch)
        except FDQError as e:
            done = f" ({pushed:,} messages pushed before this batch)" if pushed else ""
            raise Failure(_one_line(e) + done) from None
        pushing = False
        pushed += len(results)
        batch.clear()
        size = 0
        for r in results:
            show(rows.push_row(r))
        advance(len(results))

    with render.progress(f"pushing to {topic}") as advance:
        for line in _stdin_lines(stdin):
            if line is None:            # nothing more to read yet: push what was read
                flush(advance)
                continue
            body = line[:-1] if line.endswith(b"\n") else line
            if body.endswith(b"\r"):
                body = body[:-1]
            if not body and not keep_empty:
                skipped += 1
                continue
            cost = (len(body) + line_bytes) * copies
            if batch and (len(batch) >= PUSH_BATCH or size + cost > PUSH_BATCH_BYTES):
                flush(advance)
            batch.append(Envelope(body, shard_key, delay, None, headers))
            size += cost
        flush(advance)
    blank = "" if not skipped else (f" ({skipped:,} blank line{'s' if skipped != 1 else ''} skipped; "
                                    "--keep-empty pushes them)")
    render.note(f"pushed {pushed:,} messages to {topic!r}{blank}")


def _print_message(m, as_json):
    row = rows.message_row(m)
    if as_json:
        render.emit_json_line(row)
        return
    parts = [row["id"]]
    if row["shard_key"] is not None:
        parts.append(f"key={row['shard_key']}")
    for name, value in row["headers"].items():
        parts.append(f"{name}={value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}")
    if row["attempts"] > 1:
        parts.append(f"attempts={row['attempts']}")
    body = m.body.decode("utf-8", "backslashreplace")
    # One message per line, and nothing a terminal would act on (click also strips raw
    # ANSI sequences from piped output): control characters but tab are escaped.
    click.echo(("  ".join(parts) + "  " + body).translate(_CONTROL_ESCAPES))


_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7f, 0xa0)] if c != 0x09} | {
    0x0a: "\\n", 0x0d: "\\r"}


class _Terminated(Exception):
    """SIGTERM arrived (``timeout``, systemd, docker stop): stop as on Ctrl-C."""


def _raise_terminated(_signum, _frame):
    raise _Terminated()


def _tail_error(e: BaseException):
    """The consumer's on_error (its own threads): one line on stderr; tail keeps going.
    ``ConsumerStalled``: no heartbeat reached the database, or no shard owned (others
    own them all), for over 3 heartbeats; reported again after a recovery."""
    what = "stalled" if isinstance(e, ConsumerStalled) else type(e).__name__
    render.note(f"fdq: warning: {what}: {_one_line(e)}")


def _print_and_ack(consumer, msgs, at_most_once: bool, as_json: bool) -> int:
    """Print ``msgs`` (each line flushed to stdout) and ack them; returns how many were
    printed. At-most-once acks each one just before its line, so a write that fails
    (the reader went away, Ctrl-C) loses that one only, not the rest of the batch;
    at-least-once acks the lines written, also when a write fails, and leaves the rest
    leased (``Consumer.close`` returns them at once). A subscription with ack_policy
    none leases nothing: its messages were done when fetched, there is nothing to ack."""
    if consumer.sub_config.ack_policy == "none":
        for m in msgs:
            _print_message(m, as_json)
        return len(msgs)
    written = []
    try:
        for m in msgs:
            if at_most_once:
                try:
                    consumer.ack_many([m])
                except LeaseLost as e:      # redelivered elsewhere: not ours to print
                    render.note(f"fdq: warning: {_one_line(e)}")
                    continue
            _print_message(m, as_json)      # click.echo flushes each line
            written.append(m)
    except BaseException:
        after_interrupt()
        if not at_most_once and written:
            try:
                consumer.ack_many(written)
            except LeaseLost:
                pass
        raise
    if not at_most_once:
        try:
            consumer.ack_many(written)
        except LeaseLost as e:
            render.note(f"fdq: warning: {_one_line(e)}")
    return len(written)


@cli.command()
@topic_argument
@click.option("--count", "-n", type=click.IntRange(min=1), default=None, metavar="N",
              help="Stop after N messages [default: follow until Ctrl-C].")
@click.option("--timeout", type=Seconds(), default=None,
              help="Stop after this many seconds without a message.")
@subscription_option
@click.option("--tag", type=Tag(), default=None, metavar="T",
              help="Take messages dispatched to tag T (extend topics).")
@click.option("--mode", type=click.Choice(["at-least-once", "at-most-once"]), default="at-least-once",
              show_default=True,
              help="at-least-once: print, then ack; at-most-once: ack each message, then print it.")
@json_option
@pass_state
def tail(state, topic, count, timeout, subscription, tag, mode, as_json):
    """Print TOPIC's messages and ack them.

    Each line: id, shard key, headers (name=value), body; control characters
    but tab are escaped (\\n, \\x1b), so a message is always one line (--json
    has the exact body).

    Joins the subscription as a consumer: with other consumers live it gets its
    share of the shards. One message per line; --json: one JSON object per line.
    A stalled consumer (database unreachable, or no shard owned, for over 3
    heartbeats) is reported by one line on stderr; tail keeps going. A topic or
    subscription deleted under it ends it (exit 1).

    A subscription with ack policy none is done with a message when tail
    fetches it, in batches (a failed write loses the rest of its batch).

    A message counts as delivered once its line is written to stdout. If the
    reader goes away (fdq tail t | head -1), tail exits 141 without a message:
    at-least-once acks the lines it wrote (the reader may not have read all of
    a pipe's buffer) and returns the rest of its batch to the subscription at
    once; at-most-once loses the one message whose line could not be written.
    """
    config = state.supervisor.config(topic)
    if tag is not None and not config.extend:
        render.note(f"topic {topic!r} has no extend support: --tag is ignored")
    gone = []                   # the topic or subscription, deleted under this tail

    def on_error(e):
        if isinstance(e, (TopicNotFound, SubscriptionNotFound)):
            gone.append(e)
        else:
            _tail_error(e)
    consumer = Consumer(state.db, topic, subscription=subscription, create=False,
                        extend_support=config.extend, desired_tag=tag, batch_size=TAIL_BATCH,
                        on_error=on_error)
    got = 0
    state.interrupted = lambda: f"tail stopped after {got:,} messages"
    try:                    # SIGTERM leaves as Ctrl-C does: shards and leases given back now
        previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:      # not the main thread: leave SIGTERM alone
        previous_sigterm = None
    try:
        last = time.monotonic()
        while count is None or got < count:
            if gone:
                raise Failure(_one_line(gone[0]))
            wait = 1.0
            if timeout is not None:
                wait = min(wait, max(0.0, last + timeout - time.monotonic()))
            want = TAIL_BATCH if count is None else min(TAIL_BATCH, count - got)
            msgs = consumer.fetch(want, timeout=wait)
            if not msgs:
                if timeout is not None and time.monotonic() - last >= timeout:
                    break
                continue
            got += _print_and_ack(consumer, msgs, mode == "at-most-once", as_json)
            last = time.monotonic()
    except _Terminated:
        raise click.exceptions.Exit(128 + signal.SIGTERM) from None
    finally:
        if previous_sigterm is not None:     # a second SIGTERM during close: no traceback
            signal.signal(signal.SIGTERM, previous_sigterm)
        consumer.close()


# -- supervision ----------------------------------------------------------------------

@cli.command()
@topic_argument
@pass_state
def pause(state, topic):
    """Pause TOPIC: stop routing and consumption.

    Pushes still land in the topic's log; fdq play routes them."""
    state.supervisor.pause(topic)
    render.note(f"paused topic {topic!r}")


@cli.command()
@topic_argument
@json_option
@pass_state
def play(state, topic, as_json):
    """Resume TOPIC: route what arrived while paused, in order."""
    sup = state.supervisor
    pending = sup.stats(topic)["counters"]["pending"]
    _resumable(state, f"play of {topic!r}")
    with render.progress(f"routing {topic}", pending) as advance:
        routed = sup.play(topic, progress=advance)
    render.note(f"topic {topic!r} is running: routed {routed:,} messages pushed while paused")
    if as_json:
        render.emit_json({"topic": topic, "routed": routed})


@cli.command()
@topic_argument
@click.option("--shards", type=Shards(), default=None,
              help="Change the shard count (re-routes every backlog, each key's order kept).")
@json_option
@pass_state
def rebalance(state, topic, shards, as_json):
    """Re-divide TOPIC's shards among live consumers.

    With --shards N, change the shard count first (every backlog re-routed,
    each shard key's order kept)."""
    sup = state.supervisor
    sup.config(topic)          # unknown: exit 1 before anything changes
    _resumable(state, f"rebalance of {topic!r}")
    # Queue entries read, without a total: a message moving to a shard not processed yet
    # is read again there, so no count known beforehand bounds it (the backlog did not).
    with render.progress(f"resharding {topic}") as advance:
        config = sup.rebalance(topic, shards=shards, progress=advance)
    members = rows.consumer_rows(sup.stats(topic))
    zombies = sum(1 for c in members if c["zombie"])
    render.note(f"topic {topic!r}: {config.shards} shards divided among {len(members)} consumer(s)"
                + (f" ({zombies} of them zombies: a live consumer takes their shards over)" if zombies else ""))
    if as_json:
        render.emit_json(rows.topic_row(topic, sup.stats(topic)))


@cli.command()
@topic_argument
@click.option("--start", type=Time(), required=True, help="From (ISO-8601, <n>s or <n>ms), inclusive.")
@click.option("--end", type=Time(), default=None, help="To (ISO-8601, <n>s or <n>ms), exclusive [default: now].")
@json_option
@pass_state
def replay(state, topic, start, end, as_json):
    """Deliver again TOPIC's messages inserted in [--start, --end).

    In order, as new messages (new ids; each keeps the original's id in
    replay_of), what was committed when the replay began. Resumable: after a
    crash, run the same command again and it continues where it stopped.

    Times: ISO-8601 (2026-11-23T02:00:00Z; no zone = UTC), epoch seconds with
    s (1795399200s) or epoch milliseconds with ms or bare (1795399200000). A
    bare number that looks like seconds (below 100000000000) is refused."""
    if end is not None and end <= start:
        raise click.BadParameter(f"--end ({iso_ms(end)}) must be after --start ({iso_ms(start)})",
                                param_hint="'--end'")
    state.supervisor.config(topic)
    done = 0

    def count(n):
        nonlocal done
        # the bar first: an interrupt inside it leaves done as it was, and the replay
        # then reports the chunk again from its progress record (once)
        advance(n)
        done += n
    # Each chunk commits with the replay's progress: a rerun takes this run over (once its
    # heartbeat has stood still for ~3 s) and goes on after its last chunk.
    state.interrupted = lambda: (f"replayed {done:,} messages of {topic!r} so far; run the same command "
                                 "again to resume (it continues where this one stopped)")
    with render.progress(f"replaying {topic}") as advance:
        n = Producer(state.db).replay(topic, as_datetime(start), as_datetime(end), progress=count)
    render.note(f"replayed {n:,} messages of topic {topic!r}")
    if as_json:
        render.emit_json({"topic": topic, "replayed": n, "start_ms": start, "end_ms": end})


@cli.command()
@topic_argument
@click.option("--before", type=Time(), default=None,
              help="Delete log entries inserted before this time (ISO-8601, <n>s or <n>ms) [default: the topic's retention_s]; "
                   "its retention_bytes applies either way.")
@json_option
@pass_state
def trim(state, topic, before, as_json):
    """Apply retention to TOPIC's log (what replay reads).

    By age (its retention_s, or --before), then by size (its retention_bytes:
    the oldest entries go until the log fits). Set them with fdq topics update.

    Also expires dedupe ids and push markers past their windows. Queued
    messages are untouched."""
    sup = state.supervisor
    config = sup.config(topic)
    if before is None and config.retention_s is None and config.retention_bytes is None:
        render.note(f"topic {topic!r} has no retention: give --before to trim its log")
    _resumable(state, f"trim of {topic!r}")
    with render.progress(f"trimming {topic}") as advance:
        n = sup.trim(topic, before_ms=as_datetime(before), progress=advance)
    render.note(f"deleted {n:,} log entries of topic {topic!r}")
    if as_json:
        render.emit_json({"topic": topic, "deleted": n})


# -- dead letters ---------------------------------------------------------------------

def _check_subscription(sup, topic, subscription):
    subs = sup.config(topic).subs
    if subscription not in subs:
        raise SubscriptionNotFound(f"subscription {subscription!r} of topic {topic!r} does not exist "
                                   f"(subscriptions: {', '.join(subs)})")

@cli.group()
def dlq():
    """Dead letters of a subscription: list, redrive, purge."""


@dlq.command("list")
@topic_argument
@subscription_option
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@json_option
@pass_state
def dlq_list(state, topic, subscription, limit, as_json):
    """List dead letters, oldest first, with the reason each was dead-lettered."""
    _check_subscription(state.supervisor, topic, subscription)
    data = [rows.dlq_row(d, subscription) for d in state.supervisor.dlq_list(topic, subscription, limit)]
    if as_json:
        render.emit_json(data)
    elif not data:
        render.note(f"the dead-letter queue of {topic}/{subscription} is empty")
    else:
        render.table(None, [
            ("id", lambda d: d["id"]),
            ("reason", lambda d: d["reason"] if len(d["reason"]) <= 60 else d["reason"][:57] + "..."),
            ("attempts", lambda d: d["attempts"]),
            ("key", lambda d: d["shard_key"]),
            ("inserted", lambda d: render.time_ms(d["insertion_time_ms"])),
            ("consumer", lambda d: d["consumer"]),
            ("body", lambda d: d["body"] if len(d["body"]) <= 60 else d["body"][:57] + "..."),
        ], data)


@dlq.command("redrive")
@topic_argument
@subscription_option
@json_option
@pass_state
def dlq_redrive(state, topic, subscription, as_json):
    """Move every dead letter back to its shard's queue (attempts reset)."""
    sup = state.supervisor
    _check_subscription(sup, topic, subscription)
    total = sup.stats(topic)["subscriptions"][subscription]["dlq"]
    _resumable(state, f"redrive of {topic}/{subscription}")
    with render.progress(f"redriving {topic}/{subscription}", total) as advance:
        n = sup.dlq_redrive(topic, subscription, progress=advance)
    render.note(f"redrove {n:,} dead letters of {topic}/{subscription}")
    if as_json:
        render.emit_json({"topic": topic, "subscription": subscription, "redriven": n})


@dlq.command("purge")
@topic_argument
@subscription_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
@pass_state
def dlq_purge(state, topic, subscription, yes, as_json):
    """Delete every dead letter of the subscription."""
    sup = state.supervisor
    _check_subscription(sup, topic, subscription)
    if not yes:
        _confirm(f"Delete every dead letter of {topic}/{subscription}?",
                 f"the dead letters of {topic}/{subscription} not purged")
    _resumable(state, f"purge of {topic}/{subscription}")
    n = sup.dlq_purge(topic, subscription)
    render.note(f"purged {n:,} dead letters of {topic}/{subscription}")
    if as_json:
        render.emit_json({"topic": topic, "subscription": subscription, "purged": n})

# -- subscriptions --------------------------------------------------------------------

class SubsGroup(click.Group):
    """``fdq subs TOPIC`` is ``fdq subs list TOPIC``; ``fdq subs COMMAND ...`` runs COMMAND."""

    def parse_args(self, ctx, args):
        first = next((a for a in args if not a.startswith("-")), None)
        if first is not None and first not in self.commands:
            args = ["list", *args]
        return super().parse_args(ctx, args)


SUBSCRIPTION_COLUMNS = [
    ("subscription", lambda r: r["name"]),
    ("ephemeral", lambda r: r["ephemeral"]),
    ("catching up", lambda r: r["catching_up"]),
    ("paused", lambda r: r["paused"]),
    ("deliver", lambda r: r["deliver_policy"] if r["start_time_ms"] is None
     else f"{r['deliver_policy']} {render.time_ms(r['start_time_ms'])}"),
    ("ack", lambda r: r["config"]["ack_policy"]),
    ("backlog", lambda r: r["backlog"]),
    ("in flight", lambda r: r["in_flight"]),
    ("dlq", lambda r: r["dlq"]),
    ("consumers", lambda r: r["consumers"]),
]

# One click option per SubscriptionConfig field the command line sets; each option's
# destination is the field's name, so FDQ's own rule judges its value.
SUBSCRIPTION_OPTIONS = {
    "ack_policy": click.option(
        "--ack-policy", type=click.Choice(ACK_POLICIES), default="explicit", show_default=True,
        help="explicit: messages are leased until acked; none: done when delivered."),
    "ack_wait_s": click.option(
        "--ack-wait-s", type=Seconds(), default=None, callback=subscription_config_callback,
        help="Lease length of every consumer [default: each consumer's own]."),
    "max_deliver": click.option(
        "--max-deliver", type=int, default=None, metavar="N", callback=subscription_config_callback,
        help="Deliveries before the DLQ [default: each consumer's own]."),
    "backoff_s": click.option(
        "--backoff-s", type=SecondsList(), default=None, callback=subscription_config_callback,
        help="Redelivery delays by attempt, e.g. 1,5,30 (the last repeats; '' = at once) "
             "[default: each consumer's own]."),
    "max_ack_pending": click.option(
        "--max-ack-pending", type=int, default=None, metavar="N", callback=subscription_config_callback,
        help="At most N leased messages per shard [default: no limit]."),
    "deliver_policy": click.option(
        "--deliver-policy", type=click.Choice(DELIVER_POLICIES), default=None,
        help="Where it starts: all messages in the log, new ones, the last one and new, or "
             "by_start_time [default: all; by_start_time with --start-time]."),
    "start_time_ms": click.option(
        "--start-time", "start_time_ms", type=Time(), default=None,
        help="Start at messages inserted at this time or later (ISO-8601, <n>s or <n>ms)."),
    "filter_shard_key": click.option(
        "--filter-shard-key", metavar="GLOB", default=None, callback=subscription_config_callback,
        help="Deliver only messages whose shard key matches this glob."),
    "filter_headers": click.option(
        "--filter-header", "filter_headers", type=FilterHeader(), multiple=True,
        callback=filter_headers_callback,
        help="Deliver only messages with header name=value (all must match; a non-string "
             "header matches its JSON text, e.g. flag=true). Repeatable."),
    "ordered": click.option(
        "--ordered", is_flag=True, help="Hold back later messages of a shard key while one is leased."),
    "ephemeral": click.option(
        "--ephemeral", is_flag=True, help="Delete it when its last consumer leaves."),
    "description": click.option(
        "--description", default=None, metavar="TEXT", callback=subscription_config_callback,
        help="Free text (at most 4096 characters)."),
}


class UpdateCommand(click.Command):
    """``fdq subs update``: an option of a field that cannot change gets told why."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            fixed = {"--" + f.replace("_", "-") for f in SUBSCRIPTION_OPTIONS} | {"--start-time", "--filter-header"}
            if e.option_name in fixed:
                may = ", ".join("--" + f.replace("_", "-") for f in UPDATABLE_SUBSCRIPTION_FIELDS)
                raise click.UsageError(f"{e.option_name} cannot be updated: only {may} may change "
                                       "(create a new subscription, or reset it for a new start point)",
                                       ctx) from None
            raise


def _subscription_options(fields):
    def apply(f):
        for name in reversed(fields):
            f = SUBSCRIPTION_OPTIONS[name](f)
        return f
    return apply


def _subscription_row(sup, topic, name):
    info = sup.subscription(topic, name)
    return rows.subscription_row(topic, info, sup.stats(topic)["subscriptions"].get(name))


def _show_subscription(row):
    items = [(k, v) for k, v in row.items() if k != "config"]
    items += [(f"config.{k}", v) for k, v in row["config"].items()]
    render.table(f"subscription {row['topic']}/{row['name']}", [
        ("field", lambda kv: kv[0]),
        ("value", lambda kv: json.dumps(kv[1], ensure_ascii=False) if isinstance(kv[1], (dict, list))
         else render.time_ms(kv[1]) if kv[0].endswith("time_ms") and kv[1] is not None else kv[1]),
    ], items)


@cli.group(cls=SubsGroup)
def subs():
    """Subscriptions of a topic: list, create, show, update, reset, pause, play, delete.

    fdq subs TOPIC lists them, as fdq subs list TOPIC does (use the latter for a
    topic named like a command)."""


@subs.command("list")
@topic_argument
@json_option
@pass_state
def subs_list(state, topic, as_json):
    """List TOPIC's subscriptions: start, backlog, in flight, DLQ, consumers."""
    data = rows.subscription_rows(state.supervisor, topic)
    if as_json:
        render.emit_json(data)
    elif not data:
        render.note(f"topic {topic!r} has no subscriptions")
    else:
        render.table(None, SUBSCRIPTION_COLUMNS, data)


@subs.command("create")
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@_subscription_options(list(SUBSCRIPTION_OPTIONS))
@json_option
@pass_state
def subs_create(state, topic, name, as_json, **fields):
    """Create subscription NAME of TOPIC and copy its start point.

    Messages of the start point (--deliver-policy) are copied from the topic's
    log before this returns (progress on stderr); then its consumers deliver.
    Nothing changes if it exists with the same options; other options are an
    error (change updatable ones with fdq subs update)."""
    if fields["deliver_policy"] is None:
        fields["deliver_policy"] = "by_start_time" if fields["start_time_ms"] is not None else "all"
    if fields["description"] is None:
        fields["description"] = ""
    try:
        config = SubscriptionConfig(**fields)
    except ConfigError as e:
        raise click.UsageError(f"invalid subscription options: {e}") from None
    sup = state.supervisor
    existed = name in sup.config(topic).subs
    copied = 0

    def count(n):
        nonlocal copied
        copied += n
        advance(n)
    _resumable(state, f"catch-up of {topic}/{name}")
    with render.progress(f"catching up {topic}/{name}") as advance:
        sup.create_subscription(topic, name, config, progress=count)
    if existed:
        render.note(f"subscription {name!r} of topic {topic!r} already exists with these options: unchanged"
                    + (f" (finished its catch-up: {copied:,} messages copied)" if copied else ""))
    else:
        render.note(f"created subscription {name!r} of topic {topic!r}: deliver {config.deliver_policy}, "
                    f"{copied:,} messages copied from the log")
    if as_json:
        render.emit_json(_subscription_row(sup, topic, name))


@subs.command("show")
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@json_option
@pass_state
def subs_show(state, topic, name, as_json):
    """Show subscription NAME of TOPIC: its stored options and counts."""
    row = _subscription_row(state.supervisor, topic, name)
    if as_json:
        render.emit_json(row)
    else:
        _show_subscription(row)


@subs.command("update", cls=UpdateCommand)
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@_subscription_options(list(UPDATABLE_SUBSCRIPTION_FIELDS))
@json_option
@pass_state
def subs_update(state, topic, name, as_json, **changes):
    """Change updatable options of subscription NAME of TOPIC.

    Only these may change; its consumers apply them at their next heartbeat.
    Other options fix what the subscription is: create a new one (or reset it
    for a new start point)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes:
        given = ", ".join("--" + f.replace("_", "-") for f in UPDATABLE_SUBSCRIPTION_FIELDS)
        raise click.UsageError(f"nothing to update: give one of {given}")
    sup = state.supervisor
    config = sup.update_subscription(topic, name, **changes)
    render.note(f"updated subscription {name!r} of topic {topic!r}: "
                + ", ".join(f"{k}={getattr(config, k)!r}" for k in changes))
    if as_json:
        render.emit_json(_subscription_row(sup, topic, name))


@subs.command("reset")
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@click.option("--to", "to_time", type=TimeOrNow(), required=True,
              help="The new start (ISO-8601, <n>s or <n>ms), or now (skip everything queued).")
@json_option
@pass_state
def subs_reset(state, topic, name, to_time, as_json):
    """Move subscription NAME's start to --to (rewind or skip).

    Its ready and delayed messages are replaced by the log's messages inserted
    at --to or later (within retention); leases and dead letters stay."""
    sup = state.supervisor
    sup.subscription(topic, name)          # unknown: exit 1 before anything changes
    _resumable(state, f"reset of {topic}/{name}")
    with render.progress(f"resetting {topic}/{name}") as advance:
        copied = sup.reset(topic, name, as_datetime(to_time), progress=advance)
    when = "now" if to_time is None else render.time_ms(to_time)
    render.note(f"reset subscription {name!r} of topic {topic!r} to {when}: {copied:,} messages copied from the log")
    if as_json:
        render.emit_json({"topic": topic, "subscription": name, "to_time_ms": to_time, "copied": copied})


@subs.command("pause")
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@json_option
@pass_state
def subs_pause(state, topic, name, as_json):
    """Pause subscription NAME of TOPIC: its consumers take nothing.

    Pushes keep filling its queues; the topic's other subscriptions go on. As
    an NSQ client's /channel/pause; fdq subs play resumes it."""
    was = state.supervisor.pause_subscription(topic, name)
    render.note(f"subscription {name!r} of topic {topic!r} " + ("was already paused" if was else "paused"))
    if as_json:
        render.emit_json(_subscription_row(state.supervisor, topic, name))


@subs.command("play")
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@json_option
@pass_state
def subs_play(state, topic, name, as_json):
    """Resume subscription NAME of TOPIC, paused by fdq subs pause (or /channel/pause)."""
    was = state.supervisor.play_subscription(topic, name)
    render.note(f"{'resumed' if was else 'nothing to resume:'} subscription {name!r} of topic {topic!r}"
                + ("" if was else " was not paused"))
    if as_json:
        render.emit_json(_subscription_row(state.supervisor, topic, name))


@subs.command("delete")
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@pass_state
def subs_delete(state, topic, name, yes):
    """Delete subscription NAME of TOPIC with its queues, leases and dead letters."""
    sup = state.supervisor
    row = _subscription_row(sup, topic, name)     # unknown: exit 1 before asking
    if not yes:
        _confirm(f"Delete subscription {topic}/{name} with a backlog of {row['backlog'] or 0:,}, "
                 f"{row['in_flight'] or 0:,} in flight and {row['dlq'] or 0:,} dead letters?",
                 f"subscription {topic}/{name} not deleted")
    sup.delete_subscription(topic, name)
    render.note(f"deleted subscription {name!r} of topic {topic!r}")


# -- the NSQ-compatible broker ----------------------------------------------------------

# Defaults and meanings are fdq.broker.__main__'s (python -m fdq.broker): one mapping.
_BROKER = vars(broker_main.parser().parse_args(["--url", ""]))


def _duration_default(name):
    return f"{_BROKER[name]:g}s"


@cli.command(context_settings={"show_default": True})
@click.option("--tcp-address", type=Address(), default=_BROKER["tcp_address"],
              help="<addr>:<port> to listen on for TCP clients (port 0: any free port).")
@click.option("--http-address", type=Address(optional=True), default=_BROKER["http_address"],
              help="<addr>:<port> to listen on for HTTP clients ('' for none).")
@click.option("--msg-timeout", type=Duration(), default=_duration_default("msg_timeout"),
              help="Default time a message may be in flight before it is requeued.")
@click.option("--max-msg-timeout", type=Duration(), default=_duration_default("max_msg_timeout"),
              help="Largest msg_timeout a client may ask for.")
@click.option("--max-msg-size", type=click.IntRange(min=1), default=_BROKER["max_msg_size"],
              help="Largest message body, bytes.")
@click.option("--max-body-size", type=click.IntRange(min=1), default=_BROKER["max_body_size"],
              help="Largest command body (MPUB), bytes.")
@click.option("--max-rdy-count", type=click.IntRange(min=1), default=_BROKER["max_rdy_count"],
              help="Largest RDY a client may set.")
@click.option("--max-heartbeat-interval", type=Duration(),
              default=_duration_default("max_heartbeat_interval"),
              help="Longest heartbeat interval a client may ask for.")
@click.option("--max-req-timeout", type=Duration(), default=_duration_default("max_req_timeout"),
              help="Longest requeue delay (REQ).")
@click.option("--max-deflate-level", type=click.IntRange(1, 9), default=_BROKER["max_deflate_level"],
              help="Highest deflate level a client may ask for.")
@click.option("--deflate/--no-deflate", default=_BROKER["deflate"], help="Allow deflate compression.")
@click.option("--snappy/--no-snappy", default=_BROKER["snappy"],
              help="Allow snappy compression (framed; needs the cramjam package).")
@click.option("--max-output-buffer-size", type=click.IntRange(min=64), default=_BROKER["max_output_buffer_size"],
              help="Largest output_buffer_size a client may ask for in IDENTIFY, bytes.")
@click.option("--output-buffer-timeout", type=Duration(), default=_duration_default("output_buffer_timeout"),
              help="Default time buffered messages wait before they are sent.")
@click.option("--min-output-buffer-timeout", type=Duration(),
              default=_duration_default("min_output_buffer_timeout"),
              help="Shortest output_buffer_timeout a client may ask for.")
@click.option("--max-output-buffer-timeout", type=Duration(),
              default=_duration_default("max_output_buffer_timeout"),
              help="Longest output_buffer_timeout a client may ask for.")
@click.option("--e2e-processing-latency-percentile", multiple=True,
              help="Publish-to-FIN latency quantile reported in /stats, in (0, 1]; repeat or comma "
                   "separate (1.0,0.99,0.95). Default: none.")
@click.option("--e2e-processing-latency-window-time", type=Duration(),
              default=_duration_default("e2e_processing_latency_window_time"),
              help="Window of the e2e processing latency percentiles.")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="TLS certificate (PEM).")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None,
              help="TLS private key (PEM).")
@click.option("--tls-required", is_flag=True, help="Clients must upgrade to TLS.")
@click.option("--auth-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Secrets and their permissions (JSON; see fdq/broker/auth.py).")
@click.option("--web-path", default=None,
              help="Serve the web dashboard (fdq web) under this path of the HTTP address, e.g. /web/.")
@click.option("--web-write-token", envvar="FDQ_WEB_WRITE_TOKEN", default=None,
              help="Dashboard actions need this token (or an --auth-file secret with admin) "
                   "[env FDQ_WEB_WRITE_TOKEN].")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              default=_BROKER["log_level"], help="Log level (stderr).")
@pass_state
def broker(state, **flags):
    """Run the NSQ-compatible broker on the database (nsqd's flags).

    NSQ clients (pynsq, nsqjs, go-nsq ...) publish and consume unchanged:
    topics are FDQ topics, channels are subscriptions. Prints the listening
    addresses on stderr once ready; serves until SIGTERM (exit 0) or Ctrl-C
    (exit 130), then closes its connections and stops.
    Durations: 60s, 1m30s, 500ms, or seconds."""
    if (flags["tls_cert"] is None) != (flags["tls_key"] is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    if flags["tls_required"] and flags["tls_cert"] is None:
        raise click.UsageError("--tls-required needs --tls-cert and --tls-key")
    try:
        options = broker_main.build_options(argparse.Namespace(**flags))
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    logging.basicConfig(stream=sys.stderr, level=flags["log_level"].upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tcp_host = flags["tcp_address"].rpartition(":")[0]
    http_host = flags["http_address"].rpartition(":")[0]

    def ready(tcp_port, http_port):
        http = f"http={http_host}:{http_port}" if http_port is not None else "http=off"
        web = f" web=http://{http_host}:{http_port}/{flags['web_path'].strip('/')}/" \
            if flags["web_path"] and http_port is not None else ""
        render.note(f"fdq broker: listening tcp={tcp_host}:{tcp_port} {http}{web}")

    from ..broker.server import run
    state.interrupted = lambda: "broker stopped"
    try:
        stopped_by = run(state.url, flags["tcp_address"], flags["http_address"] or None, options, ready)
    except (OSError, ssl.SSLError) as e:
        raise Failure(f"cannot start the broker: {_one_line(e)}") from None
    if stopped_by == signal.SIGINT:     # its own handler stopped it: the line Ctrl-C prints elsewhere
        _exit_interrupted(state.interrupted)
    render.note("fdq broker: stopped")


def main(argv=None):
    """The console script ``fdq``."""
    cli.main(args=argv, prog_name="fdq")


__all__ = ["cli", "main", "Failure"]
