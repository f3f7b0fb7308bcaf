"""Every exception FDQ raises. Callers catch ``FDQError`` (or a subclass) and never
need to import ``sqlite3`` or ``fdb``."""


class FDQError(Exception):
    """Base of every error FDQ raises."""


class ConfigError(FDQError):
    """An option, URL or configuration value is invalid."""


class ConnectError(ConfigError):
    """The database named by a URL cannot be opened."""


class FormatError(FDQError):
    """The database holds a key layout this version of FDQ cannot use."""


class InvalidName(FDQError):
    """A topic or subscription name breaks the naming rule."""


class TopicNotFound(FDQError):
    """The topic does not exist."""


class TopicExists(FDQError):
    """A topic of that name already exists with another configuration."""


class SubscriptionNotFound(FDQError):
    """The subscription does not exist."""


class MessageNotFound(FDQError):
    """No trace of the message: not in the topic's log (trimmed, or never pushed) nor
    in any queue or dead-letter queue of its subscriptions."""


class ConsumerStalled(FDQError):
    """A consumer could not reach the database, or owned no shard, for over 3 heartbeats."""


class MessageTooLarge(FDQError):
    """A message body is larger than the topic allows."""


class InvalidMessage(FDQError):
    """A message or its envelope is malformed (wrong body type, bad delay, ...)."""


class InvalidHeader(FDQError):
    """A message header has a bad name, value or size."""


class BacklogFull(FDQError):
    """The topic's max_backlog would be exceeded; nothing was written."""


class TopicHeld(FDQError):
    """A push met a play's brief hold (``fdq.ops.play.play_chunk``): nothing was
    written. Producers and replay wait it out and retry; it does not reach callers."""


class ReplayTakenOver(FDQError):
    """A replay stalled for longer than ``fdq.supervisor.REPLAY_ORPHAN_S`` (its heartbeat
    stopped) and a rerun of the same window took its progress over: this one stops,
    having pushed nothing the rerun will push again."""


class CorruptValue(FDQError):
    """A stored value does not decode (a damaged record): ``what`` it was ("message
    record", "lease record", ...), its ``raw`` bytes as stored, and ``cause``: what the
    decoder found wrong. Queues move such a record to the dead-letter queue, raw bytes
    kept, and go on; log readers skip it with a warning."""

    def __init__(self, what: str, raw=b"", cause: str = ""):
        self.what, self.raw, self.cause = what, bytes(raw), cause
        super().__init__(f"{what} does not decode: {cause}" if cause else f"{what} does not decode")

    def __reduce__(self):
        return (type(self), (self.what, self.raw, self.cause))


class ClientForked(FDQError):
    """A FoundationDB client used in a process forked after it started (it cannot work
    there: start such processes with ``spawn``, or connect after the fork)."""


class LeaseLost(FDQError):
    """The message's lease or the shard's ownership moved to another consumer."""

    def __init__(self, message: str, ids=()):
        super().__init__(message)
        self.ids = tuple(ids)    # the ids of the messages whose lease was lost, if any

    def __reduce__(self):
        return (type(self), (str(self), self.ids))


# FDB error codes the embedded engine raises, with FDB's names and descriptions.
ERROR_NAMES = {
    1004: ("timed_out", "Operation timed out"),
    1007: ("transaction_too_old", "Transaction is too old to perform reads or be committed"),
    1009: ("future_version", "Request for future version"),
    1020: ("not_committed", "Transaction not committed due to conflict with another transaction"),
    1021: ("commit_unknown_result", "Transaction may or may not have committed"),
    1022: ("commit_unknown_result_fatal", "Idempotency id for transaction may have expired"),
    1025: ("transaction_cancelled", "Operation aborted because the transaction was cancelled"),
    1031: ("transaction_timed_out", "Operation aborted because the transaction timed out"),
    1032: ("too_many_watches", "Too many watches currently set (limit 10,000 per database)"),
    1034: ("watches_disabled", "Watches cannot be set if read your writes is disabled"),
    1036: ("accessed_unreadable", "Read or wrote an unreadable key"),
    1037: ("process_behind", "Storage process does not have recent mutations"),
    1038: ("database_locked", "Database is locked"),
    1101: ("operation_cancelled", "Asynchronous operation cancelled"),
    2000: ("client_invalid_operation", "Invalid API call"),
    2004: ("key_outside_legal_range", "Key outside legal range"),
    2005: ("inverted_range", "Range begin key larger than end key"),
    2006: ("invalid_option_value", "Option set with an invalid value"),
    2017: ("used_during_commit", "Operation issued while a commit was outstanding"),
    2020: ("no_commit_version", "Transaction is read-only and therefore does not have a commit version"),
    2021: ("no_commit_version", "Transaction is read-only and therefore does not have a commit version"),
    2101: ("transaction_too_large", "Transaction exceeds byte limit (10,000,000 bytes)"),
    2102: ("key_too_large", "Key length exceeds limit (10,000 bytes)"),
    2103: ("value_too_large", "Value length exceeds limit (100,000 bytes)"),
    4100: ("internal_error", "An internal error occurred"),
}

# Predicates, as fdb.predicates (fdb_error_predicate in bindings/c/fdb_c.cpp).
RETRYABLE_NOT_COMMITTED = frozenset({1007, 1009, 1020, 1037, 1038, 1213})
MAYBE_COMMITTED = frozenset({1021, 1039})
RETRYABLE = RETRYABLE_NOT_COMMITTED | MAYBE_COMMITTED


class EngineError(FDQError):
    """A database error, with FoundationDB's numeric ``code`` and ``name``.

    The embedded engine raises it directly; on FoundationDB, ``fdb.FDBError`` is
    translated to it where it leaves FDQ (``fdq.transactional``)."""

    def __init__(self, code: int, description: str | None = None):
        self.code = int(code)
        name, default = ERROR_NAMES.get(self.code, ("unknown_error", "Unknown error"))
        self.name = name
        self.description = description or default
        super().__init__(f"{self.description} ({self.name}, code {self.code})")

    def __reduce__(self):
        return (type(self), (self.code, self.description))


class DatabaseCorrupt(EngineError):
    """The embedded engine's database file is damaged (SQLite: "database disk image is
    malformed", "file is not a database"): ``path`` names it, ``cause`` is SQLite's
    text. Code 4100 (``internal_error``), never retried: the damage stays."""

    def __init__(self, path: str, cause: str):
        self.path = path
        self.cause = cause
        super().__init__(4100, f"database file {path!r} is damaged (SQLite: {cause}): stop the processes "
                               f"using it, keep a copy, then recover it (sqlite3 {path} .recover) or restore "
                               "a backup")
        self.args = (self.description,)

    def __str__(self):
        return self.description

    def __reduce__(self):
        return (type(self), (self.path, self.cause))


def is_retryable(err) -> bool:
    """As ``fdb.predicates.is_retryable``: takes anything with a ``code``."""
    return getattr(err, "code", None) in RETRYABLE


def is_maybe_committed(err) -> bool:
    """As ``fdb.predicates.is_maybe_committed``."""
    return getattr(err, "code", None) in MAYBE_COMMITTED


class AccessDenied(FDQError):
    """A request lacks the token or permission its action needs (``fdq web``). ``code``:
    ``auth_required`` (none given), ``auth_failed`` (not known), ``read_only`` (the
    server takes no writes), ``forbidden`` (known, without this permission)."""

    def __init__(self, message: str, code: str = "forbidden"):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return (type(self), (str(self), self.code))
