"""fdq subs: list, create, show, update, reset, delete, checked against the Python API
(Supervisor.subscription / stats) and against what consumers then get."""
from __future__ import annotations

import time
from functools import partial

import pytest
from click.testing import CliRunner

import fdq
from fdq.cli import cli
from fdq.config import SubscriptionConfig

import fdqtest
from fdqtest import fetch_ids


ROW_KEYS = {"topic", "name", "ephemeral", "catching_up", "paused", "deliver_policy", "start_time_ms", "start_position",
            "backlog", "in_flight", "delayed", "dlq", "consumers", "config"}


# Every message the API can still fetch: up to 5 s for the first, then until a fetch comes back empty.
drain = partial(fdqtest.drain, first_wait_s=5.0, wait_s=0.3, settle="ack_many", create=False, extend_support=True)


@pytest.fixture
def orders(db):
    """Topic orders: 6 messages, keys a/b, header region eu (even) or us (odd)."""
    p = fdq.Supervisor(db)
    p.create_topic("orders", shards=2, extend=True)
    fdq.Producer(db).push_many("orders", [
        fdq.Envelope(f"m{i}".encode(), shard_key="a" if i < 3 else "b",
                     headers={"region": "eu" if i % 2 == 0 else "us"}) for i in range(6)])
    return p


def check_row(row, sup, topic):
    """A row as the API sees the subscription."""
    info = sup.subscription(topic, row["name"])
    st = sup.stats(topic)["subscriptions"][row["name"]]
    assert set(row) == ROW_KEYS
    assert SubscriptionConfig.from_dict(row["config"]) == info["config"]
    assert (row["ephemeral"], row["catching_up"], row["start_position"]) == \
        (info["ephemeral"], info["catching_up"], info["start_position"])
    assert row["deliver_policy"] == info["config"].deliver_policy
    assert row["start_time_ms"] == info["config"].start_time_ms
    assert [row[k] for k in ("backlog", "in_flight", "delayed", "dlq")] == \
        [st[k] for k in ("backlog", "in_flight", "delayed", "dlq")]
    assert row["consumers"] == len(st["consumers"])


def test_create_with_every_option_stores_that_config(run, sup, orders):
    row = run.json("subs", "create", "orders", "audit", "--ack-wait-s", "12.5", "--max-deliver", "4",
                   "--backoff-s", "1,5,30", "--max-ack-pending", "7", "--deliver-policy", "last",
                   "--filter-shard-key", "a*", "--filter-header", "region=eu", "--filter-header", "v=1",
                   "--ordered", "--ephemeral", "--description", "audit trail")
    want = SubscriptionConfig(ack_wait_s=12.5, max_deliver=4, backoff_s=(1.0, 5.0, 30.0), max_ack_pending=7,
                              deliver_policy="last", filter_shard_key="a*",
                              filter_headers={"region": "eu", "v": "1"}, ordered=True, ephemeral=True,
                              description="audit trail")
    assert sup.subscription("orders", "audit")["config"] == want
    check_row(row, sup, "orders")
    assert row["ephemeral"] is True and row["backlog"] == 1          # "last": the last message only

    row = run.json("subs", "create", "orders", "quick", "--ack-policy", "none")
    assert sup.subscription("orders", "quick")["config"] == SubscriptionConfig(ack_policy="none")
    assert row["backlog"] == 6                                      # default policy "all"


def test_deliver_policies_and_filters_reach_consumers(run, db, sup, orders):
    r = run("subs", "create", "orders", "everything")
    assert r.stdout == "" and "6 messages copied from the log" in r.stderr
    run("subs", "create", "orders", "fresh", "--deliver-policy", "new")
    run("subs", "create", "orders", "eu", "--filter-header", "region=eu")
    run("subs", "create", "orders", "keyb", "--filter-shard-key", "b")
    last_ms = max(m.insertion_time for m in drain(db, "orders", "default"))
    while int(time.time() * 1000) <= last_ms:          # the next push is inserted after last_ms
        time.sleep(0.005)
    start = int(time.time() * 1000)
    fdq.Producer(db).push("orders", b"late", shard_key="a", headers={"region": "eu"})
    row = run.json("subs", "create", "orders", "since", "--start-time", str(start))
    assert row["deliver_policy"] == "by_start_time" and row["start_time_ms"] == start
    assert [m.body for m in drain(db, "orders", "since")] == [b"late"]
    assert len(drain(db, "orders", "everything")) == 7
    assert [m.body for m in drain(db, "orders", "fresh")] == [b"late"]
    assert sorted(m.body for m in drain(db, "orders", "eu")) == [b"late", b"m0", b"m2", b"m4"]
    assert sorted(m.body for m in drain(db, "orders", "keyb")) == [b"m3", b"m4", b"m5"]


