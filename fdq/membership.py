"""Consumer membership and shard ownership: join, heartbeat, leave, zombies, assignment.

A subscription's live consumers are the consumer records present under
``config/topics/<t>/consumers/<sub>/``. Every change of that set (join, leave, zombie)
re-divides the shards in the same transaction, moving as few as possible, and bumps each
moved shard's owner epoch: a consumer that lost a shard can no longer commit from it,
because every consuming transaction reads the shard record (see ``ensure_owner``).

Liveness never compares clocks of two hosts: an observer remembers when, on its own
monotonic clock, it last saw each peer's heartbeat counter change; a counter unchanged
for the zombie timeout makes the peer a zombie. Database versions are not used, so
version jumps (FDB recoveries) cannot make a live consumer look dead. (The heartbeat
age that stats display is a separate, approximate figure: ``heartbeat_age``.)
"""
from __future__ import annotations

from .engine import transactional
from .errors import LeaseLost
from .keyspace import TopicSpace, counter, decode_counter
from .keyspace.codec import pack, unpack
from .topic import read_topic_config


def read_clock(tr, clock_key: bytes) -> int:
    """The database clock, in milliseconds (snapshot read: never conflicts).

    Delays (delayed pushes, nak delays, backoff) are due by this clock, not by database
    versions (an FDB recovery jumps versions ~100 s at once) nor by a wall clock (hosts
    disagree). Live consumers advance it by the time that passed on their own monotonic
    clocks (``advance_clock``), so it never runs ahead of real time: a delay may end a
    heartbeat late, never early. It stands still while no consumer runs."""
    return decode_counter(tr.snapshot[clock_key])


@transactional
def advance_clock(tr, clock_key: bytes, candidate_ms: int, version_key: bytes | None = None) -> int:
    """Move the database clock to at least ``candidate_ms`` (a blind atomic max, so
    consumers never conflict over it). Returns the clock's new value as seen here.
    With ``version_key`` (``Keyspace.clock_version_key``), an advance also records its
    read version there (a blind max too): how long ago, in versions, the clock last
    moved (``heartbeat_age_s``)."""
    current = read_clock(tr, clock_key)
    if candidate_ms > current:
        tr.max(clock_key, int(candidate_ms).to_bytes(8, "little"))
        if version_key is not None:
            tr.max(version_key, tr.get_read_version().wait().to_bytes(8, "little"))
    return max(current, candidate_ms)


def shard_ids(config, tags=("",)):
    return [(tag, n) for tag in tags for n in range(config.shards)]


@transactional
def read_tags(tr, ts: TopicSpace, *, snapshot: bool = True) -> list:
    """Every dispatch tag messages were pushed with, plus "" (untagged), sorted."""
    reader = tr.snapshot if snapshot else tr
    r = ts.tags.range()
    return [""] + sorted(ts.tags.unpack(kv.key)[0] for kv in reader.get_range(r.start, r.stop))


def ownership_pools(config, tags: list, members: dict) -> list:
    """Tag dispatch as an ownership rule: [(shards, consumer ids)] pools to divide.
    Tag-T shards belong to consumers that want T while any is live, else to the
    untagged consumers; untagged shards only ever to untagged consumers."""
    want = {}
    for cid, m in members.items():
        want.setdefault(m["record"].get("tag") or "", []).append(cid)
    untagged = sorted(want.get("", []))
    pools = [(shard_ids(config, [""]), untagged)]
    for tag in tags:
        if tag == "":
            continue
        if want.get(tag):
            pools.append((shard_ids(config, [tag]), sorted(want[tag])))
        else:
            pools[0] = (pools[0][0] + shard_ids(config, [tag]), untagged)
    return pools


