"""The NSQ V2 codec, fed bytes (no sockets)."""
import json
import struct

import pytest
from hypothesis import given, settings, strategies as st

from fdq.broker import protocol as p


def feed_all(parser, data, step=None):
    out = []
    if step is None:
        return parser.feed(data)
    for i in range(0, len(data), step):
        out += parser.feed(data[i:i + step])
    return out


def test_magic_then_commands_byte_by_byte():
    stream = (p.MAGIC_V2 + b"NOP\n" + p.encode_command(b"PUB", b"t", body=b"hello")
              + p.encode_mpub(b"t", [b"a", b"bb", b"\x00\n"]) + b"DPUB t 1500\n" + struct.pack(">I", 1) + b"x"
              + b"SUB t ch#ephemeral\r\n" + b"RDY 10\n" + b"FIN 0123456789abcdef\n" + b"REQ 0123456789abcdef 100\n"
              + b"TOUCH 0123456789abcdef\n" + b"CLS\n")
    for step in (1, 3, 7, len(stream)):
        cmds = feed_all(p.Parser(), stream, step)
        assert [c.name for c in cmds] == [b"NOP", b"PUB", b"MPUB", b"DPUB", b"SUB", b"RDY", b"FIN", b"REQ",
                                          b"TOUCH", b"CLS"]
        assert cmds[1].body == b"hello" and cmds[1].params == [b"t"]
        assert cmds[2].bodies == [b"a", b"bb", b"\x00\n"]
        assert cmds[3].params == [b"t", b"1500"] and cmds[3].body == b"x"
        assert cmds[4].params == [b"t", b"ch#ephemeral"]
        assert cmds[7].params == [b"0123456789abcdef", b"100"]


def test_partial_frame_stays_buffered():
    parser = p.Parser()
    data = p.MAGIC_V2 + p.encode_command(b"PUB", b"t", body=b"x" * 100)
    assert parser.feed(data[:-1]) == []
    assert parser.buffered > 0
    (cmd,) = parser.feed(data[-1:])
    assert cmd.body == b"x" * 100 and parser.buffered == 0


def test_wrong_magic_is_fatal_bad_protocol():
    parser = p.Parser()
    (err,) = parser.feed(b"  V1NOP\n")
    assert isinstance(err, p.ProtocolError) and err.code == "E_BAD_PROTOCOL" and err.fatal
    assert parser.dead and parser.feed(b"NOP\n") == []
    assert err.frame()[8:].startswith(b"E_BAD_PROTOCOL")


@pytest.mark.parametrize("data,code", [
    (b"BOGUS\n", "E_INVALID"),
    (b"PUB\n", "E_INVALID"),
    (b"PUB bad!topic\n", "E_BAD_TOPIC"),
    (b"PUB " + b"x" * 65 + b"\n", "E_BAD_TOPIC"),
    (b"PUB t\n" + struct.pack(">i", 0), "E_BAD_MESSAGE"),
    (b"PUB t\n" + struct.pack(">i", -5), "E_BAD_MESSAGE"),
    (b"PUB t\n" + struct.pack(">i", 2000), "E_BAD_MESSAGE"),
    (b"DPUB t\n", "E_INVALID"),
    (b"DPUB t abc\n", "E_INVALID"),
    (b"DPUB t# 10\n", "E_BAD_TOPIC"),
    (b"MPUB t\n" + struct.pack(">i", 0), "E_BAD_BODY"),
    (b"MPUB t\n" + struct.pack(">i", 10_000), "E_BAD_BODY"),
    (b"MPUB t\n" + struct.pack(">ii", 4, 0), "E_BAD_BODY"),
    (b"MPUB t\n" + struct.pack(">iii", 8, 1, 0), "E_BAD_MESSAGE"),
    (b"MPUB t\n" + struct.pack(">iii", 8, 1, 5000), "E_BAD_MESSAGE"),
    (b"MPUB t\n" + struct.pack(">iii", 9, 1, 5) + b"x", "E_BAD_MESSAGE"),
    (b"MPUB t\n" + struct.pack(">iii", 11, 1, 1) + b"xyz", "E_BAD_BODY"),
    (b"IDENTIFY\n" + struct.pack(">i", 3) + b"{x]", "E_BAD_BODY"),
    (b"IDENTIFY\n" + struct.pack(">i", 2) + b"[]", "E_BAD_BODY"),
    (b"AUTH x\n", "E_INVALID"),
    (b"AUTH\n" + struct.pack(">i", 0), "E_BAD_BODY"),
])
def test_fatal_errors(data, code):
    parser = p.Parser(max_msg_size=1024, max_body_size=4096)
    out = parser.feed(p.MAGIC_V2 + data)
    assert isinstance(out[-1], p.ProtocolError), out
    assert out[-1].code == code and out[-1].fatal, out[-1]


