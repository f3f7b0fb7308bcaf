"""``fdq topics`` (list, show, create, update, delete, upgrade), ``fdq stats`` and
``fdq consumers``: a topic's settings, counters and consumers."""
from __future__ import annotations

import json

import click

from ..config import TTL_ACTIONS, UPDATABLE_TOPIC_FIELDS, TopicConfig
from . import admin, render, rows
from .app import cli, confirm, json_option, pass_state, topic_argument
from .params import CLEARED, TOPIC, Duration, Int, OrNone, Seconds, Shards, format_option, topic_config_callback

TOPIC_COLUMNS = [
    ("topic", lambda r: r["name"]),
    ("shards", lambda r: r["shards"] if r["resharding_to"] in (None, r["shards"])
        else f"{r['shards']}→{r['resharding_to']}"),
    ("extend", lambda r: r["extend"]),
    ("paused", lambda r: r["paused"]),
    ("subscriptions", lambda r: ", ".join(r["subscriptions"])),
    ("inserted", lambda r: r["inserted"]),
    ("backlog", lambda r: r["backlog"]),
    ("pending", lambda r: r["pending"]),
]


@cli.group(invoke_without_command=True)
@format_option
@pass_state
@click.pass_context
def topics(ctx, state, as_json):
    """List topics (or show, create, update, delete, upgrade one).

    Columns: shards, extend support, paused, subscriptions, messages inserted,
    backlog (routed, not yet done, summed over subscriptions), pending (pushed
    while paused or resharding, not yet routed).
    """
    if ctx.invoked_subcommand is not None:
        return
    data = rows.topic_rows(state.supervisor)
    render.rows_or_note(data, TOPIC_COLUMNS, "no topics", as_json)


def _value(v):
    """A setting's value in a table: a list or mapping as JSON, the rest as tables show it."""
    return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list, tuple)) else v


SETTING_COLUMNS = [("setting", lambda kv: kv[0]), ("value", lambda kv: _value(kv[1]))]


@topics.command("show")
@click.argument("name", type=TOPIC)
@format_option
@pass_state
def topics_show(state, name, as_json):
    """Show topic NAME's settings and its subscriptions' settings.

    Every setting of the topic (shards, hash, extend, limits, retention, dedupe
    window), its state and counts; then each subscription: its state and
    every setting. --json: fdq topics --json's row, with each subscription as
    fdq subs --json lists it instead of its name."""
    data = rows.topic_detail(state.supervisor, name)
    if as_json:
        render.emit_json(data)
        return
    render.table(f"topic {name}", SETTING_COLUMNS,
                 [(k, v) for k, v in data.items() if k not in ("name", "subscriptions")])
    for sub in data["subscriptions"]:
        items = [(k, sub[k]) for k in ("paused", "catching_up", "start_position", "backlog",
                                       "in_flight", "delayed", "dlq", "consumers")]
        render.table(f"subscription {name}/{sub['name']}", SETTING_COLUMNS,
                     items + [(k, v if not k.endswith("time_ms") or v is None else render.time_ms(v))
                              for k, v in sub["config"].items()])


def _show_topic(state, name, as_json):
    row = rows.topic_row(name, state.supervisor.stats(name))
    if as_json:
        render.emit_json(row)
    return row


@topics.command("create")
@click.argument("name", type=TOPIC)
@click.option("--shards", type=Shards(), default=None,
              help=f"Number of shards [default: {TopicConfig().shards}]; an existing topic with "
                   "another count is an error (use rebalance).")
@click.option("--extend", is_flag=True, help="Extend support: headers and tag dispatch.")
@click.option("--max-backlog", type=Int(), default=None, metavar="N", callback=topic_config_callback,
              help="Refuse pushes beyond this backlog per subscription.")
@click.option("--retention-s", type=Seconds(), default=None, metavar="DURATION", callback=topic_config_callback,
              help="Keep the \"all\" log this long, e.g. 7d (applied by its consumers and fdq trim).")
@click.option("--retention-bytes", type=Int(), default=None, metavar="N", callback=topic_config_callback,
              help="Keep at most this many bytes of the \"all\" log, the newest (applied by its consumers "
                   "and fdq trim).")
@click.option("--retention-messages", type=Int(), default=None, metavar="N", callback=topic_config_callback,
              help="Keep at most this many entries of the \"all\" log, the newest.")
@click.option("--ttl-s", type=Seconds(), default=None, metavar="DURATION", callback=topic_config_callback,
              help="Never deliver a message after this long, unless pushed with its own --ttl.")
@click.option("--ttl-action", type=click.Choice(TTL_ACTIONS), default=None, callback=topic_config_callback,
              help="What becomes of an expired message: drop it (counted) or dead-letter it [default: drop].")
@click.option("--dedupe-window-s", type=Seconds(), default=None, metavar="DURATION", callback=topic_config_callback,
              help=f"Remember msg-ids this long, e.g. 10m [default: {TopicConfig().dedupe_window_s:g}s].")
