"""Tag dispatch with consumers in separate OS processes: tag A, tag B and untagged.

Tag-T messages go to T consumers only; untagged messages never go to tagged consumers; a
tag nobody wants falls back to the untagged consumers; when the last T consumer is
killed (kill -9), the untagged survivors drain its pending T messages (its leased one
after the zombie timeout and the lease) and when a T consumer returns, new T messages
go to it."""
from __future__ import annotations

import json

import pytest

import fdq
from fdq.headers import DISPATCH_TAG

from fdqtest import wait_for


TOPIC = "orders"
# Generous for 2 cores shared with other test runs: a live consumer must never look dead.
OPTS = dict(heartbeat_interval_s=0.25, zombie_timeout_s=8.0, ack_wait_s=3.0, poll_interval_s=0.2)


def _push(producer, tag, prefix, count):
    envs = [fdq.Envelope(f"{prefix}-{i}".encode(), shard_key=f"k{i}",
                         headers={DISPATCH_TAG: tag} if tag else {"x": i})
            for i in range(count)]
    return producer.push_many(TOPIC, envs)


def _start(workers, cid, tag):
    return workers.start("tag-consumer", cid, "--topic", TOPIC, "--tag", tag or "", "--config", json.dumps(OPTS))


def _deliveries(workers, w) -> list:
    return [e for e in workers.events(w) if e["event"] == "delivered"]


def _delivered(workers, started):
    return {e["body"]: e for w in started for e in _deliveries(workers, w)}


def _tag_owners(sup, tag):
    return sup.stats(TOPIC)["subscriptions"]["default"]["tags"].get(tag, {}).get("owners")


@pytest.mark.slow
def test_tag_dispatch_fallback_on_kill_and_return(db, workers):
    sup = fdq.Supervisor(db)
    sup.create_topic(TOPIC, shards=4, extend=True)
    a = _start(workers, "cons-a", "A")
    b = _start(workers, "cons-b", "B")
    u = _start(workers, "cons-u", None)
    for w in (a, b, u):
        workers.wait_ready(w)
    p = fdq.Producer(db)

    # 1. A, B, C (no consumer) and untagged messages, mixed in one push_many each.
    _push(p, "A", "a1", 30)
    _push(p, "B", "b1", 30)
    _push(p, "C", "c1", 30)
    _push(p, None, "u1", 30)
    expected = {f"{x}-{i}" for x in ("a1", "b1", "c1", "u1") for i in range(30)}
    wait_for(lambda: expected <= set(_delivered(workers, [a, b, u])), 60, "phase 1 deliveries")
    assert {e["body"][:2] for e in _deliveries(workers, a)} == {"a1"}
    assert {e["body"][:2] for e in _deliveries(workers, b)} == {"b1"}
    assert {e["body"][:2] for e in _deliveries(workers, u)} == {"c1", "u1"}
    assert all(e["tag"] == e["header_tag"] == "A" for e in _deliveries(workers, a))
    assert all(e["tag"] == "C" for e in _deliveries(workers, u) if e["body"].startswith("c1"))
    tags = sup.stats(TOPIC)["subscriptions"]["default"]["tags"]
    assert tags["A"]["owners"] == ["cons-a"] and not tags["A"]["fallback"]
    assert tags["C"]["owners"] == ["cons-u"] and tags["C"]["fallback"]
    assert tags[""]["owners"] == ["cons-u"]
    assert tags["A"]["shards"] == tags[""]["shards"] == 4

    # 2. A's consumer takes a message and hangs on it; kill -9 it; more A messages
    # arrive while it is dead. The untagged survivor drains them all.
    p.push(TOPIC, b"hang", shard_key="k0", headers={DISPATCH_TAG: "A"})
    wait_for(lambda: any(e["body"] == "hang" for e in _deliveries(workers, a)), 30, "A to take the hang message")
    workers.kill9(a)
    _push(p, "A", "a2", 20)
    _push(p, None, "u2", 10)
    expected2 = {f"a2-{i}" for i in range(20)} | {f"u2-{i}" for i in range(10)} | {"hang"}
    wait_for(lambda: expected2 <= {e["body"] for e in _deliveries(workers, u)}, 60,
             "untagged survivor to drain A's messages")
    hang = [e for e in _deliveries(workers, u) if e["body"] == "hang"]
    assert hang[0]["attempts"] >= 2 and hang[0]["tag"] == "A"     # redelivered after the lease
    assert _tag_owners(sup, "A") == ["cons-u"]
    assert {e["body"][:2] for e in _deliveries(workers, b)} == {"b1"}       # B never gets A or untagged

    # 3. An A consumer returns: new A messages go to it, untagged ones still not.
    a2 = _start(workers, "cons-a2", "A")
    workers.wait_ready(a2)
    assert _tag_owners(sup, "A") == ["cons-a2"]      # moved back when it joined
    _push(p, "A", "a3", 20)
    _push(p, None, "u3", 10)
    wait_for(lambda: {f"a3-{i}" for i in range(20)} <= {e["body"] for e in _deliveries(workers, a2)}, 60,
             "the returning A consumer to get new A messages")
    wait_for(lambda: {f"u3-{i}" for i in range(10)} <= {e["body"] for e in _deliveries(workers, u)}, 60,
             "untagged messages")
    assert {e["body"][:2] for e in _deliveries(workers, a2)} == {"a3"}
    assert not any(e["body"].startswith("a3") for e in _deliveries(workers, u) + _deliveries(workers, b))
    assert all(e["tag"] == "A" for e in _deliveries(workers, a) + _deliveries(workers, a2))
    assert all(e["tag"] == "B" for e in _deliveries(workers, b))
    assert all(e["tag"] in ("", "C", "A") for e in _deliveries(workers, u))
    assert not any(e["tag"] == "A" and e["body"].startswith("a3") for e in _deliveries(workers, u))
    st = sup.stats(TOPIC)["subscriptions"]["default"]
    wait_for(lambda: sup.stats(TOPIC)["subscriptions"]["default"]["backlog"] == 0, 30, "empty backlog")
    assert st["tags"]["A"]["fallback"] is False
