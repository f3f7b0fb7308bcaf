"""FDQ: a message queue layer on FoundationDB."""
from .engine import transactional
from .keyspace.format import connect
from .errors import (BacklogFull, ClientForked, ConfigError, ConnectError, ConsumerStalled, CorruptValue,
                     DatabaseCorrupt, EngineError, FDQError, FormatError, InvalidHeader, InvalidMessage, InvalidName,
                     LeaseLost,
                     MessageTooLarge, ReplayTakenOver, SubscriptionNotFound, TopicExists, TopicNotFound)

from .config import ConsumerConfig, ProducerConfig, SubscriptionConfig, TopicConfig
from .consumer import Consumer
from .message import Message
from .settlement import Action, Settlement
from .tailing import tail
from .producer import Envelope, Producer, PushResult
from .supervisor import Supervisor
from .maintainer import Maintenance
from . import aio, worker

__version__ = "0.1.0"

__all__ = [
    "connect", "transactional", "Producer", "Envelope", "PushResult", "Consumer", "Message", "Settlement",
    "Action", "tail", "aio", "worker", "Supervisor", "Maintenance", "ConsumerConfig", "ProducerConfig", "TopicConfig", "SubscriptionConfig",
    "FDQError", "ConfigError", "ConnectError", "EngineError", "FormatError", "InvalidName",
    "TopicNotFound", "TopicExists", "SubscriptionNotFound", "MessageTooLarge",
    "InvalidMessage", "InvalidHeader", "BacklogFull", "LeaseLost", "ConsumerStalled", "ClientForked",
    "ReplayTakenOver", "CorruptValue", "DatabaseCorrupt",
]
