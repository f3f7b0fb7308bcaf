"""A producer caches a topic's config behind the database's metadata version (every config
change bumps it in its transaction): a change made by another process is seen by the next
push of a producer that cached the config before it, never missed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import fdq
from fdq.ops.routing import shard_for

FDQ = Path(sys.executable).parent / "fdq"


def fdq_cli(url, *args):
    r = subprocess.run([str(FDQ), "--url", url, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def test_a_push_after_another_process_paused_the_topic_is_held(db, url, sup):
    p = fdq.Producer(db)
    fdq.Supervisor(db).create_topic("orders")
    p.push("orders", b"before")                     # this process has read the config
    fdq_cli(url, "pause", "orders")
    p.push("orders", b"after")
    counters = sup.stats("orders")["counters"]
    assert (counters["routed"], counters["pending"]) == (1, 1)


def test_a_push_after_another_process_resharded_goes_to_a_shard_of_the_new_count(db, url, sup):
    p = fdq.Producer(db)
    fdq.Supervisor(db).create_topic("orders")
    p.push("orders", b"before", shard_key="b")
    fdq_cli(url, "rebalance", "orders", "--shards", "32")
    r = p.push("orders", b"after", shard_key="b")
    assert sup.config("orders").shards == 32
    assert (shard_for("b", 16), r.shard) == (5, 21)          # not the shard of 16


def test_a_push_after_another_process_deleted_the_topic_finds_no_topic(db, url):
    p = fdq.Producer(db, config=fdq.ProducerConfig(auto_create=False))
    fdq.Supervisor(db).create_topic("orders")
    p.push("orders", b"before")
    fdq_cli(url, "topics", "delete", "orders", "--yes")
    with pytest.raises(fdq.TopicNotFound):
        p.push("orders", b"after")
