"""Second-round review of the less-travelled paths: delayed messages copied from the
"all" log (catch-up, reset, replay, play), concurrent replays, bad replay input, aio
cancellation. Each test failed before the fix it names."""
from __future__ import annotations

import fdq
from fdq import membership
from fdq.keyspace import Keyspace


def _sub_stats(db, topic, sub):
    return fdq.Supervisor(db).stats(topic)["subscriptions"][sub]


def _fetch_ids(db, topic, sub, timeout=0.3):
    c = fdq.Consumer(db, topic, subscription=sub, create=False)
    try:
        got = c.fetch(100, timeout=timeout)
        c.ack_many(got)
        return [m.replay_of or m.id for m in got]
    finally:
        c.close()


def _advance_clock(db, ms):
    """Move the database clock (what delays are due by) ``ms`` ahead, as consumers do
    with the time their monotonic clocks saw pass."""
    ck = Keyspace().clock_key
    tr = db.create_transaction()
    now = membership.read_clock(tr, ck)
    tr.cancel()
    membership.advance_clock(db, ck, now + ms)


def test_a_new_subscription_gets_a_delayed_message_at_its_due_time(db):
    """Catch-up copied a delayed message, not due yet, into the new subscription's ready
    queue: delivered at once, 10 minutes early (the log entry had no due time)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    late = p.push("t", b"later", shard_key="a", delay=600).id
    due_soon = p.push("t", b"soon", shard_key="b", delay=1).id
    now = p.push("t", b"now", shard_key="c").id
    _advance_clock(db, 2000)        # "soon" is due by now, "later" is not
    sup.create_subscription("t", "new", fdq.SubscriptionConfig(deliver_policy="all"))
    st = _sub_stats(db, "t", "new")
    assert (st["backlog"], st["delayed"]) == (3, 1)
    assert sorted(_fetch_ids(db, "t", "new")) == sorted([due_soon, now])
    assert _sub_stats(db, "t", "new")["delayed"] == 1
    _advance_clock(db, 600_000)
    assert _fetch_ids(db, "t", "new") == [late]


def test_a_rewind_keeps_a_pending_delay(db):
    """A reset to an earlier time re-queued a delayed message that was not due yet as
    ready (delivered at once)."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    late = p.push("t", b"later", shard_key="a", delay=600).id
    now = p.push("t", b"now", shard_key="c").id
    assert _fetch_ids(db, "t", "default") == [now]
    sup.reset("t", "default", 0)
    st = _sub_stats(db, "t", "default")
    assert (st["backlog"], st["delayed"]) == (2, 1)
    assert _fetch_ids(db, "t", "default") == [now]
    _advance_clock(db, 600_000)
    assert _fetch_ids(db, "t", "default") == [late]


def test_a_replay_keeps_a_pending_delay_and_delivers_a_past_one_at_once(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    late = p.push("t", b"later", shard_key="a", delay=600).id
    soon = p.push("t", b"soon", shard_key="b", delay=1).id
    _advance_clock(db, 2000)
    assert _fetch_ids(db, "t", "default") == [soon]
    assert p.replay("t", 0) == 2
    st = _sub_stats(db, "t", "default")
    assert (st["backlog"], st["delayed"]) == (3, 2)     # "later" and its replay wait, not "soon"'s replay
    assert _fetch_ids(db, "t", "default") == [soon]          # the replay of "soon": due already
    _advance_clock(db, 600_000)
    assert sorted(_fetch_ids(db, "t", "default")) == [late, late]   # "later" and its replay


def test_play_routes_a_delayed_message_by_its_push_time_due(db):
    """A delayed message pushed while paused waited ``delay`` from the play, not from its
    push: paused for longer than its delay, it still waited the whole delay again."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    sup.pause("t")
    p = fdq.Producer(db)
    soon = p.push("t", b"soon", shard_key="b", delay=1).id
    late = p.push("t", b"later", shard_key="a", delay=600).id
    _advance_clock(db, 2000)
    assert sup.play("t") == 2
    st = _sub_stats(db, "t", "default")
    assert (st["backlog"], st["delayed"]) == (2, 1)
    assert _fetch_ids(db, "t", "default") == [soon]
    _advance_clock(db, 600_000)
    assert _fetch_ids(db, "t", "default") == [late]
