"""Helpers shared by every test directory (``tests/`` is on ``sys.path`` through its
conftest): the engine a test runs on, bounded waiting on a condition, the consumer
configurations of the tests (:data:`FAST`), draining a subscription (:func:`drain`),
key-space reads, and worker processes (:class:`Procs`, running ``tests/workers``).

The suite runs twice (``make test``): on the embedded engine (``sqlite://``), and with
``FDQ_TEST_ENGINE=fdb`` on ``fdb://`` through FoundationDB's official Python binding over
the libfdb_c stand-in of ``tests/standin`` (or, with ``FDQ_TEST_FDB_CLUSTER_FILE``, on a
real cluster). Tests name their databases with :func:`database_url`, never a URL scheme.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import msgpack
import pytest

ENGINE = os.environ.get("FDQ_TEST_ENGINE", "sqlite")
if ENGINE not in ("sqlite", "fdb"):
    raise RuntimeError(f"FDQ_TEST_ENGINE={ENGINE!r}: expected sqlite or fdb")
DOCKER_CLUSTER_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docker",
                                   "fdb.cluster")
# A real cluster for the fdb pass: FDQ_TEST_FDB_CLUSTER_FILE, or FDQ_TEST_FDB=docker (the
# server of docker/docker-compose.yml, started by tests/conftest.py with testcontainers).
FDB_CLUSTER_FILE = os.environ.get("FDQ_TEST_FDB_CLUSTER_FILE") or (
    DOCKER_CLUSTER_FILE if os.environ.get("FDQ_TEST_FDB") == "docker" else None)
ON_FDB = ENGINE == "fdb"
STANDIN = ON_FDB and FDB_CLUSTER_FILE is None

if STANDIN:
    # Before anything loads fdb.impl: this process and every process a test starts (through
    # tests/standin/site/sitecustomize.py) load the binding over the stand-in.
    import standin

    os.environ.update(standin.environment())
    standin.install_from_env()

import fdq  # noqa: E402
from workers.common import read_lines  # noqa: E402,F401 - the worker logs' reader, for the tests too
from fdq.ops import clock  # noqa: E402
from fdq.keyspace import Keyspace  # noqa: E402
from fdq.keyspace.codec import Record  # noqa: E402
from fdq.ops.routing import shard_for  # noqa: E402

embedded_only = pytest.mark.skipif(ON_FDB, reason="about the embedded engine itself (sqlite:// only)")


def database_url(path, **options) -> str:
    """The URL of the test database stored at ``path`` (a file in the test's tmp_path).

    ``options`` are the embedded engine's (``fault_injection``, ``seed``,
    ``synchronous``). On the fdb pass the URL is ``fdb://`` a cluster file beside
    ``path`` that the libfdb_c stand-in serves from ``path`` (the same database for every
    option set); on a real cluster, that cluster (options skip the test)."""
    path = os.path.abspath(str(path))
    if not ON_FDB:
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"sqlite://{path}" + (f"?{query}" if query else "")
    if FDB_CLUSTER_FILE is not None:
        if options:
            pytest.skip(f"engine options {options} need the embedded engine or the libfdb_c stand-in")
        return f"fdb://{FDB_CLUSTER_FILE}"
    from standin import write_cluster_file
    tag = "" if not options else "-%08x" % zlib.crc32(repr(sorted(options.items())).encode())
    cluster = f"{path}{tag}.cluster"
    if not os.path.exists(cluster):
        write_cluster_file(cluster, path, **options)
    return f"fdb://{cluster}"


def key_on_shard(n: int, shards: int) -> str:
    """A shard key that routes to shard ``n`` of ``shards`` (asked of the routing function)."""
    return next(k for k in (f"k{i}" for i in range(100_000)) if shard_for(k, shards) == n)


def wait_for(cond, timeout: float = 60.0, what: str = "condition", interval: float = 0.05):
    """Poll ``cond()`` until it returns a truthy value (returned); fail the test naming
    ``what`` after ``timeout`` seconds. Tests wait for conditions, never for fixed sleeps."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def readable(fd, timeout: float) -> bool:
    """Whether ``fd`` (a descriptor or a file) has something to read, or its end, within
    ``timeout`` seconds. Through epoll: ``select.select`` refuses descriptors past 1023,
    which a test worker that has run many tests can be given."""
    import selectors
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(max(0.0, timeout)))


