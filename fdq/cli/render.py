"""Output: rows on stdout in the format asked for (``--format``, ``params.format_option``):
``table`` (rich, for a terminal: columns never wrap inside a word; at a narrow width the
low-priority columns go, a footer says which), ``plain`` (space-aligned text, no box or
colour, nothing truncated: the default when stdout is not a terminal), ``tsv`` (a header
row, then one line per row; tab, newline, carriage return and backslash escaped as
``\\t \\n \\r \\\\``) or ``json`` (the rows as they are). Messages and progress go to
stderr. A progress bar (rich) when stderr is a terminal, plain lines else. Every command
renders here; which columns matter most is ``rows.COLUMN_PRIORITY``."""
from __future__ import annotations

import contextlib
import datetime
import json
import sys
import textwrap
import time

import click
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .app import check_interrupt
from .params import FORMAT_KEY
from .rows import COLUMN_PRIORITY, FREE_TEXT_COLUMNS

PLAIN_EVERY_S = 2.0
# rich's table with show_edge=False, pad_edge=False: a padding, a line, a padding.
COLUMN_GAP = 3
PLAIN_GAP = "  "
# A free-text column (a body, a reason) keeps at least this many characters in a table.
FREE_TEXT_MIN = 12


class _Console(Console):
    """rich's Console, but a closed pipe raises BrokenPipeError (rich exits 1 by itself):
    the command line handles it, as for any other write (exit 141, no message)."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError()


def output_format() -> str:
    """The current command's ``--format``; by default ``table`` when stdout is a
    terminal, else ``plain``."""
    ctx = click.get_current_context(silent=True)
    chosen = ctx.meta.get(FORMAT_KEY) if ctx is not None else None
    if chosen is not None:
        return chosen
    out = sys.stdout
    return "table" if out is not None and out.isatty() else "plain"


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
    """A listing: ``rows`` as one JSON document (``--json``, ``[]`` when empty), else
    ``table``; when there are none, the note ``empty`` on stderr (and, as tsv, the header
    row alone)."""
    if as_json or output_format() == "json":
        emit_json(rows)
        return
    if not rows:
        note(empty)
        if output_format() != "tsv":
            return
    table(None, columns, rows)


def table(title: str | None, columns: list, rows: list):
    """``columns``: [(header, function of row -> value)] shown in the current
    ``output_format()``; a command showing several tables calls this once for each
    (separated by a blank line; a title is a line of its own, ``# title`` as tsv)."""
    if sys.stdout is None:              # started with descriptor 1 closed: as click.echo does
        return
    headers = [h for h, _f in columns]
    values = [[f(row) for _h, f in columns] for row in rows]
    fmt = output_format()
    ctx = click.get_current_context(silent=True)
    if ctx is not None:                 # a blank line between the tables of one command
        if ctx.meta.get("fdq.tables_shown"):
            click.echo("")
        ctx.meta["fdq.tables_shown"] = True
    if fmt == "json":
        emit_json([dict(zip(headers, v)) for v in values])
    elif fmt == "tsv":
        if title:
            click.echo(f"# {_tsv(title)}")
        for line in [headers, *values]:
            click.echo("\t".join(_tsv(v) for v in line))
    else:
        numeric = [all(v[i] is None or _is_number(v[i]) for v in values) and any(_is_number(v[i]) for v in values)
                   for i in range(len(columns))]
        cells = [[_text(v) for v in row] for row in values]
        if fmt == "plain":
            _plain(title, headers, cells, numeric)
        else:
            _rich_table(title, headers, cells, numeric)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7f, 0xa0)]} | {
    0x09: "\\t", 0x0a: "\\n", 0x0d: "\\r"}


def _text(v) -> str:
    """A value as people read it, on one line (control characters escaped)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v).translate(_CONTROL_ESCAPES)


_TSV_ESCAPES = {0x5c: "\\\\", 0x09: "\\t", 0x0a: "\\n", 0x0d: "\\r"}


def _tsv(v) -> str:
    """A value as a tsv field: None empty, booleans true/false, numbers as Python
    writes them (no separators), text with tab, newline, CR and backslash escaped."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v).translate(_TSV_ESCAPES)


