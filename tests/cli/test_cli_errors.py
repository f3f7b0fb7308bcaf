"""Bad input: the right exit code (1 for an FDQError, 2 for a usage error), one line
naming the problem, and nothing already stored harmed."""
from __future__ import annotations

import pytest

import fdq


@pytest.fixture
def stored(run, db, sup):
    """A database holding messages: an extend topic with headers and a DLQ entry, a
    plain topic with a backlog."""
    run("topics", "create", "orders", "--shards", 4, "--extend")
    p = fdq.Producer(db)
    p.push_many("orders", [fdq.Envelope(f"o{i}".encode(), shard_key="k", headers={"i": i}) for i in range(5)])
    p.push_many("plain", [fdq.Envelope(f"p{i}".encode()) for i in range(3)])
    quick = fdq.ConsumerConfig(heartbeat_interval_s=0.05, lease_check_interval_s=0.05)   # quick close
    with fdq.Consumer(db, "orders", extend_support=True, config=quick) as c:
        [m] = c.fetch(1, timeout=5)
        m.term("poison")
    return sup


USAGE_ERRORS = [  # (argv, text the message must contain)
    (["stats", "bad name"], "invalid topic name 'bad name'"),
    (["push", "a/b", "x"], "invalid topic name 'a/b'"),
    (["topics", "create", "x" * 65], "invalid topic name"),
    (["tail", "orders", "--subscription", "no way"], "invalid subscription name 'no way'"),
    (["topics", "create", "new", "--shards", "0"], "shards must be an integer > 0, not 0"),
    (["topics", "create", "new", "--shards", "many"], "'many' is not an integer"),
    (["topics", "create", "new", "--shards", "5000"], "shards must be at most 4096"),
    (["rebalance", "orders", "--shards", "-3"], "shards must be an integer > 0"),
    (["rebalance", "orders", "--shards", "9" * 20], "shards must be at most 4096, not 99999999999999999999"),
    (["topics", "create", "new", "--max-backlog", "0"], "max_backlog must be an integer > 0, not 0"),
    (["topics", "create", "new", "--max-backlog", "lots"], "'lots' is not a valid integer"),
    (["topics", "create", "new", "--retention-s", "-5"], "'-5': a duration must be >= 0 (e.g. 90 (seconds), 1m30s"),
    (["topics", "create", "new", "--max-backlog", "9" * 23], "max_backlog must be at most 9,223,372,036,854,775,807"),
    (["topics", "create", "new", "--retention-s", "1e300"], "'1e300' is not a duration"),
    (["topics", "create", "new", "--retention-s", "40000d"], "a duration must be at most 3,153,600,000 s"),
    (["subs", "create", "orders", "s2", "--max-deliver", "9" * 23], "max_deliver must be at most"),
    (["subs", "create", "orders", "s2", "--max-ack-pending", "9" * 23], "max_ack_pending must be at most"),
    (["subs", "create", "orders", "s2", "--ack-wait-s", "40000d"], "a duration must be at most"),
    (["subs", "create", "orders", "s2", "--backoff-s", "1,40000d"], "'40000d': a duration must be at most"),
    (["subs", "update", "orders", "default", "--max-deliver", "9" * 23], "max_deliver must be at most"),
    (["topics", "create", "new", "--retention-s", "0"], "retention_s must be a number > 0, not 0.0"),
    (["topics", "create", "new", "--retention-s", "inf"], "'inf' is not a duration"),
    (["push", "orders", "x", "--header", "novalue"], "a header is name=value"),
    (["push", "orders", "x", "--header", "bad name=1"], "invalid header name 'bad name'"),
    (["push", "orders", "x", "--header", "##secret=1"], "header '##secret': names starting '##' are reserved"),
    (["push", "orders", "x", "-H", "a=1", "-H", "a=2"], "header 'a' is given twice"),
    (["push", "orders", "x", "-H", "##client_dispatch_tag=1"], "the tag must be a non-empty string"),
    (["push", "orders", "x", "--delay", "-1"], "'-1': a duration must be >= 0"),
    (["push", "orders", "x", "--delay", "nan"], "'nan' is not a duration"),
    (["push", "orders", "x", "--delay", "5000d"], "delay must be seconds from 0 to 315,360,000"),
    (["push", "orders", "-", "--delay", "5000d"], "delay must be seconds from 0 to 315,360,000"),
    (["push", "orders", "x", "--msg-id", "m" * 257], "msg_id must be a non-empty str of at most 256"),
    (["push", "orders", "x", "--key", "k" * 2000], "shard_key of 2,000 bytes (UTF-8) exceeds the limit"),
    (["push", "orders", "-", "--msg-id", "m1"], "--msg-id names one message"),
    (["replay", "orders", "--start", "yesterday"], "'yesterday' is not a time: give ISO-8601"),
    (["replay", "orders", "--start", "2026-13-45"], "'2026-13-45' is not a time"),
    (["replay", "orders", "--start", "2000s", "--end", "1000s"],
     "--end (1970-01-01T00:16:40.000Z) must be after --start (1970-01-01T00:33:20.000Z)"),
    (["replay", "orders", "--start", "1700000000"], "'1700000000' is ambiguous: as epoch milliseconds it is "
     "1970-01-20T16:13:20.000Z, as epoch seconds 2023-11-14T22:13:20.000Z; write 1700000000s for seconds"),
    (["trim", "orders", "--before", "1700000000"], "'1700000000' is ambiguous"),
    (["subs", "reset", "orders", "default", "--to", "1795399200"], "'1795399200' is ambiguous"),
    (["subs", "create", "orders", "s2", "--start-time", "1"], "'1' is ambiguous"),
    (["replay", "orders"], "give the window's start: --start TIME or --since DURATION"),
    (["trim", "orders", "--before", "soon"], "'soon' is not a time"),
    (["replay", "orders", "--start", "9" * 23], "is out of range: times go from 1970-01-01 to 9999-12-31 (epoch milliseconds 0 to 253402300799999)"),
    (["replay", "orders", "--start", "0", "--end", "9" * 20], "is out of range"),
    (["replay", "orders", "--start", "1969-12-31T23:59:59Z"], "is out of range"),
    (["trim", "orders", "--before", "9" * 30], "is out of range"),
    (["subs", "reset", "orders", "default", "--to", "9" * 23], "is out of range"),
    (["subs", "create", "orders", "late", "--start-time", "9" * 23], "is out of range"),
    (["tail", "orders", "--count", "0"], "0 is not in the range x>=1"),
    (["tail", "orders", "--mode", "exactly-once"], "'exactly-once' is not one of"),
    (["tail", "orders", "--tag", "a b"], "invalid tag 'a b'"),
    (["topics", "upgrade", "plain"], "nothing to upgrade: give --extend"),
    (["stats"], "Missing argument 'TOPIC'"),
    (["frobnicate"], "No such command 'frobnicate'"),
    (["topics", "--shards", "3"], "No such option '--shards'"),
]


