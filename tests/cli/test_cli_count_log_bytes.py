"""fdq topics upgrade --count-log-bytes: an older FDQ's topic gets an exact log_bytes."""
from __future__ import annotations

import fdq
from fdq.keyspace import Keyspace


def _log_size(db, ts) -> int:
    total = 0
    for space in (ts.log, ts.all_chunks):
        r = space.range()
        total += sum(len(kv.key) + len(kv.value)
                     for kv in db.create_transaction().snapshot.get_range(r.start, r.stop))
    return total


def test_upgrade_count_log_bytes(run, sup, monkeypatch):
    ts = Keyspace().topic("old")
    fdq.topic.write_topic_config(sup.db, ts, fdq.TopicConfig(shards=3))    # as an older FDQ
    p = fdq.Producer(sup.db)
    p.push_many("old", [fdq.Envelope(b"x" * 40, shard_key=f"k{i}") for i in range(1200)])
    p.push("old", b"B" * 200_000)
    assert run.json("stats", "old")["log_bytes"] is None
    from fdq.cli import render
    monkeypatch.setattr(render, "PLAIN_EVERY_S", 0.0)         # a progress line per chunk
    r = run("topics", "upgrade", "old", "--count-log-bytes")
    assert "counting the log of old: " in r.stderr
    assert f"the log of topic 'old' is {_log_size(sup.db, ts):,} bytes (1,201 entries counted)" in r.stderr
    assert run.json("stats", "old")["log_bytes"] == _log_size(sup.db, ts)
    row = run.json("topics", "upgrade", "old", "--count-log-bytes")     # again: nothing to count
    assert row["name"] == "old"
    assert run.json("stats", "old")["log_bytes"] == _log_size(sup.db, ts)
    assert sup.config("old").log_bytes_counted
    run("topics", "upgrade", "nosuch", "--count-log-bytes", code=1)
