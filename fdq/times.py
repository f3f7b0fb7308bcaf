"""Points in time to epoch milliseconds, the unit FDQ stores: as the Python API takes them
(:func:`to_ms`: numbers of milliseconds, datetimes) and as people write them
(:func:`parse_time`: the ``fdq`` command's options, Spark's options); and durations as
people write them (:func:`parse_duration`: every ``*-s`` option, ``--timeout``,
``--delay``, the broker's nsqd flags).

A time: ISO-8601 (``2026-11-23T02:00:00Z``, ``2026-11-23``, an offset; no zone = UTC),
a number with its unit (``1795399200s``, ``1795399200.5s``, ``1795399200000ms``), a bare
integer of epoch milliseconds, ``now``, or a duration before or after now (``-15m``,
``+1h``). A bare integer from 1 to 99,999,999,999 is refused: as milliseconds it is a
time in 1970-1973, as seconds one from 1970 to the year 5138, so it is almost surely
seconds typed where milliseconds are meant (``1700000000``: 2023 in seconds, 1970-01-20
in milliseconds); the message says to add ``s`` or ``ms``.

A duration: numbers with units, summed (``1m30s``, ``1h30m``, ``500ms``, ``1.5s``,
``2d``; units ``ns us µs ms s m h d``: Go's, as nsqd's flags take them, and days), or a
bare number of seconds (``90``, ``0.5``). Never negative, NaN or infinite; at most 100
years (``config.MAX_SECONDS``); at most ``MAX_DURATION_CHARS`` characters (no digit
floods).
"""
from __future__ import annotations

import datetime
import decimal
import re
import time

from .config import MAX_SECONDS, shown
from .errors import ConfigError

EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
# The last millisecond of year 9999 (what a datetime holds; msgpack stores 64-bit ints).
MAX_TIME_MS = 253402300799999
# Bare integers below this (1973-03-03 in ms, the year 5138 in s) look like seconds.
MIN_BARE_MS = 100_000_000_000
# |epoch ms| the API takes as a number: beyond it no time (stored times are int64).
MAX_API_MS = 1 << 62

_BARE = re.compile(r"[0-9]+")
_WITH_UNIT = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s)")
# Digits a number may have before its point (leading zeros aside): MAX_TIME_MS has 15,
# and Python refuses to convert more than 4,300 (ValueError).
MAX_DIGITS = 20
EXAMPLES = "e.g. 2026-11-23T02:00:00Z, 1795399200s, 1795399200000ms, now or -15m"

_DURATION_UNITS = {"ns": decimal.Decimal("1e-9"), "us": decimal.Decimal("1e-6"), "µs": decimal.Decimal("1e-6"),
                   "ms": decimal.Decimal("0.001"), "s": decimal.Decimal(1), "m": decimal.Decimal(60),
                   "h": decimal.Decimal(3600), "d": decimal.Decimal(86400)}
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_DURATION_BARE = re.compile(_NUMBER)
# One number and its unit; a duration is one or more of them, matched from where the last
# ended (re.match at a position: linear, never a search from every digit).
_DURATION_PART = re.compile(f"({_NUMBER})(ns|us|µs|ms|s|m|h|d)")
# Longer than any duration people write ("1d23h59m59.999s" is 15): refused before parsing.
MAX_DURATION_CHARS = 32
DURATION_EXAMPLES = "e.g. 90 (seconds), 1m30s, 500ms, 1.5s, 2h or 2d"


def iso_ms(ms: int) -> str:
    """``ms`` as ISO-8601 UTC to the millisecond (``2026-11-23T02:00:00.000Z``)."""
    t = EPOCH + datetime.timedelta(milliseconds=ms)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def as_datetime(ms: int | None) -> datetime.datetime | None:
    """Epoch milliseconds as an aware UTC datetime (exact; None stays None): how a time
    parsed here is handed to the Python API, whose bare numbers from 1 to ``MIN_BARE_MS``
    are refused as probable seconds (``5ms``, written with its unit, is meant)."""
    return None if ms is None else EPOCH + datetime.timedelta(milliseconds=ms)


def to_ms(t, *, refuse_seconds: bool = True) -> int | None:
    """Epoch milliseconds from an int/float (ms) or a datetime (naive = UTC). NaN,
    infinities and times beyond ``MAX_API_MS`` are refused (ConfigError), and so is a
    number from 1 to ``MIN_BARE_MS`` (1973-03-03 as milliseconds): it is almost surely
    epoch seconds (``time.time()``), which as milliseconds would mean January 1970 and
    replay or rewind to the start of the log (``refuse_seconds=False``: a time already
    checked, e.g. by ``Producer.replay``)."""
    if t is None:
        return None
    if isinstance(t, datetime.datetime):
        if t.tzinfo is None:
            t = t.replace(tzinfo=datetime.timezone.utc)
        return (t - EPOCH) // datetime.timedelta(milliseconds=1)     # exact: no float
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t or not -MAX_API_MS <= t <= MAX_API_MS:
        raise ConfigError(f"time must be epoch milliseconds (within ±2**62) or a datetime, not {shown(t)}")
    if refuse_seconds and 0 < t < MIN_BARE_MS:
        raise ConfigError(f"time {t!r} looks like epoch seconds (as epoch milliseconds it is "
                          f"{iso_ms(int(t))}): times are epoch milliseconds or a datetime; "
                          f"pass {int(t * 1000)} or a datetime")
    return int(t)


