"""Second review of extend headers: header filters of subscriptions."""
import fdq
from click.testing import CliRunner

from fdq.cli.commands import cli


def _received(db, topic, sub):
    c = fdq.Consumer(db, topic, subscription=sub, create=False, extend_support=True)
    try:
        ms = c.fetch(100, timeout=0.5)
        c.ack_many(ms)
        return [m.id for m in ms]
    finally:
        c.close()


def test_filter_matches_a_non_string_header_by_its_json_text(db):
    """Header values are JSON values and ``fdq push --header flag=true`` stores true; a
    filter ``flag=true`` compared it with Python's ``str(True)`` ("True"), so the message
    was dropped as filtered (likewise null, lists and maps). A string header matches its
    own text; any other value its compact JSON text."""
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, extend=True)
    filters = {"flag": ("flag", "true"), "nul": ("n", "null"), "lst": ("l", '[1,"a"]'),
               "map": ("m", '{"x":1}'), "int": ("i", "3"), "flt": ("f", "1.5"), "str": ("s", "eu"),
               "strnum": ("sn", "3")}
    for sub, (name, value) in filters.items():
        sup.create_subscription("t", sub, fdq.SubscriptionConfig(filter_headers={name: value}))
    sup.create_subscription("t", "pyrepr", fdq.SubscriptionConfig(filter_headers={"flag": "True"}))
    r = fdq.Producer(db).push("t", b"x", headers={"flag": True, "n": None, "l": [1, "a"], "m": {"x": 1},
                                                 "i": 3, "f": 1.5, "s": "eu", "sn": "3"})
    for sub in filters:
        assert _received(db, "t", sub) == [r.id], f"filter {filters[sub]} did not match"
    assert _received(db, "t", "pyrepr") == []


def test_cli_header_and_filter_header_agree(db, db_url):
    """The CLI's own spelling: pushed with --header flag=true, filtered with
    --filter-header flag=true."""
    run = CliRunner().invoke
    assert run(cli, ["--url", db_url, "topics", "create", "t", "--extend"]).exit_code == 0
    res = run(cli, ["--url", db_url, "subs", "create", "t", "f", "--filter-header", "flag=true"])
    assert res.exit_code == 0, res.output
    res = run(cli, ["--url", db_url, "push", "t", "--header", "flag=true", "hello"])
    assert res.exit_code == 0, res.output
    assert len(_received(db, "t", "f")) == 1
