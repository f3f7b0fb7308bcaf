"""reset(topic, sub, to_time): rewind and fast-forward; leases and the DLQ untouched;
messages pushed during a reset kept exactly once."""
from __future__ import annotations

import threading
import time
from functools import partial

import pytest

import fdq

import fdqtest
from fdqtest import advance_clock, fast, fetch_ids, sub_stats, wait_for


# The subscription tests' consumer: FAST with slower polls and lease checks.
SUBS_FAST = fast(lease_check_interval_s=0.2, poll_interval_s=0.1)
# Everything a subscription delivers until it stays empty for idle_s (acked, unless settle=None).
drain = partial(fdqtest.drain, idle_s=1.0, batch=500, settle="ack_many", create=False, config=SUBS_FAST)


def _push(db, tag, n):
    return [r.id for r in fdq.Producer(db).push_many(
        "t", [fdq.Envelope(f"{tag}{i}".encode(), shard_key=f"k{i % 5}") for i in range(n)])]


def _ids(msgs):
    ids = [m.id for m in msgs]
    assert len(ids) == len(set(ids)), "duplicates"
    return set(ids)


def test_reset_backwards_and_forwards(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=3)
    sup.create_subscription("t", "r")
    a = _push(db, "a", 40)
    time.sleep(0.05)
    t1 = int(time.time() * 1000)
    time.sleep(0.05)
    b = _push(db, "b", 40)
    assert _ids(drain(db, "t", "r", idle_s=0.3)) == set(a + b)
    # Rewind to t1: exactly the messages inserted since.
    sup.reset("t", "r", t1)
    assert _ids(drain(db, "t", "r", idle_s=0.3)) == set(b)
    # Fast-forward to now: what is queued is skipped, new pushes still arrive.
    c = _push(db, "c", 30)
    sup.reset("t", "r")
    assert sup.stats("t")["subscriptions"]["r"]["backlog"] == 0
    d = _push(db, "d", 10)
    assert _ids(drain(db, "t", "r", idle_s=0.3)) == set(d)
    # Rewind to the beginning (a datetime works too), producers pushing meanwhile.
    more = []
    stop = threading.Event()

    def pusher():
        while not stop.is_set() and len(more) < 2000:
            more.extend(_push(db, "e", 5))
    th = threading.Thread(target=pusher)
    th.start()
    try:
        time.sleep(0.1)
        import datetime
        sup.reset("t", "r", datetime.datetime(2000, 1, 1))
        time.sleep(0.1)
    finally:
        stop.set()
        th.join(timeout=60)
    assert more
    assert _ids(drain(db, "t", "r", idle_s=0.5)) == set(a + b + c + d + more)
    # The default subscription was never touched.
    assert sup.stats("t")["subscriptions"]["default"]["backlog"] == len(a + b + c + d + more)


def test_reset_leaves_leases_and_dlq_alone(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    sup.create_subscription("t", "r")
    ids = _push(db, "a", 10)
    c = fdq.Consumer(db, "t", subscription="r")
    try:
        first = c.fetch(2, timeout=1)
        first[1].term("bad")
        sup.reset("t", "r", 0)
        st = sup.stats("t")["subscriptions"]["r"]
        assert st["dlq"] == 1 and st["in_flight"] == 1
        first[0].ack()          # the lease survived the reset: no LeaseLost
        rest = fdqtest.drain(c, first_wait_s=0.3, wait_s=0.3, settle="ack_many")   # until a fetch comes back empty
        # everything but the leased one is queued again (the dead letter included)
        assert _ids(rest) == set(ids) - {first[0].id}
        st = sup.stats("t")["subscriptions"]["r"]
        assert st["in_flight"] == 0 and st["backlog"] == 0 and st["dlq"] == 1
    finally:
        c.close()


def test_reset_purges_delayed_messages_in_pages(db, monkeypatch):
    from fdq.ops import catchup
    monkeypatch.setattr(catchup, "PURGE_SCAN", 3)     # many small pages
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "r")
    p = fdq.Producer(db)
    old = [p.push("t", f"d{i}".encode(), shard_key=f"k{i}", delay=600).id for i in range(10)]
    st = sup.stats("t")["subscriptions"]["r"]
    assert st["delayed"] == 10 and st["backlog"] == 10
    sup.reset("t", "r")                           # fast-forward: the delayed ones go too
    st = sup.stats("t")["subscriptions"]["r"]
    assert st["delayed"] == 0 and st["backlog"] == 0
    later = p.push("t", b"later", delay=600).id  # pushed after the reset: kept, still delayed
    st = sup.stats("t")["subscriptions"]["r"]
    assert st["delayed"] == 1 and st["backlog"] == 1
    # Rewind to the start: every logged message is queued again, once, the one still
    # delayed included; none is due yet, so each waits for its due time (the log keeps
    # it), in pages of the purge as the first time.
    sup.reset("t", "r", 0)
    st = sup.stats("t")["subscriptions"]["r"]
    assert st["delayed"] == 11 and st["backlog"] == 11
    assert drain(db, "t", "r", idle_s=0.3) == []
    from fdq.ops import clock
    from fdq.keyspace import Keyspace
    ck = Keyspace().topic("t").clock_key
    tr = db.create_transaction()
    clock.advance_clock(db, ck, clock.read_clock(tr, ck) + 601_000)   # all due
    got = _ids(drain(db, "t", "r", idle_s=0.3))
    assert got == set(old + [later])
    st = sup.stats("t")["subscriptions"]["r"]
    assert st["delayed"] == 0 and st["backlog"] == 0


