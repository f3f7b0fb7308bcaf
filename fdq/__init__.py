"""FDQ: a message queue layer on FoundationDB."""
from .engine import connect, transactional
from .errors import (BacklogFull, ConfigError, ConnectError, EngineError, FDQError,
                     FormatError, InvalidHeader, InvalidMessage, InvalidName, LeaseLost,
                     MessageTooLarge, SubscriptionNotFound, TopicExists, TopicNotFound)

__version__ = "0.1.0"

__all__ = [
    "connect", "transactional",
    "FDQError", "ConfigError", "ConnectError", "EngineError", "FormatError", "InvalidName",
    "TopicNotFound", "TopicExists", "SubscriptionNotFound", "MessageTooLarge",
    "InvalidMessage", "InvalidHeader", "BacklogFull", "LeaseLost",
]
