"""Fuzzing what the ``fdq`` command reads from its command line: times
(``fdq.times.parse_time``, ``to_ms``) and every option of every command as click parses
it (``fdq.cli.params`` types and callbacks). The only outcomes allowed are a valid
value or FDQ's / click's own error (a usage error, exit 2), never another exception
(ValueError, OverflowError, RecursionError escaped before) and never a hang.

Derandomized (the same examples on every run: no flaky CI), a few seconds in all;
``HYPOTHESIS_FUZZ=N`` runs N examples per property instead."""
from __future__ import annotations

import datetime
import faulthandler
import os
import subprocess
import sys

import click
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import fdq
from fdq.cli import cli
from fdq.cli.params import (Address, Duration, FilterHeader, Header, Int, Name, OrNone, Seconds, SecondsList, Shards,
                            Since, Tag, Time, TimeOrNow, headers_callback)
from fdq.config import MAX_SECONDS
from fdq.times import MAX_API_MS, MAX_TIME_MS, iso_ms, parse_time, to_ms
from fdqtest import ON_FDB

pytestmark = pytest.mark.skipif(ON_FDB, reason="no database: engine-independent, run in the sqlite:// pass")

FUZZ = int(os.environ.get("HYPOTHESIS_FUZZ", "0"))
fuzz = settings(derandomize=True, database=None, deadline=None, max_examples=FUZZ or 150,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True)
def _no_hang():
    """A property stuck in a parser dumps every thread's stack and ends the run."""
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def digit_floods(suffixes=("", "s", "ms", ".5s", "h", "m", "us")):
    """Numbers far beyond any range: past Python's 4,300-digit str-to-int limit, with
    units after them and zeros before them."""
    return st.builds(lambda zeros, n, suffix: "0" * zeros + "9" * n + suffix,
                     st.sampled_from([0, 1, 5000]), st.sampled_from([1, 15, 16, 21, 400, 4301, 6000]),
                     st.sampled_from(suffixes))


WORDS = ["now", "none", "inf", "-inf", "nan", "1e400", "-0", "0", "1_000", "٣", "²", "３", "T", "Z", ":", "=",
         "[", "{", "\x00", " ", "+", "-", ".", "e", "s", "ms", "m", "h", "us", "µs", "ns", "2026-11-23",
         "T02:00:00", "+01:00", "-23:59", "0001-01-01", "9999-12-31", "::1", "[::1]:", "localhost:"]
# Text shaped like what the options take, and text that is not.
TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="0123456789.:+-TZsmhnuµ=e ,[]{}\"", max_size=40),
    st.lists(st.sampled_from(WORDS), max_size=6).map("".join),
    digit_floods(),
    st.builds(lambda depth, open_: "x=" + open_ * depth, st.sampled_from([10, 3000, 100_000]),
              st.sampled_from(["[", '{"a":'])),
    st.builds(lambda host, port: f"{host}:{port}", st.sampled_from(["h", "127.0.0.1", "[::1]", ""]),
              st.one_of(st.integers(-1, 10**6).map(str), digit_floods(("",)), st.sampled_from(WORDS))),
)


@fuzz
@given(TEXT)
@example("9" * 4301)
@example("0" * 5000 + "1700000000000")
@example("9" * 5000 + ".5s")
@example("1795399200." + "9" * 5000 + "s")
def test_parse_time_gives_a_time_in_range_or_a_config_error(text):
    """A bare integer of over 4,300 digits raised ValueError (Python's int limit)."""
    try:
        ms = parse_time(text)
    except fdq.ConfigError as e:
        assert len(str(e)) < 500, "the message quotes the text shortened"
        return
    assert isinstance(ms, int) and 0 <= ms <= MAX_TIME_MS


@fuzz
@given(st.integers(0, MAX_TIME_MS))
def test_parse_time_reads_back_each_way_it_writes_a_time(ms):
    assert parse_time(iso_ms(ms)) == ms
    assert parse_time(f"{ms}ms") == ms
    assert parse_time(f"{ms // 1000}.{ms % 1000:03d}s") == ms
    assert parse_time(f"{ms // 1000}.{ms % 1000:03d}999999999999999999999999999999s") == ms   # cut, not rounded


@fuzz
@given(st.one_of(st.integers(-2**70, 2**70), st.floats(), st.datetimes(), st.text(max_size=5), st.none(),
                 st.booleans(), st.just(10**5000)))
def test_to_ms_gives_epoch_milliseconds_or_a_config_error(t):
    try:
        ms = to_ms(t)
    except fdq.ConfigError:
        return
    assert ms is None if t is None else isinstance(ms, int) and abs(ms) <= MAX_API_MS + 1000 * 86400 * 366 * 10000


