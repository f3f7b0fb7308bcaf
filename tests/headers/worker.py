"""A consumer process for the tag-dispatch tests.

argv: db_url topic consumer_id tag events_path options_json. Consumes at least once and
appends a JSON line per delivery (unbuffered, O_APPEND) to events_path. A body of
b"hang" makes a tagged worker's handler block, so the message stays leased until the
process is killed. SIGTERM leaves the subscription cleanly.
"""
import json
import os
import signal
import sys
import threading

import fdq


def main():
    url, topic, cid, tag, path, opts = sys.argv[1:7]
    opts = json.loads(opts)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    lock = threading.Lock()

    def emit(**event):
        with lock:
            os.write(fd, (json.dumps(event) + "\n").encode())

    def handler(m):
        emit(event="delivered", consumer=cid, id=m.id, body=m.body.decode(), tag=m.tag,
             header_tag=m.headers.get("##client_dispatch_tag"), attempts=m.attempts)
        if m.body == b"hang" and tag:
            threading.Event().wait(600)

    db = fdq.connect(url)
    config = fdq.ConsumerConfig(**opts)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    c = fdq.tail(db, topic, handler, consumer_id=cid, config=config, extend_support=True,
                 desired_tag=tag or None, batch_size=10)
    emit(event="ready", consumer=cid)
    deadline = 600
    while not stop.wait(0.2) and deadline > 0:   # bounded: a worker never outlives a test run
        deadline -= 0.2
    c.shutdown()


if __name__ == "__main__":
    main()
