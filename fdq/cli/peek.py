"""``fdq peek`` and ``fdq get``: looking at messages without consuming them."""
from __future__ import annotations

import click

from .. import ConfigError, Supervisor
from ..times import as_datetime
from . import render, rows
from .app import cli, json_option, pass_state, subscription_option, topic_argument
from .params import Time, format_option


def _short(text, n: int = 40):
    if text is None:
        return None
    return text if len(text) <= n else text[:n - 3] + "..."


def detail(r: dict) -> str | None:
    """What a peeked message's state says about it, for people: when it is due, who
    holds it, why it is dead."""
    if r["state"] == "delayed":
        return "due now" if r["due_in_s"] <= 0 else f"due in {render.duration_ms(round(r['due_in_s'] * 1000))}"
    if r["state"] == "in_flight":
        return f"leased by {r['leased_by']}" + (f" (ack wait {r['ack_wait_s']:g} s)" if r["ack_wait_s"] else "")
    if r["state"] == "dead":
        age = "" if r["dead_age_s"] is None else f" ({render.duration_ms(round(r['dead_age_s'] * 1000))} ago)"
        return _short(r["reason"]) + age
    return None


PEEK_COLUMNS = [
    ("id", lambda r: r["id"]),
    ("state", lambda r: r["state"]),
    ("shard", lambda r: r["shard"]),
    ("attempts", lambda r: r["attempts"]),
    ("inserted", lambda r: render.time_ms(r["insertion_time_ms"])),
    ("detail", detail),
    ("key", lambda r: r["shard_key"]),
    ("body", lambda r: _short(r["body"])),
]


@cli.command()
@topic_argument
@subscription_option
@click.option("-n", "--count", "limit", type=click.IntRange(1, Supervisor.PEEK_MAX), default=20, show_default=True,
              help="Show at most N messages (the first, by id).")
@click.option("--state", "states", type=click.Choice(Supervisor.PEEK_STATES), multiple=True,
              help="Only messages in this state (repeat for several) [default: every state].")
@click.option("--from", "from_time", type=Time(), default=None,
              help="Only messages inserted at this time or later (now, -15m, ISO-8601, <n>s or <n>ms).")
@format_option
@pass_state
def peek(state, topic, subscription, limit, states, from_time, as_json):
    """Show a subscription's messages without consuming them.

    Ready, delayed, in flight (leased) and dead-lettered messages, by id (push
    order), with their attempts, due times, lease holders and dead-letter
    reasons. Reads only: leases nothing, changes nothing."""
    found = state.supervisor.peek(topic, subscription, states=states or Supervisor.PEEK_STATES, limit=limit,
                                  from_time=as_datetime(from_time))
    data = [rows.peek_row(e, subscription) for e in found]
    render.rows_or_note(data, PEEK_COLUMNS, f"no message of {topic}/{subscription} in "
                        f"{', '.join(states or Supervisor.PEEK_STATES)}", as_json)


GET_COLUMNS = [
    ("subscription", lambda r: r["subscription"]),
    ("state", lambda r: r["state"]),
    ("shard", lambda r: r["shard"]),
    ("attempts", lambda r: r["attempts"]),
    ("detail", lambda r: detail(r) if r["id"] is not None else None),
]


@cli.command()
@topic_argument
@click.argument("message_id", metavar="ID")
@json_option
@pass_state
def get(state, topic, message_id, as_json):
    """Show message ID of TOPIC and where it is in each subscription.

    Its log entry (until trimmed) and, per subscription: ready, delayed,
    in_flight, dead, pending (pushed while paused), catching_up, or done
    (acked, taken, filtered or expired). Reads only."""
    sup = state.supervisor
    try:
        info = sup.get(topic, message_id)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="'ID'") from None
    row = rows.get_row(info)
    if as_json:
        render.emit_json(row)
        return
    log = row["log"]
    fields = [("id", row["id"]), ("topic", topic)]
    if log is None:
        fields.append(("log", "trimmed"))
    else:
        fields += [("inserted", render.time_ms(log["insertion_time_ms"])), ("key", log["shard_key"]),
                   ("msg_id", log["msg_id"]), ("replay_of", log["replay_of"]),
                   ("headers", ", ".join(f"{k}={v}" for k, v in (log["headers"] or {}).items()) or None),
                   ("body", _short(log["body"], 200) + ("" if log["body_encoding"] == "utf-8" else " (base64)"))]
    render.table(None, [("field", lambda f: f[0]), ("value", lambda f: f[1])], fields)
    places = [dict(p, subscription=s["name"]) for s in row["subscriptions"] for p in s["places"]]
    places += [dict(_nowhere(), subscription=s["name"], state=s["state"]) for s in row["subscriptions"]
               if not s["places"]]
    order = [s["name"] for s in row["subscriptions"]]
    render.table("subscriptions", GET_COLUMNS, sorted(places, key=lambda p: order.index(p["subscription"])))
    if row["delayed_unsearched"]:
        render.note(f"delayed messages of {', '.join(row['delayed_unsearched'])} not all searched (too many): "
                    f"it may be delayed there; fdq peek {topic} -s SUB --state delayed lists them")


def _nowhere() -> dict:
    return {"id": None, "shard": None, "attempts": None}
