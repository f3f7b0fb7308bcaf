"""``fdq worker module:attr`` as a process: the handler module in the test's directory,
the installed ``fdq`` command. SIGTERM (or Ctrl-C) drains: every message is handled once
and acked, or handed back with its attempts unchanged; a handler stuck past the drain
timeout, or a second signal, ends it at once."""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fdq
from fdqtest import kill_all, sub_stats, wait_for

FDQ = Path(sys.executable).parent / "fdq"
N = 200

HANDLERS = '''
import asyncio, os, time
import fdq

OUT = os.environ["WORKER_OUT"]
STUCK = os.environ.get("WORKER_STUCK", "")


def _note(msg):
    with open(OUT, "a") as f:       # one short line per write: appended whole
        f.write(f"{msg.body.decode()} {msg.attempts}\\n")


@fdq.worker.handler(topic="orders", subscription="billing")
def handle(msg):
    if msg.body.decode() == STUCK:
        open(OUT + ".stuck", "w").close()
        time.sleep(120)             # a handler that does not return in time
    time.sleep(0.03)
    _note(msg)


@fdq.worker.handler(topic="orders", subscription="billing")
async def ahandle(msg):
    if msg.body.decode() == STUCK:
        open(OUT + ".stuck", "w").close()
        await asyncio.sleep(120)
    await asyncio.sleep(0.03)
    _note(msg)


@fdq.worker.handler(topic="orders", subscription="billing", mode="exactly-once")
def once(tr, msg):
    tr[b"worker-test/" + msg.id.encode()] = msg.body
    _note(msg)


def once_plain(tr, msg):
    once(tr, msg)


def bhandle(msgs):
    for m in msgs:
        _note(m)


def flaky(msg):
    if msg.body == b"m3" and msg.attempts == 1:
        raise ValueError("bad input m3")
    _note(msg)


not_callable = 3
'''


@pytest.fixture
def setup(tmp_path, url, db, sup):
    (tmp_path / "handlers.py").write_text(HANDLERS)
    sup.create_topic("orders", shards=4)
    sup.create_subscription("orders", "billing")
    fdq.Producer(db).push_many("orders", [fdq.Envelope(f"m{i}".encode()) for i in range(N)])
    return tmp_path


