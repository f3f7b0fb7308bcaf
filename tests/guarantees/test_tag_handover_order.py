"""Per-key order across tag-shard handovers, in real OS processes (the soak's consumer
role, ``tests/workers/soak.py``), driven by a seed.

Most messages carry dispatch tag ``g`` (keys of their own, pushed in order by one
thread of the test), the rest none. Two subscriptions: ``default`` exactly-once and
``alo`` ordered at-least-once (handlers ack, nak, term, overrun their lease at random),
each with consumer slots that the test restarts many times a second, each start
wanting the tag or not at random: so the tag's shards keep moving between tagged
consumers and the untagged ones they fall back to (a tagged consumer joining while
untagged ones hold or drain them, the last tagged one leaving or ``kill -9``'d), while
lease rounds, carried settlements, naks and expiries of the previous owner are in
flight; a rebalance now and then. Odd seeds run with fault injection.

Once drained: every logged message processed once exactly-once and handled (acked or
dead) at least once, and per shard key the first deliveries in log order (exactly-once:
commit order; ordered at-least-once: first handler calls, across processes).

    FDQ_TAG_ORDER_SEEDS=1-20 FDQ_TAG_ORDER_SECONDS=10 pytest -q tests/guarantees/test_tag_handover_order.py
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

import fdq
from fdq.headers import DISPATCH_TAG
from fdq.keyspace import Keyspace

from chaoshelpers import check_first_in_order, exactly_once_counts, handled, log_of, seeds
from fdqtest import counter_value, database_url, scan, wait_for

CHURN_S = float(os.environ.get("FDQ_TAG_ORDER_SECONDS", "3"))
SLOTS = {"default": ("eo", 3), "alo": ("alo", 3)}
KEYS = 6
FAULTS = 0.02


def _producer(db, rng, stop, pushed):
    """One thread: tagged keys ``g0..`` (80%) and untagged ``u0..``, singles and
    batches, so each key's pushes are in log order."""
    p = fdq.Producer(db)
    i = 0
    while not stop.is_set():
        envs = []
        for _ in range(rng.choice([1, 1, 3, 8])):
            tagged = rng.random() < 0.8
            key = f"{'g' if tagged else 'u'}{rng.randrange(KEYS)}"
            envs.append(fdq.Envelope(f"m{i}".encode(), shard_key=key,
                                     headers={DISPATCH_TAG: "g"} if tagged else None))
            i += 1
        pushed.extend(r.id for r in p.push_many("t", envs))
        time.sleep(rng.uniform(0, 0.01))


@pytest.mark.slow
@pytest.mark.parametrize("seed", seeds("FDQ_TAG_ORDER_SEEDS", [2]))
def test_tag_shard_handovers_keep_each_keys_order(tmp_path, cluster_factory, seed):
    rng = random.Random(seed)
    faults = seed % 2 == 1
    url = database_url(tmp_path / "fdq.db")
    db = fdq.connect(url)
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=rng.choice([2, 3]), extend=True)
    sup.create_subscription("t", "alo", fdq.SubscriptionConfig(ordered=True))
    cl = cluster_factory(url, "soak", faults, FAULTS, rng)

    slots, outs, n_starts = {}, {"default": [], "alo": []}, [0]

    def start(slot, sub, mode, tagged):
        n_starts[0] += 1
        out = tmp_path / f"{slot}.{n_starts[0]}.log"
        outs[sub].append(out)
        # the same id again half the time (a replacement), else a new one
        name = slot if rng.random() < 0.5 else f"{slot}-{n_starts[0]}"
        p = cl.start("consumer", name, out, "--mode", mode, "--sub", sub, *(["--tag"] if tagged else []))
        slots[slot] = [p, sub, mode, tagged]

    for sub, (mode, k) in SLOTS.items():
        for j in range(k):
            start(f"{sub}{j}", sub, mode, tagged=j == 0)
    for p, *_ in list(slots.values()):
        cl.wait_ready(p)

    stop, pushed = threading.Event(), []
    prod = threading.Thread(target=_producer, args=(db, random.Random(seed), stop, pushed), daemon=True)
    prod.start()
    moves = {"kill9": 0, "term": 0, "rebalance": 0}
    try:
        deadline = time.monotonic() + CHURN_S
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.05, 0.25))
            r = rng.random()
            if r < 0.1:
                sup.rebalance("t")
                moves["rebalance"] += 1
                continue
            slot = rng.choice(sorted(slots))
            p, sub, mode, tagged = slots[slot]
            if r < 0.65:
                cl.kill9(p)
                moves["kill9"] += 1
            else:
                os.kill(p.pid, signal.SIGTERM)      # a clean leave, not waited for: its shards move at once
                moves["term"] += 1
            # the tagged slot flips often: the tag's shards move with it
            start(slot, sub, mode, tagged=(not tagged) if rng.random() < 0.5 else tagged)
    finally:
        stop.set()
        prod.join(30)
    assert not prod.is_alive()

    # every slot's last start runs on, slot 0 wanting the tag and slot 1 not (untagged
    # shards are never a tagged consumer's: they need one that wants none)
    for sub, (mode, _k) in SLOTS.items():
        for j, tagged in ((0, True), (1, False)):
            slot = f"{sub}{j}"
            if slots[slot][3] != tagged:
                cl.kill9(slots[slot][0])
                start(slot, sub, mode, tagged=tagged)
    ts = Keyspace().topic("t")
    ids = set(pushed)

    def drained():
        st = sup.stats("t")["subscriptions"]
        return (all(s["backlog"] == s["in_flight"] == s["delayed"] == 0 for s in st.values())
                and len(scan(db, b"so/default/done/")) >= len(ids))
    wait_for(drained, 90, interval=0.2, what="both subscriptions to drain")
    for p, *_ in slots.values():
        cl.stop(p)
    log = [(mid, rec) for mid, rec in log_of(db, ts)]
    assert ids <= {mid for mid, _r in log}
    handovers = {sub: counter_value(db, ts.assignment_key(sub)) for sub in SLOTS}    # ownership changes
    print(f"\nseed {seed}: faults={faults} pushed={len(ids)} moves={moves} starts={n_starts[0]} "
          f"assignments={handovers}")
    assert min(handovers.values()) >= 5, "too few ownership changes to test anything"

    done = exactly_once_counts(db, b"so/default/done/")
    assert set(done) == {mid for mid, _r in log}, "exactly-once: missing or unknown"
    assert [m for m, n in done.items() if n != 1] == [], "exactly-once: processed more than once"
    eo_order = [bytes(v).decode() for _k, v in scan(db, b"so/default/order/")]
    check_first_in_order(log, {m: i for i, m in enumerate(eo_order)}, "exactly-once", at_least=len(ids) // 2)

    calls, _ = handled(outs["alo"])
    dead = {d["id"] for d in sup.dlq_list("t", "alo", limit=100000)}
    assert {mid for mid, _r in log} - set(calls) <= dead, "alo: neither handled nor dead"
    check_first_in_order(log, {m: min(t for t, _a, _o in v) for m, v in calls.items()}, "alo",
                         at_least=len(ids) // 2)
