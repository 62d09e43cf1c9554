"""Records: what happened to a queue, in the past tense.

Every state change the core makes is returned as one of these, in order. The actor hands them to the
journal with the queue name and the time of the command; replaying them rebuilds the queue. The set of
types is the journal's (§8): adding a field is fine only with a default (older records lack it);
renaming or removing one is a format change (docs/journal-format.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.core.config import QueueConfig
from broker.core.immutable import immutable as record


@record
class QueueCreated:
    config: QueueConfig
    id_prefix: str


@record
class QueueUpdated:
    config: QueueConfig


@record
class QueueDeleted:
    pass


@record
class Published:
    id: str
    seq: int
    payload: bytes
    binary: bool
    headers: Mapping[str, str] | None
    key: str | None
    priority: int
    published_at: float
    available_at: float | None
    #: ``(queue, message id)`` when the message was moved here from another queue (a dead letter, an
    #: expiry, a redrive) rather than published: its key is not remembered, and recovery uses it to
    #: tell whether a move recorded by the other queue arrived.
    origin: tuple[str, str] | None = None


@record
class Replaced:
    """A publish with ``on_duplicate: "replace"`` gave a ready or delayed message a new body."""

    id: str
    payload: bytes
    binary: bool
    headers: Mapping[str, str] | None


@record
class Claimed:
    id: str
    lease_id: str
    consumer: str
    attempt: int
    deadline: float


@record
class Acked:
    id: str
    lease_id: str


@record
class Nacked:
    id: str
    lease_id: str
    delay: float
    reason: str | None


@record
class Deferred:
    id: str
    lease_id: str
    retry_after: float
    reason: str | None


@record
class Extended:
    id: str
    lease_id: str
    deadline: float


@record
class Released:
    id: str
    lease_id: str
    #: True when the delivery never reached a consumer, so it does not count as an attempt.
    refunded: bool


@record
class LeaseExpired:
    id: str
    lease_id: str


@record
class DeadLettered:
    """The message left the queue for the dead-letter queue ``to`` (``None``: dropped, counted).
    The message published into ``to`` carries the provenance headers of §6."""

    id: str
    lease_id: str | None
    reason: str  # "max_attempts" | "rejected"
    attempt: int
    to: str | None


@record
class Expired:
    """``message_ttl`` passed before the message was acked; it went to ``to`` (or was dropped)."""

    id: str
    to: str | None


@record
class Redriven:
    """The message left this (dead-letter) queue for ``to``, where it starts over as a new message."""

    id: str
    to: str


@record
class Deleted:
    id: str


@record
class Purged:
    count: int


Record = (
    QueueCreated
    | QueueUpdated
    | QueueDeleted
    | Published
    | Replaced
    | Claimed
    | Acked
    | Nacked
    | Deferred
    | Extended
    | Released
    | LeaseExpired
    | DeadLettered
    | Expired
    | Redriven
    | Deleted
    | Purged
)

#: The journal type name of each record class (§8), e.g. ``LeaseExpired`` → ``"lease_expired"``.
RECORD_TYPES: dict[type[Any], str] = {
    QueueCreated: "queue_created",
    QueueUpdated: "queue_updated",
    QueueDeleted: "queue_deleted",
    Published: "published",
    Replaced: "replaced",
    Claimed: "claimed",
    Acked: "acked",
    Nacked: "nacked",
    Deferred: "deferred",
    Extended: "extended",
    Released: "released",
    LeaseExpired: "lease_expired",
    DeadLettered: "dead_lettered",
    Expired: "expired",
    Redriven: "redriven",
    Deleted: "deleted",
    Purged: "purged",
}


@record
class HistoryOmitted:
    """Not a journal record: what stands, second in a message's history, for the ``count`` oldest
    entries after its first that the queue dropped to keep the history within ``MAX_HISTORY``
    (``broker.core.queue``); its time is that of the first entry dropped. Snapshots hold it among a
    message's history entries (docs/journal-format.md); the journal never does, and keeps every
    entry it stands for."""

    count: int


#: The types, and their names, that a message's history may hold besides ``RECORD_TYPES``: a snapshot
#: writes them as records of these types, the journal never.
HISTORY_ONLY_TYPES: dict[type[Any], str] = {HistoryOmitted: "omitted"}
