"""``fdq subs``: a topic's subscriptions (list, create, show, update, reset, pause,
play, delete)."""
from __future__ import annotations

import json

import click

from .. import ConfigError, SubscriptionConfig
from ..config import ACK_POLICIES, DELIVER_POLICIES, UPDATABLE_SUBSCRIPTION_FIELDS, check_filters
from ..times import as_datetime
from . import render, rows
from .app import cli, confirm, json_option, pass_state, resumable, topic_argument
from .params import (SUBSCRIPTION, FilterHeader, Int, Seconds, SecondsList, Time, TimeOrNow, filter_headers_callback,
                     format_option, subscription_config_callback)

class SubsGroup(click.Group):
    """``fdq subs TOPIC`` is ``fdq subs list TOPIC``; ``fdq subs COMMAND ...`` runs COMMAND."""

    def parse_args(self, ctx, args):
        first = next((a for a in args if not a.startswith("-")), None)
        if first is not None and first not in self.commands:
            args = ["list", *args]
        return super().parse_args(ctx, args)


SUBSCRIPTION_COLUMNS = [
    ("subscription", lambda r: r["name"]),
    ("ephemeral", lambda r: r["ephemeral"]),
    ("catching up", lambda r: r["catching_up"]),
    ("paused", lambda r: r["paused"]),
    ("deliver", lambda r: r["deliver_policy"] if r["start_time_ms"] is None
     else f"{r['deliver_policy']} {render.time_ms(r['start_time_ms'])}"),
    ("ack", lambda r: r["config"]["ack_policy"]),
    ("backlog", lambda r: r["backlog"]),
    ("in flight", lambda r: r["in_flight"]),
    ("dlq", lambda r: r["dlq"]),
    ("consumers", lambda r: r["consumers"]),
]

# One click option per SubscriptionConfig field the command line sets; each option's
# destination is the field's name, so FDQ's own rule judges its value.
SUBSCRIPTION_OPTIONS = {
    "ack_policy": click.option(
        "--ack-policy", type=click.Choice(ACK_POLICIES), default="explicit", show_default=True,
        help="explicit: messages are leased until acked; none: done when delivered."),
    "ack_wait_s": click.option(
        "--ack-wait-s", type=Seconds(), default=None, metavar="DURATION", callback=subscription_config_callback,
        help="Lease length of every consumer, e.g. 30s, 1m30s [default: each consumer's own]."),
    "max_deliver": click.option(
        "--max-deliver", type=Int(), default=None, metavar="N", callback=subscription_config_callback,
        help="Deliveries before the DLQ [default: each consumer's own]."),
    "backoff_s": click.option(
        "--backoff-s", type=SecondsList(), default=None, metavar="D1,D2,...", callback=subscription_config_callback,
        help="Redelivery delays by attempt, e.g. 1,5,30 or 1s,30s,5m (the last repeats; '' = at once) "
             "[default: each consumer's own]."),
    "max_ack_pending": click.option(
        "--max-ack-pending", type=Int(), default=None, metavar="N", callback=subscription_config_callback,
        help="At most N leased messages per shard [default: no limit]."),
    "deliver_policy": click.option(
        "--deliver-policy", type=click.Choice(DELIVER_POLICIES), default=None,
        help="Where it starts: all messages in the log, new ones, the last one and new, or "
             "by_start_time [default: all; by_start_time with --start-time]."),
    "start_time_ms": click.option(
        "--start-time", "start_time_ms", type=Time(), default=None,
        help="Start at messages inserted at this time or later (ISO-8601, <n>s, <n>ms, now or -1h)."),
    "filter_shard_key": click.option(
        "--filter-shard-key", metavar="GLOB", default=None, callback=subscription_config_callback,
        help="Deliver only messages whose shard key matches this glob."),
    "filter_headers": click.option(
        "--filter-header", "filter_headers", type=FilterHeader(), multiple=True,
        callback=filter_headers_callback,
        help="Deliver only messages with header name=value (all must match; a non-string "
             "header matches its JSON text, e.g. flag=true). Repeatable."),
    "ordered": click.option(
        "--ordered", is_flag=True, help="Hold back later messages of a shard key while one is leased."),
    "ephemeral": click.option(
        "--ephemeral", is_flag=True, help="Delete it when its last consumer leaves."),
    "description": click.option(
        "--description", default=None, metavar="TEXT", callback=subscription_config_callback,
        help="Free text (at most 4096 characters)."),
}


