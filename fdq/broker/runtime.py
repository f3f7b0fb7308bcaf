"""The ``memory`` object of nsqd's ``/stats`` (Go runtime figures) from what CPython
measures. Only measured values are given: a Go client decodes an absent field as zero,
and a zero that claims a measurement would mislead (CPython has no idle/released heap
split and no next-GC size, so ``heap_idle_bytes``, ``heap_released_bytes`` and
``next_gc_bytes`` are left out).

* ``heap_objects``: memory blocks allocated by CPython's allocator (``sys.getallocatedblocks``)
* ``heap_in_use_bytes``: the process's resident set
* ``gc_total_runs``: collections of every generation
* ``gc_pause_usec_100/99/95``: quantiles of the last ``PAUSES`` collections' durations
  (timed with ``gc.callbacks`` from ``record_gc_pauses()`` on; absent until one ran)
"""
from __future__ import annotations

import collections
import gc
import math
import resource
import sys
import time

PAUSES = 1024
_pauses = collections.deque(maxlen=PAUSES)     # microseconds
_started = [None]


def _on_gc(phase, _info):
    if phase == "start":
        _started[0] = time.perf_counter_ns()
    elif _started[0] is not None:
        _pauses.append((time.perf_counter_ns() - _started[0]) / 1000)
        _started[0] = None


def record_gc_pauses():
    """Time every garbage collection from now on (once per process)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024    # the peak, where /proc is not


def _quantile(ordered: list, q: float) -> int:
    return math.ceil(ordered[min(len(ordered) - 1, int(q * len(ordered)))])    # a pause is never 0


def memory() -> dict:
    out = {"heap_objects": sys.getallocatedblocks(), "heap_in_use_bytes": _rss(),
           "gc_total_runs": sum(g["collections"] for g in gc.get_stats())}
    pauses = sorted(_pauses)
    if pauses:
        out.update(gc_pause_usec_100=math.ceil(pauses[-1]), gc_pause_usec_99=_quantile(pauses, 0.99),
                   gc_pause_usec_95=_quantile(pauses, 0.95))
    return out


__all__ = ["memory", "record_gc_pauses"]
