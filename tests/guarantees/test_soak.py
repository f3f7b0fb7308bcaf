"""A soak of features at once, in real OS processes (``tests/workers/soak.py``), driven by a seed.

Where ``test_chaos.py`` runs one supervisor and tail consumers, this one runs, all at
once: producers pushing from threads through auto-batching (``linger_ms``) and with
``push_many`` (keys, unkeyed, delayed, shared ``msg_id``s, dispatch tag ``g``, a
``color`` header); two supervisor processes at once (pause, play, rebalance, reshard,
replay, trim, pause/play of single subscriptions, reset, update, DLQ redrive); and
subscriptions: ``default`` exactly-once (tail), ``alo`` ordered at-least-once by tail
consumers and a pull consumer (``fetch``: ack, ack_many, nak(delay), term,
in_progress, leases left to expire), ``aio`` at-least-once by ``fdq.aio.tail``, ``flt``
(``filter_headers`` color=red, ``max_ack_pending`` 3), and ``rst`` (exactly-once) and
``rsa`` (at-least-once), which are also ``reset`` (rewound or skipped to now) at random.
The test ``kill -9``s and restarts producers, consumers and supervisors at random; odd
seeds run with fault injection.

Checked once drained: every acknowledged push stored, ``msg_id``s once, ``inserted ==
routed ==`` the log; exactly-once: each logged message once, first deliveries in log
order per key; at-least-once subscriptions: each (filter-matching) message handled,
acked or dead, ``acked + dlq ==`` expected, no filtered one handled, ``filtered``
counts the others; ``alo``: first deliveries in log order per key across consumers;
with resets: what was pushed after the last one handled (exactly-once: once); each
shard's counters equal its queues, in one read, every moment the test looks and at
the end; the log's ``log_bytes`` its size; no queue entry, lease or counter left; a
last redrive delivers each dead letter once.

    FDQ_SOAK_SEEDS=1-10 FDQ_SOAK_SECONDS=30 pytest -q -s tests/guarantees/test_soak.py
"""
from __future__ import annotations

import collections
import json
import os
import time

import pytest

import fdq
from fdq.keyspace import decode_counter, Keyspace

from chaoshelpers import (check_acknowledged_pushes, check_first_in_order, check_no_leftovers, drained,
                          exactly_once_counts, fetch_redriven, handled, log_of, LogReader, restart_producer,
                          seeded_topic, seeds, stop_while_reading, wait_producers)
from fdqtest import log_bytes, read_lines, scan, wait_for


SOAK_S = float(os.environ.get("FDQ_SOAK_SECONDS", "10"))
PRODUCERS, BUDGET = 3, int(30 * SOAK_S)
# (sub, mode, slot count, tagged slot)
CONSUMERS = (("default", "eo", 3), ("rst", "eo", 2), ("alo", "alo", 2), ("alo", "fetch", 1), ("aio", "aio", 2), ("flt", "alo", 2), ("rsa", "alo", 1))
TAGGED = {"default-eo1", "alo-alo1", "aio-aio1"}
SUBS = ("default", "alo", "aio", "flt", "rst", "rsa")
TRIM_AGE_S = 5.0
FAULTS = float(os.environ.get("FDQ_CHAOS_FAULTS", "0.02"))     # as the chaos test


def _filtered(db, ts, sub):
    total = 0
    for k, v in scan(db, ts.subs.key()):
        t = ts.subs.unpack(k)
        if t[0] == sub and len(t) == 6 and t[1] == "shards" and t[4] == "stats" and t[5] == "filtered":
            total += decode_counter(v)
    return total


def _check_shard_counters(db, ts) -> int:
    """In one read (a consistent snapshot, at any moment of the soak): each shard's
    ``in_flight`` and ``delayed`` counters equal its leased and delayed entries, and
    ``routed - done`` its ready, delayed and leased ones. Returns the shards checked."""
    from fdq.keyspace.codec import decode_leases
    r = ts.subs.range()
    for _attempt in range(20):
        tr = db.create_transaction()
        try:
            rows = list(tr.snapshot.get_range(r.start, r.stop))
            break
        except fdq.FDQError:
            continue
    found = collections.defaultdict(collections.Counter)
    for k, v in rows:
        t = ts.subs.unpack(k)
        if len(t) < 6 or t[1] != "shards":
            continue
        shard, area = t[:4], t[4]
        if area == "stats":
            found[shard]["c_" + t[5]] += decode_counter(v)
        elif area == "leased":
            found[shard]["leased"] += len(decode_leases(k, v).entries)
        elif area in ("ready", "delayed"):
            found[shard][area] += 1
    for shard, c in found.items():
        assert c["c_in_flight"] == c["leased"], (shard, dict(c))
        assert c["c_delayed"] == c["delayed"], (shard, dict(c))
        assert c["c_routed"] - c["c_done"] == c["ready"] + c["delayed"] + c["leased"], (shard, dict(c))
    return len(found)


