"""A worker process of the engine conformance suite: ``engine_worker.py COMMAND URL JSON``.

Prints one JSON line with its result. Runs against either engine via ``fdq.connect``.
"""
from __future__ import annotations

import json
import random
import struct
import sys
import time

import fdb.tuple

import fdq
from fdq.engine import error_types


def _loop(db, body, errors):
    """A hand-written FDB retry loop that counts the errors it retried, by code."""
    tr = db.create_transaction()
    while True:
        try:
            result = body(tr)
            tr.commit().wait()
            return result, tr
        except error_types() as e:
            errors[str(e.code)] = errors.get(str(e.code), 0) + 1
            tr.on_error(e).wait()


def cmd_add(db, a):
    """``n`` transactions each adding 1 (little-endian) to one key: blind atomic ops."""
    key = bytes.fromhex(a["key"])
    errors = {}
    for _ in range(a["n"]):
        _loop(db, lambda tr: tr.add(key, struct.pack("<q", 1)), errors)
    return {"errors": errors}


def cmd_rmw(db, a):
    """``n`` read-modify-write increments (no atomic ops) on random keys of ``keys``."""
    p = bytes.fromhex(a["prefix"])
    rng = random.Random(a["seed"])
    errors = {}

    def bump(tr, key):
        v = tr[key]
        n = 0 if v == None else struct.unpack("<q", bytes(v))[0]  # noqa: E711
        tr[key] = struct.pack("<q", n + 1)

    for _ in range(a["n"]):
        key = p + b"%02d" % rng.randrange(a["keys"])
        _loop(db, lambda tr: bump(tr, key), errors)
    return {"errors": errors}


def cmd_bank(db, a):
    """Random transfers between accounts, each made idempotent by a marker key written
    with its effects (ids chosen outside the retry loop). Every attempt also reads all
    accounts and records whether their sum was the invariant total."""
    p = bytes.fromhex(a["prefix"])
    acct = p + b"acct/"
    marks = p + b"mark/"
    rng = random.Random(a["seed"])
    errors = {}
    bad_sums = 0

    def transfer(tr, tid, src, dst, amount):
        nonlocal bad_sums
        rows = list(tr.get_range(acct, acct + b"\xff"))
        if sum(struct.unpack("<q", kv.value)[0] for kv in rows) != a["total"] or len(rows) != a["accounts"]:
            bad_sums += 1
        if tr[marks + tid] != None:  # noqa: E711 - FDB's Value: absent == None
            return False
        s = struct.unpack("<q", bytes(tr[acct + b"%03d" % src]))[0]
        d = struct.unpack("<q", bytes(tr[acct + b"%03d" % dst]))[0]
        if s < amount:
            amount = s
        tr[acct + b"%03d" % src] = struct.pack("<q", s - amount)
        tr[acct + b"%03d" % dst] = struct.pack("<q", d + amount)
        tr[marks + tid] = b""
        return True

    done = 0
    for i in range(a["n"]):
        tid = f"{a['worker']}-{i}".encode()
        src, dst = rng.sample(range(a["accounts"]), 2)
        amount = rng.randint(1, 50)
        _loop(db, lambda tr: transfer(tr, tid, src, dst, amount), errors)
        done += 1
    return {"done": done, "errors": errors, "bad_sums": bad_sums}


def cmd_vstamp(db, a):
    """``n`` transactions each writing one versionstamped key; returns the stamps."""
    p = bytes.fromhex(a["prefix"])
    stamps = []
    for i in range(a["n"]):
        def body(tr, i=i):
            key = fdb.tuple.pack_with_versionstamp((fdb.tuple.Versionstamp(),), prefix=p)
            tr.set_versionstamped_key(key, json.dumps([a["worker"], i]).encode())
            return tr.get_versionstamp()
        vs, _tr = _loop(db, body, {})
        stamps.append(bytes(vs.wait()).hex())
    return {"stamps": stamps}


def cmd_set(db, a):
    tr = db.create_transaction()
    tr[bytes.fromhex(a["key"])] = bytes.fromhex(a["value"])
    tr.commit().wait()
    return {"ok": True}


def cmd_watch(db, a):
    """Arm a watch on ``key``, say so on stdout, and report whether it fired in time."""
    key = bytes.fromhex(a["key"])
    if "fallback_poll_s" in a:     # the embedded engine's safety-net poll, made slow
        from fdq.engine.sqlite import watches
        watches.WATCH_FALLBACK_POLL_S = a["fallback_poll_s"]
    tr = db.create_transaction()
    f = tr.watch(key)
    tr.commit().wait()
    print("armed", flush=True)
    deadline = time.monotonic() + a["timeout"]
    while not f.is_ready() and time.monotonic() < deadline:
        time.sleep(0.002)
    if f.is_ready():
        f.wait()
        tr = db.create_transaction()
        return {"fired": True, "value": bytes(tr[key].wait()).hex()}
    return {"fired": False}


def main():
    command, url, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    db = fdq.connect(url, check_format=False)
    print(json.dumps(globals()["cmd_" + command](db, args)), flush=True)


if __name__ == "__main__":
    main()
