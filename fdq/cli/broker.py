"""``fdq broker``: the NSQ-compatible broker (``fdq.broker``) on the database, with
nsqd's flags (their defaults and meanings are ``python -m fdq.broker``'s)."""
from __future__ import annotations

import argparse
import logging
import signal
import ssl
import sys

import click

from .. import ConfigError
from ..broker import __main__ as broker_main
from . import render
from .app import Failure, cli, exit_interrupted, one_line, pass_state
from .params import Address, Duration

# Defaults and meanings are fdq.broker.__main__'s (python -m fdq.broker): one mapping.
_BROKER = vars(broker_main.parser().parse_args(["--url", ""]))


def _duration_default(name):
    return f"{_BROKER[name]:g}s"


@cli.command(context_settings={"show_default": True})
@click.option("--tcp-address", type=Address(), default=_BROKER["tcp_address"],
              help="<addr>:<port> to listen on for TCP clients (port 0: any free port).")
@click.option("--http-address", type=Address(optional=True), default=_BROKER["http_address"],
              help="<addr>:<port> to listen on for HTTP clients ('' for none).")
@click.option("--msg-timeout", type=Duration(), default=_duration_default("msg_timeout"),
              help="Default time a message may be in flight before it is requeued.")
@click.option("--max-msg-timeout", type=Duration(), default=_duration_default("max_msg_timeout"),
              help="Largest msg_timeout a client may ask for.")
@click.option("--max-msg-size", type=click.IntRange(min=1), default=_BROKER["max_msg_size"],
              help="Largest message body, bytes.")
@click.option("--max-body-size", type=click.IntRange(min=1), default=_BROKER["max_body_size"],
              help="Largest command body (MPUB), bytes.")
@click.option("--max-rdy-count", type=click.IntRange(min=1), default=_BROKER["max_rdy_count"],
              help="Largest RDY a client may set.")
@click.option("--max-heartbeat-interval", type=Duration(),
              default=_duration_default("max_heartbeat_interval"),
              help="Longest heartbeat interval a client may ask for.")
@click.option("--max-req-timeout", type=Duration(), default=_duration_default("max_req_timeout"),
              help="Longest requeue delay (REQ).")
@click.option("--max-deflate-level", type=click.IntRange(1, 9), default=_BROKER["max_deflate_level"],
              help="Highest deflate level a client may ask for.")
@click.option("--deflate/--no-deflate", default=_BROKER["deflate"], help="Allow deflate compression.")
@click.option("--snappy/--no-snappy", default=_BROKER["snappy"],
              help="Allow snappy compression (framed; needs the cramjam package).")
@click.option("--max-output-buffer-size", type=click.IntRange(min=64), default=_BROKER["max_output_buffer_size"],
              help="Largest output_buffer_size a client may ask for in IDENTIFY, bytes.")
@click.option("--output-buffer-timeout", type=Duration(), default=_duration_default("output_buffer_timeout"),
              help="Default time buffered messages wait before they are sent.")
@click.option("--min-output-buffer-timeout", type=Duration(),
              default=_duration_default("min_output_buffer_timeout"),
              help="Shortest output_buffer_timeout a client may ask for.")
@click.option("--max-output-buffer-timeout", type=Duration(),
              default=_duration_default("max_output_buffer_timeout"),
              help="Longest output_buffer_timeout a client may ask for.")
@click.option("--e2e-processing-latency-percentile", multiple=True,
              help="Publish-to-FIN latency quantile reported in /stats, in (0, 1]; repeat or comma "
                   "separate (1.0,0.99,0.95). Default: none.")
@click.option("--e2e-processing-latency-window-time", type=Duration(),
              default=_duration_default("e2e_processing_latency_window_time"),
              help="Window of the e2e processing latency percentiles.")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="TLS certificate (PEM).")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None,
              help="TLS private key (PEM).")
@click.option("--tls-required", is_flag=True, help="Clients must upgrade to TLS.")
@click.option("--https-address", type=Address(optional=True), default=None,
              help="<addr>:<port> to serve the HTTP API over TLS on (needs --tls-cert/--tls-key). "
                   "[default: none]")
