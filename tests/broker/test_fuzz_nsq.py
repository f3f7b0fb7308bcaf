"""Fuzz properties of the broker's NSQ side (issue 21, the harness that stays): the
parser, a connection fed arbitrary bytes, IDENTIFY negotiation, numbers, PUB_EXT
headers. The only outcomes allowed are a valid result or an FDQ error (``ProtocolError``,
``InvalidHeader``): never another exception type, never a hang. Derandomized and small
enough for every run; engine-independent, so in the sqlite pass only."""
from __future__ import annotations

import asyncio
import faulthandler
import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fdq
from fdq.broker import protocol as p
from fdq.broker.server import Broker
from fdq.errors import FDQError, InvalidHeader
from fdq.headers import validate_headers
from fdqtest import ON_FDB
from inprocess import run_conn

pytestmark = pytest.mark.skipif(ON_FDB, reason="engine-independent: run in the sqlite pass")

FUZZ = settings(derandomize=True, deadline=None, max_examples=100, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def hang_guard():
    """A property that hangs dumps every thread's stack instead of stalling the run."""
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# -- strategies ------------------------------------------------------------------------

def nested(n: int) -> bytes:
    return b"[" * n + b"]" * n


# sizes sampled, not drawn: derandomized draws stay small, and the bugs are at the far end
digit_floods = st.sampled_from([0, 1, 19, 20, 4301, 5000]).map(lambda n: b"9" * n)
hostile_numbers = st.one_of(
    st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.just(10 ** 4000), st.just(-(10 ** 30)),
    st.sampled_from([0, -1, 1, 999, 1000, 2 ** 63, -(2 ** 63) - 1, 1e400]))
json_values = st.recursive(
    st.none() | st.booleans() | hostile_numbers | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
IDENTIFY_KEYS = ["client_id", "short_id", "hostname", "long_id", "user_agent", "feature_negotiation",
                 "heartbeat_interval", "output_buffer_size", "output_buffer_timeout", "sample_rate", "msg_timeout",
                 "tls_v1", "snappy", "deflate", "deflate_level", "extend_support", "desired_tag"]
identify_dicts = st.dictionaries(st.sampled_from(IDENTIFY_KEYS) | st.text(max_size=8), json_values, max_size=8)


def dumps(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()     # NaN/Infinity literals too: not JSON, sent anyway


json_bodies = st.one_of(identify_dicts.map(dumps), json_values.map(dumps),
                        st.sampled_from([1, 2, 900, 5000]).map(nested), st.binary(max_size=40))
params = st.one_of(st.binary(max_size=12).map(lambda b: b.replace(b" ", b"").replace(b"\n", b"")), digit_floods,
                   st.sampled_from([b"t", b"ch", b"0123456789abcdef", b"-1", b"1e400", b"", b"t#ephemeral"]))
NAMES = [b"NOP", b"RDY", b"FIN", b"REQ", b"TOUCH", b"CLS", b"SUB", b"PUB", b"DPUB", b"MPUB", b"PUB_EXT",
         b"IDENTIFY", b"AUTH", b"BOGUS"]


@st.composite
def commands(draw) -> bytes:
    """One command-shaped frame: a name, parameters, and for the commands with a body a
    size and a body (sometimes a lying size)."""
    name = draw(st.sampled_from(NAMES))
    line = b" ".join([name, *draw(st.lists(params, max_size=3))]) + b"\n"
    if name not in (b"PUB", b"DPUB", b"MPUB", b"PUB_EXT", b"IDENTIFY", b"AUTH"):
        return line
    if name == b"PUB_EXT":
        header = draw(json_bodies)
        body = struct.pack(">H", len(header) & 0xFFFF) + header + draw(st.binary(max_size=8))
    elif name == b"MPUB":
        msgs = draw(st.lists(st.binary(min_size=1, max_size=8), max_size=3))
        body = struct.pack(">i", draw(st.sampled_from([len(msgs), 0, -1, 1 << 30]))) + \
            b"".join(struct.pack(">i", len(m)) + m for m in msgs)
    else:
        body = draw(json_bodies if name == b"IDENTIFY" else st.binary(max_size=16))
    size = draw(st.sampled_from([len(body), len(body), 0, -1, len(body) + 3, 1 << 31 - 1]))
    return line + struct.pack(">i", size) + body


identify_frames = json_bodies.map(lambda body: b"IDENTIFY\n" + struct.pack(">I", len(body)) + body)
number_lines = st.tuples(st.sampled_from([b"RDY", b"REQ 0123456789abcdef", b"DPUB t"]), digit_floods).map(
    lambda t: t[0] + b" " + t[1] + b"\n" + (struct.pack(">I", 1) + b"x" if t[0] == b"DPUB t" else b""))
conversations = st.lists(st.one_of(commands(), identify_frames, number_lines), min_size=1, max_size=5).map(b"".join)
streams = st.one_of(
    conversations,
    st.binary(max_size=200),
    st.lists(commands(), max_size=5).map(b"".join),
    st.tuples(st.lists(commands(), max_size=3), st.binary(max_size=30)).map(lambda t: b"".join(t[0]) + t[1]))


def outcome(item):
    """A parser item as comparable data."""
    if isinstance(item, p.ProtocolError):
        return ("error", str(item), item.fatal)
    return ("command", item.name, tuple(item.params), item.body, item.bodies, json.dumps(item.identify),
            json.dumps(item.ext))


# -- the parser ------------------------------------------------------------------------

@FUZZ
@given(st.booleans(), streams, st.lists(st.integers(1, 64), max_size=8))
def test_the_parser_yields_commands_or_protocol_errors_whatever_the_chunking(magic, data, cuts):
    data = (p.MAGIC_V2 if magic else b"") + data
    whole = p.Parser().feed(data)
    assert all(isinstance(i, (p.Command, p.ProtocolError)) for i in whole)
    assert all(isinstance(i, FDQError) for i in whole if not isinstance(i, p.Command))
    parser, pos, chunked = p.Parser(), 0, []
    for n in cuts + [len(data)]:
        chunked += parser.feed(data[pos:pos + n])
        pos += n
    chunked += parser.feed(data[pos:])
    assert [outcome(i) for i in chunked] == [outcome(i) for i in whole]


# -- numbers, IDENTIFY, PUB_EXT headers ------------------------------------------------

@FUZZ
@given(st.one_of(st.binary(max_size=30), digit_floods, st.integers(0, 10 ** 40).map(lambda n: str(n).encode())))
def test_parse_int_gives_a_number_or_e_invalid(raw):
    try:
        n = p.parse_int(raw, "RDY could not parse count")
    except p.ProtocolError as e:
        assert e.code == "E_INVALID" and e.fatal and len(str(e)) < 100
        return
    assert 0 <= n <= p.OVERFLOW


@FUZZ
@given(identify_dicts)
def test_negotiate_gives_an_identity_or_a_protocol_error(data):
    try:
        ident, resp = p.negotiate(data, p.Limits())
    except p.ProtocolError as e:
        assert e.code.startswith("E_") and len(str(e)) < 300
        return
    assert isinstance(ident, p.Identity) and isinstance(resp, bytes)
    assert resp == p.OK or isinstance(json.loads(resp), dict)


@FUZZ
@given(json_bodies)
def test_a_pub_ext_header_is_headers_or_an_fdq_error(header):
    """The TCP PUB_EXT header (parser, then the producer's validation) and /pub_ext?ext=
    (loads_json, then the same validation)."""
    items = p.Parser(expect_magic=False).feed(p.encode_pub_ext(b"t", header, b"m"))
    assert len(items) == 1
    item = items[0]
    if isinstance(item, p.ProtocolError):
        assert item.code in ("E_INVALID_JSON_HEADER", "E_BAD_MESSAGE")
    else:
        try:
            validate_headers(item.ext)
        except InvalidHeader:
            pass
    try:
        value = p.loads_json(header.decode("utf-8", "replace"))
    except ValueError:
        return
    if isinstance(value, dict):
        try:
            validate_headers(value)
        except InvalidHeader:
            pass


# -- a connection fed bytes (no socket) ------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A broker (not listening) on a fresh database, its event loop, and the
    unexpected failures it reports."""
    db = fdq.connect(f"sqlite://{tmp_path_factory.mktemp('fuzz') / 'fdq.db'}")
    broker = Broker(db)
    unexpected = []
    broker.unexpected = lambda conn, where, e: unexpected.append(f"{where}: {type(e).__name__}: {e}")
    loop = asyncio.new_event_loop()
    yield broker, loop, unexpected
    loop.run_until_complete(broker.close())
    loop.close()


@settings(FUZZ, max_examples=80)
@given(st.one_of(conversations, st.binary(max_size=100)))
def test_a_connection_answers_any_bytes_with_frames_and_no_unexpected_error(served, data):
    broker, loop, unexpected = served
    out, conn = loop.run_until_complete(run_conn(broker, p.MAGIC_V2 + data))
    assert unexpected == [], unexpected
    assert conn.closed
    if conn._codec is None:         # compressed after IDENTIFY: frames not readable as such
        buf = bytearray(out)
        frames = p.decode_frames(buf)
        assert not buf, "a partial frame was written"
        assert all(t in (p.FRAME_RESPONSE, p.FRAME_ERROR, p.FRAME_MESSAGE) for t, _ in frames)
