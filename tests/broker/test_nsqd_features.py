"""nsqd features over raw sockets: snappy stream compression, output buffering
(IDENTIFY output_buffer_size / output_buffer_timeout), TOUCH capped at
--max-msg-timeout, REQ/DPUB timeout parsing and clamping, and /stats's
e2e_processing_latency percentiles, producers and client fields."""
import json
import socket
import struct
import time

import pytest

from fdq.broker import protocol as p
from fdqtest import wait_for
from nsqclient import RawClient

pytestmark = pytest.mark.slow


def consumer(broker, topic, channel="ch", rdy=None, **ident):
    c = RawClient(broker.tcp)
    ident.setdefault("heartbeat_interval", 1000)
    resp = c.identify(**ident)
    c.sub(topic, channel, rdy)
    return c, resp


def stats(broker, topic):
    st = json.loads(broker.http_req(f"/stats?format=json&topic={topic}")[1])
    return st, st["topics"][0] if st["topics"] else None


def chan(topic_stats, name="ch"):
    return next(c for c in topic_stats["channels"] if c["channel_name"] == name)


# -- snappy ----------------------------------------------------------------------------

class SnappyClient:
    """Wraps a RawClient whose IDENTIFY negotiated snappy: everything after the
    IDENTIFY response is a snappy framed stream both ways (python-snappy's codec)."""

    def __init__(self, raw):
        import snappy
        self.snappy = snappy
        self.raw = raw
        self.d = snappy.StreamDecompressor()
        self.buf = bytearray(self.d.decompress(bytes(raw.buf)))
        raw.buf.clear()

    def send(self, data):
        # a fresh compressor per command, as pynsq's SnappyEncoder: a stream identifier each time
        self.raw.sock.sendall(self.snappy.StreamCompressor().compress(data))

    def frame(self, timeout=30):
        deadline = time.monotonic() + timeout
        while True:
            if len(self.buf) >= 8:
                size, ftype = struct.unpack_from(">Ii", self.buf)
                if len(self.buf) >= 4 + size:
                    data = bytes(self.buf[8:4 + size])
                    del self.buf[:4 + size]
                    if ftype == p.FRAME_RESPONSE and data == p.HEARTBEAT:
                        self.send(b"NOP\n")
                        continue
                    return ftype, data
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no frame")
            self.raw.sock.settimeout(left)
            chunk = self.raw.sock.recv(65536)
            if not chunk:
                return None
            self.buf += self.d.decompress(chunk)


def test_snappy_negotiated_both_ways(broker_factory):
    pytest.importorskip("snappy", reason="python-snappy is not installed (pip install -e '.[test]')")
    b = broker_factory()
    c = RawClient(b.tcp)
    resp = c.identify(snappy=True, heartbeat_interval=1000)
    assert resp["snappy"] is True and resp["deflate"] is False
    s = SnappyClient(c)
    assert s.frame() == (p.FRAME_RESPONSE, p.OK)          # the first compressed frame
    bodies = [b"x" * 5000, bytes(range(256)) * 3, b"small"]
    s.send(p.encode_command(b"PUB", b"sn", body=bodies[0]))
    assert s.frame() == (p.FRAME_RESPONSE, p.OK)
    s.send(p.encode_mpub(b"sn", bodies[1:]))
    assert s.frame() == (p.FRAME_RESPONSE, p.OK)
    s.send(b"SUB sn ch\n")
    assert s.frame() == (p.FRAME_RESPONSE, p.OK)
    s.send(b"RDY 10\n")
    got = []
    for _ in range(3):
        t, d = s.frame()
        assert t == p.FRAME_MESSAGE
        _ts, attempts, mid, body, _ = p.decode_message(d)
        got.append(body)
        s.send(b"FIN " + mid + b"\n")
    assert sorted(got) == sorted(bodies)
    _st, topic = stats(b, "sn")
    clients = chan(topic)["clients"]
    assert clients and clients[0]["snappy"] is True and clients[0]["deflate"] is False
    # a corrupt chunk (CRC flipped) closes that connection; other clients are still served
    bad = bytearray(s.snappy.StreamCompressor().compress(b"NOP\n"))
    bad[14] ^= 0xFF
    c.sock.sendall(bytes(bad))
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, "connection not closed after a corrupt snappy chunk"
        try:
            if s.frame(timeout=max(0.1, deadline - time.monotonic())) is None:
                break
        except (ConnectionError, socket.timeout, TimeoutError):
            break
        except Exception:       # the error frame may not decode: the stream is being torn down
            break
    other = RawClient(b.tcp)
    other.pub("sn", b"still served")
    other.close()
    c.close()


