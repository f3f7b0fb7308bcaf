"""``fdq`` as a process on a pipe: what a shell pipeline does to it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fdq
from fdqtest import kill_all, readline_within, wait_for

FDQ = Path(sys.executable).parent / "fdq"


def _env(url):
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME")}
    env["FDQ_URL"] = url
    return env


def test_push_stdin_pushes_lines_while_the_writer_is_still_open(url, sup):
    """``tail -f app.log | fdq push logs -``: each line is pushed once it is read, not
    held back until 500 lines or end of input (where an interrupt would lose them)."""
    p = subprocess.Popen([str(FDQ), "push", "logs", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=_env(url))
    try:
        p.stdin.write(b"first\nsecond\n")
        p.stdin.flush()

        def inserted():
            try:
                return sup.stats("logs")["counters"]["inserted"]
            except fdq.TopicNotFound:
                return 0
        wait_for(lambda: inserted() == 2, timeout=30, what="the two lines pushed while stdin is open")
        # no newline: the last line at end of input
        out, err = p.communicate(input=b"third", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    ids = out.decode().split()
    assert len(ids) == len(set(ids)) == 3
    assert sup.stats("logs")["counters"]["inserted"] == 3
    with fdq.Consumer(sup.db, "logs", create=False) as c:
        got = c.fetch(10, timeout=5)
        c.ack_many(got)
    assert sorted(m.body for m in got) == [b"first", b"second", b"third"]


def test_tail_stopped_by_sigterm_leaves_at_once(url, db, sup):
    """``timeout 60 fdq tail``, systemd or docker stop send SIGTERM: tail leaves the
    subscription as on Ctrl-C (its shards free and its unacked leases returned now,
    not after the zombie timeout and the ack wait)."""
    import signal
    fdq.Producer(db).push("orders", b"before")
    p, line = _tail_consuming(url, sup)
    try:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert (line.decode().split()[-1], out) == ("before", b"")
    assert b"Traceback" not in err
    assert sup.consumers("orders") == []                         # left: no zombie to wait for
    assert sup.stats("orders")["subscriptions"]["default"]["in_flight"] == 0


def _tail_consuming(url, sup):
    """``fdq tail orders`` in its own process, once it acked the message pushed before
    (acked once its line is read: this reads it). Returns the process and that line."""
    p = subprocess.Popen([str(FDQ), "tail", "orders"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_env(url))
    try:
        line = readline_within(p, timeout=30, what="the line of the message pushed before")
        wait_for(lambda: sup.stats("orders")["subscriptions"]["default"]["acked"] == 1
                 and sup.consumers("orders"), timeout=30, what="tail consuming")
    except BaseException:
        kill_all([p])
        raise
    return p, line


def test_push_with_stdin_closed_is_one_line(url):
    """``fdq push t - <&-`` (a daemon without stdin): exit 1, one line, no traceback."""
    r = subprocess.run([str(FDQ), "push", "orders", "-"], preexec_fn=lambda: os.close(0),
                       capture_output=True, env=_env(url), timeout=60)
    assert (r.returncode, r.stdout) == (1, b""), r.stderr
    assert r.stderr == b"fdq: error: stdin is closed: give DATA, or lines on stdin\n"


def test_table_with_stdout_closed_is_no_traceback(url, db):
    """``fdq topics >&-``: the table goes nowhere, as click.echo's output does."""
    fdq.Producer(db).push("orders", b"x")
    r = subprocess.run([str(FDQ), "topics"], preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE,
                       env=_env(url), timeout=60)
    assert (r.returncode, r.stderr) == (0, b"")


def test_tail_ends_when_its_topic_is_deleted(url, db, sup):
    """A tail whose topic is deleted under it stops with one line naming the problem
    (exit 1), as a tail of an unknown topic does, instead of warning forever."""
    fdq.Producer(db).push("orders", b"before")
    p, line = _tail_consuming(url, sup)
    try:
        sup.delete_topic("orders")
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1, err
    assert (line.decode().split()[-1], out) == ("before", b"")
    assert err.decode().splitlines()[-1] == "fdq: error: topic 'orders' does not exist"
    assert b"Traceback" not in err