def test_iso_start_time(run, sup, orders):
    row = run.json("subs", "create", "orders", "iso", "--start-time", "2026-11-23T02:00:00Z")
    assert row["start_time_ms"] == 1795399200000
    assert sup.subscription("orders", "iso")["config"].start_time_ms == 1795399200000
    row = run.json("subs", "create", "orders", "iso2", "--start-time", "2026-11-23T02:00:00",
                   "--deliver-policy", "by_start_time")
    assert row["start_time_ms"] == 1795399200000                     # no zone: UTC
    # to the millisecond, with its zone (a float timestamp x 1000 lost 1 ms on these)
    for name, iso, ms in [("f1", "2039-01-21T16:44:43.562Z", 2179241083562),
                          ("f2", "2004-10-29T19:45:19.330+02:00", 1099071919330),
                          ("f3", "1972-02-25T22:17:37.064", 67904257064)]:
        assert run.json("subs", "create", "orders", name, "--start-time", iso)["start_time_ms"] == ms


def test_list_show_and_the_list_shortcut(run, sup, orders):
    run("subs", "create", "orders", "eu", "--filter-header", "region=eu", "--ordered")
    run("subs", "create", "orders", "tmp#ephemeral", "--deliver-policy", "new")
    rows = run.json("subs", "orders")
    assert rows == run.json("subs", "list", "orders")
    assert [r["name"] for r in rows] == [i["name"] for i in sup.subscriptions("orders")] == \
        ["default", "eu", "tmp#ephemeral"]
    for row in rows:
        check_row(row, sup, "orders")
    assert [r["ephemeral"] for r in rows] == [False, False, True]
    assert run.json("subs", "show", "orders", "eu") == rows[1]
    table = run("subs", "orders").stdout
    assert "tmp#ephemeral" in table and "eu" in table
    shown = run("subs", "show", "orders", "eu").stdout
    assert '{"region": "eu"}' in shown


def test_create_again_same_is_a_no_op_different_is_an_error(run, state, sup, orders):
    run("subs", "create", "orders", "s", "--max-deliver", "3")
    before = state()
    r = run("subs", "create", "orders", "s", "--max-deliver", "3")
    assert "already exists with these options: unchanged" in r.stderr
    assert state() == before
    r = run("subs", "create", "orders", "s", "--max-deliver", "4", code=1)
    assert r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith("fdq: error: subscription 's' of topic 'orders' exists with a different "
                               "configuration: max_deliver (stored 3, given 4)")
    assert state() == before


def test_update(run, db, sup, orders):
    run("subs", "create", "orders", "s", "--max-deliver", "5")
    row = run.json("subs", "update", "orders", "s", "--ack-wait-s", "9", "--backoff-s", "0.5,2",
                   "--max-ack-pending", "3", "--description", "new text")
    config = sup.subscription("orders", "s")["config"]
    assert config == SubscriptionConfig(max_deliver=5, ack_wait_s=9.0, backoff_s=(0.5, 2.0), max_ack_pending=3,
                                        description="new text")
    check_row(row, sup, "orders")
    r = run("subs", "update", "orders", "s", "--backoff-s", "")
    assert sup.subscription("orders", "s")["config"].backoff_s == ()
    assert "backoff_s=()" in r.stderr
    assert len(drain(db, "orders", "s")) == 6                         # the backlog is untouched


def test_reset_rewinds_and_skips(run, db, sup, orders):
    assert len(drain(db, "orders", "default")) == 6
    assert sup.stats("orders")["subscriptions"]["default"]["backlog"] == 0
    out = run.json("subs", "reset", "orders", "default", "--to", "0")
    assert out == {"topic": "orders", "subscription": "default", "to_time_ms": 0, "copied": 6}
    assert sup.stats("orders")["subscriptions"]["default"]["backlog"] == 6
    r = run("subs", "reset", "orders", "default", "--to", "now")
    assert "to now: 0 messages copied" in r.stderr
    assert sup.stats("orders")["subscriptions"]["default"]["backlog"] == 0
    assert sup.subscription("orders", "default")["catching_up"] is False


def test_delete(run, state, sup, orders):
    run("subs", "create", "orders", "gone")
    before = state()
    r = run("subs", "delete", "orders", "gone", input="n\n", code=1)       # declined
    assert "Delete subscription orders/gone with a backlog of 6" in r.stderr
    assert r.stderr.splitlines()[-1].endswith("fdq: error: not confirmed: subscription orders/gone not deleted "
                                              "(give --yes to skip the question)")
    assert state() == before
    run("subs", "delete", "orders", "gone", input="y\n")
    assert sup.config("orders").subs == ("default",)
    run("subs", "create", "orders", "gone2")
    r = run("subs", "delete", "orders", "gone2", "--yes")
    assert r.stderr == "deleted subscription 'gone2' of topic 'orders'\n"
    assert [i["name"] for i in sup.subscriptions("orders")] == ["default"]


