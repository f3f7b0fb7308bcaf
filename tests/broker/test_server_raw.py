"""The broker over raw sockets: every command, nsqd's error codes, partial frames,
oversize bodies, wrong magic, heartbeats, RDY limits, requeue on close."""
import json
import struct
import time

import pytest

from fdq.broker import protocol as p

pytestmark = pytest.mark.slow


@pytest.fixture
def broker(shared_broker):
    return shared_broker


def consumer(raw, topic, channel="ch", rdy=None, **ident):
    c = raw()
    # Long heartbeats: a test reading its connections in turn answers one's heartbeats
    # only while reading it; with 1 s, a slow round under load got a connection closed
    # for two missed heartbeats, and the message it had not read yet was requeued to
    # another (a duplicate in test_connections_share_a_channel, ~1 run in 20 under load).
    # The heartbeat tests set their own interval.
    ident.setdefault("heartbeat_interval", 30000)
    c.identify(**ident)
    c.sub(topic, channel, rdy)
    return c


def test_pub_mpub_dpub_sub_fin(raw):
    pub = raw()
    pub.pub("t", b"one")
    pub.send(p.encode_mpub(b"t", [b"two", b"three\n\x00"]))
    pub.expect()
    c = consumer(raw, "t", rdy=10, msg_timeout=5000)
    got = {}
    for _ in range(3):
        ts, attempts, mid, body, _ = c.message()
        assert attempts == 1 and len(mid) == 16 and abs(ts / 1e9 - time.time()) < 120
        got[body] = mid
    assert set(got) == {b"one", b"two", b"three\n\x00"}
    for mid in got.values():
        c.send(b"FIN " + mid + b"\n")
    # a FIN of an id no longer in flight is a non-fatal E_FIN_FAILED
    c.send(b"FIN " + got[b"one"] + b"\n")
    assert c.error().startswith("E_FIN_FAILED")
    # DPUB: delivered after the delay, not before
    t0 = time.monotonic()
    pub.send(b"DPUB t 1500\n" + struct.pack(">I", 4) + b"late")
    pub.expect()
    _ts, attempts, mid, body, _ = c.message(timeout=30)
    assert body == b"late" and time.monotonic() - t0 >= 1.4
    c.send(b"FIN " + mid + b"\n")
    c.send(b"NOP\n")
    c.send(b"CLS\n")
    c.expect(p.CLOSE_WAIT)


def test_req_with_delay_and_attempts_and_touch(raw):
    raw().pub("r", b"m")
    c = consumer(raw, "r", rdy=1, msg_timeout=2000)
    _ts, a1, mid, body, _ = c.message()
    assert a1 == 1
    t0 = time.monotonic()
    c.send(b"REQ " + mid + b" 1000\n")
    _ts, a2, mid2, body2, _ = c.message(timeout=30)
    assert body2 == b"m" and a2 == 2 and time.monotonic() - t0 >= 0.9
    # TOUCH keeps it beyond msg_timeout (2 s): touch every 0.5 s for 3 s, no redelivery
    t1 = time.monotonic()
    while time.monotonic() - t1 < 3.0:
        c.send(b"TOUCH " + mid2 + b"\n")
        with pytest.raises(TimeoutError):
            c.frame(timeout=0.5)
    c.send(b"FIN " + mid2 + b"\n")
    with pytest.raises(TimeoutError):
        c.frame(timeout=3)         # acked: never redelivered


def test_msg_timeout_redelivers(raw):
    raw().pub("mt", b"x")
    c = consumer(raw, "mt", rdy=5, msg_timeout=1000)
    _ts, a1, mid, _b, _ = c.message()
    _ts, a2, mid2, body, _ = c.message(timeout=30)      # not FIN'd: redelivered after ~1 s
    assert body == b"x" and a2 == 2 and mid2 == mid     # as nsqd, under the same id
    c.send(b"FIN " + mid2 + b"\n")
    c.send(b"FIN " + mid + b"\n")                      # finished once
    assert c.error().startswith("E_FIN_FAILED")


