"""youzan's PUB_EXT and tag dispatch, /pub_ext; AUTH allow/deny (TCP and HTTP); TLS."""
import json
import select
import ssl
import struct

import pytest

from fdq.broker import protocol as p
from nsqclient import RawClient

pytestmark = pytest.mark.slow


def ext_consumer(addr, topic, channel, rdy=10, **ident):
    c = RawClient(addr)
    c.identify(heartbeat_interval=1000, extend_support=True, **ident)
    c.sub(topic, channel, rdy)
    return c


def test_pub_ext_and_tag_dispatch(broker):
    assert broker.http_req("/topic/create?topic=ext&extend=true", b"")[0] == 200
    assert broker.http_req("/topic/create?topic=plain", b"")[0] == 200
    assert broker.http_req("/channel/create?topic=ext&channel=c", b"")[0] == 200
    pub = RawClient(broker.tcp)
    pub.identify()
    # plain topics refuse PUB_EXT (non-fatal); bad JSON is E_INVALID_JSON_HEADER (non-fatal)
    pub.send(p.encode_pub_ext(b"plain", b'{"a":1}', b"x"))
    assert pub.error().startswith("E_EXT_NOT_SUPPORT")
    pub.send(p.encode_pub_ext(b"ext", b"{bad", b"x"))
    assert pub.error().startswith("E_INVALID_JSON_HEADER")
    pub.send(p.encode_pub_ext(b"ext", b'{"##bogus":1}', b"x"))
    assert pub.error().startswith("E_INVALID_JSON_HEADER")
    for i in range(4):
        pub.send(p.encode_pub_ext(b"ext", json.dumps({"##client_dispatch_tag": "blue", "n": i}).encode(), b"b%d" % i))
        pub.expect()
    for i in range(3):
        pub.send(p.encode_pub_ext(b"ext", json.dumps({"k": "v"}).encode(), b"u%d" % i))
        pub.expect()
    pub.send(p.encode_pub_ext(b"ext", b'{"##trace_id":"12345"}', b"traced"))
    t, d = pub.frame()
    assert t == p.FRAME_RESPONSE and d[:2] == b"OK" and len(d) == 2 + 8 + 8 + 8 + 4
    assert int.from_bytes(d[10:18], "big") == 12345 and struct.unpack(">I", d[26:30])[0] == 6
    # a plain client may not subscribe to an extend topic, nor an extend client to a plain one
    c = RawClient(broker.tcp)
    c.identify(heartbeat_interval=1000)
    c.send(b"SUB ext c\n")
    assert c.error().startswith("E_SUB_EXTEND_NEED")
    c = RawClient(broker.tcp)
    c.identify(heartbeat_interval=1000, extend_support=True)
    c.send(b"SUB plain c\n")
    assert c.error().startswith("E_EXT_NOT_SUPPORT")
    # tag dispatch: the "blue" consumer gets the blue messages, the untagged one the rest
    blue = ext_consumer(broker.tcp, "ext", "c", desired_tag="blue")
    plain = ext_consumer(broker.tcp, "ext", "c")
    got_blue = []
    for _ in range(4):
        ts, att, mid, body, ext = blue.message(ext=True)
        h = json.loads(ext)
        assert h["##client_dispatch_tag"] == "blue" and body == b"b%d" % h["n"]
        got_blue.append(body)
        blue.send(b"FIN " + mid + b"\n")
    got_plain = []
    for _ in range(4):
        ts, att, mid, body, ext = plain.message(ext=True)
        got_plain.append((body, json.loads(ext)))
        plain.send(b"FIN " + mid + b"\n")
    assert sorted(got_blue) == [b"b0", b"b1", b"b2", b"b3"]
    assert sorted(b for b, _h in got_plain) == [b"traced", b"u0", b"u1", b"u2"]
    assert all(h == {"k": "v"} for b, h in got_plain if b != b"traced")
    # /pub_ext with ext= and X-Nsqext-* headers; a tag with no consumer falls back to untagged ones
    st, body = broker.http_req('/pub_ext?topic=ext&ext={"a":"1","%23%23client_dispatch_tag":"red"}', b"h1",
                               headers={"X-Nsqext-Color": "green"})
    assert (st, body) == (200, b"OK")
    st, body = broker.http_req("/pub_ext?topic=plain", b"h2")
    assert st == 400 and b"E_EXT_NOT_SUPPORT" in body
    ts, att, mid, body, ext = plain.message(ext=True, timeout=60)
    assert body == b"h1" and json.loads(ext) == {"a": "1", "##client_dispatch_tag": "red", "color": "green"}
    plain.send(b"FIN " + mid + b"\n")


AUTH = {"secrets": [
    {"secret": "pub-only", "identity": "writer",
     "authorizations": [{"topic": "orders", "channels": [], "permissions": ["publish"]}]},
    {"secret": "reader", "identity": "billing",
     "authorizations": [{"topic": "orders", "channels": ["billing"], "permissions": ["subscribe"]}]},
    {"secret": "ops", "identity": "ops",
     "authorizations": [{"topic": ".*", "channels": [".*"], "permissions": ["publish", "subscribe", "admin"]}]},
    {"secret": "nothing", "identity": "nobody", "authorizations": []},
]}