USAGE_ERRORS = [  # (argv, text the one "Error:" line must contain)
    (["subs", "create", "orders", "s", "--ack-wait-s", "0"], "ack_wait_s must be a number > 0, not 0.0"),
    (["subs", "create", "orders", "s", "--ack-wait-s", "-1"], "'-1': a duration must be >= 0"),
    (["subs", "create", "orders", "s", "--max-deliver", "0"], "max_deliver must be an integer > 0, not 0"),
    (["subs", "create", "orders", "s", "--max-deliver", "x"], "'x' is not a valid integer"),
    (["subs", "create", "orders", "s", "--backoff-s", "1,x"], "'x' is not a duration"),
    (["subs", "create", "orders", "s", "--max-ack-pending", "0"], "max_ack_pending must be an integer > 0"),
    (["subs", "create", "orders", "s", "--ack-policy", "maybe"], "'maybe' is not one of 'explicit', 'none'"),
    (["subs", "create", "orders", "s", "--deliver-policy", "old"], "'old' is not one of"),
    (["subs", "create", "orders", "s", "--start-time", "soon"], "'soon' is not a time"),
    (["subs", "create", "orders", "s", "--filter-header", "novalue"], "a header filter is name=value"),
    (["subs", "create", "orders", "s", "--filter-header", "bad name=1"], "invalid header name 'bad name'"),
    (["subs", "create", "orders", "s", "--filter-header", "a=1", "--filter-header", "a=2"],
     "header 'a' is given twice"),
    (["subs", "create", "orders", "s", "--filter-shard-key", ""], "filter_shard_key must be a non-empty glob"),
    (["subs", "create", "orders", "s", "--description", "x" * 4097], "description must be a str of at most 4096"),
    (["subs", "create", "orders", "s", "--ack-policy", "none", "--max-deliver", "3"],
     "max_deliver needs ack_policy='explicit'"),
    (["subs", "create", "orders", "s", "--ack-policy", "none", "--ordered"], "ordered=True needs ack_policy"),
    (["subs", "create", "orders", "s", "--start-time", "5ms", "--deliver-policy", "new"],
     "start_time_ms needs deliver_policy='by_start_time'"),
    (["subs", "create", "orders", "s", "--deliver-policy", "by_start_time"],
     "deliver_policy='by_start_time' needs start_time_ms"),
    (["subs", "create", "orders", "s", "--backoff-s", "1,2,3", "--max-deliver", "3"],
     "backoff_s has 3 entries but max_deliver is 3"),
    (["subs", "create", "orders", "bad name"], "invalid subscription name 'bad name'"),
    (["subs", "create", "bad/topic", "s"], "invalid topic name 'bad/topic'"),
    (["subs", "create", "orders"], "Missing argument 'NAME'"),
    (["subs", "update", "orders", "default"], "nothing to update: give one of --description, --ack-wait-s"),
    (["subs", "update", "orders", "default", "--ordered"], "--ordered cannot be updated"),
    (["subs", "update", "orders", "default", "--deliver-policy", "new"], "--deliver-policy cannot be updated"),
    (["subs", "update", "orders", "default", "--max-deliver", "-2"], "max_deliver must be an integer > 0"),
    (["subs", "reset", "orders", "default"], "Missing option '--to'"),
    (["subs", "reset", "orders", "default", "--to", "later"], "'later' is not a time: give ISO-8601"),
    (["subs", "show", "orders"], "Missing argument 'NAME'"),
]


@pytest.mark.parametrize("argv,text", USAGE_ERRORS, ids=[" ".join(a)[:50] for a, _t in USAGE_ERRORS])
def test_usage_errors_exit_2(run, orders, state, argv, text):
    before = state()
    run.usage_error(argv, text, input="y\n")
    assert state() == before


FAILURES = [  # (argv, the stderr line after "fdq: error: ")
    (["subs", "nosuch"], "topic 'nosuch' does not exist"),
    (["subs", "create", "nosuch", "s"], "topic 'nosuch' does not exist"),
    (["subs", "show", "orders", "other"], "subscription 'other' of topic 'orders' does not exist "
                                          "(subscriptions: default)"),
    (["subs", "delete", "orders", "other", "--yes"], "subscription 'other' of topic 'orders' does not exist "
                                                     "(subscriptions: default)"),
    (["subs", "update", "orders", "other", "--max-deliver", "3"],
     "subscription 'other' of topic 'orders' does not exist (subscriptions: default)"),
    (["subs", "reset", "orders", "other", "--to", "now"],
     "subscription 'other' of topic 'orders' does not exist (subscriptions: default)"),
    (["subs", "update", "orders", "limited", "--backoff-s", "1,2,3"],      # against the stored max_deliver
     "backoff_s has 3 entries but max_deliver is 2: a message is redelivered at most max_deliver - 1 times, "
     "so backoff_s may have at most 1"),
    (["subs", "update", "orders", "fire", "--max-deliver", "3"],
     "max_deliver needs ack_policy='explicit' (ack_policy is 'none': nothing is leased or redelivered)"),
]


