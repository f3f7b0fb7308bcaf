"""An operator's sequences: retention options, trim's messages, consumers shown as
they are (a killed one is not "live")."""
from __future__ import annotations

import json

import pytest

import fdq


def test_trim_of_a_topic_with_retention_bytes_only_does_not_say_it_has_no_retention(run, db, sup):
    sup.create_topic("sized", retention_bytes=1)
    fdq.Producer(db).push_many("sized", [fdq.Envelope(b"a" * 100)] * 3)
    r = run("trim", "sized", "--json")
    assert "no retention" not in r.stderr, r.stderr
    assert '"deleted": 3' in r.stdout
    sup.create_topic("unlimited")
    assert "has no retention: give --before" in run("trim", "unlimited").stderr


def test_retention_messages_keeps_the_newest_entries(run, db, sup):
    run("topics", "create", "counted", "--retention-messages", 3)
    fdq.Producer(db).push_many("counted", [fdq.Envelope(b"m%d" % i) for i in range(5)])
    r = run("trim", "counted", "--json")
    assert "no retention" not in r.stderr, r.stderr
    assert json.loads(r.stdout)["deleted"] == 2
    run("topics", "update", "counted", "--retention-messages", 1)
    assert run.json("trim", "counted")["deleted"] == 2
    assert [m["body"] for m in sup.peek("counted", states=("ready",))] == [b"m%d" % i for i in range(5)]  # queues kept


def test_push_ttl_and_the_topic_ttl_options(run, db, sup):
    run("topics", "create", "t", "--shards", 1, "--ttl-s", "2m", "--ttl-action", "dead_letter")
    assert (sup.config("t").ttl_s, sup.config("t").ttl_action) == (120.0, "dead_letter")
    run("push", "t", "x", "--ttl", "30s")
    [m] = sup.peek("t", states=("ready",))
    run("topics", "update", "t", "--ttl-s", "none", "--ttl-action", "drop")
    assert (sup.config("t").ttl_s, sup.config("t").ttl_action) == (None, "drop")
    assert "ttl must be seconds above 0" in run("push", "t", "x", "--ttl", "0", code=2).stderr
    assert m["body"] == b"x"


def test_a_topic_a_push_created_gets_retention_by_topics_update(run, db, sup):
    """``fdq push`` creates a missing topic with the defaults (no retention): an operator
    must be able to give it retention afterwards, or its log grows for good."""
    run("push", "auto", "-", input="".join(f"m{i}\n" for i in range(20)))
    assert run.json("trim", "auto")["deleted"] == 0           # no retention: nothing to trim
    row = run.json("topics", "update", "auto", "--retention-bytes", 1, "--max-backlog", 1000)
    assert row == {"topic": "auto", "max_backlog": 1000, "dedupe_window_s": 120.0, "retention_s": None,
                   "retention_bytes": 1, "retention_messages": None, "ttl_s": None, "ttl_action": "drop",
                   "max_message_bytes": 1 << 20}
    assert sup.config("auto").retention_bytes == 1
    assert run.json("trim", "auto")["deleted"] == 20
    assert sup.stats("auto")["counters"]["log_bytes"] == 0
    # none clears an optional setting; the rest stays as it was
    run("topics", "update", "auto", "--retention-bytes", "none", "--retention-s", 3600)
    config = sup.config("auto")
    assert (config.retention_bytes, config.retention_s, config.max_backlog) == (None, 3600.0, 1000)


def test_topics_create_takes_retention_bytes_and_dedupe_window(run, sup):
    run("topics", "create", "sized", "--retention-bytes", 5000, "--dedupe-window-s", 10)
    config = sup.config("sized")
    assert (config.retention_bytes, config.dedupe_window_s) == (5000, 10.0)


def test_topics_update_bad_values_exit_2_and_unknown_topic_exit_1(run, sup, state):
    run("topics", "create", "orders")
    before = state()
    for argv, text in [(["--retention-bytes", 0], "retention_bytes must be an integer > 0, not 0"),
                       (["--retention-s", "-1"], "'-1': a duration must be >= 0"),
                       (["--max-backlog", "lots"], "'lots' is not a valid integer"),
                       (["--max-message-bytes", 9 << 20], "max_message_bytes must be at most 8 MiB"),
                       (["--dedupe-window-s", "none"], "'none' is not a duration"),
                       ([], "nothing to update")]:
        r = run("topics", "update", "orders", *argv, code=2)
        assert text in r.stderr, r.stderr
    r = run("topics", "update", "nosuch", "--retention-s", 60, code=1)
    assert r.stderr == "fdq: error: topic 'nosuch' does not exist\n"
    assert state() == before


