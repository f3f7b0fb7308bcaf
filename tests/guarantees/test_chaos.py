"""Randomized chaos, driven by a seed, all in real OS processes (``tests/workers/chaos.py``).

One topic, four subscriptions fed by the same pushes: ``default`` consumed exactly-once
(the handler writes a marker per message in its transaction), ``alo`` (``ordered=True``)
and ``alu`` at-least-once (handlers ack, nak, term or sleep past their lease at random;
max_deliver 3; random batch sizes and handler threads), ``amo`` at-most-once. Two
producers push singles and batches, keyed and unkeyed, a few delayed, a few large
(split across keys), some ``msg_id``s pushed twice (by one producer or two). A supervisor process pauses,
plays, rebalances, reshards (``rebalance(shards=N)``), replays windows of the log,
redrives the dead letters of ``alo`` or ``alu`` (their handlers term some messages, others
die by max_deliver) and trims the log older than ``TRIM_AGE_S`` while consumers consume, at
random (the test reads the log often enough to see every entry before a trim can delete it).
The topic has extend support: some messages carry dispatch tag ``g`` (keys of their own),
and one consumer of ``default``, ``alo`` and ``alu`` each wants that tag (its shards go to
the untagged consumers while no consumer wanting it is live). Meanwhile the test ``kill -9``s a random producer, consumer or the supervisor
and restarts it (a killed play/rebalance/replay is run again by the restarted
supervisor); with some seeds every process uses the embedded engine's fault injection
(retryable errors, ``commit_unknown_result``, version jumps).

Then everything drains, and the invariants are checked against the "all" log (what was
stored; a push killed before its producer logged the result may or may not be there):

* every acknowledged push is in the log, a ``msg_id`` stored once, each producer's ids in
  its push order; ``inserted == routed ==`` the log's size;
* exactly-once: every logged message processed once; per shard key, in log order;
* at-least-once: every logged message handled; each one acked or in the DLQ (terminated
  only by a handler that said so); acked + dead == logged; emitted >= handler calls.
  Per shard key, first handler calls in log order: across consumers for the ordered
  subscription; within each consumer process (calls at attempt 1, a redriven message's
  new attempt 1 not counted) for the other. (Not
  across consumers there, by design: when a shard moves, its new owner leases the next
  messages while the old one may still be handling its leased batch, and the batch-mates
  of a handler that overran its ack wait are handed to it after their leases expired;
  only ``ordered=True`` holds a key's later messages back meanwhile.)
* at-most-once: nothing handled twice; missing only what a killed consumer took;
  first deliveries in log order per key;
* a consumer wanting tag ``g`` handled tagged messages only (untagged shards are never
  its);
* no lease, ready or delayed message left; backlog, in-flight, delayed counters 0; the
  topic's emitted/acked the sums of its subscriptions';
* dead letters counted exactly after the redrives and trims under way: a last redrive
  moves every listed dead letter, each delivered once more with its attempts reset,
  the DLQ counter 0 and acked == logged after.

Bounded for the suite (2 fixed seeds, ~10 s of chaos each). A soak:

    FDQ_CHAOS_SEEDS=100-139 FDQ_CHAOS_SECONDS=30 pytest -q tests/guarantees/test_chaos.py

(``FDQ_CHAOS_SEEDS``: ``a-b`` or a comma list; ``FDQ_CHAOS_SECONDS``: chaos per seed,
default 10; odd seeds run with fault injection, ``FDQ_CHAOS_FAULTS`` its probability,
default 0.02.) A failing seed leaves its evidence in the test's tmp directory: each
process's event log, ``supervisor.journal`` (operations with monotonic times) and stderr.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import time

import pytest

import fdq
from fdq.keyspace import Keyspace

from chaoshelpers import (check_acknowledged_pushes, check_first_in_order, check_no_leftovers, drained,
                          exactly_once_counts, fetch_redriven, handled, log_of, LogReader, restart_producer,
                          seeded_topic, seeds, stop_while_reading, wait_producers)
from fdqtest import read_lines, scan, wait_for


CHAOS_S = float(os.environ.get("FDQ_CHAOS_SECONDS", "10"))
PRODUCERS, BUDGET = 2, int(40 * CHAOS_S)      # messages per producer slot, over its restarts
CONSUMERS = (("default", "eo", 2), ("alo", "alo", 2), ("alu", "alo", 2), ("amo", "amo", 1))
TAGGED = {"default1", "alo1", "alu1"}       # consumer slots that want dispatch tag "g"
TAG_HEADER = "##client_dispatch_tag"
FAULTS = float(os.environ.get("FDQ_CHAOS_FAULTS", "0.02"))
TRIM_AGE_S = 5.0        # the supervisor trims log entries older than this


def _poll(cond, timeout):
    """Poll ``cond`` for up to ``timeout`` s (a chaos moment to aim at, not a must)."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.002)


