"""fdq topics: list, create, delete, upgrade; --url / FDQ_URL; checked against the API."""
from __future__ import annotations

import dataclasses

import fdq
from fdq.config import TOPIC_STATE


def test_topics_empty(run):
    r = run("topics")
    assert r.stdout == ""
    assert "no topics" in r.stderr
    assert run.json("topics") == []


def test_create_and_list(run, sup):
    r = run("topics", "create", "orders", "--shards", 4, "--extend", "--max-backlog", 1000,
            "--retention-s", 3600)
    assert "created topic 'orders'" in r.stderr
    config = sup.config("orders")
    assert (config.shards, config.extend, config.max_backlog, config.retention_s) == (4, True, 1000, 3600)
    run("topics", "create", "plain")
    assert sup.config("plain").shards == fdq.TopicConfig().shards

    fdq.Producer(sup.db).push_many("plain", [fdq.Envelope(b"x")] * 3)
    rows = run.json("topics")
    assert [r["name"] for r in rows] == [n for n, _c in sup.topics()] == ["orders", "plain"]
    orders, plain = rows
    assert orders == {"name": "orders", "shards": 4, "hash": "blake2b-64", "extend": True, "max_backlog": 1000,
                      "dedupe_window_s": 120.0, "retention_s": 3600.0, "retention_bytes": None,
                      "retention_messages": None, "ttl_s": None, "ttl_action": "drop",
                      "max_message_bytes": 1 << 20, "paused": False, "resharding_to": None,
                      "subscriptions": ["default"], "inserted": 0, "pending": 0, "backlog": 0}
    st = sup.stats("plain")
    assert plain["inserted"] == st["counters"]["inserted"] == 3
    assert plain["backlog"] == st["subscriptions"]["default"]["backlog"] == 3
    assert plain["extend"] is False

    table = run("topics").stdout
    lines = table.splitlines()
    assert "topic" in lines[0] and "backlog" in lines[0]
    assert any(line.split()[0] == "plain" and "3" in line for line in lines)


def test_create_json_and_existing_topic(run, sup):
    row = run.json("topics", "create", "orders", "--shards", 8)
    assert row["name"] == "orders" and row["shards"] == 8
    r = run("topics", "create", "orders", "--shards", 8)
    assert "already exists" in r.stderr
    r = run("topics", "create", "orders", "--shards", 4, code=1)
    assert r.stderr.startswith("fdq: error: ") and "already exists with 8 shards" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert sup.config("orders").shards == 8
    # The default count is a request too when given: 16 against 8 is refused...
    r = run("topics", "create", "orders", "--shards", 16, code=1)
    assert "already exists with 8 shards, not 16" in r.stderr and "rebalance" in r.stderr
    # ...while no --shards on an existing topic leaves it as it is.
    r = run("topics", "create", "orders")
    assert "already exists (8 shards" in r.stderr
    assert sup.config("orders").shards == 8


def test_delete(run, sup):
    fdq.Producer(sup.db).push("orders", b"x")
    fdq.Producer(sup.db).push("keep", b"y")
    r = run("topics", "delete", "orders", input="n\n", code=1)     # declined: nothing deleted
    assert r.stderr.splitlines()[-1].endswith("fdq: error: not confirmed: topic 'orders' not deleted "
                                              "(give --yes to skip the question)")
    r = run("topics", "delete", "orders", input="", code=1)        # no answer (stdin at its end)
    assert "fdq: error: not confirmed: topic 'orders' not deleted" in r.stderr
    assert sup.config("orders")
    run("topics", "delete", "orders", input="y\n")
    assert [n for n, _c in sup.topics()] == ["keep"]
    run("topics", "create", "gone")
    r = run("topics", "delete", "gone", "--yes")
    assert "deleted topic 'gone'" in r.stderr
    assert [n for n, _c in sup.topics()] == ["keep"]
    assert sup.stats("keep")["counters"]["inserted"] == 1


def test_upgrade_extend(run, sup):
    p = fdq.Producer(sup.db)
    first = p.push("orders", b"plain-before").id
    run("topics", "upgrade", "orders", code=2)             # nothing to upgrade
    assert sup.config("orders").extend is False
    row = run.json("topics", "upgrade", "orders", "--extend")
    assert row["extend"] is True and sup.config("orders").extend is True
    run("push", "orders", "with-header", "--header", "h=1")
    got = run.json_lines("tail", "orders", "--count", 2, "--timeout", 10)
    assert {m["body"] for m in got} == {"plain-before", "with-header"}
    assert {m["id"]: m["headers"] for m in got}[first] == {}


