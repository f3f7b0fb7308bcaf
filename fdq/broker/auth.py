"""``--auth-file``: secrets and what each may do, checked by the broker itself (nsqd
asks an HTTP auth server; the file holds the same answer nsqd's auth server gives).

The file is JSON::

    {"secrets": [
        {"secret": "s3cret-for-orders", "identity": "orders-service",
         "authorizations": [
            {"topic": "orders(\\\\..*)?", "channels": ["billing", "audit.*"],
             "permissions": ["subscribe", "publish"]}]},
        {"secret": "ops", "identity": "ops",
         "authorizations": [{"topic": ".*", "channels": [".*"],
                             "permissions": ["subscribe", "publish", "admin"]}]}]}

``topic`` and ``channels`` are regular expressions matched against the WHOLE name
(anchored, unlike nsqd's unanchored match, so ``orders`` never grants ``orders-x``).
Permissions: ``publish`` (PUB, MPUB, DPUB, PUB_EXT, /pub, /mpub, /pub_ext),
``subscribe`` (SUB: the channel must match too), ``admin`` (/topic/*, /channel/*).
TCP clients send the secret with AUTH; HTTP clients in the ``X-NSQ-Auth-Secret`` header.
"""
from __future__ import annotations

import hmac
import json
import re
import time
from dataclasses import dataclass

from ..errors import ConfigError

PERMISSIONS = ("publish", "subscribe", "admin")


@dataclass(frozen=True)
class Rule:
    topic: re.Pattern
    channels: tuple
    permissions: frozenset
    nsqd: bool = False      # an auth server's rule: nsqd's matching (authd.py)

    def allows(self, topic: str, channel: str | None, action: str) -> bool:
        if self.nsqd:       # unanchored; a publish needs a channel regex matching "" (nsqd's IsAllowed)
            return action in self.permissions and self.topic.search(topic) is not None and \
                any(c.search(channel or "") for c in self.channels)
        if action not in self.permissions or not self.topic.fullmatch(topic):
            return False
        if channel is None:
            return True
        return any(c.fullmatch(channel) for c in self.channels)


@dataclass(frozen=True)
class Grant:
    identity: str
    rules: tuple
    identity_url: str = ""
    expires: float | None = None     # time.monotonic() past which an auth server is asked again

    def allows(self, topic: str, channel: str | None, action: str) -> bool:
        return any(r.allows(topic, channel, action) for r in self.rules)

    def expired(self) -> bool:
        return self.expires is not None and time.monotonic() >= self.expires


class AuthFailed(Exception):
    """A secret without a grant (its message says why: for the log, not the client)."""


class AuthFile:
    def __init__(self, entries: list):
        self._entries = entries      # [(secret bytes, Grant)]

    def query(self, secret: bytes, remote_ip: str = "", tls: bool = False, common_name: str = "") -> Grant:
        """A TCP client's AUTH (the same call as ``authd.AuthServers.query``)."""
        grant = self.lookup(secret)
        if grant is None:
            raise AuthFailed("unknown secret")
        return grant

    def lookup(self, secret: bytes, remote_ip: str = "", tls: bool = False) -> Grant | None:
        """The grant of ``secret`` (compared in constant time), or None."""
        found = None
        for s, grant in self._entries:
            if hmac.compare_digest(s, secret):
                found = grant
        return found

    @classmethod
    def load(cls, path: str) -> "AuthFile":
        try:
            with open(path, "rb") as f:
                data = json.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read --auth-file {path!r}: {e}") from None
        except ValueError as e:
            raise ConfigError(f"--auth-file {path!r} is not valid JSON: {e}") from None
        return cls.parse(data, path)

    @classmethod
    def parse(cls, data, where: str = "auth file") -> "AuthFile":
        if not isinstance(data, dict) or not isinstance(data.get("secrets"), list):
            raise ConfigError(f"{where}: expected {{\"secrets\": [...]}}")
        entries = []
        for i, e in enumerate(data["secrets"]):
            what = f"{where}: secrets[{i}]"
            if not isinstance(e, dict) or not isinstance(e.get("secret"), str) or not e["secret"]:
                raise ConfigError(f"{what}: needs a non-empty string \"secret\"")
            rules = parse_rules(e.get("authorizations"), what)
            entries.append((e["secret"].encode(), Grant(str(e.get("identity") or f"secret-{i}"), tuple(rules))))
        return cls(entries)


def parse_rules(authorizations, what: str, nsqd: bool = False) -> list:
    """``authorizations`` (a list of {"topic", "channels", "permissions"}) as Rules;
    ConfigError naming ``what`` for an unknown permission or a bad regular expression."""
    if authorizations is not None and not isinstance(authorizations, list):
        raise ConfigError(f"{what}: \"authorizations\" must be a list")
    rules = []
    for j, a in enumerate(authorizations or []):
        w = f"{what}.authorizations[{j}]"
        if not isinstance(a, dict):
            raise ConfigError(f"{w}: must be an object")
        perms = a.get("permissions") or []
        if not isinstance(perms, list):
            raise ConfigError(f"{w}: \"permissions\" must be a list")
        bad = [x for x in perms if x not in PERMISSIONS]
        if bad:
            raise ConfigError(f"{w}: unknown permission(s) {bad} (known: {', '.join(PERMISSIONS)})")
        try:
            topic = re.compile(a.get("topic", ""))
            channels = tuple(re.compile(c) for c in a.get("channels") or [])
        except (re.error, TypeError) as ex:
            raise ConfigError(f"{w}: bad regular expression: {ex}") from None
        rules.append(Rule(topic, channels, frozenset(perms), nsqd))
    return rules


__all__ = ["AuthFailed", "AuthFile", "Grant", "Rule", "PERMISSIONS", "parse_rules"]