def test_line_too_long_is_fatal():
    parser = p.Parser()
    (err,) = parser.feed(p.MAGIC_V2 + b"PUB " + b"x" * (p.MAX_LINE + 10))
    assert err.code == "E_INVALID" and err.fatal


def test_pub_ext_json_header_and_bad_json_is_not_fatal():
    parser = p.Parser()
    good = p.encode_pub_ext(b"t", b'{"##client_dispatch_tag":"a","k":1}', b"body")
    bad = p.encode_pub_ext(b"t", b"{nope", b"body")
    out = parser.feed(p.MAGIC_V2 + good + bad + b"NOP\n")
    assert out[0].ext == {"##client_dispatch_tag": "a", "k": 1} and out[0].body == b"body"
    assert out[1].code == "E_INVALID_JSON_HEADER" and not out[1].fatal
    assert out[2].name == b"NOP"


def test_frames_and_messages_round_trip():
    mid = b"0123456789abcdef"
    buf = bytearray(p.response() + p.message(123, 2, mid, b"body") + p.ProtocolError("E_INVALID", "x").frame()
                    + p.message(5, 1, mid, b"b2", ext=b'{"a":1}'))
    (t0, d0), (t1, d1), (t2, d2), (t3, d3) = p.decode_frames(buf)
    assert (t0, d0) == (p.FRAME_RESPONSE, b"OK")
    assert t1 == p.FRAME_MESSAGE and p.decode_message(d1) == (123, 2, mid, b"body", None)
    assert (t2, d2) == (p.FRAME_ERROR, b"E_INVALID x")
    assert p.decode_message(d3, ext=True) == (5, 1, mid, b"b2", b'{"a":1}')
    with pytest.raises(ValueError):
        p.message(1, 1, b"short", b"")


def test_identify_negotiation():
    limits = p.Limits()
    ident, resp = p.negotiate({"feature_negotiation": True, "heartbeat_interval": 5000, "msg_timeout": 2000,
                               "deflate": True, "deflate_level": 9, "sample_rate": 10,
                               "client_id": "c", "output_buffer_timeout": -1}, limits)
    assert ident.heartbeat_interval_ms == 5000 and ident.msg_timeout_ms == 2000 and ident.deflate
    r = json.loads(resp)
    assert r["max_rdy_count"] == 2500 and r["msg_timeout"] == 2000 and r["deflate_level"] == 6
    assert r["deflate"] is True and r["tls_v1"] is False and r["auth_required"] is False
    assert r["sample_rate"] == 10 and r["max_msg_timeout"] == 15 * 60_000
    ident, resp = p.negotiate({}, limits)
    assert resp == b"OK" and ident.heartbeat_interval_ms == 30_000 and ident.msg_timeout_ms == 60_000
    ident, _ = p.negotiate({"heartbeat_interval": -1}, limits)
    assert ident.heartbeat_interval_ms == 0
    for bad in ({"heartbeat_interval": 10}, {"heartbeat_interval": 10**9}, {"msg_timeout": 5},
                {"sample_rate": 100}, {"output_buffer_size": 1}, {"msg_timeout": "x"},
                {"desired_tag": "bad tag!"}):
        with pytest.raises(p.ProtocolError) as e:
            p.negotiate(bad, limits)
        assert e.value.code == "E_BAD_BODY" and e.value.fatal


def test_identify_both_compressions_conflict_only_when_both_are_offered():
    both = {"feature_negotiation": True, "snappy": True, "deflate": True}
    with pytest.raises(p.ProtocolError) as e:
        p.negotiate(both, p.Limits())
    assert e.value.code == "E_IDENTIFY_FAILED" and e.value.fatal
    # as nsqd: a broker without snappy (no cramjam, --no-snappy) gives deflate
    ident, resp = p.negotiate(both, p.Limits(snappy=False))
    assert ident.deflate and not ident.snappy and json.loads(resp)["deflate"] is True


def test_names():
    assert p.valid_name(b"a.b-c_d") and p.valid_name(b"x" * 64) and p.valid_name(b"ch#ephemeral")
    assert not p.valid_name(b"") and not p.valid_name(b"x" * 65) and not p.valid_name(b"a b")
    assert not p.valid_name(b"a#b")
    assert not p.valid_name(b"abc\n") and not p.valid_name(b"ch#ephemeral\n")    # Go's $ is end of text


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"PUB t\n", b"MPUB t\n", b"IDENTIFY\n", b"DPUB t 5\n", b"PUB_EXT t\n", b"SUB a b\n",
                     b"AUTH\n", b"\x00\x00\x00\x05", b"\xff\xff\xff\xff", b"\x00\x00\x00\x02{}"]),
), max_size=20), st.booleans(), st.integers(1, 9))
def test_fuzz_parser_never_crashes(chunks, magic, step):
    parser = p.Parser(max_msg_size=256, max_body_size=1024)
    data = (p.MAGIC_V2 if magic else b"") + b"".join(chunks)
    for item in feed_all(parser, data, step):
        assert isinstance(item, (p.Command, p.ProtocolError))