_KILLED_RESET = """
import os, signal, sys
import fdq
from fdq.ops import catchup as subs

subs.CHUNK = 20
chunk, calls = subs.catch_up_chunk, []

def dies(*args, **kwargs):      # killed -9 after a few chunks of the rewind's catch-up
    calls.append(1)
    if len(calls) == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return chunk(*args, **kwargs)

subs.catch_up_chunk = dies
fdq.Supervisor(fdq.connect(sys.argv[1])).reset("t", "r", 0)
"""


def test_reset_killed_midway_is_finished_by_live_consumers(db, url, tmp_path):
    """A reset killed -9 midway leaves the subscription catching up (no delivery). Its
    live consumers finish the catch-up: the rewind's messages arrive, each once."""
    import signal
    import subprocess
    import sys
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "r")
    a = _push(db, "a", 200)
    assert _ids(drain(db, "t", "r", idle_s=0.3)) == set(a)
    c = fdq.Consumer(db, "t", subscription="r", create=False, config=SUBS_FAST,
                     on_error=lambda e: None)
    try:
        script = tmp_path / "killed_reset.py"
        script.write_text(_KILLED_RESET)
        proc = subprocess.run([sys.executable, str(script), url], timeout=120, capture_output=True)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        assert "r" in sup.config("t").catchup        # left midway
        got = []

        def step():
            ms = c.fetch(100, timeout=0.2)
            c.ack_many(ms)
            got.extend(ms)
            return len(got) >= len(a)
        wait_for(step, timeout=60, what="the rewind's messages")
        assert _ids(got) == set(a)
        assert not c.fetch(100, timeout=0.5)
        assert "r" not in sup.config("t").catchup
    finally:
        c.close()


_RESET_KILLED_IN_PURGE = """
import os, signal, sys
import fdq
from fdq.ops import catchup as subs


subs.CHUNK = 10
chunk, calls = subs.catch_up_chunk, []

def dies(*args, **kwargs):      # killed -9 after a few chunks of the purge of the old queue
    calls.append(1)
    if len(calls) == 15:
        os.kill(os.getpid(), signal.SIGKILL)
    return chunk(*args, **kwargs)

subs.catch_up_chunk = dies
to = None if sys.argv[2] == "now" else int(sys.argv[2])
fdq.Supervisor(fdq.connect(sys.argv[1])).reset("t", "r", to)
"""