@pytest.mark.slow
@pytest.mark.parametrize("seed", seeds("FDQ_SOAK_SEEDS", [1]))
def test_soak(tmp_path, cluster_factory, seed):
    rng, faults, url, db, sup = seeded_topic(tmp_path, seed)
    sup.create_subscription("t", "alo", fdq.SubscriptionConfig(ordered=True))
    sup.create_subscription("t", "aio", fdq.SubscriptionConfig())
    sup.create_subscription("t", "flt", fdq.SubscriptionConfig(filter_headers={"color": "red"},
                                                               max_ack_pending=3))
    sup.create_subscription("t", "rst", fdq.SubscriptionConfig(ack_policy="none"))
    sup.create_subscription("t", "rsa", fdq.SubscriptionConfig())
    cl = cluster_factory(url, "soak", faults, FAULTS, rng)

    prods = {}
    for i in range(PRODUCERS):
        out = tmp_path / f"p{i}.0.log"
        prods[i] = [cl.start("producer", f"p{i}", out, "--gen", 0, "--count", BUDGET, "--pace", SOAK_S * 0.8),
                    0, [out]]
    cons = {}
    for sub, mode, k in CONSUMERS:
        for j in range(k):
            slot = f"{sub}-{mode}{j}"
            out = tmp_path / f"{slot}.0.log"
            tag = ["--tag"] if slot in TAGGED else []
            p = cl.start("consumer", slot, out, "--mode", mode, "--sub", sub, *tag)
            cons[slot] = [p, sub, mode, [(p, out)], tag]
    sups = {}
    for i in range(2):
        journal = tmp_path / f"s{i}.journal"
        sups[i] = [cl.start("supervisor", f"s{i}", journal, "--trim-age", TRIM_AGE_S, "--subs", ",".join(SUBS)),
                   journal, 0]
    kills = collections.Counter()
    ts = Keyspace().topic("t")
    reader = LogReader(db, ts)

    deadline = time.monotonic() + SOAK_S
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.1, 0.6))
        reader.read()
        _check_shard_counters(db, ts)
        r = rng.random()
        if r < 0.15:
            if not restart_producer(cl, prods, rng.randrange(PRODUCERS), BUDGET, tmp_path,
                                    "--pace", max(0.1, deadline - time.monotonic()) * 0.8):
                continue
            kills["producer"] += 1
        elif r < 0.6:
            slot = rng.choice(sorted(cons))
            p, sub, mode, runs, tag = cons[slot]
            cl.kill9(p)
            kills[f"consumer-{mode}"] += 1
            name = slot if rng.random() < 0.5 else f"{slot}-{len(runs)}"
            out = tmp_path / f"{slot}.{len(runs)}.log"
            p = cl.start("consumer", name, out, "--mode", mode, "--sub", sub, *tag)
            runs.append((p, out))
            cons[slot][0] = p
        else:
            i = rng.randrange(2)
            p, journal, n0 = sups[i]
            if len(read_lines(journal)) > n0 + 1:
                cl.kill9(p)
                kills["supervisor"] += 1
                sups[i] = [cl.start("supervisor", f"s{i}", journal, "--trim-age", TRIM_AGE_S,
                                    "--subs", ",".join(SUBS)), journal, len(read_lines(journal))]

    wait_producers(cl, prods, reader)
    for i in sups:
        stop_while_reading(cl, sups[i][0], reader)
    for i in sups:
        reader.until_exit(sups[i][0])
        cl.stop(sups[i][0], 1)
    reader.read()
    assert reader.longest_gap < TRIM_AGE_S - 1, f"the log was read {reader.longest_gap:.1f} s apart"
    t_drain = time.monotonic()
    sup.rebalance("t")
    sup.play("t")
    for sub in SUBS:
        sup.play_subscription("t", sub)
    from fdq.ops.catchup import catch_up
    catch_up(db, ts, "rst")     # a reset a kill or a pause left midway
    catch_up(db, ts, "rsa")
    config = sup.config("t")
    assert (config.paused, config.resharding_to, config.paused_subs, config.catchup) == (False, None, (), ()), config

    log = sorted(reader.seen.items())
    ids = [mid for mid, _r in log]
    red = [mid for mid, rec in log if (rec.headers or {}).get("color") == "red"]
    try:
        wait_for(lambda: drained(sup, db, b"so/default/done/", len(ids)), 120, interval=0.2, what="every subscription to drain")
    except AssertionError:
        st = sup.stats("t")
        raise AssertionError(f"not drained: {json.dumps({s: {k: v[k] for k in ('backlog', 'in_flight', 'delayed', 'paused')} for s, v in st['subscriptions'].items()})} "
                             f"{st['counters']} eo done {len(scan(db, b'so/default/done/'))} of {len(ids)}")
    for p, *_rest in cons.values():
        cl.wait_ready(p)
        cl.stop(p)
    journals = {i: read_lines(sups[i][1]) for i in sups}
    ops = collections.Counter()
    resets = {}     # sub -> wall times (ms) at which its resets ended
    for jl in journals.values():
        for a, b in zip(jl, jl[1:]):
            if a.startswith("B ") and b.startswith("E "):
                op = json.loads(a[2:].rsplit(" ", 1)[0])
                ops[op[0] + ("!" if "ConfigError" in b else "")] += 1
                if op[0] == "reset":
                    resets.setdefault(op[2] if len(op) > 2 else "rst", []).append(int(b.split(" ")[2]))
    print(f"\nseed {seed}: faults={faults} logged={len(ids)} red={len(red)} (trimmed {len(ids) - len(log_of(db, ts))}) "
          f"kills={dict(kills)} ops={dict(ops)} drained in {time.monotonic() - t_drain:.1f}s")

    # -- pushes
    in_log = dict(log)
    check_acknowledged_pushes(prods, in_log, lambda r, rec: rec.body.decode() == r["body"], in_order=False)
    st = sup.stats("t")
    c = st["counters"]
    assert (c["inserted"], c["routed"], c["pending"]) == (len(ids), len(ids), 0), c

    # -- exactly-once
    done = exactly_once_counts(db, b"so/default/done/")
    assert set(done) == set(ids), f"eo: missing {sorted(set(ids) - set(done))[:5]}, unknown {sorted(set(done) - set(ids))[:5]}"
    assert [m for m, n in done.items() if n != 1] == [], "eo: processed more than once"
    eo_order = [bytes(v).decode() for _k, v in scan(db, b"so/default/order/")]
    check_first_in_order(log, {m: i for i, m in enumerate(eo_order)}, "exactly-once")
    s = st["subscriptions"]["default"]
    assert (s["emitted"], s["acked"]) == (len(ids), len(ids)), s

    # -- exactly-once with resets: what was pushed after the last reset ended, once;
    # nothing more often than once per reset plus one; counters as the deliveries
    rdone = exactly_once_counts(db, b"so/rst/done/")
    assert set(rdone) <= set(ids), "rst: unknown ids"
    after = [m for m, rec in log if rec.ts_ms > max(resets.get("rst", []), default=0) + 500]
    assert [m for m in after if rdone.get(m) != 1] == [], f"rst: after the last reset, not once ({resets})"
    assert max(rdone.values(), default=0) <= 1 + len(resets.get("rst", [])), "rst: delivered too often"
    s = st["subscriptions"]["rst"]
    assert s["emitted"] == s["acked"] == sum(rdone.values()), (s, sum(rdone.values()))

    # -- at-least-once subscriptions
    def outs(sub):
        return [out for p, s, _m, runs, _t in cons.values() if s == sub for _p, out in runs]
    for sub, expected in (("alo", ids), ("aio", ids), ("flt", red)):
        calls, _ = handled(outs(sub))
        assert set(calls) == set(expected), \
            f"{sub}: never handled {sorted(set(expected) - set(calls))[:5]}, unexpected {sorted(set(calls) - set(expected))[:5]}"
        dlq = {d["id"]: d for d in sup.dlq_list("t", sub, limit=100000)}
        assert set(dlq) <= set(expected), sub
        for mid in expected:
            outcomes = {o for _t, _a, o in calls[mid]}
            if mid in dlq:
                if dlq[mid]["reason"].startswith("terminated") or "soak term" in dlq[mid]["reason"]:
                    assert "term" in outcomes, f"{sub}: {mid} terminated, no handler did: {calls[mid]} {dlq[mid]}"
            else:
                assert outcomes & {"ack", "slow", "inprog"}, f"{sub}: {mid} neither acked nor dead: {calls[mid]}"
        s = st["subscriptions"][sub]
        assert s["acked"] + len(dlq) == len(expected) and s["dlq"] == len(dlq), (sub, s["acked"], len(dlq), len(expected))
        assert s["emitted"] >= sum(len(v) for v in calls.values()), (sub, s["emitted"])
        if sub == "alo":
            check_first_in_order(log, {m: min(t for t, _a, _o in v) for m, v in calls.items()}, sub)
    assert _filtered(db, ts, "flt") == len(ids) - len(red), (_filtered(db, ts, "flt"), len(ids), len(red))
    # at-least-once with resets: what was pushed after the last one ended, handled
    calls, _ = handled(outs("rsa"))
    after = [m for m, rec in log if rec.ts_ms > max(resets.get("rsa", []), default=0) + 500]
    assert [m for m in after if m not in calls] == [], f"rsa: after the last reset, never handled ({resets})"

    # -- counters and leftovers
    assert _check_shard_counters(db, ts)
    assert c["log_bytes"] == log_bytes(db, ts), (c["log_bytes"], log_bytes(db, ts))
    check_no_leftovers(st, db, ts)

    # -- dead letters: a last redrive delivers each once more
    for sub, expected in (("alo", ids), ("aio", ids), ("flt", red), ("rsa", None)):
        dead = {d["id"] for d in sup.dlq_list("t", sub, limit=100000)}
        assert sup.dlq_redrive("t", sub) == len(dead), sub
        got = fetch_redriven(db, sub, dead)
        assert set(got) == dead, sub
        s = sup.stats("t")["subscriptions"][sub]
        assert (s["dlq"], s["backlog"], s["in_flight"]) == (0, 0, 0), (sub, s)
        assert expected is None or s["acked"] == len(expected), (sub, s)