def test_snappy_refused_when_disabled_and_with_deflate(broker_factory):
    b = broker_factory("--no-snappy")
    c = RawClient(b.tcp)
    resp = c.identify(snappy=True, heartbeat_interval=1000)
    assert resp["snappy"] is False
    c.pub("nosn", b"plain")                                 # the stream stayed uncompressed
    c.close()
    # as nsqd: the conflict is between what the broker enables (p.negotiate's test has
    # it with snappy offered), and nothing is enabled without feature negotiation
    c = RawClient(b.tcp)
    resp = c.identify(snappy=True, deflate=True, heartbeat_interval=1000)
    assert resp["deflate"] is True and resp["snappy"] is False
    c.close()
    c = RawClient(b.tcp)
    assert c.identify(feature_negotiation=False, snappy=True, deflate=True) == p.OK
    c.pub("nosn", b"plain")
    c.close()


# -- output buffering ------------------------------------------------------------------

@pytest.mark.parametrize("ident,error", [
    ({"output_buffer_size": 63}, "E_BAD_BODY IDENTIFY output buffer size (63) is invalid"),
    ({"output_buffer_size": 64 * 1024 + 1}, "E_BAD_BODY IDENTIFY output buffer size (65537) is invalid"),
    ({"output_buffer_timeout": 24}, "E_BAD_BODY IDENTIFY output buffer timeout (24) is invalid"),
    ({"output_buffer_timeout": 30001}, "E_BAD_BODY IDENTIFY output buffer timeout (30001) is invalid"),
])
def test_output_buffer_bounds(shared_broker, ident, error):
    c = RawClient(shared_broker.tcp)
    c.send(p.encode_command(b"IDENTIFY", body=json.dumps(ident).encode()))
    assert c.error() == error
    assert c.closed()
    c.close()


def test_output_buffer_negotiated_values(shared_broker):
    c = RawClient(shared_broker.tcp)
    r = c.identify(output_buffer_size=100, output_buffer_timeout=25)
    assert (r["output_buffer_size"], r["output_buffer_timeout"]) == (100, 25)
    c.close()
    c = RawClient(shared_broker.tcp)
    r = c.identify()
    assert (r["output_buffer_size"], r["output_buffer_timeout"]) == (16384, 250)     # nsqd's defaults
    c.close()
    c = RawClient(shared_broker.tcp)
    r = c.identify(output_buffer_timeout=-1)
    assert r["output_buffer_timeout"] == 0
    c.close()
    c = RawClient(shared_broker.tcp)
    r = c.identify(output_buffer_size=-1, output_buffer_timeout=1000)
    assert (r["output_buffer_size"], r["output_buffer_timeout"]) == (1, 0)            # unbuffered
    c.close()


def first_message_after_publish(broker, topic, rdy, **ident):
    """Seconds from sending a PUB to its message reaching a consumer IDENTIFYed with ``ident``."""
    c, _ = consumer(broker, topic, rdy=rdy, **ident)
    time.sleep(0.3)                   # the SUB's first (empty) fetch is under way: nothing to flush
    pub = RawClient(broker.tcp)
    t0 = time.monotonic()
    pub.pub(topic, b"m" * 100)
    _ts, _a, mid, body, _ = c.message(timeout=60)
    el = time.monotonic() - t0
    c.send(b"FIN " + mid + b"\n")
    c.close()
    pub.close()
    return el


def test_output_buffer_timeout_holds_messages(shared_broker):
    # RDY 10, one small message: the buffer neither fills nor reaches RDY, so the message
    # waits for the output buffer timeout (here 2 s, heartbeats 10 s apart)
    el = first_message_after_publish(shared_broker, "ob1", 10, output_buffer_timeout=2000,
                                     heartbeat_interval=10000)
    assert el >= 1.9, el