@pytest.mark.parametrize("argv", [["--shards", "4"], ["--shards=4"], ["--retention-s", "60", "--shards", "4"]])
def test_topics_update_shards_points_to_rebalance(run, sup, state, argv):
    """``fdq topics update NAME --shards N`` answered click's bare "No such option:
    --shards": a topic's shard count changes with ``fdq rebalance NAME --shards N``
    (it moves every queued message); the usage error (exit 2) says so, changing nothing."""
    run("topics", "create", "orders")
    before = state()
    r = run("topics", "update", "orders", *argv, code=2)
    assert "--shards cannot be updated" in r.stderr and "fdq rebalance orders --shards 4" in r.stderr, r.stderr
    assert state() == before


def test_update_topic_refuses_what_it_cannot_change(sup):
    sup.create_topic("t", shards=4)
    with pytest.raises(fdq.ConfigError, match=r"topic option\(s\) extend, shards cannot be updated"):
        sup.update_topic("t", shards=8, extend=True)
    with pytest.raises(fdq.ConfigError, match="retention_s must be a number > 0"):
        sup.update_topic("t", retention_s=-1)
    assert sup.config("t").shards == 4


CONSUMER = """
import sys, time, fdq
db = fdq.connect(sys.argv[1])
c = fdq.tail(db, "orders", lambda m: None,
             config=fdq.ConsumerConfig(heartbeat_interval_s=0.2, lease_check_interval_s=0.05))
print("ready", flush=True)
time.sleep(120)
"""


