"""Fuzz properties of the broker's HTTP side (issue 21, the harness that stays): the
request head parser, the chunked body reader, and a whole request served. The only
outcomes allowed are a request, or an answer with one of nsqd's statuses (400, 413, 431
for what cannot be read; 500 with one log line for a handler's failure): never another
exception type, never a hang. Derandomized, small; in the sqlite pass only."""
from __future__ import annotations

import asyncio
import faulthandler
from urllib.parse import quote_from_bytes

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fdq
from fdq.broker.http import HTTPError, HTTPServer, MAX_HEADER_BYTES, parse_head
from fdq.broker.server import Broker
from fdqtest import ON_FDB
from inprocess import Writer, reader_of

pytestmark = pytest.mark.skipif(ON_FDB, reason="engine-independent: run in the sqlite pass")

FUZZ = settings(derandomize=True, deadline=None, max_examples=100, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
LIMIT = 5 * 1024 * 1024


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# -- strategies ------------------------------------------------------------------------

ROUTES = ["/ping", "/info", "/stats", "/metrics", "/pub", "/mpub", "/pub_ext", "/topic/create", "/topic/delete",
          "/topic/empty", "/topic/pause", "/topic/unpause", "/channel/create", "/channel/delete", "/channel/empty",
          "/channel/pause", "/channel/unpause", "/nope"]
# sizes sampled, not drawn: derandomized draws stay small, and the bugs are at the far end
floods = st.sampled_from([1, 19, 20, 4301]).map(lambda n: "9" * n)
lengths = st.one_of(floods, st.sampled_from(["", "0", "5", "007", "+5", "-1", " 12 ", "0x10", "1e3", "\xb2", "\u0663",
                                             "9223372036854775807", "9223372036854775808", "5242881"]),
                    st.text(max_size=6))
query_values = st.one_of(floods, st.text(max_size=8), st.sampled_from(
    ["t", "ch", "true", "1", "-1", "[" * 3000 + "]" * 3000, '{"a": NaN}', '{"a": [1, {"b": 1e400}]}',
     '{"##client_dispatch_tag": "x"}', "%", "\x00"]))
queries = st.dictionaries(st.sampled_from(["topic", "channel", "defer", "ext", "binary", "format", "extend",
                                           "include_clients"]), query_values, max_size=4).map(
    lambda q: "&".join(f"{k}={quote_from_bytes(v.encode('utf-8', 'surrogatepass'))}" for k, v in q.items()))
targets = st.one_of(
    st.tuples(st.sampled_from(ROUTES), queries).map(lambda t: f"{t[0]}?{t[1]}" if t[1] else t[0]),
    st.sampled_from(["//[::1/ping", "http://[/x", "*", "", "/ping?" + "a=1&" * 100]),
    st.text(max_size=20))
header_lines = st.lists(st.one_of(
    lengths.map(lambda v: f"Content-Length: {v}"),
    st.sampled_from(["Transfer-Encoding: chunked", "Transfer-Encoding: gzip, chunked", "Expect: 100-continue",
                     "Connection: close", "Connection: keep-alive", "X-Nsqext-Region: eu", "X-Nsqext-##trace_id: 12",
                     "no colon here", ": empty name"]),
    st.text(max_size=20)), max_size=5)


@st.composite
def heads(draw, body: bytes | None = None) -> bytes:
    """A request head; with ``body``, most often with its true Content-Length."""
    method = draw(st.sampled_from(["POST", "GET", "POST", "PUT", "", "G ET"]))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "", "HTTP/9"]))
    lines = [f"{method} {draw(targets)} {version}", *draw(header_lines)]
    if body is not None and draw(st.integers(0, 3)):
        lines.append(f"Content-Length: {len(body)}")
    return "\r\n".join(lines).encode("utf-8", "surrogatepass") + b"\r\n\r\n"


@st.composite
def requests(draw) -> bytes:
    body = draw(st.one_of(st.binary(max_size=64), st.sampled_from([b"m", b"a\nb\n", b"\x00\x00\x00\x01\x00\x00\x00\x01x"])))
    return draw(heads(body)) + body


