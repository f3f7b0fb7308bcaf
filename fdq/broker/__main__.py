"""``python -m fdq.broker``: run the NSQ-compatible broker (nsqd's flag names).

Prints one line ``fdq-broker tcp=HOST:PORT http=HOST:PORT`` on stdout once listening
(ports resolved when 0 is given), then serves until SIGTERM/SIGINT."""
from __future__ import annotations

import argparse
import logging
import re
import sys

from ..errors import ConfigError, FDQError
from . import protocol as p
from .server import BrokerOptions, run

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")


def parse_duration(text: str) -> float:
    """Seconds of a Go duration (``60s``, ``1m30s``, ``500ms``) or a plain number of seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    pos, total = 0, 0.0
    for m in _PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (use e.g. 60s, 1m30s, 500ms)")
    return total


def build_options(args) -> BrokerOptions:
    ms = lambda s: int(round(s * 1000))  # noqa: E731
    limits = p.Limits(msg_timeout_ms=ms(args.msg_timeout), max_msg_timeout_ms=ms(args.max_msg_timeout),
                      max_msg_size=args.max_msg_size, max_body_size=args.max_body_size,
                      max_rdy_count=args.max_rdy_count, max_heartbeat_interval_ms=ms(args.max_heartbeat_interval),
                      max_req_timeout_ms=ms(args.max_req_timeout),
                      heartbeat_interval_ms=min(p.DEFAULTS["heartbeat_interval_ms"], ms(args.max_heartbeat_interval)),
                      deflate=args.deflate, max_deflate_level=args.max_deflate_level)
    if limits.msg_timeout_ms > limits.max_msg_timeout_ms:
        raise ConfigError("--msg-timeout must not exceed --max-msg-timeout")
    return BrokerOptions(limits=limits, tls_cert=args.tls_cert, tls_key=args.tls_key,
                         tls_required=args.tls_required, auth_file=args.auth_file)


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
    ap.add_argument("--tls-cert")
    ap.add_argument("--tls-key")
    ap.add_argument("--tls-required", action="store_true")
    ap.add_argument("--auth-file", help="secrets -> permissions (see fdq/broker/auth.py)")
    ap.add_argument("--log-level", default="WARNING")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def ready(tcp_port, http_port):
        th = args.tcp_address.rpartition(":")[0]
        hh = args.http_address.rpartition(":")[0]
        print(f"fdq-broker tcp={th}:{tcp_port} http={hh}:{http_port}", flush=True)
    try:
        run(args.url, args.tcp_address, args.http_address or None, build_options(args), ready)
    except FDQError as e:
        print(f"fdq broker: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
