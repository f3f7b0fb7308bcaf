"""Extend headers: per-message key -> value pairs (NSQ's extend messages).

Names match ``[0-9a-zA-Z_\\-#]+``; values are JSON-compatible. Names starting ``##``
are FDQ's: ``##client_dispatch_tag`` (tag dispatch) and ``##trace_id``. Limits: at most
``MAX_HEADERS`` headers and ``MAX_HEADER_BYTES`` bytes encoded (msgpack).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping

import msgpack

from .errors import InvalidHeader

NAME_RE = re.compile(r"^[0-9a-zA-Z_\-#]+$")
DISPATCH_TAG = "##client_dispatch_tag"
TRACE_ID = "##trace_id"
RESERVED = frozenset({DISPATCH_TAG, TRACE_ID})
MAX_HEADERS = 64
MAX_HEADER_BYTES = 8192
MAX_NAME_CHARS = 128
MAX_DEPTH = 8


def _check_value(name, value, depth=0):
    if depth > MAX_DEPTH:
        raise InvalidHeader(f"header {name!r}: value nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str, int)):
        if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**64:
            raise InvalidHeader(f"header {name!r}: integer {value} does not fit 64 bits")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidHeader(f"header {name!r}: {value} is not a JSON number")
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_value(name, v, depth + 1)
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidHeader(f"header {name!r}: map keys must be strings, not {k!r}")
            _check_value(name, v, depth + 1)
        return
    raise InvalidHeader(f"header {name!r}: {type(value).__name__} is not a JSON-compatible value")


def validate_headers(headers) -> dict:
    """Check names, values and size; returns a plain dict copy. Raises InvalidHeader
    naming the first bad header."""
    if not isinstance(headers, Mapping):
        raise InvalidHeader(f"headers must be a mapping, not {type(headers).__name__}")
    if len(headers) > MAX_HEADERS:
        raise InvalidHeader(f"{len(headers)} headers: at most {MAX_HEADERS} are allowed")
    out = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not NAME_RE.match(name) or len(name) > MAX_NAME_CHARS:
            raise InvalidHeader(f"invalid header name {name!r}: use 1-{MAX_NAME_CHARS} characters of "
                                "[0-9a-zA-Z_-#]")
        if name.startswith("##") and name not in RESERVED:
            raise InvalidHeader(f"header {name!r}: names starting '##' are reserved "
                                f"(known: {', '.join(sorted(RESERVED))})")
        _check_value(name, value)
        if name == DISPATCH_TAG and (not isinstance(value, str) or not NAME_RE.match(value)):
            raise InvalidHeader(f"header {DISPATCH_TAG!r}: the tag must be a non-empty string of "
                                f"[0-9a-zA-Z_-#], not {value!r}")
        out[name] = value
    size = len(msgpack.packb(out, use_bin_type=True))
    if size > MAX_HEADER_BYTES:
        raise InvalidHeader(f"headers encode to {size:,} bytes: at most {MAX_HEADER_BYTES:,} are allowed")
    return out


def dispatch_tag(headers) -> str:
    """The message's dispatch tag ("" for untagged messages)."""
    if not headers:
        return ""
    return headers.get(DISPATCH_TAG) or ""
