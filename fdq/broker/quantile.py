"""End-to-end processing latency percentiles, as nsqd's ``e2e_processing_latency``
in /stats: the time from a message's publication to its FIN, over a moving window
(``--e2e-processing-latency-window-time``, default 10 minutes), at the quantiles given
by ``--e2e-processing-latency-percentile`` (none by default: nothing is recorded and
/stats shows ``{"count": 0, "percentiles": null}``).

As nsqd's internal/quantile, two half-window buckets: samples go to the current one,
which becomes the previous one every half window, so the result covers the last half
window to full window. Each bucket keeps at most ``MAX_SAMPLES`` samples (a uniform
reservoir past that), so memory is bounded whatever the rate; ``count`` is exact."""
from __future__ import annotations

import random
import time

MAX_SAMPLES = 4096


class _Bucket:
    __slots__ = ("count", "samples")

    def __init__(self):
        self.count = 0
        self.samples = []

    def add(self, value):
        self.count += 1
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(value)
        else:
            i = random.randrange(self.count)
            if i < MAX_SAMPLES:
                self.samples[i] = value


class Quantile:
    def __init__(self, percentiles: tuple = (), window_s: float = 600.0):
        self.percentiles = tuple(percentiles)
        self.half = window_s / 2
        self._buckets = [_Bucket(), _Bucket()]
        self._moved = time.monotonic()

    def _rotate(self):
        now = time.monotonic()
        elapsed = now - self._moved
        if elapsed >= 2 * self.half:          # idle for a whole window: both stale
            self._buckets = [_Bucket(), _Bucket()]
            self._moved = now
        elif elapsed >= self.half:
            self._buckets = [self._buckets[1], _Bucket()]
            self._moved += self.half

    def add(self, latency_ns: int):
        if not self.percentiles:
            return
        self._rotate()
        self._buckets[1].add(latency_ns)

    def samples(self) -> tuple:
        """(count, samples) over the window."""
        self._rotate()
        a, b = self._buckets
        return a.count + b.count, a.samples + b.samples


def result(percentiles: tuple, parts: list) -> dict:
    """nsqd's quantile.Result of the (count, samples) ``parts`` merged: ``{"count": n,
    "percentiles": [{"quantile": q, "value": ns}, ...]}`` (``null`` if not tracked)."""
    if not percentiles:
        return {"count": 0, "percentiles": None}
    count = sum(c for c, _s in parts)
    values = sorted(v for _c, s in parts for v in s)
    out = []
    for q in percentiles:
        if values:
            v = float(values[min(len(values) - 1, max(0, int(round(q * len(values))) - 1))])
        else:
            v = 0.0
        out.append({"quantile": q, "value": v})
    return {"count": count, "percentiles": out}


__all__ = ["Quantile", "result", "MAX_SAMPLES"]
