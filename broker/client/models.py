"""What the client hands back: deliveries, publish and settle answers, and the handler outcomes."""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

_new_tuple = tuple.__new__

#: The headers of a delivery that has none: empty and read-only (a default shared by every such one).
NO_HEADERS: Mapping[str, str] = MappingProxyType({})


class Delivery(NamedTuple):
    """A message leased to this consumer (§5): settle it with its ``lease_id``. Bytes payloads (sent
    base64 in JSON) arrive as ``bytes``.

    A named tuple, so immutable: a consumer makes one per message it claims, and a tuple is made in C
    (a frozen dataclass took ~5 µs of the client's ~16 µs per claimed and acked message)."""

    id: str
    seq: int
    lease_id: str
    lease_deadline: str
    attempt: int
    payload: Any
    headers: Mapping[str, str] = NO_HEADERS
    key: str | None = None
    priority: int = 0
    published_at: str = ""

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Delivery:
        payload = data.get("payload")
        if data.get("payload_encoding") == "base64" and isinstance(payload, str):
            payload = base64.b64decode(payload)
        # ``tuple.__new__`` (what ``_make`` calls) skips the named tuple's ``__new__``, a Python frame.
        return _new_tuple(
            cls,
            (
                data["id"],
                data["seq"],
                data["lease_id"],
                data["lease_deadline"],
                data["attempt"],
                payload,
                data.get("headers") or NO_HEADERS,
                data.get("key"),
                data.get("priority", 0),
                data.get("published_at", ""),
            ),
        )


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """A claim's answer: iterate it (or read ``messages``) for the deliveries."""

    messages: list[Delivery]
    ready: int
    retry_after: float | None = None

    def __iter__(self) -> Iterator[Delivery]:
        return iter(self.messages)

    def __len__(self) -> int:
        return len(self.messages)


class Published(NamedTuple):
    """One message of a publish answer, a named tuple as ``Delivery`` is (one per message published)."""

    id: str
    seq: int
    duplicate: bool
    replaced: bool = False


@dataclass(frozen=True, slots=True)
class Settled:
    """An ack, nack, defer or extend answer: how many leases it settled and which it skipped (stale or
    unknown); ``dead_lettered`` for a nack, ``deadlines`` for an extend."""

    count: int
    skipped: list[str]
    dead_lettered: int = 0
    deadlines: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a batch publish (a plain dict with the same fields works too)."""

    payload: Any
    headers: Mapping[str, str] | None = None
    key: str | None = None
    delay: float | str | None = None
    priority: int | None = None
    on_duplicate: str | None = None

    def to_json(self) -> dict[str, Any]:
        return message_body(
            self.payload, self.headers, self.key, self.delay, self.priority, self.on_duplicate
        )


def message_body(
    payload: Any,
    headers: Mapping[str, str] | None = None,
    key: str | None = None,
    delay: float | str | None = None,
    priority: int | None = None,
    on_duplicate: str | None = None,
) -> dict[str, Any]:
    """The JSON of one message (§4); bytes go as base64 with ``"payload_encoding": "base64"``."""
    body: dict[str, Any]
    if isinstance(payload, bytes | bytearray | memoryview):
        body = {"payload": base64.b64encode(bytes(payload)).decode(), "payload_encoding": "base64"}
    else:
        body = {"payload": payload}
    if headers:
        body["headers"] = dict(headers)
    if key is not None:
        body["key"] = key
    if delay is not None:
        body["delay"] = delay
    if priority is not None:
        body["priority"] = priority
    if on_duplicate is not None:
        body["on_duplicate"] = on_duplicate
    return body


# -- handler outcomes (the worker loop) -------------------------------------------------------------


class Defer(Exception):
    """Raise from a handler to give the message back for ``retry_after`` seconds without spending an
    attempt (the broker was busy, a rate limit was hit: backpressure, not failure)."""

    def __init__(self, retry_after: float = 0.0, reason: str | None = None) -> None:
        super().__init__(reason or f"deferred for {retry_after:g} s")
        self.retry_after = retry_after
        self.reason = reason


class Retry(Exception):
    """Raise from a handler to nack the message: tried again after ``delay`` seconds (default: the
    queue's ``retry_backoff``). Any other exception does the same with the queue's backoff."""

    def __init__(self, delay: float | None = None, reason: str | None = None) -> None:
        super().__init__(reason or "retry")
        self.delay = delay
        self.reason = reason


class Reject(Exception):
    """Raise from a handler when retrying cannot help: the message is dead-lettered at once
    (a nack with ``retryable: false``)."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason or "rejected")
        self.reason = reason


@dataclass(slots=True)
class WorkerStats:
    """What a worker loop did: returned by ``work`` when it stops."""

    delivered: int = 0
    acked: int = 0
    nacked: int = 0
    deferred: int = 0
    rejected: int = 0
    #: Messages given back unhandled when the worker stopped (deferred for 0 s: no attempt spent).
    given_back: int = 0
    #: Messages whose settle the broker refused as invalid (400, 413): logged, left to lease expiry.
    refused: int = 0
    extended: int = 0
    #: Settles and extends the broker skipped: the lease had expired and the message was redelivered.
    skipped: int = 0
    #: ``"stream"`` (SSE push) or ``"poll"`` (long-poll claims, when the broker has no /work route).
    mode: str = "stream"
    #: Streams opened again after one ended, or (polling) claims tried again after a failure.
    reconnects: int = 0
