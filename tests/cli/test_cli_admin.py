"""fdq stats, consumers, pause, play, rebalance, replay, trim, dlq: output parsed and
checked against the Python API's state."""
from __future__ import annotations

import datetime
import json
import time

import pytest

import fdq
from fdq.cli import render


def without_clock(stats: dict) -> dict:
    """``Supervisor.stats`` without what changes with time alone: lag, a live consumer's
    heartbeats, their age and the zombie mark computed from it; the maintenance role's
    beat and its last pass's age."""
    for k in ("beat", "last_pass_age_s"):
        stats["maintenance"].pop(k)
    for s in stats["subscriptions"].values():
        s.pop("lag_ms")
        for c in s["consumers"]:
            for k in ("heartbeats", "heartbeat_age_s", "zombie"):
                c.pop(k)
    return stats


@pytest.fixture
def consumer(db):
    """A live in-process consumer of "orders" (tag "gpu") that handles nothing yet."""
    made = []

    def make(topic="orders", **kwargs):
        c = fdq.Consumer(db, topic, **kwargs)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


def test_stats(run, db, sup, consumer):
    run("topics", "create", "orders", "--shards", 4, "--extend", "--max-backlog", 100)
    p = fdq.Producer(db)
    p.push_many("orders", [fdq.Envelope(f"{i}".encode(), shard_key=f"k{i}") for i in range(6)])
    p.push_many("orders", [fdq.Envelope(b"g", headers={"##client_dispatch_tag": "gpu"})] * 2)
    p.push("orders", b"later", delay=60)
    c = consumer(extend_support=True, desired_tag="gpu")
    leased = c.fetch(1, timeout=5)
    assert len(leased) == 1

    data = run.json("stats", "orders")
    api = sup.stats("orders")
    # exactly what the Python API returns, JSON-encoded (tuples as lists)
    assert isinstance(data["subscriptions"]["default"]["lag_ms"], int)
    assert without_clock(data) == json.loads(json.dumps(without_clock(api)))
    assert (data["topic"], data["config"]["shards"], data["config"]["extend"], data["config"]["max_backlog"]) == \
        ("orders", 4, True, 100)
    c9 = data["counters"]
    assert c9["inserted"] == 9
    assert (c9["inserted_bytes"], c9["trimmed"]) == (6 + 2 + len(b"later"), 0)   # bodies pushed
    assert c9["log_bytes"] > 9 * 13       # each entry's key and record, more than its body
    sub = data["subscriptions"]["default"]
    assert (sub["backlog"], sub["in_flight"], sub["delayed"], sub["dlq"]) == (9, 1, 1, 0)
    [cons] = sub["consumers"]
    assert cons["id"] == c.id and cons["tag"] == "gpu" and cons["mode"] == "at_least_once"
    assert sorted(tuple(ts) for ts in cons["tag_shards"]) == sorted(c.owned_shards)
    assert sub["tags"][""]["backlog"] == 7 and sub["tags"]["gpu"]["backlog"] == 2
    assert (sub["tags"]["gpu"]["in_flight"], sub["tags"]["gpu"]["shards"]) == (1, 4)
    assert sum(s["backlog"] for s in sub["shards"]) == 9
    assert sum(1 for s in sub["shards"] if s["owner"] is None) == 4      # no untagged consumer

    table = run("stats", "orders").stdout
    assert "topic orders: 4 shards, extend on, running" in table
    for title in ("subscriptions", "consumers", "backlog per tag"):
        assert title in table
    assert c.id in table and "gpu:0-3" in table


def test_consumers(run, db, consumer):
    run("topics", "create", "orders", "--shards", 6)
    r = run("consumers", "orders")
    assert r.stdout == "" and "has no consumers" in r.stderr
    a, b = consumer(consumer_id="a"), consumer(consumer_id="b")
    rows = {c["id"]: c for c in run.json("consumers", "orders")}
    assert set(rows) == {"a", "b"}
    for c in (a, b):
        c._refresh_owned()
        assert sorted((s["tag"] or "", s["shard"]) for s in rows[c.id]["shards"]) == c.owned_shards
    assert sum(len(r["shards"]) for r in rows.values()) == 6
    table = run("consumers", "orders").stdout
    assert " a " in table and " b " in table
    b.close()
    assert [c["id"] for c in run.json("consumers", "orders")] == ["a"]


