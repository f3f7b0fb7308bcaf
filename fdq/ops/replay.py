"""Replay: the transactional steps of pushing a window of the "all" log again.

A replay has an id (``replay_id``: by default its window, ``<start_ms>:<end_ms>``, or
``<start_ms>:open`` without an end). It is done by *runs*. Each run has a progress
record (``replays/<id>/<run>``: the window, ``stop`` (the read version it began at: it
replays what was committed before), ``after`` (the last original pushed again),
``count``, and its ``owner``) and a heartbeat counter beside it. The run that finishes
a replay leaves its record, ``replays/<id>/"done"`` ({start, end, stop, count,
finished_ms}), in the transaction that removes its progress: the same replay again is
then a no-op (``replay_begin`` returns that record) unless asked to run ``again``. Each chunk pushes its
messages and advances the progress in one transaction (``replay_chunk``), fenced by the
owner, so a retry after ``commit_unknown_result`` pushes nothing twice and a run taken
over (``replay_begin(claim=...)``) by another caller cannot commit again. The loop that
drives a run (a heartbeat thread, watching for orphaned runs) is
``fdq.supervisor.run_replay``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine import transactional
from ..errors import ConfigError, ReplayTakenOver
from ..keyspace import REPLAY_DONE, Keyspace, TopicSpace, counter, decode_counter
from ..keyspace.codec import decode_replay, encode_replay
from .push import TX_WRITE_BYTES, push_batch


@dataclass(frozen=True)
class Replayed:
    """What ``Supervisor.replay`` did: ``replayed`` messages pushed again by this call;
    ``skipped_replays``: copies made by earlier replays, left out (``include_replays``
    keeps them); ``finished``: the replay's done record ({start, end, stop, count,
    finished_ms}) when it had finished before and so did nothing now."""

    replay_id: str
    replayed: int
    skipped_replays: int = 0
    finished: dict | None = None


@transactional
def replay_done(tr, ts: TopicSpace, replay_id: str) -> dict | None:
    """The record of replay ``replay_id``'s finish, None if it has not finished (a
    snapshot read)."""
    return decode_replay(tr.snapshot[ts.replay_done_key(replay_id)])


@transactional
def replay_runs(tr, ts: TopicSpace, window: str) -> dict:
    """{run: (owner, heartbeat)} of the unfinished runs of replay ``window`` (its id)
    (snapshot reads)."""
    r = ts.replay_runs_range(window)
    owners, beats = {}, {}
    for kv in tr.snapshot.get_range(r.start, r.stop):
        key = ts.replays.unpack(kv.key)
        if key[1] == REPLAY_DONE:
            continue
        if len(key) == 2:
            owners[key[1]] = decode_replay(kv.value).get("owner")
        else:
            beats[key[1]] = decode_counter(kv.value)
    return {run: (owner, beats.get(run, 0)) for run, owner in owners.items()}


@transactional
def replay_begin(tr, ts: TopicSpace, window: str, owner: str, start_ms, end_ms, claim=None, *,
                 again: bool = True):
    """Start a run of replay ``window`` (its id) owned by ``owner``: it replays what was
    committed up to this transaction's read version (``stop``). With ``claim`` (run,
    owner, heartbeat as ``replay_runs`` saw them), take that run over instead, if it is
    still as seen (else None). Returns ``(run, progress)``; without ``again``, ``(None,
    done record)`` if the replay has finished before (read with a conflict: a run
    finishing meanwhile makes this retry and see it)."""
    if claim is not None:
        run, old_owner, seen = claim
        state = decode_replay(tr[ts.replay_run_key(window, run)])
        if state is None or decode_counter(tr[ts.replay_beat_key(window, run)]) != seen \
                or state.get("owner") != old_owner:
            return None
        state["owner"] = owner
        tr[ts.replay_run_key(window, run)] = encode_replay(state)
        return run, state
    if not again:
        done = decode_replay(tr[ts.replay_done_key(window)])
        if done is not None:
            return None, done
    state = {"start": start_ms, "end": end_ms, "stop": tr.get_read_version().wait(), "after": None,
             "count": 0, "owner": owner}
    tr[ts.replay_run_key(window, owner)] = encode_replay(state)
    return owner, state


def _owned(tr, ts: TopicSpace, window: str, run: str, owner: str) -> dict:
    """The progress of ``run``, read with a conflict, if ``owner`` still owns it: else
    ``ReplayTakenOver`` (taken over) or ``ConfigError`` (finished, or never begun)."""
    state = decode_replay(tr[ts.replay_run_key(window, run)])
    if state is None:
        raise ConfigError(f"replay {window!r} of topic {ts.name!r} is not running")
    if state.get("owner") != owner:
        raise ReplayTakenOver(f"replay {window!r} of topic {ts.name!r} stalled (its heartbeat stood still) "
                              "and another call took it over: this one stops")
    return state


@transactional
def replay_chunk(tr, ks: Keyspace, ts: TopicSpace, run: tuple, entries: list, txid: bytes,
                 now_ms: int, time_index: dict) -> tuple:
    """Push the ``entries`` [(vs, ops.push.PushItem)] past the progress of ``run`` (window,
    run, owner) and advance it, in this one transaction, if ``owner`` still owns the run.
    Takes the first of them whose writes fit a transaction (``push_batch``'s sizing rule,
    by the topic's config read here: a subscription created or deleted meanwhile
    conflicts), at least one. Returns ``(pushed, taken)``: how many the run has pushed
    in all, and how many of ``entries`` (from the first) are done."""
    window, run_id, owner = run
    state = _owned(tr, ts, window, run_id, owner)
    after = state["after"]
    todo = [(vs, item) for vs, item in entries if after is None or vs.to_bytes() > after]
    skipped = len(entries) - len(todo)
    if not todo:
        return state["count"], skipped
    # The progress, not a push marker, says whether an attempt committed: no marker read.
    results, _stamp = push_batch(tr, ks, [(ts.name, item) for _vs, item in todo], txid,
                                 int.from_bytes(txid[:4], "big"), False, now_ms, time_index, False,
                                 TX_WRITE_BYTES)
    taken = len(results)
    state["after"] = todo[taken - 1][0].to_bytes()
    state["count"] += taken
    tr[ts.replay_run_key(window, run_id)] = encode_replay(state)
    return state["count"], skipped + taken


@transactional
def replay_count(tr, ts: TopicSpace, window: str, run: str, owner: str) -> int | None:
    """How many ``run`` has pushed by its progress (a snapshot read), None if it is not
    ``owner``'s (any more)."""
    state = decode_replay(tr.snapshot[ts.replay_run_key(window, run)])
    return state["count"] if state is not None and state.get("owner") == owner else None


@transactional
def replay_finish(tr, ts: TopicSpace, window: str, run: str, owner: str, now_ms: int):
    """Remove a finished run's progress and heartbeat, and record the replay's finish
    (``REPLAY_DONE``: {start, end, stop, count, finished_ms}), if ``owner`` still owns it."""
    state = decode_replay(tr[ts.replay_run_key(window, run)])
    if state is not None and state.get("owner") == owner:
        del tr[ts.replay_run_key(window, run)]
        del tr[ts.replay_beat_key(window, run)]
        tr[ts.replay_done_key(window)] = encode_replay({k: state[k] for k in ("start", "end", "stop", "count")}
                                                 | {"finished_ms": now_ms})


@transactional
def replay_beat(tr, ts: TopicSpace, window: str, run: str):
    """Bump ``run``'s heartbeat counter while its progress record exists (read with a
    conflict: a beat racing the run's finish or takeover retries and finds it gone,
    rather than leave a counter of a finished run behind)."""
    if tr[ts.replay_run_key(window, run)] != None:  # noqa: E711
        tr.add(ts.replay_beat_key(window, run), counter(1))
