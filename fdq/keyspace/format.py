"""The layout's version (``meta/format`` under the root) and the connect that checks it.

The engine only opens databases; :func:`connect` (``fdq.connect``) opens one and, within
``CONNECT_TIMEOUT_S``, refuses a layout newer than this FDQ knows. The first topic
created records the version (``ensure_format`` with ``write=True``).
"""
from __future__ import annotations

import fdb.tuple as fdbtuple

from ..engine import connection, run_within, transactional
from ..errors import ConnectError, EngineError, FormatError
from . import Keyspace

FORMAT_VERSION = 1


@transactional
def ensure_format(tr, ks: Keyspace, *, write: bool = True) -> int | None:
    """Refuse a newer layout than this FDQ knows; write ``meta/format`` on first use
    (``write=False``, as on connect: check only, an empty database stays empty)."""
    raw = tr[ks.format_key]
    if raw == None:  # noqa: E711
        if not write:
            return None
        tr[ks.format_key] = fdbtuple.pack((FORMAT_VERSION,))
        return FORMAT_VERSION
    return _layout_version(bytes(raw))


def _layout_version(raw: bytes) -> int:
    """The version ``meta/format`` holds: exactly one int of 1..FORMAT_VERSION packed as
    a tuple. A newer one asks for a newer FDQ; anything else is not FDQ's, or damaged."""
    try:
        value = fdbtuple.unpack(raw)
    except Exception as e:  # the tuple layer raises ValueError, IndexError, struct.error...
        value, cause = None, f"does not decode ({type(e).__name__}: {_short(str(e))})"
    else:
        cause = None
    if value is not None:
        if len(value) != 1 or type(value[0]) is not int:
            cause = f"decodes to {_short(repr(value))}"
        elif value[0] > FORMAT_VERSION:
            raise FormatError(f"database key layout is format {value[0]}; this FDQ understands up "
                              f"to {FORMAT_VERSION}: upgrade FDQ")
        elif value[0] < 1:
            cause = f"decodes to {value[0]}"
        else:
            return value[0]
    raise FormatError(f"meta/format holds {_short(repr(raw))}, which {cause}: not an FDQ layout "
                      f"version (1..{FORMAT_VERSION}); this database was not written by FDQ, or it is "
                      "damaged: use another database, or restore a backup")


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def connect(url: str | None = None, *, check_format: bool = True):
    """Open the database named by ``url`` (default: ``fdq.engine.default_url()``):
    FDB's ``Database`` for ``fdb://``, the embedded engine's for ``sqlite://``; then
    check FDQ's layout version (unless ``check_format=False``), bounded: an unreachable
    cluster answers nothing. Raises
    :class:`fdq.errors.ConnectError` naming the URL and the cause, and
    :class:`fdq.errors.FormatError` for a database of a newer layout."""
    db = connection.connect(url)
    if not check_format:
        return db
    timeout_s = connection.CONNECT_TIMEOUT_S
    try:
        run_within(db, int(timeout_s * 1000), ensure_format, Keyspace(), write=False)
    except FormatError as e:
        raise FormatError(f"{connection.describe_url(url)}: {e}") from None
    except EngineError as e:
        if e.code != 1031:
            raise
        raise ConnectError(f"{connection.describe_url(url)}: no answer within {timeout_s:g} s: is the "
                           "database running and reachable from here?") from None
    return db