@json_option
@pass_state
def topics_create(state, name, shards, extend, max_backlog, retention_s, retention_bytes, retention_messages,
                  ttl_s, ttl_action, dedupe_window_s, as_json):
    """Create topic NAME (nothing changes if it already exists).

    Change its retention and limits later with fdq topics update."""
    sup = state.supervisor
    existed = any(n == name for n, _c in sup.topics())
    options = {"max_backlog": max_backlog, "retention_s": retention_s, "retention_bytes": retention_bytes,
               "retention_messages": retention_messages, "ttl_s": ttl_s, "ttl_action": ttl_action,
               "dedupe_window_s": dedupe_window_s}
    config = sup.create_topic(name, shards=shards, extend=extend,
                              **{k: v for k, v in options.items() if v is not None})
    if existed:
        render.note(f"topic {name!r} already exists ({config.shards} shards, "
                    f"extend {'on' if config.extend else 'off'}): unchanged")
    else:
        render.note(f"created topic {name!r}: {config.shards} shards, extend {'on' if config.extend else 'off'}")
    _show_topic(state, name, as_json)


def _settings_row(name: str, config: TopicConfig) -> dict:
    return {"topic": name, **{k: getattr(config, k) for k in UPDATABLE_TOPIC_FIELDS}}


class TopicUpdateCommand(click.Command):
    """``fdq topics update``: ``--shards`` gets told that ``fdq rebalance`` changes it."""

    def parse_args(self, ctx, args):
        given = list(args)      # click's parser consumes the list it is given
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            if e.option_name != "--shards":
                raise
            args, shards, rest, i = given, "N", [], 0
            while i < len(args):
                if args[i] == "--shards":
                    shards = args[i + 1] if i + 1 < len(args) else shards
                    i += 2
                    continue
                if args[i].startswith("--shards="):
                    shards = args[i].split("=", 1)[1]
                else:
                    rest.append(args[i])
                i += 1
            try:
                super().parse_args(ctx, rest)
                name = ctx.params.get("name") or "NAME"
            except click.UsageError:
                name = "NAME"
            raise click.UsageError(f"--shards cannot be updated here: a topic's shard count changes with "
                                   f"fdq rebalance {name} --shards {shards} (it moves the queued messages)",
                                   ctx) from None


@topics.command("update", cls=TopicUpdateCommand)
@click.argument("name", type=TOPIC)
@click.option("--max-backlog", type=OrNone(Int()), default=None, metavar="N|none",
              callback=topic_config_callback, help="Refuse pushes beyond this backlog per subscription.")
@click.option("--dedupe-window-s", type=Seconds(), default=None, metavar="DURATION", callback=topic_config_callback,
              help="Remember msg-ids this long, e.g. 10m.")
@click.option("--retention-s", type=OrNone(Seconds()), default=None, metavar="DURATION|none",
              callback=topic_config_callback, help="Keep the \"all\" log this long, e.g. 7d.")
@click.option("--retention-bytes", type=OrNone(Int()), default=None, metavar="N|none",
              callback=topic_config_callback, help="Keep at most this many bytes of the \"all\" log.")
@click.option("--retention-messages", type=OrNone(Int()), default=None, metavar="N|none",
              callback=topic_config_callback, help="Keep at most this many entries of the \"all\" log.")
@click.option("--ttl-s", type=OrNone(Seconds()), default=None, metavar="DURATION|none",
              callback=topic_config_callback, help="Never deliver a message after this long (its own --ttl first).")
@click.option("--ttl-action", type=click.Choice(TTL_ACTIONS), default=None, callback=topic_config_callback,
              help="What becomes of an expired message: drop (counted) or dead_letter.")
@click.option("--max-message-bytes", type=Int(), default=None, metavar="N", callback=topic_config_callback,
              help="The largest body a push accepts.")
@json_option
@pass_state
def topics_update(state, name, as_json, **changes):
    """Change topic NAME's retention and limits (none clears one).

    E.g. for a topic a push created with the defaults: pushes apply the limits
    from then on, its consumers the retention (fdq trim at once)."""
    changes = {k: (None if v is CLEARED else v) for k, v in changes.items() if v is not None}
    if not changes:
        raise click.UsageError("nothing to update: give one of "
                               + ", ".join("--" + k.replace("_", "-") for k in UPDATABLE_TOPIC_FIELDS))
    config = state.supervisor.update_topic(name, **changes)
    render.note(f"updated topic {name!r}: " + ", ".join(f"{k}={getattr(config, k)!r}" for k in changes))
    if as_json:
        render.emit_json(_settings_row(name, config))


@topics.command("delete")
@click.argument("name", type=TOPIC)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@pass_state
def topics_delete(state, name, yes):
    """Delete topic NAME with all its messages, consumers and counters."""
    sup = state.supervisor
    row = rows.topic_row(name, sup.stats(name))    # unknown topic: exit 1 before asking
    if not yes:
        confirm(f"Delete topic {name!r} with {row['inserted']:,} messages inserted and a backlog "
                 f"of {row['backlog']:,}?", f"topic {name!r} not deleted")
    sup.delete_topic(name)
    render.note(f"deleted topic {name!r}")


