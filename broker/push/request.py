"""What one push sends and what its answer means: the envelope, the signature, and the outcome.

Pure functions (the time is passed in), so the exact scheme docs/push.md promises is tested directly.

Signature scheme (version ``v1``): the request carries ``x-broker-timestamp: <unix seconds, an
integer>`` and ``x-broker-signature: sha256=<hex>``, where ``<hex>`` is the lowercase hex
HMAC-SHA256, keyed with the queue's secret (its UTF-8 bytes), of the timestamp's decimal digits, one
``.``, and the raw request body: ``HMAC(secret, f"{timestamp}.".encode() + body)``.

A queue whose ``push.format`` is ``simpleq`` (made through ``/compat/simpleq``, docs/compat.md) is pushed
in SimpleQ's shape instead: its delivery envelope ``{"id", "queue", "payload", "attempt",
"maxAttempts", "createdAt"}`` and ``x-simpleq-signature: sha256=<hex>``, the lowercase hex
HMAC-SHA256 keyed with the secret of the raw body alone, so SimpleQ receivers verify it unchanged.
"""

from __future__ import annotations

import base64
import email.utils
import enum
import hashlib
import hmac
import math
from dataclasses import dataclass
from typing import Any

import orjson

from broker.clock import format_time
from broker.core.config import PushConfig
from broker.core.model import Delivery

SIGNATURE_HEADER = "x-broker-signature"
TIMESTAMP_HEADER = "x-broker-timestamp"
SIMPLEQ_SIGNATURE_HEADER = "x-simpleq-signature"

#: Hold for a 429/503/529 that names no (readable) Retry-After, in seconds.
DEFAULT_RETRY_AFTER = 60.0
#: The longest defer the core takes (§5).
MAX_RETRY_AFTER = 86400.0
#: The shortest hold for a 429/503/529: a defer spends no attempt, so ``Retry-After: 0`` (or a date a
#: lagging clock puts in the past) would otherwise push the message again at once, for ever.
MIN_RETRY_AFTER = 1.0


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The ``x-broker-signature`` value for ``body`` sent at ``timestamp`` (Unix seconds)."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify(secret: str, timestamp: str, body: bytes, signature: str) -> bool:
    """What a receiver does (docs/push.md has the same in Python and Node): constant-time compare."""
    try:
        expected = sign(secret, int(timestamp), body)
    except ValueError:
        return False
    return hmac.compare_digest(expected.encode(), signature.encode())


def envelope(queue: str, delivery: Delivery, max_attempts: int) -> bytes:
    """The JSON body of a push: ``{"id", "queue", "payload", "attempt", "lease_id", "max_attempts",
    "published_at", "headers"}``. A JSON payload is embedded as stored; bytes as base64, with
    ``"payload_encoding": "base64"`` (§2)."""
    claimed, message = delivery
    body: dict[str, Any] = {
        "id": claimed.id,
        "queue": queue,
        "payload": None,
        "attempt": claimed.attempt,
        "lease_id": claimed.lease_id,
        "max_attempts": max_attempts,
        "published_at": format_time(message.published_at),
        "headers": dict(message.headers or {}),
    }
    if message.binary:
        body["payload"] = base64.b64encode(message.payload).decode()
        body["payload_encoding"] = "base64"
    else:
        body["payload"] = orjson.Fragment(message.payload)
    return orjson.dumps(body)


def headers(secret: str, now: float, body: bytes, message_id: str, attempt: int) -> dict[str, str]:
    """Every header of a push request made at ``now`` (Unix seconds)."""
    sent_at = math.floor(now)
    return {
        "content-type": "application/json",
        "user-agent": "broker-push/1",
        TIMESTAMP_HEADER: str(sent_at),
        SIGNATURE_HEADER: sign(secret, sent_at, body),
        "x-broker-message-id": message_id,
        "x-broker-attempt": str(attempt),
    }