def test_a_message_keeps_its_id_when_redelivered(raw):
    # nsqd's message id is fixed at publish: REQ, timeouts and requeues on close
    # redeliver it under the same id, which clients may use to recognise redeliveries.
    # The broker numbered each delivery afresh.
    raw().pub("ids", b"m")
    c = consumer(raw, "ids", rdy=1, msg_timeout=60_000)
    _ts, a1, mid, _b, _ = c.message()
    assert len(mid) == 16 and mid.isascii() and b" " not in mid
    c.send(b"REQ " + mid + b" 0\n")
    _ts, a2, mid2, _b, _ = c.message(timeout=30)
    assert (a1, a2) == (1, 2) and mid2 == mid
    c.close()                                            # requeued at once, to another client
    c = consumer(raw, "ids", rdy=1, msg_timeout=60_000)
    _ts, a3, mid3, body, _ = c.message(timeout=30)
    assert body == b"m" and a3 == 3 and mid3 == mid
    c.send(b"FIN " + mid3 + b"\n")


def test_never_more_in_flight_than_rdy(raw):
    pub = raw()
    pub.send(p.encode_mpub(b"rdy", [b"%d" % i for i in range(20)]))
    pub.expect()
    c = consumer(raw, "rdy", rdy=3, msg_timeout=30000)
    first = [c.message() for _ in range(3)]
    with pytest.raises(TimeoutError):
        c.frame(timeout=2)
    c.send(b"FIN " + first[0][2] + b"\n")
    c.message()                         # exactly one more
    with pytest.raises(TimeoutError):
        c.frame(timeout=1.5)
    c.send(b"RDY 0\n")
    for m in first[1:]:
        c.send(b"FIN " + m[2] + b"\n")
    with pytest.raises(TimeoutError):
        c.frame(timeout=1.5)


def test_close_requeues_in_flight_at_once(raw):
    raw().pub("cl", b"held")
    c1 = consumer(raw, "cl", rdy=1, msg_timeout=600_000)
    assert c1.message()[3] == b"held"
    c1.close()
    c2 = consumer(raw, "cl", rdy=1, msg_timeout=600_000)
    t0 = time.monotonic()
    _ts, attempts, mid, body, _ = c2.message(timeout=30)     # long before its 10 min timeout
    assert body == b"held" and attempts == 2 and time.monotonic() - t0 < 30


def test_no_redelivery_while_a_longer_msg_timeout_holds_it(raw):
    # A fetch for a connection with msg_timeout 1 s that loses its RDY meanwhile must
    # not hand its 1 s leases to a connection with msg_timeout 60 s: they expired under
    # it and were delivered again while it still held them (and its FIN then failed).
    for i in range(3):
        topic = f"mixed-timeouts{i}"
        short = consumer(raw, topic, rdy=1, msg_timeout=1000)
        long = consumer(raw, topic, msg_timeout=60_000)
        raw().pub(topic, b"warm-up")
        short.send(b"FIN " + short.message(timeout=30)[2] + b"\n")
        # a round trip after the FIN: the channel is now in a fetch for `short`, which
        # loses its RDY (and `long` gets one) before that fetch returns the next message
        short.send(b"TOUCH 0000000000000000\n")
        assert short.error().startswith("E_TOUCH_FAILED")
        short.send(b"RDY 0\n")
        long.send(b"RDY 1\n")
        raw().pub(topic, b"only")
        _ts, _attempts, mid, body, _ = long.message(timeout=30)
        assert body == b"only"
        other = consumer(raw, topic, rdy=5, msg_timeout=60_000)
        with pytest.raises(TimeoutError):               # 1 s lease + expiry check, well past
            other.frame(timeout=4)
        long.send(b"FIN " + mid + b"\n")
        for c in (short, long, other):
            c.close()


def test_connections_share_a_channel(raw):
    pub = raw()
    pub.send(p.encode_mpub(b"sh", [b"%d" % i for i in range(40)]))
    pub.expect()
    cs = [consumer(raw, "sh", rdy=1, msg_timeout=30000) for _ in range(4)]
    # nsqd does not deal a channel's messages to its connections in lock-step: a
    # connection FINing while another waits for its refill may take the next message
    # itself (reading one and FINing it at once, the last round failed ~1 run in 10: a
    # connection held the 40th message, unread, while the one waited on had none). What
    # it does promise: a connection with RDY and nothing in flight gets a message while
    # the channel has any left. So each round reads one message from every connection
    # (each has RDY 1 and nothing in flight; the others hold at most one each, so
    # messages remain undelivered), and only then FINs the four.
    seen = []
    for _round in range(10):
        held = [c.message() for c in cs]
        seen += [m[3] for m in held]
        for c, m in zip(cs, held):
            c.send(b"FIN " + m[2] + b"\n")
    # every message delivered to the channel once, across its connections
    assert sorted(seen) == sorted(b"%d" % i for i in range(40))


