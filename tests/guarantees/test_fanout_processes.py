"""Two subscriptions on one topic, each with its own consumer processes; one consumer of
each is killed with SIGKILL mid-run. Every message is processed exactly once per
subscription (exactly-once mode) and at least once (acking mode)."""
import threading
import time

import pytest

import fdq
from fdq.keyspace import decode_counter

from fdqtest import wait_for
from workers.common import seen_key


N = 600


def counts(db, sub, ids):
    tr = db.create_transaction()
    fs = [tr.snapshot[seen_key(sub, i)] for i in ids]
    out = [decode_counter(f) for f in fs]
    tr.cancel()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exactly", "acking"])
def test_two_subscriptions_survive_kill9(db, url, workers, mode):
    sup = fdq.Supervisor(db)
    sup.create_topic("orders", shards=8)
    sup.create_subscription("orders", "billing")
    sup.create_subscription("orders", "analytics", fdq.SubscriptionConfig(deliver_policy="new"))
    procs = {sub: [workers.start("subs-consumer", f"{sub}-{i}", "--topic", "orders", "--sub", sub, "--mode", mode,
                                      wait_ready=True) for i in range(2)]
             for sub in ("billing", "analytics")}
    ids = []
    producer = fdq.Producer(db)
    killed = threading.Event()

    def push():
        for i in range(0, N, 20):
            if i == N // 2:         # the second half goes out after the kill, whatever the load
                killed.wait(120)
            ids.extend(r.id for r in producer.push_many(
                "orders", [fdq.Envelope(f"m{j}".encode(), shard_key=f"c{j % 31}") for j in range(i, i + 20)]))
            time.sleep(0.01)
    t = threading.Thread(target=push)
    t.start()
    # Kill one consumer of each subscription once both have processed something, while
    # the victim owns shards and the pushes go on: what lands on its shards after the
    # kill is processed only if the survivor takes them over.
    def victims_own_shards():
        subs = sup.stats("orders")["subscriptions"]
        return all(c["shards"] for s in procs for c in subs[s]["consumers"] if c["id"] == f"{s}-0")
    try:
        wait_for(lambda: len(ids) >= 100 and all(sum(counts(db, s, ids[:100])) > 10 for s in procs)
                 and victims_own_shards(), what="both subscriptions consuming, the victims owning shards")
        owned = {s: c["shards"] for s, st in sup.stats("orders")["subscriptions"].items() if s in procs
                 for c in st["consumers"] if c["id"] == f"{s}-0"}
        for sub in procs:
            workers.kill9(procs[sub][0])
    finally:
        killed.set()        # the pusher goes on (and ends) whatever happened
    assert all(owned.get(s) for s in procs), f"a victim owned no shard when killed: {owned}"
    t.join(timeout=120)
    assert not t.is_alive() and len(ids) == N and len(set(ids)) == N
    # The survivor of each subscription took over every shard, the victim's included.
    for sub in procs:
        wait_for(lambda: {sh["owner"] for sh in sup.stats("orders")["subscriptions"][sub]["shards"]}
                 == {f"{sub}-1"}, timeout=60, what=f"{sub}-1 owning every shard")

    def complete():
        return all(min(counts(db, s, ids)) >= 1 for s in procs)
    wait_for(complete, timeout=90, what="every message processed by both subscriptions")
    for sub in procs:
        c = counts(db, sub, ids)
        if mode == "exactly":
            assert c == [1] * N, f"{sub}: duplicates {[(i, n) for i, n in zip(ids, c) if n != 1][:5]}"
        else:
            assert min(c) >= 1
    st = sup.stats("orders")["subscriptions"]
    for sub in procs:
        wait_for(lambda: sup.stats("orders")["subscriptions"][sub]["backlog"] == 0, timeout=30,
                 what=f"{sub} backlog 0")
    # The default subscription got every message too and nobody consumed it.
    assert st["default"]["backlog"] == N
    for sub in procs:
        workers.term(procs[sub][1])
