"""How listings look (``--format table|plain|tsv|json``): off a terminal plain text (no
box drawing, nothing cut); tsv and json parse back to the rows; on an 80-column
terminal every header word and every cell whole (columns dropped, and named in a footer,
rather than broken inside a word)."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

import fdq
from fdq.cli.rows import FREE_TEXT_COLUMNS
from fdqtest import FAST, FAST_STEADY, readable, wait_for

FDQ = Path(sys.executable).parent / "fdq"
BOX = re.compile(r"[┃━│╇┏┓┗┛─┡┩]")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TOPIC = "orders-from-the-eu-webshop"
SUBS = ["billing-and-invoicing", "warehouse-dispatch"]
# Cells that move between two runs of a command: compared by shape.
CLOCK_CELL = re.compile(r"-|[0-9.]+ (ms|s|min|h)( \(zombie\))?")
CLOCK_HEADERS = {"lag", "heartbeat age"}
# (argv after the command name, what --json gives as the table's rows)
LISTINGS = {
    "topics": (["topics"], lambda j: j),
    "consumers": (["consumers", TOPIC], lambda j: j),
    "subs": (["subs", "list", TOPIC], lambda j: j),
    "dlq": (["dlq", "list", TOPIC, "-s", SUBS[0]], lambda j: j),
}


@pytest.fixture
def busy_topic(db, run):
    """A topic with long names, two subscriptions with two live consumers each (long
    ids), a backlog and a dead letter whose body and reason hold a tab, newlines and a
    backslash."""
    run("topics", "create", TOPIC, "--shards", "8")
    for sub in SUBS:
        run("subs", "create", TOPIC, sub, "--description", "what this subscription is for, said at length " * 3)
    p = fdq.Producer(db)
    for i in range(30):
        p.push(TOPIC, f"message {i}".encode(), shard_key=f"customer-{i % 7}")
    dead = "tab\there, newline\nthere, a backslash \\ and more text to make it longer than eighty"
    p.push(TOPIC, dead.encode(), shard_key="customer-dead")
    with fdq.Consumer(db, TOPIC, subscription=SUBS[0], config=FAST) as c:
        def dead_letter():
            for m in c.fetch(100, timeout=0.2):
                m.term("handler failed:\tbad\ninput \\ here") if m.body == dead.encode() else m.release()
            return fdq.Supervisor(db).stats(TOPIC)["subscriptions"][SUBS[0]]["dlq"] == 1
        wait_for(dead_letter, what="a dead letter")
    consumers = [fdq.Consumer(db, TOPIC, subscription=sub, config=FAST_STEADY) for sub in SUBS for _ in (1, 2)]
    sup = fdq.Supervisor(db)

    def settled():
        subs = sup.stats(TOPIC)["subscriptions"]
        return all(len(subs[s]["consumers"]) == 2 and all(sh["owner"] for sh in subs[s]["shards"]) for s in SUBS)
    wait_for(settled, what="both consumers of each subscription owning shards")
    yield dead
    for c in consumers:
        c.close()


def _env(url):
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME", "COLUMNS", "LINES")}
    env.update(FDQ_URL=url, TERM="xterm-256color")
    return env


def in_terminal(url, argv, columns=80, timeout=60) -> str:
    """``fdq *argv`` with stdout on a pseudo-terminal ``columns`` wide: what it shows,
    colours stripped."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([FDQ, *argv], stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE,
                            env=_env(url))
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not readable(master, 0.5):
                if proc.poll() is not None and not readable(master, 0.1):
                    break
                continue
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:         # EIO: the terminal's other side is closed
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=max(1, deadline - time.monotonic())) == 0, proc.stderr.read()
    finally:
        os.close(master)
        proc.stderr.close()
    return ANSI.sub("", out.decode()).replace("\r\n", "\n")


def _blocks(text: str) -> list:
    """The tables of an output, each a list of lines (separated by blank lines)."""
    return [b.splitlines() for b in text.strip("\n").split("\n\n")]


def _plain_rows(lines) -> tuple:
    """A plain table (header line, rows) split into cells at runs of 2+ spaces."""
    cells = [re.split(r" {2,}", line.strip()) for line in lines]
    return cells[0], cells[1:]


def _terminal_table(lines) -> tuple:
    """An 80-column table: (title lines, headers (wrapped ones joined), rows, footer)."""
    rule = next(i for i, line in enumerate(lines) if "━" in line)
    head_start = rule - 1
    while head_start > 0 and "┃" in lines[head_start - 1]:
        head_start -= 1
    pieces = [[p.strip() for p in line.split("┃")] for line in lines[head_start:rule]]
    headers = [" ".join(w for w in col if w) for col in zip(*pieces)]
    body = lines[rule + 1:]
    footer = " ".join(line for line in body if "│" not in line and line.strip())
    rows = [[c.strip() for c in line.split("│")] for line in body if "│" in line]
    if len(headers) == 1:       # one column: no separators
        rows = [[line.strip()] for line in body if line.strip() and not line.startswith("(hidden")]
    return lines[:head_start], headers, rows, footer


def _check_whole(plain_lines, term_lines, columns=80):
    """Every header word and every cell of the terminal's table is the plain table's,
    whole, less the columns its footer names; no line is wider than the terminal."""
    headers, rows = _plain_rows(plain_lines)
    _title, t_headers, t_rows, footer = _terminal_table(term_lines)
    assert all(len(line) <= columns for line in term_lines), term_lines
    hidden = []
    if footer:
        m = re.fullmatch(rf"\(hidden at {columns} columns: (.*); --format plain shows all\)", " ".join(footer.split()))
        assert m, footer
        hidden = m[1].split(", ")
    assert t_headers == [h for h in headers if h not in hidden], (t_headers, headers, footer)
    assert len(t_rows) == len(rows), (t_rows, rows)
    kept = [i for i, h in enumerate(headers) if h not in hidden]
    for row, t_row in zip(rows, t_rows):
        for i, cell in zip(kept, t_row):
            if headers[i] in CLOCK_HEADERS:
                assert CLOCK_CELL.fullmatch(cell), cell
            elif headers[i] in FREE_TEXT_COLUMNS and cell.endswith("…"):
                assert row[i].startswith(cell[:-1]), (cell, row[i])
            else:
                assert cell == row[i], (headers[i], cell, row[i])
    return hidden