@pytest.mark.parametrize("topic,rdy,ident", [
    ("ob2", 1, {}),                                       # RDY reached: flushed at once
    ("ob3", 10, {"output_buffer_size": 64}),              # the frame fills the buffer
    ("ob4", 10, {"output_buffer_size": -1}),              # unbuffered
])
def test_output_buffer_flushes_early(shared_broker, topic, rdy, ident):
    # a 30 s timeout that must not be what sends the message
    ident = {"heartbeat_interval": 30000, "output_buffer_timeout": 30000, **ident}
    if ident.get("output_buffer_size") == -1:
        del ident["output_buffer_timeout"]
    el = first_message_after_publish(shared_broker, topic, rdy, **ident)
    assert el < 15, el


def test_output_buffer_timeout_off_still_buffers(shared_broker):
    # As nsqd: output_buffer_timeout -1 alone turns the flush timer off; the 16 KiB buffer
    # still holds a small message until it fills or the client reaches its RDY
    c, _ = consumer(shared_broker, "ob5", rdy=10, output_buffer_timeout=-1, heartbeat_interval=30000)
    time.sleep(0.3)                   # the SUB's first (empty) fetch is under way
    RawClient(shared_broker.tcp).pub("ob5", b"m" * 100)
    with pytest.raises(TimeoutError):
        c.message(timeout=1.5)
    c.send(b"RDY 1\n")                # one in flight, RDY 1: it can take no more: flushed
    _ts, _a, mid, body, _ = c.message(timeout=30)
    assert body == b"m" * 100
    c.send(b"FIN " + mid + b"\n")
    c.close()


# -- TOUCH cap, REQ / DPUB timeouts ----------------------------------------------------

def test_touch_capped_at_max_msg_timeout(broker_factory):
    b = broker_factory("--msg-timeout", "2s", "--max-msg-timeout", "3s")
    RawClient(b.tcp).pub("tc", b"long job")
    c, _ = consumer(b, "tc", rdy=1, msg_timeout=2000)
    _ts, a1, mid, _b, _ = c.message()
    t0 = time.monotonic()
    assert a1 == 1
    # keep touching: without the cap the lease would be extended forever
    c.sock.settimeout(0.4)
    redelivered = None
    deadline = t0 + 30
    while redelivered is None and time.monotonic() < deadline:
        c.send(b"TOUCH " + mid + b"\n")
        try:
            f = c.frame(timeout=0.4)
        except TimeoutError:
            continue
        if f[0] == p.FRAME_ERROR:
            assert f[1].decode().startswith("E_TOUCH_FAILED"), f
            continue
        assert f[0] == p.FRAME_MESSAGE, f
        redelivered = p.decode_message(f[1])
    assert redelivered is not None, "message never timed out while being touched"
    el = time.monotonic() - t0
    assert redelivered[1] == 2 and redelivered[3] == b"long job"
    assert el >= 2.8, el                   # not before max_msg_timeout (3 s)
    c.send(b"FIN " + redelivered[2] + b"\n")
    wait_for(lambda: chan(stats(b, "tc")[1])["timeout_count"] == 1, timeout=30)
    c.close()


