"""Output: rows to a rich table (people) or JSON (scripts) on stdout; messages and
progress on stderr. A progress bar (rich) when stderr is a terminal, plain lines else."""
from __future__ import annotations

import contextlib
import datetime
import json
import sys
import time

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .app import check_interrupt

PLAIN_EVERY_S = 2.0


class _Console(Console):
    """rich's Console, but a closed pipe raises BrokenPipeError (rich exits 1 by itself):
    the command line handles it, as for any other write (exit 141, no message)."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError()


def _stdout_console() -> Console:
    # Tables piped to a file or a pager keep their columns instead of 80-column wrapping.
    out = sys.stdout
    return _Console(file=out, width=None if out.isatty() else 160, soft_wrap=False)


def emit_json(obj):
    """One JSON document on stdout."""
    click.echo(json.dumps(obj, indent=2, ensure_ascii=False))


def emit_json_line(obj):
    """One JSON object per line (streams: ``push``, ``tail``)."""
    click.echo(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


def note(message: str):
    """A message for people, on stderr."""
    click.echo(message, err=True)


def rows_or_note(rows: list, columns: list, empty: str, as_json: bool):
    """A listing: ``rows`` as one JSON document (``--json``, ``[]`` when empty), else a
    table, or the note ``empty`` on stderr when there are none."""
    if as_json:
        emit_json(rows)
    elif not rows:
        note(empty)
    else:
        table(None, columns, rows)


def table(title: str | None, columns: list, rows: list):
    """``columns``: [(header, function of row -> text)]. Numbers are right-aligned."""
    if sys.stdout is None:              # started with descriptor 1 closed: as click.echo does
        return
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    cells = [[f(row) for _h, f in columns] for row in rows]
    for i, (header, _f) in enumerate(columns):
        numeric = bool(cells) and all(isinstance(c[i], (int, float)) and not isinstance(c[i], bool)
                                      for c in cells)
        t.add_column(header, overflow="fold", justify="right" if numeric else "left")
    for c in cells:     # Text, not str: a cell is data, never rich markup ("[/]" in a body)
        t.add_row(*[Text(_text(v)) for v in c])
    _stdout_console().print(t)


def _text(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def duration_ms(ms) -> str:
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms} ms"
    s = ms / 1000
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def time_ms(ms) -> str:
    if ms is None:
        return "-"
    t = datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def shard_list(shards: list) -> str:
    """[{"tag", "shard"}] -> "0-3,7 gpu:0-1" (runs of shard numbers per tag)."""
    by_tag = {}
    for s in shards:
        by_tag.setdefault(s["tag"] or "", []).append(s["shard"])
    parts = []
    for tag in sorted(by_tag):
        ns = sorted(by_tag[tag])
        runs, start = [], ns[0]
        for a, b in zip(ns, ns[1:] + [None]):
            if b != a + 1:
                runs.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        parts.append((f"{tag}:" if tag else "") + ",".join(runs))
    return " ".join(parts) or "-"


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


@contextlib.contextmanager
def progress(label: str, total: int | None = None):
    """Yield ``advance(n)``. A rich bar on a terminal's stderr; else a plain line every
    few seconds. Either way the caller prints its own summary afterwards. ``advance``
    and the end of the block raise KeyboardInterrupt for a Ctrl-C a finalizer swallowed
    (``app.check_interrupt``): the work stops at the next chunk, as on any Ctrl-C."""
    err = sys.stderr
    check_interrupt()
    if stderr_is_terminal():
        # Imported here, not at the top: ~60 ms of import that only a bar on a terminal
        # needs (every command would pay it at start).
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                                   TextColumn, TimeElapsedColumn)
        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=_Console(file=err, force_terminal=True), transient=True) as bar:
            task = bar.add_task(label, total=total)

            def advance_bar(n):
                bar.advance(task, n)
                check_interrupt()
            yield advance_bar
        check_interrupt()
        return
    state = {"done": 0, "last": time.monotonic()}

    def advance(n):
        state["done"] += n
        now = time.monotonic()
        if now - state["last"] >= PLAIN_EVERY_S:
            state["last"] = now
            of = f"/{total:,}" if total else ""
            click.echo(f"{label}: {state['done']:,}{of}", err=True)
        check_interrupt()
    yield advance
    check_interrupt()       # before the command's success line


__all__ = ["emit_json", "emit_json_line", "note", "table", "duration_ms", "time_ms", "shard_list",
           "progress"]