def simpleq_sign(secret: str, body: bytes) -> str:
    """The ``x-simpleq-signature`` value for ``body``: no timestamp, the raw body alone."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def simpleq_envelope(queue: str, delivery: Delivery, max_attempts: int) -> bytes:
    """SimpleQ's delivery envelope, field for field: ``{"id", "queue", "payload", "attempt",
    "maxAttempts", "createdAt"}``. A byte payload (published natively) goes as base64 text, with
    ``"payloadEncoding": "base64"``: SimpleQ itself has only JSON payloads."""
    claimed, message = delivery
    body: dict[str, Any] = {
        "id": claimed.id,
        "queue": queue,
        "payload": None,
        "attempt": claimed.attempt,
        "maxAttempts": max_attempts,
        "createdAt": format_time(message.published_at),
    }
    if message.binary:
        body["payload"] = base64.b64encode(message.payload).decode()
        body["payloadEncoding"] = "base64"
    else:
        body["payload"] = orjson.Fragment(message.payload)
    return orjson.dumps(body)


def build(
    queue: str, config: PushConfig, delivery: Delivery, max_attempts: int, now: float
) -> tuple[bytes, dict[str, str]]:
    """The body and headers of the push of ``delivery`` made at ``now`` (Unix seconds): what the
    dispatcher sends, in the queue's push format."""
    claimed, _ = delivery
    if config.format == "simpleq":
        body = simpleq_envelope(queue, delivery, max_attempts)
        return body, {
            "content-type": "application/json",
            "user-agent": "broker-push/1",
            SIMPLEQ_SIGNATURE_HEADER: simpleq_sign(config.secret, body),
        }
    body = envelope(queue, delivery, max_attempts)
    return body, headers(config.secret, now, body, claimed.id, claimed.attempt)


class Outcome(enum.Enum):
    """What the receiver's answer means for the message."""

    DONE = "done"  # 2xx: acked (standard) or awaiting its callback (ack mode)
    DEFER = "defer"  # 429, 503, 529: backpressure, no attempt spent
    REFUSED = "refused"  # 401, 403: the push config is wrong; the queue's push pauses
    FAILED = "failed"  # anything else, a timeout, or no connection: a failed attempt


BACKPRESSURE = frozenset({429, 503, 529})
REFUSAL = frozenset({401, 403})


def outcome_of(status: int | None) -> Outcome:
    """The outcome of an answer with ``status`` (``None``: no answer, a timeout or connection error)."""
    if status is None:
        return Outcome.FAILED
    if 200 <= status < 300:
        return Outcome.DONE
    if status in BACKPRESSURE:
        return Outcome.DEFER
    if status in REFUSAL:
        return Outcome.REFUSED
    return Outcome.FAILED


@dataclass(frozen=True, slots=True)
class Attempt:
    """One push as the history shows it. ``lease_id`` is the delivery it pushed: the key that pairs it
    with the claim in the message's own history (a push in progress has no entry yet, so pairing by
    position would shift). Left out of ``to_dict``: the native history's answer stays as docs/push.md
    shows it."""

    at: float
    attempt: int
    status: int | None
    error: str | None
    duration: float
    outcome: str
    lease_id: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": format_time(self.at),
            "attempt": self.attempt,
            "status": self.status,
            "error": self.error,
            "duration": round(self.duration, 6),
            "outcome": self.outcome,
        }


def retry_after(value: str | None, now: float) -> float:
    """Seconds to hold a deferred message: ``Retry-After`` as delta-seconds or an HTTP date (relative to
    ``now``, Unix seconds), clamped to 1 … 86400; 60 when absent or unreadable."""
    if value is None:
        return DEFAULT_RETRY_AFTER
    text = value.strip()
    seconds: float
    if text.isascii() and text.isdigit():  # str.isdigit alone takes "²", which float() refuses
        seconds = float(text)
    else:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return DEFAULT_RETRY_AFTER
        if when.tzinfo is None:  # RFC 9110 dates are GMT
            return DEFAULT_RETRY_AFTER
        seconds = when.timestamp() - now
    return min(max(seconds, MIN_RETRY_AFTER), MAX_RETRY_AFTER)
