"""A consumer process for the subscription tests: ``python worker.py URL TOPIC SUB MODE NAME``.

MODE ``exactly``: exactly-once; the handler counts each message id in its dequeue
transaction (``subs/<sub>/seen/<id>``). MODE ``acking``: at-least-once; the handler
counts the id in its own transaction, then the message is acked. Runs until SIGTERM
(clean leave) or SIGKILL. Prints "ready" once it has joined.
"""
import signal
import sys
import threading

import fdq

ONE = (1).to_bytes(8, "little")
FAST = dict(heartbeat_interval_s=0.2, zombie_timeout_s=1.5, lease_check_interval_s=0.2,
            poll_interval_s=0.1, ack_wait_s=3.0)


def seen_key(sub, mid):
    return f"subs-test/{sub}/seen/{mid}".encode()


def main(url, topic, sub, mode, name):
    db = fdq.connect(url)
    if mode == "exactly":
        def handler(tr, m):
            tr.add(seen_key(sub, m.id), ONE)
        c = fdq.tail(db, topic, handler, transactional=True, consumer_id=name, subscription=sub,
                     config=fdq.ConsumerConfig(**FAST), batch_size=20, create=False)
    else:
        @fdq.transactional
        def record(tr, mid):
            tr.add(seen_key(sub, mid), ONE)

        def handler(m):
            record(db, m.id)
        c = fdq.tail(db, topic, handler, consumer_id=name, subscription=sub,
                     config=fdq.ConsumerConfig(**FAST), batch_size=20, create=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    print("ready", flush=True)
    while not stop.wait(0.1):
        pass
    c.shutdown()
    print("left", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:6])