@pytest.mark.parametrize("to", ["now", "0"])
def test_reset_killed_in_its_purge_then_resharded_to_fewer_shards(db, url, tmp_path, to):
    """A reset killed -9 while it purged the old queue shard by shard, then a reshard to
    fewer shards (moving unpurged messages into shards the purge had finished), then
    the catch-up finished: the old messages are purged all the same. A reset to now
    delivered 83 of 400 old ones; a rewind delivered each once but counted 83 of them
    routed twice (a backlog of 83 left for good)."""
    import signal
    import subprocess
    import sys
    from fdq.keyspace import Keyspace
    from fdq.ops.catchup import catch_up
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    sup.create_subscription("t", "r")
    a = _push(db, "a", 400)
    script = tmp_path / "killed_reset.py"
    script.write_text(_RESET_KILLED_IN_PURGE)
    proc = subprocess.run([sys.executable, str(script), url, to], timeout=120, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert "r" in sup.config("t").catchup        # left midway
    sup.pause("t")
    sup.rebalance("t", shards=2)
    sup.play("t")
    catch_up(db, Keyspace().topic("t"), "r")        # as the subscription's consumers do
    expected = set() if to == "now" else set(a)
    assert sup.stats("t")["subscriptions"]["r"]["backlog"] == len(expected)
    assert _ids(drain(db, "t", "r", idle_s=0.3)) == expected
    assert sup.stats("t")["subscriptions"]["r"]["backlog"] == 0


def _queued(db, sub):
    """The ready, delayed and leased messages of ``sub`` by a scan (its backlog, for real)."""
    from fdq.keyspace import Keyspace
    ts = Keyspace().topic("t")
    tr = db.create_transaction()
    r = ts.subs[sub].range()
    return sum(1 for kv in tr.snapshot.get_range(r.start, r.stop)
               if len(ts.subs.unpack(kv.key)) > 4 and ts.subs.unpack(kv.key)[4] in ("ready", "delayed", "leased"))


def test_rewind_over_leases_returned_after_its_purge_counts_them_once(db):
    """A rewind whose purge ran, then leases returned to ready (nak; or expired), then the
    copy from the log (a reset killed between the two, finished later by consumers):
    the copy found those messages not leased and wrote them again at their ready key,
    counting them routed twice: a backlog of 10 left for good after all 50 were
    delivered."""
    from fdq.ops import catchup as subs
    from fdq.keyspace import Keyspace
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "r")
    ids = _push(db, "a", 50)
    ts = Keyspace().topic("t")
    with fdq.Consumer(db, "t", subscription="r", config=fdq.ConsumerConfig(ack_wait_s=30)) as c:
        leased = c.fetch(10, timeout=1)
        assert len(leased) == 10
        subs.begin_reset(db, ts, "r", 0)
        subs.catch_up_chunk(db, ts, "r", 500)       # the purge
        for m in leased:
            m.nak(0)
    subs.catch_up(db, ts, "r")
    assert sup.stats("t")["subscriptions"]["r"]["backlog"] == _queued(db, "r") == 50
    assert _ids(drain(db, "t", "r", idle_s=0.3)) == set(ids)
    assert sup.stats("t")["subscriptions"]["r"]["backlog"] == 0


def test_rewind_over_unkeyed_leases_a_reshard_moved_queues_them_once(db):
    """Unkeyed messages leased, the topic resharded (their lease records move with them),
    then a rewind over them: it must find each leased message where the reshard put it
    and leave it alone. The reshard put an unkeyed message by its versionstamp and the
    rewind looked in its log bucket's shard, so it queued most of them again beside
    their leases, to be delivered twice (a backlog of 67 for 40 messages; plan 1h.1)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=4)
    sup.create_subscription("t", "r")
    ids = [r.id for r in fdq.Producer(db).push_many("t", [fdq.Envelope(b"u%d" % i) for i in range(40)])]
    with fdq.Consumer(db, "t", subscription="r", config=fast(SUBS_FAST, ack_wait_s=60)) as c:
        assert _ids(fdqtest.fetch_n(c, 40)) == set(ids)
        sup.rebalance("t", shards=3)
        sup.reset("t", "r", 0)
        st = sup.stats("t")["subscriptions"]["r"]
        assert (st["backlog"], st["in_flight"]) == (40, 40)      # the leased copies alone
        assert _ready(db, "r") == 0


def _ready(db, sub) -> int:
    """The messages in ``sub``'s ready queues, by a scan."""
    from fdq.keyspace import Keyspace
    ts = Keyspace().topic("t")
    tr = db.create_transaction()
    r = ts.subs[sub].range()
    return sum(1 for kv in tr.snapshot.get_range(r.start, r.stop)
               if len(ts.subs.unpack(kv.key)) > 4 and ts.subs.unpack(kv.key)[4] == "ready")


