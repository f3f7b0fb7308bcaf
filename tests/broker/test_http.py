"""nsqd's HTTP API: /ping /info /stats /pub /mpub /topic/* /channel/* and /metrics."""
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

import fdq
from fdq.broker import protocol as p
from fdqtest import readline_within, wait_for
from nsqclient import RawClient

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


@pytest.fixture
def broker(shared_broker):
    return shared_broker


def stats(broker, **q):
    qs = "&".join(f"{k}={v}" for k, v in {"format": "json", **q}.items())
    status, body = broker.http_req(f"/stats?{qs}")
    assert status == 200
    return json.loads(body)


def channel(broker, topic, ch):
    for t in stats(broker, topic=topic)["topics"]:
        for c in t["channels"]:
            if c["channel_name"] == ch:
                return c
    return None


class RawHTTP:
    """One keep-alive HTTP connection on a plain socket (what urllib hides: interim
    responses, chunked bodies, what is left on the connection); every read bounded."""

    def __init__(self, broker, timeout=10):
        self.sock = socket.create_connection(("127.0.0.1", broker.http_port), timeout=timeout)
        self.buf = b""

    def _fill(self):
        chunk = self.sock.recv(65536)       # socket.timeout past the bound fails the test
        assert chunk, "the broker closed the connection"
        self.buf += chunk

    def response(self):
        """(status, body) of the next response (interim ones included)."""
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        n = int(next((v for k, v in (x.split(":", 1) for x in lines[1:]) if k.lower() == "content-length"), 0))
        while len(self.buf) < n:
            self._fill()
        body, self.buf = self.buf[:n], self.buf[n:]
        return int(lines[0].split()[1]), body

    def close(self):
        self.sock.close()


def test_ping_info_and_errors(broker):
    assert broker.http_req("/ping") == (200, b"OK")
    info = json.loads(broker.http_req("/info")[1])
    assert info["tcp_port"] == broker.tcp_port and info["http_port"] == broker.http_port
    assert broker.http_req("/nope")[0] == 404
    assert broker.http_req("/pub", b"x") == (400, b'{"message": "MISSING_ARG_TOPIC"}')
    assert broker.http_req("/pub?topic=bad!", b"x") == (400, b'{"message": "INVALID_TOPIC"}')
    assert broker.http_req("/pub?topic=t", b"") == (400, b'{"message": "MSG_EMPTY"}')
    assert broker.http_req("/pub?topic=t", b"x" * (1024 * 1024 + 1)) == (413, b'{"message": "MSG_TOO_BIG"}')
    assert broker.http_req("/pub?topic=t&defer=abc", b"x") == (400, b'{"message": "INVALID_DEFER"}')
    assert broker.http_req("/topic/delete?topic=nosuch", b"") == (404, b'{"message": "TOPIC_NOT_FOUND"}')
    assert broker.http_req("/topic/create?topic=x", method="GET")[0] == 405
    assert broker.http_req("/channel/delete?topic=t&channel=nosuch", b"")[0] in (404,)
    assert broker.http_req("/channel/create?topic=t", b"") == (400, b'{"message": "MISSING_ARG_CHANNEL"}')


def test_pub_mpub_and_consume(broker):
    assert broker.http_req("/channel/create?topic=h&channel=c", b"")[0] == 200
    assert broker.http_req("/pub?topic=h", b"one") == (200, b"OK")
    assert broker.http_req("/mpub?topic=h", b"two\nthree\n") == (200, b"OK")
    binary = struct.pack(">i", 2) + struct.pack(">i", 4) + b"fo\nr" + struct.pack(">i", 4) + b"five"
    assert broker.http_req("/mpub?topic=h&binary=true", binary) == (200, b"OK")
    t0 = time.monotonic()
    assert broker.http_req("/pub?topic=h&defer=1500", b"six") == (200, b"OK")
    c = RawClient(broker.tcp)
    c.identify(heartbeat_interval=1000)
    c.sub("h", "c", 10)
    got = {}
    for _ in range(6):
        m = c.message(timeout=30)
        got[m[3]] = time.monotonic() - t0
        c.send(b"FIN " + m[2] + b"\n")
    assert set(got) == {b"one", b"two", b"three", b"fo\nr", b"five", b"six"}
    assert got[b"six"] >= 1.4
    ch = wait_for(lambda: (lambda x: x if x and x["in_flight_count"] == 0 else None)(channel(broker, "h", "c")))
    assert ch["depth"] == 0 and ch["message_count"] == 6 and ch["client_count"] == 1
    assert ch["clients"][0]["finish_count"] == 6 and ch["clients"][0]["ready_count"] == 10
    text = broker.http_req("/stats")[1].decode()
    assert "[h" in text and "[c" in text
    def metrics():      # (the page may be a read of a few seconds ago: fdq.metrics' cache)
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(broker.http_req("/metrics")[1].decode()) for s in f.samples}
        return [samples.get(("fdq_subscription_backlog_messages", (("subscription", "c"), ("topic", "h")))),
                samples.get(("fdq_topic_inserted_messages_total", (("topic", "h"),))),
                samples.get(("fdq_broker_channel_clients", (("channel", "c"), ("topic", "h"))))]
    wait_for(lambda: metrics() == [0, 6, 1], timeout=30, what="/metrics' figures")
    c.close()


