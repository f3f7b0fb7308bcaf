"""Two broker processes on one database: publish to one, consume from both; kill -9
one mid-stream, its client reconnects to the other; nothing is lost."""
import signal
import threading
import time

import pytest

from fdq.broker import protocol as p
from nsqclient import RawClient

pytestmark = pytest.mark.slow


def consumer(addr, topic, channel, rdy):
    c = RawClient(addr)
    c.identify(heartbeat_interval=1000, msg_timeout=3000)
    c.sub(topic, channel, rdy)
    return c


def poll(c, timeout=0.05):
    try:
        f = c.frame(timeout=timeout)
    except TimeoutError:
        return "idle"
    return f


def test_kill_9_one_broker_mid_stream(broker_factory):
    a, b = broker_factory(), broker_factory()
    n = 300
    assert b.http_req("/channel/create?topic=fo&channel=c", b"")[0] == 200
    published = []
    errors = []

    def publish():
        pub = RawClient(b.tcp)
        try:
            for i in range(0, n, 10):
                pub.send(p.encode_mpub(b"fo", [b"m%04d" % j for j in range(i, i + 10)]))
                pub.expect()
                published.extend(range(i, i + 10))
                time.sleep(0.02)
        except Exception as e:        # reported by the assertion below
            errors.append(e)
        finally:
            pub.close()
    t = threading.Thread(target=publish, daemon=True)
    t.start()

    ca, cb = consumer(a.tcp, "fo", "c", 20), consumer(b.tcp, "fo", "c", 20)
    finished = {}                     # body -> times finished
    from_a = set()
    killed = False
    deadline = time.monotonic() + 150
    held = []
    while time.monotonic() < deadline:
        for name, c in (("a", ca), ("b", cb)):
            f = poll(c)
            if f == "idle":
                continue
            assert f is not None and f[0] == p.FRAME_MESSAGE, (name, f)
            _ts, _att, mid, body, _ = p.decode_message(f[1])
            if name == "a" and not killed:
                from_a.add(body)
                if len(from_a) >= 30:     # keep these in flight on A and kill it
                    held.append(body)
                    if len(held) >= 5:
                        a.proc.send_signal(signal.SIGKILL)
                        a.proc.wait(30)
                        killed = True
                        ca.close()
                        ca = consumer(b.tcp, "fo", "c", 20)     # reconnect to the other broker
                    continue
            c.send(b"FIN " + mid + b"\n")
            finished[body] = finished.get(body, 0) + 1
        if len(published) == n and len(finished) == n:
            break
    t.join(30)
    assert not errors, errors
    assert killed and len(published) == n
    missing = sorted(set(b"m%04d" % i for i in range(n)) - set(finished))
    assert not missing, f"lost {len(missing)} messages: {missing[:10]}"
    dups = {k for k, v in finished.items() if v > 1}
    assert dups <= from_a, "only messages delivered by the killed broker may repeat"
    for body in held:
        assert finished.get(body, 0) >= 1           # in flight on the dead broker: redelivered
    ca.close()
    cb.close()


def test_sigterm_shuts_down_cleanly_and_returns_in_flight(broker_factory):
    a, b = broker_factory(), broker_factory()
    pub = RawClient(a.tcp)
    pub.send(p.encode_mpub(b"st", [b"%d" % i for i in range(10)]))
    pub.expect()
    c = RawClient(a.tcp)
    c.identify(heartbeat_interval=1000, msg_timeout=600_000)    # only the shutdown can return them soon
    c.sub("st", "default", 10)
    held = {c.message()[3] for _ in range(10)}      # all in flight on A, never FIN'd
    assert a.stop(signal.SIGTERM, timeout=60) == 0
    assert c.closed(timeout=10)
    cb = consumer(b.tcp, "st", "default", 10)
    again = set()
    for _ in range(10):
        _ts, attempts, mid, body, _ = cb.message(timeout=60)
        assert attempts == 2
        again.add(body)
        cb.send(b"FIN " + mid + b"\n")
    assert again == held          # returned to the queue at shutdown, not lost
    cb.close()
