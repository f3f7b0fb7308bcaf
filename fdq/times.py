"""Points in time to epoch milliseconds, the unit FDQ stores: as the Python API takes them
(:func:`to_ms`: numbers of milliseconds, datetimes) and as people write them
(:func:`parse_time`: the ``fdq`` command's options, Spark's options).

Accepted: ISO-8601 (``2026-11-23T02:00:00Z``, ``2026-11-23``, an offset; no zone = UTC),
a number with its unit (``1795399200s``, ``1795399200.5s``, ``1795399200000ms``), or a
bare integer of epoch milliseconds. A bare integer from 1 to 99,999,999,999 is refused:
as milliseconds it is a time in 1970-1973, as seconds one from 1970 to the year 5138, so
it is almost surely seconds typed where milliseconds are meant (``1700000000``: 2023 in
seconds, 1970-01-20 in milliseconds); the message says to add ``s`` or ``ms``.
"""
from __future__ import annotations

import datetime
import decimal
import re

from .config import shown
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
EXAMPLES = "e.g. 2026-11-23T02:00:00Z, 1795399200s or 1795399200000ms"


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


def parse_time(value) -> int:
    """Epoch milliseconds from ``value`` as written (see the module's docstring); a
    ``ConfigError`` naming the value and the problem otherwise."""
    text = str(value).strip()
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


__all__ = ["to_ms", "parse_time", "iso_ms", "as_datetime", "EPOCH", "MAX_TIME_MS", "MAX_API_MS", "MIN_BARE_MS"]
