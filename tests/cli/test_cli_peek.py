"""fdq peek, fdq get, fdq dlq redrive|purge by id and by age, fdq consumers TOPIC reap:
through the installed ``fdq`` command (subprocess) where a process is killed, click's
runner elsewhere; output parsed, the database checked through the Python API."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fdq

from fdqtest import advance_clock, fast, fetch_until, wait_for

FDQ = Path(sys.executable).parent / "fdq"


def _fdq(url, *args, code=0, timeout=60):
    r = subprocess.run([str(FDQ), "--url", url, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == code, f"fdq {args}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def _states(db):
    """Topic "orders": a ready, a delayed, an in-flight and a dead message (in
    "default"). Returns the consumer holding the in-flight one and {body: id}."""
    sup = fdq.Supervisor(db)
    sup.create_topic("orders", shards=2)
    p = fdq.Producer(db)
    ids = {b: p.push("orders", b, shard_key=b.decode()).id for b in (b"bad", b"held")}
    c = fdq.Consumer(db, "orders", config=fast(ack_wait_s=60))
    got = {m.body: m for m in fetch_until(c, lambda g: len(g) >= 2)}
    got[b"bad"].term("cannot parse")
    ids[b"soon"] = p.push("orders", b"soon", delay=600).id
    ids[b"fresh"] = p.push("orders", "fresh \u00e9".encode(), shard_key="k").id
    return c, ids


def test_peek_lists_every_state_and_changes_nothing(run, db, state):
    c, ids = _states(db)
    try:
        c._stop.set()           # its threads stopped (as a kill -9), the lease still held
        c._member.join(timeout=10)
        before = state()
        rows = run.json("peek", "orders", "-n", 50)
        assert state() == before
        assert [r["id"] for r in rows] == sorted(ids.values())
        by = {r["body"]: r for r in rows}
        assert (by["bad"]["state"], by["bad"]["reason"], by["bad"]["attempts"]) == ("dead", "terminated: cannot parse", 1)
        assert (by["held"]["state"], by["held"]["leased_by"], by["held"]["attempts"]) == ("in_flight", c.id, 1)
        assert by["soon"]["state"] == "delayed" and 500 < by["soon"]["due_in_s"] <= 600
        assert (by["fresh \u00e9"]["state"], by["fresh \u00e9"]["shard_key"], by["fresh \u00e9"]["body_encoding"]) == \
            ("ready", "k", "utf-8")
        assert [r["body"] for r in run.json("peek", "orders", "--state", "dead", "--state", "delayed")] == \
            ["bad", "soon"]
        assert len(run.json("peek", "orders", "-n", 1)) == 1
        table = run("peek", "orders").stdout
        for text in ("ready", "delayed", "in_flight", "dead", "terminated: cannot parse", f"leased by {c.id}",
                     "due in", ids[b"held"]):
            assert text in table, table
    finally:
        c.close()


def test_peek_and_get_errors(run, db):
    fdq.Supervisor(db).create_topic("orders", shards=1)
    assert "no message of orders/default in ready" in run("peek", "orders", "--state", "ready").stderr
    assert run.json("peek", "orders") == []
    run.usage_error(["peek", "orders", "--state", "gone"], "'gone' is not one of")
    run.usage_error(["peek", "orders", "-n", 0], "0 is not in the range")
    assert "subscription" in run("peek", "orders", "-s", "nosuch", code=1).stderr
    assert "topic 'nosuch' does not exist" in run("peek", "nosuch", code=1).stderr
    run.usage_error(["get", "orders", "xyz"], "invalid message id 'xyz'")
    r = run("get", "orders", "0" * 24, code=1)
    assert r.stderr.startswith("fdq: error: message 000000000000000000000000 of topic 'orders' not found")


def test_get_shows_the_log_entry_and_each_subscription(run, db):
    c, ids = _states(db)
    try:
        fdq.Supervisor(db).create_subscription("orders", "audit")
        got = run.json("get", "orders", ids[b"held"])
        assert got["log"]["body"] == "held" and got["log"]["shard_key"] == "held"
        subs = {s["name"]: s for s in got["subscriptions"]}
        assert subs["default"]["state"] == "in_flight"
        assert subs["default"]["places"][0]["leased_by"] == c.id
        assert [s["state"] for s in run.json("get", "orders", ids[b"bad"])["subscriptions"]][0] == "dead"
        out = run("get", "orders", ids[b"bad"]).stdout
        assert "terminated: cannot parse" in out and "cannot" in out and ids[b"bad"] in out
    finally:
        c.close()


def test_dlq_redrive_and_purge_by_id_and_by_age(run, db, sup):
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    for b in (b"a", b"b", b"c"):
        p.push("t", b, shard_key=b.decode())
    with fdq.Consumer(db, "t", config=fast()) as c:
        for m in fetch_until(c, lambda g: len(g) >= 3):
            m.term("no")
    ids = {d["body"]: d["id"] for d in sup.dlq_list("t")}
    r = run("dlq", "redrive", "t", "--id", ids[b"a"], "--id", ids[b"a"], "--json")
    assert json.loads(r.stdout)["redriven"] == 1
    assert "redrove 1 dead letters of t/default (of the 1 ids given)" in r.stderr
    assert sorted(d["body"] for d in sup.dlq_list("t")) == [b"b", b"c"]
    assert run.json("dlq", "purge", "t", "--older-than", "1h", "--yes")["purged"] == 0
    advance_clock(db, 2 * 3600 * 1000)
    assert all(d["dead_age_s"] >= 7200 for d in run.json("dlq", "list", "t"))
    assert run.json("dlq", "purge", "t", "--id", ids[b"b"], "--yes")["purged"] == 1
    assert run.json("dlq", "redrive", "t", "--older-than", "1h")["redriven"] == 1
    assert sup.dlq_list("t") == [] and sup.stats("t")["subscriptions"]["default"]["backlog"] == 2
    # exactly one selector; a malformed id changes nothing
    run.usage_error(["dlq", "redrive", "t"], "give one of --id ID")
    run.usage_error(["dlq", "purge", "t", "--all", "--older-than", "1h", "--yes"], "not --older-than and --all")
    run.usage_error(["dlq", "purge", "t", "--id", "nothex", "--yes"], "invalid message id 'nothex'")
    run.usage_error(["dlq", "redrive", "t", "--older-than", "soon"], "soon")


def test_consumers_reap_after_kill9(procs, url, db):
    """A consumer killed with kill -9 stays registered, a zombie owning its shards, with
    no live peer to notice; ``fdq consumers TOPIC reap`` removes it and frees its shards."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = procs.start("web-consumer", "w1", "--topic", "t", wait_ready=True)
    wait_for(lambda: [(c["id"], c["heartbeats"] > 0) for c in sup.consumers("t")] == [("w1", True)], 30,
             what="w1 registered and heartbeating")
    procs.kill9(p)
    [c] = json.loads(_fdq(url, "consumers", "t", "--json").stdout)
    assert c["id"] == "w1"          # registered still
    r = _fdq(url, "consumers", "t", "reap", "--zombie-after", "1s", "--json")
    assert json.loads(r.stdout) == {"topic": "t", "zombies": [{"subscription": "default", "id": "w1"}],
                                    "deleted_subscriptions": []}
    assert "declared 1 zombie(s) of 't': default/w1" in r.stderr
    assert "has no consumers" in _fdq(url, "consumers", "t").stderr
    shards = sup.stats("t")["subscriptions"]["default"]["shards"]
    assert all(s["owner"] != "w1" for s in shards), shards