def auth(c, secret):
    c.send(p.encode_command(b"AUTH", body=secret.encode()))


def test_auth_allow_and_deny(broker_factory, tmp_path):
    path = tmp_path / "auth.json"
    path.write_text(json.dumps(AUTH))
    b = broker_factory("--auth-file", str(path))
    c = RawClient(b.tcp)
    assert c.identify()["auth_required"] is True
    c.send(p.encode_command(b"PUB", b"orders", body=b"x"))
    assert c.error() == "E_AUTH_FIRST AUTH required before PUB"          # nsqd's texts
    c = RawClient(b.tcp)
    auth(c, "wrong")
    assert c.error().startswith("E_AUTH_FAILED")
    c = RawClient(b.tcp)
    auth(c, "nothing")          # as nsqd: a secret that grants nothing is refused at AUTH
    assert c.error() == "E_UNAUTHORIZED AUTH No authorizations found"
    assert c.closed()
    c = RawClient(b.tcp)
    auth(c, "pub-only")
    t, d = c.frame()
    assert json.loads(d)["identity"] == "writer"
    c.pub("orders", b"paid")
    c.send(p.encode_command(b"PUB", b"orders-x", body=b"x"))
    assert c.error() == 'E_UNAUTHORIZED AUTH failed for PUB on "orders-x" ""'
    c = RawClient(b.tcp)
    c.identify(heartbeat_interval=1000)
    auth(c, "reader")
    c.frame()
    c.send(b"SUB orders audit\n")           # a channel it may not read
    assert c.error() == 'E_UNAUTHORIZED AUTH failed for SUB on "orders" "audit"'
    c = RawClient(b.tcp)
    c.identify(heartbeat_interval=1000)
    auth(c, "reader")
    c.frame()
    c.sub("orders", "billing", 5)
    assert c.message()[3] == b"paid"
    c.send(p.encode_command(b"AUTH", body=b"ops"))
    assert c.error().startswith("E_INVALID")
    # HTTP: the same secrets in X-NSQ-Auth-Secret
    assert b.http_req("/ping")[0] == 200
    assert b.http_req("/pub?topic=orders", b"y")[0] == 401
    assert b.http_req("/pub?topic=orders", b"y", headers={"X-NSQ-Auth-Secret": "nope"})[0] == 403
    assert b.http_req("/pub?topic=orders", b"y", headers={"X-NSQ-Auth-Secret": "pub-only"})[0] == 200
    assert b.http_req("/pub?topic=other", b"y", headers={"X-NSQ-Auth-Secret": "pub-only"})[0] == 403
    assert b.http_req("/channel/delete?topic=orders&channel=billing", b"",
                      headers={"X-NSQ-Auth-Secret": "reader"})[0] == 403
    assert b.http_req("/topic/create?topic=new", b"", headers={"X-NSQ-Auth-Secret": "ops"})[0] == 200


def test_auth_disabled_without_auth_file(broker):
    c = RawClient(broker.tcp)
    auth(c, "x")
    assert c.error().startswith("E_AUTH_DISABLED")


def test_tls_upgrade_and_required(broker_factory, cert):
    crt, key = cert
    b = broker_factory("--tls-cert", crt, "--tls-key", key, "--tls-required")
    c = RawClient(b.tcp)
    c.send(p.encode_command(b"PUB", b"t", body=b"x"))
    assert c.error().startswith("E_INVALID")        # TLS required first
    c = RawClient(b.tcp)
    resp = c.identify(tls_v1=True, heartbeat_interval=1000)
    assert resp["tls_v1"] is True
    ctx = ssl.create_default_context(cafile=crt)
    ctx.check_hostname = False
    tls = ctx.wrap_socket(c.sock, server_hostname="127.0.0.1")
    c.sock = tls
    assert not c.buf
    c.expect()                                      # OK, over TLS
    c.pub("tls", b"secret body")
    c.sub("tls", "c", 1)
    assert c.message()[3] == b"secret body"


def test_no_heartbeat_in_clear_during_a_slow_tls_handshake(broker_factory, cert):
    # A client that starts its handshake a little late (more than a heartbeat interval
    # after the IDENTIFY answer) got a clear heartbeat frame where the ServerHello
    # belongs, and the handshake failed. nsqd holds its writes during the upgrade.
    crt, key = cert
    b = broker_factory("--tls-cert", crt, "--tls-key", key)
    c = RawClient(b.tcp)
    assert c.identify(tls_v1=True, heartbeat_interval=1000)["tls_v1"] is True
    assert not c.buf
    poller = select.poll()        # not select(): a long session's descriptors pass 1024
    poller.register(c.sock, select.POLLIN)
    readable = poller.poll(3000)                    # three heartbeat intervals
    assert not readable, c.sock.recv(100)
    ctx = ssl.create_default_context(cafile=crt)
    ctx.check_hostname = False
    c.sock = ctx.wrap_socket(c.sock, server_hostname="127.0.0.1")
    c.expect()                                      # OK, over TLS
    c.pub("slow-tls", b"body")
