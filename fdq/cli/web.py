"""``fdq web``: serve the live dashboard (``fdq.web``) until SIGTERM or Ctrl-C."""
from __future__ import annotations

import logging
import signal
import sys

import click

from . import render
from .app import Failure, State, cli, exit_interrupted, one_line, pass_state
from ..web.server import run
from .params import Address, Duration


@cli.command(context_settings={"show_default": True})
@click.option("--http-address", type=Address(), default="127.0.0.1:4180",
              help="<addr>:<port> to serve the dashboard on (port 0: any free port).")
@click.option("--url", "web_url", metavar="URL", default=None,
              help="Database URL (as fdq --url; this one wins).")
@click.option("--write-token", envvar="FDQ_WEB_WRITE_TOKEN", default=None, show_default=False,
              help="Actions (pause, play, rebalance, redrive, purge) need this token, typed into the "
                   "page; without it the dashboard is read-only [env FDQ_WEB_WRITE_TOKEN].")
@click.option("--sample-interval", type=Duration(), default="1s",
              help="How often the charts' stats are sampled.")
@click.option("--history", type=Duration(), default="10m", help="How much of the charts is kept.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              default="WARNING", help="Log level (stderr).")
@pass_state
def web(state: State, http_address, web_url, write_token, sample_interval, history, log_level):
    """Serve a live dashboard of the database's topics in a browser.

    Topics with charts of their rates, backlog and oldest-ready age,
    subscriptions, consumers and which shards each owns, dead letters; pause,
    play, rebalance, redrive and purge with the write token. Prints the
    address on stderr once ready; serves until SIGTERM (exit 0) or Ctrl-C (130).
    Bind it to 127.0.0.1 (the default) or put it behind a proxy: anyone who
    reaches it can read."""
    if write_token is not None and not write_token.strip():
        raise click.UsageError("--write-token must not be empty")
    logging.basicConfig(stream=sys.stderr, level=log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def ready(host, port):
        mode = "actions need the write token" if write_token else "read-only"
        render.note(f"fdq web: serving http://{host}:{port}/ ({mode})")

    state.interrupted = lambda: "dashboard stopped"
    try:
        stopped_by = run(web_url or state.url, http_address, write_token=write_token,
                         sample_interval_s=sample_interval, history_s=history, ready=ready)
    except OSError as e:
        raise Failure(f"cannot start the dashboard on {http_address}: {one_line(e)}") from None
    if stopped_by == signal.SIGINT:
        exit_interrupted(state.interrupted)
    render.note("fdq web: stopped")
