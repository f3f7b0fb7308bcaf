"""What the randomized guarantee tests (``test_chaos.py``, ``test_soak.py``) share: their
seeds, worker processes restarted under a seed (with or without fault injection), a
reader that sees every log entry before a trim can delete it, the drain, and the checks
both make once drained."""
from __future__ import annotations

import collections
import json
import os
import random
import signal
import time
from pathlib import Path

import fdq
from fdq.keyspace import message_id

from fdqtest import database_url, Procs, read_lines, scan, with_faults


def seeds(env: str, default: list) -> list:
    """The seeds of ``$env`` (``a-b`` or a comma list), else ``default``."""
    spec = os.environ.get(env)
    if not spec:
        return default
    if "-" in spec:
        a, b = spec.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(s) for s in spec.split(",")]


def seeded_topic(tmp_path, seed: int):
    """The seed's random generator, whether it runs with fault injection (odd seeds), and
    a fresh database (url, db, supervisor) with topic ``t`` (2-8 shards, extend)."""
    rng = random.Random(seed)
    faults = seed % 2 == 1
    url = database_url(tmp_path / "fdq.db")
    db = fdq.connect(url)
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=rng.randint(2, 8), extend=True)
    return rng, faults, url, db, sup


class Cluster(Procs):
    """The worker processes of roles ``KIND-ROLE`` (``chaos`` or ``soak``), each started
    with a seed from ``rng`` and, with ``faults``, on a connection that injects faults
    at probability ``p`` (a seed of its own per start)."""

    def __init__(self, tmp: Path, url: str, kind: str, faults: bool, p: float, rng: random.Random):
        super().__init__(tmp, url)
        self.kind, self.faults, self.p, self.rng = kind, faults, p, rng
        self.n = 0

    def url_for(self):
        self.n += 1
        return with_faults(self.url, self.p, self.rng.randrange(1 << 30)) if self.faults else self.url

    def start(self, role, name, out, *args):
        url = self.url_for()
        return super().start(f"{self.kind}-{role}", name, "--seed", self.rng.randrange(1 << 30), *args, url=url,
                             out=out, err=self.tmp / f"{name}.{self.n}.err")


def log_of(db, ts):
    from fdq.log import iter_window, log_buckets
    return [(message_id(vs), rec) for vs, _b, rec in iter_window(db, ts, log_buckets(db, ts), None, None)]


class LogReader:
    """Every log entry read (trimmed since or not), and the longest time between two reads:
    each entry lives the trim age at least, so reads closer than that see every one."""

    def __init__(self, db, ts):
        self.db, self.ts = db, ts
        self.seen = {}                  # id -> record
        self.longest_gap, self.last = 0.0, time.monotonic()

    def read(self):
        for mid, rec in log_of(self.db, self.ts):
            self.seen.setdefault(mid, rec)
        now = time.monotonic()
        self.longest_gap, self.last = max(self.longest_gap, now - self.last), now

    def until_exit(self, p, timeout: float = 120):
        """Keep reading while ``p`` runs (up to ``timeout`` s)."""
        t_end = time.monotonic() + timeout
        while p.poll() is None and time.monotonic() < t_end:
            self.read()
            time.sleep(0.1)


def restart_producer(cl, prods, slot, budget, tmp_path, *args):
    """``kill -9`` the producer of ``slot`` and start the next generation with what is
    left of its ``budget`` (none: not restarted). ``prods[slot]``: [process, generation,
    [event logs]]. Returns whether it was running."""
    p, gen, outs = prods[slot]
    if p.poll() is not None:
        return False
    cl.kill9(p)
    left = budget - sum(len(read_lines(f)) for f in outs)
    if left > 0:
        out = tmp_path / f"p{slot}.{gen + 1}.log"
        outs.append(out)
        prods[slot] = [cl.start("producer", f"p{slot}", out, "--gen", gen + 1, "--count", left, *args), gen + 1, outs]
    return True


def wait_producers(cl, prods, reader):
    """The producers finish (or were killed after their last push), the log read meanwhile."""
    for slot in prods:
        p = prods[slot][0]
        reader.until_exit(p)
        rc = p.wait(timeout=1)
        assert rc == 0 or getattr(p, "killed", False), f"producer p{slot} exited {rc}: {cl.stderr(p)}"


