"""An interrupted replay reports what it pushed. Ctrl-C lands right after a chunk's commit
as easily as anywhere (``fdq replay``'s own test sends it as soon as the first chunk is
visible): the report must count a chunk that committed before the interrupt surfaced."""
from __future__ import annotations

import pytest

import fdq


def test_an_interrupt_right_after_a_chunk_commits_still_reports_that_chunk(db):
    n = 2500
    p = fdq.Producer(db)
    for i in range(0, n, 500):
        p.push_many("t", [fdq.Envelope(f"m{j}".encode()) for j in range(i, i + 500)])
    sup = fdq.Supervisor(db)
    reported = []

    def progress(k):
        if not reported:
            reported.append(0)      # the first report: interrupted before it counts anything
            raise KeyboardInterrupt
        reported.append(k)

    with pytest.raises(KeyboardInterrupt):
        p.replay("t", 0, progress=progress)
    pushed = sup.stats("t")["counters"]["inserted"] - n
    assert pushed > 0                   # the first chunk committed before the interrupt
    assert sum(reported) == pushed      # and is reported (once)
    # the same call again finishes the window: each message replayed once in all
    assert p.replay("t", 0) + pushed == n
    assert sup.stats("t")["counters"]["inserted"] == 2 * n
