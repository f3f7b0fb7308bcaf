"""NSQ TCP protocol V2, as nsqd speaks it: a pure codec, no I/O.

``Parser.feed(bytes)`` returns the complete ``Command``s received so far (partial
frames stay buffered); a malformed frame yields a ``ProtocolError`` item and, if it is
fatal (as nsqd's ``FatalClientErr``), the parser stops: the server sends the error
frame and closes. Encoders build response, error and message frames.

Frames (server -> client): ``[size uint32][type uint32][data]``, size = 4 + len(data);
type 0 response, 1 error, 2 message. A message's data is ``[timestamp ns int64]
[attempts uint16][16-byte id][body]``; extend messages (youzan's PUB_EXT extension) add
``[ext version uint8][ext len uint16][ext data]`` before the body (version 4: JSON).
"""
from __future__ import annotations

import json
import math
import re
import reprlib
import struct
from dataclasses import dataclass

from ..errors import FDQError

MAGIC_V2 = b"  V2"
FRAME_RESPONSE, FRAME_ERROR, FRAME_MESSAGE = 0, 1, 2
HEARTBEAT = b"_heartbeat_"
OK = b"OK"
CLOSE_WAIT = b"CLOSE_WAIT"
EXT_VERSION_JSON = 4
MSG_ID_LEN = 16
MAX_LINE = 64 * 1024
# Topic/channel names (nsqd's protocol.IsValidTopicName / IsValidChannelName).
NAME_RE = re.compile(rb"^[.a-zA-Z0-9_-]+(#ephemeral)?$")

_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")
_U16 = struct.Struct(">H")
_FRAME_HDR = struct.Struct(">Ii")
_MSG_HDR = struct.Struct(">qH")
# a whole message frame's head: [size][type 2][timestamp ns][attempts], then id and body
MESSAGE_HEAD = struct.Struct(">IiqH")

# nsqd's defaults (nsqd/options.go)
DEFAULTS = {
    "msg_timeout_ms": 60_000,
    "max_msg_timeout_ms": 15 * 60_000,
    "max_msg_size": 1024 * 1024,
    "max_body_size": 5 * 1024 * 1024,
    "max_rdy_count": 2500,
    "max_heartbeat_interval_ms": 60_000,
    "max_req_timeout_ms": 60 * 60_000,
    "heartbeat_interval_ms": 30_000,
    "output_buffer_size": 16 * 1024,
    "max_output_buffer_size": 64 * 1024,
    "output_buffer_timeout_ms": 250,
    "min_output_buffer_timeout_ms": 25,
    "max_output_buffer_timeout_ms": 30_000,
    "max_deflate_level": 6,
}


class ProtocolError(FDQError):
    """A client error as nsqd reports it: ``code`` (``E_INVALID``, ...), a description,
    and whether it is fatal (the connection is closed after the error frame)."""

    def __init__(self, code: str, desc: str = "", fatal: bool = True):
        self.code = code
        self.desc = desc
        self.fatal = fatal
        super().__init__(f"{code} {desc}".strip())

    def frame(self) -> bytes:
        return frame(FRAME_ERROR, str(self).encode())


def fatal(code, desc=""):
    return ProtocolError(code, desc, True)


def nonfatal(code, desc=""):
    return ProtocolError(code, desc, False)


class Command:
    """One client command: ``name`` (bytes, e.g. b"PUB"), ``params`` (the line's other
    words), and its decoded payload: ``body`` (PUB, DPUB, AUTH), ``bodies`` (MPUB),
    ``identify`` (dict), ``ext`` (PUB_EXT's JSON header, dict)."""

    __slots__ = ("name", "params", "body", "bodies", "identify", "ext")

    def __init__(self, name: bytes, params: list | None = None, body: bytes | None = None):
        self.name = name
        self.params = [] if params is None else params
        self.body = body
        self.bodies = None
        self.identify = None
        self.ext = None

    def __repr__(self):
        return f"Command({self.name!r}, {self.params!r})"


def valid_name(name: bytes) -> bool:
    return 1 <= len(name) <= 64 and NAME_RE.fullmatch(name) is not None     # "$" would let "a\n" by


def frame(frame_type: int, data: bytes) -> bytes:
    return _FRAME_HDR.pack(len(data) + 4, frame_type) + data


def response(data: bytes = OK) -> bytes:
    return frame(FRAME_RESPONSE, data)


