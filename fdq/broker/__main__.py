"""``python -m fdq.broker``: run the NSQ-compatible broker (nsqd's flag names).

Prints one line ``fdq-broker tcp=HOST:PORT http=HOST:PORT`` on stdout once listening
(ports resolved when 0 is given), then serves until SIGTERM/SIGINT."""
from __future__ import annotations

import argparse
import logging
import socket
import sys

from .. import times
from ..errors import ConfigError, FDQError
from . import protocol as p
from .server import BrokerOptions, run, split_address

def parse_duration(text: str) -> float:
    """Seconds of a duration as every FDQ option reads it (``fdq.times.parse_duration``:
    nsqd's Go durations ``60s``, ``1m30s``, ``500ms``, also ``2d``, or plain seconds)."""
    try:
        return times.parse_duration(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_options(args) -> BrokerOptions:
    ms = lambda s: int(round(s * 1000))  # noqa: E731
    limits = p.Limits(msg_timeout_ms=ms(args.msg_timeout), max_msg_timeout_ms=ms(args.max_msg_timeout),
                      max_msg_size=args.max_msg_size, max_body_size=args.max_body_size,
                      max_rdy_count=args.max_rdy_count, max_heartbeat_interval_ms=ms(args.max_heartbeat_interval),
                      max_req_timeout_ms=ms(args.max_req_timeout),
                      heartbeat_interval_ms=min(p.DEFAULTS["heartbeat_interval_ms"], ms(args.max_heartbeat_interval)),
                      deflate=args.deflate, max_deflate_level=args.max_deflate_level, snappy=args.snappy,
                      max_output_buffer_size=args.max_output_buffer_size,
                      output_buffer_timeout_ms=ms(args.output_buffer_timeout),
                      min_output_buffer_timeout_ms=ms(args.min_output_buffer_timeout),
                      max_output_buffer_timeout_ms=ms(args.max_output_buffer_timeout))
    if limits.msg_timeout_ms < 10:
        raise ConfigError(f"--msg-timeout must be at least 10ms (a delivery's lease), not {limits.msg_timeout_ms}ms")
    if limits.msg_timeout_ms > limits.max_msg_timeout_ms:
        raise ConfigError("--msg-timeout must not exceed --max-msg-timeout")
    if not limits.min_output_buffer_timeout_ms <= limits.output_buffer_timeout_ms <= limits.max_output_buffer_timeout_ms:
        raise ConfigError("--output-buffer-timeout must be within --min/--max-output-buffer-timeout")
    if limits.max_output_buffer_size < 64:
        raise ConfigError("--max-output-buffer-size must be at least 64")
    percentiles = tuple(parse_percentiles(args.e2e_processing_latency_percentile or []))
    if args.metrics_leader_timeout <= 0:
        raise ConfigError("--metrics-leader-timeout must be > 0")
    if args.e2e_processing_latency_window_time <= 0:
        raise ConfigError("--e2e-processing-latency-window-time must be > 0")
    web_path = getattr(args, "web_path", None) or None
    if web_path is not None and (not web_path.startswith("/") or web_path.strip("/") == ""
                                 or web_path.strip("/").split("/")[0] in _NSQD_PATHS):
        raise ConfigError(f"--web-path must be a path of its own such as /web/, not {web_path!r} "
                          f"(nsqd's endpoints are {', '.join('/' + x for x in _NSQD_PATHS)})")
    https = getattr(args, "https_address", None) or None
    if https is not None:
        split_address(https)
        if not args.tls_cert or not args.tls_key:
            raise ConfigError("--https-address needs --tls-cert and --tls-key")
    auth_servers = tuple(getattr(args, "auth_http_address", None) or ())
    if auth_servers and args.auth_file:
        raise ConfigError("--auth-file and --auth-http-address exclude each other: use one")
    lookupds = tuple(getattr(args, "lookupd_tcp_address", None) or ())
    for a in lookupds:
        split_address(a)
    ports = {}
    for name in ("broadcast_tcp_port", "broadcast_http_port"):
        port = getattr(args, name, None)
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"--{name.replace('_', '-')} must be a port in 1-65535, not {port}")
        ports[name] = port
    if lookupds and not getattr(args, "http_address", None) and ports["broadcast_http_port"] is None:
        raise ConfigError("--lookupd-tcp-address without an --http-address needs --broadcast-http-port "
                          "(nsqlookupd requires an HTTP port)")
    return BrokerOptions(limits=limits, tls_cert=args.tls_cert, tls_key=args.tls_key,
                         tls_required=args.tls_required, auth_file=args.auth_file,
                         e2e_percentiles=percentiles, e2e_window_s=args.e2e_processing_latency_window_time,
                         web_path=web_path, web_write_token=getattr(args, "web_write_token", None) or None,
                         metrics_database=args.metrics_database,
                         metrics_leader_timeout_s=args.metrics_leader_timeout,
                         broadcast_address=getattr(args, "broadcast_address", None) or socket.gethostname(),
                         lookupd_tcp_addresses=lookupds, https_address=https,
                         auth_http_addresses=auth_servers, maintenance=args.maintenance, **ports)


METRICS_DATABASE = ("leader", "always", "never")
_NSQD_PATHS = ("ping", "info", "stats", "metrics", "pub", "mpub", "pub_ext", "topic", "channel")


def parse_percentiles(values) -> list:
    """``--e2e-processing-latency-percentile`` values (each may be comma separated, as
    nsqd's): quantiles in (0, 1], in the order given, without repeats."""
    out = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                q = float(part)
            except ValueError:
                raise ConfigError(f"e2e processing latency percentile {part!r} is not a number") from None
            if not 0 < q <= 1:
                raise ConfigError(f"e2e processing latency percentile {q} must be in (0, 1]")
            if q not in out:
                out.append(q)
    return out


