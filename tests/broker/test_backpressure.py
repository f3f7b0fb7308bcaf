"""A client that pipelines publishes faster than the database commits them: the broker
stops reading once its pending publishes pass a bound (nsqd runs them one at a time),
so its memory stays bounded; everything sent is published once the database moves."""
from __future__ import annotations

import json
import sqlite3
import time

import pytest

from fdq.broker import protocol as p
from fdq.broker.conn import MAX_PENDING_PUBLISHES as MAX_PENDING
from fdqtest import ON_FDB

BODY = 256 * 1024
COUNT = 400          # 100 MiB in all

pytestmark = pytest.mark.skipif(ON_FDB, reason="holds the embedded engine's SQLite write lock from outside (sqlite:// only)")


def test_pipelined_publishes_are_bounded_then_all_land(raw, broker, db_url):
    c = raw()
    c.pub("bp", b"first")                     # the topic exists; the database works
    blocker = sqlite3.connect(db_url[len("sqlite://"):], isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")        # another writer holds the database (< its 10 s wait)
    frame = p.encode_command(b"PUB", b"bp", body=b"x" * BODY)
    data = memoryview(frame * COUNT)
    sent = 0
    c.sock.setblocking(False)
    deadline = time.monotonic() + 3
    try:
        while sent < len(data) and time.monotonic() < deadline:
            try:
                sent += c.sock.send(data[sent:sent + (1 << 20)])
            except BlockingIOError:
                time.sleep(0.01)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    # It read no more than its bound (32 MiB) plus a read and the sockets' buffers.
    assert sent < 48 << 20, f"the broker took {sent / (1 << 20):.0f} MiB of publishes it could not commit"
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
