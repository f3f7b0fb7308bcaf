"""What a producer pushes (:class:`Envelope`) and what a push returns (:class:`PushResult`).

An ``Envelope`` checks its fields when made, so a bad one is refused at the call and never
fails the other pushes of a shared transaction.
"""
from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .errors import InvalidMessage
from .headers import validate_headers

MAX_DELAY_S = 10 * 365 * 86400   # (NaN, inf and overflowing delays are refused at the call)
MAX_SHARD_KEY_BYTES = 1024    # a shard key is stored with every copy of its message


def _utf8(what: str, text: str):
    """Refuse a str that has no UTF-8 form (lone surrogates): caught at the call, it
    cannot fail the other pushes of a shared transaction."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidMessage(f"{what} must be valid Unicode (it has no UTF-8 form): {text!r}") from None


@dataclass(frozen=True)
class Envelope:
    """What a producer pushes. ``headers`` is a read-only mapping (extend topics only).
    Limits: ``shard_key`` at most ``MAX_SHARD_KEY_BYTES`` (UTF-8), ``msg_id`` 256
    characters, the body the topic's ``max_message_bytes``."""

    body: bytes
    shard_key: str | None = None
    delay: float | None = None
    msg_id: str | None = None
    headers: Mapping | None = None
    ttl_s: float | None = None      # time to live (None: the topic's ttl_s); a timedelta too

    def __post_init__(self):
        if isinstance(self.body, (bytearray, memoryview)):
            object.__setattr__(self, "body", bytes(self.body))
        if not isinstance(self.body, bytes):
            raise InvalidMessage(f"message body must be bytes, not {type(self.body).__name__}"
                                 + (" (encode the str first)" if isinstance(self.body, str) else ""))
        if self.shard_key is not None:
            if not isinstance(self.shard_key, str):
                raise InvalidMessage(f"shard_key must be a str, not {type(self.shard_key).__name__}")
            if not self.shard_key.isascii():
                _utf8("shard_key", self.shard_key)
            if len(self.shard_key) > MAX_SHARD_KEY_BYTES // 4 and len(self.shard_key.encode()) > MAX_SHARD_KEY_BYTES:
                raise InvalidMessage(f"shard_key of {len(self.shard_key.encode()):,} bytes (UTF-8) exceeds "
                                     f"the limit of {MAX_SHARD_KEY_BYTES:,}")
        if self.msg_id is not None and (not isinstance(self.msg_id, str) or not 0 < len(self.msg_id) <= 256):
            raise InvalidMessage(f"msg_id must be a non-empty str of at most 256 characters, not {self.msg_id!r}")
        if self.msg_id is not None and not self.msg_id.isascii():
            _utf8("msg_id", self.msg_id)
        if isinstance(self.delay, datetime.timedelta):
            object.__setattr__(self, "delay", self.delay.total_seconds())
        if self.delay is not None and (isinstance(self.delay, bool) or not isinstance(self.delay, (int, float))
                                       or not 0 <= self.delay <= MAX_DELAY_S):
            raise InvalidMessage(f"delay must be seconds from 0 to {MAX_DELAY_S:,}, not {self.delay!r}")
        if isinstance(self.ttl_s, datetime.timedelta):
            object.__setattr__(self, "ttl_s", self.ttl_s.total_seconds())
        if self.ttl_s is not None and (isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float))
                                       or not 0 < self.ttl_s <= MAX_DELAY_S):
            raise InvalidMessage(f"ttl must be seconds above 0 up to {MAX_DELAY_S:,}, not {self.ttl_s!r}")
        if self.ttl_s is not None and self.delay and self.ttl_s <= self.delay:
            raise InvalidMessage(f"ttl ({self.ttl_s!r} s) must exceed delay ({self.delay!r} s): the message "
                                 "would expire before it is due")
        if self.headers is not None:
            plain = validate_headers(self.headers)
            object.__setattr__(self, "headers", MappingProxyType(plain))
            object.__setattr__(self, "_plain_headers", plain or None)   # what push encodes: no copy

    _plain_headers = None   # (not a field) the validated headers as a dict, set with headers


@dataclass(frozen=True)
class PushResult:
    """The outcome of one push: ``id`` is the message's id (the first one's, for a
    deduplicated ``msg_id``). When the message's ``##trace_id`` header is a string of
    digits, ``trace_id`` echoes it and ``position`` is the message's position in the
    topic's log (its id: commit versionstamp + index), as NSQ's PUB_EXT response does."""

    id: str
    topic: str
    shard: int
    duplicate: bool = False
    trace_id: str | None = None
    position: str | None = None


_new = object.__new__


def _plain_result(mid: str, topic: str, shard: int) -> PushResult:
    """``PushResult(mid, topic, shard)`` without the frozen dataclass's ``__init__``
    (one ``object.__setattr__`` per field: half of a push_many's result time)."""
    r = _new(PushResult)
    r.__dict__.update(id=mid, topic=topic, shard=shard, duplicate=False, trace_id=None, position=None)
    return r


def _plain_envelope(body: bytes) -> Envelope:
    """``Envelope(body)`` for a ``bytes`` body, without the frozen dataclass's ``__init__``
    and the checks of fields it does not have (``Producer.push`` of one plain message)."""
    e = _new(Envelope)
    e.__dict__.update(body=body, shard_key=None, delay=None, msg_id=None, headers=None, ttl_s=None)
    return e


__all__ = ["Envelope", "PushResult", "MAX_DELAY_S", "MAX_SHARD_KEY_BYTES"]
