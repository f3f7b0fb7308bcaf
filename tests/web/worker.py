"""A consumer in its own OS process for the dashboard's tests (``kill -9`` by PID):
``python worker.py URL TOPIC ID LOG [options]``.

At-least-once ``fdq.tail`` of the topic's default subscription. Each delivery appends
``got BODY ATTEMPTS ID`` to LOG (``O_APPEND``, unbuffered: a line written survives a
kill), then ``ack BODY`` once handled. A body starting with ``poison`` raises (a nak:
dead-lettered after ``--max-deliver``) until the file ``--cure`` exists. SIGTERM: a
clean shutdown (leaves its shards)."""
from __future__ import annotations

import argparse
import os
import signal
import threading


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("topic")
    ap.add_argument("id")
    ap.add_argument("log")
    ap.add_argument("--heartbeat-s", type=float, default=0.3)
    ap.add_argument("--zombie-timeout-s", type=float, default=1.0)
    ap.add_argument("--max-deliver", type=int, default=5)
    ap.add_argument("--cure", default=None)
    args = ap.parse_args()

    import fdq
    fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def handle(msg):
        body = msg.body.decode()
        os.write(fd, f"got {body} {msg.attempts} {msg.id}\n".encode())
        if body.startswith("poison") and not (args.cure and os.path.exists(args.cure)):
            raise RuntimeError(f"cannot handle {body}")
        os.write(fd, f"ack {body}\n".encode())

    config = fdq.ConsumerConfig(heartbeat_interval_s=args.heartbeat_s, zombie_timeout_s=args.zombie_timeout_s,
                                max_deliver=args.max_deliver, poll_interval_s=0.05,
                                lease_check_interval_s=0.1, ack_wait_s=10)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    consumer = fdq.tail(fdq.connect(args.url), args.topic, handle, consumer_id=args.id, config=config,
                        on_error=lambda e: None)
    stop.wait()
    consumer.shutdown()


if __name__ == "__main__":
    main()
