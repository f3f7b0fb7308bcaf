"""Parameter types of the ``fdq`` command: what can be judged from the command line
alone is judged here, with FDQ's own rules (``check_name``, ``TopicConfig``,
``validate_headers``), and a bad value is a usage error (exit 2)."""
from __future__ import annotations

import functools
import json
import math
import re

import click

from ..broker.server import split_address
from ..config import MAX_SECONDS, SubscriptionConfig, TopicConfig, check_name, shown
from ..envelope import Envelope
from ..errors import ConfigError, InvalidHeader, InvalidMessage, InvalidName
from ..headers import TRACE_ID, is_tag, validate_headers
from ..times import now_ms, parse_duration, parse_time


class Name(click.ParamType):
    """A topic or subscription name (NSQ's rule, ``fdq.config.check_name``)."""

    def __init__(self, what: str = "topic"):
        self.what = what
        self.name = what

    def convert(self, value, param, ctx):
        try:
            return check_name(value, self.what)
        except InvalidName as e:
            self.fail(str(e), param, ctx)


# Digits an integer option may have (leading zeros aside): past any count FDQ stores
# (2**63 - 1 has 19), short of a flood Python would spend time on (or refuse: 4,300).
MAX_INT_DIGITS = 30
_INT = re.compile(r"([+-]?)0*([0-9]+)")


def _digit_flood(ptype: click.ParamType, value, param, ctx):
    """Refuse an integer of more than ``MAX_INT_DIGITS`` digits, before Python converts it."""
    if not isinstance(value, int):
        m = _INT.fullmatch(str(value).strip())
        if m and len(m[2]) > MAX_INT_DIGITS:
            ptype.fail(f"{shown(str(value))} is not a valid integer: more than {MAX_INT_DIGITS} digits", param, ctx)


class Int(click.IntRange):
    """click's integer (within [``min``, ``max``] when given), of at most
    ``MAX_INT_DIGITS`` digits (an option's callback applies its FDQ bound)."""

    name = "integer"

    def convert(self, value, param, ctx):
        _digit_flood(self, value, param, ctx)
        return super().convert(value, param, ctx)


class Shards(click.ParamType):
    """A shard count, valid as ``TopicConfig.shards`` is."""

    name = "shards"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        else:
            _digit_flood(self, value, param, ctx)
            try:
                n = int(str(value).strip())
            except ValueError:
                self.fail(f"{shown(value)} is not an integer", param, ctx)
        try:
            TopicConfig(shards=n)
        except ConfigError as e:
            self.fail(str(e), param, ctx)
        return n


def topic_config_callback(ctx, param, value):
    """Check an option that is a ``TopicConfig`` field (same name) by FDQ's own rule."""
    if value is not None and value is not CLEARED:
        try:
            TopicConfig(**{param.name: value})
        except ConfigError as e:
            raise click.BadParameter(str(e), ctx, param) from None
    return value


def envelope_callback(ctx, param, value):
    """Check a push option that is an ``Envelope`` field (same name) by FDQ's own rule."""
    if value is not None:
        try:
            Envelope(b"", **{param.name: value})
        except InvalidMessage as e:
            raise click.BadParameter(str(e), ctx, param) from None
    return value


def subscription_config_callback(ctx, param, value):
    """Check an option that is a ``SubscriptionConfig`` field (same name) alone, by FDQ's
    own rule; combinations are checked once every option is known."""
    if value is not None:
        try:
            SubscriptionConfig(**{param.name: value})
        except ConfigError as e:
            raise click.BadParameter(str(e), ctx, param) from None
    return value


class SecondsList(click.ParamType):
    """Comma-separated durations (``1,5,30``, ``1s,30s,5m``); the empty string is the
    empty list. -> a tuple of seconds."""

    name = "d1,d2,..."

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = str(value).strip()
        if not text:
            return ()
        return tuple(Seconds().convert(part.strip(), param, ctx) for part in text.split(","))


class Seconds(click.ParamType):
    """A duration >= 0 as ``fdq.times.parse_duration`` reads it (``1m30s``, ``500ms``,
    ``1.5s``, ``2d``, a bare number of seconds; at most 100 years); an option's callback
    applies its FDQ bound. -> seconds (float)."""

    name = "duration"
    zero = True

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):    # a default, in seconds
            if math.isfinite(value) and 0 <= value <= MAX_SECONDS and (value > 0 or self.zero):
                return float(value)
            value = shown(value)
        try:
            return parse_duration(value, zero=self.zero)
        except ConfigError as e:
            self.fail(str(e), param, ctx)


class Cleared:
    """``none`` given for an optional setting: clear it (``OrNone``)."""

    def __repr__(self):
        return "none"


CLEARED = Cleared()


class OrNone(click.ParamType):
    """``inner``'s values, or ``none`` (-> ``CLEARED``): an optional setting to clear."""

    def __init__(self, inner):
        self.inner = inner
        self.name = f"{inner.name}|none"

    def convert(self, value, param, ctx):
        if value is CLEARED or (isinstance(value, str) and value.strip().lower() == "none"):
            return CLEARED
        return self.inner.convert(value, param, ctx)


class Time(click.ParamType):
    """A point in time as ``fdq.times.parse_time`` reads it: ISO-8601 (no zone = UTC),
    ``<n>s`` (epoch seconds), ``<n>ms`` or a bare integer of epoch milliseconds (one
    that looks like seconds is refused), ``now``, or ``-15m`` / ``+1h`` (a duration
    before or after now). -> epoch ms."""

    name = "time"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):      # converted before
            return value
        try:
            return parse_time(value)
        except ConfigError as e:
            self.fail(str(e), param, ctx)