@transactional
def read_members(tr, ts: TopicSpace, sub: str, *, snapshot: bool = True, orphans: list | None = None) -> dict:
    """{consumer_id: {"record": dict, "hb": int}} of the subscription. With ``orphans``
    (a list), the keys of heartbeats left without a record are appended to it (left by
    an older FDQ's heartbeat racing a zombie declaration: see ``heartbeat``)."""
    reader = tr.snapshot if snapshot else tr
    r = ts.consumers[sub].range()
    members = {}
    keys = {}
    for kv in reader.get_range(r.start, r.stop):
        t = ts.consumers[sub].unpack(kv.key)
        if len(t) == 1:
            members.setdefault(t[0], {"hb": 0})["record"] = unpack(kv.value)
        else:
            if len(t) == 2 and t[1] == "hb":
                members.setdefault(t[0], {})["hb"] = decode_counter(kv.value)
            keys.setdefault(t[0], []).append(kv.key)
    if orphans is not None:
        orphans += [k for cid, ks in keys.items() if "record" not in members.get(cid, {}) for k in ks]
    return {cid: m for cid, m in members.items() if "record" in m}


@transactional
def read_owners(tr, ts: TopicSpace, sub: str, *, snapshot: bool = True) -> dict:
    """{(tag, n): (owner or None, epoch)} of every shard record of the subscription."""
    reader = tr.snapshot if snapshot else tr
    r = ts.shard_records[sub].range()
    out = {}
    for kv in reader.get_range(r.start, r.stop):
        tag, n = ts.shard_records[sub].unpack(kv.key)
        owner, epoch = unpack(kv.value)
        out[(tag, n)] = (owner, epoch)
    return out


def plan_assignment(shards: list, owners: dict, live: list) -> dict:
    """New owners for ``shards`` given current ``owners`` {(tag, n): owner} and the
    sorted ``live`` consumer ids: an even share each, moving as few shards as possible.
    Deterministic, so members racing to rebalance compute the same plan."""
    if not live:
        return {s: None for s in shards}
    held = {c: [] for c in live}
    orphans = []
    for s in shards:
        o = owners.get(s)
        (held[o] if o in held else orphans).append(s)
    base, extra = divmod(len(shards), len(live))
    # The consumers holding most keep the extra shards: fewer moves.
    order = sorted(live, key=lambda c: (-len(held[c]), c))
    quota = {c: base + (1 if i < extra else 0) for i, c in enumerate(order)}
    for c in live:
        while len(held[c]) > quota[c]:
            orphans.append(held[c].pop())
    orphans.sort()
    for c in sorted(live, key=lambda c: (len(held[c]) - quota[c], c)):
        while len(held[c]) < quota[c] and orphans:
            held[c].append(orphans.pop(0))
    plan = {}
    for c, ss in held.items():
        for s in ss:
            plan[s] = c
    return plan


@transactional
def assign_shards(tr, ts: TopicSpace, sub: str, config=None) -> dict:
    """Re-divide the subscription's shards among its live consumers (the records
    present), by tag pool (see ``ownership_pools``). Moved shards get a new owner
    epoch; heartbeat keys left without a record are cleared. Returns the plan
    {(tag, n): owner}.

    The shard count is the stored config's, read here (a reshard committing meanwhile
    conflicts), not ``config``: a consumer's cached copy may predate a reshard, and a
    plan for the old count left the new shards without an owner for good."""
    config = read_topic_config(tr, ts)
    if sub not in config.subs:
        return {}   # deleted (a consumer's round racing the deletion): no record left behind
    orphans = []
    members = read_members(tr, ts, sub, snapshot=False, orphans=orphans)
    for key in orphans:
        del tr[key]
    tags = read_tags(tr, ts, snapshot=False)
    current = read_owners(tr, ts, sub, snapshot=False)
    owners = {s: o for s, (o, _e) in current.items()}
    plan = {}
    for pool_shards, pool_members in ownership_pools(config, tags, members):
        plan.update(plan_assignment(pool_shards, owners, pool_members))
    shards = list(plan)
    moved = False
    for s in shards:
        owner, epoch = current.get(s, (None, 0))
        if plan[s] != owner or s not in current:
            tr[ts.shard_records[sub].pack(s)] = pack([plan[s], epoch + 1])
            moved = True
    for s in current:  # shards beyond the shard count (after a reshard): unowned
        if s not in plan and current[s][0] is not None:
            tr[ts.shard_records[sub].pack(s)] = pack([None, current[s][1] + 1])
            moved = True
    if moved:
        tr.add(ts.assignment_key(sub), counter(1))
    return plan


