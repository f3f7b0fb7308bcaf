"""Futures and value types of the embedded engine, shaped like FDB's Python binding.

FDB's ``Value`` and ``Key`` are lazy futures that imitate ``bytes``: ``isinstance(v, bytes)``
is True (a faked ``__class__``), comparisons and ``len`` use the resolved value, an absent
value equals ``None`` yet ``v is None`` is False, and ``bytes(v)`` of an absent value
raises ``TypeError``. Read errors surface at first use, as FDB's do.
"""
from __future__ import annotations

import threading

from ..errors import EngineError


class Future:
    """A one-shot result: ``wait()`` returns it or raises the stored error."""

    __slots__ = ("_event", "_result", "_error", "_callbacks", "_lock", "_on_cancel")

    def __init__(self):
        self._event = threading.Event()
        self._result = None
        self._error = None
        self._callbacks = []
        self._lock = threading.Lock()
        self._on_cancel = None

    @staticmethod
    def ready(result=None, error=None) -> "Future":
        return _Ready(result, error)

    def _resolve(self, result=None, error=None) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._result, self._error = result, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)
        return True

    def is_ready(self) -> bool:
        return self._event.is_set()

    def block_until_ready(self):
        self._event.wait()

    def on_ready(self, callback):
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def cancel(self):
        if self._resolve(None, EngineError(1101)) and self._on_cancel:
            self._on_cancel(self)

    def wait(self, timeout: float | None = None):
        """Block until ready. ``timeout`` (seconds) is an FDQ extension: ``None`` if
        it runs out (FDB's futures have no timeout)."""
        if not self._event.wait(timeout):
            return None
        if self._error is not None:
            raise self._error
        return self._result

    @staticmethod
    def wait_for_any(*futures) -> int:
        done = threading.Event()
        for f in futures:
            f.on_ready(lambda _f: done.set())
        done.wait()
        for i, f in enumerate(futures):
            if f.is_ready():
                return i
        raise AssertionError("unreachable")


class _Ready(Future):
    """A future born resolved (commit results, read versions): no Event to build."""

    __slots__ = ()

    def __init__(self, result=None, error=None):
        self._result, self._error = result, error
        self._callbacks = self._lock = self._on_cancel = self._event = None

    def _resolve(self, result=None, error=None):
        return False

    def is_ready(self):
        return True

    def block_until_ready(self):
        pass

    def on_ready(self, callback):
        callback(self)

    def cancel(self):
        pass

    def wait(self, timeout=None):
        if self._error is not None:
            raise self._error
        return self._result


class _BytesFuture:
    """Base of Value and Key: a resolved-or-failed bytes result that imitates bytes."""

    __slots__ = ("_v", "_error")

    def __init__(self, value, error=None):
        self._v = value
        self._error = error

    @property
    def __class__(self):  # noqa: D401 - FDB's binding fakes this the same way
        return bytes

    @property
    def value(self):
        if self._error is not None:
            raise self._error
        return self._v

    def wait(self):
        self.value
        return self

    def is_ready(self):
        return True

    def block_until_ready(self):
        pass

    def as_foundationdb_key(self):
        return self.value

    def as_foundationdb_value(self):
        return self.value

    def __bytes__(self):
        return self.value

    def __str__(self):
        return str(self.value)

    def __repr__(self):
        return repr(self.value)

    def __len__(self):
        return len(self.value)

    def __getitem__(self, i):
        return self.value[i]

    def __hash__(self):
        return hash(self.value)

    def __iter__(self):
        return iter(self.value)

    def __contains__(self, x):
        return x in self.value

    def __add__(self, rhs):
        return self.value + (rhs.value if isinstance(rhs, _BytesFuture) else rhs)

    def __radd__(self, lhs):
        return lhs + self.value

    def __eq__(self, rhs):
        return self.value == (rhs.value if _is_bytes_future(rhs) else rhs)

    def __ne__(self, rhs):
        return not self == rhs

    def __lt__(self, rhs):
        return self.value < (rhs.value if _is_bytes_future(rhs) else rhs)

    def __le__(self, rhs):
        return self.value <= (rhs.value if _is_bytes_future(rhs) else rhs)

    def __gt__(self, rhs):
        return self.value > (rhs.value if _is_bytes_future(rhs) else rhs)

    def __ge__(self, rhs):
        return self.value >= (rhs.value if _is_bytes_future(rhs) else rhs)

    def __int__(self):
        return int(self.value)

    def __getattr__(self, name):
        # bytes methods (startswith, decode, ...) act on the resolved value, as FDB's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.value, name)


def _is_bytes_future(x) -> bool:
    return isinstance(x, _BytesFuture)


class Value(_BytesFuture):
    """The result of ``tr[key]``: bytes-like, or absent (``== None``)."""

    __slots__ = ()

    def present(self) -> bool:
        return self.value is not None


class Key(_BytesFuture):
    """The result of ``tr.get_key(selector)`` or ``tr.get_versionstamp()``."""

    __slots__ = ()


_vs_guard = threading.Lock()


class VersionstampFuture(_BytesFuture):
    """``tr.get_versionstamp()``: resolves to 10 bytes after a successful commit. Its
    Event is built only if someone waits before the commit ends (most callers ask
    after ``commit()`` returns: one Event less per push)."""

    __slots__ = ("_event", "_done")

    def __init__(self):
        super().__init__(None)
        self._event = None
        self._done = False

    def _resolve(self, value=None, error=None):
        self._v, self._error = value, error
        with _vs_guard:
            self._done = True
            event = self._event
        if event is not None:
            event.set()

    def is_ready(self):
        return self._done

    def block_until_ready(self):
        if self._done:
            return
        with _vs_guard:
            if self._done:
                return
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        event.wait()

    @property
    def value(self):
        self.block_until_ready()
        if self._error is not None:
            raise self._error
        return self._v