class UpdateCommand(click.Command):
    """``fdq subs update``: an option of a field that cannot change gets told why."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            fixed = {"--" + f.replace("_", "-") for f in SUBSCRIPTION_OPTIONS} | {"--start-time", "--filter-header"}
            if e.option_name in fixed:
                may = ", ".join("--" + f.replace("_", "-") for f in UPDATABLE_SUBSCRIPTION_FIELDS)
                raise click.UsageError(f"{e.option_name} cannot be updated: only {may} may change "
                                       "(create a new subscription, or reset it for a new start point)",
                                       ctx) from None
            raise


def _subscription_options(fields):
    def apply(f):
        for name in reversed(fields):
            f = SUBSCRIPTION_OPTIONS[name](f)
        return f
    return apply


def _subscription_row(sup, topic, name):
    info = sup.subscription(topic, name)
    return rows.subscription_row(topic, info, sup.stats(topic)["subscriptions"].get(name))


def _show_subscription(row):
    items = [(k, v) for k, v in row.items() if k != "config"]
    items += [(f"config.{k}", v) for k, v in row["config"].items()]
    render.table(f"subscription {row['topic']}/{row['name']}", [
        ("field", lambda kv: kv[0]),
        ("value", lambda kv: json.dumps(kv[1], ensure_ascii=False) if isinstance(kv[1], (dict, list))
         else render.time_ms(kv[1]) if kv[0].endswith("time_ms") and kv[1] is not None else kv[1]),
    ], items)


@cli.group(cls=SubsGroup)
def subs():
    """Subscriptions of a topic: list, create, show, update, reset, pause, play, delete.

    fdq subs TOPIC lists them, as fdq subs list TOPIC does (use the latter for a
    topic named like a command)."""


@subs.command("list")
@topic_argument
@format_option
@pass_state
def subs_list(state, topic, as_json):
    """List TOPIC's subscriptions: start, backlog, in flight, DLQ, consumers."""
    data = rows.subscription_rows(state.supervisor, topic)
    render.rows_or_note(data, SUBSCRIPTION_COLUMNS, f"topic {topic!r} has no subscriptions", as_json)


@subs.command("create")
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@_subscription_options(list(SUBSCRIPTION_OPTIONS))
@json_option
@pass_state
def subs_create(state, topic, name, as_json, **fields):
    """Create subscription NAME of TOPIC and copy its start point.

    Messages of the start point (--deliver-policy) are copied from the topic's
    log before this returns (progress on stderr); then its consumers deliver.
    Nothing changes if it exists with the same options; other options are an
    error (change updatable ones with fdq subs update)."""
    if fields["deliver_policy"] is None:
        fields["deliver_policy"] = "by_start_time" if fields["start_time_ms"] is not None else "all"
    if fields["description"] is None:
        fields["description"] = ""
    sup = state.supervisor
    topic_config = sup.config(topic)
    existed = name in topic_config.subs
    try:
        config = SubscriptionConfig(**fields)
        if not existed:
            check_filters(topic, name, config, topic_config)
    except ConfigError as e:
        raise click.UsageError(f"invalid subscription options: {e}") from None
    copied = 0

    def count(n):
        nonlocal copied
        copied += n
        advance(n)
    resumable(state, f"catch-up of {topic}/{name}")
    with render.progress(f"catching up {topic}/{name}") as advance:
        sup.create_subscription(topic, name, config, progress=count)
    if existed:
        render.note(f"subscription {name!r} of topic {topic!r} already exists with these options: unchanged"
                    + (f" (finished its catch-up: {copied:,} messages copied)" if copied else ""))
    else:
        render.note(f"created subscription {name!r} of topic {topic!r}: deliver {config.deliver_policy}, "
                    f"{copied:,} messages copied from the log")
    if as_json:
        render.emit_json(_subscription_row(sup, topic, name))


