"""FIN/REQ/TOUCH ride the channel's next fetch (``Consumer.settle_soon``): on a busy
channel one commit carries the settlements and the next lease; on an idle one a FIN is
committed alone after a few milliseconds, not left for the consumer's next sweep (every
0.5 s); under RDY churn every message is finished exactly once, with no error."""
import statistics
import time

import pytest

import fdq
from fdq.broker import protocol as p
from fdqtest import sub_stats, wait_for
from nsqclient import RawClient

pytestmark = pytest.mark.slow


def _client(broker, topic, rdy):
    c = RawClient(broker.tcp)
    c.identify(heartbeat_interval=30000, msg_timeout=60000)
    c.sub(topic, "c", rdy)
    return c


def test_a_fin_on_an_idle_channel_commits_within_milliseconds(broker):
    c = _client(broker, "idle", 1)
    pub = RawClient(broker.tcp)
    db = fdq.connect(broker.url)
    took = []
    for i in range(5):
        pub.pub("idle", b"m%d" % i)
        _ts, _a, mid, body, _ = c.message(timeout=30)
        assert body == b"m%d" % i
        t0 = time.monotonic()
        c.send(b"FIN " + mid + b"\n")
        deadline = t0 + 10
        while sub_stats(db, "idle", "c")["acked"] < i + 1:
            assert time.monotonic() < deadline, "FIN never committed"
            time.sleep(0.002)
        took.append(time.monotonic() - t0)
    # nothing else happens on the channel: the linger (5 ms) commits it, not a sweep
    assert statistics.median(took) < 0.3, f"FIN to commit: {took}"
    c.close()
    pub.close()


def test_every_message_is_finished_once_under_rdy_churn(broker):
    """RDY flips between 0 and a few while messages arrive and each is FIN'd: the FINs
    carried by fetches, committed alone, or both, none is lost or answered with an error,
    and no message comes twice."""
    n = 300
    pub = RawClient(broker.tcp)
    for k in range(0, n, 50):
        pub.send(p.encode_mpub(b"churn", [b"%d" % i for i in range(k, k + 50)]))
        pub.expect()
    c = _client(broker, "churn", 3)
    seen = []
    deadline = time.monotonic() + 60
    while len(seen) < n:
        assert time.monotonic() < deadline, f"{len(seen)} of {n} messages"
        f = c.frame(timeout=30)
        assert f is not None and f[0] == p.FRAME_MESSAGE, f
        _ts, attempts, mid, body, _ = p.decode_message(f[1])
        seen.append(body)
        c.send(b"FIN " + mid + b"\n")
        if len(seen) % 7 == 0:      # 0 then back up: a fetch under way hands its messages back
            c.send(b"RDY 0\n")
            c.send(b"RDY %d\n" % (1 + len(seen) % 5))
        elif len(seen) % 5 == 0:
            c.send(b"RDY 1\n")
    assert sorted(seen, key=int) == [b"%d" % i for i in range(n)]
    db = fdq.connect(broker.url)
    wait_for(lambda: sub_stats(db, "churn", "c")["acked"] == n, 30, what="every FIN committed")
    c.send(b"NOP\n")
    with pytest.raises(TimeoutError):
        c.frame(timeout=1)      # no error frame, no redelivery
    c.close()
    pub.close()