def _env(url, tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME")}
    env.update(FDQ_URL=url, WORKER_OUT=str(tmp_path / "out.txt"), **extra)
    return env


def _start(url, tmp_path, *argv, **extra):
    return subprocess.Popen([str(FDQ), "worker", *argv], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(url, tmp_path, **extra))


def _handled(tmp_path) -> list:
    """[(body, attempts)] the handler wrote, in order."""
    try:
        text = (tmp_path / "out.txt").read_text()
    except FileNotFoundError:
        return []
    return [(b.encode(), int(a)) for b, a in (line.split() for line in text.splitlines())]


def _finish(p, timeout):
    """(exit code, stderr, seconds it took) of ``p``; killed past ``timeout``."""
    start = time.monotonic()
    try:
        _out, err = p.communicate(timeout=timeout)
    finally:
        kill_all([p])
    return p.returncode, err.decode(), time.monotonic() - start


def _rest(db, n) -> dict:
    """{body: attempts} of the ``n`` messages left on billing, fetched and acked."""
    out = {}
    if n == 0:
        return out
    with fdq.Consumer(db, "orders", subscription="billing", create=False) as c:
        for m in c.messages(timeout=10):
            out[m.body] = m.attempts
            m.ack()
            if len(out) == n:
                break
    return out


def _check_each_handled_once_or_back_uncounted(db, sup, tmp_path):
    handled = _handled(tmp_path)
    counts = collections.Counter(b for b, _a in handled)
    assert not [b for b, k in counts.items() if k > 1], "handled twice"
    assert all(a == 1 for _b, a in handled)
    assert 0 < len(counts) < N, "the signal did not come mid-run"
    s = sub_stats(db, "orders", "billing")
    assert s["in_flight"] == 0 and s["consumers"] == [] and s["dlq"] == 0
    assert s["backlog"] == N - len(counts)
    rest = _rest(db, N - len(counts))
    assert set(rest) == {f"m{i}".encode() for i in range(N)} - set(counts)
    assert set(rest.values()) == {1}, "a message handed back had an attempt counted"


@pytest.mark.parametrize("handler", ["handle", "ahandle"])
def test_sigterm_mid_run_drains_and_exits_0(setup, url, db, sup, handler):
    """Each message handled once (acked) or handed back with its attempts unchanged."""
    p = _start(url, setup, f"handlers:{handler}", "--concurrency", "4", "--drain-timeout", "30s")
    try:
        wait_for(lambda: len(_handled(setup)) >= 20, 60, "20 messages handled")
        before = len(_handled(setup))
        p.send_signal(signal.SIGTERM)
        code, err, took = _finish(p, 60)
    finally:
        kill_all([p])
    assert code == 0, err
    assert took < 30, err
    # the 4 running finish, no other starts (slack: the ones begun before the signal
    # landed, on a busy machine); not the rest of the batches in hand (~80)
    assert len(_handled(setup)) <= before + 20
    assert "Traceback" not in err and "draining" in err and "stopped after" in err, err
    _check_each_handled_once_or_back_uncounted(db, sup, setup)


def test_ctrl_c_mid_run_drains_and_exits_130(setup, url, db, sup):
    p = _start(url, setup, "handlers:handle", "-c", "2")
    try:
        wait_for(lambda: len(_handled(setup)) >= 10, 60, "10 messages handled")
        p.send_signal(signal.SIGINT)
        code, err, _took = _finish(p, 60)
    finally:
        kill_all([p])
    assert code == 130, err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("fdq: interrupted: worker stopped after"), err
    _check_each_handled_once_or_back_uncounted(db, sup, setup)


def test_at_most_once_drains_the_batches_it_took(setup, url, db, sup):
    """At most once a batch is gone from the queue once taken: the drain runs every
    message of it (none lost, none twice)."""
    p = _start(url, setup, "handlers:handle", "--mode", "at-most-once", "-c", "4")
    try:
        wait_for(lambda: len(_handled(setup)) >= 20, 60, "20 messages handled")
        p.send_signal(signal.SIGTERM)
        code, err, _took = _finish(p, 60)
    finally:
        kill_all([p])
    assert code == 0, err
    counts = collections.Counter(b for b, _a in _handled(setup))
    assert set(counts.values()) == {1}
    s = sub_stats(db, "orders", "billing")
    assert s["in_flight"] == 0 and s["backlog"] == N - len(counts)
    rest = _rest(db, N - len(counts))
    assert set(rest) | set(counts) == {f"m{i}".encode() for i in range(N)}


@pytest.mark.parametrize("handler", ["handle", "ahandle"])
def test_a_handler_stuck_past_the_drain_timeout_is_left_and_its_message_counted(setup, url, db, sup, handler):
    """m5's handler never returns: the worker still leaves within the drain timeout (not
    when the handler returns); m5 comes back as a failed attempt, the others as before,
    also those of its batch no handler began (an aio round waits for its slowest
    handler: their release, recorded in the round, never commits; the close gives them
    back uncounted)."""
    p = _start(url, setup, f"handlers:{handler}", "-c", "2", "--drain-timeout", "1s", WORKER_STUCK="m5")
    try:
        wait_for(lambda: (setup / "out.txt.stuck").exists(), 60, "the handler of m5 stuck")
        sent = time.monotonic()
        p.send_signal(signal.SIGTERM)
        code, err, _took = _finish(p, 60)
        took = time.monotonic() - sent
    finally:
        kill_all([p])
    assert code == 0, err
    assert took < 15, err       # 1 s of drain, then the goodbye; not the handler's 120 s
    assert "still running after the drain timeout" in err, err
    handled = {b for b, _a in _handled(setup)}
    assert b"m5" not in handled
    s = sub_stats(db, "orders", "billing")
    assert s["in_flight"] == 0 and s["backlog"] == N - len(handled)
    rest = _rest(db, N - len(handled))
    assert rest.pop(b"m5") == 2         # it was an attempt
    assert set(rest.values()) == {1}


def _second_signal(p, sig, after=None):
    """Send ``sig``, wait for the worker's "draining" line, then (``after()``: once it
    returns) send ``sig`` again; (exit code, stderr, seconds from the second signal)."""
    p.send_signal(sig)
    lines = []
    while not any("draining" in line for line in lines):
        line = p.stderr.readline().decode()
        assert line, lines
        lines.append(line)
    if after is not None:
        after()
    sent = time.monotonic()
    p.send_signal(sig)
    code, err, _took = _finish(p, 60)
    return code, "".join(lines) + err, time.monotonic() - sent


@pytest.mark.parametrize("sig, exit_code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_second_signal_stops_at_once(setup, url, db, sup, sig, exit_code):
    """The drain waits for m0's stuck handler (100 s): a second signal ends the process
    within seconds, its exit code the signal's, and every lease it held back before it
    exits: m0 as a failed attempt, the messages no handler began uncounted."""
    p = _start(url, setup, "handlers:handle", "--drain-timeout", "100s", WORKER_STUCK="m0")
    try:
        wait_for(lambda: (setup / "out.txt.stuck").exists(), 60, "the handler of m0 stuck")
        code, err, took = _second_signal(p, sig)
    finally:
        kill_all([p])
    assert code == exit_code, err
    assert took < 15, err
    assert "stopped at once" in err and "Traceback" not in err, err
    s = sub_stats(db, "orders", "billing")
    assert s["in_flight"] == 0 and s["consumers"] == [], s
    handled = {b for b, _a in _handled(setup)}
    rest = _rest(db, N - len(handled))
    assert rest.pop(b"m0") == 2         # its handler began: an attempt
    assert set(rest.values()) <= {1}


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.1, 0.3])
def test_a_second_signal_at_any_moment_of_a_drain_leaves_no_lease_held(setup, url, db, sup, delay):
    """No stuck handler: the drain is short, and the second signal lands somewhere in it
    (waiting for the handlers, leaving, or done): whichever, the process ends at once
    and holds no lease and no membership (it was: a close cut in the middle by the
    second signal's exit left the round's leases in flight until their ack wait)."""
    p = _start(url, setup, "handlers:handle", "-c", "2")
    try:
        wait_for(lambda: len(_handled(setup)) >= 5, 60, "5 messages handled")
        code, err, took = _second_signal(p, signal.SIGTERM, lambda: time.sleep(delay))
    finally:
        kill_all([p])
    # 0: the drain ended before the second signal; -15: after the command, its default action
    assert code in (0, 143, -signal.SIGTERM), err
    assert took < 15, err
    assert "Traceback" not in err, err
    s = sub_stats(db, "orders", "billing")
    assert s["in_flight"] == 0 and s["consumers"] == [], s