def test_url_from_environment(url, tmp_path, sup):
    from click.testing import CliRunner
    from fdq.cli import cli
    r = CliRunner().invoke(cli, ["topics", "create", "viaenv"], env={"FDQ_URL": url})
    assert r.exit_code == 0, r.stderr
    assert [n for n, _c in sup.topics()] == ["viaenv"]
    other = f"sqlite://{tmp_path / 'other.db'}"          # --url wins over FDQ_URL
    r = CliRunner().invoke(cli, ["--url", other, "topics", "--json"], env={"FDQ_URL": url})
    assert r.exit_code == 0 and r.stdout.strip() == "[]"


def test_default_url_is_the_embedded_database(tmp_path):
    from click.testing import CliRunner
    from fdq.cli import cli
    home = tmp_path / "home"
    r = CliRunner().invoke(cli, ["topics", "create", "t"], env={"FDQ_URL": None, "FDQ_HOME": str(home)})
    assert r.exit_code == 0, r.stderr
    assert (home / "fdq.db").exists()
    db = fdq.connect(f"sqlite://{home / 'fdq.db'}")
    assert [n for n, _c in fdq.Supervisor(db).topics()] == ["t"]


# Every TopicConfig field that is a setting: not its state, not its subscriptions' names.
SETTINGS = {f.name for f in dataclasses.fields(fdq.TopicConfig)} - set(TOPIC_STATE) - {"subs"}


def test_topics_json_rows_carry_every_setting(run, sup):
    sup.create_topic("sized", shards=3, retention_bytes=5000, dedupe_window_s=30, max_message_bytes=4096)
    [row] = run.json("topics")
    config = sup.config("sized")
    assert SETTINGS <= set(row)
    assert {k: row[k] for k in SETTINGS} == {k: getattr(config, k) for k in SETTINGS}


def test_topics_show_prints_every_setting_and_each_subscription_with_its_config(run, sup):
    run("topics", "create", "orders", "--shards", 4, "--extend", "--max-backlog", 1000, "--retention-s", 3600,
        "--retention-bytes", 1 << 30, "--dedupe-window-s", 45)
    run("topics", "update", "orders", "--max-message-bytes", 65536)
    run("subs", "create", "orders", "audit", "--ack-wait-s", 30, "--backoff-s", "1,5", "--max-deliver", 7,
        "--filter-header", "region=eu", "--description", "the audit trail")
    fdq.Producer(sup.db).push_many("orders", [fdq.Envelope(b"x")] * 2)
    sup.pause_subscription("orders", "audit")

    data = run.json("topics", "show", "orders")
    config = sup.config("orders")
    assert {k: data[k] for k in SETTINGS} == {k: getattr(config, k) for k in SETTINGS}
    assert (data["max_message_bytes"], data["dedupe_window_s"], data["retention_bytes"]) == (65536, 45, 1 << 30)
    [row] = [r for r in run.json("topics") if r["name"] == "orders"]
    assert {k: v for k, v in data.items() if k != "subscriptions"} == \
        {k: v for k, v in row.items() if k != "subscriptions"}              # the list's row, in full
    subs = {s["name"]: s for s in data["subscriptions"]}
    assert list(subs) == row["subscriptions"] == ["default", "audit"]
    assert subs == {s["name"]: s for s in run.json("subs", "orders")}      # as fdq subs lists them
    audit = sup.subscription("orders", "audit")
    assert subs["audit"]["config"] == audit["config"].as_dict()
    assert subs["audit"]["paused"] is True and subs["audit"]["backlog"] == 2
    assert subs["audit"]["config"]["backoff_s"] == [1.0, 5.0] and subs["audit"]["config"]["max_deliver"] == 7

    out = run("topics", "show", "orders").stdout
    for name in SETTINGS | {"paused", "backlog"}:
        assert f"\n{name} " in out, name
    lines = {line.split()[0]: line.split()[-1] for line in out.splitlines()
             if line.split() and line.split()[0] in SETTINGS}
    assert (lines["shards"], lines["retention_s"], lines["max_message_bytes"], lines["max_backlog"]) == \
        ("4", "3600", "65,536", "1,000")
    assert "subscription orders/default" in out and "subscription orders/audit" in out
    for text in ("the audit trail", '{"region": "eu"}', "[1.0, 5.0]"):
        assert text in out, text


def test_topics_show_of_a_missing_topic_is_an_error(run):
    r = run("topics", "show", "nosuch", code=1)
    assert r.stdout == "" and r.stderr == "fdq: error: topic 'nosuch' does not exist\n"
