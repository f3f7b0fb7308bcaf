"""Supervision: ``fdq pause``, ``play``, ``rebalance``, ``replay``, ``trim`` and the
dead letters (``fdq dlq list|redrive|purge``)."""
from __future__ import annotations

import click

from .. import ConfigError, Supervisor
from ..config import check_replay_id, default_replay_id
from ..times import as_datetime, iso_ms
from . import render, rows
from .app import cli, confirm, json_option, pass_state, resumable, subscription_option, topic_argument
from .params import Int, Shards, Since, Time, format_option

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
    each shard key's order kept)."""
    sup = state.supervisor
    sup.config(topic)          # unknown: exit 1 before anything changes
    resumable(state, f"rebalance of {topic!r}")
    # Queue entries read, without a total: a message moving to a shard not processed yet
    # is read again there, so no count known beforehand bounds it (the backlog did not).
    with render.progress(f"resharding {topic}") as advance:
        config = sup.rebalance(topic, shards=shards, progress=advance)
    members = rows.consumer_rows(sup.stats(topic))
    zombies = sum(1 for c in members if c["zombie"])
    render.note(f"topic {topic!r}: {config.shards} shards divided among {len(members)} consumer(s)"
                + (f" ({zombies} of them zombies: a live consumer takes their shards over)" if zombies else ""))
    if as_json:
        render.emit_json(rows.topic_row(topic, sup.stats(topic)))


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
    if before is None and config.retention_s is None and config.retention_bytes is None:
        render.note(f"topic {topic!r} has no retention: give --before to trim its log")
    resumable(state, f"trim of {topic!r}")
    with render.progress(f"trimming {topic}") as advance:
        n = sup.trim(topic, before_ms=as_datetime(before), progress=advance)
    render.note(f"deleted {n:,} log entries of topic {topic!r}")
    if as_json:
        render.emit_json({"topic": topic, "deleted": n})


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


@dlq.command("redrive")
@topic_argument
@subscription_option
@json_option
@pass_state
def dlq_redrive(state, topic, subscription, as_json):
    """Move every dead letter back to its shard's queue (attempts reset)."""
    sup = state.supervisor
    sup.subscription(topic, subscription)     # unknown: exit 1 before anything changes
    total = sup.stats(topic)["subscriptions"][subscription]["dlq"]
    resumable(state, f"redrive of {topic}/{subscription}")
    with render.progress(f"redriving {topic}/{subscription}", total) as advance:
        n = sup.dlq_redrive(topic, subscription, progress=advance)
    render.note(f"redrove {n:,} dead letters of {topic}/{subscription}")
    if as_json:
        render.emit_json({"topic": topic, "subscription": subscription, "redriven": n})


@dlq.command("purge")
@topic_argument
@subscription_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
@pass_state
def dlq_purge(state, topic, subscription, yes, as_json):
    """Delete every dead letter of the subscription."""
    sup = state.supervisor
    sup.subscription(topic, subscription)     # unknown: exit 1 before anything changes
    if not yes:
        confirm(f"Delete every dead letter of {topic}/{subscription}?",
                 f"the dead letters of {topic}/{subscription} not purged")
    resumable(state, f"purge of {topic}/{subscription}")
    n = sup.dlq_purge(topic, subscription)
    render.note(f"purged {n:,} dead letters of {topic}/{subscription}")
    if as_json:
        render.emit_json({"topic": topic, "subscription": subscription, "purged": n})