@pytest.mark.parametrize("argv", [["handlers:once"],       # the decorator's mode
                                  ["handlers:once_plain", "-t", "orders", "-s", "billing", "--exactly-once"]])
def test_an_exactly_once_handler_gets_the_transaction(setup, url, db, sup, argv):
    p = _start(url, setup, *argv, "--concurrency", "2")
    try:
        wait_for(lambda: len(_handled(setup)) >= N and sub_stats(db, "orders", "billing")["backlog"] == 0,
                 60, "every message handled")
        p.send_signal(signal.SIGTERM)
        code, err, _took = _finish(p, 60)
    finally:
        kill_all([p])
    assert code == 0, err
    assert "exactly-once" in err
    tr = db.create_transaction()
    stored = {bytes(kv.value) for kv in tr.get_range(b"worker-test/", b"worker-test0")}
    tr.cancel()
    assert stored == {f"m{i}".encode() for i in range(N)}


def test_batch_gives_the_handler_lists(setup, url, db, sup):
    p = _start(url, setup, "handlers:bhandle", "--topic", "orders", "-s", "billing", "--batch")
    try:
        wait_for(lambda: sub_stats(db, "orders", "billing")["acked"] == N, 60, "every message acked")
        p.send_signal(signal.SIGTERM)
        code, err, _took = _finish(p, 60)
    finally:
        kill_all([p])
    assert code == 0, err
    assert ", batches" in err and f"stopped after {N} deliveries handled" in err, err
    assert sorted(b for b, _a in _handled(setup)) == sorted(f"m{i}".encode() for i in range(N))