def test_snappy_codec_streams_in_any_split():
    snappy = pytest.importorskip("snappy", reason="python-snappy is not installed (pip install -e '.[test]')")
    from fdq.broker.compress import Snappy
    # client -> broker: a fresh stream identifier per command (pynsq's encoder), any split
    data = b"".join(snappy.StreamCompressor().compress(c) for c in
                    (b"NOP\n", b"PUB t\n\x00\x00\x01\x00" + bytes(range(256)), b"y" * 200_000))
    plain = b"NOP\n" + b"PUB t\n\x00\x00\x01\x00" + bytes(range(256)) + b"y" * 200_000
    for step in (1, 7, 4096, len(data)):
        d = Snappy()
        out = b"".join(d.decompress(data[i:i + step]) for i in range(0, len(data), step))
        assert out == plain, step
    # broker -> client: one stream, readable by python-snappy's decoder in any split
    c = Snappy()
    stream = c.compress(b"first") + c.compress(b"second" * 20_000)
    dec = snappy.StreamDecompressor()
    assert b"".join(dec.decompress(stream[i:i + 5]) for i in range(0, len(stream), 5)) == \
        b"first" + b"second" * 20_000
    # corrupt input is a ValueError (the connection sends E_INVALID and closes)
    bad = bytearray(snappy.StreamCompressor().compress(b"abcdef" * 10))
    bad[14] ^= 0xFF                           # inside the chunk's CRC
    with pytest.raises(ValueError):
        Snappy().decompress(bytes(bad))
    with pytest.raises(ValueError):
        Snappy().decompress(b"\x00\x09\x00\x00\x00\x00\x00\x00hello")    # no stream identifier


def test_output_buffer_negotiation():
    limits = p.Limits()
    ident, _ = p.negotiate({"output_buffer_size": 64, "output_buffer_timeout": 25}, limits)
    assert (ident.output_buffer_size, ident.output_buffer_timeout_ms) == (64, 25)
    ident, _ = p.negotiate({"output_buffer_size": -1, "output_buffer_timeout": 500}, limits)
    assert (ident.output_buffer_size, ident.output_buffer_timeout_ms) == (1, 0)
    ident, _ = p.negotiate({"output_buffer_timeout": -1}, limits)
    assert (ident.output_buffer_size, ident.output_buffer_timeout_ms) == (16 * 1024, 0)
    for bad in (63, 64 * 1024 + 1):
        with pytest.raises(p.ProtocolError, match=rf"IDENTIFY output buffer size \({bad}\) is invalid"):
            p.negotiate({"output_buffer_size": bad}, limits)
    for bad in (24, 30_001):
        with pytest.raises(p.ProtocolError, match=rf"IDENTIFY output buffer timeout \({bad}\) is invalid"):
            p.negotiate({"output_buffer_timeout": bad}, limits)


def test_parse_int_as_nsqd():
    """nsqd's ByteToBase10 (RDY count, REQ and DPUB timeouts): digits only, no sign,
    and an empty parameter is 0 (RDY took a sign, and refused an empty one)."""
    assert p.parse_int(b"1500", "x") == 1500
    assert p.parse_int(b"", "x") == 0
    for raw in (b"-1", b"+1", b"1x", b" 1"):
        with pytest.raises(p.ProtocolError, match="E_INVALID"):
            p.parse_int(raw, "REQ could not parse timeout")
    with pytest.raises(p.ProtocolError, match="E_INVALID RDY could not parse count -1"):
        p.parse_int(b"-1", "RDY could not parse count")


def test_names_in_errors_are_quoted_as_go():
    assert p.go_quote(b"a*b") == '"a*b"'
    assert p.go_quote(b'a"b\\c\n\x01') == '"a\\"b\\\\c\\n\\x01"'


def test_e2e_quantile_result():
    from fdq.broker.quantile import MAX_SAMPLES, Quantile, result
    q = Quantile((1.0, 0.5, 0.99), window_s=600)
    for v in range(1, 101):
        q.add(v)
    r = result(q.percentiles, [q.samples()])
    assert r == {"count": 100, "percentiles": [{"quantile": 1.0, "value": 100.0}, {"quantile": 0.5, "value": 50.0},
                                               {"quantile": 0.99, "value": 99.0}]}
    assert result((), [q.samples()]) == {"count": 0, "percentiles": None}
    off = Quantile((), 600)
    off.add(5)
    assert off.samples() == (0, [])
    big = Quantile((0.5,), 600)
    for v in range(3 * MAX_SAMPLES):
        big.add(v)
    count, samples = big.samples()
    assert count == 3 * MAX_SAMPLES and len(samples) == MAX_SAMPLES     # bounded memory, exact count
