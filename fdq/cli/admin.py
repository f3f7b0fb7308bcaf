"""Supervision: ``fdq pause``, ``play``, ``rebalance``, ``replay``, ``trim``, ``maintain`` and the
dead letters (``fdq dlq list|redrive|purge``)."""
from __future__ import annotations

import signal
import threading
import time

import click

from .. import ConfigError, Maintenance, Supervisor
from ..config import check_replay_id, default_replay_id
from ..times import as_datetime, iso_ms
from . import render, rows
from .app import (cli, confirm, exit_interrupted, json_option, pass_state, resumable, subscription_option,
                  topic_argument)
from .params import Duration, Int, Shards, Since, Time, format_option

@cli.command()
@topic_argument
@pass_state
def pause(state, topic):
    """Pause TOPIC: stop routing and consumption.

    Pushes still land in the topic's log; fdq play routes them."""
    state.supervisor.pause(topic)
    render.note(f"paused topic {topic!r}")


@cli.command()
@topic_argument
@json_option
@pass_state
def play(state, topic, as_json):
    """Resume TOPIC: route what arrived while paused, in order."""
    sup = state.supervisor
    pending = sup.stats(topic)["counters"]["pending"]
    resumable(state, f"play of {topic!r}")
    with render.progress(f"routing {topic}", pending) as advance:
        routed = sup.play(topic, progress=advance)
    render.note(f"topic {topic!r} is running: routed {routed:,} messages pushed while paused")
    if as_json:
        render.emit_json({"topic": topic, "routed": routed})


@cli.command()
@topic_argument
@click.option("--shards", type=Shards(), default=None,
              help="Change the shard count (re-routes every backlog, each key's order kept).")
@json_option
@pass_state
def rebalance(state, topic, shards, as_json):
    """Re-divide TOPIC's shards among live consumers.

    With --shards N, change the shard count first (every backlog re-routed,
    each shard key's order kept): a bar counts the queued messages (each once,
    moved or kept in its shard), then a line says how many moved."""
    sup = state.supervisor
    config = sup.config(topic)          # unknown: exit 1 before anything changes
    resumable(state, f"rebalance of {topic!r}")
    if shards not in (None, config.shards) or config.resharding_to not in (None, config.shards):
        # the total: what the queues hold, from counters (a reshard counts each message once)
        queued = sum(s["backlog"] for s in sup.stats(topic)["subscriptions"].values())
        with render.progress(f"resharding {topic}", queued) as advance:
            result = sup.rebalance(topic, shards=shards, progress=advance)
    else:
        result = sup.rebalance(topic, shards=shards)
    members = rows.consumer_rows(sup.stats(topic))
    zombies = sum(1 for c in members if c["zombie"])
    consumers = _count(len(members), "consumer") + (
        f" ({zombies} of them zombies: a live consumer takes their shards over)" if zombies else "")
    if result.from_shards != result.shards:
        render.note(f"topic {topic!r}: {result.from_shards} → {result.shards} shards; moved {result.moved:,} of "
                    f"{_count(result.queued, 'queued message')}; {consumers}")
    else:
        render.note(f"topic {topic!r}: {result.shards} shards divided among {consumers}")
    if as_json:
        render.emit_json({"topic": topic, "from_shards": result.from_shards, "shards": result.shards,
                          "queued": result.queued, "moved": result.moved, "consumers": len(members),
                          "zombies": zombies})


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


@cli.command()
@topic_argument
@click.option("--start", type=Time(), default=None,
              help="From (ISO-8601, <n>s, <n>ms, or before now: -15m), inclusive.")
@click.option("--since", type=Since(), default=None, metavar="DURATION",
              help="From this long ago: --since 1h is --start -1h.")
@click.option("--end", type=Time(), default=None,
              help="To (ISO-8601, <n>s, <n>ms, now, -5m), exclusive [default: now].")
@click.option("--id", "replay_id", default=None, metavar="ID",
              help="Name this replay [default: its window, <start_ms>:<end_ms> or <start_ms>:open].")
@click.option("--again", is_flag=True, help="Replay again a replay (this --id, or window) that finished before.")
@click.option("--include-replays", is_flag=True,
              help="Also replay the copies earlier replays pushed [default: only original messages].")
@click.option("--dry-run", is_flag=True,
              help="Change nothing: show how many would be replayed, and to which subscriptions.")
