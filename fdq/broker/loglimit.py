"""Log lines that clients can cause, rate-limited: one line a second per kind, and the
count of those suppressed meanwhile on the next line of that kind."""
from __future__ import annotations

import logging
import threading
import time


class LogLimiter:
    """``log(level, kind, msg, *args)``: logged unless a line of ``kind`` was logged less
    than ``interval_s`` ago; then counted, and the next line of that kind says how many
    were suppressed. ``warning(kind, msg, *args)``: at WARNING."""

    def __init__(self, log: logging.Logger, interval_s: float = 1.0, max_kinds: int = 1000):
        self.logger = log
        self.interval_s = interval_s
        self.max_kinds = max_kinds
        self._lock = threading.Lock()
        self._kinds = {}        # kind -> [last logged (monotonic), suppressed since]

    def warning(self, kind: str, msg: str, *args):
        self.log(logging.WARNING, kind, msg, *args)

    def log(self, level: int, kind: str, msg: str, *args):
        if not self.logger.isEnabledFor(level):
            return
        now = time.monotonic()
        with self._lock:
            entry = self._kinds.get(kind)
            if entry is not None and now - entry[0] < self.interval_s:
                entry[1] += 1
                return
            suppressed = entry[1] if entry is not None else 0
            if entry is None and len(self._kinds) >= self.max_kinds:
                self._kinds.clear()     # bounded: kinds are few, but named by clients' input
            self._kinds[kind] = [now, 0]
        if suppressed:
            msg += " (%d similar suppressed)"
            args = (*args, suppressed)
        self.logger.log(level, msg, *args)
