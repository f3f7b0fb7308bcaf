"""Times and durations on the command line, one grammar for every option
(``fdq.times.parse_time``, ``parse_duration``): times ISO-8601, ``<n>s``, ``<n>ms``, bare
epoch milliseconds (one that looks like epoch seconds is refused), ``now`` and ``-15m`` /
``+1h``; durations ``1m30s``, ``500ms``, ``1.5s``, ``2d`` or bare seconds. And ``fdq push
--file`` / ``--eof``: a whole file or stdin as one message."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fdq
from fdq.broker.__main__ import parse_duration as broker_duration
from fdq.times import MIN_BARE_MS, iso_ms, parse_duration, parse_time
from fdqtest import collect

FDQ = Path(sys.executable).parent / "fdq"

T_MS = 1795399200000        # 2026-11-23T02:00:00Z


@pytest.mark.parametrize("text", ["2026-11-23T02:00:00Z", "2026-11-23T02:00:00z", "2026-11-23T02:00:00",
                                  "2026-11-23T03:00:00+01:00", "1795399200s", "1795399200.000s",
                                  "1795399200000ms", "1795399200000", " 1795399200000 "])
def test_each_form_is_the_same_instant(text):
    assert parse_time(text) == T_MS


def test_exact_to_the_millisecond():
    assert parse_time("1795399200.123s") == T_MS + 123
    assert parse_time("1795399200.1239s") == T_MS + 123          # below a millisecond: cut
    assert parse_time("2026-11-23T02:00:00.123Z") == T_MS + 123
    assert parse_time("2026-11-23") == T_MS - 2 * 3600 * 1000      # a date: its midnight, UTC
    assert iso_ms(T_MS + 123) == "2026-11-23T02:00:00.123Z"


def test_bare_numbers_that_look_like_seconds_are_refused():
    assert parse_time("0") == 0                                    # the epoch in either unit
    assert parse_time(str(MIN_BARE_MS)) == MIN_BARE_MS             # 1973-03-03 in ms
    for text in ["1", "1700000000", str(MIN_BARE_MS - 1)]:
        with pytest.raises(fdq.ConfigError, match=f"'{text}' is ambiguous: .* write {text}s for seconds "
                                                  f"or {text}ms for milliseconds"):
            parse_time(text)
    assert parse_time("1700000000s") == 1700000000000
    assert parse_time("1700000000ms") == 1700000000                # explicit: taken as written


@pytest.mark.parametrize("text", ["yesterday", "-5x", "1e12", "5 s", "5sec", "2026-13-45", "", "- 5m", "--5m"])
def test_not_a_time(text):
    with pytest.raises(fdq.ConfigError, match=f"{text.strip()!r} is not a time"):
        parse_time(text)


def test_replay_window_in_seconds_is_the_window_in_milliseconds(run, db):
    """What a user typing seconds gets: the window they meant, not January 1970."""
    p = fdq.Producer(db)
    p.push_many("orders", [b"old", b"old2"])
    with fdq.Consumer(db, "orders") as c:
        old = c.fetch(10, timeout=5)
        c.ack_many(old)
    cut_ms = max(m.insertion_time for m in old) + 1        # insertion times: the producer's clock
    deadline = time.monotonic() + 5
    while time.time() * 1000 < cut_ms + 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    p.push("orders", b"new")
    seconds = f"{cut_ms // 1000}.{cut_ms % 1000:03d}s"
    row = run.json("replay", "orders", "--start", seconds)
    assert row["start_ms"] == cut_ms and row["replayed"] == 1      # "new" only
    assert run.json("replay", "orders", "--start", "0")["replayed"] == 3       # old, old2, new (not its replay)
    r = run("replay", "orders", "--start", str(cut_ms // 1000), code=2)
    assert f"'{cut_ms // 1000}' is ambiguous" in r.stderr and "as epoch milliseconds it is 1970-01-" in r.stderr


def test_small_times_written_with_their_unit_reach_the_api(run, db):
    """The Python API refuses a bare number from 1 to 1e11 (probably seconds); the
    command hands it a datetime, so ``5ms`` or ``1000s``, written with their unit, are
    the instants meant: a window from 1970 that holds every message."""
    p = fdq.Producer(db)
    p.push_many("orders", [b"a", b"b"])
    assert run.json("replay", "orders", "--start", "5ms")["replayed"] == 2
    assert run.json("replay", "orders", "--start", "1000s", "--end", "2026-11-23T02:00:00Z")["replayed"] == 0
    assert run.json("trim", "orders", "--before", "5ms")["deleted"] == 0
    with pytest.raises(fdq.ConfigError, match="looks like epoch seconds"):
        p.replay("orders", 5)


DURATIONS = [("1m30s", 90.0), ("500ms", 0.5), ("1.5s", 1.5), ("2d", 172800.0), ("90", 90.0), ("0.5", 0.5),
             ("1h30m", 5400.0), (".5s", 0.5), ("1d2h3m4s5ms", 93784.005), ("250us", 0.00025), ("0", 0.0),
             (" 7d ", 604800.0), ("3650d", 315360000.0)]


@pytest.mark.parametrize("text,seconds", DURATIONS)
def test_durations_are_units_summed_or_bare_seconds(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-12)
    assert broker_duration(text) == pytest.approx(seconds, rel=1e-12)      # the broker's nsqd flags too


@pytest.mark.parametrize("text,error", [
    ("-1", "'-1': a duration must be >= 0"),
    ("-1m30s", "'-1m30s': a duration must be >= 0"),
    ("1e3", "'1e3' is not a duration"),
    ("inf", "'inf' is not a duration"),
    ("nan", "'nan' is not a duration"),
    ("1m30", "'1m30' is not a duration"),                   # a number without its unit after one with
    ("5 s", "'5 s' is not a duration"),
    ("1y", "'1y' is not a duration"),
    ("", "'' is not a duration"),
    ("9" * 33, "is not a duration: longer than 32 characters"),
    ("0" * 40 + "1s", "is not a duration: longer than 32 characters"),
    ("40000d", "'40000d': a duration must be at most 3,153,600,000 s (100 years)"),
])
def test_a_bad_duration_says_why_with_examples(text, error):
    with pytest.raises(fdq.ConfigError) as e:
        parse_duration(text)
    assert error in str(e.value) and (str(e.value).endswith("(e.g. 90 (seconds), 1m30s, 500ms, 1.5s, 2h or 2d)")
                                      or "100 years" in str(e.value))
    with pytest.raises(fdq.ConfigError, match="must be > 0"):
        parse_duration("0s", zero=False)


def test_now_and_times_relative_to_now():
    assert parse_time("now", now=T_MS) == T_MS
    assert parse_time("NOW", now=T_MS) == T_MS
    assert parse_time("-15m", now=T_MS) == T_MS - 900_000
    assert parse_time("+1h30m", now=T_MS) == T_MS + 5_400_000
    assert parse_time("-90", now=T_MS) == T_MS - 90_000              # bare: seconds, as every duration
    assert parse_time("-1.5s", now=T_MS) == T_MS - 1500
    before = time.time_ns() // 1_000_000
    got = parse_time("-1h")
    assert before - 3_600_000 <= got <= time.time_ns() // 1_000_000 - 3_600_000
    with pytest.raises(fdq.ConfigError, match="'-40000d' is not a time: a time relative to now is at most 100 years"):
        parse_time("-40000d", now=T_MS)
    with pytest.raises(fdq.ConfigError, match="out of range"):
        parse_time("-100d", now=0)                                     # before 1970


def test_replay_start_relative_to_now(run, db):
    fdq.Producer(db).push("orders", b"a")
    before = time.time() * 1000
    row = run.json("replay", "orders", "--start", "-15m")
    after = time.time() * 1000
    assert before - 900_000 - 1 <= row["start_ms"] <= after - 900_000 and row["replayed"] == 1
    row = run.json("replay", "orders", "--since", "1h", "--end", "now", "--again")
    assert time.time() * 1000 - 3_600_000 - 60_000 <= row["start_ms"] <= time.time() * 1000 - 3_600_000
    assert abs(row["end_ms"] - time.time() * 1000) < 60_000 and row["replayed"] == 1
    run.usage_error(["replay", "orders", "--start", "-1h", "--since", "1h"],
                    "give the window's start: --start TIME or --since DURATION (one of them)")
    run.usage_error(["replay", "orders", "--since", "soon"], "Invalid value for '--since': 'soon' is not a duration")
    # -15m is the option's value, not an option of its own
    run.usage_error(["trim", "orders", "--before", "-1y"], "Invalid value for '--before': '-1y' is not a time")


def test_every_duration_option_takes_the_grammar(run, db):
    """``--ack-wait-s 1m30s`` is stored as 90.0; the same grammar for every ``*-s``
    option, ``--delay`` and ``--timeout``."""
    run("topics", "create", "orders", "--retention-s", "7d", "--dedupe-window-s", "1m30s")
    row = run.json("subs", "create", "orders", "audit", "--ack-wait-s", "1m30s", "--backoff-s", "500ms,1m,1.5s")
    assert row["config"]["ack_wait_s"] == 90.0 and row["config"]["backoff_s"] == [0.5, 60.0, 1.5]
    config = fdq.Supervisor(db).config("orders")
    assert config.retention_s == 604800.0 and config.dedupe_window_s == 90.0
    run("topics", "update", "orders", "--retention-s", "2h30m")
    assert fdq.Supervisor(db).config("orders").retention_s == 9000.0
    run("subs", "update", "orders", "audit", "--ack-wait-s", "2m")
    assert fdq.Supervisor(db).subscription("orders", "audit")["config"].ack_wait_s == 120.0
    run("push", "orders", "later", "--delay", "1h")
    assert fdq.Supervisor(db).stats("orders")["subscriptions"]["audit"]["delayed"] == 1
    started = time.monotonic()
    run("tail", "orders", "-s", "audit", "--timeout", "300ms")          # nothing ready: ends after 0.3 s
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("argv,option,value", [
    (["subs", "create", "orders", "s", "--ack-wait-s", "1m30"], "--ack-wait-s", "1m30"),
    (["topics", "create", "t", "--retention-s", "7 days"], "--retention-s", "7 days"),
    (["push", "orders", "x", "--delay", "soon"], "--delay", "soon"),
    (["tail", "orders", "--timeout", "1e9"], "--timeout", "1e9"),
    (["subs", "create", "orders", "s", "--backoff-s", "1s,2x"], "--backoff-s", "2x"),
    (["web", "--sample-interval", "fast"], "--sample-interval", "fast"),
    (["broker", "--msg-timeout", "1m30"], "--msg-timeout", "1m30"),
])
def test_a_bad_duration_is_one_line_naming_the_option_value_and_examples(run, argv, option, value):
    r = run.usage_error(argv, f"Invalid value for '{option}': '{value}' is not a duration")
    line = next(line for line in r.stderr.splitlines() if line.startswith("Error: "))
    assert "(e.g. 90 (seconds), 1m30s, 500ms, 1.5s, 2h or 2d)" in line


def test_push_file_is_one_message_byte_exact(run, db, tmp_path):
    body = bytes(range(256)) * 40 + b"\r\n\n \n"          # every byte, newlines at the end: kept
    path = tmp_path / "blob.bin"
    path.write_bytes(body)
    pushed = run.json_lines("push", "orders", "--file", path, "--key", "k1")
    assert len(pushed) == 1
    r = run("push", "orders", "--eof", input=b"line 1\nline 2\n\n")
    assert len(r.stdout.split()) == 1
    got = collect(db, "orders", 2)
    assert [(m.id, m.body, m.shard_key) for m in got[:1]] == [(pushed[0]["id"], body, "k1")]
    assert got[1].body == b"line 1\nline 2\n\n"
    run("push", "orders", "--eof", input=b"")                        # an empty stdin: one empty message
    assert collect(db, "orders", 1)[0].body == b""


def test_push_file_larger_than_the_topic_allows_is_refused_before_reading(run, db, tmp_path):
    run("topics", "create", "orders")
    run("topics", "update", "orders", "--max-message-bytes", "1000")
    (tmp_path / "ok").write_bytes(b"x" * 1000)
    run("push", "orders", "--file", tmp_path / "ok")
    huge = tmp_path / "huge"
    with open(huge, "wb") as f:              # sparse: read, it would be 64 GiB in memory
        f.truncate(64 << 30)
    started = time.monotonic()
    r = run("push", "orders", "--file", huge, code=1)
    assert time.monotonic() - started < 10
    assert r.stderr == (f"fdq: error: file {str(huge)!r} is 68,719,476,736 bytes, more than topic 'orders''s "
                        "max_message_bytes (1,000): raise it with fdq topics update orders --max-message-bytes N "
                        "(at most 8 MiB)\n")
    r = run("push", "orders", "--eof", input=b"y" * 1001, code=1)
    assert "stdin is over 1,000 bytes, more than topic 'orders''s max_message_bytes (1,000)" in r.stderr
    # a topic the push would create: the default limit (1 MiB)
    (tmp_path / "big").write_bytes(b"z" * ((1 << 20) + 1))
    r = run("push", "new", "--file", tmp_path / "big", code=1)
    assert "is 1,048,577 bytes, more than topic 'new''s max_message_bytes (1,048,576)" in r.stderr
    assert [n for n, _c in fdq.Supervisor(db).topics()] == ["orders"]
    assert fdq.Supervisor(db).stats("orders")["counters"]["inserted"] == 1


def test_push_eof_reads_a_pipe_to_its_end(url, db):
    """The installed command, stdin a real pipe written in pieces: one message."""
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME")}
    env["FDQ_URL"] = url
    proc = subprocess.Popen([FDQ, "push", "orders", "--eof"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    for piece in (b"first\n", b"\x00second", b"\n" * 3):
        proc.stdin.write(piece)
        proc.stdin.flush()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert [m.body for m in collect(db, "orders", 1)] == [b"first\n\x00second\n\n\n"]
    assert len(out.split()) == 1 and err == b""


@pytest.mark.parametrize("argv", [["push", "orders", "x", "--eof"], ["push", "orders", "--file", "F", "--eof"],
                                  ["push", "orders", "-", "--file", "F"]])
def test_push_takes_one_source(run, tmp_path, argv):
    (tmp_path / "f").write_bytes(b"x")
    run.usage_error([str(tmp_path / "f") if a == "F" else a for a in argv], "give one of DATA, --file F and --eof")


FLOOD = "9" * 5000


@pytest.mark.parametrize("argv", [
    ["topics", "create", "t", "--max-backlog", FLOOD], ["topics", "create", "t", "--shards", FLOOD],
    ["topics", "update", "orders", "--retention-bytes", FLOOD], ["tail", "orders", "--count", FLOOD],
    ["dlq", "list", "orders", "--limit", "0" * 5000 + "1" + FLOOD], ["subs", "create", "orders", "s", "--max-deliver", FLOOD],
    ["topics", "create", "t", "--retention-s", FLOOD + "s"], ["push", "orders", "x", "--delay", "0." + FLOOD],
    ["replay", "orders", "--start", "-" + FLOOD + "ms"], ["replay", "orders", "--start", FLOOD],
])
def test_a_digit_flood_is_refused_in_one_short_line(run, argv):
    """Integers, durations and times have bounded digit counts: 5,000 digits are refused
    at once, the message quoting the value shortened."""
    r = run.usage_error(argv, "Invalid value for")
    line = next(line for line in r.stderr.splitlines() if line.startswith("Error: "))
    assert len(line) < 300 and ("more than 30 digits" in line or "32 characters" in line
                                or "out of range" in line), line
