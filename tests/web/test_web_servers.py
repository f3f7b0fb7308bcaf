"""The dashboard served for real: ``fdq web`` in its own process, and the broker serving
the same app under ``--web-path`` with its ``--auth-file`` rules."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

import fdq

from fdqtest import kill_all, readline_within
from webhelpers import env_for, request, start_web

@pytest.mark.slow
def test_fdq_web_serves_the_page_and_api_and_stops_on_sigterm(db_url, db):
    fdq.Supervisor(db).create_topic("orders", shards=3)
    fdq.Producer(db).push("orders", b"hello")
    proc, base = start_web(db_url, "--write-token", "tok", "--sample-interval", "200ms")
    try:
        status, hdrs, page = request(base)
        assert status == 200 and b'<base href="/">' in page
        assert "default-src 'self'" in hdrs["Content-Security-Policy"]
        status, _h, info = request(base + "api/info")
        assert status == 200 and info["writable"] and info["sample_interval_s"] == 0.2
        status, _h, topics = request(base + "api/topics")
        assert [(t["name"], t["shards"], t["backlog"]) for t in topics["topics"]] == [("orders", 3, 1)]
        status, _h, out = request(base + "api/topics/orders/pause", "POST", {})
        assert (status, out["error"]) == (401, "auth_required")
        status, _h, out = request(base + "api/topics/orders/pause", "POST", {}, {"Authorization": "Bearer tok"})
        assert status == 200 and fdq.Supervisor(db).config("orders").paused
        status, _h, out = request(base + "api/topics/nosuch")
        assert (status, out) == (404, {"error": "topic_not_found", "message": "topic 'nosuch' does not exist"})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "fdq web: stopped" in proc.stderr.read()
    finally:
        kill_all([proc])


@pytest.mark.slow
def test_fdq_web_ctrl_c_exits_130_with_one_line(db_url, db):
    proc, base = start_web(db_url)
    try:
        assert request(base + "api/info")[2]["writable"] is False
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        assert proc.stderr.read().strip() == "fdq: interrupted: dashboard stopped"
    finally:
        kill_all([proc])


def test_fdq_web_refuses_an_address_it_cannot_use(tmp_path, db_url):
    from click.testing import CliRunner

    from fdq.cli import cli
    r = CliRunner().invoke(cli, ["--url", db_url, "web", "--http-address", "nowhere"])
    assert r.exit_code == 2 and "address must be host:port, not 'nowhere'" in r.stderr
    r = CliRunner().invoke(cli, ["--url", db_url, "web", "--write-token", " "])
    assert r.exit_code == 2 and "--write-token must not be empty" in r.stderr


AUTH = {"secrets": [
    {"secret": "ops", "identity": "ops", "authorizations": [
        {"topic": ".*", "channels": [".*"], "permissions": ["subscribe", "publish", "admin"]}]},
    {"secret": "reader", "identity": "reader", "authorizations": [
        {"topic": ".*", "channels": [".*"], "permissions": ["subscribe"]}]}]}


@pytest.mark.slow
def test_the_broker_serves_the_dashboard_under_its_web_path_with_its_auth_rules(tmp_path, db_url, db):
    fdq.Supervisor(db).create_topic("orders", shards=2)
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps(AUTH))
    proc = subprocess.Popen([sys.executable, "-m", "fdq.broker", "--url", db_url, "--tcp-address", "127.0.0.1:0",
                             "--http-address", "127.0.0.1:0", "--auth-file", str(auth), "--web-path", "/web/"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env_for(db_url))
    try:
        line = readline_within(proc, 60, "the broker's ready line")
        port = int(re.search(r"http=[\d.]+:(\d+)", line).group(1))
        base = f"http://127.0.0.1:{port}/web/"
        status, _h, page = request(base)
        assert status == 200 and b'<base href="/web/">' in page        # assets need no secret
        assert request(base + "static/app.js")[0] == 200
        status, _h, out = request(base + "api/topics")
        assert (status, out["error"]) == (401, "auth_required")
        status, _h, out = request(base + "api/topics", headers={"X-NSQ-Auth-Secret": "reader"})
        assert status == 200 and out["topics"][0]["name"] == "orders"
        status, _h, out = request(base + "api/topics/orders/pause", "POST", {}, {"Authorization": "Bearer reader"})
        assert (status, out["error"]) == (403, "forbidden")
        status, _h, out = request(base + "api/topics/orders/pause", "POST", {}, {"Authorization": "Bearer ops"})
        assert status == 200 and fdq.Supervisor(db).config("orders").paused
        # nsqd's own endpoints are still the broker's
        assert request(f"http://127.0.0.1:{port}/ping")[0] == 200
        assert request(f"http://127.0.0.1:{port}/stats?format=json")[0] == 401
    finally:
        kill_all([proc])


@pytest.mark.parametrize("path", ["/", "web", "/topic/", "/ping"])
def test_a_web_path_that_is_not_its_own_is_refused(path):
    from fdq.broker.__main__ import build_options, parser
    with pytest.raises(fdq.ConfigError, match="--web-path must be a path of its own"):
        build_options(parser().parse_args(["--url", "x", "--web-path", path]))
