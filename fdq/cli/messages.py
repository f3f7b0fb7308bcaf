"""``fdq push`` and ``fdq tail``: messages in from arguments or stdin lines, out to
stdout (and acked)."""
from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import select
import signal
import stat
import struct
import sys
import termios
import time

import click

from .. import (Action, Consumer, ConsumerStalled, Envelope, FDQError, LeaseLost, Producer, Settlement,
                SubscriptionNotFound, TopicConfig, TopicNotFound)
from ..engine import after_interrupt
from . import render, rows
from .app import Failure, check_interrupt, cli, json_option, one_line, pass_state, subscription_option, topic_argument
from .params import Header, Int, Seconds, Tag, envelope_callback, headers_callback

PUSH_BATCH = 500      # stdin lines per transaction at most (progress and errors count by them)
TAIL_BATCH = 100

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


def _whole_body(sup, topic: str, path: str | None) -> bytes:
    """The bytes of file ``path`` (None: stdin to its end) as one message body. Larger
    than the topic's ``max_message_bytes`` (a topic the push would create: the default
    one's) is refused: a regular file by its size, before it is read; a pipe once one
    byte more than the limit has been read."""
    try:
        limit = sup.config(topic).max_message_bytes
    except TopicNotFound:
        limit = TopicConfig().max_message_bytes
    what = "stdin" if path is None else f"file {path!r}"

    def too_large(size: str):
        return Failure(f"{what} is {size} bytes, more than topic {topic!r}'s max_message_bytes ({limit:,}): "
                       f"raise it with fdq topics update {topic} --max-message-bytes N (at most 8 MiB)")
    if path is None and sys.stdin is None:      # started with descriptor 0 closed
        raise Failure("stdin is closed: give DATA or --file F")
    with (open(path, "rb") if path is not None else contextlib.nullcontext(sys.stdin.buffer)) as stream:
        try:
            st = os.fstat(stream.fileno())
        except (AttributeError, OSError, ValueError):       # no descriptor (a test's stdin)
            st = None
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size - stream.tell() > limit:
            raise too_large(f"{st.st_size - stream.tell():,}")
        body = stream.read(limit + 1)
    if len(body) > limit:
        raise too_large(f"over {limit:,}")
    return body


@cli.command()
@topic_argument
@click.argument("data", required=False)
@click.option("--key", "-k", "shard_key", metavar="K", callback=envelope_callback,
              help="Shard key (messages of one key keep their order).")
@click.option("--delay", type=Seconds(), default=None, metavar="DURATION", callback=envelope_callback,
              help="Deliver after this long: 30 (seconds), 1m30s, 500ms, 2h.")
@click.option("--ttl", "ttl_s", type=Seconds(), default=None, metavar="DURATION", callback=envelope_callback,
              help="Never deliver it after this long, e.g. 30s [default: the topic's ttl_s].")
@click.option("--header", "-H", "headers", type=Header(), multiple=True, callback=headers_callback,
              help="A header name=value (extend topics); the value is JSON if it parses, "
                   "else a string. Repeatable.")
@click.option("--msg-id", metavar="ID", callback=envelope_callback,
              help="Your id: a repeat within the topic's dedupe window is stored once.")
@click.option("--keep-empty", is_flag=True,
              help="Push blank stdin lines as empty messages [default: skip them].")
@click.option("--file", "-f", "path", type=click.Path(exists=True, dir_okay=False), default=None, metavar="F",
              help="Push file F's bytes as one message, exactly (nothing stripped).")