@click.option("--auth-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Secrets and their permissions (JSON; see fdq/broker/auth.py).")
@click.option("--auth-http-address", multiple=True,
              help="nsqd auth server (host:port or URL; repeatable) asked for each secret's permissions "
                   "(GET /auth?secret=...); excludes --auth-file.")
@click.option("--web-path", default=None,
              help="Serve the web dashboard (fdq web) under this path of the HTTP address, e.g. /web/.")
@click.option("--web-write-token", envvar="FDQ_WEB_WRITE_TOKEN", default=None,
              help="Dashboard actions need this token (or an --auth-file secret with admin) "
                   "[env FDQ_WEB_WRITE_TOKEN].")
@click.option("--metrics-database", type=click.Choice(broker_main.METRICS_DATABASE),
              default=_BROKER["metrics_database"],
              help="/metrics' database-wide families (topics, subscriptions, consumers): leader = from one "
                   "of the brokers serving /metrics on the database at a time; always = from this broker.")
@click.option("--metrics-leader-timeout", type=Duration(), default=_duration_default("metrics_leader_timeout"),
              help="The metrics leader's beat standing still this long, another broker takes over.")
@click.option("--lookupd-tcp-address", type=Address(), multiple=True,
              help="nsqlookupd TCP address to register with (repeatable): NSQ clients find the broker "
                   "through nsqlookupd; every topic and subscription of the database is registered.")
@click.option("--broadcast-address", default=None,
              help="Address this broker is registered under with nsqlookupd.  [default: the hostname]")
@click.option("--broadcast-tcp-port", type=click.IntRange(1, 65535), default=None,
              help="TCP port registered with nsqlookupd.  [default: the bound TCP port]")
@click.option("--broadcast-http-port", type=click.IntRange(1, 65535), default=None,
              help="HTTP port registered with nsqlookupd.  [default: the bound HTTP port]")
@click.option("--maintenance/--no-maintenance", default=_BROKER["maintenance"],
              help="Take part in every topic's retention and TTL sweeps (one process per topic at a time).")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              default=_BROKER["log_level"], help="Log level (stderr).")
@pass_state
def broker(state, **flags):
    """Run the NSQ-compatible broker on the database (nsqd's flags).

    NSQ clients (pynsq, nsqjs, go-nsq ...) publish and consume unchanged:
    topics are FDQ topics, channels are subscriptions. Prints the listening
    addresses on stderr once ready; serves until SIGTERM (exit 0) or Ctrl-C
    (exit 130), then closes its connections and stops.
    Durations: 60s, 1m30s, 500ms, or seconds."""
    if (flags["tls_cert"] is None) != (flags["tls_key"] is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    if flags["tls_required"] and flags["tls_cert"] is None:
        raise click.UsageError("--tls-required needs --tls-cert and --tls-key")
    try:
        options = broker_main.build_options(argparse.Namespace(**flags))
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    logging.basicConfig(stream=sys.stderr, level=flags["log_level"].upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tcp_host = flags["tcp_address"].rpartition(":")[0]
    http_host = flags["http_address"].rpartition(":")[0]

    def ready(tcp_port, http_port, https_port):
        http = f"http={http_host}:{http_port}" if http_port is not None else "http=off"
        if https_port is not None:
            http += f" https={flags['https_address'].rpartition(':')[0]}:{https_port}"
        web = f" web=http://{http_host}:{http_port}/{flags['web_path'].strip('/')}/" \
            if flags["web_path"] and http_port is not None else ""
        render.note(f"fdq broker: listening tcp={tcp_host}:{tcp_port} {http}{web}")

    state.interrupted = lambda: "broker stopped"
    try:
        stopped_by = broker_main.run(state.url, flags["tcp_address"], flags["http_address"] or None, options, ready)
    except (OSError, ssl.SSLError) as e:
        raise Failure(f"cannot start the broker: {one_line(e)}") from None
    if stopped_by == signal.SIGINT:     # its own handler stopped it: the line Ctrl-C prints elsewhere
        exit_interrupted(state.interrupted)
    render.note("fdq broker: stopped")
