"""``fdq maintain [TOPIC...]`` as a process (the installed ``fdq`` command): it holds a
topic's maintenance role and applies its retention where no consumer or broker runs,
until SIGTERM (exit 0, the role given up at once); ``fdq trim`` names a live holder and
runs beside it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import fdq
from fdqtest import kill_all, wait_for

FDQ = Path(sys.executable).parent / "fdq"


def _maintenance(sup, topic):
    return sup.stats(topic)["maintenance"]


def test_maintain_applies_retention_holding_the_role_and_trim_names_it(run, url, db, sup):
    sup.create_topic("t", shards=2, retention_messages=5)
    sup.create_topic("other", retention_messages=5)
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"m%d" % i) for i in range(30)])
    fdq.Producer(db).push_many("other", [fdq.Envelope(b"m%d" % i) for i in range(30)])
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME")}
    p = subprocess.Popen([str(FDQ), "--url", url, "maintain", "t"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    try:
        first = p.stderr.readline().decode()
        assert first.startswith("fdq maintain: ") and " on t " in first, first
        name = first.split()[2]
        wait_for(lambda: _maintenance(sup, "t")["trimmed"] == 25, 60, "t trimmed to its 5 newest")
        m = _maintenance(sup, "t")
        assert m["holder"] == name
        wait_for(lambda: _maintenance(sup, "t")["last_pass_by"] == name, 30, "a pass of it recorded")
        r = run("trim", "t")
        assert f"note: {name} maintains topic 't'" in r.stderr and "runs beside it" in r.stderr, r.stderr
        p.send_signal(signal.SIGTERM)
        _out, err = p.communicate(timeout=60)
    finally:
        kill_all([p])
    assert p.returncode == 0, err
    assert "fdq maintain: stopped" in err.decode()
    assert _maintenance(sup, "t")["holder"] is None        # given up at once, not left to its lease
    assert _maintenance(sup, "other")["trimmed"] == 0      # not one of its topics


def test_trim_says_nothing_of_a_holder_when_none_runs(run, sup):
    sup.create_topic("t", retention_messages=5)
    r = run("trim", "t")
    assert "maintains" not in r.stderr


def test_maintain_of_a_topic_that_does_not_exist_is_one_line_exit_1(url):
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME")}
    r = subprocess.run([str(FDQ), "--url", url, "maintain", "nope"], capture_output=True, env=env, timeout=60)
    assert r.returncode == 1, r.stderr
    assert b"nope" in r.stderr and b"Traceback" not in r.stderr