def test_pause_play(run, db, sup):
    run("topics", "create", "orders", "--shards", 2)
    run("pause", "orders")
    assert sup.config("orders").paused is True
    ids = run("push", "orders", "-", "--key", "k", input="\n".join(map(str, range(30)))).stdout.split()
    st = sup.stats("orders")
    assert (st["counters"]["inserted"], st["counters"]["routed"]) == (30, 0)
    assert run.json("topics")[0]["pending"] == 30
    r = run("play", "orders", "--json")
    assert r.stdout and json.loads(r.stdout) == {"topic": "orders", "routed": 30}
    assert "routed 30 messages" in r.stderr
    assert sup.config("orders").paused is False
    with fdq.Consumer(db, "orders") as c:
        got = c.fetch(100, timeout=5)
    assert [m.id for m in got] == ids                        # in order


def test_rebalance(run, db, sup, consumer):
    run("topics", "create", "orders", "--shards", 4)
    ids = run("push", "orders", "-", "--key", "k", input="\n".join(map(str, range(40)))).stdout.split()
    fdq.Producer(db).push_many("orders", [fdq.Envelope(f"x{i}".encode(), shard_key=f"x{i}") for i in range(40)])
    row = run.json("rebalance", "orders", "--shards", 8)
    assert row["shards"] == 8 and sup.config("orders").shards == 8
    assert sup.stats("orders")["subscriptions"]["default"]["backlog"] == 80
    with fdq.Consumer(db, "orders") as c:
        got = []
        while len(got) < 80:
            batch = c.fetch(100, timeout=5)
            assert batch, f"only {len(got)} of 80 messages after the reshard"
            c.ack_many(batch)
            got += batch
    assert [m.id for m in got if m.shard_key == "k"] == ids   # one key's order kept
    a = consumer(consumer_id="a")
    r = run("rebalance", "orders")
    assert "8 shards divided among 1 consumer\n" in r.stderr
    a._refresh_owned()
    assert len(a.owned_shards) == 8


def test_replay(run, db, sup):
    p = fdq.Producer(db)
    old = [p.push("orders", f"m{i}".encode(), shard_key="k").id for i in range(5)]
    with fdq.Consumer(db, "orders") as c:
        c.ack_many(c.fetch(100, timeout=5))
    start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    r = run("replay", "orders", "--start", start.isoformat(), "--json")
    out = json.loads(r.stdout)
    assert out["replayed"] == 5 and out["start_ms"] == int(start.timestamp() * 1000) and out["end_ms"] is None
    got = run.json_lines("tail", "orders", "--count", 5, "--timeout", 10)
    assert [m["body"] for m in got] == [f"m{i}" for i in range(5)]
    assert [m["replay_of"] for m in got] == old
    # an empty window (epoch ms) replays nothing
    future = int(time.time() * 1000) + 3_600_000
    assert run.json("replay", "orders", "--start", future, "--end", future + 1000)["replayed"] == 0


def test_replay_again_dry_run_and_include_replays(run, db, state, sup):
    """Rerunning a replay compounded (100, 200, 400): now the same command is a no-op
    once finished (saying so), --again replays the originals only, --dry-run changes
    nothing and says what a run would push and to which subscriptions."""
    sup.create_topic("r", shards=2)
    run("subs", "create", "r", "keyed", "--filter-shard-key", "a*")
    fdq.Producer(db).push_many("r", [fdq.Envelope(f"m{i}".encode(), shard_key="a" if i % 2 else None)
                                     for i in range(100)])
    start = "1000000000000ms"
    before = state()
    plan = run.json("replay", "r", "--start", start, "--dry-run")
    assert state() == before
    assert (plan["replay_id"], plan["messages"], plan["skipped_replays"], plan["subscriptions"]) == \
        ("1000000000000:open", 100, 0, {"default": 100, "keyed": 50})
    r = run("replay", "r", "--start", start, "--dry-run")
    assert "would push 100 messages" in r.stderr and "keyed" in r.stdout
    assert [run.json("replay", "r", "--start", start)["replayed"] for _ in range(3)] == [100, 0, 0]
    r = run("replay", "r", "--start", start)
    assert "replay 1000000000000:open of 'r' already finished at " in r.stderr and "(100 messages)" in r.stderr
    assert "--again" in r.stderr
    out = run.json("replay", "r", "--start", start, "--again")
    assert (out["replayed"], out["skipped_replays"], out["already_finished"]) == (100, 100, False)
    out = run.json("replay", "r", "--start", start, "--id", "all", "--include-replays")
    assert (out["replay_id"], out["replayed"], out["skipped_replays"]) == ("all", 300, 0)
    assert sup.stats("r")["counters"]["inserted"] == 600
    run.usage_error(["replay", "r", "--start", start, "--id", "a/b"], "invalid replay id 'a/b'")