@subs.command("show")
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@format_option
@pass_state
def subs_show(state, topic, name, as_json):
    """Show subscription NAME of TOPIC: its stored options and counts."""
    row = _subscription_row(state.supervisor, topic, name)
    if as_json:
        render.emit_json(row)
    else:
        _show_subscription(row)


@subs.command("update", cls=UpdateCommand)
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@_subscription_options(list(UPDATABLE_SUBSCRIPTION_FIELDS))
@json_option
@pass_state
def subs_update(state, topic, name, as_json, **changes):
    """Change updatable options of subscription NAME of TOPIC.

    Only these may change; its consumers apply them at their next heartbeat.
    Other options fix what the subscription is: create a new one (or reset it
    for a new start point)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes:
        given = ", ".join("--" + f.replace("_", "-") for f in UPDATABLE_SUBSCRIPTION_FIELDS)
        raise click.UsageError(f"nothing to update: give one of {given}")
    sup = state.supervisor
    config = sup.update_subscription(topic, name, **changes)
    render.note(f"updated subscription {name!r} of topic {topic!r}: "
                + ", ".join(f"{k}={getattr(config, k)!r}" for k in changes))
    if as_json:
        render.emit_json(_subscription_row(sup, topic, name))


@subs.command("reset")
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@click.option("--to", "to_time", type=TimeOrNow(), required=True,
              help="The new start (ISO-8601, <n>s, <n>ms, -1h), or now (skip everything queued).")
@json_option
@pass_state
def subs_reset(state, topic, name, to_time, as_json):
    """Move subscription NAME's start to --to (rewind or skip).

    Its ready and delayed messages are replaced by the log's messages inserted
    at --to or later (within retention); leases and dead letters stay."""
    sup = state.supervisor
    sup.subscription(topic, name)          # unknown: exit 1 before anything changes
    resumable(state, f"reset of {topic}/{name}")
    with render.progress(f"resetting {topic}/{name}") as advance:
        copied = sup.reset(topic, name, as_datetime(to_time), progress=advance)
    when = "now" if to_time is None else render.time_ms(to_time)
    render.note(f"reset subscription {name!r} of topic {topic!r} to {when}: {copied:,} messages copied from the log")
    if as_json:
        render.emit_json({"topic": topic, "subscription": name, "to_time_ms": to_time, "copied": copied})


@subs.command("pause")
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@json_option
@pass_state
def subs_pause(state, topic, name, as_json):
    """Pause subscription NAME of TOPIC: its consumers take nothing.

    Pushes keep filling its queues; the topic's other subscriptions go on. As
    an NSQ client's /channel/pause; fdq subs play resumes it."""
    was = state.supervisor.pause_subscription(topic, name)
    render.note(f"subscription {name!r} of topic {topic!r} " + ("was already paused" if was else "paused"))
    if as_json:
        render.emit_json(_subscription_row(state.supervisor, topic, name))


@subs.command("play")
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@json_option
@pass_state
def subs_play(state, topic, name, as_json):
    """Resume subscription NAME of TOPIC, paused by fdq subs pause (or /channel/pause)."""
    was = state.supervisor.play_subscription(topic, name)
    render.note(f"{'resumed' if was else 'nothing to resume:'} subscription {name!r} of topic {topic!r}"
                + ("" if was else " was not paused"))
    if as_json:
        render.emit_json(_subscription_row(state.supervisor, topic, name))


@subs.command("delete")
@topic_argument
@click.argument("name", type=SUBSCRIPTION)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@pass_state
def subs_delete(state, topic, name, yes):
    """Delete subscription NAME of TOPIC with its queues, leases and dead letters."""
    sup = state.supervisor
    row = _subscription_row(sup, topic, name)     # unknown: exit 1 before asking
    if not yes:
        confirm(f"Delete subscription {topic}/{name} with a backlog of {row['backlog'] or 0:,}, "
                 f"{row['in_flight'] or 0:,} in flight and {row['dlq'] or 0:,} dead letters?",
                 f"subscription {topic}/{name} not deleted")
    sup.delete_subscription(topic, name)
    render.note(f"deleted subscription {name!r} of topic {topic!r}")