@transactional
def assign_new_tags(tr, ts: TopicSpace, sub: str) -> bool:
    """Give an owner (per ``ownership_pools``) to the shards of dispatch tags first
    pushed since the last assignment: push only writes the tag's key blind, so live
    consumers call this from their membership loop. Snapshot reads until a shard record
    is missing, so the common case conflicts only with a config change; consumers racing
    here compute the same plan. Not while resharding (``reshard_finish`` assigns).
    Returns whether it re-assigned."""
    config = read_topic_config(tr, ts)    # a reshard starting meanwhile conflicts
    if config.resharding_to is not None:
        return False
    owners = read_owners(tr, ts, sub)
    if all((tag, n) in owners for tag in read_tags(tr, ts) for n in range(config.shards)):
        return False
    assign_shards(tr, ts, sub, config)
    return True


def _incarnation(raw):
    """The ``incarnation`` of a stored consumer record (None: absent, or a record of
    a consumer from before incarnations)."""
    return None if raw == None else unpack(raw).get("incarnation")  # noqa: E711


def _is_mine(raw, incarnation) -> bool:
    """Whether a stored consumer record (present) belongs to the instance
    ``incarnation`` (None: any; a record without one: any)."""
    theirs = _incarnation(raw)
    return incarnation is None or theirs is None or theirs == incarnation


@transactional
def join(tr, ts: TopicSpace, sub: str, consumer_id: str, record: dict, config) -> dict:
    """Register a consumer and give it its share of shards.

    A record's ``incarnation`` tells instances of one consumer id apart: an instance
    joining under the id of another (a replacement started while the first still
    runs) takes the id over, and the shards the id owns get a new owner epoch, so the
    earlier instance's transactions fail the fence (``ensure_owner``); it no longer
    heartbeats or refreshes its shards as that id (``heartbeat``, ``read_owned``)."""
    key = ts.consumer_key(sub, consumer_id)
    existing = tr[key]
    if existing != None and not _is_mine(existing, record.get("incarnation")):  # noqa: E711
        bumped = False
        for s, (owner, epoch) in read_owners(tr, ts, sub, snapshot=False).items():
            if owner == consumer_id:
                tr[ts.shard_records[sub].pack(s)] = pack([owner, epoch + 1])
                bumped = True
        if bumped:
            tr.add(ts.assignment_key(sub), counter(1))
    tr[key] = pack(record)
    tr.add(ts.heartbeat_key(sub, consumer_id), counter(1))
    return assign_shards(tr, ts, sub, config)


@transactional
def read_owned(tr, ts: TopicSpace, sub: str, consumer_id: str, incarnation=None) -> dict | None:
    """{(tag, n): epoch} of the shards ``consumer_id`` owns; None if another instance
    (``incarnation``) joined under that id since (see ``join``)."""
    raw = tr.snapshot[ts.consumer_key(sub, consumer_id)]
    if raw != None and not _is_mine(raw, incarnation):  # noqa: E711
        return None
    return {s: e for s, (o, e) in read_owners(tr, ts, sub).items() if o == consumer_id}


@transactional
def replaced(tr, ts: TopicSpace, sub: str, consumer_id: str, incarnation) -> bool:
    """Whether another instance joined under ``consumer_id`` (see ``join``)."""
    raw = tr.snapshot[ts.consumer_key(sub, consumer_id)]
    return raw != None and not _is_mine(raw, incarnation)  # noqa: E711


def _remove_member(tr, ts, sub, consumer_id):
    r = ts.consumers[sub][consumer_id].range()
    tr.clear_range(r.start, r.stop)
    del tr[ts.consumer_key(sub, consumer_id)]
    del tr[ts.take_marker_key(sub, consumer_id)]


@transactional
def leave(tr, ts: TopicSpace, sub: str, consumer_id: str, config, incarnation=None):
    """Unregister a consumer and hand its shards to the others now (nothing if
    another instance took its id over: its membership is that one's)."""
    if not _is_mine(tr[ts.consumer_key(sub, consumer_id)], incarnation):
        return
    _remove_member(tr, ts, sub, consumer_id)
    assign_shards(tr, ts, sub, config)


