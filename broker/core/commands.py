"""Commands: what a client asks a queue to do, in the imperative.

The HTTP layer builds one from a request after checking its shape; the actor hands it to
``QueueCore.apply`` with the time. Values are already validated and in the core's units (seconds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from broker.core.model import NewMessage, State


@dataclass(frozen=True, slots=True)
class Publish:
    messages: Sequence[NewMessage]


@dataclass(frozen=True, slots=True)
class Claim:
    consumer: str
    max_count: int = 1
    lease: float | None = None
    #: Seconds to wait for a message when none is ready (long poll); handled by the actor.
    wait: float = 0.0


@dataclass(frozen=True, slots=True)
class Ack:
    lease_ids: Sequence[str]


@dataclass(frozen=True, slots=True)
class Nack:
    lease_ids: Sequence[str]
    delay: float | None = None
    reason: str | None = None
    #: ``False``: the consumer says retrying cannot help; the message is dead-lettered at once.
    retryable: bool = True


@dataclass(frozen=True, slots=True)
class Defer:
    lease_ids: Sequence[str]
    retry_after: float = 0.0
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Extend:
    lease_ids: Sequence[str]
    lease: float


@dataclass(frozen=True, slots=True)
class Release:
    """Give leases back at once (a consumer went away); ``refund_attempt`` when it never saw them."""

    lease_ids: Sequence[str]
    refund_attempt: bool = False


@dataclass(frozen=True, slots=True)
class Receive:
    """Messages moved here from another queue (dead-lettered, expired or redriven). Unlike a publish,
    keys are not de-duplicated and ``max_depth`` does not refuse them: a move must never lose one."""

    messages: Sequence[NewMessage]


@dataclass(frozen=True, slots=True)
class Redrive:
    """Move messages out of this (dead-letter) queue: ``ids``, or every ready and delayed one when
    ``None``; each goes to ``to``, else to the queue its ``x-dead-letter-from`` header names. Only
    queues in ``destinations`` (the ones that exist) are moved to: a live view of them, so that a queue
    deleted while this command waited in the inbox is not moved to (and created again on demand)."""

    ids: Sequence[str] | None
    to: str | None
    destinations: AbstractSet[str]


@dataclass(frozen=True, slots=True)
class ListMovable:
    """The ids a ``Redrive`` of every message would move (ready and delayed, in seq order) and leave
    (in flight): a redrive of a large dead-letter queue is carried out as redrives of these ids a slice
    at a time (``Registry.redrive``), so that it never holds the event loop for seconds."""


@dataclass(frozen=True, slots=True)
class Browse:
    state: State | None = None
    limit: int = 100
    after: int = 0


@dataclass(frozen=True, slots=True)
class GetMessage:
    message_id: str


@dataclass(frozen=True, slots=True)
class FindLeases:
    """The lease of each message's latest delivery, for the surfaces that settle by message id
    (``QueueCore.find_leases``). A read, like ``GetMessage``: it journals only what it noticed came due."""

    message_ids: Sequence[str]


@dataclass(frozen=True, slots=True)
class FindDelivery:
    """The lease of the latest delivery of a message to ``consumer`` with ``attempt``, and the message's
    attempt now (``QueueCore.find_delivery``). A read, like ``GetMessage``."""

    message_id: str
    consumer: str
    attempt: int


@dataclass(frozen=True, slots=True)
class BrowseDeadLetters:
    """A page of the dead letters here from queue ``origin`` (``QueueCore.browse_dead_letters``): of the
    first ``limit`` live messages with ``seq > after``, those whose ``x-dead-letter-from`` names it."""

    origin: str
    limit: int = 100
    after: int = 0


@dataclass(frozen=True, slots=True)
class FindDeadLetters:
    """Which dead letters here from queue ``origin`` the ``ids`` name, by their own id or the id of the
    message they were (``QueueCore.find_dead_letters``). A read, like ``GetMessage``."""

    origin: str
    ids: Sequence[str]


@dataclass(frozen=True, slots=True)
class DeleteMessage:
    message_id: str


@dataclass(frozen=True, slots=True)
class Purge:
    pass


@dataclass(frozen=True, slots=True)
class GetStats:
    pass


@dataclass(frozen=True, slots=True)
class UpdateConfig:
    #: Any subset of the queue's config fields, as the client sent them.
    changes: Mapping[str, Any]
    #: A rotation: a fresh secret for the push config as it is when the change applies (one computed
    #: from an earlier read put back a push config a PUT had removed or changed meanwhile).
    new_push_secret: bool = False


Command = (
    Publish
    | Claim
    | Ack
    | Nack
    | Defer
    | Extend
    | Release
    | Receive
    | Redrive
    | ListMovable
    | Browse
    | GetMessage
    | FindLeases
    | FindDelivery
    | BrowseDeadLetters
    | FindDeadLetters
    | DeleteMessage
    | Purge
    | GetStats
    | UpdateConfig
)

#: Commands whose records change what a restart recovers, so a durable queue answers them only once
#: their records are committed. Claims and extends change only leases, which need not survive a crash.
DURABLE_COMMANDS: frozenset[type[Any]] = frozenset(
    {Publish, Ack, Nack, Defer, Release, Receive, Redrive, DeleteMessage, Purge, UpdateConfig}
)