def _plain(title, headers, cells, numeric):
    """Columns aligned with spaces (numbers to the right); every cell whole, whatever
    the width; no trailing padding."""
    widths = [max(cell_len(c) for c in col) for col in zip(headers, *cells)]
    if title:
        click.echo(title)
    for row in [headers, *cells]:
        parts = []
        for i, c in enumerate(row):
            pad = " " * (widths[i] - cell_len(c))
            if numeric[i] and row is not headers:
                parts.append(pad + c)
            else:
                parts.append(c if i == len(row) - 1 else c + pad)
        click.echo(PLAIN_GAP.join(parts))


def _layout(headers, cells, width) -> tuple:
    """Which columns a table ``width`` cells wide shows, and how: (kept column indexes,
    their widths, whether headers wrap at their spaces). No cell or header word is ever
    split: headers wrap at spaces first, free-text columns shrink (ellipsized) to
    ``FREE_TEXT_MIN``, then columns go, the lowest priority (``rows.COLUMN_PRIORITY``;
    the rightmost of equals) first, the first column never."""
    kept = list(range(len(headers)))
    data_w = [max((cell_len(c[i]) for c in cells), default=0) for i in range(len(headers))]

    def widths(wrap, squeeze):
        out = []
        for i in kept:
            head = max(map(cell_len, headers[i].split()), default=0) if wrap else cell_len(headers[i])
            w = max(head, data_w[i])
            if squeeze and headers[i] in FREE_TEXT_COLUMNS:
                w = max(head, min(w, FREE_TEXT_MIN))
            out.append(w)
        return out

    while True:
        for wrap, squeeze in ((False, False), (True, False), (True, True)):
            ws = widths(wrap, squeeze)
            total = sum(ws) + COLUMN_GAP * (len(ws) - 1)
            if total <= width:
                if squeeze:             # the room left goes to the free-text columns, in order
                    room = width - total
                    for j, i in enumerate(kept):
                        if headers[i] in FREE_TEXT_COLUMNS:
                            grow = min(room, data_w[i] - ws[j])
                            if grow > 0:
                                ws[j] += grow
                                room -= grow
                return kept, ws, wrap
        droppable = [i for i in kept[1:]]
        if not droppable:
            return kept, ws, True       # wider than the terminal: whole cells, lines too long
        kept.remove(max(droppable, key=lambda i: (COLUMN_PRIORITY.get(headers[i], 1), i)))


def _rich_table(title, headers, cells, numeric):
    console = _Console(file=sys.stdout, soft_wrap=False)
    kept, ws, wrap = _layout(headers, cells, console.width)
    if title:
        console.print(Text(title))
    t = Table(show_edge=False, pad_edge=False, expand=False)
    for i, w in zip(kept, ws):
        head = headers[i]
        if wrap and cell_len(head) > w:
            head = "\n".join(textwrap.wrap(head, w, break_long_words=False, break_on_hyphens=False))
        t.add_column(Text(head, style="bold"), width=w, no_wrap=True,
                     overflow="ellipsis" if headers[i] in FREE_TEXT_COLUMNS else "fold",
                     justify="right" if numeric[i] else "left")
    for row in cells:   # Text, not str: a cell is data, never rich markup ("[/]" in a body)
        t.add_row(*[Text(row[i]) for i in kept])
    console.print(t, width=max(console.width, sum(ws) + COLUMN_GAP * (len(ws) - 1)))
    hidden = [headers[i] for i in range(len(headers)) if i not in kept]
    if hidden:
        console.print(Text(f"(hidden at {console.width} columns: {', '.join(hidden)}; --format plain shows all)"))


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


__all__ = ["output_format", "emit_json", "emit_json_line", "note", "table", "rows_or_note", "duration_ms", "time_ms", "shard_list",
           "progress"]
