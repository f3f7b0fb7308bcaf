"""Subscription options in delivery: ordered retries, max_ack_pending, filters,
ack_policy none, the stall alarm, updates picked up by live consumers."""
import random
import threading
import time

import pytest

import fdq
from fdq.keyspace.codec import shard_of

from fdqtest import fast, fetch_ids, wait_for


# The subscription tests' consumer: FAST with slower polls and lease checks.
SUBS_FAST = fast(lease_check_interval_s=0.2, poll_interval_s=0.1)

KEYS = [f"k{i}" for i in range(6)]
PER_KEY = 25


def _push_keys(db, topic):
    envs = [fdq.Envelope(f"{k}:{s}".encode(), shard_key=k) for s in range(PER_KEY) for k in KEYS]
    fdq.Producer(db).push_many(topic, envs)


def _run_random_naks(db, sub, ordered, seed):
    sup = fdq.Supervisor(db)
    sup.create_subscription("t", sub, fdq.SubscriptionConfig(ordered=ordered, max_deliver=1000,
                                                             deliver_policy="new"))
    rng = random.Random(seed)
    lock = threading.Lock()
    acked = []          # (monotonic time, key, seq)
    held = {}           # k0's first message: nak'd once for a long delay

    def handler(m):
        key, seq = m.body.decode().split(":")
        seq = int(seq)
        with lock:
            if key == "k0" and seq == 0 and "t" not in held:
                held["t"] = time.monotonic()
                m.nak(1.5)
                return
            if rng.random() < 0.3:
                m.nak(rng.choice([0, 0.02, 0.05]))
                return
            acked.append((time.monotonic(), key, seq))
    c = fdq.tail(db, "t", handler, subscription=sub, batch_size=10,
                 config=SUBS_FAST, create=False)
    try:
        _push_keys(db, "t")
        wait_for(lambda: len(acked) >= len(KEYS) * PER_KEY, timeout=90, what=f"{sub}: every message acked")
    finally:
        c.shutdown()
    return acked, held["t"]


def test_ordered_retries_keep_per_key_order_while_other_keys_flow(db):
    fdq.Supervisor(db).create_topic("t", shards=2)
    acked, held_at = _run_random_naks(db, "ordered", True, seed=7)
    by_key = {k: [s for _t, kk, s in acked if kk == k] for k in KEYS}
    for k in KEYS:
        assert by_key[k] == list(range(PER_KEY)), f"{k}: acked out of order or twice: {by_key[k]}"
    # While k0's first message waited 1.5 s for redelivery, other keys (including those
    # on k0's own shard) kept flowing: no head-of-line blocking across keys.
    k0_first_ack = next(t for t, k, s in acked if k == "k0")
    assert k0_first_ack - held_at >= 1.0
    same_shard = [k for k in KEYS[1:] if shard_of(k, 2) == shard_of("k0", 2)]
    assert same_shard, "the test needs another key on k0's shard"
    during = {k for t, k, _s in acked if held_at < t < k0_first_ack}
    assert set(same_shard) <= during, f"keys {set(same_shard) - during} blocked behind k0"
    assert not [s for t, k, s in acked if k == "k0" and t < k0_first_ack]


def test_without_ordered_redelivery_overtakes(db):
    """The control: the same random naks without ordered=True reorder keys."""
    fdq.Supervisor(db).create_topic("t", shards=2)
    acked, _ = _run_random_naks(db, "unordered", False, seed=7)
    by_key = {k: [s for _t, kk, s in acked if kk == k] for k in KEYS}
    assert any(v != sorted(v) for v in by_key.values())


def _leased_per_shard(db, ts, sub, shards):
    tr = db.create_transaction()
    out = {}
    for n in range(shards):
        out[n] = sum(len(lr.entries) for _k, lr in fdq.ops.queue.read_leases(tr.snapshot, ts.shard(sub, "", n)))
    tr.cancel()
    return out