@click.option("--eof", is_flag=True, help="Push stdin, read to its end, as one message, exactly.")
@json_option
@pass_state
def push(state, topic, data, shard_key, delay, ttl_s, headers, msg_id, keep_empty, path, eof, as_json):
    """Push DATA (or stdin lines) to TOPIC; print the ids.

    TOPIC is created if missing.

    With DATA "-" (or no DATA), push one message per line of stdin (newline, or
    CR LF, stripped; nothing else), in as few transactions as hold them (up to
    500 lines each; what was read is pushed once no more input is ready: lines
    of a live pipe go out as they come); prints one id per line. Blank lines (nothing before the newline) are
    skipped and counted in the summary; --keep-empty pushes them as empty
    messages. A line of spaces is data, pushed as it is.

    --file F (or --eof: stdin to its end) pushes a whole file as one message,
    its bytes exactly; one larger than the topic's max_message_bytes is
    refused before it is read (exit 1).
    """
    show = render.emit_json_line if as_json else (lambda r: click.echo(r["id"]))
    if path is not None or eof:
        if data is not None or (path is not None and eof):
            raise click.UsageError("give one of DATA, --file F and --eof")
        body = _whole_body(state.supervisor, topic, path)
    elif data is not None and data != "-":
        body = _encode_arg(data)
    else:
        body = None
    if body is not None:
        r = Producer(state.db).push(topic, body, shard_key=shard_key, msg_id=msg_id, delay=delay,
                          headers=headers, ttl=ttl_s)
        if r.duplicate:
            render.note(f"msg-id {msg_id!r} was pushed before: not stored again")
        show(rows.push_row(r))
        return
    if msg_id is not None:
        raise click.UsageError("--msg-id names one message: give DATA, not stdin lines")
    if sys.stdin is None:                   # started with descriptor 0 closed
        raise Failure("stdin is closed: give DATA, or lines on stdin")
    fed = pushed = skipped = 0
    reading = True          # in the input: no transaction under way

    def envelopes():
        """stdin's lines as envelopes, and None when no more input is ready yet (the
        producer then commits what it holds)."""
        nonlocal fed, skipped, reading
        for line in _stdin_lines(sys.stdin.buffer):
            if line is not None:
                body = line[:-1] if line.endswith(b"\n") else line
                if body.endswith(b"\r"):
                    body = body[:-1]
                if not body and not keep_empty:
                    skipped += 1
                    continue
                line = Envelope(body, shard_key, delay, None, headers, ttl_s)
                fed += 1
            reading = False
            yield line
            reading = True

    def interrupted():
        held = fed - pushed
        maybe = f"; the {held:,} lines being pushed may be stored too" if held and not reading else ""
        return f"pushed {pushed:,} messages to {topic!r} (ids printed){maybe}"
    state.interrupted = interrupted
    with render.progress(f"pushing to {topic}") as advance:
        try:
            for results in Producer(state.db).push_stream(topic, envelopes(), max_messages=PUSH_BATCH):
                pushed += len(results)
                for r in results:
                    show(rows.push_row(r))
                advance(len(results))
        except FDQError as e:
            done = f" ({pushed:,} messages pushed before this batch)" if pushed else ""
            raise Failure(one_line(e) + done) from None
    blank = "" if not skipped else (f" ({skipped:,} blank line{'s' if skipped != 1 else ''} skipped; "
                                    "--keep-empty pushes them)")
    render.note(f"pushed {pushed:,} messages to {topic!r}{blank}")


def _message_line(m, as_json) -> str:
    """A message as ``fdq tail`` prints it: one line (without its newline)."""
    row = rows.message_row(m)
    if as_json:
        return json.dumps(row, ensure_ascii=False, separators=(",", ":"))
    parts = [row["id"]]
    if row["shard_key"] is not None:
        parts.append(f"key={row['shard_key']}")
    for name, value in row["headers"].items():
        parts.append(f"{name}={value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}")
    if row["attempts"] > 1:
        parts.append(f"attempts={row['attempts']}")
    body = m.body.decode("utf-8", "backslashreplace")
    # One message per line, and nothing a terminal would act on: control characters
    # but tab are escaped.
    return ("  ".join(parts) + "  " + body).translate(_CONTROL_ESCAPES)


_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7f, 0xa0)] if c != 0x09} | {
    0x0a: "\\n", 0x0d: "\\r"}


