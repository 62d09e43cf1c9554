"""A queue's configuration (§3): defaults, validation of a partial update, and its plain-dict form."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker.core.durations import parse_duration
from broker.errors import InvalidRequest

QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_QUEUE_NAME = 128

#: The dead-letter queue name that means "<queue>.dlq" (resolved against the queue's own name).
DEFAULT_DEAD_LETTER = "<queue>.dlq"


def check_queue_name(name: str, field: str = "queue name") -> str:
    """Return ``name`` if it is a valid queue name (§2), else raise ``InvalidRequest`` naming ``field``."""
    if not QUEUE_NAME.fullmatch(name):
        raise InvalidRequest(f"{field} {name!r} must match ^[A-Za-z0-9][A-Za-z0-9._-]{{0,127}}$")
    return name


@dataclass(frozen=True, slots=True)
class RetryBackoff:
    """Delay for a nack that names none: ``fixed`` = base; ``exponential`` = base·2^(attempt-1)."""

    type: str = "fixed"
    base: float = 0.0
    max: float = 3600.0

    def delay(self, attempt: int) -> float:
        if self.type == "fixed":
            return min(self.base, self.max)
        return min(self.base * 2.0 ** max(attempt - 1, 0), self.max)


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """Everything `PUT /v1/queues/{queue}` can set. Durations are seconds."""

    lease: float = 30.0
    max_attempts: int = 0
    dead_letter: str | None = DEFAULT_DEAD_LETTER
    retry_backoff: RetryBackoff = RetryBackoff()
    max_depth: int = 0
    rate_limit: tuple[int, float] | None = None
    message_ttl: float = 0.0
    claim_window: float = 0.0
    durable: bool = True
    dedup_window: float = 86400.0

    def updated(self, changes: Mapping[str, Any]) -> QueueConfig:
        """A copy with ``changes`` (any subset of the fields, as a client sends them) applied.

        Raises ``InvalidRequest`` naming the first bad field; nothing is half-applied.
        """
        if not isinstance(changes, Mapping):
            raise InvalidRequest("the queue config must be a JSON object")
        parsed: dict[str, Any] = {}
        for field, value in changes.items():
            parser = _FIELD_PARSERS.get(field)
            if parser is None:
                known = ", ".join(_FIELD_PARSERS)
                raise InvalidRequest(f"unknown queue config field {field!r}; known fields: {known}")
            parsed[field] = parser(value)
        return dataclasses.replace(self, **parsed)

    def to_dict(self, queue: str) -> dict[str, Any]:
        """The config as the API shows it, with the default dead-letter name resolved for ``queue``."""
        return {
            "lease": self.lease,
            "max_attempts": self.max_attempts,
            "dead_letter": self.dead_letter_queue(queue),
            "retry_backoff": {
                "type": self.retry_backoff.type,
                "base": self.retry_backoff.base,
                "max": self.retry_backoff.max,
            },
            "max_depth": self.max_depth,
            "rate_limit": (
                None if self.rate_limit is None else {"max": self.rate_limit[0], "per": self.rate_limit[1]}
            ),
            "message_ttl": self.message_ttl,
            "claim_window": self.claim_window,
            "durable": self.durable,
            "dedup_window": self.dedup_window,
        }

    def dead_letter_queue(self, queue: str) -> str | None:
        """Where ``queue`` dead-letters to. The default is ``<queue>.dlq``, with ``queue`` cut short
        when needed to keep the name within 128 characters, and never the queue itself."""
        if self.dead_letter != DEFAULT_DEAD_LETTER:
            return self.dead_letter
        name = f"{queue[: MAX_QUEUE_NAME - 4]}.dlq"
        if name == queue:  # a 128-character name ending in ".dlq" would be its own dead-letter queue
            mark = "_" if queue[MAX_QUEUE_NAME - 5] != "_" else "-"
            name = f"{queue[: MAX_QUEUE_NAME - 5]}{mark}.dlq"
        return name


def _int(field: str, low: int, high: int) -> Any:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidRequest(f"{field} must be an integer between {low} and {high}")
        return value

    return parse


def _duration(field: str, low: float, high: float) -> Any:
    return lambda value: parse_duration(value, field, low=low, high=high)


def _bool(field: str) -> Any:
    def parse(value: Any) -> bool:
        if not isinstance(value, bool):
            raise InvalidRequest(f"{field} must be true or false")
        return value

    return parse


def _dead_letter(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest("dead_letter must be a queue name or null")
    return check_queue_name(value, "dead_letter")


def _retry_backoff(value: Any) -> RetryBackoff:
    if not isinstance(value, Mapping):
        raise InvalidRequest('retry_backoff must be an object like {"type": "fixed", "base": 0}')
    unknown = set(value) - {"type", "base", "max"}
    if unknown:
        raise InvalidRequest(f"unknown retry_backoff field(s): {', '.join(sorted(unknown))}")
    kind = value.get("type", "fixed")
    if kind not in ("fixed", "exponential"):
        raise InvalidRequest("retry_backoff.type must be 'fixed' or 'exponential'")
    base = parse_duration(value.get("base", 0), "retry_backoff.base", high=604800)
    cap = parse_duration(value.get("max", 3600), "retry_backoff.max", high=604800)
    return RetryBackoff(kind, base, cap)


def _rate_limit(value: Any) -> tuple[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"max", "per"}:
        raise InvalidRequest('rate_limit must be null or {"max": N, "per": seconds}')
    count = _int("rate_limit.max", 1, 1_000_000_000)(value["max"])
    per = parse_duration(value["per"], "rate_limit.per", low=0.001, high=86400)
    return (count, per)


_FIELD_PARSERS: dict[str, Any] = {
    "lease": _duration("lease", 0.1, 43200),
    "max_attempts": _int("max_attempts", 0, 1_000_000),
    "dead_letter": _dead_letter,
    "retry_backoff": _retry_backoff,
    "max_depth": _int("max_depth", 0, 1_000_000_000),
    "rate_limit": _rate_limit,
    "message_ttl": _duration("message_ttl", 0, 31_536_000),
    "claim_window": _duration("claim_window", 0, 5),
    "durable": _bool("durable"),
    "dedup_window": _duration("dedup_window", 0, 31_536_000),
}
