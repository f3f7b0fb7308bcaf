"""Hostile numbers and nesting (issue 21.8): each answered as nsqd answers it (an E_*
frame, an HTTP status), the connection closed where nsqd closes it, and at most one log
line per connection, never a traceback (they used to drop the connection with no frame
and log a full traceback each: any client could flood the log)."""
import asyncio
import json
import logging
import socket
import struct
import time

import pytest

import fdq
from fdq.broker import protocol as p
from fdq.broker.server import Broker
from inprocess import run_conn

DEEP = b"[" * 5000 + b"]" * 5000
NINES = b"9" * 5000


def identify(body: bytes) -> bytes:
    return b"IDENTIFY\n" + struct.pack(">I", len(body)) + body


def pub_ext(topic: bytes, header: bytes, body: bytes = b"m") -> bytes:
    return p.encode_pub_ext(topic, header, body)


@pytest.fixture
def loud(broker_factory):
    """A broker logging at INFO, whose log the test reads once it has stopped."""
    return broker_factory("--log-level", "INFO")


def stderr_of(broker) -> str:
    broker.stop()
    return broker.proc.stderr.read()


FATAL = [
    (identify(b'{"heartbeat_interval": 1e400}'),
     "E_BAD_BODY IDENTIFY heartbeat_interval must be a finite number, not inf"),
    (identify(b'{"msg_timeout": -1e400}'), "E_BAD_BODY IDENTIFY msg_timeout must be a finite number, not -inf"),
    (identify(b'{"heartbeat_interval": NaN}'), "E_BAD_BODY IDENTIFY failed to decode JSON body"),
    (identify(b'{"output_buffer_size": 1' + b"0" * 4000 + b"}"),
     "E_BAD_BODY IDENTIFY output_buffer_size (a 13288-bit number) is out of range"),
    (identify(b'{"sample_rate": ' + NINES + b"}"), "E_BAD_BODY IDENTIFY failed to decode JSON body"),
    (identify(DEEP), "E_BAD_BODY IDENTIFY failed to decode JSON body"),
    (identify(b'{"client_id": ' + b"[" * 900 + b"]" * 900 + b"}"),
     "E_BAD_BODY IDENTIFY client_id must be a string, not [[[[[[[...]]]]]]]"),
    (b"DPUB t " + NINES + b"\n" + struct.pack(">I", 1) + b"x",
     "E_INVALID DPUB timeout 99999999999999999999999999999999... out of range 0-3600000"),
    (b"SUB t ch\nRDY " + NINES + b"\n", "E_INVALID RDY count 99999999999999999999999999999999... out of range 0-2500"),
    (b"SUB t ch\nRDY 0000000000000000000000000000001\n", None),     # leading zeros: 1, accepted
]


@pytest.mark.parametrize("data,text", FATAL, ids=[
    "identify-inf", "identify-minus-inf", "identify-nan", "identify-4000-digits", "identify-5000-digits",
    "identify-nested-5000", "identify-client-id-nested-900", "dpub-5000-digits", "rdy-5000-digits",
    "rdy-leading-zeros"])
def test_hostile_numbers_and_nesting_get_nsqds_error_frame(raw, data, text):
    c = raw()
    c.send(data)
    f = c.frame()
    if data.startswith(b"SUB"):
        assert f == (p.FRAME_RESPONSE, p.OK)
        if text is None:                     # RDY accepted: the connection stays open
            c.send(b"NOP\nRDY 0\nCLS\n")
            assert c.frame() == (p.FRAME_RESPONSE, p.CLOSE_WAIT)
            return
        f = c.frame()
    assert f == (p.FRAME_ERROR, text.encode()), f
    assert c.closed()


def test_hostile_requeue_timeout_is_clamped_and_nested_ext_headers_refused(raw, broker):
    status, _ = broker.http_req("/topic/create?topic=x&extend=true", b"")
    assert status == 200
    c = raw()
    c.identify(extend_support=True)
    c.send(b"SUB x ch\n")
    c.expect()
    # REQ: nsqd clamps the timeout; the id is not in flight: a non-fatal error
    c.send(b"REQ 0123456789abcdef " + NINES + b"\n")
    assert c.error() == "E_REQ_FAILED REQ 0123456789abcdef failed ID not in flight"
    # PUB_EXT's JSON header nested 5,000 deep: non-fatal, as any header that is not JSON
    c.send(pub_ext(b"x", b"[" * 5000 + b"]" * 5000))
    assert c.error() == "E_INVALID_JSON_HEADER PUB_EXT header is not valid JSON"
    c.send(pub_ext(b"x", b'{"a": NaN}'))
    assert c.error() == "E_INVALID_JSON_HEADER PUB_EXT header is not valid JSON"
    c.send(b"NOP\nCLS\n")
    assert c.frame() == (p.FRAME_RESPONSE, p.CLOSE_WAIT)      # still open