def test_max_ack_pending_per_shard_pull(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    sup.create_subscription("t", "fc", fdq.SubscriptionConfig(max_ack_pending=3, deliver_policy="new"))
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"x", shard_key=f"k{i}") for i in range(100)])
    c = fdq.Consumer(db, "t", subscription="fc", create=False, config=SUBS_FAST)
    try:
        got = c.fetch(100, timeout=0.5)
        per = {}
        for m in got:
            per[m.shard] = per.get(m.shard, 0) + 1
        assert per and max(per.values()) == 3 and len(got) == 3 * len(per) == 12
        assert c.fetch(100, timeout=0.3) == []            # at the limit: nothing more
        first = [m for m in got if m.shard == got[0].shard][:2]
        c.ack_many(first)                                   # room for 2 in that shard only
        more = c.fetch(100, timeout=0.5)
        assert len(more) == 2 and {m.shard for m in more} == {got[0].shard}
        c.ack_many([m for m in got if m not in first] + more)
    finally:
        c.close()


def test_max_ack_pending_never_exceeded_under_concurrency(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    sup.create_subscription("t", "fc", fdq.SubscriptionConfig(max_ack_pending=2, deliver_policy="new"))
    ts = sup.keyspace.topic("t")
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"x", shard_key=f"k{i}") for i in range(300)])
    done = []
    cfg = fast(SUBS_FAST, max_concurrency=4)
    consumers = [fdq.tail(db, "t", lambda m: (time.sleep(0.002), done.append(1)), subscription="fc",
                          batch_size=50, config=cfg, create=False) for _ in range(2)]
    peak = 0
    try:
        deadline = time.monotonic() + 90
        while len(done) < 300 and time.monotonic() < deadline:
            peak = max(peak, max(_leased_per_shard(db, ts, "fc", 4).values()))
            time.sleep(0.005)
    finally:
        for c in consumers:
            c.shutdown()
    assert len(done) >= 300
    assert 1 <= peak <= 2, f"a shard had {peak} unacked messages (max_ack_pending=2)"


def test_filters(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, extend=True)
    sup.create_subscription("t", "eu", fdq.SubscriptionConfig(filter_shard_key="eu-*"))
    sup.create_subscription("t", "kind", fdq.SubscriptionConfig(filter_headers={"kind": "a"}))
    p = fdq.Producer(db)
    p.push_many("t", [fdq.Envelope(b"1", shard_key="eu-1", headers={"kind": "a"}),
                      fdq.Envelope(b"2", shard_key="us-1", headers={"kind": "a"}),
                      fdq.Envelope(b"3", shard_key="eu-2", headers={"kind": "b"}),
                      fdq.Envelope(b"4"),
                      fdq.Envelope(b"5", shard_key="eu-3")])

    def bodies(sub):
        c = fdq.Consumer(db, "t", subscription=sub, create=False, extend_support=True)
        try:
            ms = c.fetch(100, timeout=0.3)
            c.ack_many(ms)
            return sorted(m.body for m in ms)
        finally:
            c.close()
    assert bodies("eu") == [b"1", b"3", b"5"]
    assert bodies("kind") == [b"1", b"2"]
    st = sup.stats("t")["subscriptions"]
    assert st["eu"]["backlog"] == 0 and st["kind"]["backlog"] == 0


def test_filter_on_any_valid_header_name(db):
    """A filter names any header a message may carry: names of up to
    fdq.headers.MAX_NAME_CHARS (128) characters, not only up to 64."""
    from fdq.headers import MAX_NAME_CHARS
    name = "h" * MAX_NAME_CHARS
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, extend=True)
    sup.create_subscription("t", "long", fdq.SubscriptionConfig(filter_headers={name: "a"}))
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"1", headers={name: "a"}),
                                     fdq.Envelope(b"2", headers={name: "b"})])
    c = fdq.Consumer(db, "t", subscription="long", create=False, extend_support=True)
    try:
        ms = c.fetch(100, timeout=0.3)
        c.ack_many(ms)
        assert [m.body for m in ms] == [b"1"]
    finally:
        c.close()


def test_ack_policy_none_delivers_at_most_once(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "fire", fdq.SubscriptionConfig(ack_policy="none", deliver_policy="new"))
    with pytest.raises(fdq.ConfigError, match="acking=True needs ack_policy='explicit'"):
        fdq.tail(db, "t", lambda m: None, acking=True, subscription="fire")
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"x") for _ in range(10)])
    got = []

    def handler(m):
        got.append(m)
        raise RuntimeError("not redelivered: ack_policy none")
    c = fdq.tail(db, "t", handler, subscription="fire", config=SUBS_FAST, on_error=lambda e: None)
    try:
        wait_for(lambda: len(got) >= 10, what="10 deliveries")
        time.sleep(0.5)
        assert len(got) == 10
    finally:
        c.shutdown()
    s = sup.stats("t")["subscriptions"]["fire"]
    assert s["backlog"] == 0 and s["in_flight"] == 0
    pull = fdq.Consumer(db, "t", subscription="fire")
    fdq.Producer(db).push("t", b"y")
    ms = pull.fetch(10, timeout=1.0)
    with pytest.raises(fdq.FDQError, match="not leased"):
        ms[0].ack()
    pull.close()


