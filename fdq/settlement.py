"""Settlements: what a consumer does with a leased message, as a named type.

``Message.ack()``, ``nak()``, ``term()``, ``in_progress()`` and ``release()`` each make
one :class:`Settlement`; :meth:`fdq.Consumer.settle` commits several in one transaction::

    c.settle([Settlement(m1, Action.ACK), Settlement(m2, Action.NAK, delay_s=5),
              Settlement(m3, Action.TERM, reason="bad payload")])
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .message import Message


class Action(enum.Enum):
    """What a settlement does with its leased message."""

    ACK = "ack"            # done: removed for good
    NAK = "nak"            # redelivered (after ``delay_s``); dead-lettered after max_deliver attempts
    TERM = "term"          # never redelivered: to the dead-letter queue with ``reason``
    TOUCH = "touch"        # still in progress: its ack wait restarts (not a final settlement)
    RELEASE = "release"    # given back uncounted: leased but never handed to a handler


# The members as module names, for FDQ's own hot paths: ``Action.ACK`` is a class
# attribute lookup costing ~0.1 us on CPython 3.11, and a settlement is compared with
# several of them on its way (per delivered message).
ACK, NAK, TERM, TOUCH, RELEASE = Action.ACK, Action.NAK, Action.TERM, Action.TOUCH, Action.RELEASE


class Settlement(NamedTuple):
    """One message's settlement. ``delay_s``: a ``NAK``'s redelivery delay in seconds
    (None or 0: at once); ``reason``: a ``TERM``'s, kept with the dead letter; a
    ``NAK``'s: how the attempt failed (``Message.nak(error=...)``: "failed: ValueError:
    ..."), kept in the dead letter's reason if it was the last one (``max_deliver``).

    A named tuple rather than a frozen dataclass: immutable and named just the same, and
    made once per delivered message on the consuming hot path, where a frozen
    dataclass's ``__init__`` costs about three times as much."""

    message: Message
    action: Action
    delay_s: float | None = None
    reason: str | None = None


__all__ = ["Action", "Settlement"]
