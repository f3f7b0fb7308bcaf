"""``fdq`` as a process: Ctrl-C (SIGINT) and a reader that goes away (``| head -1``).

Ctrl-C: every command exits 130 with one line ``fdq: interrupted: ...`` on stderr and
no traceback, and what it was doing can be finished by running it again. A closed
stdout: exit 141 (what a shell reports for ``seq`` killed by SIGPIPE), nothing on
stderr, and tail acks only what it wrote."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fdq
from fdqtest import readable, wait_for

FDQ = Path(sys.executable).parent / "fdq"


def _env(url):
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME")}
    env["FDQ_URL"] = url
    return env


def _finish(p, timeout=60):
    """(stdout, stderr) of ``p`` once it exits; killed (and the test failed) past ``timeout``."""
    try:
        return p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _interrupted_line(err: bytes) -> str:
    text = err.decode()
    assert "Traceback" not in text and "Aborted" not in text, text
    lines = [line for line in text.splitlines() if line.startswith("fdq: interrupted")]
    assert len(lines) == 1 and text.splitlines()[-1] == lines[0], text
    return lines[0]


def _read_lines(p, n: int, timeout: float) -> list:
    """The first ``n`` lines of ``p``'s stdout (unbuffered reads: what is not read stays
    in the pipe); fails the test past ``timeout`` seconds."""
    fd, buf = p.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while buf.count(b"\n") < n:
        if not readable(fd, deadline - time.monotonic()):
            raise AssertionError(f"{len(buf.splitlines())} of {n} lines from pid {p.pid} within {timeout} s")
        chunk = os.read(fd, 1 << 16)
        assert chunk, f"pid {p.pid} closed its stdout after {buf!r}"
        buf += chunk
    return buf.splitlines()


def _closed_pipe():
    """A pipe whose reader is already gone: every write to the other end fails (EPIPE)."""
    r, w = os.pipe()
    os.close(r)
    return w


def test_ctrl_c_mid_replay_exits_130_and_a_rerun_resumes(url, db, sup):
    n = 30_000
    p = fdq.Producer(db)
    for i in range(0, n, 1000):
        p.push_many("big", [fdq.Envelope(f"m{j}".encode()) for j in range(i, i + 1000)])
    argv = [str(FDQ), "replay", "big", "--start", "1000000000000ms", "--json"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(url))
    try:
        # the first chunks are pushed again: the replay is under way
        wait_for(lambda: sup.stats("big")["counters"]["inserted"] > n or proc.poll() is not None,
                 timeout=60, what="the replay's first chunk")
        assert proc.poll() is None, "the replay finished before it could be interrupted: make the log larger"
        proc.send_signal(signal.SIGINT)
    finally:
        out, err = _finish(proc)
    assert proc.returncode == 130, err
    assert out == b""
    line = _interrupted_line(err)
    assert line.startswith("fdq: interrupted: replayed ") and "run the same command again to resume" in line, line
    done = int(line.split()[3].replace(",", ""))
    inserted = sup.stats("big")["counters"]["inserted"]
    assert 0 < done == inserted - n < n            # what it says it replayed is what it pushed
    # the same command again takes the interrupted run over and replays the rest once
    rerun = subprocess.run(argv, capture_output=True, env=_env(url), timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout)["replayed"] == n - done
    assert sup.stats("big")["counters"]["inserted"] == 2 * n
    with fdq.Consumer(db, "big", create=False) as c:
        replayed, delivered = [], 0
        while delivered < 2 * n:
            got = c.fetch(1000, timeout=10)
            assert got, f"{delivered} of {2 * n} delivered"
            c.ack_many(got)
            delivered += len(got)
            replayed += [m.replay_of for m in got if m.replay_of is not None]
    assert len(replayed) == len(set(replayed)) == n      # each original replayed exactly once


# fdq replay with render.progress patched: after the first chunk an object is dropped
# whose __del__ sends SIGINT and spins until it is delivered, so the KeyboardInterrupt is
# raised inside the finalizer, where Python prints "Exception ignored" and drops it (as
# a Ctrl-C landing in a transaction's __del__ on a loaded machine).
SWALLOWED_SIGINT = """
import contextlib, os, signal, sys, time
from fdq.cli import main, render

real = render.progress
dropped = []


class SignalInFinalizer:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:      # the handler raises here, in the finalizer
            pass


@contextlib.contextmanager
def progress(label, total=None):
    with real(label, total) as advance:
        def patched(n):
            advance(n)
            if not dropped:
                dropped.append(1)
                SignalInFinalizer()             # dropped at once: __del__ runs now
        yield patched