def message(ts_ns: int, attempts: int, msg_id: bytes, body: bytes, ext: bytes | None = None) -> bytes:
    """A message frame; ``ext`` (JSON bytes) makes it an extend message (version 4)."""
    if len(msg_id) != MSG_ID_LEN:
        raise ValueError(f"message id must be {MSG_ID_LEN} bytes, not {len(msg_id)}")
    head = _MSG_HDR.pack(ts_ns, min(attempts, 0xFFFF)) + msg_id
    if ext is not None:
        head += bytes([EXT_VERSION_JSON]) + _U16.pack(len(ext)) + ext
    return frame(FRAME_MESSAGE, head + body)


def trace_response(fdq_id: str, trace_id, size: int) -> bytes:
    """youzan's PUB_EXT answer when the header has ``##trace_id``: ``OK`` + [8-byte id]
    + [8-byte trace id] + [8-byte queue offset] + [4-byte size]. FDQ's 12-byte id is
    split: its first 8 bytes (the commit version) as the id, its last 4 (batch order
    and index in the batch) as the offset; a trace id that is not a number is sent as 0."""
    raw = bytes.fromhex(fdq_id)
    try:
        trace = int(trace_id) & 0xFFFFFFFFFFFFFFFF
    except (TypeError, ValueError):
        trace = 0
    return b"OK" + raw[:8] + trace.to_bytes(8, "big") + int.from_bytes(raw[8:], "big").to_bytes(8, "big") \
        + _U32.pack(size)


# -- client side (tests, bench) ------------------------------------------------------

def encode_command(name: bytes, *params, body: bytes | None = None) -> bytes:
    line = b" ".join([name, *[p if isinstance(p, bytes) else str(p).encode() for p in params]]) + b"\n"
    if body is None:
        return line
    return line + _U32.pack(len(body)) + body


def encode_mpub(topic: bytes, bodies: list) -> bytes:
    payload = _U32.pack(len(bodies)) + b"".join(_U32.pack(len(b)) + b for b in bodies)
    return b"MPUB " + topic + b"\n" + _U32.pack(len(payload)) + payload


def encode_pub_ext(topic: bytes, header: bytes, body: bytes) -> bytes:
    payload = _U16.pack(len(header)) + header + body
    return b"PUB_EXT " + topic + b"\n" + _U32.pack(len(payload)) + payload


def decode_frames(buf: bytearray) -> list:
    """Pop complete frames [(type, data)] from ``buf`` (a client's reader)."""
    out = []
    while len(buf) >= 8:
        size, ftype = _FRAME_HDR.unpack_from(buf)
        if len(buf) < 4 + size:
            break
        out.append((ftype, bytes(buf[8:4 + size])))
        del buf[:4 + size]
    return out


def decode_message(data: bytes, ext: bool = False) -> tuple:
    """(ts_ns, attempts, id, body, ext_json_or_None) of a message frame's data."""
    ts, attempts = _MSG_HDR.unpack_from(data)
    mid = data[10:26]
    if not ext:
        return ts, attempts, mid, data[26:], None
    n = _U16.unpack_from(data, 27)[0]
    return ts, attempts, mid, data[29 + n:], data[29:29 + n]


# -- server side ---------------------------------------------------------------------

_NO_BODY = {b"SUB", b"RDY", b"FIN", b"REQ", b"TOUCH", b"CLS", b"NOP"}
_KNOWN = _NO_BODY | {b"IDENTIFY", b"AUTH", b"PUB", b"MPUB", b"DPUB", b"PUB_EXT"}