def test_a_consumer_beyond_the_shard_count_is_on_standby_not_stalled(db, sup):
    """With more consumers than shards, one owns none: that is standby (it takes a shard
    when one frees), shown in stats, and no ``ConsumerStalled`` alarm for owning no
    shard (it was reported as a stall after 3 heartbeats). A heartbeat that a loaded
    host delays past 3 intervals is a stall of another kind, reported as such: not
    what this pins."""
    sup.create_topic("t", shards=1)
    errors = {"a": [], "b": []}
    a = fdq.Consumer(db, "t", config=SUBS_FAST, consumer_id="a", on_error=errors["a"].append)
    b = fdq.Consumer(db, "t", config=SUBS_FAST, consumer_id="b", on_error=errors["b"].append)
    try:
        busy, idle = (a, b) if a.owned_shards else (b, a)
        row = lambda cid: next(c for c in sup.stats("t")["subscriptions"]["default"]["consumers"]  # noqa: E731
                               if c["id"] == cid)
        start = row(idle.id)["heartbeats"]
        wait_for(lambda: row(idle.id)["heartbeats"] >= start + 5, timeout=20,
                 what="5 heartbeats of the idle consumer (past the 3 of the stall alarm)")
        assert idle.owned_shards == [] and row(idle.id)["standby"] and not row(busy.id)["standby"]
        assert sup.stats("t")["subscriptions"]["default"]["standby"] == 1
        assert not [e for es in errors.values() for e in es
                    if isinstance(e, fdq.ConsumerStalled) and "owns no shard" in str(e)], errors
        busy.close()
        wait_for(lambda: idle.owned_shards, timeout=10, what="the standby consumer to take the freed shard")
        assert sup.stats("t")["subscriptions"]["default"]["standby"] == 0
    finally:
        a.close()
        b.close()