def test_stats_message_bytes_are_the_bodies_published(broker):
    """nsqd's topic message_bytes: the bytes of every message body published to the
    topic (with message_count, the messages), from FDQ's counters: HTTP /pub and /mpub,
    TCP PUB, and a body large enough to be split into chunks."""
    assert broker.http_req("/pub?topic=mb", b"one") == (200, b"OK")
    assert broker.http_req("/mpub?topic=mb", b"two\nthree\n") == (200, b"OK")
    c = RawClient(broker.tcp)
    c.identify()
    c.pub("mb", b"x" * 200_000)
    c.close()
    t, = stats(broker, topic="mb")["topics"]
    assert (t["message_count"], t["message_bytes"]) == (4, 3 + 3 + 5 + 200_000)


def test_topic_and_channel_admin(broker):
    assert broker.http_req("/topic/create?topic=adm", b"")[0] == 200
    assert broker.http_req("/channel/create?topic=adm&channel=x", b"")[0] == 200
    assert broker.http_req("/channel/create?topic=adm&channel=y", b"")[0] == 200
    assert broker.http_req("/mpub?topic=adm", b"1\n2\n3\n")[0] == 200
    assert channel(broker, "adm", "x")["depth"] == 3
    assert broker.http_req("/channel/empty?topic=adm&channel=x", b"")[0] == 200
    assert channel(broker, "adm", "x")["depth"] == 0 and channel(broker, "adm", "y")["depth"] == 3
    assert broker.http_req("/channel/delete?topic=adm&channel=y", b"")[0] == 200
    assert channel(broker, "adm", "y") is None
    # topic pause: published messages are held until unpause
    assert broker.http_req("/topic/pause?topic=adm", b"")[0] == 200
    assert stats(broker, topic="adm")["topics"][0]["paused"] is True
    assert broker.http_req("/pub?topic=adm", b"p")[0] == 200
    assert channel(broker, "adm", "x")["depth"] == 0
    assert broker.http_req("/topic/unpause?topic=adm", b"")[0] == 200
    assert channel(broker, "adm", "x")["depth"] == 1
    assert broker.http_req("/topic/empty?topic=adm", b"")[0] == 200
    assert channel(broker, "adm", "x")["depth"] == 0
    assert broker.http_req("/topic/delete?topic=adm", b"")[0] == 200
    assert stats(broker, topic="adm")["topics"] == []


def test_paused_channel_holds_messages_until_unpaused(broker):
    c = RawClient(broker.tcp)
    c.identify(heartbeat_interval=1000)
    c.sub("pz", "c", 10)
    assert broker.http_req("/channel/pause?topic=pz&channel=c", b"")[0] == 200
    assert channel(broker, "pz", "c")["paused"] is True
    assert broker.http_req("/pub?topic=pz", b"held")[0] == 200
    with pytest.raises(TimeoutError):
        c.frame(timeout=2)
    assert broker.http_req("/channel/unpause?topic=pz&channel=c", b"")[0] == 200
    m = c.message(timeout=30)
    assert m[3] == b"held"
    c.send(b"FIN " + m[2] + b"\n")
    c.close()


def test_ephemeral_channel_disappears_with_its_last_client(broker):
    cs = []
    for _ in range(2):
        c = RawClient(broker.tcp)
        c.identify(heartbeat_interval=1000)
        c.sub("eph", "tmp#ephemeral", 5)
        cs.append(c)
    assert channel(broker, "eph", "tmp#ephemeral") is not None
    assert broker.http_req("/pub?topic=eph", b"x")[0] == 200
    assert len(channel(broker, "eph", "tmp#ephemeral")["clients"]) == 2
    cs[0].close()
    # the broker saw the first client go: the channel stays, one client left
    wait_for(lambda: len((channel(broker, "eph", "tmp#ephemeral") or {"clients": []})["clients"]) <= 1,
             what="the first client gone")
    assert channel(broker, "eph", "tmp#ephemeral") is not None
    cs[1].close()
    wait_for(lambda: channel(broker, "eph", "tmp#ephemeral") is None, what="ephemeral channel deleted")