@json_option
@pass_state
def replay(state, topic, start, since, end, replay_id, again, include_replays, dry_run, as_json):
    """Deliver again TOPIC's messages inserted in [--start, --end).

    In order, as new messages (new ids; each keeps the original's id in
    replay_of), what was committed when the replay began; copies pushed by
    earlier replays are left out (--include-replays keeps them). Once per
    replay: the same command again does nothing once the replay has finished
    (--again replays again), and after a crash or Ctrl-C it continues where
    it stopped.

    Times: ISO-8601 (2026-11-23T02:00:00Z; no zone = UTC), epoch seconds with
    s (1795399200s) or epoch milliseconds with ms or bare (1795399200000). A
    bare number that looks like seconds (below 100000000000) is refused;
    now, or a duration before or after now (-15m, +1h)."""
    if (start is None) == (since is None):
        raise click.UsageError("give the window's start: --start TIME or --since DURATION (one of them)")
    start = since if start is None else start
    if end is not None and end <= start:
        raise click.BadParameter(f"--end ({iso_ms(end)}) must be after --start ({iso_ms(start)})",
                                param_hint="'--end'")
    try:
        check_replay_id(replay_id if replay_id is not None else default_replay_id(start, end))
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="'--id'") from None
    sup = state.supervisor
    sup.config(topic)
    options = dict(replay_id=replay_id, again=again, include_replays=include_replays)
    if dry_run:
        _replay_dry_run(sup.replay(topic, as_datetime(start), as_datetime(end), dry_run=True, **options),
                        topic, as_json)
        return
    done = 0

    def count(n):
        nonlocal done
        # the bar first: an interrupt inside it leaves done as it was, and the replay
        # then reports the chunk again from its progress record (once)
        advance(n)
        done += n
    # Each chunk commits with the replay's progress: a rerun takes this run over (once its
    # heartbeat has stood still for ~3 s) and goes on after its last chunk.
    state.interrupted = lambda: (f"replayed {done:,} messages of {topic!r} so far; run the same command "
                                 "again to resume (it continues where this one stopped)")
    with render.progress(f"replaying {topic}") as advance:
        result = sup.replay(topic, as_datetime(start), as_datetime(end), progress=count, **options)
    if result.finished is not None:
        f = result.finished
        render.note(f"replay {result.replay_id} of {topic!r} already finished at {iso_ms(f['finished_ms'])} "
                    f"({f['count']:,} messages): nothing replayed; --again replays it again")
    else:
        skipped = (f" ({result.skipped_replays:,} copies from earlier replays left out; --include-replays "
                   "replays them too)") if result.skipped_replays else ""
        render.note(f"replayed {result.replayed:,} messages of topic {topic!r} (replay {result.replay_id}){skipped}")
    if as_json:
        render.emit_json({"topic": topic, "replay_id": result.replay_id, "replayed": result.replayed,
                          "skipped_replays": result.skipped_replays,
                          "already_finished": result.finished is not None, "start_ms": start, "end_ms": end})


def _replay_dry_run(plan: dict, topic: str, as_json: bool):
    if as_json:
        render.emit_json({"topic": topic, **plan})
        return
    if plan["finished"] is not None and plan["messages"] == 0:
        f = plan["finished"]
        render.note(f"dry run: replay {plan['replay_id']} of {topic!r} finished at {iso_ms(f['finished_ms'])} "
                    f"({f['count']:,} messages): it would replay nothing (--again: replay it again)")
        return
    extra = [f"{plan['skipped_replays']:,} copies from earlier replays left out"] if plan["skipped_replays"] else []
    if plan["trimmed"]:
        extra.append(f"{plan['trimmed']:,} trimmed")
    if plan["resumes"]:
        extra.append("an interrupted run would be resumed: only what it left is pushed")
    render.note(f"dry run: replay {plan['replay_id']} of {topic!r} would push {plan['messages']:,} messages "
                f"({plan['bytes']:,} bytes)" + (f"; {'; '.join(extra)}" if extra else ""))
    render.table("would be delivered", [("subscription", lambda kv: kv[0]), ("messages", lambda kv: kv[1])],
                 sorted(plan["subscriptions"].items()))


@cli.command()
@topic_argument
@click.option("--before", type=Time(), default=None,
              help="Delete log entries inserted before this time (ISO-8601, <n>s, <n>ms, -7d) [default: the topic's retention_s]; "
                   "its retention_bytes applies either way.")
