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
    version = fdbtuple.unpack(bytes(raw))[0]
    if version > FORMAT_VERSION:
        raise FormatError(f"database key layout is format {version}; this FDQ understands up "
                          f"to {FORMAT_VERSION}: upgrade FDQ")
    return version


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
    except EngineError as e:
        if e.code != 1031:
            raise
        raise ConnectError(f"{connection.describe_url(url)}: no answer within {timeout_s:g} s: is the "
                           "database running and reachable from here?") from None
    return db