@pytest.mark.parametrize("argv,text", USAGE_ERRORS, ids=[" ".join(a)[:40] for a, _t in USAGE_ERRORS])
def test_usage_errors_exit_2(run, stored, state, argv, text):
    before = state()
    run.usage_error(argv, text, input="a\n")
    assert state() == before


FAILURES = [  # (argv, the whole stderr line after "fdq: error: ")
    (["stats", "nosuch"], "topic 'nosuch' does not exist"),
    (["consumers", "nosuch"], "topic 'nosuch' does not exist"),
    (["tail", "nosuch", "--count", "1"], "topic 'nosuch' does not exist"),
    (["pause", "nosuch"], "topic 'nosuch' does not exist"),
    (["play", "nosuch"], "topic 'nosuch' does not exist"),
    (["rebalance", "nosuch"], "topic 'nosuch' does not exist"),
    (["rebalance", "nosuch", "--shards", "2"], "topic 'nosuch' does not exist"),
    (["replay", "nosuch", "--start", "0"], "topic 'nosuch' does not exist"),
    (["trim", "nosuch"], "topic 'nosuch' does not exist"),
    (["dlq", "list", "nosuch"], "topic 'nosuch' does not exist"),
    (["dlq", "redrive", "nosuch", "--all"], "topic 'nosuch' does not exist"),
    (["dlq", "purge", "nosuch", "--all", "--yes"], "topic 'nosuch' does not exist"),
    (["topics", "delete", "nosuch", "--yes"], "topic 'nosuch' does not exist"),
    (["topics", "upgrade", "nosuch", "--extend"], "topic 'nosuch' does not exist"),
    (["dlq", "list", "orders", "-s", "other"],
     "subscription 'other' of topic 'orders' does not exist (subscriptions: default)"),
    (["tail", "orders", "-s", "other", "--count", "1"],
     "subscription 'other' of topic 'orders' does not exist (subscriptions: default)"),
    (["topics", "create", "orders", "--shards", "8"],
     "topic 'orders' already exists with 4 shards, not 8 (change the count with rebalance)"),
    (["push", "plain", "x", "--header", "a=1"],
     "topic 'plain' has no extend support: headers are refused (create it with extend=True or upgrade it)"),
]


@pytest.mark.parametrize("argv,message", FAILURES, ids=[" ".join(a)[:40] for a, _m in FAILURES])
def test_fdq_errors_exit_1_with_one_line(run, stored, state, argv, message):
    before = state()
    r = run(*argv, code=1)
    assert r.stdout == ""
    assert r.stderr == f"fdq: error: {message}\n"
    assert state() == before


def test_oversize_message_from_stdin(run, stored, state):
    run("topics", "create", "tiny")
    before = state()
    big = b"y" * ((1 << 20) + 1)
    r = run("push", "tiny", "-", input=b"small\n" + big + b"\n", code=1)
    assert r.stdout == ""
    assert r.stderr.splitlines()[-1].startswith("fdq: error: message body of 1,048,577 bytes exceeds")
    assert state() == before                                  # the batch is all or nothing


def test_bad_url(run, tmp_path):
    from click.testing import CliRunner
    from fdq.cli import cli
    for url, text in [("bogus://x", "unknown scheme 'bogus'"),
                      (f"sqlite://{tmp_path}/missing/dir/x.db", "does not exist"),
                      (f"sqlite://{tmp_path}/x.db?fault=1", "unknown option 'fault'")]:
        r = CliRunner().invoke(cli, ["--url", url, "topics"])
        assert r.exit_code == 1, r.stderr
        assert r.stderr.startswith("fdq: error: ") and text in r.stderr and r.stderr.count("\n") == 1
    not_a_db = tmp_path / "junk.db"
    not_a_db.write_bytes(b"this is not a database" * 100)
    r = CliRunner().invoke(cli, ["--url", f"sqlite://{not_a_db}", "topics"])
    assert r.exit_code == 1 and r.stderr.startswith("fdq: error: ") and r.stderr.count("\n") == 1
    assert not_a_db.read_bytes() == b"this is not a database" * 100