def test_req_timeout_parse_and_clamp(broker_factory):
    b = broker_factory("--max-req-timeout", "1s")
    RawClient(b.tcp).pub("rq", b"r")
    c, _ = consumer(b, "rq", rdy=1, msg_timeout=60000)
    _ts, _a, mid, _b, _ = c.message()
    # nsqd's ByteToBase10: no sign, fatal E_INVALID
    c.send(b"REQ " + mid + b" -1\n")
    assert c.error() == "E_INVALID REQ could not parse timeout -1"
    assert c.closed()
    c.close()
    # the close requeued it; an out-of-range delay is clamped to --max-req-timeout (no error)
    c, _ = consumer(b, "rq", rdy=1, msg_timeout=60000)
    _ts, a2, mid, _b, _ = c.message()
    assert a2 == 2
    t0 = time.monotonic()
    c.send(b"REQ " + mid + b" 3600000\n")
    _ts, a3, mid, body, _ = c.message(timeout=30)
    el = time.monotonic() - t0
    assert a3 == 3 and body == b"r" and 0.8 <= el < 20, el
    c.send(b"FIN " + mid + b"\n")
    c.close()
    # DPUB's timeout is checked, not clamped
    d = RawClient(b.tcp)
    d.send(b"DPUB rq 1001\n" + struct.pack(">I", 1) + b"x")
    assert d.error() == "E_INVALID DPUB timeout 1001 out of range 0-1000"
    d.close()
    d = RawClient(b.tcp)
    d.send(b"DPUB rq 1x\n" + struct.pack(">I", 1) + b"x")
    assert d.error() == "E_INVALID DPUB could not parse timeout 1x"
    d.close()


# -- /stats ------------------------------------------------------------------------------

def test_stats_e2e_latency_percentiles_and_producers(broker_factory):
    b = broker_factory("--e2e-processing-latency-percentile", "1.0,0.5",
                       "--e2e-processing-latency-percentile", "0.99")
    pub = RawClient(b.tcp)
    pub.identify(client_id="producer-1")
    c, _ = consumer(b, "e2e", rdy=10, client_id="consumer-1")
    for i in range(5):
        pub.pub("e2e", b"%d" % i)
    for _ in range(5):
        _ts, _a, mid, _b, _ = c.message()
        time.sleep(0.02)
        c.send(b"FIN " + mid + b"\n")

    def done():
        return chan(stats(b, "e2e")[1])["e2e_processing_latency"]["count"] == 5
    wait_for(done, timeout=30)
    st, topic = stats(b, "e2e")
    ch = chan(topic)
    lat = ch["e2e_processing_latency"]
    assert [q["quantile"] for q in lat["percentiles"]] == [1.0, 0.5, 0.99]
    v = {q["quantile"]: q["value"] for q in lat["percentiles"]}
    assert 0 < v[0.5] <= v[0.99] <= v[1.0] < 60e9            # nanoseconds
    assert topic["e2e_processing_latency"]["count"] == 5
    cl = ch["clients"][0]
    for key in ("client_id", "hostname", "version", "remote_address", "state", "ready_count", "in_flight_count",
                "message_count", "finish_count", "requeue_count", "timeout_count", "deferred_count",
                "connect_ts", "sample_rate", "deflate", "snappy", "user_agent", "tls", "tls_cipher_suite",
                "tls_version", "tls_negotiated_protocol", "tls_negotiated_protocol_is_mutual"):
        assert key in cl, key
    assert cl["client_id"] == "consumer-1" and cl["finish_count"] == 5 and cl["message_count"] == 5
    prods = [x for x in st["producers"] if x["client_id"] == "producer-1"]
    assert prods and prods[0]["pub_counts"] == [{"topic": "e2e", "count": 5}]
    mem = st["memory"]
    assert mem["heap_in_use_bytes"] > 1 << 20 and mem["gc_total_runs"] >= 0 and "heap_objects" in mem
    lean = json.loads(b.http_req("/stats?format=json&topic=e2e&include_clients=false&include_mem=false")[1])
    assert "memory" not in lean and lean["producers"] == []
    assert chan(lean["topics"][0])["clients"] == [] and chan(lean["topics"][0])["message_count"] == 5
    c.close()
    pub.close()


def test_stats_e2e_latency_off_by_default(shared_broker):
    c, _ = consumer(shared_broker, "e2eoff", rdy=1)
    RawClient(shared_broker.tcp).pub("e2eoff", b"m")
    _ts, _a, mid, _b, _ = c.message()
    c.send(b"FIN " + mid + b"\n")
    wait_for(lambda: chan(stats(shared_broker, "e2eoff")[1])["depth"] == 0, timeout=30)
    _st, topic = stats(shared_broker, "e2eoff")
    assert topic["e2e_processing_latency"] == {"count": 0, "percentiles": None}
    assert chan(topic)["e2e_processing_latency"] == {"count": 0, "percentiles": None}
    c.close()