def test_update_is_picked_up_and_fixed_fields_refused(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    sup.create_subscription("t", "s", fdq.SubscriptionConfig(max_ack_pending=1))
    c = fdq.Consumer(db, "t", subscription="s", config=SUBS_FAST)
    try:
        new = sup.update_subscription("t", "s", max_ack_pending=5, ack_wait_s=7.0, description="x")
        assert new.max_ack_pending == 5
        wait_for(lambda: c.sub_config == new and c.config.ack_wait_s == 7.0, timeout=10,
                 what="the consumer applying the update")
        with pytest.raises(fdq.ConfigError, match="cannot update deliver_policy, ordered"):
            sup.update_subscription("t", "s", ordered=True, deliver_policy="new")
        with pytest.raises(fdq.ConfigError, match="backoff_s has 6 entries but max_deliver is 5"):
            sup.update_subscription("t", "s", max_deliver=5, backoff_s=(1,) * 6)
    finally:
        c.close()


def test_stall_alarm_when_the_database_is_unreachable(db, url, db_path):
    """Another process holds SQLite's exclusive lock: nothing of the consumer's reaches
    the database; after 3 heartbeats the alarm fires, and it clears once the lock goes."""
    import sqlite3
    fdq.Supervisor(db).create_topic("t", shards=1)
    errors = []
    c = fdq.Consumer(db, "t", config=SUBS_FAST, on_error=errors.append)
    try:
        time.sleep(0.5)
        assert not [e for e in errors if isinstance(e, fdq.ConsumerStalled)]
        lock = sqlite3.connect(str(db_path), isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            wait_for(lambda: [e for e in errors if isinstance(e, fdq.ConsumerStalled)], timeout=20,
                     what="the stall alarm")
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        stalls = [e for e in errors if isinstance(e, fdq.ConsumerStalled)]
        assert "has not completed a heartbeat" in str(stalls[0])
        wait_for(lambda: not c._member.stall_reported, timeout=20, what="recovery")
    finally:
        c.close()


def test_ordered_holds_a_key_while_its_lease_expires(db):
    """Pull consumer: k0's first message is leased and never settled. Until its lease
    expires and it is redelivered and acked, no later k0 message is delivered; other
    keys keep flowing."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    sup.create_subscription("t", "o", fdq.SubscriptionConfig(ordered=True, ack_wait_s=1.0, max_deliver=10))
    fdq.Producer(db).push_many("t", [fdq.Envelope(f"{k}:{s}".encode(), shard_key=k)
                                     for s in range(5) for k in ("k0", "k1", "k2")])
    c = fdq.Consumer(db, "t", subscription="o", create=False, config=SUBS_FAST)
    try:
        first = c.fetch(100, timeout=1)
        assert sorted(m.body for m in first) == [b"k0:0", b"k1:0", b"k2:0"]   # one per key
        held = next(m for m in first if m.body == b"k0:0")
        delivered = []
        for m in first:
            if m is not held:
                m.ack()
        # k1 and k2 flow to the end while k0:0 stays leased and unsettled
        deadline = time.monotonic() + 0.8
        while time.monotonic() < deadline:
            for m in c.fetch(100, timeout=0.05):
                delivered.append(m.body)
                if m.body == b"k0:0":
                    break
                m.ack()
        assert not [b for b in delivered if b.startswith(b"k0")], delivered
        assert {b for b in delivered if not b.startswith(b"k0")} == {f"{k}:{s}".encode() for k in ("k1", "k2")
                                                                        for s in range(1, 5)}
        # the lease expires: k0:0 comes back (attempt 2) before any later k0 message
        again = wait_for(lambda: c.fetch(100, timeout=0.1), timeout=20, what="redelivery")
        assert [m.body for m in again] == [b"k0:0"] and again[0].attempts == 2
        order = []
        m = again[0]
        while m is not None:
            order.append(m.body)
            m.ack()
            nxt = c.fetch(100, timeout=1.0)
            assert len(nxt) <= 1
            m = nxt[0] if nxt else None
        assert order == [f"k0:{s}".encode() for s in range(5)]
        with pytest.raises(fdq.LeaseLost):
            held.ack()
    finally:
        c.close()


def test_consumers_of_a_deleted_subscription_are_told(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "s")
    errors = []
    c = fdq.Consumer(db, "t", subscription="s", config=SUBS_FAST, on_error=errors.append)
    try:
        sup.delete_subscription("t", "s")
        wait_for(lambda: [e for e in errors if isinstance(e, fdq.SubscriptionNotFound)], timeout=10,
                 what="SubscriptionNotFound reported")
        stall = wait_for(lambda: [e for e in errors if isinstance(e, fdq.ConsumerStalled)], timeout=10,
                         what="the stall alarm")
        assert "SubscriptionNotFound" in str(stall[0])
        assert "s" not in sup.config("t").subs     # the consumer did not resurrect it
    finally:
        c.close()


def test_filter_matches_a_non_string_header_by_its_json_text(db):
    """Header values are JSON values and ``fdq push --header flag=true`` stores true; a
    filter ``flag=true`` compared it with Python's ``str(True)`` ("True"), so the message
    was dropped as filtered (likewise null, lists and maps). A string header matches its
    own text; any other value its compact JSON text."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, extend=True)
    filters = {"flag": ("flag", "true"), "nul": ("n", "null"), "lst": ("l", '[1,"a"]'),
               "map": ("m", '{"x":1}'), "int": ("i", "3"), "flt": ("f", "1.5"), "str": ("s", "eu"),
               "strnum": ("sn", "3")}
    for sub, (name, value) in filters.items():
        sup.create_subscription("t", sub, fdq.SubscriptionConfig(filter_headers={name: value}))
    sup.create_subscription("t", "pyrepr", fdq.SubscriptionConfig(filter_headers={"flag": "True"}))
    r = fdq.Producer(db).push("t", b"x", headers={"flag": True, "n": None, "l": [1, "a"], "m": {"x": 1},
                                                 "i": 3, "f": 1.5, "s": "eu", "sn": "3"})
    for sub in filters:
        assert fetch_ids(db, "t", sub, timeout=0.5, extend_support=True) == [r.id], f"filter {filters[sub]} did not match"
    assert fetch_ids(db, "t", "pyrepr", timeout=0.5, extend_support=True) == []
