"""The maintenance's holder killed with ``kill -9`` while it trims: the ``log_bytes``
counter still equals the log's bytes, the ``trimmed`` counter its deleted entries, and
the next holder finishes the trim."""
import fdq
from fdq.keyspace import Keyspace

from fdqtest import log_bytes, scan, wait_for

ARGS = ("--mode", "alo", "--hb", 0.2, "--zombie", 1.5)


def test_holder_killed_mid_trim_leaves_the_counters_exact(procs, db, sup):
    sup.create_topic("t", shards=4, retention_messages=10)
    ts = Keyspace().topic("t")
    p = fdq.Producer(db)
    for i in range(10):
        p.push_many("t", [fdq.Envelope(b"m%d-%d" % (i, j) * 20) for j in range(300)])
    a = procs.start("consumer", "a", *ARGS, wait_ready=True)
    wait_for(lambda: sup.stats("t")["maintenance"]["trimmed"] > 0, 60, what="a trimming")
    procs.kill9(a)
    counters = sup.stats("t")["counters"]
    assert counters["log_bytes"] == log_bytes(db, ts)
    entries = len(scan(db, ts.log.key()))
    assert entries == counters["inserted"] - counters["trimmed"]
    procs.start("consumer", "b", *ARGS, wait_ready=True)
    wait_for(lambda: (c := sup.stats("t")["counters"])["inserted"] - c["trimmed"] <= 10, 60, what="b finishing")
    assert sup.stats("t")["counters"]["log_bytes"] == log_bytes(db, ts)