@pytest.mark.slow
@pytest.mark.parametrize("seed", seeds("FDQ_CHAOS_SEEDS", [1, 2]))
def test_chaos(tmp_path, cluster_factory, seed):
    rng, faults, url, db, sup = seeded_topic(tmp_path, seed)
    sup.create_subscription("t", "alo", fdq.SubscriptionConfig(deliver_policy="all", ordered=True))
    sup.create_subscription("t", "alu", fdq.SubscriptionConfig(deliver_policy="all"))
    sup.create_subscription("t", "amo", fdq.SubscriptionConfig(deliver_policy="all"))
    cl = cluster_factory(url, "chaos", faults, FAULTS, rng)

    # -- start everything
    prods = {}          # slot -> [process, generation, [out files]]
    pace = ("--pace", CHAOS_S * 0.8, "--total", BUDGET)
    for i in range(PRODUCERS):
        out = tmp_path / f"p{i}.0.log"
        prods[i] = [cl.start("producer", f"p{i}", out, "--gen", 0, "--count", BUDGET, *pace), 0, [out]]
    cons = {}           # slot -> [process, sub, mode, [(process, out)]]
    for sub, mode, k in CONSUMERS:
        for j in range(k):
            slot = f"{sub}{j}"
            out = tmp_path / f"{slot}.0.log"
            p = cl.start("consumer", slot, out, "--mode", mode, "--sub", sub, *(["--tag"] if slot in TAGGED else []))
            cons[slot] = [p, sub, mode, [(p, out)]]
    journal = tmp_path / "supervisor.journal"
    supp = cl.start("supervisor", "s", journal, "--trim-age", TRIM_AGE_S)
    kills = collections.Counter()
    sup_lines = 0
    ts = Keyspace().topic("t")
    reader = LogReader(db, ts)

    # -- chaos: kill -9 and restart at random
    deadline = time.monotonic() + CHAOS_S
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.1, 0.7))     # pacing of the chaos, not a synchronisation
        reader.read()
        r = rng.random()
        if r < 0.2:
            if not restart_producer(cl, prods, rng.randrange(PRODUCERS), BUDGET, tmp_path, *pace):
                continue
            kills["producer"] += 1
        elif r < 0.55:
            slot = rng.choice(sorted(cons))
            p, sub, mode, runs = cons[slot]
            cl.kill9(p)
            kills[f"consumer-{mode}"] += 1
            name = slot if rng.random() < 0.5 else f"{slot}-{len(runs)}"   # rejoin as itself, or anew
            out = tmp_path / f"{slot}.{len(runs)}.log"
            p = cl.start("consumer", name, out, "--mode", mode, "--sub", sub, *(["--tag"] if slot in TAGGED else []))
            runs.append((p, out))
            cons[slot][0] = p
        elif len(read_lines(journal)) > sup_lines + 1:    # it got to work since its start
            if rng.random() < 0.6:      # aim at a long operation under way
                _poll(lambda: (read_lines(journal) or ["E"])[-1].startswith(('B ["rebalance", ', 'B ["replay"',
                                                                            'B ["play"')), 2.0)
            cl.kill9(supp)
            kills["supervisor"] += 1
            sup_lines = len(read_lines(journal))
            supp = cl.start("supervisor", "s", journal, "--trim-age", TRIM_AGE_S)

    # -- drain: producers finish, the supervisor stops, a final rebalance and play
    wait_producers(cl, prods, reader)       # the supervisor still trims meanwhile
    # the supervisor still trims and replays (new entries) until it stops
    stop_while_reading(cl, supp, reader)
    reader.until_exit(supp)
    cl.stop(supp, 1)
    reader.read()       # nothing more is written to the log, nor trimmed
    # each entry lived TRIM_AGE_S at least: read at least once if reads were closer
    assert reader.longest_gap < TRIM_AGE_S - 1, \
        f"the log was read {reader.longest_gap:.1f} s apart: a trimmed entry may be unseen"
    t_drain = time.monotonic()
    sup.rebalance("t")
    sup.play("t")
    config = sup.config("t")
    assert (config.paused, config.resharding_to) == (False, None), config

    log = sorted(reader.seen.items())   # ids sort in log order
    ids = [mid for mid, _r in log]
    wait_for(lambda: drained(sup, db, b"ch/done/", len(ids)), 120, interval=0.2, what="every subscription to drain")
    for p, _sub, _mode, _runs in cons.values():
        cl.wait_ready(p)
        cl.stop(p)
    jl = read_lines(journal)
    done_ops = collections.defaultdict(list)    # kind -> [result] of the operations that finished
    for a, b in zip(jl, jl[1:]):
        if a.startswith("B ") and b.startswith("E "):
            done_ops[json.loads(a[2:].rsplit(" ", 1)[0])[0]].append(json.loads(b.split(" ", 2)[2]))
    print(f"\nseed {seed}: faults={faults} logged={len(ids)} (trimmed {len(ids) - len(log_of(db, ts))}) "
          f"kills={dict(kills)} "
          f"supervisor ops={sum(1 for x in read_lines(journal) if x.startswith('B '))} "
          f"(killed mid-way: {sum(1 for a, b in zip(jl, jl[1:]) if a.startswith('B ') and b.startswith('B '))}; "
          f"redrives {len(done_ops['redrive'])} moving {sum(done_ops['redrive'])}, "
          f"trims {len(done_ops['trim'])} deleting {sum(done_ops['trim'])}) "
          f"drained in {time.monotonic() - t_drain:.1f}s")

    # -- pushes: every acknowledged push stored; msg_ids once; each producer's ids in order
    in_log = dict(log)
    assert len(in_log) == len(log), "one id logged twice"
    # a large body is stored in chunks (its delivery is checked: ch/bad)
    check_acknowledged_pushes(prods, in_log, lambda r, rec: rec.nchunks or rec.body.split(b"|")[0].decode() == r["body"],
                              in_order=True)
    stored_mids = collections.Counter(rec.msg_id for _m, rec in log if rec.msg_id is not None)
    assert not [m for m, n in stored_mids.items() if n > 1], "a msg_id stored twice"
    st = sup.stats("t")
    c = st["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (len(ids), len(ids), 0), c

    # -- exactly-once
    assert scan(db, b"ch/bad/") == [], "a large body delivered damaged"
    done = exactly_once_counts(db, b"ch/done/")
    assert set(done) == set(ids), f"eo: missing {len(set(ids) - set(done))}, unknown {len(set(done) - set(ids))}"
    assert [m for m, n in done.items() if n != 1] == [], "eo: processed more than once"
    eo_order = [bytes(v).decode() for _k, v in scan(db, b"ch/order/")]
    check_first_in_order(log, {m: i for i, m in enumerate(eo_order)}, "exactly-once")

    # -- at-least-once, ordered (first deliveries in order across consumers) and not
    # (first deliveries in order within each consumer process)
    _check_alo(sup, st, log, ids, [out for _p, out in cons["alo0"][3] + cons["alo1"][3]], "alo")
    outs = [out for _p, out in cons["alu0"][3] + cons["alu1"][3]]
    _check_alo(sup, st, log, ids, outs, "alu")
    # a message's first delivery is its earliest call; a redriven one starts again at
    # attempt 1, later, maybe in another process: not a first delivery
    all_calls, _ = handled(outs)
    first = {m: min(t for t, _a, _o in v) for m, v in all_calls.items()}
    compared = 0
    for out in outs:            # a run killed early may have handled too little to compare
        calls, _ = handled([out])
        compared += check_first_in_order(
            log, {m: t for m, v in calls.items() for t, a, _o in v if a == 1 and t == first[m]},
            f"alu {out.name}", at_least=0)
    assert compared > 0, "alu: no ordered pair compared in any consumer run"

    # -- dispatch tags: what a consumer wanting "g" handled was tagged "g"
    tagged = {m for m, rec in log if (rec.headers or {}).get(TAG_HEADER) == "g"}
    by_tag_consumers = set()
    for slot in TAGGED - {"default1"}:
        calls, _ = handled([out for _p, out in cons[slot][3]])
        assert set(calls) <= tagged, f"{slot} (tag g) handled untagged {sorted(set(calls) - tagged)[:5]}"
        by_tag_consumers |= set(calls)
    print(f"tagged {len(tagged)}, handled by tag consumers {len(by_tag_consumers)}")

    # -- at-most-once
    runs = cons["amo0"][3]
    calls, _ = handled([out for _p, out in runs])
    assert [m for m, v in calls.items() if len(v) > 1] == [], "amo: handled twice"
    lost_by_kill = set()
    for p, out in runs:
        if p.returncode == -signal.SIGKILL:
            h, taken = handled([out])
            lost_by_kill |= taken - set(h)
    missing = set(ids) - set(calls)
    assert missing <= lost_by_kill, f"amo: lost, never taken by a killed consumer: {sorted(missing - lost_by_kill)[:5]}"
    check_first_in_order(log, {m: v[0][0] for m, v in calls.items()}, "at-most-once")

    # -- counters and leftovers
    for sub in ("default", "amo"):
        s = st["subscriptions"][sub]
        assert (s["emitted"], s["acked"]) == (len(ids), len(ids)), (sub, s["emitted"], s["acked"])
    check_no_leftovers(st, db, ts)

    # -- dead letters: a last redrive moves each listed one; each delivered once more
    for sub in ("alo", "alu"):
        dead = {d["id"] for d in sup.dlq_list("t", sub, limit=100000)}
        before = sup.stats("t")["subscriptions"][sub]
        assert sup.dlq_redrive("t", sub) == len(dead) == before["dlq"], sub
        s = sup.stats("t")["subscriptions"][sub]
        assert (s["dlq"], s["backlog"], s["in_flight"]) == (0, len(dead), 0), (sub, s)
        got = fetch_redriven(db, sub, dead)
        assert set(got) == dead and set(got.values()) <= {1}, (sub, got)
        s = sup.stats("t")["subscriptions"][sub]
        assert (s["dlq"], s["backlog"], s["in_flight"], s["acked"]) == (0, 0, 0, len(ids)), (sub, s)


def _check_alo(sup, st, log, ids, outs, sub):
    calls, _ = handled(outs)
    assert set(calls) == set(ids), f"{sub}: never handled {sorted(set(ids) - set(calls))[:5]}"
    dlq = {d["id"]: d for d in sup.dlq_list("t", sub, limit=100000)}
    assert set(dlq) <= set(ids)
    for mid in ids:
        outcomes = {o for _t, _a, o in calls[mid]}
        if mid in dlq:
            if dlq[mid]["reason"].startswith("terminated"):
                assert "term" in outcomes, f"{sub}: {mid} terminated, no handler did: {calls[mid]}"
        else:
            assert outcomes & {"ack", "slow"}, f"{sub}: {mid} neither acked nor dead: {calls[mid]}"
    s = st["subscriptions"][sub]
    assert s["acked"] + len(dlq) == len(ids) and s["dlq"] == len(dlq), (sub, s["acked"], len(dlq), len(ids))
    assert s["emitted"] >= sum(len(v) for v in calls.values()), sub
    if sub == "alo":
        check_first_in_order(log, {m: min(t for t, _a, _o in v) for m, v in calls.items()}, sub)