class TimeOrNow(Time):
    """A ``Time``, where ``now`` is the moment the operation runs (-> None)."""

    name = "time|now"

    def convert(self, value, param, ctx):
        if value is None or (isinstance(value, str) and value.strip().lower() == "now"):
            return None
        return super().convert(value, param, ctx)


class Since(click.ParamType):
    """A duration back from now (``--since 1h``: an hour ago). -> epoch ms."""

    name = "duration"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):      # converted before
            return value
        try:
            return max(0, now_ms() - int(parse_duration(value) * 1000))
        except ConfigError as e:
            self.fail(str(e), param, ctx)


class Duration(Seconds):
    """A duration > 0 (``Seconds`` without 0): intervals, timeouts of the servers."""

    zero = False


class Address(click.ParamType):
    """``host:port`` (port 0: any free port), checked by the broker's ``split_address``."""

    name = "host:port"

    def __init__(self, optional: bool = False):
        self.optional = optional

    def convert(self, value, param, ctx):
        text = str(value)
        if self.optional and text == "":
            return text
        try:
            _host, port = split_address(text)
        except ConfigError as e:
            self.fail(str(e), param, ctx)
        if port > 65535:
            self.fail(f"port {port} of {text!r} is above 65535", param, ctx)
        return text


def _reject_constant(name):
    raise ValueError(name)


def _name_value(ptype: click.ParamType, value, param, ctx, what: str, example: str) -> tuple:
    """``name=value`` split at the first ``=`` (a usage error naming ``what`` otherwise)."""
    name, sep, raw = str(value).partition("=")
    if not sep or not name:
        ptype.fail(f"{value!r}: {what} is name=value (e.g. {example})", param, ctx)
    return name, raw


class Header(click.ParamType):
    """``name=value``: the value is parsed as JSON when it is valid JSON (``n=3``,
    ``ok=true``, ``l=[1,2]``, ``s="3"``), else kept as a string (``user=alice``).
    ``##trace_id`` stays a string (push echoes a trace id of digits given as a string)."""

    name = "name=value"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        name, raw = _name_value(self, value, param, ctx, "a header", "--header user=alice")
        if name == TRACE_ID:
            return name, raw
        try:
            parsed = json.loads(raw, parse_constant=_reject_constant)
        except ValueError:
            parsed = raw
        except RecursionError:
            self.fail(f"header {shown(name)}: its JSON value is nested too deeply", param, ctx)
        return name, parsed


def _pairs(ctx, param, pairs) -> dict:
    """``name=value`` option pairs as a dict; a name given twice is a usage error."""
    headers = {}
    for name, value in pairs:
        if name in headers:
            raise click.BadParameter(f"header {name!r} is given twice", ctx, param)
        headers[name] = value
    return headers


def headers_callback(ctx, param, pairs):
    """Collect ``--header`` pairs into a dict checked by ``validate_headers``."""
    if not pairs:
        return None
    try:
        return validate_headers(_pairs(ctx, param, pairs))
    except InvalidHeader as e:
        raise click.BadParameter(str(e), ctx, param) from None


class FilterHeader(click.ParamType):
    """``name=value`` of a subscription's header filter: the value is a string, matched
    against a string header's text or another value's compact JSON text (as ``--header``
    parses it: ``flag=true`` matches a header pushed with ``--header flag=true``)."""

    name = "name=value"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        return _name_value(self, value, param, ctx, "a header filter", "--filter-header region=eu")


def filter_headers_callback(ctx, param, pairs):
    """Collect ``--filter-header`` pairs into ``filter_headers``, checked by FDQ's rule."""
    if not pairs:
        return None
    return subscription_config_callback(ctx, param, _pairs(ctx, param, pairs))


class Tag(click.ParamType):
    """A dispatch tag (the rule of ``##client_dispatch_tag`` values)."""

    name = "tag"

    def convert(self, value, param, ctx):
        if not is_tag(str(value)):
            self.fail(f"invalid tag {value!r}: use characters of [0-9a-zA-Z_-#]", param, ctx)
        return str(value)


TOPIC = Name("topic")
SUBSCRIPTION = Name("subscription")

FORMATS = ("table", "plain", "tsv", "json")
FORMAT_KEY = "fdq.format"       # the command's --format, in click's context (render reads it)


def format_option(f):
    """``--format table|plain|tsv|json`` (default: table on a terminal, else plain) and
    ``--json`` (= ``--format json``, kept) on a command that lists or shows rows. The
    command still gets ``as_json``; ``render`` reads the format from the context."""
    @functools.wraps(f)
    def command(*args, output_format, as_json, **kwargs):
        if as_json and output_format not in (None, "json"):
            raise click.UsageError(f"--json is --format json: give one of them, not --format {output_format} too")
        chosen = "json" if as_json else output_format
        if chosen is not None:
            click.get_current_context().meta[FORMAT_KEY] = chosen
        return f(*args, as_json=chosen == "json", **kwargs)
    command = click.option("--json", "as_json", is_flag=True, help="Print JSON (stable keys): --format json.")(command)
    return click.option("--format", "output_format", type=click.Choice(FORMATS), default=None, metavar="FORMAT",
                        help="table|plain|tsv|json [default: table on a terminal, else plain: aligned text, "
                             "nothing cut].")(command)

__all__ = ["CLEARED", "OrNone", "topic_config_callback", "envelope_callback", "subscription_config_callback", "Name", "Int", "Shards", "Seconds",
           "SecondsList", "Time", "TimeOrNow", "Since", "Duration", "Address", "Header", "FilterHeader", "Tag",
           "headers_callback", "filter_headers_callback", "TOPIC", "SUBSCRIPTION", "FORMATS", "format_option"]