def http_raw(broker, head: bytes, body: bytes = b"", timeout: float = 30) -> tuple:
    """(status, body) of one request sent as raw bytes; (None, b"") if closed unanswered."""
    with socket.create_connection(("127.0.0.1", broker.http_port), timeout=timeout) as s:
        s.sendall(head + body)
        data = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data:
                top, _, rest = data.partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in top.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")]
                if length and len(rest) >= length[0]:
                    break
    if not data:
        return None, b""
    top, _, rest = data.partition(b"\r\n\r\n")
    return int(top.split(b" ")[1]), rest


def test_hostile_http_requests_get_a_status(broker):
    status, _ = broker.http_req("/topic/create?topic=x&extend=true", b"")
    assert status == 200
    # Content-Length of 4,301 digits: Go's server (nsqd) answers 400 "bad Content-Length"
    status, body = http_raw(broker, b"POST /pub?topic=x HTTP/1.1\r\nContent-Length: " + b"9" * 4301 + b"\r\n\r\n")
    assert status == 400 and json.loads(body) == {"message": "INVALID_REQUEST"}
    # a length within 63 bits but over the limit: 413, as nsqd
    status, body = http_raw(broker, b"POST /pub?topic=x HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n")
    assert status == 413 and json.loads(body) == {"message": "MSG_TOO_BIG"}
    # a Unicode digit is no digit of a length
    status, _ = http_raw(broker, b"POST /pub?topic=x HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n")
    assert status == 400
    # /pub_ext?ext= nested 3,000 deep
    ext = b"%5B" * 3000 + b"%5D" * 3000
    status, body = http_raw(broker, b"POST /pub_ext?topic=x&ext=" + ext + b" HTTP/1.1\r\nContent-Length: 1\r\n\r\n",
                            b"m")
    assert status == 400 and json.loads(body) == {"message": "E_INVALID_JSON_HEADER"}
    # a target urlsplit refuses
    status, _ = http_raw(broker, b"GET //[::1/ping HTTP/1.1\r\n\r\n")
    assert status == 400
    # a header block larger than the reader takes
    status, _ = http_raw(broker, b"GET /ping HTTP/1.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
    assert status == 431
    assert broker.http_req("/ping") == (200, b"OK")


def test_hostile_input_logs_one_line_per_connection_and_no_traceback(raw, loud):
    cases = [data for data, text in FATAL if text is not None]
    for data in cases:
        c = raw(addr=loud.tcp)
        c.send(data)
        assert c.closed()
    http_raw(loud, b"POST /pub?topic=x HTTP/1.1\r\nContent-Length: " + b"9" * 4301 + b"\r\n\r\n")
    log = stderr_of(loud)
    assert "Traceback" not in log, log
    lines = [line for line in log.splitlines() if "client" in line]
    assert len(lines) <= len(cases), log


@pytest.fixture
def inproc(tmp_path):
    """A broker that is not listening, on a fresh database, and its event loop."""
    broker = Broker(fdq.connect(f"sqlite://{tmp_path / 'fdq.db'}"))
    loop = asyncio.new_event_loop()
    yield broker, loop
    loop.run_until_complete(broker.close())
    loop.close()


@pytest.mark.parametrize("where,data", [
    ("IDENTIFY", identify(b'{"client_id": "c"}')),
    ("publish", p.encode_command(b"PUB", b"t", body=b"m")),
], ids=["command", "publish"])
def test_an_unexpected_failure_ends_the_connection_with_e_internal_and_one_log_line(inproc, monkeypatch, caplog,
                                                                                    where, data):
    """The safety net under every command (and every publish's answer): whatever no
    handler expected gets a fatal E_INTERNAL frame, and one WARNING line, at most one a
    second per kind; the traceback only at DEBUG."""
    broker, loop = inproc
    if where == "IDENTIFY":
        monkeypatch.setattr(p, "negotiate", lambda data, limits: 1 / 0)
    else:
        async def push(*_a, **_k):
            return 1 / 0
        monkeypatch.setattr(fdq.aio, "push", push)      # the broker's PUB: fdq.aio.push
    caplog.set_level(logging.INFO, logger="fdq.broker")
    for _ in range(3):
        out, conn = loop.run_until_complete(run_conn(broker, p.MAGIC_V2 + data))
        frames = p.decode_frames(bytearray(out))
        assert frames[-1][0] == p.FRAME_ERROR and frames[-1][1].startswith(b"E_INTERNAL "), frames
        assert conn.closed
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, [r.getMessage() for r in lines]      # the other two within the second
    text = lines[0].getMessage()
    assert "ZeroDivisionError" in text and where.lower() in text.lower() and lines[0].exc_info is None
    assert "Traceback" not in caplog.text