@transactional
def heartbeat(tr, ts: TopicSpace, sub: str, consumer_id: str, incarnation=None) -> bool:
    """Bump the heartbeat counter; False if the record is gone (declared a zombie) or
    another instance took the id over (``replaced``).

    The record is read with a conflict: a zombie declaration (or leave, or a
    subscription's deletion) committing meanwhile makes this retry and return False.
    By snapshot, the heartbeat committed after the declaration and left its keys behind
    without a record (``assign_shards`` clears such leftovers)."""
    raw = tr[ts.consumer_key(sub, consumer_id)]
    if raw == None or not _is_mine(raw, incarnation):  # noqa: E711
        return False
    tr.add(ts.heartbeat_key(sub, consumer_id), counter(1))
    # For display only (``heartbeat_age``): the database clock and the read version.
    tr.max(ts.heartbeat_clock_key(sub, consumer_id), read_clock(tr, ts.clock_key).to_bytes(8, "little"))
    tr.max(ts.consumers.pack((sub, consumer_id, "hbv")), tr.get_read_version().wait().to_bytes(8, "little"))
    return True


VERSIONS_PER_S = 1_000_000


def heartbeat_age(hb_clock, hb_version, clock: int, clock_version, read_version: int):
    """Seconds since a consumer's last heartbeat, for display (``Supervisor.stats``), from
    what it recorded (``hb_clock``: the database clock then; ``hb_version``: the read
    version then; None if absent) and the database now (its ``clock``, the read version
    of the clock's last advance ``clock_version`` or None, and ``read_version``). None
    before the first heartbeat. Liveness never uses it (see the module docstring).

    No single read can time a heartbeat exactly: versions jump ~100 s at an FDB recovery,
    the client's wall clock is any host's, and the database clock only moves while some
    consumer runs. So the age is split at the clock's last advance: up to it, the
    database clock (advanced by live consumers' monotonic clocks: immune to version
    jumps and clock skew; it lags real time by at most a lease-check interval); after
    it (or from the heartbeat, if the clock has not moved since), versions (~1,000,000 a
    second). While any consumer of the database runs, the
    clock advances every ``lease_check_interval_s``, so the figure is right to within
    that interval and a version jump shows only until the next advance (a fraction of
    a second); with no consumer running (all killed), the clock stands still and the
    age grows by versions, as it should. A jump that happens while no consumer runs
    adds ~100 s to it. A consumer of an older FDQ records no clock: its age is by
    versions alone."""
    if hb_version is None:
        return None
    if hb_clock is None:
        return round(max(0, read_version - hb_version) / VERSIONS_PER_S, 3)
    # by versions from the later of the heartbeat and the clock's last advance
    since = max(hb_version, clock_version if clock_version is not None else 0)
    return round(max(0, clock - hb_clock) / 1000 + max(0, read_version - since) / VERSIONS_PER_S, 3)


@transactional
def declare_zombie(tr, ts: TopicSpace, sub: str, consumer_id: str, observed_hb: int, config) -> bool:
    """Remove a consumer whose heartbeat stayed at ``observed_hb``, and re-divide its
    shards. A heartbeat committed meanwhile makes this conflict or return False."""
    if tr[ts.consumer_key(sub, consumer_id)] == None:  # noqa: E711
        return False
    if decode_counter(tr[ts.heartbeat_key(sub, consumer_id)]) != observed_hb:
        return False
    _remove_member(tr, ts, sub, consumer_id)
    assign_shards(tr, ts, sub, config)
    return True


def ensure_owner(tr, ts: TopicSpace, sub: str, shard_id, consumer_id: str, epoch: int):
    """The fence: a non-snapshot read of the shard record, so a transaction of a
    consumer that lost the shard conflicts or fails here."""
    raw = tr[ts.shard(sub, *shard_id).record]
    if raw == None:  # noqa: E711
        raise LeaseLost(f"shard {shard_id} of {ts.name}/{sub} has no owner record")
    owner, current = unpack(raw)
    if owner != consumer_id or current != epoch:
        raise LeaseLost(f"shard {shard_id} of {ts.name}/{sub} is owned by {owner!r} "
                        f"(epoch {current}), not {consumer_id!r} (epoch {epoch})")