def check_acknowledged_pushes(prods, in_log, stored_as_pushed, in_order: bool):
    """Every push a producer logged (it returned: acknowledged) is in the log
    (``in_log``: id -> record); a ``msg_id`` is stored under one id; a push that was not a
    duplicate is stored as pushed (``stored_as_pushed(logged, record)``) and, with
    ``in_order``, each producer run's ids come in its push order."""
    by_msg_id = collections.defaultdict(set)
    for slot in prods:
        for out in prods[slot][2]:
            last = None
            for line in read_lines(out):
                r = json.loads(line)
                assert r["id"] in in_log, f"acknowledged push {r} not in the log"
                if r["msg_id"] is not None:
                    by_msg_id[r["msg_id"]].add(r["id"])
                if not r["dup"]:
                    assert stored_as_pushed(r, in_log[r["id"]]), (r, in_log[r["id"]])
                    assert not in_order or last is None or r["id"] > last, f"p{slot}: ids out of push order at {r}"
                    last = r["id"]
    for m, got in by_msg_id.items():
        assert len(got) == 1, f"msg_id {m} stored as {got}"


def drained(sup, db, done_prefix: bytes, n: int) -> bool:
    """Nothing pending, in backlog, in flight or delayed; ``n`` exactly-once evidence counters."""
    st = sup.stats("t")
    if st["counters"]["pending"]:
        return False
    for s in st["subscriptions"].values():
        if s["backlog"] or s["in_flight"] or s["delayed"]:
            return False
    return len(scan(db, done_prefix)) >= n


def handled(paths):
    """{id: [(t_ns, attempts, outcome)]} and ids taken (at most once), per file list."""
    calls, taken = collections.defaultdict(list), set()
    for path in paths:
        for line in read_lines(path):
            parts = line.split(" ")
            if parts[0] == "H":
                calls[parts[2]].append((int(parts[1]), int(parts[3]), parts[4]))
            elif parts[0] == "T":
                taken.add(parts[1])
            elif parts[0] == "BAD":
                raise AssertionError(f"{path.name}: a large body delivered damaged: {line}")
    return calls, taken


def _order_keys(rec):
    return rec.shard_key is not None and not rec.shard_key.startswith("d-")


def check_first_in_order(log, first_t, what, at_least=1):
    """Per shard key, the first delivery times (``first_t``: id -> time) follow the log's
    order. Returns how many pairs (a message and the previous one of its key) were
    compared: at least ``at_least``, so that the check cannot pass on nothing."""
    last, compared = {}, 0
    for mid, rec in log:
        if not _order_keys(rec) or mid not in first_t:
            continue
        prev = last.get(rec.shard_key)
        assert prev is None or prev[1] < first_t[mid], \
            f"{what}: key {rec.shard_key}: {mid} first delivered before {prev[0]}, logged earlier"
        compared += prev is not None
        last[rec.shard_key] = (mid, first_t[mid])
    assert compared >= at_least, f"{what}: only {compared} ordered pairs to compare"
    return compared


def exactly_once_counts(db, prefix: bytes) -> dict:
    """{id: times processed} of the exactly-once evidence under ``prefix``."""
    return {k[len(prefix):].decode(): int.from_bytes(bytes(v)[:8], "little") for k, v in scan(db, prefix)}


def check_no_leftovers(st, db, ts):
    """The topic's emitted/acked the sums of its subscriptions'; no backlog, in-flight or
    delayed count; no ready, delayed or leased entry left in any queue."""
    c = st["counters"]
    subs = st["subscriptions"].values()
    assert c["emitted"] == sum(s["emitted"] for s in subs) and c["acked"] == sum(s["acked"] for s in subs), c
    for s in subs:
        assert (s["backlog"], s["in_flight"], s["delayed"]) == (0, 0, 0), s
    left = []
    for k, _v in scan(db, ts.subs.key()):
        t = ts.subs.unpack(k)
        if len(t) > 4 and t[1] == "shards" and t[4] in ("ready", "delayed", "leased"):
            left.append(t)
    assert left == [], f"left in queues: {left[:5]}"


def fetch_redriven(db, sub, dead) -> dict:
    """The redriven dead letters ``dead`` of ``sub``, each delivered once: {id: attempts}."""
    got = {}
    with fdq.Consumer(db, "t", subscription=sub, create=False, extend_support=True) as c:
        while len(got) < len(dead):
            ms = c.fetch(100, timeout=10)
            assert ms, f"{sub}: {len(got)} of {len(dead)} redriven dead letters delivered"
            c.ack_many(ms)
            for m in ms:
                assert m.id not in got, f"{sub}: redriven {m.id} delivered twice"
                got[m.id] = m.attempts
    return got


def stop_while_reading(cl, p, reader):
    """SIGTERM ``p`` (once ready) and read the log until it exits (it may still trim)."""
    cl.wait_ready(p, meanwhile=reader.read)
    os.kill(p.pid, signal.SIGTERM)