def test_broker_topics_have_no_default_subscription(broker):
    """A topic the broker creates has channels only (no FDQ "default" nobody reads, whose
    backlog would grow without bound); what is published before the first channel is
    delivered to it, as nsqd's topic buffer does; later channels start at their creation."""
    db = fdq.connect(broker.url)
    assert broker.http_req("/mpub?topic=nodef", b"a\nb\nc\n") == (200, b"OK")   # creates the topic
    assert broker.http_req("/topic/create?topic=nodef2", b"")[0] == 200
    sup = fdq.Supervisor(db)
    assert sup.config("nodef").subs == () and sup.config("nodef2").subs == ()
    assert sup.stats("nodef")["counters"]["inserted"] == 3
    c = RawClient(broker.tcp)
    c.identify(heartbeat_interval=1000)
    c.sub("nodef", "first", 10)
    got = []
    while len(got) < 3:
        m = c.message(timeout=20)
        got.append(m[3])
        c.send(b"FIN " + m[2] + b"\n")
    assert sorted(got) == [b"a", b"b", b"c"]
    assert broker.http_req("/channel/create?topic=nodef&channel=second", b"")[0] == 200
    assert broker.http_req("/pub?topic=nodef", b"d") == (200, b"OK")
    assert c.message(timeout=20)[3] == b"d"
    c.close()
    assert sup.config("nodef").subs == ("first", "second")
    wait_for(lambda: channel(broker, "nodef", "second")["depth"] == 1, what="d alone in the second channel")


def test_ephemeral_channel_of_a_broker_killed_while_subscribing_is_not_left_behind(db_url):
    """A broker killed between creating an ephemeral channel's subscription and joining
    it as a consumer must not leave the subscription without members: no reaper deletes
    one (they look for zombie members) and every publish would fan out to it forever.
    The broker here dies exactly there (``fdq.ops.membership.join`` kills its process)."""
    code = ("import os, signal, runpy; import fdq.ops.membership; "
            "fdq.ops.membership.join = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL); "
            "runpy.run_module('fdq.broker', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", code, "--url", db_url, "--tcp-address", "127.0.0.1:0",
                             "--http-address", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=_ROOT, env=os.environ.copy(), text=True)
    try:
        line = readline_within(proc, 60, "the broker's address line")
        assert line.startswith("fdq-broker"), (line, proc.stderr.read()[-2000:] if proc.poll() is not None else "")
        tcp = dict(kv.split("=") for kv in line.split()[1:])["tcp"]
        sup = fdq.Supervisor(fdq.connect(db_url))
        sup.create_topic("eph2", shards=2, subs=("keep",))
        c = RawClient(tcp)
        c.identify(heartbeat_interval=1000)
        c.send(b"SUB eph2 tmp#ephemeral\n")
        assert proc.wait(60) == -signal.SIGKILL
        c.close()
        assert sup.config("eph2").subs == ("keep",)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