TYPES = {
    "Name": (Name(), lambda v: isinstance(v, str)),
    "Shards": (Shards(), lambda v: 1 <= v <= 4096),
    "Seconds": (Seconds(), lambda v: 0 <= v < float("inf")),
    "SecondsList": (SecondsList(), lambda v: all(0 <= s < float("inf") for s in v)),
    "OrNone": (OrNone(Seconds()), lambda v: True),
    "Time": (Time(), lambda v: 0 <= v <= MAX_TIME_MS),
    "TimeOrNow": (TimeOrNow(), lambda v: v is None or 0 <= v <= MAX_TIME_MS),
    "Duration": (Duration(), lambda v: 0 < v <= MAX_SECONDS),
    "Since": (Since(), lambda v: 0 <= v <= MAX_TIME_MS),
    "Int": (Int(min=1), lambda v: 1 <= v < 10**30),
    "Address": (Address(), lambda v: isinstance(v, str)),
    "Header": (Header(), lambda v: isinstance(v, tuple) and len(v) == 2),
    "FilterHeader": (FilterHeader(), lambda v: isinstance(v, tuple) and len(v) == 2),
    "Tag": (Tag(), lambda v: isinstance(v, str)),
}


@fuzz
@given(st.sampled_from(sorted(TYPES)), TEXT)
@example("Time", "9" * 4301)
@example("Address", "h:²")
@example("Address", "h:" + "1" * 5000)
@example("Header", "x=" + "[" * 100_000)
@example("Duration", "1e300h")
def test_each_parameter_type_gives_a_valid_value_or_a_usage_error(kind, text):
    """``h:²`` and a 5,000-digit port raised ValueError from the address check, a deep
    JSON header RecursionError, a 4,301-digit time ValueError; a duration of 1e300 h
    passed (``fdq web --sample-interval``: its sampling thread's wait overflowed)."""
    param_type, valid = TYPES[kind]
    try:
        value = param_type.convert(text, None, None)
    except click.BadParameter:
        return
    assert valid(value), value
    if kind == "Header":
        try:
            headers_callback(None, None, [value])
        except click.BadParameter:
            pass


FLOODS = """
import click
from fdq.cli.params import Address, Duration, Seconds, Shards, Time
flood = "9" * 200_000
for param_type, text in [(Duration(), "h:" + flood), (Duration(), "1s" + flood), (Time(), flood + "s"),
                         (Address(), "h:" + flood), (Shards(), flood), (Seconds(), flood)]:
    try:
        param_type.convert(text, None, None)
    except click.BadParameter:
        pass
print("done")
"""


def test_a_digit_flood_is_refused_at_once():
    """The duration parser searched on from every digit for a unit after it: 60,000
    digits took 2 minutes (quadratic, in one regex call: the GIL held), 200,000 hours.
    In a process of its own, so a hang is killed."""
    r = subprocess.run([sys.executable, "-c", FLOODS], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout == "done\n", r.stderr[-2000:]


def _options():
    """(command path, its required arguments, option) of every option of every ``fdq``
    command whose value is parsed or checked (not plain strings, flags, files)."""
    out = []

    def walk(cmd, path):
        if isinstance(cmd, click.Group):
            for name in sorted(cmd.commands):
                walk(cmd.commands[name], path + [name])
            return
        base = []
        for p in cmd.params:
            if isinstance(p, click.Argument) and p.required:
                base.append("orders")
            elif p.required:
                base += [p.opts[0], "now" if isinstance(p.type, TimeOrNow) else "0"]
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.is_flag and not isinstance(p.type, (click.Path, click.Choice)) \
                    and (p.callback is not None or not isinstance(p.type, click.types.StringParamType)):
                out.append((path, base, p.opts[0]))
    walk(cli, [])
    return out


OPTIONS = _options()


def test_the_fuzzed_options_cover_every_parameter_type():
    names = {type(cmd_opt).__name__ for cmd_opt in _types_of_options()}
    assert {"Shards", "Seconds", "SecondsList", "OrNone", "Time", "TimeOrNow", "Since", "Duration", "Address",
            "Header", "FilterHeader", "Tag", "Int", "IntRange"} <= names, names


def _types_of_options():
    for path, _base, opt in OPTIONS:
        cmd = cli
        for name in path:
            cmd = cmd.commands[name]
        yield next(p.type for p in cmd.params if p.opts[0] == opt)


@fuzz
@given(st.sampled_from(OPTIONS), st.lists(TEXT, min_size=1, max_size=2))
@example(next(o for o in OPTIONS if o[2] == "--header"), ["x=" + "[" * 100_000])
@example(next(o for o in OPTIONS if o[2] == "--start"), ["9" * 4301])
def test_every_option_of_every_command_parses_or_is_a_usage_error(option, values):
    """Parsed as the command line is (click's parser, the option's type and callback,
    nothing run): a usage error or a context, nothing else."""
    path, base, opt = option
    cmd = cli
    for name in path:
        cmd = cmd.commands[name]
    args = list(base)
    for v in values:
        args += [opt, v]
    try:
        with cmd.make_context(" ".join(["fdq", *path]), args) as _ctx:
            pass
    except click.ClickException:
        pass


def test_a_time_never_takes_python_s_int_limit_for_an_answer():
    """The error names the problem (out of range), not ``sys.set_int_max_str_digits``."""
    with pytest.raises(fdq.ConfigError, match="is out of range: times go from 1970-01-01 to 9999-12-31"):
        parse_time("9" * 4301)
    assert parse_time("0" * 5000 + "1795399200000") == 1795399200000
    assert to_ms(datetime.datetime(2026, 11, 23, 2)) == 1795399200000