class StdoutWatch:
    """What ``fdq tail`` knows of its stdout's reader.

    On a pipe (a FIFO), how many of the bytes written the reader has read: Linux's
    ``FIONREAD`` on the write end gives those still unread (also after the reader
    closed). On a pipe or a socket, whether the reader has gone, without writing:
    ``poll`` reports ``POLLERR`` (pipe) or ``POLLHUP`` (socket) on the write end.
    Elsewhere (a file, a terminal, no descriptor: click's test runner) what is
    written counts as read, and the reader never goes."""

    def __init__(self, stream):
        try:
            fd = stream.fileno()
            mode = os.fstat(fd).st_mode
        except (AttributeError, OSError, ValueError):
            fd, mode = None, 0
        self.fd = fd
        self.fifo = stat.S_ISFIFO(mode)
        self._poll = None
        if self.fifo or stat.S_ISSOCK(mode):
            self._poll = select.poll()
            self._poll.register(fd, 0)      # POLLERR and POLLHUP are always reported
        self.written = 0                    # bytes written to the descriptor, in all

    @property
    def watched(self) -> bool:
        """Whether the reader's going is seen without a write (a pipe or a socket)."""
        return self._poll is not None

    def reader_gone(self, wait_s: float = 0.0) -> bool:
        """Whether the reader has closed its end, waiting up to ``wait_s`` for it."""
        if self._poll is None:
            return False
        return any(ev & (select.POLLERR | select.POLLHUP) for _fd, ev in self._poll.poll(int(wait_s * 1000)))

    def read_upto(self) -> int:
        """How many of the bytes written the reader has read."""
        if not self.fifo:
            return self.written
        try:
            unread = struct.unpack("i", fcntl.ioctl(self.fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:         # not Linux's pipe: as written
            unread = 0
        return self.written - unread


class TailOutput:
    """``fdq tail``'s messages from their lease to their settlement.

    At-least-once, a message is acked once its line has been *read* (``StdoutWatch``:
    on a pipe, when the reader has read past its newline; elsewhere, when written);
    until then it stays leased (touched every half ack wait). What tail holds when it
    stops (lines written but not read, messages not yet written) is released: back to
    its queue at once, no attempt counted. At-most-once acks each message just before
    its line, so a write that fails loses that one only. A subscription with ack
    policy none leases nothing: its messages were done when fetched."""

    def __init__(self, consumer, watch: StdoutWatch, at_most_once: bool, as_json: bool):
        self.consumer, self.watch = consumer, watch
        self.at_most_once, self.as_json = at_most_once, as_json
        self.leasing = consumer.sub_config.ack_policy != "none"
        self.unread = collections.deque()     # [end offset, message, leased at]: written, not yet read
        self.unwritten = collections.deque()  # leased, not yet written

    def _write(self, m):
        stream = sys.stdout
        if stream is None:                  # started with descriptor 1 closed: as click.echo does
            return
        data = (_message_line(m, self.as_json) + "\n").encode(getattr(stream, "encoding", None) or "utf-8",
                                                              "backslashreplace")
        stream.flush()
        stream.buffer.write(data)
        stream.buffer.flush()
        self.watch.written += len(data)

    def emit(self, msgs) -> int:
        """Print ``msgs``, one line each; ack those read so far. Returns how many lines
        were written."""
        if not self.leasing:
            for m in msgs:
                self._write(m)
            return len(msgs)
        self.unwritten.extend(msgs)
        now = time.monotonic()
        written = 0
        while self.unwritten:
            m = self.unwritten[0]
            if self.at_most_once:
                try:
                    self.consumer.ack_many([m])
                except LeaseLost as e:      # redelivered elsewhere: not ours to print
                    self.unwritten.popleft()
                    render.note(f"fdq: warning: {one_line(e)}")
                    continue
                self.unwritten.popleft()
                self._write(m)
            else:
                self._write(m)
                self.unread.append([self.watch.written, self.unwritten.popleft(), now])
            written += 1
        self.ack_read()
        return written

    def ack_read(self):
        """Ack the lines read; keep the unread ones leased."""
        upto = self.watch.read_upto()
        read = []
        while self.unread and self.unread[0][0] <= upto:
            read.append(self.unread.popleft()[1])
        if read:
            try:
                self.consumer.ack_many(read)
            except LeaseLost as e:
                render.note(f"fdq: warning: {one_line(e)}")
        if self.unread and time.monotonic() - self.unread[0][2] > self.consumer.config.ack_wait_s / 2:
            now = time.monotonic()
            try:
                self.consumer.settle([Settlement(u[1], Action.TOUCH) for u in self.unread])
            except LeaseLost as e:
                render.note(f"fdq: warning: {one_line(e)}")
            for u in self.unread:
                u[2] = now

    def drain(self):
        """Wait for the reader to read every line written, or to go away."""
        self.ack_read()
        while self.unread:
            check_interrupt()
            gone = self.watch.reader_gone(wait_s=0.05)
            self.ack_read()
            if gone:
                return

    def give_back(self) -> int:
        """Ack what was read, release the rest; returns how many were released."""
        rest = []
        if self.leasing:
            self.ack_read()
            rest = [u[1] for u in self.unread] + list(self.unwritten)
            self.unread.clear()
            self.unwritten.clear()
        if rest:
            try:
                self.consumer.settle([Settlement(m, Action.RELEASE) for m in rest])
            except LeaseLost as e:
                render.note(f"fdq: warning: {one_line(e)}")
        return len(rest)


class _Terminated(Exception):
    """SIGTERM arrived (``timeout``, systemd, docker stop): stop as on Ctrl-C."""


def _raise_terminated(_signum, _frame):
    raise _Terminated()


def _tail_error(e: BaseException):
    """The consumer's on_error (its own threads): one line on stderr; tail keeps going.
    ``ConsumerStalled``: no heartbeat reached the database, or no shard owned (others
    own them all), for over 3 heartbeats; reported again after a recovery."""
    what = "stalled" if isinstance(e, ConsumerStalled) else type(e).__name__
    render.note(f"fdq: warning: {what}: {one_line(e)}")


@cli.command()
@topic_argument
@click.option("--count", "-n", type=Int(min=1), default=None, metavar="N",
              help="Stop after N messages [default: follow until Ctrl-C].")
@click.option("--timeout", type=Seconds(), default=None, metavar="DURATION",
              help="Stop after this long without a message: 5 (seconds), 1m30s, 500ms.")
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
    A stalled consumer (database unreachable, or no shard owned while some shard has
    no live owner, for over 3 heartbeats) is reported by one line on stderr; tail keeps
    going. With more consumers than shards, tail may own none (standby): it waits,
    and takes a shard when one frees. A topic or
    subscription deleted under it ends it (exit 1).

    A subscription with ack policy none is done with a message when tail
    fetches it, in batches (a failed write loses the rest of its batch).

    At-least-once, a message is acked once its line has been read: on a pipe,
    once the reader has read past its newline (Linux; elsewhere once written);
    to a file or a terminal, once written. If the reader goes away (fdq tail t
    | head -1), tail stops at once and exits 141 without a message: the lines
    read are acked, the rest (written but unread, or not yet written) go back
    to the subscription at once, no delivery attempt counted. With --count N it
    never leases more than N, and ends when the reader has read them. At-most-
    once loses the one message whose line could not be written.
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
                        extend_support=config.extend, desired_tag=tag,
                        batch_size=TAIL_BATCH if count is None else min(TAIL_BATCH, count),
                        on_error=on_error)
    watch = StdoutWatch(sys.stdout)
    out = TailOutput(consumer, watch, mode == "at-most-once", as_json)
    got = 0
    state.interrupted = lambda: f"tail stopped after {got:,} messages"
    try:                    # SIGTERM leaves as Ctrl-C does: shards and leases given back now
        previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:      # not the main thread: leave SIGTERM alone
        previous_sigterm = None
    try:
        last = time.monotonic()
        while count is None or got < count:
            check_interrupt()
            if gone:
                raise Failure(one_line(gone[0]))
            if watch.reader_gone():
                raise BrokenPipeError()         # exit 141, as a failed write
            # a watched stdout: look at the reader at least 5 times a second
            wait = 0.2 if watch.watched else 1.0
            if timeout is not None:
                wait = min(wait, max(0.0, last + timeout - time.monotonic()))
            want = TAIL_BATCH if count is None else min(TAIL_BATCH, count - got)
            msgs = consumer.fetch(want, timeout=wait)
            out.ack_read()
            if not msgs:
                if timeout is not None and time.monotonic() - last >= timeout:
                    break
                continue
            got += out.emit(msgs)
            last = time.monotonic()
        out.drain()
        if out.unread:
            raise BrokenPipeError()             # the reader went before reading every line
    except _Terminated:
        raise click.exceptions.Exit(128 + signal.SIGTERM) from None
    finally:
        after_interrupt()
        if previous_sigterm is not None:     # a second SIGTERM while giving back: no traceback
            signal.signal(signal.SIGTERM, previous_sigterm)
        try:
            out.give_back()
        except FDQError as e:
            _tail_error(e)
        consumer.close()
