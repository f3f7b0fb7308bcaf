"""Clients that misbehave at the connection level: one that stops reading, one that
disconnects mid-frame, many at once."""
import json
import socket
import struct
import time

import pytest

from fdq.broker import protocol as p
from fdqtest import wait_for

pytestmark = pytest.mark.slow

BODY = b"x" * 100_000


def channel_stats(broker, topic, channel):
    status, body = broker.http_req(f"/stats?format=json&topic={topic}")
    assert status == 200
    for t in json.loads(body)["topics"]:
        for c in t["channels"]:
            if c["channel_name"] == channel:
                return c
    return None


def frozen_subscriber(raw, topic: str, mpubs: int, **identify):
    """``mpubs`` MPUBs of 40 messages to ``topic``, then a client with a small receive
    buffer subscribed to its channel "ch" with RDY 50, which the caller never reads."""
    pub = raw()
    for _ in range(mpubs):
        pub.send(p.encode_mpub(topic.encode(), [BODY] * 40))
        pub.expect()
    c = raw()
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.identify(**identify)
    c.send(b"SUB %s ch\nRDY 50\n" % topic.encode())
    return c


def test_a_client_that_stops_reading_is_dropped_and_its_messages_go_elsewhere(raw, broker):
    """A subscriber that reads nothing but keeps sending NOPs: its messages time out and
    were delivered to it again and again, each time into the broker's memory (it grew
    ~8 MB/s here). Now it gets nothing more past a bound of unread bytes, and is closed
    once it has read nothing for a heartbeat interval (nsqd's write deadline); its
    messages go to a healthy consumer."""
    stuck = frozen_subscriber(raw, "stuck", 4, msg_timeout=1000, heartbeat_interval=3000)
    deadline = time.monotonic() + 30
    dropped = False
    while time.monotonic() < deadline:
        try:
            stuck.send(b"NOP\n")
        except OSError:
            dropped = True
            break
        st = channel_stats(broker, "stuck", "ch")
        if st is not None and st["message_count"] > 0 and st["client_count"] == 0:
            dropped = True
            break
        time.sleep(0.3)
    assert dropped, "a client that reads nothing was never closed"
    st = channel_stats(broker, "stuck", "ch")
    # what it was sent is bounded: not redelivered to it every msg_timeout
    assert st["message_count"] <= 100, st["message_count"]
    ok = raw()
    ok.identify(msg_timeout=30000)
    ok.sub("stuck", "ch", rdy=200)
    seen = set()
    while len(seen) < 160:
        _ts, _att, mid, body, _ = ok.message(timeout=30)
        assert body == BODY
        seen.add(mid)
        ok.send(b"FIN " + mid + b"\n")
    wait_for(lambda: channel_stats(broker, "stuck", "ch")["in_flight_count"] == 0, 30, "all finished")


def test_a_closed_connection_whose_client_reads_nothing_is_not_held_open(raw, broker):
    """A connection closed by the broker (here for a fatal error) while its client reads
    nothing, as a frozen process: asyncio's close waits for the unsent output to go out,
    so the socket and its buffer were held until the client read, for ever. Now they are
    dropped after a few seconds."""
    c = frozen_subscriber(raw, "frozen", 2, msg_timeout=60000, heartbeat_interval=60000)
    # (a fetch of up to 50 goes out in one write: several MB, most of it unsent)
    wait_for(lambda: (channel_stats(broker, "frozen", "ch") or {}).get("in_flight_count", 0) >= 10, 30,
             "messages sent to it")
    c.send(b"BAD\n")                                # fatal: the broker closes it
    wait_for(lambda: channel_stats(broker, "frozen", "ch")["client_count"] == 0, 30, "the connection closed")
    c.sock.setblocking(False)

    def gone():
        try:
            c.sock.send(b"NOP\n")       # answered with a reset once the broker's socket is closed
        except BlockingIOError:
            return False
        except OSError:
            return True
        return False
    wait_for(gone, 30, "the broker's socket closed", interval=0.3)


def test_clients_that_disconnect_mid_frame(raw, broker):
    """A publisher gone in the middle of a PUB body publishes nothing; a consumer gone
    in the middle of its FIN line has not finished the message: it is requeued at once
    (long before its 60 s msg_timeout) to another consumer."""
    c = raw()
    c.send(b"PUB midframe\n" + struct.pack(">I", 100) + b"x" * 50)
    c.send(b"MPUB midframe\n" + struct.pack(">I", 100) + struct.pack(">I", 2))
    c.close()
    pub = raw()
    pub.pub("midframe2", b"m")
    a = raw()
    a.identify(msg_timeout=60000)
    a.sub("midframe2", "ch", rdy=1)
    _ts, attempts, mid, body, _ = a.message()
    assert attempts == 1
    a.send(b"FIN " + mid[:8])                     # no newline: not a command yet
    a.close()
    b = raw()
    b.identify(msg_timeout=60000)
    b.sub("midframe2", "ch", rdy=1)
    t0 = time.monotonic()
    _ts, attempts, mid2, body2, _ = b.message(timeout=30)
    assert (body2, mid2, attempts) == (body, mid, 2) and time.monotonic() - t0 < 30
    b.send(b"FIN " + mid2 + b"\n")
    status, out = broker.http_req("/stats?format=json&topic=midframe")
    assert status == 200 and json.loads(out)["topics"] == []


def test_a_slow_but_steady_reader_is_not_dropped(raw, broker):
    """A client reading slowly (~40 KB/s) but all the time is making progress: as with
    nsqd's per-write deadline it stays connected, though its backlog takes longer than
    a heartbeat interval to go out (the bound first dropped it once its backlog had not
    drained within one)."""
    pub = raw()
    for _ in range(3):
        pub.send(p.encode_mpub(b"slowsteady", [BODY] * 40))     # 12 MB: more than the kernel's buffers
        pub.expect()
    c = raw()
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.identify(msg_timeout=60000, heartbeat_interval=2000)
    c.send(b"SUB slowsteady ch\nRDY 120\n")
    got = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 8:                  # 4 heartbeat intervals
        chunk = c.sock.recv(8192)
        assert chunk, "the broker closed a connection that was reading"
        got += len(chunk)
        c.send(b"NOP\n")                             # its heartbeats, unread yet, answered
        time.sleep(0.2)
    assert got < 120 * len(BODY)                        # it was still behind all along
    assert channel_stats(broker, "slowsteady", "ch")["client_count"] == 1
