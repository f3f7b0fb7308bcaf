"""The dashboard's JSON API (``WebApp.handle``) over a real database, real producers and
consumers: what each endpoint reports, what each action does, and how bad input and
missing tokens are refused (a JSON error naming the problem, nothing changed)."""
from __future__ import annotations


import pytest

import fdq
from fdq.broker.auth import AuthFile
from fdq.web import WebApp

from webhelpers import TOKEN, Api
from fdqtest import fast, fetch_n, wait_for

WEB_FAST = fast(zombie_timeout_s=1.0)


def _sub(detail, name="default"):
    return next(s for s in detail["subscriptions"] if s["name"] == name)


# -- reads ------------------------------------------------------------------------------

def test_topics_lists_each_topic_with_backlog_and_rates_from_two_samples(api, app, sup, db):
    sup.create_topic("orders", shards=4)
    sup.create_topic("audit", shards=2)
    p = fdq.Producer(db)
    app.history.sample_all()
    p.push_many("orders", [fdq.Envelope(b"x%d" % i) for i in range(30)])
    app.history.sample_all()
    rows = {t["name"]: t for t in api.ok("api/topics")["topics"]}
    assert set(rows) == {"orders", "audit"}
    o = rows["orders"]
    assert (o["shards"], o["paused"], o["inserted"], o["backlog"], o["subscriptions"]) == (4, False, 30, 30, 1)
    assert o["inserted_per_s"] > 0 and o["acked_per_s"] == 0
    assert rows["audit"]["backlog"] == 0 and rows["audit"]["inserted_per_s"] == 0


def test_topic_shows_subscription_backlog_in_flight_delayed_redeliveries_and_dead_letters(api, sup, db):
    sup.create_topic("orders", shards=2)
    sup.create_subscription("orders", "audit")
    sup.pause_subscription("orders", "audit")
    p = fdq.Producer(db)
    for body in (b"lease", b"nak", b"term", b"wait"):
        p.push("orders", body, shard_key="k")
    p.push("orders", b"later", delay=600)
    with fdq.Consumer(db, "orders", consumer_id="pull", config=WEB_FAST) as c:
        got = {m.body: m for m in fetch_n(c, 4)}
        got[b"nak"].nak()
        got[b"term"].term("bad input")
        got[b"wait"].nak()
        d = api.ok("api/topics/orders")
        s = _sub(d)
        assert (s["backlog"], s["in_flight"], s["delayed"], s["redeliveries"], s["dlq"], s["paused"]) == \
            (4, 1, 1, 2, 1, False)
        assert s["lag_ms"] >= 0 and s["oldest_ready_time_ms"] is not None
        assert [x["id"] for x in s["consumers"]] == ["pull"]
        audit = _sub(d, "audit")
        assert (audit["paused"], audit["backlog"], audit["dlq"]) == (True, 5, 0)
    assert d["settings"]["shards"] == 2 and d["counters"]["inserted"] == 5
    assert d["summary"]["dlq"] == 1


def test_consumers_show_liveness_heartbeat_age_and_the_shards_each_owns(api, sup, db):
    sup.create_topic("orders", shards=6)
    a = fdq.tail(db, "orders", lambda m: None, consumer_id="a", config=WEB_FAST)
    b = fdq.tail(db, "orders", lambda m: None, consumer_id="b", config=WEB_FAST)
    try:
        def split():
            s = _sub(api.ok("api/topics/orders"))
            owners = {x["owner"] for x in s["assignment"]}
            return s if owners == {"a", "b"} and all(c["state"] == "live" for c in s["consumers"]) else None
        s = wait_for(split, 30, what="both consumers live, owning shards")
        by_id = {c["id"]: c for c in s["consumers"]}
        for cid in ("a", "b"):
            owned = sorted(x["shard"] for x in s["assignment"] if x["owner"] == cid)
            assert sorted(x["shard"] for x in by_id[cid]["shards"]) == owned and len(owned) == 3
            assert by_id[cid]["heartbeat_age_s"] < by_id[cid]["zombie_after_s"] == 1.0
            assert by_id[cid]["mode"] == "at_least_once"
    finally:
        a.shutdown()
        b.shutdown()