render.progress = progress
main(sys.argv[1:])
"""


def test_an_interrupt_swallowed_by_a_finalizer_stops_the_replay(url, db, sup):
    """Before: the replay ran to its end and exited 0 (the interrupt was printed as
    "Exception ignored in: ... KeyboardInterrupt" and lost)."""
    n = 2000
    fdq.Producer(db).push_many("big", [fdq.Envelope(f"m{i}".encode()) for i in range(n)])
    r = subprocess.run([sys.executable, "-c", SWALLOWED_SIGINT, "replay", "big", "--start", "1000000000000ms",
                        "--json"], capture_output=True, env=_env(url), timeout=120)
    assert r.returncode == 130, r.stderr
    assert r.stdout == b""
    line = _interrupted_line(r.stderr)
    assert line.startswith("fdq: interrupted: replayed "), line
    assert b"Exception ignored" not in r.stderr
    done = int(line.split()[3].replace(",", ""))
    assert 0 < done == sup.stats("big")["counters"]["inserted"] - n < n


def test_ctrl_c_in_tail_and_push_is_one_line_and_exit_130(url, db, sup):
    fdq.Producer(db).push("orders", b"one")
    tail = subprocess.Popen([str(FDQ), "tail", "orders"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env(url))
    push = subprocess.Popen([str(FDQ), "push", "orders", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(url))
    try:
        push.stdin.write(b"two\n")
        push.stdin.flush()              # stdin stays open: push waits for more lines
        # tail acks a line once it is read
        lines = _read_lines(tail, 2, timeout=60)
        wait_for(lambda: sup.stats("orders")["subscriptions"]["default"]["acked"] == 2,
                 timeout=60, what="tail printing and acking both messages")
        tail.send_signal(signal.SIGINT)
        push.send_signal(signal.SIGINT)
    finally:
        tail_out, tail_err = _finish(tail)
        push_out, push_err = _finish(push)
    assert (tail.returncode, push.returncode) == (130, 130), (tail_err, push_err)
    assert _interrupted_line(tail_err) == "fdq: interrupted: tail stopped after 2 messages"
    # unkeyed: each may be on its own shard, so either order
    assert tail_out == b""
    assert sorted(line.decode().split()[-1] for line in lines) == ["one", "two"]
    assert _interrupted_line(push_err) == "fdq: interrupted: pushed 1 messages to 'orders' (ids printed)"
    assert len(push_out.split()) == 1
    assert sup.consumers("orders") == []                       # tail left the subscription


def test_ctrl_c_stops_the_broker_with_exit_130(tmp_path, url):
    proc = subprocess.Popen([str(FDQ), "broker", "--tcp-address", "127.0.0.1:0", "--http-address", ""],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(url), cwd=tmp_path)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                line = lines.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("no ready line from fdq broker within 60 s") from None
            if line.startswith(b"fdq broker: listening "):
                break
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rest = b""
    while not lines.empty():
        rest += lines.get()
    assert proc.returncode == 130, rest
    assert _interrupted_line(rest) == "fdq: interrupted: broker stopped"


def test_a_closed_stdout_exits_141_silently(url, db):
    fdq.Producer(db).push("orders", b"x")
    for argv in (["topics", "--json"], ["topics"], ["stats", "orders"], ["push", "orders", "y"]):
        w = _closed_pipe()
        try:
            r = subprocess.run([str(FDQ), *argv], stdout=w, stderr=subprocess.PIPE, env=_env(url), timeout=60)
        finally:
            os.close(w)
        assert (r.returncode, r.stderr) == (141, b""), (argv, r.stderr)


def _sub(sup, topic):
    return sup.stats(topic)["subscriptions"]["default"]


def test_tail_into_a_closed_pipe_acks_only_what_it_wrote(url, db, sup):
    """A reader gone before tail starts: tail sees it before leasing anything (either
    mode: at-most-once used to lose the message whose line failed)."""
    fdq.Producer(db).push_many("orders", [fdq.Envelope(f"m{i}".encode()) for i in range(5)])
    for mode, acked in (("at-least-once", 0), ("at-most-once", 0)):
        w = _closed_pipe()
        try:
            r = subprocess.run([str(FDQ), "tail", "orders", "--count", "5", "--mode", mode], stdout=w,
                               stderr=subprocess.PIPE, env=_env(url), timeout=60)
        finally:
            os.close(w)
        assert (r.returncode, r.stderr) == (141, b""), (mode, r.stderr)
        s = _sub(sup, "orders")
        assert (s["acked"], s["backlog"], s["in_flight"]) == (acked, 5 - acked, 0), (mode, s)
        assert sup.consumers("orders") == []


def test_tail_piped_to_head_acks_what_it_wrote(url, db, sup):
    """``fdq tail t --count 1000 | head -1`` under ``set -o pipefail``: tail exits 141,
    says nothing; every message is either acked (written to the pipe, the line head
    printed among them) or back in the backlog, none left leased."""
    n = 1000
    sup.create_topic("orders", shards=1)           # one shard: delivered in push order
    fdq.Producer(db).push_many("orders", [fdq.Envelope(f"{i:04d}".encode() + b"." * 300) for i in range(n)])
    r = subprocess.run(["bash", "-c", f'set -o pipefail; "{FDQ}" tail orders --count {n} --json | head -1'],
                       capture_output=True, env=_env(url), timeout=120)
    assert (r.returncode, r.stderr) == (141, b""), r.stderr    # 300 kB: more than a pipe holds
    [line] = r.stdout.decode().splitlines()
    assert json.loads(line)["body"].startswith("0000")
    s = _sub(sup, "orders")
    assert s["in_flight"] == 0 and 1 <= s["acked"] < n and s["acked"] + s["backlog"] == n, s
    rest = []
    with fdq.Consumer(db, "orders", create=False) as c:
        while len(rest) < s["backlog"]:
            got = c.fetch(n, timeout=10)
            assert got, f"{len(rest)} of {s['backlog']} delivered"
            c.ack_many(got)
            rest += got
    # the acked ones are the first lines, in order; the rest come next
    assert [m.body[:4] for m in rest] == [f"{i:04d}".encode() for i in range(s["acked"], n)]