def readline_within(proc, timeout: float = 60.0, what: str = "a line"):
    """The next line of ``proc.stdout`` (a pipe), failing the test if none comes within
    ``timeout`` seconds (a child stuck before it prints must not hang the run). Returns
    what ``readline()`` returns (empty at end of output)."""
    if not readable(proc.stdout, timeout):
        raise AssertionError(f"timed out after {timeout}s waiting for {what} from pid {proc.pid}")
    return proc.stdout.readline()


def kill_all(procs, timeout: float = 30.0):
    """SIGKILL (and reap) every process of ``procs`` still running: a ``finally`` for
    tests that start processes, so a failure or a timeout leaves none behind."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            try:
                p.wait(timeout)
            except Exception:       # noqa: BLE001 - reaping is best effort; the kill was sent
                pass


def with_faults(url: str, p: float, seed: int | None = None) -> str:
    """The database of ``url`` (a :func:`database_url`) with the embedded engine's fault
    injection at probability ``p`` (also under the libfdb_c stand-in)."""
    options = {"fault_injection": p} if seed is None else {"fault_injection": p, "seed": seed}
    if url.startswith("sqlite://"):
        return url + "?" + "&".join(f"{k}={v}" for k, v in options.items())
    if not STANDIN:
        pytest.skip("fault injection needs the embedded engine or the libfdb_c stand-in")
    import json
    from standin.libfdb_c import SERVED_MARK
    with open(url[len("fdb://"):]) as f:
        settings = json.loads(next(l for l in f.read().splitlines() if l.startswith(SERVED_MARK))[len(SERVED_MARK):])
    return database_url(settings.pop("path"), **{**settings, **options})


def engine_errors() -> tuple:
    """What a raw engine call (``tr.commit().wait()``) raises on this pass: the embedded
    engine's EngineError, or ``fdb.FDBError`` (FDQ translates only what leaves its own
    functions)."""
    from fdq.engine import error_types
    return error_types()


def read_version(db) -> int:
    """A fresh read version of ``db`` (its transaction is kept until the read is waited
    for: FDB cancels the pending reads of a transaction it destroys)."""
    tr = db.create_transaction()
    return tr.get_read_version().wait()


def read(db, key, snapshot: bool = True):
    """The value at ``key`` now (bytes, or None if absent), in a transaction of its own
    kept until the read is waited for."""
    tr = db.create_transaction()
    return (tr.snapshot if snapshot else tr)[key].wait().value


# -- consumer configurations ---------------------------------------------------------

#: The tests' consumer: quick heartbeats, polls and lease checks (a zombie after 1.5 s).
FAST = fdq.ConsumerConfig(heartbeat_interval_s=0.2, zombie_timeout_s=1.5, poll_interval_s=0.05,
                          lease_check_interval_s=0.05)
#: A consumer that must never look dead to its peers (zombie after 5 s) on a loaded machine.
FAST_STEADY = fdq.ConsumerConfig(heartbeat_interval_s=0.1, zombie_timeout_s=5.0, poll_interval_s=0.05)


def fast(base: fdq.ConsumerConfig = FAST, **overrides) -> fdq.ConsumerConfig:
    """``base`` (default :data:`FAST`) with ``overrides``."""
    return dataclasses.replace(base, **overrides)


# -- reading the database ------------------------------------------------------------

def scan(db, prefix: bytes) -> list:
    """Every (key, value) under ``prefix``, in key order, in bounded transactions."""
    out = []
    begin, end = prefix, prefix + b"\xff"
    while True:
        tr = db.create_transaction()
        rows = list(tr.snapshot.get_range(begin, end, limit=5000))
        out += [(kv.key, kv.value) for kv in rows]
        if len(rows) < 5000:
            return out
        begin = rows[-1].key + b"\x00"


def log_bytes(db, ts) -> int:
    """The "all" log's bytes by a full scan: its entries' and body chunks' keys and
    values (what the ``log_bytes`` counter must equal)."""
    return sum(len(k) + len(v) for space in (ts.log, ts.all_chunks) for k, v in scan(db, space.key()))


def dump(db) -> dict:
    """Every key and value of the database (the tests' databases are small)."""
    tr = db.create_transaction()
    out = {bytes(kv.key): bytes(kv.value) for kv in tr.snapshot.get_range(b"", b"\xff")}
    tr.cancel()
    return out


def counter_value(db, key: bytes) -> int:
    from fdq.keyspace import decode_counter
    return decode_counter(read(db, key))


def sub_stats(db, topic: str, sub: str = "default") -> dict:
    return fdq.Supervisor(db).stats(topic)["subscriptions"][sub]


def threads_in(*names) -> list:
    """Idents of the threads whose stack has a frame of each function in ``names`` (a
    name, or a tuple of names any one of which will do)."""
    out = []
    for ident, frame in sys._current_frames().items():
        seen = set()
        while frame is not None:
            seen.add(frame.f_code.co_name)
            frame = frame.f_back
        if all(n in seen if isinstance(n, str) else seen & set(n) for n in names):
            out.append(ident)
    return out


# -- helpers of several test files ------------------------------------------------

class CountingDatabase:
    """``db`` itself, counting the transactions created through it: in all
    (``transactions``) and by the creating thread (``mine()``: the calling thread's)."""

    def __init__(self, db):
        self._db = db
        self.transactions = 0
        self.by_thread = {}

    def create_transaction(self):
        me = threading.get_ident()
        self.transactions += 1
        self.by_thread[me] = self.by_thread.get(me, 0) + 1
        return self._db.create_transaction()

    def mine(self) -> int:
        return self.by_thread.get(threading.get_ident(), 0)

    def __getattr__(self, name):
        return getattr(self._db, name)


# Heartbeats, lease checks and sweeps far apart: a fetching thread's transactions are its
# rounds' own (``drained_consumer``).
QUIET = fdq.ConsumerConfig(heartbeat_interval_s=5.0, zombie_timeout_s=30.0, poll_interval_s=60.0,
                           lease_check_interval_s=5.0)
QUIET_WAIT_S = 10.0     # far below QUIET's 60 s sweep


def drained_consumer(db, topic: str = "t"):
    """A pull consumer (``QUIET``) owning ``topic``'s one shard, which it has drained and
    watches."""
    c = fdq.Consumer(db, topic, config=QUIET)
    wait_for(lambda: c.owned_shards, 10, what="the shard owned")
    assert c.fetch(10, timeout=0.2) == []       # drained: the shard is watched now
    return c


def fetch_until(c, cond, timeout=30):
    """Fetch repeatedly (bounded) until ``cond(all fetched so far)``; returns them."""
    got = []
    deadline = time.monotonic() + timeout
    while not cond(got):
        assert time.monotonic() < deadline, f"timed out; fetched {[(m.body, m.attempts) for m in got]}"
        got += c.fetch(100, timeout=0.2)
    return got


def advance_clock(db, ms, topic="t"):
    """Move ``topic``'s clock (what its delays are due by) ``ms`` ahead, as its consumers
    do with the time their monotonic clocks saw pass."""
    ck = Keyspace().topic(topic).clock_key
    tr = db.create_transaction()
    now = clock.read_clock(tr, ck)
    tr.cancel()
    clock.advance_clock(db, ck, now + ms)


def replay_counts(db, topic):
    """{original id: copies} of the replayed copies in ``topic``'s "all" log."""
    ts = Keyspace().topic(topic)
    counts = collections.Counter()
    r = ts.log.range()
    tr = db.create_transaction()
    for kv in tr.snapshot.get_range(r.start, r.stop):
        rec = Record.decode(kv.value)
        if rec.replay_of is not None:
            counts[rec.replay_of] += 1
    tr.cancel()
    return counts


def log_records(db, topic) -> list:
    """Raw record fields of the "all" log, in log order per bucket, decoded with bytes
    kept as bytes (so header encodings compare byte for byte)."""
    ts = fdq.Supervisor(db).keyspace.topic(topic)
    r = ts.log.range()
    tr = db.create_transaction()
    rows = []
    for kv in tr.snapshot.get_range(r.start, r.stop):
        vs = ts.log.unpack(kv.key)[1]
        rows.append((vs, msgpack.unpackb(bytes(kv.value), raw=False)))
    tr.cancel()
    rows.sort(key=lambda x: x[0])
    return [f for _vs, f in rows]


def stored_bodies(db, topic: str) -> collections.Counter:
    """How many times each body is stored in ``topic``'s "all" log."""
    ts = Keyspace().topic(topic)
    return collections.Counter(Record.decode(v).body for _k, v in scan(db, ts.log.key()))


def collect(db, topic, want: int, **consumer_kwargs) -> list:
    """``want`` messages of ``topic``'s default subscription, each acked, by a FAST
    consumer made with ``consumer_kwargs`` (failing the test after 30 s)."""
    return drain(db, topic, until=want, strict=True, timeout=30, config=FAST, **consumer_kwargs)


def fetch_n(c, n: int, timeout: float = 30) -> list:
    """Exactly ``n`` messages fetched by consumer ``c`` (never more), failing the test
    after ``timeout`` s."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"fetched only {len(got)} of {n}"
        got += c.fetch(n - len(got), timeout=0.2)
    return got


def fetch_ids(db, topic, sub, timeout=0.3, **consumer_kwargs):
    """The ids of one fetch (up to 100, acked) of ``sub`` (a replayed copy: the id it
    replays)."""
    c = fdq.Consumer(db, topic, subscription=sub, create=False, **consumer_kwargs)
    try:
        got = c.fetch(100, timeout=timeout)
        c.ack_many(got)
        return [m.replay_of or m.id for m in got]
    finally:
        c.close()


def commit_retrying(tr, attempt) -> int:
    """Commit ``tr`` (its first attempt made by the caller, the other transaction
    interleaved by hand), retrying as ``fdq.transactional`` does: on a conflict, reset
    and run ``attempt(tr)`` again. Returns how many retries it took."""
    retries = 0
    while True:
        try:
            tr.commit().wait()
            return retries
        except engine_errors() as e:
            tr.on_error(e.code).wait()
            retries += 1
            attempt(tr)


# -- draining a subscription ---------------------------------------------------------

def drain(source, topic: str | None = None, sub: str = "default", *, until=None, idle_s: float = 0.0,
          first_wait_s: float = 0.2, wait_s: float = 0.2, batch: int | None = 100, timeout: float = 60.0,
          strict: bool = False, settle: str | None = "ack", reason: str = "drained", **consumer_kwargs) -> list:
    """Fetch what a subscription delivers, settling each batch, and return the messages.

    ``source`` is a consumer (used as it is, left open), or a database: then a consumer
    of ``topic``/``sub`` is made with ``consumer_kwargs`` and closed at the end. It stops
    once ``until`` is reached (a message count, or a set of bodies all received), or,
    with ``until=None``, once a fetch comes back empty ``idle_s`` or more after the last
    message. The first fetch waits up to ``first_wait_s``, later ones ``wait_s``; each
    asks for ``batch`` messages (None: as many as ``until`` still wants). After
    ``timeout`` it returns what it got (``strict``: fails the test). ``settle``: ``"ack"``
    (each message), ``"ack_many"`` (each batch at once), ``"term"`` (with ``reason``) or None."""
    own = not isinstance(source, fdq.Consumer)
    c = fdq.Consumer(source, topic, subscription=sub, **consumer_kwargs) if own else source
    got = []
    deadline = time.monotonic() + timeout
    quiet_since = time.monotonic()

    def reached():
        if isinstance(until, int):
            return len(got) >= until
        return until is not None and until <= {m.body for m in got}
    try:
        while not reached():
            if time.monotonic() > deadline:
                if strict:
                    raise AssertionError(f"timed out after {timeout}s draining: got {len(got)} of {until}")
                break
            ms = c.fetch(batch or until - len(got), timeout=first_wait_s if not got else wait_s)
            if ms:
                got += ms
                if settle == "ack_many":
                    c.ack_many(ms)
                elif settle is not None:
                    for m in ms:
                        m.ack() if settle == "ack" else m.term(reason)
                quiet_since = time.monotonic()
            elif until is None and time.monotonic() - quiet_since >= idle_s:
                break
    finally:
        if own:
            c.close()
    return got


# -- worker processes ----------------------------------------------------------------

#: The worker entry point: ``python tests/workers ROLE --url URL --name NAME ...``.
WORKERS = Path(__file__).with_name("workers")


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class Procs:
    """Starts worker processes (``tests/workers``, one role each) and reaps every one of
    them at teardown (killed by PID). Each gets ``--url``, ``--name``, ``--out`` (its
    event log, default ``NAME.log``) and ``--status`` (``NAME.status``); its stderr
    goes to ``err`` (default ``NAME.err``) in the test's directory."""

    def __init__(self, tmp_path: Path, url: str):
        self.tmp = Path(tmp_path)
        self.url = url
        self.procs = []

    def start(self, role: str, name: str, *args, url: str | None = None, out=None, err=None,
              wait_ready=False, timeout: float = 60):
        out = str(out or self.tmp / f"{name}.log")
        status = str(self.tmp / f"{name}.status")
        err = str(err or self.tmp / f"{name}.err")
        cmd = [sys.executable, str(WORKERS), role, "--url", url or self.url, "--name", name,
               "--out", out, "--status", status, *map(str, args)]
        with open(err, "w") as f:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True)
        p.name, p.out, p.status, p.err = name, out, status, err
        self.procs.append(p)
        if wait_ready:
            line = self.readline(p, timeout)
            assert line.strip() == "ready", f"{name} did not start: {line!r} {self.stderr(p)}"
        return p

    def readline(self, p, timeout: float) -> str:
        import selectors
        with selectors.DefaultSelector() as sel:
            sel.register(p.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise AssertionError(f"{p.name}: no output within {timeout}s; stderr: {self.stderr(p)}")
        return p.stdout.readline()

    def wait_ready(self, p, timeout: float = 60, meanwhile=None):
        """Wait for the worker's ``ready`` line (its signal handler is set by then),
        calling ``meanwhile()`` every 0.1 s or so while it does not come."""
        import selectors
        with selectors.DefaultSelector() as sel:
            sel.register(p.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                assert left > 0, f"{p.name}: not ready within {timeout}s: {self.stderr(p)}"
                if not sel.select(min(left, 0.1) if meanwhile else left):
                    if meanwhile:
                        meanwhile()
                    continue
                line = p.stdout.readline()
                assert line, f"{p.name} exited before it was ready: {self.stderr(p)}"
                if line.strip() == "ready":
                    return

    def stderr(self, p) -> str:
        try:
            return Path(p.err).read_text()[-8000:]
        except FileNotFoundError:
            return ""

    def kill9(self, p):
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        p.killed = True     # (a producer killed after its last push is not restarted)

    def term(self, p, timeout: float = 60):
        """SIGTERM (a clean shutdown) and wait; returns the exit code."""
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
        return p.wait(timeout=timeout)

    def stop(self, p, timeout: float = 90):
        """SIGTERM (the worker shuts its consumer down cleanly), wait, and check it exited 0."""
        try:
            rc = self.term(p, timeout)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGUSR1)     # the worker dumps every thread's stack
            wait_for(lambda: "hread 0x" in self.stderr(p), 5, what="a stack dump")   # "(Current t|T)hread 0x…"
            raise AssertionError(f"{p.name} did not stop within {timeout}s: {self.stderr(p)[-6000:]}")
        assert rc == 0, f"{p.name} exited {rc}: {self.stderr(p)}"

    def wait(self, p, timeout: float = 120):
        rc = p.wait(timeout=timeout)
        assert rc == 0, f"{p.name} exited {rc}: {self.stderr(p)}"

    def events(self, p) -> list:
        """The JSON lines of the worker's event log (a killed writer's last line may be cut)."""
        return [json.loads(line) for line in read_lines(p.out) if line.endswith("}")]

    def cleanup(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout:
                p.stdout.close()
