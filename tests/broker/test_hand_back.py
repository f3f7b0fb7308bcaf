"""What the broker leased for a channel and no connection could take (its only
connection set RDY 0 while the channel's fetch waited) goes back to the queue without
counting an attempt: the message is delivered later as attempt 1."""
import json

import pytest

import fdq
from fdqtest import sub_stats, wait_for
from nsqclient import RawClient

pytestmark = pytest.mark.slow


def _depth(broker, topic, ch) -> int:
    status, body = broker.http_req(f"/stats?format=json&topic={topic}")
    assert status == 200
    for t in json.loads(body)["topics"]:
        for c in t["channels"]:
            if c["channel_name"] == ch:
                return c["depth"]
    return -1


def test_a_message_leased_for_no_ready_connection_is_released_uncounted(broker):
    """RDY 0 with the channel's fetch waiting, then a publish (on the same connection,
    so the RDY is processed first): the fetch leases the message and hands it back (a
    release: leased once more than acked); after RDY 1 it arrives with attempts 1
    (before: handed back as a nak, attempts 2)."""
    c = RawClient(broker.tcp)
    c.identify(heartbeat_interval=30000)
    c.sub("hb", "c", 10)
    db = fdq.connect(broker.url)
    for i in range(5):
        c.send(b"RDY 0\n")
        c.pub("hb", b"m%d" % i)
        wait_for(lambda: _depth(broker, "hb", "c") == 1, 30, what="the message back in the queue")
        c.send(b"RDY 10\n")
        _ts, attempts, mid, body, _ = c.message(timeout=30)
        assert (body, attempts) == (b"m%d" % i, 1)
        c.send(b"FIN " + mid + b"\n")
        wait_for(lambda: sub_stats(db, "hb", "c")["backlog"] == 0, 30, what="the FIN committed")
    s = sub_stats(db, "hb", "c")    # a hand-back was leased once more than acked
    assert s["emitted"] > s["acked"] == 5, f"no fetch was under way at RDY 0: nothing handed back ({s})"
    c.close()