def test_at_80_columns_every_header_word_and_cell_is_whole(run, url, busy_topic):
    some_hidden = False
    for name, (argv, _rows) in LISTINGS.items():
        plain = run(*argv).stdout
        term = in_terminal(url, argv)
        assert BOX.search(term), term                       # a table, on a terminal
        some_hidden |= bool(_check_whole(plain.splitlines(), term.splitlines()))
    # stats: several tables, each after its title
    plain_blocks = _blocks(run("stats", TOPIC).stdout)
    term_blocks = _blocks(in_terminal(url, ["stats", TOPIC]))
    assert [b[0] for b in term_blocks] == [b[0] for b in plain_blocks]      # the titles
    assert [b[0] for b in plain_blocks][1:] == ["subscriptions", "consumers"]
    for p, t in zip(plain_blocks, term_blocks):
        some_hidden |= bool(_check_whole(p[1:], t))
    assert some_hidden, "the data is meant to be too wide for 80 columns"
    # wide enough, nothing is hidden
    term = in_terminal(url, ["consumers", TOPIC], columns=250)
    assert _check_whole(run("consumers", TOPIC).stdout.splitlines(), term.splitlines(), columns=250) == []


def test_off_a_terminal_the_output_is_plain_and_whole(run, busy_topic):
    """No box drawing in a file or a pipe, no colour, nothing cut (the dead letter's
    body and reason, the long descriptions), one line per row."""
    outputs = {name: run(*argv).stdout for name, (argv, _rows) in LISTINGS.items()}
    outputs["stats"] = run("stats", TOPIC).stdout
    outputs["subs show"] = run("subs", "show", TOPIC, SUBS[0]).stdout
    for name, out in outputs.items():
        assert out and not BOX.search(out) and "\x1b" not in out and "…" not in out, (name, out)
    dead = busy_topic
    assert dead.replace("\t", "\\t").replace("\n", "\\n") in outputs["dlq"]
    assert "handler failed:\\tbad\\ninput \\ here" in outputs["dlq"]
    assert ("what this subscription is for, said at length " * 3).strip() in outputs["subs show"]
    headers, rows = _plain_rows(outputs["consumers"].splitlines())
    assert headers[:2] == ["subscription", "consumer"] and len(rows) == 4
    assert all(len(r) == len(headers) for r in rows)
    # an explicit --format table off a terminal: rich's table
    assert BOX.search(run("topics", "--format", "table").stdout)


def _unescape_tsv(field: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"t": "\t", "n": "\n", "r": "\r", "\\": "\\"}[m[1]], field)


def _steady(rows):
    """Rows less what moves between two runs (heartbeats and the zombie flag judged from
    their age, a dead letter's age)."""
    return [{k: v for k, v in r.items() if not k.startswith("heartbeat") and k not in ("zombie", "dead_age_s")}
            for r in rows]


def test_tsv_and_json_parse_back_to_the_rows(run, busy_topic):
    dead = busy_topic
    for name, (argv, _rows) in LISTINGS.items():
        rows = run.json(*argv)
        assert _steady(json.loads(run(*argv, "--format", "json").stdout)) == _steady(rows)
        lines = run(*argv, "--format", "tsv").stdout.split("\n")
        assert lines[-1] == ""                              # every line ends with its newline
        table = [[_unescape_tsv(f) for f in line.split("\t")] for line in lines[:-1]]
        header, body = table[0], table[1:]
        assert len(body) == len(rows) and all(len(r) == len(header) for r in body), name
        by_header = [dict(zip(header, r)) for r in body]
        if name == "topics":
            assert [(r["topic"], int(r["inserted"]), int(r["backlog"]), r["extend"]) for r in by_header] == \
                [(r["name"], r["inserted"], r["backlog"], "true" if r["extend"] else "false") for r in rows]
        elif name == "consumers":
            assert [(r["subscription"], r["consumer"], r["host"], r["pid"]) for r in by_header] == \
                [(r["subscription"], r["id"], r["host"], str(r["pid"])) for r in rows]
        elif name == "subs":
            assert [(r["subscription"], int(r["backlog"]), int(r["dlq"])) for r in by_header] == \
                [(r["name"], r["backlog"], r["dlq"]) for r in rows]
        else:
            assert [(r["id"], r["reason"], r["body"], int(r["attempts"])) for r in by_header] == \
                [(r["id"], r["reason"], r["body"], r["attempts"]) for r in rows]
            assert by_header[0]["body"] == dead and "\t" in by_header[0]["reason"]
    run("topics", "create", "empty")
    r = run("consumers", "empty", "--format", "tsv")
    assert r.stdout.startswith("subscription\tconsumer\t") and r.stdout.count("\n") == 1
    assert "has no consumers" in r.stderr


def test_json_and_format_json_are_one_option(run, busy_topic):
    run.usage_error(["topics", "--json", "--format", "tsv"], "--json is --format json")
    run.usage_error(["topics", "--format", "yaml"], "Invalid value for '--format'")
    assert json.loads(run("stats", TOPIC, "--json", "--format", "json").stdout)["topic"] == TOPIC