@json_option
@pass_state
def trim(state, topic, before, as_json):
    """Apply retention to TOPIC's log (what replay reads).

    By age (its retention_s, or --before), then by size (its retention_bytes:
    the oldest entries go until the log fits). Set them with fdq topics update.

    Also expires dedupe ids and push markers past their windows. Queued
    messages are untouched."""
    sup = state.supervisor
    config = sup.config(topic)
    if before is None and config.retention_s is None and config.retention_bytes is None \
            and config.retention_messages is None:
        render.note(f"topic {topic!r} has no retention: give --before to trim its log")
    holder, age = _live_maintainer(sup, topic)
    if holder is not None:
        # Not deferred: each step is one transaction deleting what it reads (a step of
        # the maintainer's on the same entries conflicts and retries: nothing counted
        # twice), and --before may ask for more than the retention the holder applies.
        render.note(f"note: {holder} maintains topic {topic!r} (its last pass {age:.0f}s ago): "
                    "this trim runs beside it, which is safe")
    resumable(state, f"trim of {topic!r}")
    with render.progress(f"trimming {topic}") as advance:
        n = sup.trim(topic, before_ms=as_datetime(before), progress=advance)
    render.note(f"deleted {n:,} log entries of topic {topic!r}")
    if as_json:
        render.emit_json({"topic": topic, "deleted": n})


def _live_maintainer(sup, topic: str) -> tuple:
    """(holder, seconds since its last pass) of ``topic``'s maintenance role if it looks
    live: a holder recorded and a pass of it within ``MAINT_LIVE_S`` (passes come every
    1 to 30 s); else (None, None)."""
    m = sup.stats(topic)["maintenance"]
    age = m["last_pass_age_s"]
    if m["holder"] is None or m["last_pass_by"] != m["holder"] or age is None or age > MAINT_LIVE_S:
        return None, None
    return m["holder"], age


# A maintenance pass at most this long ago: its holder is live (passes back off to 30 s,
# a holder killed is taken over after its 10 s lease).
MAINT_LIVE_S = 45.0


@cli.command()
@click.argument("topics", nargs=-1, metavar="[TOPIC]...")
@pass_state
def maintain(state, topics):
    """Run retention and TTL sweeps in the foreground until SIGTERM or Ctrl-C.

    For TOPICs (default: every topic, also those created later): the
    maintenance every consumer and broker takes part in, for where none runs.
    One process per topic does the work at a time (a role in the database):
    this one takes a topic over when its holder stops or stands still 10s,
    and defers to a live one. Progress: fdq stats TOPIC. SIGTERM: exit 0;
    Ctrl-C: 130; either gives up the topics it held at once."""
    for t in topics:
        state.supervisor.config(t)      # TopicNotFound: named, exit 1
    stop, first = threading.Event(), []

    def on_signal(signum, _frame):      # flags only (see fdq worker's _Signals)
        if not first:
            first.append(signum)
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    state.interrupted = lambda: "maintenance stopped"
    try:
        m = Maintenance(state.db, topics=list(topics) or None)
        render.note(f"fdq maintain: {m.name} on {', '.join(topics) if topics else 'every topic'} "
                    "(SIGTERM or Ctrl-C: stop)")
        try:
            while not stop.is_set():
                time.sleep(0.2)
        finally:
            m.close()
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
    if first and first[0] == signal.SIGINT:
        exit_interrupted(state.interrupted)
    render.note("fdq maintain: stopped")


# -- dead letters ---------------------------------------------------------------------

DLQ_COLUMNS = [
    ("id", lambda d: d["id"]),
    ("reason", lambda d: d["reason"]),
    ("attempts", lambda d: d["attempts"]),
    ("key", lambda d: d["shard_key"]),
    ("inserted", lambda d: render.time_ms(d["insertion_time_ms"])),
    ("consumer", lambda d: d["consumer"]),
    ("body", lambda d: d["body"]),
]


@cli.group()
def dlq():
    """Dead letters of a subscription: list, redrive, purge."""


@dlq.command("list")
@topic_argument
@subscription_option
@click.option("--limit", type=Int(1, Supervisor.DLQ_LIST_MAX), default=100, show_default=True)
@format_option
@pass_state
def dlq_list(state, topic, subscription, limit, as_json):
    """List dead letters, oldest first, with the reason each was dead-lettered."""
    data = [rows.dlq_row(d, subscription) for d in state.supervisor.dlq_list(topic, subscription, limit)]
    render.rows_or_note(data, DLQ_COLUMNS, f"the dead-letter queue of {topic}/{subscription} is empty", as_json)


def _dlq_selection(ids, older_than, every) -> str:
    """Which dead letters a redrive or purge acts on: exactly one of --id, --older-than
    and --all (a usage error otherwise)."""
    given = [name for name, v in (("--id", ids), ("--older-than", older_than), ("--all", every)) if v]
    if len(given) != 1:
        raise click.UsageError("give one of --id ID (repeatable), --older-than DURATION or --all"
                               + (f", not {' and '.join(given)} together" if given else ""))
    return given[0]


def _by_ids(call, topic, subscription, ids) -> int:
    try:
        return call(topic, subscription, list(ids))
    except ConfigError as e:            # a malformed id: nothing changed
        raise click.BadParameter(str(e), param_hint="'--id'") from None