def test_expect_100_continue_is_answered(broker):
    # curl sends "Expect: 100-continue" with a body over 1 MiB and waits a second for
    # the interim answer before sending the body anyway; nsqd (Go) answers at once.
    c = RawHTTP(broker, timeout=5)
    body = b"a\nb\n"
    c.sock.sendall(b"POST /mpub?topic=expect HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body))
    assert c.response() == (100, b"")
    c.sock.sendall(body)
    assert c.response() == (200, b"OK")
    c.close()
    assert stats(broker, topic="expect")["topics"][0]["message_count"] == 2


def test_chunked_request_bodies(broker):
    # Clients that do not know a body's length send it chunked (Go's http.Client with a
    # plain io.Reader, requests with a generator). The broker ignored the chunks: a 400
    # MSG_EMPTY, then the chunks parsed as the next request, whose stray 404 answered
    # the client's next request on the connection.
    c = RawHTTP(broker)
    c.sock.sendall(b"POST /pub?topic=chunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                   b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n")
    assert c.response() == (200, b"OK")
    c.sock.sendall(b"POST /mpub?topic=chunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                   b"3\r\na\nb\r\n2\r\n\nc\r\n0\r\nX-Trailer: 1\r\n\r\n")
    assert c.response() == (200, b"OK")
    c.sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert c.response() == (200, b"OK")
    c.close()
    assert stats(broker, topic="chunked")["topics"][0]["message_count"] == 4
    sub = RawClient(broker.tcp)
    sub.identify()
    sub.send(b"SUB chunked c\n")      # the first channel starts from the topic's log
    sub.expect()
    sub.send(b"RDY 10\n")
    assert sorted(sub.message(timeout=30)[3] for _ in range(4)) == [b"a", b"b", b"c", b"hello, world"]
    sub.close()
    for bad, status in ((b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
                        (b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % (6 * 1024 * 1024), 413),
                        (b"Content-Length: abc\r\n\r\n", 400)):
        c = RawHTTP(broker)
        c.sock.sendall(b"POST /pub?topic=chunked HTTP/1.1\r\nHost: x\r\n" + bad)
        assert c.response()[0] == status
        c.close()


def test_mpub_errors_as_nsqd(broker):
    # nsqd answers a bad binary /mpub body with 413 and the TCP MPUB's code less "E_";
    # any binary value but "false"/"0" means binary (the broker published "binary=yes"
    # bodies, length prefixes included, as one text message); an empty text body is OK.
    one = struct.pack(">i", 1)
    for body, message in ((b"", "BAD_BODY"), (struct.pack(">i", 0), "BAD_BODY"),
                          (struct.pack(">i", 2) + one + b"a", "BAD_MESSAGE"),
                          (one + struct.pack(">i", 0), "BAD_MESSAGE"),
                          (one + struct.pack(">i", 1024 * 1024 + 1) + b"a", "BAD_MESSAGE"),
                          (one + struct.pack(">i", 5) + b"abc", "BAD_MESSAGE")):
        assert broker.http_req("/mpub?topic=mpe&binary=true", body) == (413, json.dumps({"message": message}).encode())
    assert broker.http_req("/mpub?topic=mpe&binary=yes", one + one + b"z") == (200, b"OK")
    assert broker.http_req("/mpub?topic=mpe&binary=0", b"p\nq") == (200, b"OK")
    assert broker.http_req("/mpub?topic=mpe", b"\n\n") == (200, b"OK")
    assert broker.http_req("/mpub?topic=mpe", b"x" * (1024 * 1024 + 1)) == (413, b'{"message": "MSG_TOO_BIG"}')
    assert stats(broker, topic="mpe")["topics"][0]["message_count"] == 3
    sub = RawClient(broker.tcp)
    sub.identify()
    sub.send(b"SUB mpe c\n")
    sub.expect()
    sub.send(b"RDY 10\n")
    assert sorted(sub.message(timeout=30)[3] for _ in range(3)) == [b"p", b"q", b"z"]
    sub.close()


def test_name_with_a_trailing_newline_is_invalid(broker):
    # Python's "$" matches before a final newline: "c\n" passed the broker's check, the
    # topic was created, and the channel's creation then failed as INVALID_TOPIC.
    assert broker.http_req("/channel/create?topic=nl-fresh&channel=c%0A", b"") == \
        (400, b'{"message": "INVALID_ARG_CHANNEL"}')
    assert broker.http_req("/pub?topic=nl-fresh%0A", b"x") == (400, b'{"message": "INVALID_TOPIC"}')
    assert stats(broker, topic="nl-fresh")["topics"] == []


def test_topic_delete_disconnects_its_subscribers(broker):
    # As nsqd. The broker kept them connected to a consumer of the deleted topic: they
    # got nothing more, and a new SUB to the same channel joined that dead channel and
    # never got what was published to the recreated topic.
    old = RawClient(broker.tcp)
    old.identify()
    old.sub("tdel", "c", 1)
    assert broker.http_req("/pub?topic=tdel", b"before") == (200, b"OK")
    assert old.message(timeout=30)[3] == b"before"
    assert broker.http_req("/topic/delete?topic=tdel", b"") == (200, b"")
    assert old.closed(timeout=30)
    assert broker.http_req("/pub?topic=tdel", b"after") == (200, b"OK")
    new = RawClient(broker.tcp)
    new.identify()
    new.sub("tdel", "c", 1)
    assert new.message(timeout=30)[3] == b"after"
    new.close()


def test_http_1_0_request_gets_the_connection_closed(broker):
    # An HTTP/1.0 client without keep-alive (check_http, ab) reads the answer until the
    # connection closes: the broker kept it open, so such a /ping probe timed out.
    c = RawHTTP(broker, timeout=10)
    c.sock.sendall(b"GET /ping HTTP/1.0\r\n\r\n")
    assert c.response() == (200, b"OK")
    assert c.sock.recv(100) == b""          # closed (a timeout past 10 s fails the test)
    c.close()
    c = RawHTTP(broker, timeout=10)
    c.sock.sendall(b"GET /ping HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert c.response() == (200, b"OK")
    c.sock.sendall(b"GET /ping HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert c.response() == (200, b"OK")
    c.close()


def test_http_error_codes_and_order_as_nsqd(broker):
    """nsqd's codes where the broker's differed: the /channel/ endpoints check their
    arguments as GetTopicChannelArgs (INVALID_ARG_TOPIC / INVALID_ARG_CHANNEL, were
    INVALID_TOPIC / INVALID_CHANNEL); /pub checks its body before its topic, and a /pub
    body past --max-body-size is MSG_TOO_BIG (was BODY_TOO_BIG); /topic/delete, pause
    and unpause look a name up without checking it (TOPIC_NOT_FOUND, was INVALID_TOPIC);
    /stats filters channels within its topic filter only."""
    for path in ("/channel/create", "/channel/delete", "/channel/empty", "/channel/pause", "/channel/unpause"):
        assert broker.http_req(f"{path}?topic=bad!&channel=c", b"") == (400, b'{"message": "INVALID_ARG_TOPIC"}')
        assert broker.http_req(f"{path}?topic=ok&channel=bad!", b"") == (400, b'{"message": "INVALID_ARG_CHANNEL"}')
        assert broker.http_req(f"{path}?channel=c", b"") == (400, b'{"message": "MISSING_ARG_TOPIC"}')
    assert broker.http_req("/pub", b"") == (400, b'{"message": "MSG_EMPTY"}')
    assert broker.http_req("/pub?topic=bad!", b"") == (400, b'{"message": "MSG_EMPTY"}')
    assert broker.http_req("/pub", b"x" * (1024 * 1024 + 1)) == (413, b'{"message": "MSG_TOO_BIG"}')
    for path, code in (("/pub", b"MSG_TOO_BIG"), ("/mpub", b"BODY_TOO_BIG")):
        # answered from the Content-Length, before the body (not sent here)
        with socket.create_connection(("127.0.0.1", broker.http_port), timeout=30) as s:
            s.sendall(f"POST {path}?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: {5 * 1024 * 1024 + 1}\r\n\r\n"
                      .encode())
            answer = b""
            while not answer.endswith(b"}"):
                chunk = s.recv(4096)
                assert chunk, answer
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 413 ") and answer.endswith(b'{"message": "' + code + b'"}'), answer
    for path in ("/topic/delete", "/topic/pause", "/topic/unpause"):
        assert broker.http_req(f"{path}?topic=bad!", b"") == (404, b'{"message": "TOPIC_NOT_FOUND"}')
    assert broker.http_req("/topic/create?topic=sf1", b"")[0] == 200
    assert broker.http_req("/channel/create?topic=sf1&channel=keep", b"")[0] == 200
    assert broker.http_req("/channel/create?topic=sf1&channel=other", b"")[0] == 200
    only = stats(broker, topic="sf1", channel="keep")["topics"]
    assert [c["channel_name"] for c in only[0]["channels"]] == ["keep"]
    every = stats(broker, channel="keep")["topics"]
    assert {c["channel_name"] for t in every if t["topic_name"] == "sf1" for c in t["channels"]} == {"keep", "other"}


def test_client_states_in_stats_as_nsqd(broker):
    """nsqd's client states: 0 init (a producer), 3 subscribed, 4 closing (after CLS);
    the broker showed 1 for anything not subscribed."""
    pub = RawClient(broker.tcp)
    pub.identify(client_id="prod")
    pub.pub("states", b"m")
    sub = RawClient(broker.tcp)
    sub.identify(client_id="cons")
    sub.sub("states", "ch")

    def states():
        data = stats(broker, topic="states")
        clients = {c["client_id"]: c["state"] for t in data["topics"] for ch in t["channels"] for c in ch["clients"]}
        clients.update({c["client_id"]: c["state"] for c in data["producers"]})
        return clients
    assert states() == {"prod": 0, "cons": 3}
    [client] = stats(broker, topic="states")["topics"][0]["channels"][0]["clients"]
    assert client["auth_identity_url"] == ""           # nsqd's field, missing
    sub.send(b"CLS\n")
    sub.expect(p.CLOSE_WAIT)
    assert states() == {"prod": 0, "cons": 4}
    text = broker.http_req("/stats?topic=states")[1].decode()
    assert "state: 4" in text
