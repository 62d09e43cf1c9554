"""Messages, their states, and the table of moves between states.

States and moves (the diagram in docs/concepts.md is checked against ``TRANSITIONS`` by a test)::

    publish ──► delayed ──due──► ready ◄──────────── retry / expire ────┐
       │                          │  ▲                                  │
       └──────────────────────────┘  └─ extend (a noticed-expired lease pulled back)
                                  │                                     │
                                claim ──► in_flight ── ack ──► acked    │
                                              │  └── retry_later ──► delayed
                                              └─────────────────────────┘

A lease whose deadline passed is noticed lazily (on the next claim or stats read): the message becomes
``ready`` again, on the reclaim freelist, but that lease still settles (ack, nack, defer, extend) until
the message is delivered again. That is why ``ack``, ``retry``, ``extend`` and ``dead_letter`` are
legal from ``ready``.

The other ways out of a queue: ``dead_letter`` (attempts used up, or a nack with ``retryable: false``),
``time_out`` (``message_ttl`` passed) and ``redrive`` (out of a dead-letter queue, back to its origin).
Each of those that moves the message elsewhere leaves a new message in the other queue.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from broker.core.immutable import immutable
from broker.errors import IllegalTransition

if TYPE_CHECKING:
    from broker.core.config import QueueConfig
    from broker.core.records import Claimed


class State(enum.StrEnum):
    """A message's state; the value is the name the API shows. (``StrEnum`` hashes in C, unlike
    ``Enum``, whose Python-level ``__hash__`` showed up in profiles of the claim path.)"""

    DELAYED = "delayed"
    READY = "ready"
    IN_FLIGHT = "in_flight"
    ACKED = "acked"
    DELETED = "deleted"
    PURGED = "purged"
    DEAD_LETTERED = "dead_lettered"
    EXPIRED = "expired"
    REDRIVEN = "redriven"


DELAYED, READY, IN_FLIGHT = State.DELAYED, State.READY, State.IN_FLIGHT
ACKED, DELETED, PURGED = State.ACKED, State.DELETED, State.PURGED
DEAD_LETTERED, EXPIRED, REDRIVEN = State.DEAD_LETTERED, State.EXPIRED, State.REDRIVEN

#: (state, move) → next state. Any pair not listed is an illegal move.
TRANSITIONS: dict[tuple[State, str], State] = {
    (DELAYED, "due"): READY,
    (READY, "claim"): IN_FLIGHT,
    (IN_FLIGHT, "ack"): ACKED,
    (READY, "ack"): ACKED,
    (IN_FLIGHT, "retry"): READY,
    (READY, "retry"): READY,
    (IN_FLIGHT, "retry_later"): DELAYED,
    (READY, "retry_later"): DELAYED,
    (IN_FLIGHT, "expire"): READY,
    (IN_FLIGHT, "extend"): IN_FLIGHT,
    (READY, "extend"): IN_FLIGHT,
    (READY, "delete"): DELETED,
    (DELAYED, "delete"): DELETED,
    (IN_FLIGHT, "delete"): DELETED,
    (READY, "purge"): PURGED,
    (DELAYED, "purge"): PURGED,
    (IN_FLIGHT, "dead_letter"): DEAD_LETTERED,
    (READY, "dead_letter"): DEAD_LETTERED,
    (READY, "time_out"): EXPIRED,
    (DELAYED, "time_out"): EXPIRED,
    (IN_FLIGHT, "time_out"): EXPIRED,
    (READY, "redrive"): REDRIVEN,
    (DELAYED, "redrive"): REDRIVEN,
}

#: States in which a message is still in the queue (counted in stats, visible to browse).
LIVE_STATES = frozenset({DELAYED, READY, IN_FLIGHT})


def move(message: Message, move_name: str) -> None:
    """Apply one move of the state table to ``message``, or raise ``IllegalTransition``."""
    try:
        message.state = TRANSITIONS[message.state, move_name]
    except KeyError:
        raise IllegalTransition(
            f"message {message.id} cannot {move_name} from state {message.state.value}"
        ) from None


class Message:
    """One message and everything the queue knows about it.

    ``payload`` is the encoded payload (JSON text, or raw bytes when ``binary``), never re-parsed by the
    queue. ``ticket`` identifies the one live entry for this message in the structure it sits in (ready
    lanes, reclaim heap, delayed heap or lease deadlines); entries with another ticket are stale and
    skipped. ``lease_id`` stays set after a lease expiry is noticed, so that lease still settles until the
    message is claimed again. ``history`` is ``None`` until something other than publishing happens,
    and holds at most ``MAX_HISTORY`` entries (``broker.core.queue``), the older ones counted.
    """

    __slots__ = (
        "attempt",
        "available_at",
        "binary",
        "consumer",
        "deliveries",
        "headers",
        "history",
        "id",
        "key",
        "lease_deadline",
        "lease_id",
        "payload",
        "priority",
        "published_at",
        "ready_at",
        "seq",
        "state",
        "ticket",
    )

    def __init__(
        self,
        id: str,
        seq: int,
        payload: bytes,
        binary: bool,
        headers: Mapping[str, str] | None,
        key: str | None,
        priority: int,
        published_at: float,
        available_at: float | None,
        state: State,
    ) -> None:
        self.id = id
        self.seq = seq
        self.payload = payload
        self.binary = binary
        self.headers = headers
        self.key = key
        self.priority = priority
        self.published_at = published_at
        self.available_at = available_at
        #: When it last became ready (claimable): its publish, the end of its delay, backoff or
        #: deferral, its lease's deadline, its release. What ``oldest_ready_age`` counts from.
        self.ready_at = published_at
        self.state = state
        self.attempt = 0
        self.deliveries = 0
        self.ticket = 0
        self.lease_id: str | None = None
        self.lease_deadline = 0.0
        self.consumer: str | None = None
        self.history: list[tuple[float, Any]] | None = None

    def __repr__(self) -> str:
        return f"<Message {self.id} seq={self.seq} {self.state.value} attempt={self.attempt}>"


@immutable
class NewMessage:
    """One message of a publish, already validated and encoded by the caller."""

    payload: bytes
    binary: bool = False
    headers: Mapping[str, str] | None = None
    key: str | None = None
    delay: float = 0.0
    priority: int = 0
    #: ``on_duplicate: "replace"``: a ready or delayed message with the same key takes this payload.
    replace: bool = False
    #: ``(queue, message id)`` a moved message (dead-lettered, expired, redriven) came from.
    origin: tuple[str, str] | None = None


#: What publishing one message did (the third item of a ``PublishedRef``). Every value but ``CREATED``
#: is true, so ``all(outcome for ...)`` says "nothing was added".
CREATED = 0
DUPLICATE = 1  # the key was known: answered with the existing message
REPLACED = 2  # the key was known and the message, ready or delayed, took the new payload and headers
CONFLICT = 3  # the key was known, replace was asked, but the message is leased

#: The answer for one published message: ``(id, seq, outcome)``. A plain tuple: the publish path makes
#: one per message, and a NamedTuple's Python-level ``__new__`` costs ten times as much.
PublishedRef = tuple[str, int, int]


#: One message handed to a consumer: the lease facts from the ``Claimed`` record, and the message for
#: what does not change while it is leased (seq, payload, headers, key, priority, published_at).
Delivery = tuple["Claimed", Message]


class MessageView(NamedTuple):
    """A message as browse and get-one show it (a snapshot)."""

    id: str
    seq: int
    state: State
    attempt: int
    #: None for a finished message whose payload was let go (``FinishedHistory.payload_bytes``).
    payload: bytes | None
    binary: bool
    headers: Mapping[str, str] | None
    key: str | None
    priority: int
    published_at: float
    available_at: float | None
    lease_id: str | None
    lease_deadline: float | None
    consumer: str | None
    history: tuple[tuple[float, Any], ...]


@dataclass(frozen=True, slots=True)
class QueueStats:
    """A frozen snapshot of a queue's gauges and counters (§3)."""

    ready: int
    delayed: int
    in_flight: int
    published_total: int
    acked_total: int
    nacked_total: int
    deferred_total: int
    dead_lettered_total: int
    expired_total: int
    lease_expired_total: int
    oldest_ready_age: float | None

    @property
    def depth(self) -> int:
        """Live messages: ready + delayed + in flight (``QueueCore.depth``)."""
        return self.ready + self.delayed + self.in_flight