class Parser:
    """Incremental parser of a client's byte stream (magic first).

    ``max_msg_size`` bounds one message body (PUB, DPUB, PUB_EXT, each MPUB message);
    ``max_body_size`` bounds an MPUB body and IDENTIFY/AUTH bodies. After a fatal error
    the parser is ``dead`` and ignores further input."""

    def __init__(self, *, max_msg_size: int = DEFAULTS["max_msg_size"],
                 max_body_size: int = DEFAULTS["max_body_size"], expect_magic: bool = True,
                 max_req_timeout_ms: int = DEFAULTS["max_req_timeout_ms"]):
        self.max_msg_size = max_msg_size
        self.max_req_timeout_ms = max_req_timeout_ms
        self.max_body_size = max_body_size
        self._buf = bytearray()
        self._need_magic = expect_magic
        self._pending = None     # a Command whose body we are waiting for
        self._pos = 0            # parse offset in _buf during feed()
        self.dead = False

    def feed(self, data: bytes) -> list:
        """Append ``data``; return [Command | ProtocolError] in order."""
        if self.dead:
            return []
        buf = self._buf
        buf += data
        self._pos = 0            # parse by offset; consumed bytes are dropped once, at the end
        out = []
        try:
            while not self.dead:
                try:
                    item = self._next()
                except ProtocolError as e:
                    out.append(e)
                    if e.fatal:
                        self.dead = True
                    continue
                if item is None:
                    break
                out.append(item)
        finally:
            if self.dead:
                buf.clear()
            elif self._pos:
                del buf[:self._pos]
            self._pos = 0
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def _next(self):
        buf = self._buf
        pos = self._pos
        if self._need_magic:
            if len(buf) - pos < 4:
                return None
            magic = bytes(buf[pos:pos + 4])
            self._pos = pos = pos + 4
            if magic != MAGIC_V2:
                raise fatal("E_BAD_PROTOCOL", f"bad protocol magic {magic!r}")
            self._need_magic = False
        if self._pending is None:
            nl = buf.find(b"\n", pos)
            if nl < 0:
                if len(buf) - pos > MAX_LINE:
                    raise fatal("E_INVALID", f"command line longer than {MAX_LINE} bytes")
                return None
            end = nl - 1 if nl > pos and buf[nl - 1] == 13 else nl     # a trailing \r
            parts = bytes(buf[pos:end]).split(b" ")
            self._pos = nl + 1
            cmd = Command(parts[0], parts[1:])
            if cmd.name in _NO_BODY:
                return cmd
            self._check_line(cmd)
            self._pending = cmd
        return self._read_body(self._pending)

    def _check_line(self, cmd: Command):
        name, p = cmd.name, cmd.params
        if name not in _KNOWN:
            raise fatal("E_INVALID", f"invalid command {name.decode('utf-8', 'replace')}")
        if name in (b"PUB", b"MPUB", b"PUB_EXT"):
            if len(p) < 1:
                raise fatal("E_INVALID", f"{name.decode()} insufficient number of parameters")
            if not valid_name(p[0]):
                raise fatal("E_BAD_TOPIC", f"{name.decode()} topic name {go_quote(p[0])} is not valid")
        elif name == b"DPUB":
            if len(p) < 2:
                raise fatal("E_INVALID", "DPUB insufficient number of parameters")
            if not valid_name(p[0]):
                raise fatal("E_BAD_TOPIC", f"DPUB topic name {go_quote(p[0])} is not valid")
            ms = parse_int(p[1], "DPUB could not parse timeout")
            if ms < 0 or ms > self.max_req_timeout_ms:
                raise fatal("E_INVALID", f"DPUB timeout {shown(p[1].lstrip(b'0') or b'0')} out of range "
                                         f"0-{self.max_req_timeout_ms}")
        elif name == b"AUTH" and len(p) != 0:
            raise fatal("E_INVALID", "AUTH invalid number of parameters")

    def _read_body(self, cmd: Command):
        buf = self._buf
        pos = self._pos
        if len(buf) - pos < 4:
            return None
        size = _I32.unpack_from(buf, pos)[0]
        name = cmd.name
        what = name.decode()
        if name in (b"PUB", b"DPUB", b"PUB_EXT"):
            if size <= 0:
                raise fatal("E_BAD_MESSAGE", f"{what} invalid message body size {size}")
            limit = self.max_msg_size + (2 + 65535 if name == b"PUB_EXT" else 0)
            if size > limit:
                raise fatal("E_BAD_MESSAGE", f"{what} message too big {size} > {self.max_msg_size}")
        elif name == b"MPUB":
            if size <= 0:
                raise fatal("E_BAD_BODY", f"MPUB invalid body size {size}")
            if size > self.max_body_size:
                raise fatal("E_BAD_BODY", f"MPUB body too big {size} > {self.max_body_size}")
        else:  # IDENTIFY, AUTH
            if size <= 0:
                raise fatal("E_BAD_BODY", f"{what} invalid body size {size}")
            if size > self.max_body_size:
                raise fatal("E_BAD_BODY", f"{what} body too big {size} > {self.max_body_size}")
        if len(buf) - pos < 4 + size:
            return None
        body = bytes(buf[pos + 4:pos + 4 + size])
        self._pos = pos + 4 + size
        self._pending = None
        if name == b"MPUB":
            cmd.bodies = self._split_mpub(body)
        elif name == b"IDENTIFY":
            try:
                data = loads_json(body)
            except ValueError:
                raise fatal("E_BAD_BODY", "IDENTIFY failed to decode JSON body") from None
            if not isinstance(data, dict):
                raise fatal("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
            cmd.identify = data
        elif name == b"PUB_EXT":
            cmd.ext, cmd.body = self._split_ext(body)
        else:
            cmd.body = body
        return cmd

    def _split_mpub(self, body: bytes) -> list:
        if len(body) < 4:
            raise fatal("E_BAD_BODY", "MPUB failed to read message count")
        n = _I32.unpack_from(body)[0]
        if n <= 0:
            raise fatal("E_BAD_BODY", f"MPUB invalid message count {n}")
        pos, out = 4, []
        for i in range(n):
            if pos + 4 > len(body):
                raise fatal("E_BAD_MESSAGE", f"MPUB failed to read message({i}) body size")
            size = _I32.unpack_from(body, pos)[0]
            pos += 4
            if size <= 0:
                raise fatal("E_BAD_MESSAGE", f"MPUB invalid message({i}) body size {size}")
            if size > self.max_msg_size:
                raise fatal("E_BAD_MESSAGE", f"MPUB message too big {size} > {self.max_msg_size}")
            if pos + size > len(body):
                raise fatal("E_BAD_MESSAGE", "MPUB failed to read message body")
            out.append(body[pos:pos + size])
            pos += size
        if pos != len(body):
            raise fatal("E_BAD_BODY", f"MPUB body has {len(body) - pos} bytes after {n} messages")
        return out

    def _split_ext(self, body: bytes) -> tuple:
        if len(body) < 2:
            raise fatal("E_BAD_MESSAGE", "PUB_EXT failed to read header length")
        n = _U16.unpack_from(body)[0]
        if 2 + n > len(body):
            raise fatal("E_BAD_MESSAGE", "PUB_EXT header length exceeds the body")
        raw, msg = body[2:2 + n], body[2 + n:]
        if len(msg) > self.max_msg_size:
            raise fatal("E_BAD_MESSAGE", f"PUB_EXT message too big {len(msg)} > {self.max_msg_size}")
        if not msg:
            raise fatal("E_BAD_MESSAGE", "PUB_EXT invalid message body size 0")
        if not raw:
            return {}, msg
        try:
            ext = loads_json(raw)
        except ValueError:
            raise nonfatal("E_INVALID_JSON_HEADER", "PUB_EXT header is not valid JSON") from None
        if not isinstance(ext, dict):
            raise nonfatal("E_INVALID_JSON_HEADER", "PUB_EXT header must be a JSON object")
        return ext, msg


# -- IDENTIFY negotiation ------------------------------------------------------------

@dataclass
class Limits:
    """The broker's limits (nsqd's flags), in milliseconds and bytes."""

    msg_timeout_ms: int = DEFAULTS["msg_timeout_ms"]
    max_msg_timeout_ms: int = DEFAULTS["max_msg_timeout_ms"]
    max_msg_size: int = DEFAULTS["max_msg_size"]
    max_body_size: int = DEFAULTS["max_body_size"]
    max_rdy_count: int = DEFAULTS["max_rdy_count"]
    max_heartbeat_interval_ms: int = DEFAULTS["max_heartbeat_interval_ms"]
    max_req_timeout_ms: int = DEFAULTS["max_req_timeout_ms"]
    heartbeat_interval_ms: int = DEFAULTS["heartbeat_interval_ms"]
    max_output_buffer_size: int = DEFAULTS["max_output_buffer_size"]
    output_buffer_timeout_ms: int = DEFAULTS["output_buffer_timeout_ms"]
    min_output_buffer_timeout_ms: int = DEFAULTS["min_output_buffer_timeout_ms"]
    max_output_buffer_timeout_ms: int = DEFAULTS["max_output_buffer_timeout_ms"]
    max_deflate_level: int = DEFAULTS["max_deflate_level"]
    tls: bool = False
    tls_required: bool = False
    deflate: bool = True
    snappy: bool = True
    auth_required: bool = False
    version: str = "1.3.0"


@dataclass
class Identity:
    """What a client negotiated with IDENTIFY."""

    client_id: str = ""
    hostname: str = ""
    user_agent: str = ""
    heartbeat_interval_ms: int = DEFAULTS["heartbeat_interval_ms"]
    msg_timeout_ms: int = DEFAULTS["msg_timeout_ms"]
    output_buffer_size: int = DEFAULTS["output_buffer_size"]
    output_buffer_timeout_ms: int = DEFAULTS["output_buffer_timeout_ms"]
    sample_rate: int = 0
    feature_negotiation: bool = False
    tls_v1: bool = False
    deflate: bool = False
    deflate_level: int = 6
    snappy: bool = False
    extend_support: bool = False
    desired_tag: str | None = None


def loads_json(raw):
    """JSON as Go's ``encoding/json`` (nsqd) reads it, bounded: ``ValueError`` for text
    that is not JSON, not UTF-8, ``NaN``/``Infinity`` (not JSON; Python's reader takes
    them), an integer of over 4,300 digits, or nesting deeper than the interpreter's
    recursion limit (``json`` raised RecursionError, which escaped every handler)."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40


def shown(value) -> str:
    """``value`` in an error text, bounded (a client chooses it: a 5,000-digit number, a
    list nested 900 deep)."""
    if isinstance(value, bytes):
        text = value.decode("utf-8", "replace")
        return text if len(text) <= 32 else text[:32] + "..."
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"a {value.bit_length()}-bit number"
    try:
        text = _repr.repr(value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__}"
    return text if len(text) <= 64 else text[:64] + "..."


def clip(text: str, limit: int = 200) -> str:
    """``text`` for a log line: at most ``limit`` characters, on one line."""
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit] + "..."


_INT64 = 1 << 63


def _int(d, key, default):
    """An integer field of IDENTIFY: a JSON number that is finite and within int64 (a
    Go ``int``; ``1e400`` is inf here, and ``int(inf)`` raised OverflowError)."""
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise fatal("E_BAD_BODY", f"IDENTIFY {key} must be a number, not {shown(v)}")
    if isinstance(v, float) and not math.isfinite(v):
        raise fatal("E_BAD_BODY", f"IDENTIFY {key} must be a finite number, not {shown(v)}")
    if not -_INT64 <= v < _INT64:
        raise fatal("E_BAD_BODY", f"IDENTIFY {key} ({shown(v)}) is out of range")
    return int(v)


def _text(d, *keys) -> str:
    """A string field of IDENTIFY (the first of ``keys`` that is set): a string, or a
    number as text; anything else is refused (Go's decoder refuses it too)."""
    for key in keys:
        v = d.get(key)
        if v is None or v == "" or v is False:
            continue
        if isinstance(v, str):
            return v
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (not isinstance(v, int) or v.bit_length() <= 64):
            return str(v)
        raise fatal("E_BAD_BODY", f"IDENTIFY {key} must be a string, not {shown(v)}")
    return ""


def negotiate(data: dict, limits: Limits) -> tuple:
    """Apply an IDENTIFY body as nsqd does. Returns ``(Identity, response_bytes)``:
    the JSON feature response if ``feature_negotiation`` was asked, else ``OK``."""
    ident = Identity(heartbeat_interval_ms=limits.heartbeat_interval_ms, msg_timeout_ms=limits.msg_timeout_ms)
    ident.client_id = _text(data, "client_id", "short_id")
    ident.hostname = _text(data, "hostname", "long_id")
    ident.user_agent = _text(data, "user_agent")
    ident.feature_negotiation = bool(data.get("feature_negotiation"))

    hb = _int(data, "heartbeat_interval", 0)
    if hb == -1:
        ident.heartbeat_interval_ms = 0                     # disabled
    elif hb == 0:
        ident.heartbeat_interval_ms = limits.heartbeat_interval_ms
    elif hb < 1000 or hb > limits.max_heartbeat_interval_ms:
        raise fatal("E_BAD_BODY", f"IDENTIFY heartbeat interval ({hb}) is invalid")
    else:
        ident.heartbeat_interval_ms = hb

    # output buffering as nsqd's clientV2.SetOutputBuffer: -1 disables (every write
    # goes out at once), 0 keeps the default, otherwise within the broker's bounds
    ident.output_buffer_timeout_ms = limits.output_buffer_timeout_ms
    obt = _int(data, "output_buffer_timeout", 0)
    if obt == -1:
        ident.output_buffer_timeout_ms = 0
    elif obt != 0:
        if obt < limits.min_output_buffer_timeout_ms or obt > limits.max_output_buffer_timeout_ms:
            raise fatal("E_BAD_BODY", f"IDENTIFY output buffer timeout ({obt}) is invalid")
        ident.output_buffer_timeout_ms = obt
    obs = _int(data, "output_buffer_size", 0)
    if obs == -1:
        ident.output_buffer_size = 1
        ident.output_buffer_timeout_ms = 0
    elif obs != 0:
        if obs < 64 or obs > limits.max_output_buffer_size:
            raise fatal("E_BAD_BODY", f"IDENTIFY output buffer size ({obs}) is invalid")
        ident.output_buffer_size = obs

    sr = _int(data, "sample_rate", 0)
    if sr < 0 or sr > 99:
        raise fatal("E_BAD_BODY", f"IDENTIFY sample rate ({sr}) is invalid")
    ident.sample_rate = sr

    mt = _int(data, "msg_timeout", 0)
    if mt != 0:
        if mt < 1000 or mt > limits.max_msg_timeout_ms:
            raise fatal("E_BAD_BODY", f"IDENTIFY msg timeout ({mt}) is invalid")
        ident.msg_timeout_ms = mt

    # As nsqd: TLS and compression are upgrades of feature negotiation only; a client
    # that does not negotiate gets OK and a plain stream, whatever else it sent.
    ident.tls_v1 = ident.feature_negotiation and bool(data.get("tls_v1")) and limits.tls
    if limits.tls_required and not ident.tls_v1:
        raise fatal("E_INVALID", "TLS is required by this broker: IDENTIFY with tls_v1")
    if ident.feature_negotiation:
        ident.snappy = bool(data.get("snappy")) and limits.snappy
        ident.deflate = bool(data.get("deflate")) and limits.deflate
        if ident.snappy and ident.deflate:     # as enabled here: one the broker lacks is no conflict
            raise fatal("E_IDENTIFY_FAILED", "cannot enable both deflate and snappy compression")
    if ident.deflate:
        level = _int(data, "deflate_level", 6)
        if level <= 0:
            level = 6
        ident.deflate_level = min(level, limits.max_deflate_level)

    ident.extend_support = bool(data.get("extend_support"))
    tag = data.get("desired_tag")
    if tag not in (None, ""):
        if not isinstance(tag, str) or not re.match(r"^[0-9a-zA-Z_\-#]{1,128}$", tag):
            raise fatal("E_BAD_BODY", f"IDENTIFY desired_tag {shown(tag)} is invalid")
        ident.desired_tag = tag

    if not ident.feature_negotiation:
        return ident, OK
    resp = {
        "max_rdy_count": limits.max_rdy_count,
        "version": limits.version,
        "max_msg_timeout": limits.max_msg_timeout_ms,
        "msg_timeout": ident.msg_timeout_ms,
        "tls_v1": ident.tls_v1,
        "deflate": ident.deflate,
        "deflate_level": ident.deflate_level,
        "max_deflate_level": limits.max_deflate_level,
        "snappy": ident.snappy,
        "sample_rate": ident.sample_rate,
        "auth_required": limits.auth_required,
        "output_buffer_size": ident.output_buffer_size,
        "output_buffer_timeout": ident.output_buffer_timeout_ms,
        "extend_support": ident.extend_support,
    }
    return ident, json.dumps(resp).encode()


OVERFLOW = 1 << 64      # parse_int's value for more digits than a uint64 holds


def parse_int(raw: bytes, what: str) -> int:
    """A decimal parameter as nsqd's ``protocol.ByteToBase10``: digits only (no sign),
    and an empty one is 0; anything else is a fatal E_INVALID ``what raw``. More than 19
    digits (leading zeros aside) is ``OVERFLOW``, above every limit: out of range where
    nsqd checks one, clamped where it clamps (``int()`` of 5,000 digits raised)."""
    if raw and not raw.isdigit():
        raise fatal("E_INVALID", f"{what} {shown(raw)}")
    digits = raw.lstrip(b"0")
    if len(digits) > 19:
        return OVERFLOW
    return int(digits) if digits else 0


def go_quote(name: bytes) -> str:
    """``name`` as Go's ``%q`` shows it (nsqd's error texts): double quotes, with
    backslash escapes for quotes, backslashes and what is not printable."""
    out = []
    for ch in name.decode("utf-8", "replace"):
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif not ch.isprintable():
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x80 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


__all__ = ["Parser", "Command", "ProtocolError", "Limits", "Identity", "negotiate", "frame", "response",
           "message", "encode_command", "encode_mpub", "encode_pub_ext", "decode_frames", "decode_message",
           "valid_name", "go_quote", "parse_int", "loads_json", "shown", "clip", "MAGIC_V2", "HEARTBEAT", "OK", "CLOSE_WAIT", "FRAME_RESPONSE",
           "FRAME_ERROR", "FRAME_MESSAGE", "DEFAULTS", "MSG_ID_LEN"]
