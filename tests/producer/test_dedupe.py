"""Deduplication by ``msg_id``: within the window a pushed id is stored once (even by
concurrent processes under faults), a duplicate reports the message it duplicates, and
a producer's skewed clock neither stalls cleanup nor stretches the window."""
from __future__ import annotations

import collections
import time

import fdq
from fdq.keyspace import Keyspace, parse_message_id
from fdq.keyspace.codec import Record

from fdqtest import kill_all, read_version, scan, with_faults


_SKEWED_PUSH = """
import sys, time
real = time.time
time.time = lambda: real() + float(sys.argv[2])
import fdq
p = fdq.Producer(fdq.connect(sys.argv[1]))
print(*[p.push("t", b"skewed", msg_id=m).id for m in sys.argv[3:]])
"""


_DEDUPE_WORKER = """
import json, sys, threading, fdq
url, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = fdq.Producer(fdq.connect(url))
out = {}
def run(t):
    for i in range(t, n, 4):      # 4 threads: auto-batched pushes of the shared ids
        r = p.push("t", f"{name}:{i}".encode(), msg_id=f"id-{i}")
        out[f"id-{i}"] = r.id
ths = [threading.Thread(target=run, args=(t,)) for t in range(4)]
[t.start() for t in ths]
[t.join(120) for t in ths]
rs = p.push_many("t", [fdq.Envelope(f"{name}:many{i}".encode(), msg_id=f"m-{i}") for i in range(n)])
out.update({f"m-{i}": r.id for i, r in enumerate(rs)})
print(json.dumps(out))
"""


def test_a_producer_clock_days_ahead_neither_stalls_dedupe_cleanup_nor_stretches_the_window(db, url):
    # Dedupe entries keep their producer's clock (so a version jump cannot shorten the
    # window). A producer whose clock is a day ahead must not make its entry young for
    # a day: trim stopped at it (cleanup of every later id stalled) and the id counted
    # as a duplicate for a day.
    import subprocess
    import sys
    from fdqtest import wait_for
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1, dedupe_window_s=0.5)
    out = subprocess.run([sys.executable, "-c", _SKEWED_PUSH, url, str(86400), "id-skewed", "id-only-skewed"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first = out.stdout.split()[0]
    p = fdq.Producer(db)
    for i in range(5):
        p.push("t", b"x", msg_id=f"id-{i}")
    ts = Keyspace().topic("t")
    first_version = int(first[:16], 16)
    wait_for(lambda: read_version(db) - first_version > 600_000,
             timeout=10, what="the window to pass by versions")
    # Past the window by versions and by this producer's clock: the id is new again
    # (and id-only-skewed, never pushed again, must not stop the cleanup below).
    r = p.push("t", b"again", msg_id="id-skewed")
    assert not r.duplicate and r.id != first

    def cleaned():
        sup.trim("t")
        return not scan(db, ts.dedupe.key()) and not scan(db, ts.dedupe_by_version.key())
    wait_for(cleaned, timeout=10, what="trim to expire every dedupe entry past its window", interval=0.2)


def test_the_same_msg_ids_pushed_by_concurrent_processes_under_faults_are_stored_once(db, url):
    import json
    import subprocess
    import sys
    fdq.Supervisor(db).create_topic("t", shards=4, dedupe_window_s=600)
    n = 150
    procs = [subprocess.Popen([sys.executable, "-c", _DEDUPE_WORKER, with_faults(url, 0.2, s),
                               f"p{s}", str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in range(3)]
    outs = []
    try:
        for pr in procs:
            so, se = pr.communicate(timeout=300)
            assert pr.returncode == 0, se[-2000:]
            outs.append(json.loads(so))
    finally:
        kill_all(procs)
    ts = Keyspace().topic("t")
    recs = [Record.decode(v) for _k, v in scan(db, ts.log.key())]
    per_id = collections.Counter(r.msg_id for r in recs)
    assert len(per_id) == 2 * n and max(per_id.values()) == 1, per_id.most_common(3)
    for mid in outs[0]:
        assert outs[0][mid] == outs[1][mid] == outs[2][mid], mid    # every process was told the stored id


def test_a_deduplicated_push_reports_the_shard_of_the_message_it_duplicates(db):
    """A push deduplicated by ``msg_id`` returned the first message's id but the shard
    of its own would-be placement (for a message without a shard key, any shard):
    ``PushResult`` then named a shard the message is not in."""
    fdq.Supervisor(db).create_topic("t", shards=16)
    p = fdq.Producer(db)
    firsts = [p.push("t", b"x", msg_id=f"id-{i}") for i in range(8)]
    for i, first in enumerate(firsts):
        again = p.push("t", b"x", msg_id=f"id-{i}")
        assert (again.id, again.shard, again.duplicate) == (first.id, first.shard, True)
    # duplicates within one transaction too
    rs = p.push_many("t", [fdq.Envelope(b"y", msg_id="same")] + [fdq.Envelope(b"z")] * 300
                     + [fdq.Envelope(b"y", msg_id="same")])
    assert (rs[-1].id, rs[-1].shard, rs[-1].duplicate) == (rs[0].id, rs[0].shard, True)
    # and that shard is where the message is queued
    ts = Keyspace().topic("t")
    for r in firsts + rs[:1]:
        key = ts.shard("default", "", r.shard).ready_key(parse_message_id(r.id))
        assert db[key] != None, r  # noqa: E711


def test_dedupe_window(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, dedupe_window_s=1.0)
    p = fdq.Producer(db)
    r1 = p.push("t", b"a", msg_id="order-1")
    r2 = p.push("t", b"a again", msg_id="order-1")
    assert r2.duplicate and r2.id == r1.id and not r1.duplicate
    rs = p.push_many("t", [fdq.Envelope(b"b", msg_id="order-2"), fdq.Envelope(b"b", msg_id="order-2")])
    assert not rs[0].duplicate and rs[1].duplicate and rs[1].id == rs[0].id
    assert sup.stats("t")["counters"]["inserted"] == 2
    time.sleep(1.2)    # past the window: the id is new again
    r3 = p.push("t", b"a later", msg_id="order-1")
    assert not r3.duplicate and r3.id != r1.id
    assert sup.stats("t")["counters"]["inserted"] == 3
    ts = Keyspace().topic("t")
    assert len(scan(db, ts.dedupe.key())) == 2
    sup.trim("t")      # order-1's first entry expired, but the id was pushed again since:
    r4 = p.push("t", b"a again", msg_id="order-1")    # its new entry must survive the trim
    assert r4.duplicate and r4.id == r3.id
    time.sleep(1.2)
    sup.trim("t")      # expired dedupe entries are cleaned
    assert scan(db, ts.dedupe.key()) == [] and scan(db, ts.dedupe_by_version.key()) == []
