"""fdq push and fdq tail, checked against what the Python API sees."""
from __future__ import annotations

import base64
import json
from functools import partial

import pytest

import fdq

import fdqtest


# Every message the API can still fetch (leased, then acked): up to 5 s for the first, then
# until a fetch comes back empty.
drain = partial(fdqtest.drain, first_wait_s=5.0, wait_s=0.3, settle="ack_many", create=False)


def test_push_one(run, db, sup):
    r = run("push", "orders", "hello", "--key", "cust-42")
    mid = r.stdout.strip()
    assert len(r.stdout.splitlines()) == 1 and r.stderr == ""
    assert sup.config("orders").shards == 16                # auto-created, as the API does
    [m] = drain(db, "orders")
    assert (m.id, m.body, m.shard_key, dict(m.headers)) == (mid, b"hello", "cust-42", {})


def test_push_json_headers_msg_id_delay(run, db, sup):
    run("topics", "create", "orders", "--extend")
    row = run.json("push", "orders", "h", "-H", "user=alice", "-H", "n=3", "-H", 'l=[1,"a"]',
                   "-H", 's="3"', "-H", "##trace_id=77")
    assert set(row) == {"id", "topic", "shard", "duplicate", "trace_id", "position"}
    assert row["topic"] == "orders" and row["duplicate"] is False and row["trace_id"] == "77"
    a = run.json("push", "orders", "once", "--msg-id", "order-1")
    r = run("push", "orders", "once", "--msg-id", "order-1", "--json")
    b = json.loads(r.stdout)
    assert b["duplicate"] is True and b["id"] == a["id"] and "not stored again" in r.stderr
    delayed = run("push", "orders", "later", "--delay", 30).stdout.strip()
    st = sup.stats("orders")["subscriptions"]["default"]
    assert st["delayed"] == 1 and st["backlog"] == 3
    msgs = {m.id: m for m in drain(db, "orders", extend_support=True)}
    assert delayed not in msgs                              # not due yet
    assert msgs[row["id"]].headers == {"user": "alice", "n": 3, "l": [1, "a"], "s": "3", "##trace_id": "77"}  # kept a string: echoed
    assert msgs[a["id"]].body == b"once" and msgs[a["id"]].msg_id == "order-1"


def test_push_stdin_lines_in_batches(run, db, sup, monkeypatch):
    monkeypatch.setattr("fdq.cli.messages.PUSH_BATCH", 7)     # several transactions
    lines = [f"line {i}" for i in range(50)] + ["", "caf\u00e9", "last-no-newline"]
    data = ("\n".join(lines)).encode()
    r = run("push", "orders", "-", "--key", "k", "--keep-empty", input=data)   # the blank line too
    ids = r.stdout.split()
    assert len(ids) == len(set(ids)) == len(lines)
    assert "pushed 53 messages to 'orders'" in r.stderr and "skipped" not in r.stderr
    got = drain(db, "orders")
    assert [m.id for m in got] == ids                        # one key: push order
    assert [m.body for m in got] == [line.encode() for line in lines]
    assert sup.stats("orders")["counters"]["inserted"] == 53
    # no DATA at all reads stdin too; CRLF line ends are stripped
    r = run("push", "orders", input=b"x\r\ny\r\n")
    assert len(r.stdout.split()) == 2
    assert sorted(m.body for m in drain(db, "orders")) == [b"x", b"y"]   # no key: any shards


def test_push_stdin_skips_blank_lines_unless_keep_empty(run, db, sup):
    """``echo | fdq push t -`` pushes nothing (a blank line is no message) and says so;
    other whitespace is data, pushed exactly as given; --keep-empty pushes blank lines."""
    r = run("push", "orders", "-", input=b"\n")
    assert r.stdout == ""
    assert r.stderr.splitlines()[-1] == "pushed 0 messages to 'orders' (1 blank line skipped; --keep-empty pushes them)"
    r = run("push", "orders", "-", "--key", "k", input=b"a\n\n  \n\r\n\t b \t\r\n\n c")
    assert len(r.stdout.split()) == 4
    assert r.stderr.splitlines()[-1] == "pushed 4 messages to 'orders' (3 blank lines skipped; --keep-empty pushes them)"
    assert [m.body for m in drain(db, "orders")] == [b"a", b"  ", b"\t b \t", b" c"]
    r = run("push", "orders", "-", "--keep-empty", input=b"\n\r\n")
    assert len(r.stdout.split()) == 2 and "skipped" not in r.stderr
    assert [m.body for m in drain(db, "orders")] == [b"", b""]
    assert "--keep-empty" in run("push", "--help").stdout


def test_push_stdin_error_names_what_was_pushed(run, db, sup, monkeypatch):
    monkeypatch.setattr("fdq.cli.messages.PUSH_BATCH", 2)
    run("topics", "create", "small", "--max-backlog", 3)
    r = run("push", "small", "-", input=b"a\nb\nc\nd\ne\nf\n", code=1)
    assert len(r.stdout.split()) == 2                        # the first batch's ids
    [line] = r.stderr.strip().splitlines()[-1:]
    assert line.startswith("fdq: error: ") and "max_backlog" in line and "2 messages pushed" in line
    assert sup.stats("small")["subscriptions"]["default"]["backlog"] == 2


