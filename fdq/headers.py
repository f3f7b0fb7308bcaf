"""Extend headers: per-message key -> value pairs (NSQ's extend messages).

Names match ``[0-9a-zA-Z_\\-#]+`` (1-``MAX_NAME_CHARS`` characters); values are
JSON-compatible: str, int (64 bits), finite float, bool, None, lists and maps with str
keys, nested at most ``MAX_DEPTH`` levels. Tuples are stored as lists. Names starting
``##`` are FDQ's: ``##client_dispatch_tag`` (tag dispatch: a tag is a non-empty string
of the name characters) and ``##trace_id`` (a string of digits is echoed in the
``PushResult``); any other ``##`` name is refused. Only extend topics store headers,
except the trace context ones (``PROPAGATION``), stored on every topic. Limits: at most ``MAX_HEADERS``
headers, ``MAX_HEADER_BYTES`` bytes encoded (msgpack, as stored with the message).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping

import msgpack

from .errors import ConfigError, InvalidHeader

NAME_RE = re.compile(r"[0-9a-zA-Z_\-#]+")      # used with fullmatch: "a\n" is no name
DISPATCH_TAG = "##client_dispatch_tag"
TRACE_ID = "##trace_id"
RESERVED = frozenset({DISPATCH_TAG, TRACE_ID})
# Trace context (W3C Trace Context and Baggage, as OpenTelemetry's default propagators
# write them: fdq.tracing): the headers every topic stores, extend support or not (a
# plain topic refuses any other header; its NSQ clients get no headers).
PROPAGATION = frozenset({"traceparent", "tracestate", "baggage"})
MAX_HEADERS = 64
MAX_HEADER_BYTES = 8192
MAX_NAME_CHARS = 128
MAX_DEPTH = 8
_DIGITS = re.compile(r"[0-9]+")


def _check_value(name, value, depth=0):
    """A checked copy of ``value`` (so a caller mutating its list later changes nothing)."""
    if depth > MAX_DEPTH:
        raise InvalidHeader(f"header {name!r}: value nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _check_str(name, value)
    if isinstance(value, int):
        if not -2**63 <= value < 2**64:
            raise InvalidHeader(f"header {name!r}: integer {value} does not fit 64 bits")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidHeader(f"header {name!r}: {value} is not a JSON number")
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_check_value(name, v, depth + 1) for v in value]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidHeader(f"header {name!r}: map keys must be strings, not {k!r}")
            out[_check_str(name, k)] = _check_value(name, v, depth + 1)
        return out
    raise InvalidHeader(f"header {name!r}: {type(value).__name__} is not a JSON-compatible value")


def _check_str(name, s: str) -> str:
    """``s`` if it encodes to UTF-8 (a lone surrogate, e.g. from surrogateescape, does not)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidHeader(f"header {name!r}: string {s!r} is not valid Unicode ({e.reason} "
                            f"at position {e.start})") from None
    return s


def check_filter_name(name) -> str:
    """A subscription's header filter names a header a message may carry: a valid
    name, not an unknown ``##`` name (every push refuses those, so such a filter would
    drop every message). ConfigError otherwise."""
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or not NAME_RE.fullmatch(name):
        raise ConfigError(f"filter_headers: invalid header name {name!r}: use 1-{MAX_NAME_CHARS} "
                          "characters of [0-9a-zA-Z_-#]")
    if name.startswith("##") and name not in RESERVED:
        raise ConfigError(f"filter_headers: header {name!r} can never be on a message (names starting "
                          f"'##' are reserved; known: {', '.join(sorted(RESERVED))}): the filter would "
                          "drop every message")
    return name


