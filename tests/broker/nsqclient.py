"""A minimal raw NSQ client for the broker tests (a module of its own: importing from
``conftest`` depends on which directory's conftest Python finds first)."""
import json
import socket
import struct
import time

from fdq.broker import protocol as p


class RawClient:
    """A minimal NSQ client on a plain socket: every read is bounded."""

    def __init__(self, addr, magic=p.MAGIC_V2, timeout=30):
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.buf = bytearray()
        self.timeout = timeout
        if magic:
            self.sock.sendall(magic)

    def send(self, data):
        self.sock.sendall(data)

    def frame(self, timeout=None, skip_heartbeats=True):
        """Next frame (type, data); answers heartbeats with NOP; None if the server closed."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            frames = p.decode_frames(self.buf) if len(self.buf) >= 8 else []
            if frames:
                # put back all but the first
                rest = b"".join(struct.pack(">Ii", len(d) + 4, t) + d for t, d in frames[1:])
                self.buf[:0] = rest
                t, d = frames[0]
                if skip_heartbeats and t == p.FRAME_RESPONSE and d == p.HEARTBEAT:
                    self.send(b"NOP\n")
                    continue
                return t, d
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no frame from the broker")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                raise TimeoutError("no frame from the broker") from None
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            self.buf += chunk

    def expect(self, data=p.OK, ftype=p.FRAME_RESPONSE):
        f = self.frame()
        assert f == (ftype, data), f
        return f

    def error(self):
        f = self.frame()
        assert f is not None and f[0] == p.FRAME_ERROR, f
        return f[1].decode()

    def closed(self, timeout=30):
        """True once the server has closed the connection (frames before that are dropped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.frame(timeout=max(0.1, deadline - time.monotonic())) is None:
                    return True
            except TimeoutError:
                return False
        return False

    def identify(self, **kw):
        kw.setdefault("feature_negotiation", True)
        self.send(p.encode_command(b"IDENTIFY", body=json.dumps(kw).encode()))
        t, d = self.frame()
        assert t == p.FRAME_RESPONSE, d
        return json.loads(d) if kw.get("feature_negotiation") else d

    def pub(self, topic, body):
        self.send(p.encode_command(b"PUB", topic.encode(), body=body))
        self.expect()

    def sub(self, topic, channel, rdy=None):
        self.send(f"SUB {topic} {channel}\n".encode())
        self.expect()
        if rdy is not None:
            self.send(f"RDY {rdy}\n".encode())

    def message(self, timeout=None, ext=False):
        f = self.frame(timeout)
        assert f is not None and f[0] == p.FRAME_MESSAGE, f
        return p.decode_message(f[1], ext)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
