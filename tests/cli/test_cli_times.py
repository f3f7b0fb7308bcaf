"""Times on the command line (``fdq.times.parse_time``): ISO-8601, ``<n>s``, ``<n>ms``
and bare epoch milliseconds; a bare number that looks like epoch seconds is refused."""
from __future__ import annotations

import time

import pytest

import fdq
from fdq.times import MIN_BARE_MS, iso_ms, parse_time

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


@pytest.mark.parametrize("text", ["yesterday", "-5", "1e12", "5 s", "5sec", "2026-13-45", ""])
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
