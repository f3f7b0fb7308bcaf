"""Opening a database: ``connect(url)`` and the URLs it takes.

* ``sqlite:///abs/path.db`` (or ``sqlite:rel/path.db``): the embedded engine
  (:mod:`fdq.engine.sqlite`). Query options: ``synchronous=NORMAL|FULL|OFF|EXTRA``,
  ``fault_injection=P``, ``seed=N``.
* ``fdb://`` or ``fdb:///path/to/fdb.cluster``: FoundationDB's own ``Database`` from the
  official binding at API version 730 (see ``API_VERSION``).

Paths are percent-decoded (``%23`` is ``#``, ``%25`` a literal ``%``, ``%3F`` ``?``); a
``#`` is refused, as it would start a fragment and cut the path short.

(Not named ``connect.py``: the package exports the function ``connect``, which would
hide a submodule of that name.)
"""
from __future__ import annotations

import os
import urllib.parse

import fdb

from ..errors import ConnectError, DatabaseCorrupt
from . import sqlite
from .binding import _learn_fdb_types, describe

# 7.3 is FoundationDB's current production line: FDQ asks for API 730 and pins the
# `foundationdb` binding to 7.3.x (setup.cfg), which loads libfdb_c 7.3 (the 8.0 binding
# refuses a 7.3 library). An application that selected an API version itself before FDQ
# connects is accepted from MIN_API_VERSION (get_range_split_points, 4-byte versionstamp
# offsets and the transactional-generator check are all older).
API_VERSION = 730
MIN_API_VERSION = 710
CLIENT_PACKAGE = "foundationdb-clients 7.3.x (.deb/.rpm from github.com/apple/foundationdb/releases)"
CONNECT_TIMEOUT_S = 10.0


def default_url() -> str:
    """``$FDQ_URL``, else the embedded engine at ``$FDQ_HOME/fdq.db`` (``FDQ_HOME``
    defaults to ``$XDG_DATA_HOME/fdq``, i.e. ``~/.local/share/fdq``)."""
    url = os.environ.get("FDQ_URL")
    if url:
        return url
    home = os.environ.get("FDQ_HOME") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "fdq")
    return "sqlite://" + urllib.parse.quote(os.path.abspath(os.path.join(home, "fdq.db")))


def connect(url: str | None = None):
    """Open the database named by ``url`` (default: :func:`default_url`): FDB's
    ``Database`` for ``fdb://``, the embedded engine's for ``sqlite://``. Raises
    :class:`fdq.errors.ConnectError` naming the URL and the cause. (``fdq.connect``,
    :func:`fdq.keyspace.format.connect`, also checks FDQ's layout version.)
    """
    if url is None:
        url = default_url()
        if url.startswith("sqlite://") and not os.environ.get("FDQ_URL"):
            os.makedirs(os.path.dirname(urllib.parse.unquote(urllib.parse.urlsplit(url).path)), exist_ok=True)
    if not isinstance(url, str):
        raise ConnectError(f"database URL must be a string, not {type(url).__name__}")
    if "#" in url:
        raise ConnectError(f"{url!r}: '#' starts a URL fragment: write it %23 "
                           f"({url.replace('#', '%23')})")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "sqlite":
        db = _connect_sqlite(url, parts)
    elif parts.scheme == "fdb":
        db = _connect_fdb(url, parts)
    else:
        raise ConnectError(f"{url!r}: unknown scheme {parts.scheme!r} "
                           "(use sqlite:///path/to/file.db or fdb:///path/to/fdb.cluster)")
    return db


def describe_url(url: str | None) -> str:
    """``url`` (the default one if None) and where its database is, for messages."""
    url = default_url() if url is None else url
    parts = urllib.parse.urlsplit(url)
    where = (f"cluster file {_path(parts) or 'the default'}"
             if parts.scheme == "fdb" else "its file")
    return f"{url!r} ({where})"


def _path(parts) -> str:
    """The file a URL names: its host and path parts, percent-decoded."""
    return urllib.parse.unquote(parts.netloc + parts.path)


def _connect_sqlite(url, parts):
    path = _path(parts)
    if not path:
        raise ConnectError(f"{url!r}: no database file path (sqlite:///path/to/file.db)")
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    options = {}
    known = {"synchronous": str, "fault_injection": float, "seed": int}
    for name, values in query.items():
        if name not in known:
            raise ConnectError(f"{url!r}: unknown option {name!r} (known: {', '.join(known)})")
        try:
            options[name] = known[name](values[-1])
        except ValueError:
            raise ConnectError(f"{url!r}: option {name}={values[-1]!r} is not a valid "
                               f"{known[name].__name__}") from None
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ConnectError(f"{url!r}: directory {directory!r} does not exist")
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        raise ConnectError(f"{url!r}: {path!r} is not readable and writable")
    try:
        return sqlite.Database(path, **options)
    except (ValueError, ConnectError) as e:
        raise ConnectError(f"{url!r}: {e}") from None
    except DatabaseCorrupt:
        raise       # it names the file and what to do
    except Exception as e:  # sqlite3.DatabaseError: not a database, locked, ...
        raise ConnectError(f"{url!r}: cannot open {path!r}: {e}") from None


def _connect_fdb(url, parts):
    cluster_file = _path(parts) or None
    if parts.query:
        names = ", ".join(sorted(urllib.parse.parse_qs(parts.query, keep_blank_values=True)))
        raise ConnectError(f"{url!r}: unknown option(s) {names} (fdb:// takes none: the cluster "
                           "file names the cluster)")
    if cluster_file and not os.access(cluster_file, os.R_OK):
        raise ConnectError(f"{url!r}: cluster file {cluster_file!r} is not readable")
    _select_api_version(fdb, url)
    try:
        db = fdb.open(cluster_file)
    except fdb.FDBError as e:
        raise ConnectError(f"{url!r}: {describe(e)} (code {e.code})") from None
    _learn_fdb_types()
    return db


def _select_api_version(fdb, url):
    """``fdb.api_version(API_VERSION)``, or accept the version the application chose."""
    if fdb.is_api_version_selected():
        chosen = fdb.get_api_version()
        if chosen < MIN_API_VERSION:
            raise ConnectError(f"{url!r}: the application selected FoundationDB API version {chosen} "
                               f"(fdb.api_version); FDQ needs {MIN_API_VERSION} to {API_VERSION}")
        return
    try:
        fdb.api_version(API_VERSION)
    except Exception as e:
        binding = getattr(fdb, "__version__", "?")
        raise ConnectError(
            f"{url!r}: the FoundationDB client library (libfdb_c) cannot be used with the "
            f"'foundationdb' Python package {binding} at API version {API_VERSION} ({e}). "
            f"Install {CLIENT_PACKAGE} with the Python package 'foundationdb>=7.3,<7.4', or use "
            "sqlite:///path.db") from None