def test_redrive_after_a_rewind_requeued_the_dead_letter_counts_it_once(db):
    """A rewind queues a dead letter again (the DLQ is left alone); a redrive before it
    is delivered wrote it again at the same ready key, counted routed twice: a backlog
    of 1 left for good. Now the redrive drops the dead letter (that copy delivers it)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1)
    sup.create_subscription("t", "r")
    ids = _push(db, "a", 10)
    with fdq.Consumer(db, "t", subscription="r") as c:
        m = c.fetch(1, timeout=1)[0]
        m.term("bad")
    sup.reset("t", "r", 0)
    assert sup.dlq_redrive("t", "r") == 1
    st = sup.stats("t")["subscriptions"]["r"]
    assert (st["backlog"], st["dlq"]) == (_queued(db, "r"), 0) == (10, 0)
    assert _ids(drain(db, "t", "r", idle_s=0.3)) == set(ids)
    assert sup.stats("t")["subscriptions"]["r"]["backlog"] == 0


def test_rewind_over_leases_delayed_after_its_purge_counts_them_once(db):
    """As above with the leases nak'd with a delay: the copy (it does not look in the
    delayed area, keyed by due time) queues them ready, and their delayed copies, once
    due, were promoted onto the same ready keys: counted routed twice, a backlog of 10
    left for good. Now the promotion drops such a delayed copy, counted done."""
    from fdq.ops import catchup as subs
    from fdq.keyspace import Keyspace
    from fdq.ops.clock import read_clock
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "r")
    ids = _push(db, "a", 50)
    ts = Keyspace().topic("t")
    with fdq.Consumer(db, "t", subscription="r", config=fast(SUBS_FAST, ack_wait_s=30)) as c:
        leased = c.fetch(10, timeout=1)
        assert len(leased) == 10
        subs.begin_reset(db, ts, "r", 0)
        subs.catch_up_chunk(db, ts, "r", 500)       # the purge
        for m in leased:
            m.nak(0.2)
        subs.catch_up(db, ts, "r")
        assert sup.stats("t")["subscriptions"]["r"]["backlog"] == _queued(db, "r") == 60
        # the consumer advances the database clock (delays are due by it): both copies
        # are there when the next take promotes the delayed ones
        clock = read_clock(db.create_transaction(), ts.clock_key)
        wait_for(lambda: read_clock(db.create_transaction(), ts.clock_key) > clock + 500, timeout=30,
                 what="the delayed copies to be due")
        got = fdqtest.drain(c, first_wait_s=0.3, wait_s=0.3, settle="ack_many")   # until a fetch comes back empty
    assert _ids(got) == set(ids)
    assert sup.stats("t")["subscriptions"]["r"]["backlog"] == _queued(db, "r") == 0


def test_a_consumer_starts_while_its_subscription_catches_up_on_a_paused_topic(db, url, tmp_path):
    """A reset killed midway leaves the subscription catching up; the topic is paused
    (or resharding). A consumer starting then tried to finish the catch-up in its
    constructor and failed with the catch-up's ConfigError ("topic is paused"): it could
    not start until the topic played. Now it starts, and finishes the catch-up once the
    topic plays: the rewind's messages arrive, each once."""
    import signal
    import subprocess
    import sys
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.create_subscription("t", "r")
    a = _push(db, "a", 200)
    assert _ids(drain(db, "t", "r", idle_s=0.3)) == set(a)
    script = tmp_path / "killed_reset.py"
    script.write_text(_KILLED_RESET)
    proc = subprocess.run([sys.executable, str(script), url], timeout=120, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    sup.pause("t")
    got = []
    c = fdq.tail(db, "t", got.append, subscription="r", config=SUBS_FAST,
                 on_error=lambda e: None)
    try:
        assert "r" in sup.config("t").catchup
        sup.play("t")
        wait_for(lambda: len(got) >= len(a), timeout=60, what="the rewind's messages")
        assert _ids(got) == set(a)
        assert "r" not in sup.config("t").catchup
    finally:
        c.shutdown()


def test_a_rewind_keeps_a_pending_delay(db):
    """A reset to an earlier time re-queued a delayed message that was not due yet as
    ready (delivered at once)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    late = p.push("t", b"later", shard_key="a", delay=600).id
    now = p.push("t", b"now", shard_key="c").id
    assert fetch_ids(db, "t", "default") == [now]
    sup.reset("t", "default", 0)
    st = sub_stats(db, "t", "default")
    assert (st["backlog"], st["delayed"]) == (2, 1)
    assert fetch_ids(db, "t", "default") == [now]
    advance_clock(db, 600_000)
    assert fetch_ids(db, "t", "default") == [late]