@topics.command("upgrade")
@click.argument("name", type=TOPIC)
@click.option("--extend", is_flag=True, help="Give the topic extend support (one-way).")
@json_option
@pass_state
def topics_upgrade(state, name, extend, as_json):
    """Give topic NAME extend support (--extend).

    --extend: headers and tag dispatch. One-way; stored messages stay readable;
    consumers must then connect with extend support."""
    if not extend:
        raise click.UsageError("nothing to upgrade: give --extend")
    state.supervisor.upgrade_extend(name)
    render.note(f"topic {name!r} has extend support")
    _show_topic(state, name, as_json)


# -- stats and consumers ------------------------------------------------------------

CONSUMER_COLUMNS = [
    ("subscription", lambda c: c["subscription"]),
    ("consumer", lambda c: c["id"]),
    ("mode", lambda c: c["mode"]),
    ("tag", lambda c: c["tag"]),
    ("host", lambda c: c["host"]),
    ("pid", lambda c: None if c["pid"] is None else str(c["pid"])),
    ("shards", lambda c: render.shard_list(c["shards"])),
    ("heartbeat age", lambda c: "-" if c["heartbeat_age_s"] is None
        else f"{c['heartbeat_age_s']:.1f} s" + (" (zombie)" if c["zombie"] else "")),
]


@cli.command()
@topic_argument
@format_option
@pass_state
def stats(state, topic, as_json):
    """Show TOPIC's counters, backlog, consumers and lag.

    Per subscription: backlog, in flight, delayed, DLQ, lag; consumers with the
    shards each owns and heartbeat age (a zombie: older than its zombie timeout,
    e.g. killed, its shards not yet taken over); backlog per dispatch tag.
    --json prints what the Python API's Supervisor.stats(TOPIC) returns, per-shard
    counters included."""
    stats = state.supervisor.stats(topic)
    if as_json:
        render.emit_json(stats)
        return
    data = rows.stats_row(stats)
    state_text = "paused" if data["paused"] else "running"
    if data["resharding_to"] == data["shards"]:     # reshard_finish done, not its play
        state_text += ", resharded: routing what was pushed meanwhile (run rebalance if stuck)"
    elif data["resharding_to"] is not None:
        state_text += f", resharding to {data['resharding_to']}"
    render.table(f"topic {topic}: {data['shards']} shards, extend {'on' if data['extend'] else 'off'}, "
                 f"{state_text}",
                 [(k, lambda d, k=k: d[k]) for k in ("inserted", "routed", "pending", "emitted", "acked")],
                 [data])
    subs = data["subscriptions"]
    render.table("subscriptions", [
        ("subscription", lambda s: s["name"]),
        ("state", lambda s: "paused" if s["paused"] else "catching up" if s["catching_up"] else "running"),
        ("backlog", lambda s: s["backlog"]),
        ("in flight", lambda s: s["in_flight"]),
        ("delayed", lambda s: s["delayed"]),
        ("dlq", lambda s: s["dlq"]),
        ("filtered", lambda s: s["filtered"]),
        ("lag", lambda s: render.duration_ms(s["lag_ms"])),
        ("consumers", lambda s: len(s["consumers"])),
        ("unowned shards", lambda s: s["unowned_shards"]),
    ], subs)
    consumers = [c for s in subs for c in s["consumers"]]
    if consumers:
        render.table("consumers", CONSUMER_COLUMNS, consumers)
    tags = [dict(t, subscription=s["name"]) for s in subs for t in s["tags"]]
    if any(t["tag"] is not None for t in tags):
        render.table("backlog per tag", [
            ("subscription", lambda t: t["subscription"]),
            ("tag", lambda t: t["tag"] or "(untagged)"),
            ("shards", lambda t: t["shards"]),
            ("backlog", lambda t: t["backlog"]),
            ("in flight", lambda t: t["in_flight"]),
            ("delayed", lambda t: t["delayed"]),
        ], tags)


@cli.command()
@topic_argument
@click.argument("action", required=False, type=click.Choice(["reap"]))
@click.option("--zombie-after", type=Duration(), default=None, metavar="DURATION",
              help="reap: declare a zombie a consumer whose heartbeat stands still this long [default: 3s].")
@format_option
@pass_state
def consumers(state, topic, action, zombie_after, as_json):
    """List TOPIC's consumers, their shards, heartbeat age; or reap zombies.

    A consumer whose heartbeat is older than its zombie timeout is marked a
    zombie (killed, or stalled): it owns its shards until a live consumer of
    its subscription takes them over, or until fdq consumers TOPIC reap
    (watches the heartbeats for --zombie-after, or a consumer's own longer
    timeout, then removes those that stood still and divides their shards)."""
    if action == "reap" or zombie_after is not None:
        return admin.reap_consumers(state, topic, action, zombie_after, as_json)
    data = rows.consumer_rows(state.supervisor.stats(topic))
    render.rows_or_note(data, CONSUMER_COLUMNS, f"topic {topic!r} has no consumers", as_json)