def test_two_channels_each_get_every_message(raw):
    a = consumer(raw, "two", "a", rdy=50)
    b = consumer(raw, "two", "b", rdy=50)
    pub = raw()
    pub.send(p.encode_mpub(b"two", [b"%d" % i for i in range(20)]))
    pub.expect()
    for c in (a, b):
        got = []
        for _ in range(20):
            m = c.message()
            got.append(m[3])
            c.send(b"FIN " + m[2] + b"\n")
        assert sorted(got) == sorted(b"%d" % i for i in range(20))


def test_wrong_magic(raw):
    c = raw(magic=b"  V1")
    assert c.error().startswith("E_BAD_PROTOCOL")
    assert c.closed()


@pytest.mark.parametrize("data,code", [
    (b"BOGUS\n", "E_INVALID"),
    (b"PUB\n", "E_INVALID"),
    (b"PUB bad!\n", "E_BAD_TOPIC"),
    (b"PUB t\n" + struct.pack(">i", 0), "E_BAD_MESSAGE"),
    (b"PUB t\n" + struct.pack(">i", 2 * 1024 * 1024), "E_BAD_MESSAGE"),
    (b"MPUB t\n" + struct.pack(">i", 6 * 1024 * 1024), "E_BAD_BODY"),
    (b"MPUB t\n" + struct.pack(">ii", 4, 0), "E_BAD_BODY"),
    (b"MPUB t\n" + struct.pack(">iii", 8, 1, -1), "E_BAD_MESSAGE"),
    (b"DPUB t\n", "E_INVALID"),
    (b"DPUB t -5\n", "E_INVALID"),
    (b"DPUB t 99999999999\n" + struct.pack(">i", 1) + b"x", "E_INVALID"),
    (b"RDY 5\n", "E_INVALID"),
    (b"FIN 0123456789abcdef\n", "E_INVALID"),
    (b"REQ 0123456789abcdef 0\n", "E_INVALID"),
    (b"TOUCH 0123456789abcdef\n", "E_INVALID"),
    (b"CLS\n", "E_INVALID"),
    (b"SUB t\n", "E_INVALID"),
    (b"SUB t# ch\n", "E_BAD_TOPIC"),
    (b"SUB t c!h\n", "E_BAD_CHANNEL"),
    (b"AUTH\n" + struct.pack(">i", 3) + b"abc", "E_AUTH_DISABLED"),
    (b"IDENTIFY\n" + struct.pack(">i", 2) + b"{]", "E_BAD_BODY"),
    (b"IDENTIFY\n" + struct.pack(">i", 27) + b'{"heartbeat_interval": 10 }', "E_BAD_BODY"),
])
def test_fatal_errors_close_the_connection(raw, data, code):
    c = raw()
    c.send(data)
    err = c.error()
    assert err.split(" ")[0] == code, err
    assert c.closed()


def test_subscribed_errors(raw):
    c = consumer(raw, "e", rdy=None)
    c.send(b"RDY 99999\n")
    assert c.error().startswith("E_INVALID")
    assert c.closed()
    c = consumer(raw, "e")
    c.send(b"FIN short\n")
    assert c.error().startswith("E_INVALID")
    assert c.closed()
    c = consumer(raw, "e")
    for cmd, code in ((b"FIN 0123456789abcdef\n", "E_FIN_FAILED"), (b"REQ 0123456789abcdef 10\n", "E_REQ_FAILED"),
                      (b"TOUCH 0123456789abcdef\n", "E_TOUCH_FAILED")):
        c.send(cmd)
        assert c.error().startswith(code)       # non-fatal: the connection stays open
    c.send(b"SUB e ch\n")
    assert c.error().startswith("E_INVALID")
    c = raw()
    c.identify(heartbeat_interval=-1)
    c.send(b"SUB e ch\n")
    assert c.error().startswith("E_INVALID")    # cannot SUB with heartbeats disabled


def test_partial_frames_and_pipelined_publishes_answer_in_order(raw):
    c = raw()
    stream = b"".join(p.encode_command(b"PUB", b"pp", body=b"m%d" % i) for i in range(30))
    stream += b"PUB bad!\n"
    for i in range(0, len(stream), 7):
        c.send(stream[i:i + 7])
        time.sleep(0.001)
    for _ in range(30):
        c.expect()
    assert c.error().startswith("E_BAD_TOPIC")
    assert c.closed()