def check_filter_value(name: str, value) -> str:
    """A header filter's value: a str (a header's text, or a non-string header's JSON
    text) that a header could hold: valid Unicode, at most ``MAX_HEADER_BYTES`` bytes."""
    if not isinstance(value, str):
        raise ConfigError(f"filter_headers: value of {name!r} must be a str, not {value!r}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ConfigError(f"filter_headers: value of {name!r} is not valid Unicode ({e.reason} "
                          f"at position {e.start})") from None
    if size > MAX_HEADER_BYTES:
        raise ConfigError(f"filter_headers: value of {name!r} is {size:,} bytes: a message's headers "
                          f"are at most {MAX_HEADER_BYTES:,} bytes, so the filter would drop every message")
    return value


def is_tag(value) -> bool:
    """Whether ``value`` is a valid dispatch tag."""
    return isinstance(value, str) and len(value) <= MAX_NAME_CHARS and NAME_RE.fullmatch(value) is not None


def check_tag(tag, what: str = "desired_tag") -> str:
    """A consumer's ``desired_tag``: the same rule as a message's dispatch tag."""
    if not is_tag(tag):
        raise ConfigError(f"{what} must be a non-empty string of 1-{MAX_NAME_CHARS} characters "
                          f"of [0-9a-zA-Z_-#], not {tag!r}")
    return tag


_SIMPLE = frozenset({str, bool, type(None), int, float})
_VALID_NAMES = set()   # names seen valid (bounded): most messages repeat the same few


def _name_ok(name) -> bool:
    ok = (isinstance(name, str) and len(name) <= MAX_NAME_CHARS and NAME_RE.fullmatch(name) is not None
          and (not name.startswith("##") or name in RESERVED))
    if ok and len(_VALID_NAMES) < 4096:
        _VALID_NAMES.add(name)
    return ok


def validate_headers(headers) -> dict:
    """Check names, values and size; returns a plain dict copy. Raises InvalidHeader
    naming the first bad header (or, over the size limit, the largest one)."""
    if type(headers) is not dict and not isinstance(headers, Mapping):
        raise InvalidHeader(f"headers must be a mapping, not {type(headers).__name__}")
    if len(headers) > MAX_HEADERS:
        raise InvalidHeader(f"{len(headers)} headers: at most {MAX_HEADERS} are allowed")
    out = dict(headers)
    # Fast path, in C calls: known names, flat values (msgpack refuses ints over 64 bits).
    types = set(map(type, out.values()))
    if _VALID_NAMES.issuperset(out) and _SIMPLE.issuperset(types):
        try:
            size = len(msgpack.packb(out, use_bin_type=True))
        except (OverflowError, UnicodeEncodeError):
            size = -1       # the slow path names the header
        if 0 <= size <= MAX_HEADER_BYTES \
                and (float not in types or all(math.isfinite(v) for v in out.values() if type(v) is float)) \
                and (DISPATCH_TAG not in out or is_tag(out[DISPATCH_TAG])):
            return out
    return _validate_slow(headers)


def _validate_slow(headers) -> dict:
    out = {}
    for name, value in headers.items():
        if not _name_ok(name):
            if isinstance(name, str) and name.startswith("##") and NAME_RE.fullmatch(name) \
                    and len(name) <= MAX_NAME_CHARS:
                raise InvalidHeader(f"header {name!r}: names starting '##' are reserved "
                                    f"(known: {', '.join(sorted(RESERVED))})")
            raise InvalidHeader(f"invalid header name {name!r}: use 1-{MAX_NAME_CHARS} characters of "
                                "[0-9a-zA-Z_-#]")
        if name == DISPATCH_TAG and not is_tag(value):
            raise InvalidHeader(f"header {DISPATCH_TAG!r}: the tag must be a non-empty string of "
                                f"1-{MAX_NAME_CHARS} characters of [0-9a-zA-Z_-#], not {value!r}")
        out[name] = _check_value(name, value)
    size = len(msgpack.packb(out, use_bin_type=True))
    if size > MAX_HEADER_BYTES:
        largest = max(out, key=lambda k: len(msgpack.packb({k: out[k]}, use_bin_type=True)))
        raise InvalidHeader(f"headers encode to {size:,} bytes: at most {MAX_HEADER_BYTES:,} are "
                            f"allowed (largest: header {largest!r})")
    return out


def dispatch_tag(headers) -> str:
    """The message's dispatch tag ("" for untagged messages)."""
    if not headers:
        return ""
    return headers.get(DISPATCH_TAG) or ""


def trace_id(headers) -> str | None:
    """``##trace_id`` when it is a string of ASCII digits or a non-negative integer
    (echoed by push, as a string), else None."""
    if not headers:
        return None
    t = headers.get(TRACE_ID)
    if isinstance(t, int) and not isinstance(t, bool) and t >= 0:
        return str(t)
    return t if isinstance(t, str) and _DIGITS.fullmatch(t) else None
