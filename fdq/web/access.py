"""Who may look and who may act.

``fdq web`` alone: anyone who reaches the address may read (bind it to 127.0.0.1, the
default, or put it behind a proxy); actions (pause, play, rebalance, redrive, purge)
need the ``--write-token`` the server was started with, and are refused without one
(read-only by default).

Mounted in the broker (``fdq broker --web-path /web/``): the broker's ``--auth-file``
rules apply as on its HTTP API. Reading needs a known secret (as ``/stats``), an
action needs ``admin`` on its topic (and, for a subscription's, the channel), as
``/topic/pause`` and ``/channel/pause``. A ``--web-write-token`` may be given too;
without an auth file or a write token the dashboard is read-only.

The page sends what a person typed in its token field as ``Authorization: Bearer``;
``X-NSQ-Auth-Secret`` (the broker's header) is read too. Credentials travel in headers,
never cookies, so another site's page cannot make a browser act here.
"""
from __future__ import annotations

import hmac

from ..errors import AccessDenied


class Access:
    """``check_read(headers)`` and ``check_write(headers, topic, subscription)`` raise
    ``AccessDenied`` or return. ``headers``: lower-case names."""

    def __init__(self, write_token: str | None = None, auth=None, *,
                 enable_hint: str = "fdq web --write-token TOKEN"):
        self.write_token = write_token or None
        self.auth = auth                # fdq.broker.auth.AuthFile, or None
        self.enable_hint = enable_hint  # how to start the server so it takes actions

    @property
    def writable(self) -> bool:
        """Whether any credential can act here."""
        return self.write_token is not None or self.auth is not None

    @property
    def mode(self) -> str:
        return "auth-file" if self.auth is not None else "token" if self.write_token else "read-only"

    @staticmethod
    def credential(headers: dict) -> str | None:
        value = headers.get("authorization", "")
        if value[:7].lower() == "bearer ":
            return value[7:].strip() or None
        return headers.get("x-nsq-auth-secret") or None

    def _is_write_token(self, cred: str) -> bool:
        return self.write_token is not None and hmac.compare_digest(cred.encode(), self.write_token.encode())

    def check_read(self, headers: dict):
        if self.auth is None:
            return
        cred = self.credential(headers)
        if cred is None:
            raise AccessDenied("this dashboard needs a secret of the broker's --auth-file: enter it in the "
                               "token field", "auth_required")
        if not self._is_write_token(cred) and self.auth.lookup(cred.encode()) is None:
            raise AccessDenied("the secret given is not in the broker's --auth-file", "auth_failed")

    def check_write(self, headers: dict, topic: str, subscription: str | None = None):
        if not self.writable:
            raise AccessDenied(f"read-only: this dashboard was started without a write token "
                               f"({self.enable_hint})", "read_only")
        cred = self.credential(headers)
        if cred is None:
            raise AccessDenied("this action needs the write token: enter it in the token field",
                               "auth_required")
        if self._is_write_token(cred):
            return
        grant = self.auth.lookup(cred.encode()) if self.auth is not None else None
        if grant is None:
            what = "write token" if self.auth is None else "write token or a secret of the broker's --auth-file"
            raise AccessDenied(f"the token given is not the {what}", "auth_failed")
        if not grant.allows(topic, subscription, "admin"):
            on = f"topic {topic!r}" + (f", channel {subscription!r}" if subscription else "")
            raise AccessDenied(f"{grant.identity!r} has no admin permission on {on}", "forbidden")


__all__ = ["Access"]