def test_a_failing_handler_is_logged_with_its_traceback_and_its_message_redelivered(setup, url, db, sup):
    p = _start(url, setup, "handlers:flaky", "-t", "orders", "-s", "billing", "-c", "4")
    try:
        wait_for(lambda: sub_stats(db, "orders", "billing")["acked"] == N, 60, "every message acked")
        p.send_signal(signal.SIGTERM)
        code, err, _took = _finish(p, 60)
    finally:
        kill_all([p])
    assert code == 0, err
    assert "handler failed on orders/billing message" in err and "ValueError: bad input m3" in err, err
    assert "Traceback" in err and f"stopped after {N + 1} deliveries handled" in err, err
    assert (b"m3", 2) in _handled(setup)


def test_options_override_the_decorators_defaults(setup, url, db, sup):
    """-s other: the handler's subscription is only a default."""
    sup.create_subscription("orders", "other")
    p = _start(url, setup, "handlers:handle", "-s", "other", "-c", "4")
    try:
        wait_for(lambda: sub_stats(db, "orders", "other")["backlog"] == 0, 60, "other drained")
        p.send_signal(signal.SIGTERM)
        code, err, _took = _finish(p, 60)
    finally:
        kill_all([p])
    assert code == 0, err
    assert sub_stats(db, "orders", "billing")["backlog"] == N


def test_exactly_once_contradicting_mode_is_a_usage_error(setup, url):
    r = subprocess.run([str(FDQ), "worker", "handlers:once", "--exactly-once", "--mode", "at-most-once"],
                       cwd=setup, capture_output=True, timeout=60, env=_env(url, setup))
    assert r.returncode == 2
    assert "Error: --exactly-once contradicts --mode at-most-once" in r.stderr.decode()


@pytest.mark.parametrize("spec, code, text", [
    ("nosuchmodule:handle", 1, "fdq: error: cannot import nosuchmodule: ModuleNotFoundError"),
    ("handlers:nope", 1, "fdq: error: cannot load handlers:nope: module handlers has no attribute 'nope'"),
    ("handlers:not_callable", 1, "fdq: error: handlers:not_callable is not callable (it is a int)"),
    ("handlers", 2, "Error: Invalid value for 'HANDLER': 'handlers' is not module:attr"),
])
def test_a_handler_that_cannot_be_loaded_is_one_line(setup, url, spec, code, text):
    r = subprocess.run([str(FDQ), "worker", spec], cwd=setup, capture_output=True, timeout=60,
                       env=_env(url, setup))
    err = r.stderr.decode()
    assert r.returncode == code, err
    assert text in err and "Traceback" not in err, err
    if code == 1:
        assert len(err.splitlines()) == 1, err


def test_a_module_that_raises_on_import_is_one_line(setup, url):
    (setup / "broken.py").write_text("raise RuntimeError('no config file')\n")
    r = subprocess.run([str(FDQ), "worker", "broken:handle"], cwd=setup, capture_output=True, timeout=60,
                       env=_env(url, setup))
    assert r.returncode == 1
    assert r.stderr.decode() == "fdq: error: cannot import broken: RuntimeError: no config file\n"


def test_path_adds_an_import_directory(setup, url, tmp_path):
    elsewhere = tmp_path / "lib"
    elsewhere.mkdir()
    (elsewhere / "farmod.py").write_text("x = 1\n")
    r = subprocess.run([str(FDQ), "worker", "farmod:x", "--path", str(elsewhere)], cwd=setup,
                       capture_output=True, timeout=60, env=_env(url, setup))
    assert r.stderr.decode() == "fdq: error: farmod:x is not callable (it is a int): name a handler function\n"
