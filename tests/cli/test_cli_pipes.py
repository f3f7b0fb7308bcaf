"""``fdq tail X | head -1``: a reader that reads one line and closes the pipe. tail stops
at once (exit 141, nothing on stderr), acks only what the reader read, hands the rest
back without counting an attempt, and never leases more than ``--count``."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fdq

FDQ = Path(sys.executable).parent / "fdq"

# Reads its stdin unbuffered, one byte at a time, to the first newline; prints that line
# and closes stdin (a buffered readline() would drain the pipe).
READER = """
import os, sys
line = b""
while not line.endswith(b"\\n"):
    b = os.read(0, 1)
    if not b:
        break
    line += b
os.close(0)
sys.stdout.buffer.write(line)
"""


def _env(url):
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME")}
    env["FDQ_URL"] = url
    return env


def _tail_into_one_line_reader(url, argv, timeout=60):
    """Run ``fdq tail *argv | READER``; returns (tail's exit code, its stderr, the line
    read, seconds from the reader's exit to tail's)."""
    tail = subprocess.Popen([str(FDQ), "tail", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env(url))
    try:
        reader = subprocess.Popen([sys.executable, "-c", READER], stdin=tail.stdout, stdout=subprocess.PIPE)
        tail.stdout.close()             # the reader holds the only read end
        line, _ = reader.communicate(timeout=timeout)
        read_at = time.monotonic()
        _out, err = tail.communicate(timeout=timeout)
        return tail.returncode, err, line, time.monotonic() - read_at
    finally:
        for p in (tail,):
            if p.poll() is None:
                p.kill()
                p.wait()


def _sub(sup, topic):
    return sup.stats(topic)["subscriptions"]["default"]


def _rest(db, topic, n):
    """Every message left, fetched and acked: [(body, attempts)]."""
    out = []
    with fdq.Consumer(db, topic, create=False) as c:
        while len(out) < n:
            got = c.fetch(n, timeout=10)
            assert got, f"{len(out)} of {n} delivered"
            c.ack_many(got)
            out += [(m.body, m.attempts) for m in got]
    return out


@pytest.mark.parametrize("n, shards", [(5, 1), (5, 16), (300, 1), (300, 16)])
def test_tail_into_a_reader_of_one_line_acks_that_line_and_hands_the_rest_back(url, db, sup, n, shards):
    """Before: 5 messages hung tail (killed) with 5 of 5 acked; 300 acked a whole
    batch of 100 for one line read."""
    sup.create_topic("orders", shards=shards)
    fdq.Producer(db).push_many("orders", [fdq.Envelope(f"m{i}".encode()) for i in range(n)])
    code, err, line, after = _tail_into_one_line_reader(url, ["orders"])
    assert (code, err) == (141, b""), err
    assert after < 5, f"tail went on {after:.1f} s after its reader closed"
    read = line.split()[-1]
    s = _sub(sup, "orders")
    assert (s["acked"], s["backlog"], s["in_flight"]) == (1, n - 1, 0), s
    assert sup.consumers("orders") == []
    rest = _rest(db, "orders", n - 1)
    assert sorted(b for b, _a in rest) == sorted(f"m{i}".encode() for i in range(n) if f"m{i}".encode() != read)
    assert all(a == 1 for _b, a in rest), "a handed-back message counted a delivery attempt"


def test_a_following_tail_with_nothing_new_stops_when_its_reader_closes(url, db, sup):
    """Nothing to write: tail learnt of the closed pipe only from a write, so it hung."""
    fdq.Producer(db).push("orders", b"only")
    code, err, line, after = _tail_into_one_line_reader(url, ["orders"])
    assert (code, err, line.split()[-1]) == (141, b"", b"only")
    assert after < 5, f"tail went on {after:.1f} s after its reader closed"
    assert (_sub(sup, "orders")["acked"], _sub(sup, "orders")["in_flight"]) == (1, 0)


def test_tail_count_never_leases_more_than_count(url, db, sup):
    sup.create_topic("orders", shards=1)
    fdq.Producer(db).push_many("orders", [fdq.Envelope(f"m{i}".encode()) for i in range(1000)])
    code, err, line, _after = _tail_into_one_line_reader(url, ["orders", "--count", "1"])
    assert (code, err, line) == (0, b"", line) and line.split()[-1] == b"m0", err
    s = _sub(sup, "orders")
    assert (s["emitted"], s["acked"], s["backlog"], s["in_flight"]) == (1, 1, 999, 0), s
    code, err, _line, _after = _tail_into_one_line_reader(url, ["orders", "--count", "3"])
    assert (code, err) == (141, b"")            # the reader left 2 of the 3 unread
    s = _sub(sup, "orders")
    assert (s["emitted"], s["acked"], s["backlog"], s["in_flight"]) == (4, 2, 998, 0), s
