"""Hot spots on a FoundationDB cluster: which keys and append points a workload's
transactions share, recorded through FoundationDB's official binding.

A cluster keeps a contiguous key range on one storage team. A key that every push writes,
or one place where versionstamped keys are appended (an *append point*: every new key
lands at its end), stays on one team however many machines are added. This runs a small
workload against ``fdb://`` through the binding over the libfdb_c stand-in of
``tests/standin`` (its ``Library.recorder`` sees every committed transaction's
``fdb_transaction_*`` calls) and reports:

* per exact key and per key family (tuple-decoded, the variable parts shown as
  ``<topic>``, ``<sub>``, ``<id>``, ``<n>``, ``<vs>``, ``<bytes>``): the share of a
  phase's write transactions that write it, and its writes and bytes per second at
  ``--rate`` messages per second (heartbeat phases: per ``--consumers`` consumers),
  flagged above ``--team-writes`` / ``--team-bytes``;
* per append point (the prefix of a versionstamped key): the same, and per append family
  how many partitions (distinct prefixes) the workload used;
* the families every transaction reads with a conflict (one resolver range they all hold);
* a simulated data distribution: the written key space, sorted, cut into shards by write
  rate (a single key or one append point cannot split), placed on ``--teams`` teams;
* the machine-independent ratios CI checks (``tests/bench/test_hotspots.py``).

Run from the repository root: ``python -m bench.hotspots [--quick] [--json | --markdown]``.
The default team figures (20,000 mutations/s, 30 MB/s) are rough estimates of one FDB
storage team, not measurements: pass your own.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))   # standin (the libfdb_c stand-in)
sys.path.insert(0, ROOT)

from fdb import tuple as fdbtuple  # noqa: E402 - (fdb.tuple does not load the client library)
from fdb.tuple import Versionstamp  # noqa: E402

from bench._common import FAST, machine, progress  # noqa: E402

# fdq, fdq.keyspace and standin are imported in the functions that use them: the stand-in
# must be installed before anything loads fdb.impl, and --fdq chooses the fdq to import.

# The CI ratios (machine-independent counts).
MAX_KEY_SHARE = 0.25            # of a push (or lease/settle) phase's transactions
MIN_APPEND_PARTITIONS = 4       # per per-message append family
PER_MESSAGE = 0.25              # an append family appended by this share of a phase's
                                # transactions (or messages) is per-message
# Mutations per message in the phase's own transactions: the plan's targets for pushes
# (plan23_26 2.2), and for consuming 1.5 (1.05-1.1 today: one more per message fails).
# push_many's floor for its workload (100 random keys over 16 shards) is 2.16: 2 rows a
# message plus the routed counter of each shard touched (the key its consumers watch:
# 0.16); its budget, 2.2, leaves room for the batch's counter add, marker and marker index
# (0.03) and nothing per message (the counters split by shard, before they were packed,
# wrote 2.82; the plan's 2.1 was below the floor).
MUTATION_BUDGETS = {"push": 8.0, "push_many": 2.2, "push_msg_id": 10.0, "consume": 1.5}
PUSH_PHASES = ("push", "push_msg_id", "push_many")
# The key-share rule is about transactions of one message each: a push_many of 100
# random keys touches every counter part (a part per shard) by design, at 1/100 of the
# transactions; its keys are held to the team rate instead (the report's flags).
SINGLE_PUSH_PHASES = ("push", "push_msg_id")

VS_OP = "set_versionstamped_key"
VS_CODE = b"\x33"   # the tuple layer's type code of a Versionstamp, which a stamp follows
HEARTBEAT_NAMES = ("hb", "hbc", "hbv")   # a member's heartbeat keys end with these


# -- key families -------------------------------------------------------------------

_WORD = re.compile(r"^[a-z_]{1,24}$")


def _elements(key: bytes):
    """The tuple elements ``key`` decodes to (as many as decode) and the bytes left."""
    out, pos = [], 0
    while pos < len(key):
        try:
            v, end = fdbtuple._decode(key, pos)
        except Exception:       # noqa: BLE001 - a range end or a partial key: stop there
            break
        out.append(v)
        pos = end
    return out, key[pos:]


def _element(v, names: dict) -> str:
    if isinstance(v, Versionstamp):
        return "<vs>"
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, int):
        return "<n>"
    if isinstance(v, bytes):
        return "<bytes>"
    if isinstance(v, str):
        if v in names:
            return names[v]
        if v == "":
            return "''"
        return v if _WORD.match(v) else "<id>"
    if isinstance(v, tuple):
        return "(" + ",".join(_element(x, names) for x in v) + ")"
    return "<" + type(v).__name__ + ">"


def family(key: bytes, names: dict) -> str:
    """``key`` as its family: tuple-decoded, the root dropped, variable parts as placeholders."""
    els, rest = _elements(key)
    if els and els[0] == "fdq":
        els = els[1:]
    text = "/".join(_element(v, names) for v in els)
    if rest:
        text += ("/" if text else "") + ("…" if rest in (b"\xff", b"\x00") else "<raw>")
    return text or "<raw>"


def head_family(head: bytes, names: dict) -> str:
    """An append point's family: its prefix's, then the stamp (``head`` ends with the
    versionstamp's type code, which the stamp follows)."""
    return family(head[:-1] if head.endswith(VS_CODE) else head, names) + "/<vs>…"


def exact(key) -> str:
    """An exact key or range, readable: its tuple elements (root dropped)."""
    if isinstance(key, tuple):
        return exact(key[0]) + " .. " + exact(key[1])
    els, rest = _elements(key)
    if els and els[0] == "fdq":
        els = els[1:]
    parts = []
    for v in els:
        if isinstance(v, bytes):
            parts.append(v[:6].hex())
        elif isinstance(v, Versionstamp):
            parts.append("vs")
        else:
            parts.append(str(v) if v != "" else "''")
    return "/".join(parts) + ("/" + rest.hex() if rest else "")


def range_family(b: bytes, e: bytes, names: dict) -> str:
    """A range ``[b, e)`` as the family of the prefix its ends share, ``/*`` after it."""
    n = 0
    while n < min(len(b), len(e)) and b[n] == e[n]:
        n += 1
    els, _rest = _elements(b[:n])
    if els and els[0] == "fdq":
        els = els[1:]
    return "/".join(_element(v, names) for v in els) + "/*"


# -- recording ----------------------------------------------------------------------

class Recorder:
    """``Library.recorder``: each committed transaction's calls, under the current phase."""

    def __init__(self):
        self.phase = None
        self.txs = collections.defaultdict(list)
        self.lock = threading.Lock()

    def __call__(self, calls):
        if self.phase is not None:
            with self.lock:
                self.txs[self.phase].append(list(calls))


def summarize(calls: list) -> dict:
    """One transaction: its mutations [(op, key or (b, e), bytes, head)], read and write
    conflict ranges, options."""
    muts, reads, writes, options = [], [], [], []
    no_conflict = False
    for c in calls:
        kind = c[0]
        if kind == "option":
            options.append(c[1])
            if c[1] == "next_write_no_write_conflict_range":
                no_conflict = True
            continue
        if kind == "read":
            reads.append((c[1], c[2]))
            continue
        if kind == "conflict":
            (reads if c[1] == "read" else writes).append((c[2], c[3]))
            continue
        if kind == "set":
            m = ("set", c[1], len(c[1]) + c[2], None)
        elif kind == "clear":
            m = ("clear", c[1], len(c[1]), None)
        elif kind == "clear_range":
            m = ("clear_range", (c[1], c[2]), len(c[1]) + len(c[2]), None)
        else:   # atomic
            key, op, plen = c[1], c[2], c[3]
            if op == VS_OP:
                offset = int.from_bytes(key[-4:], "little")
                key = key[:-4]
                m = (op, key, len(key) + plen, key[:offset])
            else:
                m = (op, key, len(key) + plen, None)
        muts.append(m)
        if not no_conflict:
            writes.append(m[1] if isinstance(m[1], tuple) else (m[1], m[1] + b"\x00"))
        no_conflict = False
    return {"muts": muts, "reads": reads, "writes": writes, "options": options}


PHASE_KINDS = {"play": "play", "trim": "trim"}   # one kind of transaction each


def kind_of(tx: dict, names: dict, phase: str = "") -> str:
    """What a transaction did: its phase's kind where the phase has one, else from the
    families it wrote."""
    if phase in PHASE_KINDS:
        return PHASE_KINDS[phase]
    fams = {family(m[1], names) if not isinstance(m[1], tuple) else range_family(*m[1], names)
            for m in tx["muts"]}
    text = " ".join(fams)
    if "/all/log/" in text and (VS_OP in {m[0] for m in tx["muts"]} or "/pending/" in text):
        return "push"
    if "/leased/" in text or "/ready/" in text or "/delayed/" in text:
        return "lease/settle"
    if all("/heartbeats/" in f or f.rsplit("/", 1)[-1] in HEARTBEAT_NAMES for f in fams):
        return "heartbeat"     # (wherever the layout keeps them)
    if "/shards/" in text or "/assignment/" in text or "/consumers/" in text:
        return "membership"
    if "/all/log/" in text:
        return "trim"
    if all(f.endswith("/clock") or f.endswith("/clock_version") for f in fams):
        return "clock"
    return "other"


# -- the workload -------------------------------------------------------------------

def _killable_consumer(url: str, topic: str, cid: str, env: dict):
    code = ("import sys, time, fdq\n"
            "from bench._common import FAST\n"
            f"c = fdq.Consumer(fdq.connect({url!r}), {topic!r}, consumer_id={cid!r}, config=fdq.ConsumerConfig(**FAST))\n"
            "c.fetch(1, timeout=0.1)\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def run_workload(url: str, rec: Recorder, *, quick: bool, topic: str = "t", seed: int = 1) -> dict:
    """Run the phases on ``url``; returns {phase: (unit, count)}: what each is per."""
    import standin
    import fdq
    rng = random.Random(seed)
    n = 100 if quick else 400
    units = {}
    db = fdq.connect(url)
    sup = fdq.Supervisor(db)
    sup.create_topic(topic, shards=16)
    sup.create_subscription(topic, "default")
    prod = fdq.Producer(db)
    body = b"x" * 100

    def phase(name, unit, count, fn):
        progress(f"{name}: {count} {unit}")
        rec.phase = name
        try:
            fn()
        finally:
            rec.phase = None
        units[name] = (unit, count)

    phase("push", "messages", n, lambda: [prod.push(topic, body, shard_key=f"k{rng.randrange(10**6)}")
                                           for _ in range(n)])
    phase("push_msg_id", "messages", n,
          lambda: [prod.push(topic, body, shard_key=f"k{rng.randrange(10**6)}", msg_id=f"m-{i}") for i in range(n)])
    batches = 12    # (the marker index of 12 transactions: fewer than 4 of 16 parts by chance ~1e-6)
    phase("push_many", "messages", 100 * batches, lambda: [
        prod.push_many(topic, [fdq.Envelope(body, shard_key=f"k{rng.randrange(10**6)}") for _ in range(100)])
        for _ in range(batches)])
    large = 4 if quick else 10
    phase("push_large", "messages", large,
          lambda: [prod.push(topic, os.urandom(300_000), shard_key=f"k{i}") for i in range(large)])
    sup.pause(topic)
    phase("push_paused", "messages", n // 2, lambda: [prod.push(topic, body, shard_key=f"k{rng.randrange(10**6)}")
                                                      for _ in range(n // 2)])
    total = n + n + 100 * batches + large + n // 2
    phase("play", "messages", n // 2, lambda: sup.play(topic))

    def consume():
        cs = [fdq.Consumer(db, topic, consumer_id=f"c{i}", config=fdq.ConsumerConfig(**FAST)) for i in range(2)]
        got = 0
        deadline = time.monotonic() + 120
        try:
            while got < total and time.monotonic() < deadline:
                for c in cs:
                    ms = c.fetch(10, timeout=0.2)
                    if ms:
                        c.ack_many(ms)
                        got += len(ms)
        finally:
            for c in cs:
                c.close()
        if got < total:
            raise RuntimeError(f"consumed {got} of {total} messages within 120 s")
    phase("consume", "messages", total, consume)

    members = 6 if quick else 12
    seconds = 2.0 if quick else 5.0

    def membership():
        env = standin.environment()
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(fdq.__file__)), ROOT,
                                             env["PYTHONPATH"]])
        zombie = _killable_consumer(url, topic, "zombie", env)
        cs = []
        try:
            line = zombie.stdout.readline()
            if not line.startswith("ready"):
                raise RuntimeError("the consumer to kill did not start")
            for i in range(members - 1):
                c = fdq.Consumer(db, topic, consumer_id=f"m{i}", config=fdq.ConsumerConfig(**FAST))
                c.fetch(1, timeout=0.05)
                cs.append(c)
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:     # heartbeats, lease checks
                for c in cs:
                    c.fetch(1, timeout=0.02)
            zombie.kill()
            zombie.wait(30)
            _wait(lambda: not any(r.get("id") == "zombie" for r in sup.consumers(topic)), 30,
                  "the killed consumer's takeover")
            cs.pop().close()                           # a leave
            for c in cs:
                c.fetch(1, timeout=0.05)
        finally:
            if zombie.poll() is None:
                zombie.kill()
                zombie.wait(30)
            for c in cs:
                c.close()
    phase("membership", "consumer-seconds", members * seconds, membership)
    phase("trim", "messages", total, lambda: sup.trim(topic, before_ms=int(time.time() * 1000) + 60_000))
    return units


# -- analysis -----------------------------------------------------------------------

def analyze_phase(phase: str, raw: list, names: dict, unit: str, count: float, scale: float, args) -> dict:
    """One phase's figures; ``scale`` = units per second at the target."""
    txs = [summarize(c) for c in raw]
    txs = [t for t in txs if t["muts"]]          # what reaches the resolvers and storage
    for t in txs:
        t["kind"] = kind_of(t, names, phase)
    kinds = collections.Counter(t["kind"] for t in txs)
    per_unit = scale / count if count else 0.0
    keys = {}
    fams = {}
    heads = {}
    append_fams = {}
    reads = {}
    nmuts = 0
    for t in txs:
        seen_keys, seen_fams, seen_heads, seen_reads = set(), set(), set(), set()
        for op, key, nbytes, head in t["muts"]:
            nmuts += 1
            if head is not None:
                fam = family(key, names)
                hf = head_family(head, names)
                h = heads.setdefault(head, {"family": hf, "txs": 0, "writes": 0, "bytes": 0})
                h["writes"] += 1
                h["bytes"] += nbytes
                if head not in seen_heads:
                    seen_heads.add(head)
                    h["txs"] += 1
                a = append_fams.setdefault(hf, {"heads": set(), "txs": 0, "writes": 0, "bytes": 0,
                                                "kinds": collections.Counter()})
                a["heads"].add(head)
                a["writes"] += 1
                a["bytes"] += nbytes
                if hf not in seen_fams:
                    a["txs"] += 1
                    a["kinds"][t["kind"]] += 1
            else:
                fam = family(key, names) if not isinstance(key, tuple) else range_family(*key, names)
                k = keys.setdefault(key, {"family": fam, "op": op, "txs": 0, "writes": 0, "bytes": 0,
                                          "kinds": collections.Counter()})
                k["writes"] += 1
                k["bytes"] += nbytes
                if key not in seen_keys:
                    seen_keys.add(key)
                    k["txs"] += 1
                    k["kinds"][t["kind"]] += 1
            f = fams.setdefault(fam, {"txs": 0, "writes": 0, "bytes": 0, "keys": set()})
            f["writes"] += 1
            f["bytes"] += nbytes
            f["keys"].add(head if head is not None else key)
            if fam not in seen_fams:
                seen_fams.add(fam)
                f["txs"] += 1
            if head is not None:
                seen_fams.add(hf)
        for b, e in t["reads"]:
            rf = family(b, names) if e == b + b"\x00" else range_family(b, e, names)
            r = reads.setdefault(rf, {"txs": 0})
            if rf not in seen_reads:
                seen_reads.add(rf)
                r["txs"] += 1
    ntx = len(txs)

    def rows(table, key_name):
        out = []
        for key, v in table.items():
            row = {key_name: v.get("family", key) if key_name != "family" else key,
                   "tx_share": v["txs"] / ntx if ntx else 0.0,
                   "per_msg": v["writes"] / count if count else 0.0,
                   "writes_s": v["writes"] * per_unit, "bytes_s": v["bytes"] * per_unit}
            if "keys" in v:
                row["keys"] = len(v["keys"])
            if "heads" in v:
                row["partitions"] = len(v["heads"])
                row["appends"] = v["writes"]
                row["kinds"] = dict(v["kinds"])
            if key_name == "key":
                row["key"] = v["family"]
                row["exact"] = exact(key)
                row["op"] = v["op"]
                row["kinds"] = dict(v["kinds"])
            if key_name == "head":
                row["exact"] = exact(key)
                row["hex"] = key.hex()
            row["hot"] = row["writes_s"] > args.team_writes or row["bytes_s"] > args.team_bytes
            out.append(row)
        out.sort(key=lambda r: (-r["tx_share"], -r["writes_s"]))
        return out

    return {
        "unit": unit, "count": count, "transactions": ntx, "kinds": dict(kinds),
        "mutations": nmuts, "mutations_per_unit": nmuts / count if count else 0.0,
        "tx_per_s": ntx * per_unit,
        "keys": rows(keys, "key"),
        "families": rows(fams, "family"),
        "heads": rows(heads, "head"),
        "append_families": rows(append_fams, "family"),
        "reads": sorted(({"family": f, "tx_share": v["txs"] / ntx if ntx else 0.0} for f, v in reads.items()),
                        key=lambda r: -r["tx_share"]),
        "_txs": txs,
    }


def _overlap(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def checks(phases: dict, names: dict) -> dict:
    """The CI ratios: {rule: {"ok": bool, "detail": str}}."""
    out = {}

    def key_share(name, ph, kinds):
        txs = [t for t in ph["_txs"] if t["kind"] in kinds]
        counts = collections.Counter()
        fams = {}
        for t in txs:
            for k in {m[1] for m in t["muts"] if m[3] is None}:
                counts[k] += 1
        worst = [(c / len(txs), k) for k, c in counts.items()] if txs else []
        worst.sort(key=lambda x: -x[0])
        bad = [(s, k) for s, k in worst if s > MAX_KEY_SHARE]
        for s, k in bad:
            fams.setdefault(family(k, names) if isinstance(k, bytes) else range_family(*k, names), s)
        detail = ("; ".join(f"{f} in {s:.0%}" for f, s in fams.items()) if bad
                  else f"most shared key in {worst[0][0]:.0%}" if worst else "no transactions")
        out[name] = {"ok": not bad and bool(txs), "detail": detail + f" of {len(txs)} {'/'.join(kinds)} transactions"}

    for p in SINGLE_PUSH_PHASES:
        key_share(f"key_share[{p}]", phases[p], ("push",))
    key_share("key_share[consume]", phases["consume"], ("lease/settle",))
    for p in PUSH_PHASES + ("push_large", "push_paused", "play", "consume"):
        ph = phases[p]
        # (a family appended fewer than 4 times can show no more partitions than appends)
        narrow = [(r["family"], r["partitions"]) for r in ph["append_families"]
                  if (r["tx_share"] >= PER_MESSAGE or r["per_msg"] >= PER_MESSAGE)
                  and r["partitions"] < min(MIN_APPEND_PARTITIONS, r["appends"])]
        out[f"append_partitions[{p}]"] = {
            "ok": not narrow,
            "detail": "; ".join(f"{f}: {n} partition(s)" for f, n in narrow) or
                      ", ".join(f"{r['family']}: {r['partitions']}" for r in ph["append_families"]) or "no appends"}
    for p, budget in MUTATION_BUDGETS.items():
        # the phase's own transactions (a consume phase also has its consumers' heartbeats,
        # which depend on how long it ran)
        kind = "lease/settle" if p == "consume" else "push"
        ph = phases[p]
        m = sum(len(t["muts"]) for t in ph["_txs"] if t["kind"] == kind) / ph["count"]
        out[f"mutations_per_message[{p}]"] = {"ok": m <= budget, "detail": f"{m:.2f} in {kind} transactions "
                                                                             f"(budget {budget:g})"}
    ph = phases["membership"]
    hb_writes = [w for t in ph["_txs"] if t["kind"] == "heartbeat" for w in t["writes"]]
    assign = [t for t in ph["_txs"] if t["kind"] == "membership"]
    hit = sum(1 for t in assign if any(_overlap(r, w) for r in t["reads"] for w in hb_writes))
    out["heartbeats_outside_assignment_reads"] = {
        "ok": bool(assign) and hit == 0 and bool(hb_writes),
        "detail": f"{hit} of {len(assign)} membership transactions read a range a heartbeat writes "
                  f"({len(hb_writes)} heartbeat writes)"}
    return out


def distribution(phases: dict, names: dict, args) -> dict:
    """The simulated data distribution: write units (an exact key, or an append point with
    everything written under it) from the push, consume and membership phases at the
    targets, sorted, cut into shards at ``--split-rate`` writes/s (a unit never splits),
    placed largest first on the least loaded of ``--teams`` teams."""
    units = {}
    for p in ("push", "consume", "membership"):
        ph = phases[p]
        heads = sorted(bytes.fromhex(r["hex"]) for r in ph["heads"])
        scale = args._scales[p] / ph["count"]
        for t in ph["_txs"]:
            for op, key, nbytes, head in t["muts"]:
                k = key[0] if isinstance(key, tuple) else key
                if head is None:
                    for h in heads:     # a clear of an appended key: its append point's range
                        if k.startswith(h):
                            head = h
                            break
                unit = head if head is not None else k
                u = units.setdefault(unit, {"writes_s": 0.0, "bytes_s": 0.0,
                                            "family": head_family(unit, names) if head is not None
                                            else exact(unit)})
                u["writes_s"] += scale
                u["bytes_s"] += nbytes * scale
    shards, cur = [], None
    for key in sorted(units):
        u = units[key]
        if cur is None or cur["writes_s"] + u["writes_s"] > args.split_rate or \
                cur["bytes_s"] + u["bytes_s"] > args.split_bytes:
            cur = {"begin": key, "writes_s": 0.0, "bytes_s": 0.0, "units": 0, "top": None}
            shards.append(cur)
        cur["writes_s"] += u["writes_s"]
        cur["bytes_s"] += u["bytes_s"]
        cur["units"] += 1
        if cur["top"] is None or u["writes_s"] > units[cur["top"]]["writes_s"]:
            cur["top"] = key
    teams = [{"team": i, "writes_s": 0.0, "bytes_s": 0.0, "shards": 0, "top": None, "top_writes_s": 0.0}
             for i in range(args.teams)]
    for s in sorted(shards, key=lambda s: -s["writes_s"]):
        t = min(teams, key=lambda t: t["writes_s"])
        t["writes_s"] += s["writes_s"]
        t["bytes_s"] += s["bytes_s"]
        t["shards"] += 1
        if s["writes_s"] > t["top_writes_s"]:
            t["top_writes_s"] = s["writes_s"]
            t["top"] = units[s["top"]]["family"]
    for t in teams:
        t["hot"] = t["writes_s"] > args.team_writes or t["bytes_s"] > args.team_bytes
    total = sum(t["writes_s"] for t in teams)
    teams.sort(key=lambda t: -t["writes_s"])
    return {"units": len(units), "shards": len(shards), "teams": teams, "writes_s": total,
            "teams_needed": total / args.team_writes,
            "max_over_mean": (teams[0]["writes_s"] / (total / len(teams))) if total else 0.0}


# -- output -------------------------------------------------------------------------

def _fmt(v):
    if isinstance(v, float):
        return f"{v:,.0f}" if v >= 100 else f"{v:.2f}"
    return str(v)


def print_report(rep: dict, args, top: int):
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    con = Console(width=max(150, os.get_terminal_size().columns if sys.stdout.isatty() else 150))
    con.print(f"[bold]Hot spots[/] at {args.rate:,} msgs/s, {args.consumers} consumers (heartbeat and lease "
              f"check every {FAST['heartbeat_interval_s']:g} s); team limit {args.team_writes:,} writes/s, "
              f"{args.team_bytes / 1e6:g} MB/s ({rep['machine']})")
    for name, ph in rep["phases"].items():
        t = Table(title=f"{name}: {ph['transactions']} write transactions per {ph['count']:g} {ph['unit']} "
                        f"({', '.join(f'{k} {v}' for k, v in ph['kinds'].items())}); "
                        f"{ph['mutations_per_unit']:.2f} mutations per {ph['unit'][:-1]}")
        for c in ("what", "key / family", "tx share", "per unit", "writes/s", "MB/s", "n", "hot"):
            t.add_column(c, justify="left" if c in ("what", "key / family") else "right")
        for r in sorted(ph["families"], key=lambda r: -r["per_msg"])[:top]:
            if "<vs>" not in r["family"]:
                t.add_row("family", escape(r["family"]), f"{r['tx_share']:.0%}", _fmt(r["per_msg"]),
                          _fmt(r["writes_s"]), f"{r['bytes_s'] / 1e6:.2f}", f"{r['keys']} keys", "")
        for r in ph["keys"][:top]:
            t.add_row("key", escape(r["exact"]), f"{r['tx_share']:.0%}", _fmt(r["per_msg"]), _fmt(r["writes_s"]),
                      f"{r['bytes_s'] / 1e6:.2f}", "", "HOT" if r["hot"] else "")
        for r in ph["append_families"][:top]:
            t.add_row("append", escape(r["family"]), f"{r['tx_share']:.0%}", _fmt(r["per_msg"]), _fmt(r["writes_s"]),
                      f"{r['bytes_s'] / 1e6:.2f}", f"{r['partitions']} parts", "")
        for r in ph["heads"][:top]:
            if r["hot"]:
                t.add_row("append pt", escape(r["exact"]), f"{r['tx_share']:.0%}", _fmt(r["per_msg"]), _fmt(r["writes_s"]),
                          f"{r['bytes_s'] / 1e6:.2f}", "", "HOT")
        for r in ph["reads"][:3]:
            t.add_row("read", escape(r["family"]), f"{r['tx_share']:.0%}", "", "", "", "", "")
        con.print(t)
    d = rep["distribution"]
    t = Table(title=f"Simulated distribution: {d['units']} write units, {d['shards']} shards, "
                    f"{len(d['teams'])} teams; {d['writes_s']:,.0f} writes/s in all (at least "
                    f"{d['teams_needed']:.0f} teams' worth); hottest team / mean = {d['max_over_mean']:.2f}")
    for c in ("team", "writes/s", "MB/s", "shards", "hottest unit", "its writes/s", "hot"):
        t.add_column(c, justify="left" if c == "hottest unit" else "right")
    for r in d["teams"][:top]:
        t.add_row(str(r["team"]), _fmt(r["writes_s"]), f"{r['bytes_s'] / 1e6:.2f}", str(r["shards"]),
                  escape(r["top"] or ""), _fmt(r["top_writes_s"]), "HOT" if r["hot"] else "")
    con.print(t)
    t = Table(title="CI ratios")
    for c in ("rule", "ok", "detail"):
        t.add_column(c)
    for k, v in rep["checks"].items():
        t.add_row(escape(k), "yes" if v["ok"] else "[red]NO[/]", escape(v["detail"]))
    con.print(t)


def markdown(rep: dict, args) -> str:
    lines = [f"Workload `python -m bench.hotspots{' --quick' if args.quick else ''}` through FDB's binding over the "
             f"libfdb_c stand-in; scaled to {args.rate:,} msgs/s and {args.consumers} consumers; team limit "
             f"{args.team_writes:,} writes/s (an estimate). Machine: {rep['machine']} (the ratios do not depend on it).",
             "", "| phase | write txs | mutations per unit | most shared exact key (share of txs) | "
             "per-message append families (partitions) |", "|---|---:|---:|---|---|"]
    for name, ph in rep["phases"].items():
        k = ph["keys"][0] if ph["keys"] else None
        apps = ", ".join(f"`{r['family']}` ({r['partitions']})" for r in ph["append_families"]
                         if r["tx_share"] >= PER_MESSAGE or r["per_msg"] >= PER_MESSAGE)
        lines.append(f"| {name} | {ph['transactions']} | {ph['mutations_per_unit']:.2f} per {ph['unit'][:-1]} | "
                     + (f"`{k['key']}` ({k['tx_share']:.0%})" if k else "–") + f" | {apps or '–'} |")
    lines += ["", f"Consumers heartbeat and check leases every {FAST['heartbeat_interval_s']:g} s here (the "
                  f"benchmarks' quick config; the default heartbeat is 1 s): per consumer-second, a default "
                  f"consumer writes about a quarter of the heartbeat figures."]
    d = rep["distribution"]
    lines += ["", f"Simulated distribution (push + consume at {args.rate:,}/s, heartbeats of {args.consumers} "
                  f"consumers; shards cut at {args.split_rate:,} writes/s): {d['shards']} shards on "
                  f"{len(d['teams'])} teams ({d['writes_s']:,.0f} writes/s in all), hottest team {d['teams'][0]['writes_s']:,.0f} writes/s "
                  f"= {d['max_over_mean']:.2f}x the mean (its largest unit `{d['teams'][0]['top']}`, "
                  f"{d['teams'][0]['top_writes_s']:,.0f} writes/s).", "",
              "| CI ratio | ok | detail |", "|---|---|---|"]
    for k, v in rep["checks"].items():
        lines.append(f"| {k} | {'yes' if v['ok'] else '**no**'} | {v['detail']} |")
    return "\n".join(lines)


SECTION = "## Hot spots (bench/hotspots.py)"


def write_results(text: str, path: str):
    """Replace this tool's "Latest" part of RESULTS.md (its other parts stay), adding the
    section before the investigations if it is not there."""
    with open(path) as f:
        doc = f.read()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    latest = f"### Latest: {stamp}\n\n{text}\n\n"
    if SECTION in doc:
        start = doc.index(SECTION)
        at = doc.find("### Latest", start)
        end_of_section = doc.find("\n## ", start + len(SECTION))
        if at < 0 or (0 <= end_of_section < at):
            at = end = start + len(SECTION) + 2
        else:
            ends = [i for i in (doc.find("\n### ", at + 1), end_of_section) if i >= 0]
            end = min(ends) + 1 if ends else len(doc)
        doc = doc[:at] + latest + doc[end:]
    else:
        body = f"{SECTION}\n\n{latest}"
        at = doc.find("## Investigations")
        doc = doc[:at] + body + doc[at:] if at >= 0 else doc.rstrip("\n") + "\n\n" + body
    with open(path, "w") as f:
        f.write(doc)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller workload (what CI runs)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--markdown", action="store_true", help="print the summary as markdown")
    ap.add_argument("--write-results", action="store_true", help="write the summary to bench/RESULTS.md")
    ap.add_argument("--rate", type=int, default=100_000, help="target messages per second")
    ap.add_argument("--consumers", type=int, default=500, help="target consumers (heartbeat phases)")
    ap.add_argument("--team-writes", type=int, default=20_000, help="mutations/s one storage team takes")
    ap.add_argument("--team-bytes", type=float, default=30e6, help="bytes/s one storage team takes")
    ap.add_argument("--teams", type=int, default=64, help="storage teams of the simulated distribution")
    ap.add_argument("--split-rate", type=float, default=5_000, help="a shard splits above this many writes/s")
    ap.add_argument("--split-bytes", type=float, default=10e6, help="... or this many bytes/s")
    ap.add_argument("--top", type=int, default=6, help="rows per table")
    ap.add_argument("--dir", default=None, help="where the temporary database goes")
    ap.add_argument("--fdq", default=None, metavar="TREE",
                    help="import fdq from this source tree (another commit's, for a before/after table)")
    args = ap.parse_args(argv)
    if args.fdq:
        sys.path.insert(0, os.path.abspath(args.fdq))

    import standin
    lib = standin.install(ffi=False, network=True, strict=True)
    rec = Recorder()
    lib.recorder = rec
    names = {"t": "<topic>", "default": "<sub>"}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        cluster = standin.write_cluster_file(os.path.join(d, "fdb.cluster"), os.path.join(d, "db.sqlite"))
        units = run_workload(f"fdb://{cluster}", rec, quick=args.quick)
    args._scales = {p: (args.rate if u == "messages" else args.consumers) for p, (u, _c) in units.items()}
    phases = {p: analyze_phase(p, rec.txs.get(p, []), names, u, c, args._scales[p], args) for p, (u, c) in units.items()}
    rep = {"machine": machine(), "rate": args.rate, "consumers": args.consumers, "phases": phases,
           "checks": checks(phases, names), "distribution": distribution(phases, names, args)}
    for ph in phases.values():
        del ph["_txs"]
    if args.json:
        print(json.dumps(rep, indent=1, default=sorted))
    elif args.markdown:
        print(markdown(rep, args))
    else:
        print_report(rep, args, args.top)
    if args.write_results:
        write_results(markdown(rep, args), os.path.join(ROOT, "bench", "RESULTS.md"))


if __name__ == "__main__":
    main()