def test_a_consumer_beyond_the_shard_count_shows_as_standby(api, sup, db):
    sup.create_topic("orders", shards=1)
    a = fdq.tail(db, "orders", lambda m: None, consumer_id="a", config=WEB_FAST)
    b = fdq.tail(db, "orders", lambda m: None, consumer_id="b", config=WEB_FAST)
    try:
        def states():
            s = _sub(api.ok("api/topics/orders"))
            got = sorted(c["state"] for c in s["consumers"])
            return got if got == ["live", "standby"] else None
        wait_for(states, 30, what="one consumer live with the shard, the other on standby")
    finally:
        a.shutdown()
        b.shutdown()


def test_history_holds_samples_and_events_of_consumers_joining_and_shards_moving(api, app, sup, db):
    sup.create_topic("orders", shards=4)
    app.history.sample_all()
    fdq.Producer(db).push_many("orders", [fdq.Envelope(b"x")] * 3)
    c = fdq.tail(db, "orders", lambda m: None, consumer_id="solo", config=WEB_FAST)
    try:
        wait_for(lambda: _sub(api.ok("api/topics/orders"))["consumers"], 30, what="the consumer registered")
        app.history.sample_all()
    finally:
        c.shutdown()
    h = api.ok("api/topics/orders/history")
    assert len(h["samples"]) == 2 and h["samples"][0]["backlog"] == 0
    assert h["samples"][1]["inserted"] == 3
    assert api.ok("api/topics/orders/history", query={"since": [str(h["samples"][0]["time_ms"])]})["samples"] \
        == h["samples"][1:]
    events = api.ok("api/topics/orders")["events"]
    kinds = {e["kind"] for e in events}
    assert {"joined", "moved"} <= kinds, events
    assert any(e["kind"] == "moved" and e["target"] == "solo" and len(e["shards"]) == 4 for e in events)


def test_dlq_lists_dead_letters_with_reason_and_attempts(api, sup, db):
    sup.create_topic("orders", shards=1)
    fdq.Producer(db).push("orders", b"poison", shard_key="cust-1")
    fdq.Producer(db).push("orders", b"\xff\xfe", shard_key="cust-2")
    with fdq.Consumer(db, "orders", config=fast(WEB_FAST, max_deliver=2)) as c:
        for m in fetch_n(c, 2):
            m.nak()
        for m in fetch_n(c, 2):
            m.nak()
    d = api.ok("api/topics/orders/subscriptions/default/dlq")
    assert d["total"] == 2
    first, second = d["dead_letters"]
    assert (first["body"], first["attempts"], first["shard_key"]) == ("poison", 2, "cust-1")
    assert "max_deliver (2)" in first["reason"]
    assert (second["body"], second["body_encoding"]) == ("//4=", "base64")


# -- actions ----------------------------------------------------------------------------

def test_redrive_of_selected_dead_letters_delivers_them_again_and_purge_deletes_others(api, sup, db):
    sup.create_topic("orders", shards=2)
    p = fdq.Producer(db)
    for body in (b"a", b"b", b"c"):
        p.push("orders", body)
    with fdq.Consumer(db, "orders", config=WEB_FAST) as c:
        for m in fetch_n(c, 3):
            m.term("no")
    ids = {d["body"]: d["id"] for d in api.ok("api/topics/orders/subscriptions/default/dlq")["dead_letters"]}
    status, out = api.post("api/topics/orders/subscriptions/default/dlq/redrive", {"ids": [ids["a"]]})
    assert status == 200 and out["redriven"] == 1 and "redrove 1 dead letter" in out["message"]
    status, out = api.post("api/topics/orders/subscriptions/default/dlq/purge", {"ids": [ids["b"], ids["a"]]})
    assert status == 200 and out["purged"] == 1 and "1 no longer in the dead-letter queue" in out["message"]
    assert [d["body"] for d in sup.dlq_list("orders")] == [b"c"]
    with fdq.Consumer(db, "orders", config=WEB_FAST) as c:
        [m] = fetch_n(c, 1)
        assert (m.body, m.id) == (b"a", ids["a"])
        m.ack()


def test_pause_and_play_a_topic_and_a_subscription(api, sup, db):
    sup.create_topic("orders", shards=2)
    status, out = api.post("api/topics/orders/pause")
    assert status == 200 and sup.config("orders").paused and "paused topic 'orders'" in out["message"]
    fdq.Producer(db).push("orders", b"while paused")
    assert api.ok("api/topics/orders")["counters"]["pending"] == 1
    status, out = api.post("api/topics/orders/play")
    assert status == 200 and out["routed"] == 1 and not sup.config("orders").paused
    status, out = api.post("api/topics/orders/subscriptions/default/pause")
    assert status == 200 and _sub(api.ok("api/topics/orders"))["paused"]
    status, out = api.post("api/topics/orders/subscriptions/default/play")
    assert status == 200 and not _sub(api.ok("api/topics/orders"))["paused"]


