"""Time arguments (replay windows, reset points, trims): bad ones are refused and harm
nothing."""
from __future__ import annotations

import pytest

import fdq

from fdqtest import replay_counts


def test_bad_times_are_refused_and_harm_nothing(db):
    """Replay, reset and trim times: NaN and infinities raised ValueError or
    OverflowError (not an FDQError), a window past int64 an OverflowError midway, a
    window ending before it starts replayed nothing silently, and trim(before_ms=NaN)
    deleted the whole log (no entry compares as newer than NaN)."""
    import datetime
    sup = fdq.Supervisor(db)
    p = fdq.Producer(db)
    ids = [p.push("t", f"m{i}".encode()).id for i in range(4)]
    for bad in (float("nan"), float("inf"), -float("inf"), 10**30, "2026-01-01", True):
        with pytest.raises(fdq.ConfigError, match="time must be"):
            p.replay("t", bad)
        with pytest.raises(fdq.ConfigError, match="time must be"):
            p.replay("t", 0, bad)
        with pytest.raises(fdq.ConfigError, match="time must be"):
            sup.reset("t", "default", bad)
        with pytest.raises(fdq.ConfigError, match="time must be"):
            sup.trim("t", before_ms=bad)
    with pytest.raises(fdq.ConfigError, match="ends .* before it starts"):
        p.replay("t", 1_795_399_200_000, 1_795_399_100_000)
    # epoch seconds where milliseconds are meant (time.time()) would replay, or rewind
    # to, the start of the log: refused, naming both readings
    secs = 1_795_399_200
    for call in (lambda: p.replay("t", secs), lambda: p.replay("t", 0, secs + 0.5),
                 lambda: sup.reset("t", "default", secs), lambda: sup.trim("t", before_ms=secs)):
        with pytest.raises(fdq.ConfigError, match=r"looks like epoch seconds .*1970-01-21.*pass 1795399200[05]00 "):
            call()
    assert sup.stats("t")["counters"]["inserted"] == 4 and replay_counts(db, "t") == {}
    assert sup.stats("t")["subscriptions"]["default"]["backlog"] == 4
    with pytest.raises(fdq.TopicNotFound):
        p.replay("nope", 0)
    # datetimes, aware in any zone or naive (UTC), mean the same instant
    now = datetime.datetime.now(datetime.timezone.utc)
    east = (now - datetime.timedelta(minutes=1)).astimezone(datetime.timezone(datetime.timedelta(hours=5)))
    assert p.replay("t", east, now) == 4
    # the same window, so the same replay: already finished (with 4)
    again = sup.replay("t", (now - datetime.timedelta(minutes=1)).replace(tzinfo=None), now)
    assert (again.replayed, again.finished["count"]) == (0, 4)
    assert sup.trim("t", before_ms=now - datetime.timedelta(hours=1)) == 0
    assert set(replay_counts(db, "t")) == set(ids)