def test_heartbeat_timeout_closes_client(raw):
    c = raw()
    c.identify(heartbeat_interval=1000)
    t0 = time.monotonic()
    beats = 0
    while True:                 # never answer: closed after missing two heartbeats
        f = c.frame(timeout=30, skip_heartbeats=False)
        if f is None:
            break
        assert f == (p.FRAME_RESPONSE, p.HEARTBEAT)
        beats += 1
    assert 1.5 <= time.monotonic() - t0 < 30 and beats >= 1
    # a client that answers stays connected
    c2 = raw()
    c2.identify(heartbeat_interval=1000)
    with pytest.raises(TimeoutError):
        c2.frame(timeout=3.5)      # frame() answers heartbeats with NOP
    c2.pub("hb", b"alive")


def test_identify_twice_is_fatal(raw):
    c = raw()
    c.identify()
    c.send(p.encode_command(b"IDENTIFY", body=b"{}"))
    assert c.error().startswith("E_INVALID")


def test_deflate(raw):
    import zlib
    c = raw()
    resp = c.identify(deflate=True, deflate_level=3, heartbeat_interval=1000)
    assert resp["deflate"] is True and resp["deflate_level"] == 3
    comp = zlib.compressobj(3, zlib.DEFLATED, -15)
    decomp = zlib.decompressobj(-15)
    data = decomp.decompress(bytes(c.buf))   # bytes read with the IDENTIFY response
    c.buf.clear()
    c.sock.settimeout(30)
    while len(data) < 10:      # the OK after the upgrade arrives compressed
        data += decomp.decompress(c.sock.recv(65536))
    assert data == p.response()
    c.send(comp.compress(p.encode_command(b"PUB", b"df", body=b"z" * 1000)) + comp.flush(zlib.Z_SYNC_FLUSH))
    data = b""
    while len(data) < 10:
        data += decomp.decompress(c.sock.recv(65536))
    assert data == p.response()


def test_compression_and_tls_need_feature_negotiation(raw):
    # nsqd answers OK and keeps the stream plain when the client does not negotiate;
    # the broker switched deflate on behind a client that then spoke plain bytes.
    for ask in ({"deflate": True}, {"snappy": True}, {"deflate": True, "snappy": True}):
        c = raw()
        assert c.identify(feature_negotiation=False, **ask) == p.OK
        c.send(p.encode_command(b"PUB", b"nofn", body=b"plain"))
        c.expect()


def test_nothing_after_a_fatal_error_is_executed(raw, broker):
    # nsqd closes at a fatal error and reads nothing more. The broker went on reading:
    # a PUB completed by a later read (here, one larger than a read) was published
    # though the client got the fatal error and no OK (it would publish it again).
    for i in range(3):
        topic = f"after-fatal{i}"
        c = raw()
        c.send(b"RDY 1\n" + p.encode_command(b"PUB", topic.encode(), body=b"x" * 100_000))
        assert c.error().startswith("E_INVALID")
        assert c.closed()
        c = raw()
        c.pub(topic + "-probe", b"y")         # a round trip after the close
        status, body = broker.http_req(f"/stats?format=json&topic={topic}")
        assert status == 200 and json.loads(body)["topics"] == [], body


def test_garbage_does_not_hurt_other_clients(raw):
    import random
    rng = random.Random(7)
    good = raw()
    good.identify(heartbeat_interval=1000)
    for i in range(30):
        bad = raw()
        bad.send(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))))
        bad.close()
        if i % 10 == 0:
            good.pub("alive", b"%d" % i)
    good.pub("alive", b"end")


def test_publish_failures_are_fatal_pub_mpub_dpub_failed(raw, broker):
    import fdq
    db = fdq.connect(broker.url)
    fdq.Supervisor(db).create_topic("full", shards=1, max_backlog=1)
    c = raw()
    c.pub("full", b"first")                      # backlog 1: the next push is refused
    for data, code in ((p.encode_command(b"PUB", b"full", body=b"x"), "E_PUB_FAILED"),
                       (p.encode_mpub(b"full", [b"a", b"b"]), "E_MPUB_FAILED"),
                       (b"DPUB full 10\n" + struct.pack(">i", 1) + b"x", "E_DPUB_FAILED")):
        c = raw()
        c.send(data)
        err = c.error()
        assert err.startswith(code) and "max_backlog" in err, err
        assert c.closed()