#: The stats of a queue just made.
NEW_QUEUE_STATS = QueueStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, None)


@dataclass(frozen=True, slots=True)
class ConfigChange:
    """The answer to a config change: the config before it (``None``: it made the queue) and after it,
    and the stats at that moment. A PUT answers with these, never with a read after it, which a DELETE
    or another PUT may have overtaken; and a new push secret is shown only to the change that made it."""

    before: QueueConfig | None
    after: QueueConfig
    stats: QueueStats


@dataclass(frozen=True, slots=True)
class SettleOutcome:
    """The answer to ack, nack, defer or extend: how many were settled and which lease ids were skipped."""

    settled: int
    skipped: tuple[str, ...]
    deadlines: Mapping[str, float] | None = None
    #: Of ``settled``, how many left for the dead-letter queue (or were dropped) instead of returning.
    dead_lettered: int = 0


@dataclass(frozen=True, slots=True)
class ClaimOutcome:
    deliveries: list[Delivery]
    ready: int
    #: Set when the queue's ``rate_limit`` held the claim back: seconds until more may be delivered.
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class RedriveOutcome:
    """The answer to a redrive: how many moved, and which asked-for ids did not, and why."""

    redriven: int
    #: Ids not in the queue (never were, or already gone).
    unknown: tuple[str, ...]
    #: ``(id, reason)`` for messages left in place: ``in_flight``, or ``no_destination`` when neither
    #: ``to`` nor the message's ``x-dead-letter-from`` names an existing queue.
    skipped: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class DeliveryLookup:
    """The answer to a lookup of one delivery of a message (``QueueCore.find_delivery``)."""

    #: The lease of the delivery asked for; None when the message's history holds none.
    lease_id: str | None
    #: The message's attempt now.
    attempt: int


@dataclass(frozen=True, slots=True)
class DeadLetterPage:
    """A page of one origin's dead letters (``QueueCore.browse_dead_letters``)."""

    views: list[MessageView]
    #: The seq the next page starts after; 0 when no live message follows this page.
    after: int


@dataclass(frozen=True, slots=True)
class DeadLetterLookup:
    """The dead letters some ids name (``QueueCore.find_dead_letters``)."""

    #: Each id that names a live dead letter → that dead letter's id (its own, for an id that is one).
    entries: Mapping[str, str]
    #: The ids without an entry that name a message redriven out of this queue, from whichever origin,
    #: while get-one still shows it (``FinishedHistory``).
    redriven: tuple[str, ...]