def test_tail_prints_headers_and_acks(run, db, sup):
    run("topics", "create", "orders", "--extend", "--shards", 4)
    p = fdq.Producer(db)
    sent = [p.push("orders", f"m{i}".encode(), shard_key="k", headers={"i": i}).id for i in range(5)]
    p.push("orders", b"\xff\x00binary", shard_key="k")
    r = run("tail", "orders", "--count", 3)
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines] == sent[:3]
    assert lines[0].split("  ") == [sent[0], "key=k", "i=0", "m0"]
    st = sup.stats("orders")["subscriptions"]["default"]
    assert (st["acked"], st["backlog"], st["in_flight"]) == (3, 3, 0)
    got = run.json_lines("tail", "orders", "--count", 3)
    assert [m["id"] for m in got] == sent[3:] + [got[2]["id"]]
    assert set(got[0]) == {"id", "topic", "subscription", "shard", "tag", "shard_key", "msg_id",
                           "insertion_time_ms", "attempts", "replay_of", "headers", "body",
                           "body_encoding"}
    assert got[0]["headers"] == {"i": 3} and got[0]["body"] == "m3" and got[0]["body_encoding"] == "utf-8"
    assert got[2]["body_encoding"] == "base64" and base64.b64decode(got[2]["body"]) == b"\xff\x00binary"
    assert got[0]["attempts"] == 1 and isinstance(got[0]["insertion_time_ms"], int)
    st = sup.stats("orders")["subscriptions"]["default"]
    assert (st["acked"], st["backlog"], st["consumers"]) == (6, 0, [])   # left the subscription


def test_tail_timeout_stops_when_idle(run, db):
    fdq.Producer(db).push_many("orders", [fdq.Envelope(b"a"), fdq.Envelope(b"b")])
    got = run.json_lines("tail", "orders", "--timeout", 0.5)
    assert sorted(m["body"] for m in got) == ["a", "b"]
    assert run("tail", "orders", "--timeout", 0.2).stdout == ""


def test_tail_at_most_once(run, db, sup):
    fdq.Producer(db).push_many("orders", [fdq.Envelope(f"{i}".encode(), shard_key="k") for i in range(4)])
    got = run.json_lines("tail", "orders", "--count", 4, "--mode", "at-most-once")
    assert [m["body"] for m in got] == ["0", "1", "2", "3"]
    assert sup.stats("orders")["subscriptions"]["default"]["backlog"] == 0


def test_tail_tag(run, db, sup):
    run("topics", "create", "jobs", "--extend", "--shards", 2)
    p = fdq.Producer(db)
    gpu = [p.push("jobs", f"g{i}".encode(), headers={"##client_dispatch_tag": "gpu"}).id for i in range(3)]
    p.push("jobs", b"plain")
    got = run.json_lines("tail", "jobs", "--tag", "gpu", "--count", 3, "--timeout", 10)
    assert sorted(m["id"] for m in got) == sorted(gpu)
    assert all(m["tag"] == "gpu" and m["headers"]["##client_dispatch_tag"] == "gpu" for m in got)
    # an untagged tail gets the untagged message (and would drain gpu's if any were left)
    [m] = run.json_lines("tail", "jobs", "--count", 1, "--timeout", 10)
    assert m["body"] == "plain" and m["tag"] is None
    r = run("tail", "orders-plain", code=1)                  # unknown topic
    assert r.stderr.strip() == "fdq: error: topic 'orders-plain' does not exist"


def test_tail_tag_on_plain_topic_warns(run, db):
    fdq.Producer(db).push("plain", b"x")
    r = run("tail", "plain", "--tag", "gpu", "--count", 1, "--timeout", 10)
    assert "no extend support: --tag is ignored" in r.stderr
    assert r.stdout.split()[-1] == "x"


def test_push_stdin_big_lines_to_a_topic_with_subscriptions(run, db, sup):
    """Every line is written once to the log and once per subscription in its batch's
    transaction: a batch of 4 MB of lines must fit FDB's 10 MB transaction with them."""
    run("topics", "create", "wide", "--shards", 4)
    for name in ("a", "b", "c"):
        run("subs", "create", "wide", name)
    lines = [bytes([97 + i % 26]) * 100_000 for i in range(40)]
    r = run("push", "wide", "-", input=b"\n".join(lines) + b"\n")
    assert len(r.stdout.split()) == 40
    st = sup.stats("wide")
    assert st["counters"]["inserted"] == 40
    assert {name: s["backlog"] for name, s in st["subscriptions"].items()} == \
        {"default": 40, "a": 40, "b": 40, "c": 40}
    # headers are written with every copy too
    run("topics", "create", "tagged", "--extend")
    for name in ("a", "b"):
        run("subs", "create", "tagged", name)
    r = run("push", "tagged", "-", "-H", "note=" + "n" * 8000, input=b"".join(b"%d\n" % i for i in range(500)))
    assert len(r.stdout.split()) == 500
    assert sup.stats("tagged")["counters"]["inserted"] == 500


@pytest.mark.parametrize("mode", ["at-least-once", "at-most-once"])
def test_tail_of_an_ack_policy_none_subscription(run, sup, mode):
    """``fdq tail --subscription S`` where S has ack_policy='none' (fetch takes its
    messages: done when delivered, nothing to ack): at-most-once acked each taken
    message before printing it, which raised, so the batch fetched was lost unprinted
    (exit 1); at-least-once printed them, then failed acking them (exit 1). Both print
    every message and exit 0."""
    sup.create_topic("t", shards=1)
    sup.create_subscription("t", "s", fdq.SubscriptionConfig(ack_policy="none"))
    fdq.Producer(sup.db).push_many("t", [fdq.Envelope(b"m%d" % i) for i in range(5)])
    rows = [line for line in run("tail", "t", "--subscription", "s", "--count", "5", "--mode", mode,
                                 "--json").stdout.splitlines() if line]
    import json
    assert [json.loads(r)["body"] for r in rows] == ["m%d" % i for i in range(5)]
    assert sup.stats("t")["subscriptions"]["s"]["backlog"] == 0
