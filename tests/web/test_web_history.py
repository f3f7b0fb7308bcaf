"""``fdq.web.history``: rates from counters between samples, and what changed between two
samples (joins, zombies, leaves, shards moving), from ``Supervisor.stats``-shaped input."""
from __future__ import annotations

from fdq.web.history import History
from fdqtest import wait_for


def stats(inserted, acked, owners, consumers=(), backlog=0):
    """A ``Supervisor.stats`` result with one subscription ``default`` whose shards are
    owned as ``owners`` (a list: owner of shard n) by ``consumers`` ((id, zombie, age))."""
    return {"topic": "t", "config": {}, "counters": {"inserted": inserted, "acked": acked},
            "subscriptions": {"default": {
                "backlog": backlog, "in_flight": 0, "lag_ms": 1500,
                "consumers": [{"id": cid, "zombie": zombie, "heartbeat_age_s": age} for cid, zombie, age in consumers],
                "shards": [{"tag": "", "shard": n, "owner": o} for n, o in enumerate(owners)]}}}


def test_rates_are_counter_differences_over_the_monotonic_time_between_samples():
    h = History(None, interval_s=1.0, keep_s=10.0)
    h.record("t", stats(100, 40, [None]), now_mono=10.0, now_ms=1_000)
    assert h.rates("t") == {"inserted_per_s": None, "acked_per_s": None}
    h.record("t", stats(300, 140, [None], backlog=160), now_mono=12.0, now_ms=3_000)
    assert h.rates("t") == {"inserted_per_s": 100.0, "acked_per_s": 50.0}
    last = h.samples("t")[-1]
    assert (last["backlog"], last["lag_s"], last["subscriptions"]["default"]["backlog"]) == (160, 1.5, 160)
    h.record("t", stats(5, 0, [None]), now_mono=13.0, now_ms=4_000)      # deleted and created again
    assert h.rates("t") == {"inserted_per_s": None, "acked_per_s": None}
    assert [s["time_ms"] for s in h.samples("t", since_ms=1_000)] == [3_000, 4_000]


def test_samples_older_than_the_history_are_dropped():
    h = History(None, interval_s=1.0, keep_s=3.0)
    for i in range(10):
        h.record("t", stats(i, 0, []), now_mono=float(i), now_ms=i * 1000)
    assert [s["time_ms"] for s in h.samples("t")] == [6000, 7000, 8000, 9000]


def test_events_say_who_joined_turned_zombie_was_taken_over_and_where_shards_went():
    h = History(None, interval_s=1.0, keep_s=60.0)
    h.record("t", stats(0, 0, [None] * 4), now_mono=1, now_ms=1)
    assert h.events("t") == []
    h.record("t", stats(0, 0, ["a", "a", "b", "b"], [("a", False, 0.1), ("b", False, 0.1)]), now_mono=2, now_ms=2)
    h.record("t", stats(0, 0, ["a", "a", "b", "b"], [("a", True, 3.5), ("b", False, 0.1)]), now_mono=3, now_ms=3)
    h.record("t", stats(0, 0, ["b", "b", "b", "b"], [("b", False, 0.1)]), now_mono=4, now_ms=4)
    texts = [e["text"] for e in reversed(h.events("t"))]
    assert texts == ["a joined default", "b joined default",
                     "default: shards 0, 1 unowned → a", "default: shards 2, 3 unowned → b",
                     "a is a zombie: heartbeat 3.5 s old",
                     "a was taken over (zombie)", "default: shards 0, 1 a → b"]
    moved = h.events("t")[0]
    assert (moved["kind"], moved["source"], moved["target"], moved["shards"]) == ("moved", "a", "b", [0, 1])


def test_a_topic_gone_from_the_list_is_forgotten():
    class Sup:
        names = ["t", "u"]

        def topics(self):
            return [(n, None) for n in self.names]

        def stats(self, name):
            return stats(1, 0, [None])
    sup = Sup()
    h = History(sup, interval_s=1.0, keep_s=60.0)
    h.sample_all()
    sup.names = ["u"]
    h.sample_all()
    assert h.samples("t") == [] and len(h.samples("u")) == 2


def test_the_sampler_goes_on_after_a_round_fails_with_any_error():
    """One round failing (a database error of the engine's own type, not an FDQError)
    must not end the sampler thread: the charts would stop for good."""
    class Sup:
        calls = 0

        def topics(self):
            return [("t", None)]

        def stats(self, name):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("an engine error of its own type")
            return stats(1, 0, [None])
    h = History(Sup(), interval_s=0.05, keep_s=60.0)
    h.start()
    try:
        wait_for(lambda: len(h.samples("t")) >= 2, 30, what="samples after the failed round")
    finally:
        h.close()