def test_rebalance_changes_the_shard_count_and_keeps_the_backlog(api, sup, db):
    sup.create_topic("orders", shards=4)
    fdq.Producer(db).push_many("orders", [fdq.Envelope(b"m", shard_key=f"k{i}") for i in range(20)])
    status, out = api.post("api/topics/orders/rebalance", {"shards": 8})
    assert status == 200 and out["shards"] == 8 and "to 8 shards" in out["message"]
    d = api.ok("api/topics/orders")
    assert d["settings"]["shards"] == 8 and _sub(d)["backlog"] == 20 and len(_sub(d)["assignment"]) == 8
    status, out = api.post("api/topics/orders/rebalance", {})
    assert status == 200 and "among its live consumers" in out["message"]


@pytest.mark.parametrize("shards, text", [(0, "shards must be an integer > 0, not 0"),
                                          (-3, "not -3"),
                                          ("eight", "whole number of shards (or null), not 'eight'"),
                                          (2.5, "not 2.5"), (True, "not True"),
                                          (5000, "5000")])
def test_a_bad_shard_count_is_refused_naming_it(api, sup, shards, text):
    sup.create_topic("orders", shards=4)
    status, out = api.post("api/topics/orders/rebalance", {"shards": shards})
    assert (status, out["error"]) == (400, "bad_request") and text in out["message"], out
    assert sup.config("orders").shards == 4


# -- refusals ---------------------------------------------------------------------------

ACTIONS = ["api/topics/orders/pause", "api/topics/orders/play", "api/topics/orders/rebalance",
           "api/topics/orders/subscriptions/default/pause", "api/topics/orders/subscriptions/default/play",
           "api/topics/orders/subscriptions/default/dlq/redrive", "api/topics/orders/subscriptions/default/dlq/purge"]


@pytest.mark.parametrize("path", ACTIONS)
def test_every_action_is_refused_without_the_write_token_or_with_a_wrong_one(api, sup, path):
    sup.create_topic("orders", shards=2)
    before = sup.stats("orders")["config"]
    status, out = api.post(path, {"ids": ["0" * 24]}, token=None)
    assert (status, out["error"]) == (401, "auth_required") and "write token" in out["message"]
    status, out = api.post(path, {"ids": ["0" * 24]}, token="guess")
    assert (status, out["error"]) == (403, "auth_failed") and "not the write token" in out["message"]
    assert sup.stats("orders")["config"] == before


def test_a_server_without_a_write_token_is_read_only(db, sup):
    sup.create_topic("orders", shards=2)
    app = WebApp(db)
    ro = Api(app)
    assert ro.ok("api/info")["writable"] is False
    status, out = ro.post("api/topics/orders/pause", token="anything")
    assert (status, out["error"]) == (403, "read_only") and "--write-token" in out["message"]
    assert not sup.config("orders").paused
    assert ro.ok("api/topics")["topics"][0]["name"] == "orders"


@pytest.mark.parametrize("method, path, body, status, code, text", [
    ("GET", "api/topics/nosuch", None, 404, "topic_not_found", "topic 'nosuch' does not exist"),
    ("POST", "api/topics/nosuch/pause", {}, 404, "topic_not_found", "'nosuch'"),
    ("GET", "api/topics/orders/subscriptions/nope/dlq", None, 404, "subscription_not_found", "nope"),
    ("POST", "api/topics/orders/subscriptions/nope/pause", {}, 404, "subscription_not_found", "nope"),
    ("GET", "api/topics/bad%20name", None, 400, "invalid_name", "invalid topic name 'bad name'"),
    ("GET", "api/nothing", None, 404, "not_found", "no such API endpoint: /api/nothing"),
    ("GET", "api/topics/orders/pause", None, 405, "method_not_allowed", "GET is not allowed"),
    ("POST", "api/topics/orders/pause", b"{nope", 400, "bad_request", "not JSON"),
    ("POST", "api/topics/orders/pause", b"[1]", 400, "bad_request", "must be a JSON object"),
    ("POST", "api/topics/orders/subscriptions/default/dlq/redrive", {}, 400, "bad_request",
     "needs \"ids\": a non-empty list"),
    ("POST", "api/topics/orders/subscriptions/default/dlq/purge", {"ids": ["xyz"]}, 400, "bad_request",
     "invalid message id 'xyz'"),
    ("GET", "api/topics/orders/subscriptions/default/dlq?limit=0", None, 400, "bad_request",
     "limit must be from 1 to 1000, not 0"),
    ("GET", "api/topics/orders/history?since=soon", None, 400, "bad_request", "since must be a whole number"),
])
def test_bad_requests_get_a_json_error_naming_the_problem(api, sup, method, path, body, status, code, text):
    sup.create_topic("orders", shards=2)
    path, _, qs = path.partition("?")
    query = {k: [v] for k, v in (kv.split("=") for kv in qs.split("&"))} if qs else None
    got_status, out = api.call(method, path, body, token=TOKEN, query=query)
    assert (got_status, out["error"]) == (status, code) and text in out["message"], out
    assert not sup.config("orders").paused