@pytest.mark.parametrize("argv,message", FAILURES, ids=[" ".join(a)[:50] for a, _m in FAILURES])
def test_fdq_errors_exit_1_with_one_line(run, orders, sup, state, argv, message):
    if "limited" in argv:
        sup.create_subscription("orders", "limited", SubscriptionConfig(max_deliver=2))
    if "fire" in argv:
        sup.create_subscription("orders", "fire", SubscriptionConfig(ack_policy="none"))
    before = state()
    r = run(*argv, code=1)
    assert r.stdout == ""
    assert r.stderr == f"fdq: error: {message}\n"
    assert state() == before


def test_create_on_a_paused_topic_is_refused(run, sup, orders, state):
    sup.pause("orders")
    before = state()
    r = run("subs", "create", "orders", "later", code=1)
    assert r.stderr == ("fdq: error: topic 'orders' is paused: subscriptions can be created once it is "
                        "playing again\n")
    assert state() == before
    sup.play("orders")
    assert run.json("subs", "create", "orders", "later")["backlog"] == 6


def test_catch_up_of_a_long_log_reports_progress_on_stderr(run, db, sup, monkeypatch):
    from fdq.cli import render
    monkeypatch.setattr(render, "PLAIN_EVERY_S", 0.0)        # a plain line per chunk (stderr is no terminal)
    fdq.Producer(db).push_many("big", [fdq.Envelope(b"x%d" % i) for i in range(1200)])
    r = run("subs", "create", "big", "late")
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert lines == ["catching up big/late: 500", "catching up big/late: 1,000", "catching up big/late: 1,200",
                     "created subscription 'late' of topic 'big': deliver all, 1,200 messages copied from the log"]
    assert sup.stats("big")["subscriptions"]["late"]["backlog"] == 1200
    r = run("subs", "reset", "big", "late", "--to", "0", "--json")
    assert r.stderr.splitlines()[-1] == ("reset subscription 'late' of topic 'big' to 1970-01-01T00:00:00.000Z: "
                                         "1,200 messages copied from the log")
    assert any(line.startswith("resetting big/late: ") for line in r.stderr.splitlines())
    assert sup.stats("big")["subscriptions"]["late"]["backlog"] == 1200    # rewound: each message once


def test_cli_header_and_filter_header_agree(db, db_url):
    """The CLI's own spelling: pushed with --header flag=true, filtered with
    --filter-header flag=true."""
    run = CliRunner().invoke
    assert run(cli, ["--url", db_url, "topics", "create", "t", "--extend"]).exit_code == 0
    res = run(cli, ["--url", db_url, "subs", "create", "t", "f", "--filter-header", "flag=true"])
    assert res.exit_code == 0, res.output
    res = run(cli, ["--url", db_url, "push", "t", "--header", "flag=true", "hello"])
    assert res.exit_code == 0, res.output
    assert len(fetch_ids(db, "t", "f", timeout=0.5, extend_support=True)) == 1


def test_a_header_filter_on_a_topic_without_headers_exits_2(run, db, sup, state):
    """On a topic without extend support the filter dropped every message (exit 0, then
    0 delivered): refused, one line naming the fix, nothing created."""
    run("topics", "create", "plain")
    fdq.Producer(db).push("plain", b"x")
    before = state()
    r = run.usage_error(["subs", "create", "plain", "eu", "--filter-header", "region=eu"],
                        "a header filter needs a topic with extend support")
    assert "fdq topics upgrade plain --extend" in r.stderr
    assert state() == before
    run("topics", "upgrade", "plain", "--extend")
    run("subs", "create", "plain", "eu", "--filter-header", "region=eu")
    assert sup.subscription("plain", "eu")["config"].filter_headers == {"region": "eu"}


def test_stats_show_what_a_filter_dropped(run, db, sup, orders):
    run("subs", "create", "orders", "eu", "--filter-header", "region=eu")
    assert len(drain(db, "orders", "eu")) == 3
    row = run.json("stats", "orders")["subscriptions"]["eu"]
    assert row["filtered"] == 3 and row["backlog"] == 0
    assert "filtered" in run("stats", "orders").stdout