def parser() -> argparse.ArgumentParser:
    d = p.DEFAULTS
    ap = argparse.ArgumentParser(prog="python -m fdq.broker", description="NSQ-compatible broker over FDQ")
    ap.add_argument("--url", required=True, help="FDQ database URL (sqlite:///path or fdb://...)")
    ap.add_argument("--tcp-address", default="0.0.0.0:4150", help="<addr>:<port> for TCP clients")
    ap.add_argument("--http-address", default="0.0.0.0:4151", help="<addr>:<port> for HTTP clients ('' for none)")
    ap.add_argument("--msg-timeout", type=parse_duration, default=d["msg_timeout_ms"] / 1000)
    ap.add_argument("--max-msg-timeout", type=parse_duration, default=d["max_msg_timeout_ms"] / 1000)
    ap.add_argument("--max-msg-size", type=int, default=d["max_msg_size"])
    ap.add_argument("--max-body-size", type=int, default=d["max_body_size"])
    ap.add_argument("--max-rdy-count", type=int, default=d["max_rdy_count"])
    ap.add_argument("--max-heartbeat-interval", type=parse_duration, default=d["max_heartbeat_interval_ms"] / 1000)
    ap.add_argument("--max-req-timeout", type=parse_duration, default=d["max_req_timeout_ms"] / 1000)
    ap.add_argument("--max-deflate-level", type=int, default=d["max_deflate_level"])
    ap.add_argument("--deflate", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--snappy", action=argparse.BooleanOptionalAction, default=True,
                    help="offer snappy compression (needs the cramjam package)")
    ap.add_argument("--max-output-buffer-size", type=int, default=d["max_output_buffer_size"],
                    help="largest output_buffer_size a client may ask for (bytes)")
    ap.add_argument("--output-buffer-timeout", type=parse_duration, default=d["output_buffer_timeout_ms"] / 1000,
                    help="default time buffered messages wait before they are flushed")
    ap.add_argument("--min-output-buffer-timeout", type=parse_duration,
                    default=d["min_output_buffer_timeout_ms"] / 1000,
                    help="shortest output_buffer_timeout a client may ask for")
    ap.add_argument("--max-output-buffer-timeout", type=parse_duration,
                    default=d["max_output_buffer_timeout_ms"] / 1000,
                    help="longest output_buffer_timeout a client may ask for")
    ap.add_argument("--e2e-processing-latency-percentile", action="append", default=None,
                    help="publish-to-FIN latency quantile to report in /stats, in (0, 1] (repeat or "
                         "comma separate: 1.0,0.99,0.95); default none")
    ap.add_argument("--e2e-processing-latency-window-time", type=parse_duration, default=600.0,
                    help="window of those percentiles")
    ap.add_argument("--tls-cert")
    ap.add_argument("--tls-key")
    ap.add_argument("--tls-required", action="store_true")
    ap.add_argument("--https-address", default=None,
                    help="<addr>:<port> for HTTPS clients (the HTTP API over TLS; needs --tls-cert/--tls-key)")
    ap.add_argument("--auth-file", help="secrets -> permissions (see fdq/broker/auth.py)")
    ap.add_argument("--auth-http-address", action="append", default=None,
                    help="nsqd auth server, host:port or URL (repeatable; see fdq/broker/authd.py)")
    ap.add_argument("--web-path", default=None,
                    help="serve the web dashboard (fdq web) under this path of the HTTP port, e.g. /web/")
    ap.add_argument("--web-write-token", default=None,
                    help="actions from the dashboard need this token (or an --auth-file secret with admin)")
    ap.add_argument("--metrics-database", choices=METRICS_DATABASE, default=BrokerOptions.metrics_database,
                    help="/metrics' database-wide families (topics, subscriptions, consumers): leader = "
                         "from one of the brokers serving /metrics on the database at a time; always = from "
                         "this broker; never")
    ap.add_argument("--metrics-leader-timeout", type=parse_duration, default=BrokerOptions.metrics_leader_timeout_s,
                    help="the metrics leader's beat standing still this long, another broker takes over")
    ap.add_argument("--lookupd-tcp-address", action="append", default=None,
                    help="nsqlookupd TCP address to register with (repeatable)")
    ap.add_argument("--broadcast-address", default=None,
                    help="address this broker is registered under with nsqlookupd (default: the hostname)")
    ap.add_argument("--broadcast-tcp-port", type=int, default=None,
                    help="TCP port registered with nsqlookupd (default: the bound TCP port)")
    ap.add_argument("--broadcast-http-port", type=int, default=None,
                    help="HTTP port registered with nsqlookupd (default: the bound HTTP port)")
    ap.add_argument("--maintenance", action=argparse.BooleanOptionalAction, default=True,
                    help="take part in every topic's retention and TTL sweeps (one process per topic at a time)")
    ap.add_argument("--log-level", default="WARNING")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def ready(tcp_port, http_port, https_port):
        th = args.tcp_address.rpartition(":")[0]
        hh = args.http_address.rpartition(":")[0]
        https = f" https={args.https_address.rpartition(':')[0]}:{https_port}" if https_port is not None else ""
        print(f"fdq-broker tcp={th}:{tcp_port} http={hh}:{http_port}{https}", flush=True)
    try:
        run(args.url, args.tcp_address, args.http_address or None, build_options(args), ready)
    except FDQError as e:
        print(f"fdq broker: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
