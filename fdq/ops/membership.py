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
age that stats display is a separate, approximate figure: ``fdq.ops.clock.heartbeat_age``.)
"""
from __future__ import annotations

from ..engine import transactional
from ..errors import LeaseLost
from ..keyspace import TopicSpace, counter, decode_counter
from ..keyspace.codec import pack, unpack
from .topics import read_topic_config
from .clock import read_clock


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
def read_members(tr, ts: TopicSpace, sub: str, *, snapshot: bool = True) -> dict:
    """{consumer_id: {"record": dict, "hb": int}} of the subscription. ``snapshot=False``
    reads the records with a conflict (a join or leave committing meanwhile conflicts);
    the heartbeat counters are always read by snapshot, from their own range: every
    member bumps its counter every heartbeat, and an assignment conflicting with each
    bump would rarely commit among many consumers."""
    reader = tr.snapshot if snapshot else tr
    records = ts.consumers[sub]
    r = records.range()
    members = {}
    for kv in reader.get_range(r.start, r.stop):
        t = records.unpack(kv.key)
        if len(t) == 1:
            members[t[0]] = {"record": unpack(kv.value), "hb": 0}
    beats = ts.heartbeats[sub]
    r = beats.range()
    for kv in tr.snapshot.get_range(r.start, r.stop):
        cid, kind = beats.unpack(kv.key)
        if kind == "hb" and cid in members:
            members[cid]["hb"] = decode_counter(kv.value)
    return members


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
def assign_shards(tr, ts: TopicSpace, sub: str) -> dict:
    """Re-divide the subscription's shards among its live consumers (the records
    present), by tag pool (see ``ownership_pools``). Moved shards get a new owner
    epoch. Returns the plan {(tag, n): owner}.

    The shard count is the stored config's, read here (a reshard committing meanwhile
    conflicts), never a caller's cached copy: one from before a reshard planned the old
    count and left the new shards without an owner for good."""
    config = read_topic_config(tr, ts)
    if sub not in config.subs:
        return {}   # deleted (a consumer's round racing the deletion): no record left behind
    members = read_members(tr, ts, sub, snapshot=False)
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
    assign_shards(tr, ts, sub)
    return True


def _is_mine(raw, incarnation) -> bool:
    """Whether a stored consumer record (present) belongs to the instance
    ``incarnation`` (None: any)."""
    return incarnation is None or unpack(raw).get("incarnation") == incarnation


@transactional
def join(tr, ts: TopicSpace, sub: str, consumer_id: str, record: dict) -> dict:
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
    return assign_shards(tr, ts, sub)


@transactional
def read_owned(tr, ts: TopicSpace, sub: str, consumer_id: str, incarnation=None) -> dict | None:
    """{(tag, n): epoch} of the shards ``consumer_id`` owns; None if another instance
    (``incarnation``) joined under that id since (see ``join``)."""
    raw = tr.snapshot[ts.consumer_key(sub, consumer_id)]
    if raw != None and not _is_mine(raw, incarnation):  # noqa: E711
        return None
    return {s: e for s, (o, e) in read_owners(tr, ts, sub).items() if o == consumer_id}


@transactional
def read_owned_watched(tr, ts: TopicSpace, sub: str, consumer_id: str, incarnation=None) -> tuple:
    """``read_owned`` and a watch on the subscription's assignment counter set at the
    same read: it fires at the next change of ownership (a join, leave, takeover or
    reshard by anyone), so the consumer reads its shards again then, not at its next
    heartbeat (a peer's leave gave the survivor nothing new to fence against: its own
    shards' epochs were unchanged, it leased them and kept polling those alone)."""
    return read_owned(tr, ts, sub, consumer_id, incarnation), tr.watch(ts.assignment_key(sub))


@transactional
def replaced(tr, ts: TopicSpace, sub: str, consumer_id: str, incarnation) -> bool:
    """Whether another instance joined under ``consumer_id`` (see ``join``)."""
    raw = tr.snapshot[ts.consumer_key(sub, consumer_id)]
    return raw != None and not _is_mine(raw, incarnation)  # noqa: E711


def _remove_member(tr, ts, sub, consumer_id):
    r = ts.heartbeats[sub][consumer_id].range()
    tr.clear_range(r.start, r.stop)
    del tr[ts.consumer_key(sub, consumer_id)]
    del tr[ts.take_marker_key(sub, consumer_id)]


@transactional
def leave(tr, ts: TopicSpace, sub: str, consumer_id: str, incarnation=None):
    """Unregister a consumer and hand its shards to the others now (nothing if
    another instance took its id over: its membership is that one's)."""
    raw = tr[ts.consumer_key(sub, consumer_id)]
    if raw != None and not _is_mine(raw, incarnation):  # noqa: E711
        return
    _remove_member(tr, ts, sub, consumer_id)
    assign_shards(tr, ts, sub)


@transactional
def heartbeat(tr, ts: TopicSpace, sub: str, consumer_id: str, incarnation=None) -> bool:
    """Bump the heartbeat counter; False if the record is gone (declared a zombie) or
    another instance took the id over (``replaced``).

    The record is read with a conflict: a zombie declaration (or leave, or a
    subscription's deletion) committing meanwhile makes this retry and return False
    (by snapshot, a heartbeat committed after the declaration would leave its keys
    behind without a record)."""
    raw = tr[ts.consumer_key(sub, consumer_id)]
    if raw == None or not _is_mine(raw, incarnation):  # noqa: E711
        return False
    tr.add(ts.heartbeat_key(sub, consumer_id), counter(1))
    # For display only (``clock.heartbeat_age``): the topic's clock and the read version.
    tr.max(ts.heartbeat_clock_key(sub, consumer_id), read_clock(tr, ts.clock_key).to_bytes(8, "little"))
    tr.max(ts.heartbeat_version_key(sub, consumer_id), tr.get_read_version().wait().to_bytes(8, "little"))
    return True


@transactional
def declare_zombie(tr, ts: TopicSpace, sub: str, consumer_id: str, observed_hb: int) -> bool:
    """Remove a consumer whose heartbeat stayed at ``observed_hb``, and re-divide its
    shards. A heartbeat committed meanwhile makes this conflict or return False."""
    if tr[ts.consumer_key(sub, consumer_id)] == None:  # noqa: E711
        return False
    if decode_counter(tr[ts.heartbeat_key(sub, consumer_id)]) != observed_hb:
        return False
    _remove_member(tr, ts, sub, consumer_id)
    assign_shards(tr, ts, sub)
    return True


def ensure_owner(tr, ts: TopicSpace, sub: str, shard_id, consumer_id: str, epoch: int):
    """The fence: a non-snapshot read of the shard record, so a transaction of a
    consumer that lost the shard conflicts or fails here."""
    check_owner(tr[ts.shard(sub, *shard_id).record], ts, sub, shard_id, consumer_id, epoch)


def check_owner(raw, ts: TopicSpace, sub: str, shard_id, consumer_id: str, epoch: int):
    """``ensure_owner`` on the shard record's read ``raw`` (a future issued earlier in
    the same transaction, non-snapshot: ``queue.round_reads``)."""
    if raw == None:  # noqa: E711
        raise LeaseLost(f"shard {shard_id} of {ts.name}/{sub} has no owner record")
    owner, current = unpack(raw)
    if owner != consumer_id or current != epoch:
        raise LeaseLost(f"shard {shard_id} of {ts.name}/{sub} is owned by {owner!r} "
                        f"(epoch {current}), not {consumer_id!r} (epoch {epoch})")


__all__ = ["shard_ids", "read_tags", "ownership_pools", "read_members", "read_owners", "plan_assignment",
           "assign_shards", "assign_new_tags", "join", "read_owned", "read_owned_watched", "replaced", "leave", "heartbeat",
           "declare_zombie", "ensure_owner", "check_owner"]
