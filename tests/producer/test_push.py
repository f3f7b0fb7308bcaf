"""Pushing to a topic that does not exist yet: a producer auto-creates it with its
options, records the layout format, and racing processes end with one config and every
message."""
from __future__ import annotations

import pytest

import fdq
from fdq.keyspace import Keyspace

from fdqtest import database_url, kill_all, read, scan, stored_bodies, with_faults


_AUTOCREATE_WORKER = """
import sys, fdq
url, name, shards = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = fdq.Producer(fdq.connect(url), config=fdq.ProducerConfig(auto_create=fdq.TopicConfig(shards=shards)))
for i in range(40):
    topic = f"new-{i % 5}"
    if i % 2:
        p.push(topic, f"{name}:{i}".encode(), shard_key=f"k{i}")
    else:
        p.push_many(topic, [fdq.Envelope(f"{name}:{i}:{j}".encode()) for j in range(3)])
print("done")
"""


def test_a_topic_auto_created_by_a_push_records_the_layout_format(tmp_path):
    # Creating a topic writes meta/format (the layout version a later FDQ checks and
    # migrates from); a push that auto-creates the first topic of a fresh database did
    # not, so a later version would take the database for an empty one.
    db = fdq.connect(database_url(tmp_path / "fresh.db"))
    fdq.Producer(db).push("t", b"x")
    ks = Keyspace()
    raw = read(db, ks.format_key, snapshot=False)
    assert raw != None  # noqa: E711


def test_topics_auto_created_by_racing_processes_have_one_config_and_every_message(db, url):
    # Three processes push (with different auto_create shard counts) into five topics
    # none of them exists yet, under fault injection: each topic is created once (the
    # losers of the race retry with the winner's config) and keeps every message.
    import subprocess
    import sys
    procs = [subprocess.Popen([sys.executable, "-c", _AUTOCREATE_WORKER, with_faults(url, 0.2, s),
                               f"p{s}", str(2 + s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in range(3)]
    try:
        for pr in procs:
            so, se = pr.communicate(timeout=300)
            assert pr.returncode == 0 and so.strip() == "done", se[-2000:]
    finally:
        kill_all(procs)
    sup = fdq.Supervisor(db)
    assert sorted(name for name, _c in sup.topics()) == [f"new-{i}" for i in range(5)]
    total = 0
    for i in range(5):
        topic = f"new-{i}"
        shards = sup.config(topic).shards
        stored = stored_bodies(db, topic)
        assert max(stored.values()) == 1
        total += len(stored)
        ts = Keyspace().topic(topic)
        # every message is in a ready queue of a shard the topic's config has
        ready = sum(len(scan(db, ts.shard("default", "", n).ready_prefix)) for n in range(shards))
        assert ready == len(stored) == sup.stats(topic)["counters"]["inserted"]
    assert total == 3 * (20 * 1 + 20 * 3)


def test_producer_auto_create_options(db):
    strict = fdq.Producer(db, config=fdq.ProducerConfig(auto_create=False))
    with pytest.raises(fdq.TopicNotFound, match="'a' does not exist"):
        strict.push("a", b"x")
    shaped = fdq.Producer(db, config=fdq.ProducerConfig(auto_create=fdq.TopicConfig(shards=4, subs=())))
    shaped.push_many("a", [fdq.Envelope(b"x"), fdq.Envelope(b"y")])
    sup = fdq.Supervisor(db)
    assert (sup.config("a").shards, sup.config("a").subs) == (4, ())
    assert sup.stats("a")["counters"]["inserted"] == 2      # in the "all" log, no queue
    fdq.Producer(db).push("b", b"z")                        # the default: 16 shards, "default"
    assert (sup.config("b").shards, sup.config("b").subs) == (16, ("default",))
    with pytest.raises(fdq.ConfigError, match="auto_create must be True, False or a TopicConfig"):
        fdq.ProducerConfig(auto_create="yes")