def _iso(text: str) -> datetime.datetime:
    # Python 3.10's fromisoformat takes no "Z"; 3.11's does. Same result on both.
    if text[-1:] in ("z", "Z"):
        text = text[:-1] + "+00:00"
    t = datetime.datetime.fromisoformat(text)
    return t if t.tzinfo is not None else t.replace(tzinfo=datetime.timezone.utc)


def parse_duration(value, *, zero: bool = True) -> float:
    """Seconds from a duration as written (see the module's docstring): ``1m30s`` ->
    90.0, ``500ms`` -> 0.5, ``90`` -> 90.0; ``zero=False`` refuses 0. A ``ConfigError``
    naming the value, the problem and examples otherwise."""
    total = _duration(str(value).strip())
    if total == 0 and not zero:
        raise ConfigError(f"{shown(str(value).strip())}: a duration must be > 0 ({DURATION_EXAMPLES})")
    return float(total)


def _duration(text: str) -> decimal.Decimal:
    """Exact seconds of ``text`` (stripped), within 0 and ``MAX_SECONDS``."""
    if len(text) > MAX_DURATION_CHARS:
        raise ConfigError(f"{shown(text)} is not a duration: longer than {MAX_DURATION_CHARS} characters "
                          f"({DURATION_EXAMPLES})")
    if text[:1] == "-" and (_DURATION_BARE.fullmatch(text[1:]) or _DURATION_PART.match(text, 1)):
        raise ConfigError(f"{shown(text)}: a duration must be >= 0 ({DURATION_EXAMPLES})")
    if _DURATION_BARE.fullmatch(text):
        total = decimal.Decimal(text)
    else:
        pos, total = 0, decimal.Decimal(0)
        while m := _DURATION_PART.match(text, pos):
            total += decimal.Decimal(m[1]) * _DURATION_UNITS[m[2]]
            pos = m.end()
        if pos != len(text) or not text:
            raise ConfigError(f"{shown(text)} is not a duration: give a number of seconds or numbers with units "
                              f"ns, us, ms, s, m, h, d ({DURATION_EXAMPLES})")
    if total > MAX_SECONDS:
        raise ConfigError(f"{shown(text)}: a duration must be at most {MAX_SECONDS:,} s (100 years)")
    return total


def now_ms() -> int:
    """The present as epoch milliseconds (the clock relative times count from)."""
    return time.time_ns() // 1_000_000


def parse_time(value, *, now: int | None = None) -> int:
    """Epoch milliseconds from ``value`` as written (see the module's docstring); a
    ``ConfigError`` naming the value and the problem otherwise. ``now``, ``-15m`` and
    ``+1h`` count from ``now`` (epoch ms; default the clock, read once)."""
    text = str(value).strip()
    if text.lower() == "now" or text[:1] in ("-", "+"):
        base = now_ms() if now is None else now
        if text.lower() == "now":
            return base
        try:
            if text[1:2].isspace():
                raise ConfigError("a space after the sign")
            seconds = _duration(text[1:])
        except ConfigError as e:
            why = ("at most 100 years" if "at most" in str(e) else
                   f"- or + a duration of at most {MAX_DURATION_CHARS} characters" if "longer than" in str(e)
                   else "- or + a duration")
            raise ConfigError(f"{shown(text)} is not a time: a time relative to now is {why} "
                              f"(-15m, -1h30m, +2d, -90 for seconds)") from None
        ms = base + int(seconds * 1000) * (-1 if text[0] == "-" else 1)     # exact; below a ms: cut
        if not 0 <= ms <= MAX_TIME_MS:
            raise ConfigError(f"{shown(text)} is out of range: times go from 1970-01-01 to 9999-12-31")
        return ms
    out_of_range = ConfigError(f"{shown(text)} is out of range: times go from 1970-01-01 to 9999-12-31 "
                               f"(epoch milliseconds 0 to {MAX_TIME_MS})")
    if _BARE.fullmatch(text):
        digits = text.lstrip("0") or "0"
        if len(digits) > MAX_DIGITS:
            raise out_of_range
        ms = int(digits)
        if 0 < ms < MIN_BARE_MS:
            raise ConfigError(
                f"{shown(text)} is ambiguous: as epoch milliseconds it is {iso_ms(ms)}, as epoch seconds "
                f"{iso_ms(ms * 1000)}; write {digits}s for seconds or {digits}ms for milliseconds")
    elif m := _WITH_UNIT.fullmatch(text):
        whole, point, fraction = m[1].partition(".")
        whole = whole.lstrip("0") or "0"
        if len(whole) > MAX_DIGITS:
            raise out_of_range
        # Past 6 decimals (a microsecond) nothing reaches a millisecond; cut there, the
        # product stays within Decimal's 28 digits (exact).
        number, unit = decimal.Decimal(whole + point + fraction[:6]), m[2]
        ms = int(number * 1000 if unit == "s" else number)    # exact; below a millisecond: cut
    else:
        try:
            t = _iso(text)
        except ValueError:
            raise ConfigError(f"{shown(text)} is not a time: give ISO-8601 (no zone = UTC), or epoch seconds "
                              f"or milliseconds with their unit ({EXAMPLES})") from None
        ms = (t - EPOCH) // datetime.timedelta(milliseconds=1)    # exact: no float
    if not 0 <= ms <= MAX_TIME_MS:
        raise out_of_range
    return ms


__all__ = ["to_ms", "parse_time", "parse_duration", "now_ms", "MAX_DURATION_CHARS", "iso_ms", "as_datetime", "EPOCH",
           "MAX_TIME_MS", "MAX_API_MS", "MIN_BARE_MS"]
