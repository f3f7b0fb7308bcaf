"""Publishes of every connection share the producer's commits (``fdq.aio.push``): a PUB
is answered OK only after its commit, each connection's answers come in its command
order, and one failing PUB among the others' fails alone."""
from __future__ import annotations

import signal
import sqlite3
import threading
import time

import pytest

import fdq
from fdq.broker import protocol as p
from fdqtest import ON_FDB
from nsqclient import RawClient

pytestmark = pytest.mark.slow


def stored_bodies(db_url, topic) -> set:
    """Every body in ``topic``'s default subscription."""
    got = set()
    with fdq.Consumer(fdq.connect(db_url), topic) as c:
        while True:
            msgs = c.fetch(500, timeout=1.0)
            if not msgs:
                return got
            got.update(m.body for m in msgs)
            c.ack_many(msgs)


def pipeline(addr, topic, tag, oks, window=40, stop=None, limit=2000):
    """PUB ``limit`` distinct bodies ``tag-i`` with ``window`` outstanding, recording
    each OK'd body in ``oks`` (in order: OKs answer in command order), until ``stop``."""
    c = RawClient(addr)
    c.sock.settimeout(30)
    sent = []
    try:
        while len(oks) < limit and not (stop is not None and stop.is_set()):
            while len(sent) - len(oks) < window and len(sent) < limit:
                body = f"{tag}-{len(sent)}".encode()
                c.send(p.encode_command(b"PUB", topic.encode(), body=body))
                sent.append(body)
            f = c.frame(timeout=30)
            if f is None:
                return
            assert f == (p.FRAME_RESPONSE, p.OK), f
            oks.append(sent[len(oks)])
    except (OSError, TimeoutError):
        return      # the broker was killed
    finally:
        c.close()


def test_every_ok_pub_is_stored_after_kill_9(broker, db_url):
    """Several connections pipelining PUBs, the broker killed -9 mid-stream: every PUB
    answered OK is in the log (OK only after its commit)."""
    fdq.Supervisor(fdq.connect(db_url)).create_topic("k9", shards=2)
    stop = threading.Event()
    oks = [[] for _ in range(4)]
    threads = [threading.Thread(target=pipeline, args=(broker.tcp, "k9", f"c{i}", oks[i], 40, stop), daemon=True)
               for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(map(len, oks)) < 400 and time.monotonic() < deadline:
        time.sleep(0.01)
    broker.proc.send_signal(signal.SIGKILL)
    broker.proc.wait(30)
    stop.set()
    for t in threads:
        t.join(30)
    answered = {b for ok in oks for b in ok}
    assert len(answered) >= 400
    missing = answered - stored_bodies(db_url, "k9")
    assert not missing, f"{len(missing)} PUBs answered OK are not stored: {sorted(missing)[:5]}"


@pytest.mark.skipif(ON_FDB, reason="holds the embedded engine's SQLite write lock from outside (sqlite:// only)")
def test_a_pub_waiting_for_its_commit_gets_no_ok_and_dies_with_the_broker(broker, db_url):
    """A PUB the broker accepted but could not commit yet (another writer holds the
    database) is not answered; the broker killed -9 then, it was never stored."""
    fdq.Supervisor(fdq.connect(db_url)).create_topic("held", shards=1)
    c = RawClient(broker.tcp)
    c.pub("held", b"before")
    blocker = sqlite3.connect(db_url[len("sqlite://"):], isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        c.send(p.encode_command(b"PUB", b"held", body=b"during"))
        with pytest.raises(TimeoutError):
            c.frame(timeout=1.5)
        broker.proc.send_signal(signal.SIGKILL)
        broker.proc.wait(30)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    c.close()
    assert stored_bodies(db_url, "held") == {b"before"}


def test_a_failing_pub_fails_alone_among_other_connections_pubs(broker, db_url):
    """PUBs of several connections commit together; one that fails (its topic's backlog
    is full) gets its fatal E_PUB_FAILED while every other connection's PUB is answered
    OK and stored."""
    sup = fdq.Supervisor(fdq.connect(db_url))
    sup.create_topic("ok", shards=2)
    sup.create_topic("full", shards=1, max_backlog=1)
    RawClient(broker.tcp).pub("full", b"first")       # backlog 1: the next push is refused
    oks = [[] for _ in range(3)]
    threads = [threading.Thread(target=pipeline, args=(broker.tcp, "ok", f"c{i}", oks[i], 40, None, 300),
                                daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    errors = []
    while any(t.is_alive() for t in threads):      # failing PUBs while the others pipeline
        bad = RawClient(broker.tcp)
        bad.send(p.encode_command(b"PUB", b"full", body=b"x"))
        errors.append(bad.error())
        assert bad.closed()
        bad.close()
    for t in threads:
        t.join(60)
    assert errors and all(e.startswith("E_PUB_FAILED") and "max_backlog" in e for e in errors), errors[:3]
    assert all(len(ok) == 300 for ok in oks), [len(ok) for ok in oks]
    assert stored_bodies(db_url, "ok") == {b for ok in oks for b in ok}
