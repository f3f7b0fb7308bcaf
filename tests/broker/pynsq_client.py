"""A pynsq (tornado) client, unchanged library code, run as a subprocess by the tests.

    pub ADDR TOPIC N          PUB n/3, MPUB n/3 (batches of 10), DPUB the rest (500 ms)
    sub ADDR TOPIC CHANNEL N  consume until N distinct bodies are finished (ADDR http://H:P:
                              discover the brokers through that nsqlookupd); REQ (1 s) the
                              first delivery of every 10th+3, TOUCH-then-FIN every 10th+5
Prints one JSON line with what happened."""
import json
import os
import random
import ssl
import sys
import time

import nsq
import tornado.ioloop


MSG_TIMEOUT_S = 3    # the reader's msg_timeout; TOUCHes every 0.5 s hold a message 4.5 s


def conn_options() -> dict:
    """PYNSQ_DEFLATE=1 / PYNSQ_SNAPPY=1 / PYNSQ_TLS=1: negotiate deflate / snappy / TLS
    (certificate not verified)."""
    opts = {}
    if os.environ.get("PYNSQ_DEFLATE"):
        opts.update(deflate=True, deflate_level=6)
    if os.environ.get("PYNSQ_SNAPPY"):
        opts.update(snappy=True)
    if os.environ.get("PYNSQ_TLS"):
        opts.update(tls_v1=True, tls_options={"cert_reqs": ssl.CERT_NONE})
    return opts


def body(i: int) -> bytes:
    return b"%06d:" % i + random.Random(i).randbytes(40 + i % 50) + b"\n\x00end"


def index(b: bytes) -> int:
    return int(b[:6])


def pub(addr, topic, n):
    loop = tornado.ioloop.IOLoop.current()
    w = nsq.Writer([addr], **conn_options())
    state = {"ok": 0, "err": [], "sent": 0}
    third = n // 3
    plan = [("pub", [i]) for i in range(third)]
    plan += [("mpub", list(range(i, min(i + 10, 2 * third)))) for i in range(third, 2 * third, 10)]
    plan += [("dpub", [i]) for i in range(2 * third, n)]

    def done(kind, idx):
        def cb(conn, data):
            if isinstance(data, nsq.Error):
                state["err"].append(str(data))
                retry_later(kind, idx)
            else:
                state["ok"] += len(idx)
                if state["ok"] == n:
                    loop.stop()
        return cb

    def retry_later(kind, idx):
        loop.call_later(0.2, lambda: send(kind, idx))

    def send(kind, idx):
        if not w.conns:
            return retry_later(kind, idx)
        if kind == "pub":
            w.pub(topic, body(idx[0]), done(kind, idx))
        elif kind == "mpub":
            w.mpub(topic, [body(i) for i in idx], done(kind, idx))
        else:
            w.dpub(topic, 500, body(idx[0]), done(kind, idx))

    def start():
        for kind, idx in plan:
            send(kind, idx)
    loop.call_later(0.5, start)
    loop.call_later(120, loop.stop)
    loop.start()
    print(json.dumps({"ok": state["ok"], "errors": state["err"][:5]}), flush=True)


def sub(addr, topic, channel, n):
    loop = tornado.ioloop.IOLoop.current()
    seen = {}          # index -> [attempts...]
    finished = set()
    ts = []
    bad = []
    state = {"last": time.monotonic()}

    def handler(m):
        b = bytes(m.body)
        i = index(b)
        if b != body(i):
            bad.append(i)
        seen.setdefault(i, []).append(m.attempts)
        ts.append(m.timestamp)
        if i % 10 == 3 and m.attempts == 1:
            m.requeue(delay=1, backoff=False)
            return None
        if i % 10 == 5:
            m.enable_async()
            t_end = time.monotonic() + MSG_TIMEOUT_S + 1.5    # held past msg_timeout by TOUCHes

            def touch():
                if time.monotonic() < t_end:
                    m.touch()
                    loop.call_later(0.5, touch)
                else:
                    m.finish()
                    finished.add(i)
                    check()
            loop.call_later(0.5, touch)
            return None
        finished.add(i)
        check()
        return True

    def check():
        state["last"] = time.monotonic()

    def tick():
        if len(finished) >= n and time.monotonic() - state["last"] > 2.0:
            loop.stop()
        else:
            loop.call_later(0.2, tick)

    source = dict(lookupd_http_addresses=[addr]) if addr.startswith("http://") else dict(nsqd_tcp_addresses=[addr])
    r = nsq.Reader(topic=topic, channel=channel, message_handler=handler, **source,
                   max_in_flight=50, max_tries=0, msg_timeout=MSG_TIMEOUT_S, heartbeat_interval=1,
                   lookupd_poll_interval=1, **conn_options())
    loop.call_later(0.5, tick)
    loop.call_later(150, loop.stop)
    loop.start()
    # which compressed socket pynsq switched to (after IDENTIFY negotiated it)
    sockets = [type(getattr(c, "socket", None)).__name__ for c in r.conns.values()]
    conns = sorted(r.conns)
    r.close()
    print(json.dumps({"seen": seen, "finished": len(finished), "bad": bad, "conns": conns,
                      "snappy": "SnappySocket" in sockets, "deflate": "DeflateSocket" in sockets,
                      "ts_min": min(ts) if ts else None, "ts_max": max(ts) if ts else None}), flush=True)


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "pub":
        pub(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sub(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