def test_trim(run, db, sup):
    run("topics", "create", "orders", "--retention-s", 3600)
    p = fdq.Producer(db)
    p.push_many("orders", [fdq.Envelope(b"a")] * 3)
    r = run("trim", "orders", "--json")                      # retention 1 h: all too young
    assert json.loads(r.stdout)["deleted"] == 0
    cut = int(time.time() * 1000) + 1000
    assert run.json("trim", "orders", "--before", cut)["deleted"] == 3
    # the log is gone (replay finds nothing); the queue still holds the messages
    assert run.json("replay", "orders", "--start", 0)["replayed"] == 0
    assert sup.stats("orders")["subscriptions"]["default"]["backlog"] == 3
    run("topics", "create", "noret")
    assert "has no retention: give --before" in run("trim", "noret").stderr


def test_dlq(run, db, sup):
    p = fdq.Producer(db)
    ids = [p.push("orders", f"bad{i}".encode(), shard_key="k").id for i in range(3)]
    with fdq.Consumer(db, "orders") as c:
        for m in c.fetch(10, timeout=5):
            m.term("poison" + (" and a long story" * 50 if m.id == ids[2] else ""))
    table = run("dlq", "list", "orders").stdout
    assert table.count("terminated: poison") == 3
    # off a terminal: plain, each row one line, nothing cut (a table on a terminal ellipsizes it)
    assert table.count("and a long story") == 50 and len(table.splitlines()) == 1 + 3
    rows = run.json("dlq", "list", "orders", "--subscription", "default")
    api = sup.dlq_list("orders")
    assert [r["id"] for r in rows] == [d["id"] for d in api] == ids
    assert rows[0]["reason"] == api[0]["reason"] and rows[0]["body"] == "bad0" and rows[0]["shard_key"] == "k"
    assert rows[2]["reason"] == "terminated: poison" + " and a long story" * 50     # --json: whole
    assert len(run.json("dlq", "list", "orders", "--limit", 2)) == 2
    assert run.json("stats", "orders")["subscriptions"]["default"]["dlq"] == 3

    assert run.json("dlq", "redrive", "orders", "--all")["redriven"] == 3
    assert sup.dlq_list("orders") == [] and sup.stats("orders")["subscriptions"]["default"]["backlog"] == 3
    with fdq.Consumer(db, "orders") as c:
        for m in c.fetch(10, timeout=5):
            m.term("again")
    r = run("dlq", "purge", "orders", "--all", input="n\n", code=1)       # declined
    assert "fdq: error: not confirmed: the dead letters of orders/default not purged" in r.stderr
    assert len(sup.dlq_list("orders")) == 3
    assert run.json("dlq", "purge", "orders", "--all", "--yes")["purged"] == 3
    assert sup.dlq_list("orders") == []
    assert "is empty" in run("dlq", "list", "orders").stderr


def test_progress_bar_on_a_terminal(run, db, sup, monkeypatch):
    """On a terminal's stderr, long work draws a rich bar; stdout stays data only."""
    monkeypatch.setattr(render, "stderr_is_terminal", lambda: True)
    run("pause", "orders", code=1)
    fdq.Producer(db).push("orders", b"x")
    run("pause", "orders")
    run("push", "orders", "-", input="a\nb\n")
    r = run("play", "orders", "--json")
    assert "routing orders" in r.stderr and "\x1b[" in r.stderr
    assert json.loads(r.stdout) == {"topic": "orders", "routed": 2}


def test_plain_progress_lines(run, db, monkeypatch):
    monkeypatch.setattr(render, "PLAIN_EVERY_S", 0.0)
    monkeypatch.setattr("fdq.cli.messages.PUSH_BATCH", 10)
    r = run("push", "orders", "-", input="\n".join(map(str, range(25))))
    progress = [line for line in r.stderr.splitlines() if line.startswith("pushing to orders: ")]
    assert progress == ["pushing to orders: 10", "pushing to orders: 20", "pushing to orders: 25"]
    assert "\x1b[" not in r.stderr
