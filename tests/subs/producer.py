"""A producer process: ``python producer.py URL TOPIC COUNT`` pushes COUNT messages in
batches of 10 with short pauses, printing a JSON list of ids at the end."""
import json
import sys
import time

import fdq


def main(url, topic, count):
    db = fdq.connect(url)
    p = fdq.Producer(db)
    ids = []
    for i in range(0, count, 10):
        ids += [r.id for r in p.push_many(topic, [fdq.Envelope(f"{j}".encode(), shard_key=f"k{j % 13}")
                                                  for j in range(i, min(count, i + 10))])]
        time.sleep(0.004)
    print(json.dumps(ids), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
