"""A soak of the broker under the supervisor: two broker processes on one database,
publishers (PUB, MPUB, DPUB) and consumers (FIN, REQ, TOUCH, leases left to expire)
on both, while the supervisor pauses, plays and reshards the topic and pauses the
channel, and one broker is killed -9 and started again. Every acknowledged publish is
finished at least once or dead-lettered; the channel drains, nothing in flight or queued.

    FDQ_BROKER_SOAK_SEEDS=1,2,3 FDQ_BROKER_SOAK_SECONDS=30 pytest -q -s tests/broker/test_broker_soak.py
"""
import os
import random
import signal
import threading
import time

import pytest

import fdq
from fdq.broker import protocol as p
from nsqclient import RawClient

pytestmark = pytest.mark.slow
SOAK_S = float(os.environ.get("FDQ_BROKER_SOAK_SECONDS", "8"))


def _consumer(addr):
    c = RawClient(addr)
    c.identify(heartbeat_interval=1000, msg_timeout=2000)
    c.sub("bs", "c", 30)
    c.addr_port = int(addr.rsplit(":", 1)[1])
    return c


@pytest.mark.parametrize("seed", [int(s) for s in os.environ.get("FDQ_BROKER_SOAK_SEEDS", "1").split(",")])
def test_broker_soak(broker_factory, db_url, seed):
    rng = random.Random(seed)
    brokers = [broker_factory(), broker_factory()]
    assert brokers[0].http_req("/channel/create?topic=bs&channel=c", b"")[0] == 200
    db = fdq.connect(db_url)
    sup = fdq.Supervisor(db)
    acked, errors, stop = set(), [], threading.Event()
    lock = threading.Lock()

    def publisher(i):
        prng = random.Random(seed * 100 + i)
        seq = 0
        c = None
        while not stop.is_set():
            try:
                if c is None:
                    c = RawClient(brokers[prng.randrange(2)].tcp, timeout=10)
                r = prng.random()
                if r < 0.5:
                    bodies = [b"p%d-%06d" % (i, seq + j) for j in range(prng.randint(2, 5))]
                    c.send(p.encode_mpub(b"bs", bodies))
                elif r < 0.9:
                    bodies = [b"p%d-%06d" % (i, seq)]
                    c.send(p.encode_command(b"PUB", b"bs", body=bodies[0]))
                else:
                    bodies = [b"p%d-%06d" % (i, seq)]
                    c.send(p.encode_command(b"DPUB", b"bs", b"%d" % prng.randint(10, 500), body=bodies[0]))
                seq += len(bodies)
                f = c.frame(timeout=10)
                if f is None:
                    raise ConnectionError("closed")
                if f == (p.FRAME_RESPONSE, p.OK):
                    with lock:
                        acked.update(bodies)
                else:
                    errors.append(f)
                time.sleep(prng.uniform(0.02, 0.08))
            except (OSError, ConnectionError, TimeoutError):
                if c is not None:
                    c.close()
                c = None
                time.sleep(0.05)
        if c is not None:
            c.close()

    pubs = [threading.Thread(target=publisher, args=(i,), daemon=True) for i in range(2)]
    for t in pubs:
        t.start()
    finished = {}
    cons = [_consumer(b.tcp) for b in brokers]
    sup_ops = []

    def admin():
        arng = random.Random(seed + 7)
        while not stop.is_set():
            r = arng.random()
            try:
                if r < 0.25:
                    sup.pause("bs"); sup_ops.append("pause")
                elif r < 0.5:
                    sup.play("bs"); sup_ops.append("play")
                elif r < 0.75:
                    sup.rebalance("bs", shards=arng.randint(2, 8)); sup_ops.append("reshard")
                elif r < 0.85:
                    sup.pause_subscription("bs", "c"); sup_ops.append("pause_c")
                else:
                    sup.play_subscription("bs", "c"); sup_ops.append("play_c")
            except fdq.ConfigError as e:
                sup_ops.append(f"! {e}"[:60])
            stop.wait(arng.uniform(0.1, 0.5))
    adm = threading.Thread(target=admin, daemon=True)
    adm.start()

    def consume_round(deadline, chaos=True):
        for i in range(2):
            c = cons[i]
            try:
                f = c.frame(timeout=0.02)
            except TimeoutError:
                continue
            except OSError as e:        # its broker killed (frame() answers heartbeats)
                if brokers[i].proc.poll() is None and c.addr_port == brokers[i].tcp_port:
                    errors.append(f"a live broker closed a consumer: {e}")
                c.close()
                cons[i] = _consumer(brokers[i].tcp)
                continue
            if f is None or f[0] != p.FRAME_MESSAGE:
                if f is None or f[0] == p.FRAME_ERROR and b"E_FIN_FAILED" not in f[1] \
                        and b"E_REQ_FAILED" not in f[1] and b"E_TOUCH_FAILED" not in f[1]:
                    if f is not None:
                        errors.append(f)
                    c.close()
                    try:
                        cons[i] = _consumer(brokers[i].tcp)
                    except OSError:
                        cons[i] = _consumer(brokers[1 - i].tcp)
                continue
            _ts, _att, mid, body, _ = p.decode_message(f[1])
            r = rng.random() if chaos else 1.0
            try:
                if r < 0.07:
                    c.send(b"REQ " + mid + b" %d\n" % rng.choice([0, 50, 200]))
                elif r < 0.1:
                    pass                                # left to expire
                else:
                    if r < 0.15:
                        c.send(b"TOUCH " + mid + b"\n")
                    c.send(b"FIN " + mid + b"\n")
                    finished[body] = finished.get(body, 0) + 1
            except OSError as e:        # its broker killed: a message read before
                if brokers[i].proc.poll() is None and c.addr_port == brokers[i].tcp_port:
                    errors.append(f"a live broker closed a consumer: {e}")
                c.close()
                cons[i] = _consumer(brokers[i].tcp)

    deadline = time.monotonic() + SOAK_S
    killed = False
    while time.monotonic() < deadline:
        consume_round(deadline)
        if not killed and time.monotonic() > deadline - SOAK_S / 2:
            brokers[0].proc.send_signal(signal.SIGKILL)
            brokers[0].proc.wait(30)
            brokers[0] = broker_factory()
            killed = True
    stop.set()
    for t in pubs + [adm]:
        t.join(30)
    sup.rebalance("bs")
    sup.play("bs")
    sup.play_subscription("bs", "c")
    end = time.monotonic() + 90
    last = 0.0
    while time.monotonic() < end:       # until FIN'd, all of it (a failed FIN: redelivered)
        consume_round(end, chaos=False)
        if time.monotonic() - last > 0.5:
            last = time.monotonic()
            st = sup.stats("bs")["subscriptions"]["c"]
            if not st["backlog"] and not st["in_flight"] and not st["delayed"] and acked <= set(finished):
                break
    st = sup.stats("bs")["subscriptions"]["c"]
    dlq = sup.dlq_list("bs", "c", limit=100000)
    missing = acked - set(finished)
    print(f"\nseed {seed}: acked {len(acked)} finished {len(finished)} dlq {len(dlq)} ops {len(sup_ops)} "
          f"errors {errors[:3]} stats {st['backlog'], st['in_flight'], st['delayed']}")
    assert errors == [], errors[:5]
    assert (st["backlog"], st["in_flight"], st["delayed"]) == (0, 0, 0), st
    assert acked and len(missing) <= len(dlq), \
        f"{len(missing)} acknowledged publishes never finished ({sorted(missing)[:5]}), dlq {len(dlq)}: {st}"