# -- the head parser -------------------------------------------------------------------

@FUZZ
@given(st.one_of(heads(), st.binary(max_size=200).map(lambda b: b + b"\r\n\r\n")))
def test_a_request_head_is_a_head_or_a_400_413_431(raw):
    try:
        head = parse_head(raw, LIMIT)
    except HTTPError as e:
        assert (e.status, e.message) in {(400, "INVALID_REQUEST"), (413, "MSG_TOO_BIG"), (413, "BODY_TOO_BIG"),
                                         (431, "HEADER_TOO_BIG")}
        return
    assert 0 <= head.length <= LIMIT and isinstance(head.headers, dict) and isinstance(head.path, str)


def test_a_head_over_the_header_limit_is_431():
    with pytest.raises(HTTPError) as info:
        parse_head(b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_HEADER_BYTES + b"\r\n\r\n", LIMIT)
    assert info.value.status == 431


# -- the chunked body reader -----------------------------------------------------------

chunk_sizes = st.one_of(st.integers(0, 40).map(lambda n: b"%x" % n), st.sampled_from(
    [b"", b"-1", b"ff" * 20, b"1_0", b"0x5", b" 3 ", b"3;ext=1", b"\xb2", b"g"]), st.binary(max_size=6))
chunked_bodies = st.lists(st.tuples(chunk_sizes, st.binary(max_size=40), st.sampled_from([b"\r\n", b"", b"xx"])),
                          max_size=4).map(lambda parts: b"".join(s + b"\r\n" + d + end for s, d, end in parts))


@FUZZ
@given(st.one_of(chunked_bodies, chunked_bodies.map(lambda b: b + b"0\r\n\r\n"), st.binary(max_size=100)))
def test_a_chunked_body_is_bytes_or_refused_or_ends_with_the_connection(data):
    writer = Writer()

    async def read():
        return await HTTPServer(None)._read_chunked(reader_of(data), writer, 100)
    try:
        body = asyncio.run(asyncio.wait_for(read(), 10))
    except asyncio.IncompleteReadError:
        assert not writer.data          # the client went away mid-body: nothing to answer
        return
    if body is None:
        status = int(bytes(writer.data).split(b" ")[1])
        assert status in (400, 413)
    else:
        assert isinstance(body, bytes) and len(body) <= 100 and not writer.data


# -- a whole request served ------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The HTTP side of a broker (not listening) on a fresh database, its event loop,
    and the lines it logs for unexpected failures."""
    db = fdq.connect(f"sqlite://{tmp_path_factory.mktemp('fuzz') / 'fdq.db'}")
    broker = Broker(db)
    unexpected = []
    broker.log_limiter.warning = lambda kind, msg, *args: unexpected.append(msg % args)
    loop = asyncio.new_event_loop()
    yield HTTPServer(broker), loop, unexpected
    loop.run_until_complete(broker.close())
    loop.close()


STATUSES = {200, 400, 401, 403, 404, 405, 413, 431, 500}


@settings(FUZZ, max_examples=100)
@given(requests())
def test_any_request_is_answered_with_an_nsqd_status_and_no_unexpected_error(served, request):
    http, loop, unexpected = served
    writer = Writer()

    async def serve():
        await asyncio.wait_for(http._serve(reader_of(request), writer), 20)
    loop.run_until_complete(serve())
    assert unexpected == [], unexpected
    out = bytes(writer.data)
    head, _, body = request.partition(b"\r\n\r\n")
    try:
        parsed = parse_head(head + b"\r\n\r\n", LIMIT)
    except HTTPError as e:
        assert out.startswith(b"HTTP/1.1 %d " % e.status), out[:300]
    else:
        if not parsed.chunked and parsed.length <= len(body):   # all of it sent: it is answered
            assert out.startswith(b"HTTP/1.1 "), (request[:300], out[:300])
    for answer in out.split(b"HTTP/1.1 ")[1:]:
        status = int(answer.split(b" ", 1)[0])
        assert status in STATUSES or status == 100, out[:300]
        if status == 500:
            assert b"INTERNAL_ERROR" in answer
