"""A client that pipelines publishes faster than the database commits them: the broker
stops reading once its pending publishes pass a bound (nsqd runs them one at a time),
so its memory stays bounded; everything sent is published once the database moves."""
from __future__ import annotations

import fcntl
import json
import sqlite3
import struct
import termios
import time

import pytest

from fdq.broker import protocol as p
from fdq.broker.conn import MAX_PENDING_PUBLISH_BYTES, MAX_PENDING_PUBLISHES as MAX_PENDING
from fdqtest import ON_FDB

BODY = 256 * 1024
COUNT = 400          # 100 MiB in all

pytestmark = pytest.mark.skipif(ON_FDB, reason="holds the embedded engine's SQLite write lock from outside (sqlite:// only)")


def unsent(sock) -> int:
    """Bytes ``sock`` was given that its peer has not acknowledged (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock, termios.TIOCOUTQ, b"\0" * 4))[0]


def unread(local_port: int, remote_port: int) -> int:
    """Bytes the kernel holds for the IPv4 socket ``local_port`` -> ``remote_port``
    that its process has not read (rx_queue of /proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, remote, queues = fields[1], fields[2], fields[4]
            if int(local.split(":")[1], 16) == local_port and int(remote.split(":")[1], 16) == remote_port:
                return int(queues.split(":")[1], 16)
    raise AssertionError(f"no socket {local_port} -> {remote_port} in /proc/net/tcp")


def test_pipelined_publishes_are_bounded_then_all_land(raw, broker, db_url):
    c = raw()
    c.pub("bp", b"first")                     # the topic exists; the database works
    blocker = sqlite3.connect(db_url[len("sqlite://"):], isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")        # another writer holds the database (< its 10 s wait)
    frame = p.encode_command(b"PUB", b"bp", body=b"x" * BODY)
    data = memoryview(frame * COUNT)
    sent = 0
    c.sock.setblocking(False)
    # It reads no more than its bound, plus its stream's buffer (reading pauses past 2 MiB),
    # a transport read (256 KiB), the frame being parsed and the parser's read (64 KiB).
    limit = MAX_PENDING_PUBLISH_BYTES + (2 << 20) + (256 << 10) + len(frame) + (64 << 10)
    deadline = time.monotonic() + 6           # (the broker's commit waits 10 s for the lock)
    blocked_since = None
    try:                                      # send until past the limit and refused for 1 s
        while sent < len(data) and time.monotonic() < deadline:
            try:
                sent += c.sock.send(data[sent:sent + (1 << 20)])
                blocked_since = None
            except BlockingIOError:
                blocked_since = blocked_since or time.monotonic()
                if sent > limit and time.monotonic() - blocked_since > 1:
                    break
                time.sleep(0.01)
        # What the broker read: what was sent less what the kernel still holds on either
        # end (the sockets' buffers grow with TCP autotuning, up to tcp_rmem's 32 MiB here).
        client_port = c.sock.getsockname()[1]
        taken = sent - unsent(c.sock) - unread(broker.tcp_port, client_port)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert sent > limit, f"sent only {sent} bytes: an unbounded broker would pass"
    assert taken < limit, f"the broker took {taken / (1 << 20):.1f} MiB of publishes it could not commit"
    c.sock.setblocking(True)
    c.sock.settimeout(60)
    c.sock.sendall(data[sent:])
    for _ in range(COUNT):
        c.expect()
    status, body = broker.http_req("/stats?format=json&topic=bp")
    assert status == 200
    [topic] = json.loads(body)["topics"]
    assert topic["message_count"] == COUNT + 1


def test_nothing_is_published_after_a_fatal_error_closed_the_wait(raw, broker, db_url):
    """A connection waiting for room among its pending publishes went on executing the
    commands it had read once room came, though a publish's fatal error had closed it
    meanwhile: PUBs the client sent after the failed one (and never got an answer
    for, so would publish again) were published. At most the ones already running
    before the failure land (publishes run concurrently). The failed one shares its
    commit with those queued with it, so its error comes when the database moves:
    the pipelined PUBs behind it fill the pending bound first and the connection waits
    for room while the failure arrives."""
    import fdq
    fdq.Supervisor(fdq.connect(db_url)).create_topic("bpf", subs=(), max_message_bytes=100)
    c = raw()
    c.pub("bpf", b"first")
    extra = 40
    blocker = sqlite3.connect(db_url[len("sqlite://"):], isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")        # the small ones wait for the database
    try:
        c.send(p.encode_command(b"PUB", b"bpf", body=b"x" * 200)      # too large: E_BAD_MESSAGE, fatal
               + p.encode_command(b"PUB", b"bpf", body=b"s") * (MAX_PENDING + extra))
        try:                                  # the database held a while (or the error came)
            c.frame(timeout=1.0)
            raise AssertionError("answered while the database was held")
        except TimeoutError:
            pass
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert c.error().startswith("E_BAD_MESSAGE")
    assert c.closed()

    def count():
        status, body = broker.http_req("/stats?format=json&topic=bpf")
        assert status == 200
        return json.loads(body)["topics"][0]["message_count"]
    deadline = time.monotonic() + 30
    while count() < MAX_PENDING - 1 and time.monotonic() < deadline:   # those already running
        time.sleep(0.05)
    assert count() >= MAX_PENDING - 1
    deadline = time.monotonic() + 2           # then nothing more
    while time.monotonic() < deadline:
        assert count() <= MAX_PENDING + 1, "published after the connection was closed"
        time.sleep(0.1)