from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=1, max_size=300), st.booleans())
def test_fuzzed_bytes_never_hurt_the_server(raw, data, magic):
    bad = raw()
    bad.send((p.MAGIC_V2 if magic else b"") + data)
    bad.close()
    good = raw()
    good.pub("fuzz-alive", b"ok")           # the server still answers other clients
    good.close()


@pytest.mark.parametrize("data,text", [
    (b"PUB a*b\n", 'E_BAD_TOPIC PUB topic name "a*b" is not valid'),
    (b"SUB ok b*c\n", 'E_BAD_CHANNEL SUB channel name "b*c" is not valid'),
    (b"AUTH\n" + struct.pack(">I", 3) + b"abc", "E_AUTH_DISABLED AUTH Disabled"),
    (b"SUB ok c\nRDY -1\n", "E_INVALID RDY could not parse count -1"),
    (b"MPUB t\n" + struct.pack(">I", 8) + struct.pack(">I", 1) + struct.pack(">i", -1),
     "E_BAD_MESSAGE MPUB invalid message(0) body size -1"),
])
def test_fatal_error_texts_as_nsqd(raw, data, text):
    """nsqd's texts: names quoted as Go's %q (were Python's b'...'), its capitals."""
    c = raw()
    c.send(data)
    f = c.frame()
    if f == (p.FRAME_RESPONSE, p.OK):       # SUB's answer first
        f = c.frame()
    assert f == (p.FRAME_ERROR, text.encode())
    assert c.closed()


def test_rdy_with_an_empty_count_is_zero(raw):
    """nsqd parses an empty RDY count as 0 (ByteToBase10); it was a fatal error."""
    pub = raw()
    pub.pub("rdyempty", b"m")
    c = consumer(raw, "rdyempty")
    c.send(b"RDY \nRDY 1\n")
    _ts, _att, mid, body, _ = c.message()
    assert body == b"m"
    c.send(b"RDY \n")           # no more in flight than the (zero) RDY allows, still open
    c.send(b"FIN " + mid + b"\nNOP\n")
    pub.pub("rdyempty", b"n")
    with pytest.raises(TimeoutError):
        c.frame(timeout=1.5)
    c.send(b"RDY 1\n")
    assert c.message()[3] == b"n"


def test_cls_then_in_flight_messages(raw):
    """As nsqd: after CLS (answered CLOSE_WAIT) a client gets no more messages, RDY is
    ignored, and it may still FIN and REQ what it holds; closing then requeues the rest."""
    pub = raw()
    pub.send(p.encode_mpub(b"cls", [b"a", b"b", b"c", b"d"]))
    pub.expect()
    c = consumer(raw, "cls", rdy=2, msg_timeout=60000)
    held = {}
    for _ in range(2):
        _ts, _att, mid, body, _ = c.message()
        held[body] = mid
    c.send(b"CLS\n")
    c.expect(p.CLOSE_WAIT)
    c.send(b"RDY 10\n")
    first, second = sorted(held)
    c.send(b"FIN " + held[first] + b"\nREQ " + held[second] + b" 0\nNOP\n")
    with pytest.raises(TimeoutError):           # no error, and no message
        c.frame(timeout=1.5)
    c.close()
    other = consumer(raw, "cls", rdy=10)
    got = sorted(other.message(timeout=30)[3] for _ in range(3))
    assert got == sorted({b"a", b"b", b"c", b"d"} - {first})
    with pytest.raises(TimeoutError):
        other.frame(timeout=1.5)


def test_dpub_with_an_empty_timeout_publishes_at_once(raw):
    """nsqd parses DPUB's empty timeout as 0 (ByteToBase10), as the parser does since
    RDY's empty count became 0; the command handler then parsed it again with int(),
    a ValueError that killed the connection's task: no answer, nothing published."""
    pub = raw()
    pub.send(b"DPUB dpubempty \n" + struct.pack(">I", 3) + b"now")
    pub.expect()
    c = consumer(raw, "dpubempty", rdy=1)
    _ts, _att, mid, body, _ = c.message(timeout=30)
    assert body == b"now"
    c.send(b"FIN " + mid + b"\n")
