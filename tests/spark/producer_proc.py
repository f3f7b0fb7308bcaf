"""A producer process for the Spark tests: pushes ``count`` messages with push_many and
writes what it pushed (id, body, shard key, headers) as JSON lines.

    producer_proc.py URL TOPIC PROC COUNT BATCH PAUSE_MS OUT
"""
import base64
import json
import sys
import time

import fdq


def message(proc: int, i: int) -> fdq.Envelope:
    body = f"p{proc}-m{i}-".encode() + bytes([i % 251]) * (i % 40)
    key = f"k{i % 50}" if i % 10 else None
    headers = None
    if i % 3 == 0:
        headers = {"proc": proc, "i": i, "kind": "a" if i % 2 else "b", "tags": ["x", i % 7]}
    return fdq.Envelope(body, shard_key=key, headers=headers)


def main():
    url, topic, proc, count, batch, pause_ms, out = sys.argv[1:8]
    proc, count, batch, pause_ms = int(proc), int(count), int(batch), int(pause_ms)
    db = fdq.connect(url)
    p = fdq.Producer(db)
    with open(out, "w") as f:
        for start in range(0, count, batch):
            envs = [message(proc, i) for i in range(start, min(count, start + batch))]
            for env, r in zip(envs, p.push_many(topic, envs)):
                f.write(json.dumps({"id": r.id, "body": base64.b64encode(env.body).decode(),
                                    "shard_key": env.shard_key,
                                    "headers": dict(env.headers) if env.headers else None}) + "\n")
            f.flush()
            if pause_ms:
                time.sleep(pause_ms / 1000)


if __name__ == "__main__":
    main()
