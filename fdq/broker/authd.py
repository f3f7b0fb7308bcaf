"""``--auth-http-address``: nsqd's auth-server protocol (nsqd ``internal/auth``).

The broker asks ``GET http://<addr>/auth?remote_ip=&tls=true|false&secret=&common_name=``
(an address given as a URL is used as is, with these parameters added), trying the
addresses from a random one on, the first answer winning. A 200 answer is::

    {"ttl": 3600, "identity": "...", "identity_url": "...",
     "authorizations": [{"topic": "regex", "channels": ["regex"],
                         "permissions": ["subscribe", "publish"]}]}

matched as nsqd does: regular expressions unanchored (``re.search``), and a publish
allowed only by a rule with a channel regex matching the empty string (``".*"``).
FDQ also accepts the ``admin`` permission (its HTTP /topic/* and /channel/*). Any other
answer (a refusal, an unreachable server, a ttl <= 0, an unknown permission, a bad
regular expression) is a failed AUTH; the cause is logged, not sent to the client.
A grant is asked for again once its ttl is over (on the connection's next command).
HTTP clients' secrets (``X-NSQ-Auth-Secret``) are cached per (secret, address) for
their ttl.
"""
from __future__ import annotations

import collections
import json
import logging
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from ..errors import ConfigError
from .auth import AuthFailed, Grant, parse_rules
from .loglimit import LogLimiter

log = logging.getLogger("fdq.broker.authd")

TIMEOUT_S = 5.0            # nsqd's --http-client-request-timeout
MAX_ANSWER = 1 << 20
CACHE_SIZE = 1024


def parse_grant(data, address: str) -> Grant:
    """An auth server's 200 answer as a Grant expiring after its ttl."""
    if not isinstance(data, dict):
        raise AuthFailed(f"{address}: the answer is not a JSON object")
    ttl = data.get("ttl")
    if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or ttl <= 0:
        raise AuthFailed(f"{address}: invalid ttl {ttl!r} (must be > 0)")
    try:
        rules = parse_rules(data.get("authorizations"), address, nsqd=True)
    except ConfigError as e:
        raise AuthFailed(str(e)) from None
    return Grant(str(data.get("identity") or ""), tuple(rules), str(data.get("identity_url") or ""),
                 time.monotonic() + ttl)


class AuthServers:
    """The ``--auth-http-address`` servers; ``lookup`` blocks (run it in an executor)."""

    def __init__(self, addresses):
        self.urls = []
        for a in addresses:
            url = a if "://" in a else f"http://{a}/auth"
            if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                raise ConfigError(f"--auth-http-address {a!r}: use host:port or an http(s):// URL")
            self.urls.append(url)
        if not self.urls:
            raise ConfigError("--auth-http-address: at least one address")
        self._cache = collections.OrderedDict()     # (secret, remote_ip, tls) -> Grant
        self._lock = threading.Lock()
        self.log_limiter = LogLimiter(log)

    def query(self, secret: bytes, remote_ip: str = "", tls: bool = False, common_name: str = "") -> Grant:
        """Ask the servers (from a random one on); AuthFailed (logged) if none grants."""
        params = urllib.parse.urlencode({"remote_ip": remote_ip, "tls": "true" if tls else "false",
                                         "secret": secret.decode(errors="replace"), "common_name": common_name})
        start = random.randrange(len(self.urls))
        errors = []
        for url in self.urls[start:] + self.urls[:start]:
            full = url + ("&" if urllib.parse.urlsplit(url).query else "?") + params
            where = urllib.parse.urlsplit(url).netloc
            try:
                with urllib.request.urlopen(full, timeout=TIMEOUT_S) as r:
                    return parse_grant(json.loads(r.read(MAX_ANSWER)), where)
            except urllib.error.HTTPError as e:
                errors.append(f"{where}: HTTP {e.code}")
            except (OSError, ValueError, AuthFailed) as e:
                errors.append(f"{where}: {type(e).__name__}: {e}" if not isinstance(e, AuthFailed) else str(e))
        failure = AuthFailed("; ".join(errors))
        self.log_limiter.warning("authd", "auth server: AUTH failed: %s", failure)
        raise failure

    def lookup(self, secret: bytes, remote_ip: str = "", tls: bool = False) -> Grant | None:
        """The grant of an HTTP client's secret (cached for its ttl), or None (the cause logged)."""
        key = (secret, remote_ip, tls)
        with self._lock:
            grant = self._cache.get(key)
        if grant is not None and not grant.expired():
            return grant
        try:
            grant = self.query(secret, remote_ip, tls)
        except AuthFailed:
            return None
        with self._lock:
            self._cache[key] = grant
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grant


__all__ = ["AuthServers", "parse_grant"]