def test_a_consumer_killed_with_none_left_shows_as_a_zombie_not_live(run, url, tmp_path, sup, wait):
    """kill -9 of a topic's only consumer: nobody declares it a zombie, so it stays
    registered with all its shards; stats and fdq consumers must not show it live."""
    import os
    import signal
    import subprocess
    import sys
    run("topics", "create", "orders", "--shards", 4)
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)
    p = subprocess.Popen([sys.executable, str(script), url], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        assert p.stdout.readline() == b"ready\n"
        # (zombie None: no heartbeat yet, so no age)
        wait(lambda: [c["zombie"] for c in run.json("consumers", "orders")] == [False], timeout=30,
             what="the consumer's first heartbeat")
        [c] = run.json("consumers", "orders")
        assert c["zombie_after_s"] == pytest.approx(0.6)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        wait(lambda: run.json("consumers", "orders")[0]["zombie"], timeout=30, what="the zombie mark")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    [c] = run.json("consumers", "orders")
    assert c["heartbeat_age_s"] > 0.6 and len(c["shards"]) == 4      # registered, owning its shards
    [s] = run.json("stats", "orders")["subscriptions"].values()
    assert s["consumers"][0]["zombie"] is True
    assert "(zombie)" in run("consumers", "orders").stdout
    assert "(zombie)" in run("stats", "orders").stdout
    assert "divided among 1 consumer (1 of them zombies" in run("rebalance", "orders").stderr


def test_a_subscription_paused_on_its_own_is_shown_and_can_be_played(run, db, sup):
    """An NSQ client's /channel/pause pauses one subscription (Supervisor.pause_subscription):
    its consumers then take nothing while its backlog grows. fdq stats and fdq subs must
    say so, and fdq subs play must resume it (the broker may not even be running)."""
    run("topics", "create", "orders", "--shards", 2)
    run("subs", "create", "orders", "audit")
    fdq.Producer(db).push_many("orders", [fdq.Envelope(f"m{i}".encode()) for i in range(5)])
    sup.pause_subscription("orders", "audit")              # as the broker's /channel/pause does
    subs = run.json("stats", "orders")["subscriptions"]
    assert (subs["audit"]["paused"], subs["default"]["paused"]) == (True, False)
    assert subs["audit"]["catching_up"] is False
    rows = {r["name"]: r for r in run.json("subs", "orders")}
    assert (rows["audit"]["paused"], rows["default"]["paused"]) == (True, False)
    assert "paused" in run("stats", "orders").stdout
    assert run("tail", "orders", "-s", "audit", "--timeout", "0.5").stdout == ""    # nothing delivered
    r = run("subs", "play", "orders", "audit")
    assert "resumed subscription 'audit' of topic 'orders'" in r.stderr
    assert len(run("tail", "orders", "-s", "audit", "-n", 5, "--timeout", 10).stdout.splitlines()) == 5
    r = run("subs", "pause", "orders", "audit", "--json")
    assert r.stdout and '"paused": true' in r.stdout
    assert sup.stats("orders")["subscriptions"]["audit"]["paused"] is True
    r = run("subs", "pause", "orders", "nosuch", code=1)
    assert r.stderr.startswith("fdq: error: subscription 'nosuch' of topic 'orders' does not exist")


def test_a_reshard_to_another_count_left_unfinished_says_how_to_finish_it(run, db, sup):
    """A rebalance --shards killed part-way leaves the topic resharding; asking for another
    count must say how to get out of that, not only that it is resharding."""
    from fdq.supervisor import reshard_begin
    run("topics", "create", "orders", "--shards", 4)
    fdq.Producer(db).push_many("orders", [fdq.Envelope(f"m{i}".encode(), shard_key=f"k{i}") for i in range(50)])
    reshard_begin(db, sup._ts("orders"), 16)             # what a killed rebalance --shards 16 leaves
    r = run("rebalance", "orders", "--shards", 8, code=1)
    assert r.stderr == ("fdq: error: topic 'orders' is already being resharded to 16 shards: finish that "
                        "first (fdq rebalance orders, without --shards; Supervisor.rebalance), then change the count\n")
    run("rebalance", "orders")
    run("rebalance", "orders", "--shards", 8)
    assert sup.config("orders").shards == 8 and sup.stats("orders")["subscriptions"]["default"]["backlog"] == 50


def test_tail_prints_one_line_per_message_whatever_the_body(run, db):
    """fdq tail's people format is one message per line (scripts count lines, | head -n
    N): a body or shard key with newlines, or terminal escapes, is shown escaped, not
    written raw (a raw ESC sequence was also stripped by click when piped)."""
    p = fdq.Producer(db)
    a = p.push("t", b"line1\nline2\r\n\x1b[31mred\x00", shard_key="k\n2").id
    b = p.push("t", b"tab\there \\ back\xff").id
    lines = run("tail", "t", "-n", 2).stdout.splitlines()       # (two shards: either order)
    assert sorted(lines) == sorted([f"{a}  key=k\\n2  line1\\nline2\\r\\n\\x1b[31mred\\x00",
                                    f"{b}  tab\there \\ back\\xff"])


def test_tables_show_brackets_in_data_as_they_are(run, db, sup):
    """A dead letter's body or reason, or a subscription's description, is data: rich's
    markup in it ([/] ...) crashed fdq dlq list with a traceback, and [bold] vanished."""
    p = fdq.Producer(db)
    p.push("dl", b"[/oops] body [bold]x")
    with fdq.Consumer(db, "dl") as c:
        [m] = c.fetch(1, timeout=5)
        m.term("bad [red]thing[/red] [/]")
    out = run("dlq", "list", "dl").stdout
    assert "[/oops] body [bold]x" in out and "bad [red]thing[/red] [/]" in out
    run("subs", "create", "dl", "s2", "--description", "see [/] and [b]this[/b]")
    assert "see [/] and [b]this[/b]" in run("subs", "show", "dl", "s2").stdout


def test_output_to_a_full_disk_is_one_line_and_exit_1(url, db, tmp_path):
    """fdq ... > file on a full disk (here /dev/full): one line naming the problem and
    exit 1, no traceback; tail acks nothing it could not write."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    fdq_bin = Path(sys.executable).parent / "fdq"
    env = {k: v for k, v in os.environ.items() if k not in ("FDQ_URL", "FDQ_HOME")}
    fdq.Producer(db).push_many("t", [fdq.Envelope(b"a"), fdq.Envelope(b"b")])
    sup = fdq.Supervisor(db)
    for argv in (["stats", "t"], ["stats", "t", "--json"], ["tail", "t", "-n", "1"]):
        with open("/dev/full", "w") as full:
            r = subprocess.run([str(fdq_bin), "--url", url, *argv], stdout=full, stderr=subprocess.PIPE,
                               env=env, timeout=60)
        assert r.returncode == 1, (argv, r.stderr)
        assert r.stderr.decode() == "fdq: error: I/O error: No space left on device\n", (argv, r.stderr)
    st = sup.stats("t")["subscriptions"]["default"]
    assert (st["acked"], st["backlog"], st["in_flight"]) == (0, 2, 0)      # nothing acked, nothing held


def test_rebalance_progress_never_runs_past_its_total(run, db, monkeypatch):
    """A reshard reads a message again when it moves to a shard not yet processed, so a
    count of entries read against the backlog ran past 100% (102,064/60,000 on a bar)."""
    from fdq.cli import render
    monkeypatch.setattr(render, "PLAIN_EVERY_S", 0.0)
    run("topics", "create", "orders", "--shards", 2)
    fdq.Producer(db).push_many("orders", [fdq.Envelope(b"m", shard_key=f"k{i}") for i in range(2000)])
    r = run("rebalance", "orders", "--shards", 7)
    lines = [line for line in r.stderr.splitlines() if line.startswith("resharding orders: ")]
    assert lines
    for line in lines:
        done, _, total = line.split(": ")[1].replace(",", "").partition("/")
        assert not total or int(done) <= int(total), line


def test_rebalance_shows_a_bar_to_the_queued_total_and_says_how_many_moved(run, db, sup, monkeypatch):
    """fdq rebalance --shards: the bar's total is what the queues hold (from counters),
    it ends there, and the last line says how many messages moved of how many queued
    (a shrink to 3 of 5 moves messages into shards not processed yet: counted once)."""
    from fdq.cli import render
    from fdq.keyspace.codec import shard_of
    monkeypatch.setattr(render, "PLAIN_EVERY_S", 0.0)
    run("topics", "create", "orders", "--shards", 5)
    keys = [f"k{i % 61}" for i in range(1200)]
    fdq.Producer(db).push_many("orders", [fdq.Envelope(b"m", shard_key=k) for k in keys])
    with fdq.Consumer(db, "orders", consumer_id="a"):
        r = run("rebalance", "orders", "--shards", 3, "--json")
    moved = sum(1 for k in keys if shard_of(k, 5) != shard_of(k, 3))
    bar = [line.split(": ")[1] for line in r.stderr.splitlines() if line.startswith("resharding orders: ")]
    assert bar and bar[-1] == "1,200/1,200", bar
    assert r.stderr.splitlines()[-1] == f"topic 'orders': 5 → 3 shards; moved {moved:,} of 1,200 queued messages; " \
                                        "1 consumer"
    assert json.loads(r.stdout) == {"topic": "orders", "from_shards": 5, "shards": 3, "queued": 1200,
                                    "moved": moved, "consumers": 1, "zombies": 0}
    r = run("rebalance", "orders")                          # no count: no bar, nothing moved
    assert r.stderr == "topic 'orders': 3 shards divided among 0 consumers\n"


@pytest.mark.parametrize("mode", ["at-least-once", "at-most-once"])
def test_tail_of_an_ack_policy_none_subscription(run, db, sup, mode):
    """A subscription with ack_policy none is done when delivered: fdq tail printed the
    batch and then failed (exit 1, 'is not leased') acking it, or with at-most-once
    failed before printing anything, the batch taken and lost."""
    run("topics", "create", "t", "--shards", 1)
    run("subs", "create", "t", "quick", "--ack-policy", "none")
    fdq.Producer(db).push_many("t", [fdq.Envelope(f"m{i}".encode()) for i in range(5)])
    r = run("tail", "t", "-s", "quick", "-n", 3, "--mode", mode, "--json")
    assert [json.loads(line)["body"] for line in r.stdout.splitlines()] == ["m0", "m1", "m2"]
    assert "warning" not in r.stderr, r.stderr
    r = run("tail", "t", "-s", "quick", "-n", 2, "--mode", mode, "--json")
    assert [json.loads(line)["body"] for line in r.stdout.splitlines()] == ["m3", "m4"]
    st = sup.stats("t")["subscriptions"]["quick"]
    assert (st["backlog"], st["in_flight"]) == (0, 0)
