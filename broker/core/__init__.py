"""The pure queue core: a synchronous state machine with ``now`` passed in.

Nothing here performs I/O, reads a clock, logs or awaits (a test enforces the imports).
"""

from broker.core.config import FinishedHistory, QueueConfig, RetryBackoff, check_queue_name
from broker.core.durations import parse_duration
from broker.core.model import (
    ClaimOutcome,
    Delivery,
    MessageView,
    NewMessage,
    PublishedRef,
    QueueStats,
    SettleOutcome,
    State,
)
from broker.core.queue import QueueCore
from broker.core.records import RECORD_TYPES, Record

__all__ = [
    "RECORD_TYPES",
    "ClaimOutcome",
    "Delivery",
    "FinishedHistory",
    "MessageView",
    "NewMessage",
    "PublishedRef",
    "QueueConfig",
    "QueueCore",
    "QueueStats",
    "Record",
    "RetryBackoff",
    "SettleOutcome",
    "State",
    "check_queue_name",
    "parse_duration",
]