def _which(ids, older_than) -> str:
    if ids:
        return f" (of the {len(set(ids)):,} ids given)"
    if older_than is not None:
        return f" (those dead-lettered over {render.duration_ms(round(older_than * 1000))} ago)"
    return ""


dlq_ids_option = click.option("--id", "ids", multiple=True, metavar="ID",
                              help="This dead letter (its id, as fdq dlq list shows it); repeatable.")
dlq_older_option = click.option("--older-than", type=Duration(), default=None, metavar="DURATION",
                                help="Those dead-lettered at least this long ago (1h, 30m, 90s).")


@dlq.command("redrive")
@topic_argument
@subscription_option
@dlq_ids_option
@dlq_older_option
@click.option("--all", "every", is_flag=True, help="Every dead letter of the subscription.")
@json_option
@pass_state
def dlq_redrive(state, topic, subscription, ids, older_than, every, as_json):
    """Move dead letters back to their shards' queues (attempts reset).

    Which: --id ID (repeatable), --older-than DURATION (by when each was
    dead-lettered), or --all."""
    _dlq_selection(ids, older_than, every)
    sup = state.supervisor
    sup.subscription(topic, subscription)     # unknown: exit 1 before anything changes
    resumable(state, f"redrive of {topic}/{subscription}")
    if ids:
        n = _by_ids(sup.dlq_redrive_ids, topic, subscription, ids)
    else:
        total = sup.stats(topic)["subscriptions"][subscription]["dlq"]
        with render.progress(f"redriving {topic}/{subscription}", None if older_than else total) as advance:
            n = sup.dlq_redrive(topic, subscription, progress=advance, older_than_s=older_than)
    render.note(f"redrove {n:,} dead letters of {topic}/{subscription}{_which(ids, older_than)}")
    if as_json:
        render.emit_json({"topic": topic, "subscription": subscription, "redriven": n})


@dlq.command("purge")
@topic_argument
@subscription_option
@dlq_ids_option
@dlq_older_option
@click.option("--all", "every", is_flag=True, help="Every dead letter of the subscription.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
@pass_state
def dlq_purge(state, topic, subscription, ids, older_than, every, yes, as_json):
    """Delete dead letters of the subscription.

    Which: --id ID (repeatable), --older-than DURATION (by when each was
    dead-lettered), or --all."""
    _dlq_selection(ids, older_than, every)
    sup = state.supervisor
    sup.subscription(topic, subscription)     # unknown: exit 1 before anything changes
    which = ("every dead letter" if every else f"{len(set(ids)):,} dead letter(s) by id" if ids
             else f"the dead letters dead-lettered over {render.duration_ms(round(older_than * 1000))} ago")
    if not yes:
        confirm(f"Delete {which} of {topic}/{subscription}?", f"the dead letters of {topic}/{subscription} not purged")
    resumable(state, f"purge of {topic}/{subscription}")
    if ids:
        n = _by_ids(sup.dlq_purge_ids, topic, subscription, ids)
    else:
        n = sup.dlq_purge(topic, subscription, older_than_s=older_than)
    render.note(f"purged {n:,} dead letters of {topic}/{subscription}{_which(ids, older_than)}")
    if as_json:
        render.emit_json({"topic": topic, "subscription": subscription, "purged": n})


def reap_consumers(state, topic: str, action: str | None, zombie_after: float | None, as_json: bool):
    """``fdq consumers TOPIC reap``: ``Supervisor.reap``, said."""
    if action != "reap":
        raise click.UsageError("--zombie-after goes with reap: fdq consumers TOPIC reap --zombie-after 3s")
    zombie_after = 3.0 if zombie_after is None else zombie_after
    sup = state.supervisor
    sup.config(topic)               # unknown: exit 1 before waiting
    render.note(f"watching the heartbeats of the consumers of {topic!r} for "
                f"{render.duration_ms(round(zombie_after * 1000))} (or a consumer's own longer zombie timeout)...")
    reaped = sup.reap(topic, zombie_after_s=zombie_after)
    zombies = reaped["zombies"]
    render.note(f"declared {len(zombies):,} zombie(s) of {topic!r}"
                + (": " + ", ".join(f"{z['subscription']}/{z['id']}" for z in zombies)
                   + " (their shards divided among live consumers)" if zombies else "")
                + (f"; deleted ephemeral subscription(s) left without consumers: "
                   f"{', '.join(reaped['deleted_subscriptions'])}" if reaped["deleted_subscriptions"] else ""))
    if as_json:
        render.emit_json({"topic": topic, **reaped})