def test_topic_names_with_ephemeral_suffix_are_read_percent_encoded(api, sup):
    sup.create_topic("orders", shards=1)
    sup.create_subscription("orders", "peek#ephemeral")
    d = api.ok("api/topics/orders")
    assert [s["name"] for s in d["subscriptions"]] == ["default", "peek#ephemeral"]
    assert api.ok("api/topics/orders/subscriptions/peek%23ephemeral/dlq")["subscription"] == "peek#ephemeral"


# -- the page's files -------------------------------------------------------------------

def test_the_page_and_its_assets_are_served_with_the_base_path(db):
    app = WebApp(db, base="/web/")
    status, ctype, body = app.handle("GET", "/", {}, {}, b"")
    assert status == 200 and ctype.startswith("text/html") and b'<base href="/web/">' in body
    assert app.handle("GET", "", {}, {}, b"")[2] == body           # the broker's /web, no slash
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
        status, ctype, body = app.handle("GET", f"/static/{name}", {}, {}, b"")
        assert status == 200 and ctype.startswith(kind) and body
    for bad in ("/static/../app.py", "/static/%2e%2e/app.py", "/app.py", "/static/"):
        assert app.handle("GET", bad, {}, {}, b"")[0] == 404, bad
    assert app.handle("POST", "/", {}, {}, b"")[0] == 405


def test_the_page_loads_nothing_from_elsewhere():
    from importlib import resources
    static = resources.files("fdq.web").joinpath("static")
    for f in static.iterdir():
        text = f.read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, f.name


# -- the broker's auth file ------------------------------------------------------------

AUTH = {"secrets": [
    {"secret": "ops", "identity": "ops", "authorizations": [
        {"topic": ".*", "channels": [".*"], "permissions": ["subscribe", "publish", "admin"]}]},
    {"secret": "billing", "identity": "billing", "authorizations": [
        {"topic": "orders", "channels": ["billing"], "permissions": ["subscribe", "admin"]}]},
    {"secret": "reader", "identity": "reader", "authorizations": [
        {"topic": ".*", "channels": [".*"], "permissions": ["subscribe"]}]}]}


def test_under_an_auth_file_reading_needs_a_secret_and_acting_needs_admin_on_the_topic(db, sup):
    sup.create_topic("orders", shards=2)
    sup.create_subscription("orders", "billing")
    sup.create_topic("audit", shards=1)
    api = Api(WebApp(db, auth=AuthFile.parse(AUTH)))
    status, out = api.get("api/topics")
    assert (status, out["error"]) == (401, "auth_required")
    assert api.get("api/topics", token="nobody")[0] == 403
    assert api.get("api/info") == (200, {"writable": True, "access": "auth-file", "base": "/",
                                         "sample_interval_s": 1.0, "history_s": 600.0})
    assert api.get("api/topics", token="reader")[0] == 200
    assert api.get("api/topics", headers={"x-nsq-auth-secret": "reader"})[0] == 200
    status, out = api.post("api/topics/orders/pause", token="reader")
    assert (status, out["error"]) == (403, "forbidden") and "'reader' has no admin permission" in out["message"]
    status, out = api.post("api/topics/audit/pause", token="billing")
    assert status == 403 and "topic 'audit'" in out["message"]
    status, out = api.post("api/topics/orders/subscriptions/default/pause", token="billing")
    assert status == 403 and "channel 'default'" in out["message"]
    assert api.post("api/topics/orders/subscriptions/billing/pause", token="billing")[0] == 200
    assert api.post("api/topics/audit/pause", token="ops")[0] == 200
    assert sup.config("audit").paused and sup.subscription("orders", "billing")["paused"]
