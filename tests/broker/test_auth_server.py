"""``--auth-http-address``: nsqd's auth-server protocol against a stand-in auth server
(GET /auth?remote_ip=&tls=&secret=&common_name= -> {"ttl", "identity", "identity_url",
"authorizations"}), over TCP (AUTH) and HTTP (X-NSQ-Auth-Secret)."""
import json
import os
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fdq.broker import protocol as p
from fdqtest import wait_for
from nsqclient import RawClient

FDQ = os.path.join(os.path.dirname(sys.executable), "fdq")
EVERYTHING = [{"topic": ".*", "channels": [".*"], "permissions": ["publish", "subscribe", "admin"]}]


class AuthStandin:
    """secret -> (status, answer); records every query's parameters."""

    def __init__(self, grants):
        self.grants = grants
        self.queries = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                url = urllib.parse.urlsplit(self.path)
                q = {k: v[0] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
                standin.queries.append((url.path, q))
                status, answer = standin.grants.get(q.get("secret"), (403, {"message": "NOT_AUTHORIZED"}))
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def secrets_asked(self):
        return [q.get("secret") for _path, q in self.queries]


@pytest.fixture
def authd():
    servers = []

    def start(grants):
        s = AuthStandin(grants)
        servers.append(s)
        return s
    yield start
    for s in servers:
        s.stop()


def grant(authorizations, ttl=3600, identity="someone"):
    return 200, {"ttl": ttl, "identity": identity, "identity_url": f"http://id/{identity}",
                 "authorizations": authorizations}


def auth(c, secret):
    c.send(p.encode_command(b"AUTH", body=secret.encode()))
    return c.frame()


def test_grants_of_the_auth_server_as_nsqd_matches_them(broker_factory, authd):
    s = authd({
        # unanchored: "ord" grants "orders"; channels ["billing"] give no publish (nsqd: "" must match)
        "reader": grant([{"topic": "ord", "channels": ["billing"], "permissions": ["subscribe", "publish"]}],
                        identity="reader"),
        "writer": grant([{"topic": "^orders$", "channels": [".*"], "permissions": ["publish"]}], identity="writer"),
        "nothing": grant([]),
    })
    b = broker_factory("--auth-http-address", s.address)
    c = RawClient(b.tcp)
    assert c.identify()["auth_required"] is True
    c.send(p.encode_command(b"PUB", b"orders", body=b"x"))
    assert c.error() == "E_AUTH_FIRST AUTH required before PUB"
    c = RawClient(b.tcp)
    assert auth(c, "wrong") == (p.FRAME_ERROR, b"E_AUTH_FAILED AUTH failed")    # refused by the server
    c = RawClient(b.tcp)
    assert auth(c, "nothing") == (p.FRAME_ERROR, b"E_UNAUTHORIZED AUTH No authorizations found")
    c = RawClient(b.tcp)
    t, d = auth(c, "writer")
    assert t == p.FRAME_RESPONSE and json.loads(d) == {"identity": "writer", "identity_url": "http://id/writer",
                                                       "permission_count": 1}
    c.pub("orders", b"paid")
    c.send(p.encode_command(b"PUB", b"orders2", body=b"x"))
    assert c.error() == 'E_UNAUTHORIZED AUTH failed for PUB on "orders2" ""'
    c = RawClient(b.tcp)
    c.identify(heartbeat_interval=1000)
    auth(c, "reader")
    c.send(p.encode_command(b"PUB", b"orders", body=b"x"))
    assert c.error() == 'E_UNAUTHORIZED AUTH failed for PUB on "orders" ""'
    c = RawClient(b.tcp)
    c.identify(heartbeat_interval=1000)
    auth(c, "reader")
    c.send(b"SUB orders audit\n")
    assert c.error() == 'E_UNAUTHORIZED AUTH failed for SUB on "orders" "audit"'
    c = RawClient(b.tcp)
    c.identify(heartbeat_interval=1000)
    auth(c, "reader")
    c.sub("orders", "billing", 5)
    assert c.message()[3] == b"paid"
    _path, q = s.queries[-1]
    assert _path == "/auth" and q == {"remote_ip": "127.0.0.1", "tls": "false", "secret": "reader",
                                      "common_name": ""}


def test_an_expired_grant_is_asked_for_again(broker_factory, authd):
    s = authd({"short": grant(EVERYTHING, ttl=1)})
    b = broker_factory("--auth-http-address", s.address)
    c = RawClient(b.tcp)
    auth(c, "short")
    c.pub("ttl", b"1")
    asked = s.secrets_asked().count("short")

    def pub_asks_again():
        c.pub("ttl", b"again")
        return s.secrets_asked().count("short") > asked
    wait_for(pub_asks_again, 30, "a PUB after the ttl asking the server again", interval=0.3)
    s.grants.clear()                                   # revoked: the next query fails
    wait_for(lambda: c.send(p.encode_command(b"PUB", b"ttl", body=b"x")) or c.frame()[0] == p.FRAME_ERROR,
             30, "a PUB refused once the grant is revoked", interval=0.3)


def test_an_unreachable_auth_server_fails_auth_with_one_log_line(broker_factory, authd):
    s = authd({})
    address = s.address
    s.stop()
    b = broker_factory("--auth-http-address", address)
    c = RawClient(b.tcp)
    assert auth(c, "any") == (p.FRAME_ERROR, b"E_AUTH_FAILED AUTH failed")    # the cause is not sent
    assert c.closed()
    b.stop()
    err = b.proc.stderr.read()
    lines = [line for line in err.splitlines() if "auth server" in line]
    assert len(lines) == 1 and address in lines[0] and "refused" in lines[0].lower(), err[-3000:]


def test_http_secrets_are_asked_once_per_ttl(broker_factory, authd):
    s = authd({"ops": grant(EVERYTHING), "pub": grant([{"topic": "a", "channels": [".*"],
                                                        "permissions": ["publish"]}])})
    b = broker_factory("--auth-http-address", f"http://{s.address}/auth?source=test")   # a URL, as given
    h = {"X-NSQ-Auth-Secret": "ops"}
    assert b.http_req("/pub?topic=a", b"x")[0] == 401
    assert b.http_req("/pub?topic=a", b"x", headers=h)[0] == 200
    assert b.http_req("/topic/create?topic=b", b"", headers=h)[0] == 200
    assert s.secrets_asked().count("ops") == 1                          # cached for its ttl
    assert s.queries[0][1]["source"] == "test"
    assert b.http_req("/topic/create?topic=c", b"", headers={"X-NSQ-Auth-Secret": "pub"})[0] == 403
    assert b.http_req("/pub?topic=a", b"x", headers={"X-NSQ-Auth-Secret": "bad"})[0] == 403


def test_auth_file_and_auth_server_exclude_each_other(db_url, tmp_path):
    path = tmp_path / "auth.json"
    path.write_text('{"secrets": []}')
    out = subprocess.run([FDQ, "--url", db_url, "broker", "--tcp-address", "127.0.0.1:0", "--auth-file", str(path),
                          "--auth-http-address", "127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "exclude each other" in out.stderr, out.stderr
