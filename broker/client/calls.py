"""Each API call as data: method, path, body or query, and how to read the answer.

``Client`` and ``AsyncClient`` both send these, so every call's shape exists once, independent of
how it is sent (``wire.Wire``, or an httpx client).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from broker.client import durations
from broker.client.models import ClaimResult, Delivery, Message, Published, Settled, message_body

T = TypeVar("T")

#: What the settle calls take: lease ids, deliveries, or a mix.
Leases = str | Delivery | Iterable[str | Delivery]


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    method: str
    path: str
    read: Callable[[Any], T]
    json: Any = None
    params: Mapping[str, str] | None = None
    #: Longest the server may take on purpose (a long poll's wait), added to the client's read timeout.
    wait: float = 0.0
    #: ``read`` is given ``(status, data)`` rather than the data alone, where the status says more.
    read_status: bool = False


def queue_path(queue: str) -> str:
    return "/v1/queues/" + quote(queue, safe="")


def lease_ids(leases: Leases) -> list[str]:
    if isinstance(leases, str | Delivery):
        leases = [leases]
    return [lease.lease_id if isinstance(lease, Delivery) else lease for lease in leases]


def _none(_: Any) -> None:
    return None


def _same(data: Any) -> Any:
    return data


def put_queue(name: str, config: Mapping[str, Any]) -> Call[tuple[bool, dict[str, Any]]]:
    """Whether the PUT created the queue (201, not 200), and its description."""
    return Call(
        "PUT",
        queue_path(name),
        lambda answer: (answer[0] == 201, answer[1]),
        json=dict(config),
        read_status=True,
    )


def get_queue(name: str) -> Call[dict[str, Any]]:
    return Call("GET", queue_path(name), _same)


def list_queues() -> Call[list[dict[str, Any]]]:
    return Call("GET", "/v1/queues", lambda data: list(data["queues"]))


def delete_queue(name: str) -> Call[None]:
    return Call("DELETE", queue_path(name), _none)


def purge(name: str) -> Call[int]:
    return Call("POST", queue_path(name) + "/purge", lambda data: int(data["purged"]))


def _published(data: Any) -> list[Published]:
    return [Published(m["id"], m["seq"], m["duplicate"], m.get("replaced", False)) for m in data["messages"]]


def publish(queue: str, body: dict[str, Any]) -> Call[Published]:
    return Call("POST", queue_path(queue) + "/messages", lambda data: _published(data)[0], json=body)


def publish_batch(queue: str, messages: Iterable[Message | Mapping[str, Any] | Any]) -> Call[list[Published]]:
    bodies = []
    for message in messages:
        if type(message) is dict and len(message) == 1 and "payload" in message:  # the usual case
            payload = message["payload"]
            # Sent as given unless its payload is bytes (base64 then): it is only read, to encode it.
            bodies.append(
                message_body(payload) if isinstance(payload, bytes | bytearray | memoryview) else message
            )
        elif isinstance(message, Message):
            bodies.append(message.to_json())
        elif isinstance(message, Mapping) and "payload" in message:
            bodies.append(_mapping_body(message))
        else:
            raise TypeError("publish_batch takes Message objects or dicts with a 'payload'")
    return Call("POST", queue_path(queue) + "/messages", _published, json={"messages": bodies})


#: The fields of the API's message object (docs/api.md, Publishing): what a dict given to
#: ``publish_batch`` may hold.
MESSAGE_FIELDS = ("payload", "payload_encoding", "headers", "key", "on_duplicate", "delay", "priority")


def _mapping_body(message: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON of a message given as a mapping in the API's shape: its fields sent as given (``None``
    as absent), a bytes payload as base64, headers as a plain dict. A field the API does not have is a
    ``TypeError`` naming it, before anything is sent."""
    unknown = [name for name in message if name not in MESSAGE_FIELDS]
    if unknown:
        raise TypeError(
            f"publish_batch: a message has no field {unknown[0]!r} (its fields: {', '.join(MESSAGE_FIELDS)})"
        )
    payload = message["payload"]
    body = message_body(
        payload,
        message.get("headers"),
        message.get("key"),
        message.get("delay"),
        message.get("priority"),
        message.get("on_duplicate"),
    )
    encoding = message.get("payload_encoding")
    if encoding is not None:
        if isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError(
                "publish_batch: a bytes payload is sent as base64 by the client: give it no payload_encoding"
            )
        body["payload_encoding"] = encoding
    return body


def _claimed(data: Any) -> ClaimResult:
    return ClaimResult(
        [Delivery.from_json(m) for m in data["messages"]], data["ready"], data.get("retry_after")
    )


def claim(
    queue: str, consumer: str | None, max_count: int, lease: float | str | None, wait: float | str | None
) -> Call[ClaimResult]:
    body: dict[str, Any] = {"max": max_count}
    if consumer is not None:
        body["consumer"] = consumer
    if lease is not None:
        body["lease"] = lease
    if wait:
        body["wait"] = wait  # as given: the broker reads it, and refuses what is no duration
        return Call("POST", queue_path(queue) + "/claim", _claimed, json=body, wait=_wait_seconds(wait))
    return Call("POST", queue_path(queue) + "/claim", _claimed, json=body)


def _wait_seconds(wait: float | str) -> float:
    """How long a claim's ``wait`` lets the broker take on purpose, added to the read timeout: 0 for a
    value that is no duration (the broker answers it 400 at once)."""
    try:
        return max(durations.seconds(wait), 0.0)
    except (TypeError, ValueError):
        return 0.0


def _settled(verb: str) -> Callable[[Any], Settled]:
    def read(data: Any) -> Settled:
        return Settled(data[verb], list(data["skipped"]), data.get("dead_lettered", 0), data.get("deadlines"))

    return read


def ack(queue: str, leases: Leases) -> Call[Settled]:
    return Call("POST", queue_path(queue) + "/ack", _settled("acked"), json={"leases": lease_ids(leases)})


def nack(
    queue: str, leases: Leases, delay: float | str | None, retryable: bool, reason: str | None
) -> Call[Settled]:
    body: dict[str, Any] = {"leases": lease_ids(leases)}
    if delay is not None:
        body["delay"] = delay
    if not retryable:
        body["retryable"] = False
    if reason is not None:
        body["reason"] = reason
    return Call("POST", queue_path(queue) + "/nack", _settled("nacked"), json=body)


def defer(queue: str, leases: Leases, retry_after: float | str, reason: str | None) -> Call[Settled]:
    body: dict[str, Any] = {"leases": lease_ids(leases), "retry_after": retry_after}
    if reason is not None:
        body["reason"] = reason
    return Call("POST", queue_path(queue) + "/defer", _settled("deferred"), json=body)


def extend(queue: str, leases: Leases, lease: float | str) -> Call[Settled]:
    body = {"leases": lease_ids(leases), "lease": lease}
    return Call("POST", queue_path(queue) + "/extend", _settled("extended"), json=body)


def stop_stream(queue: str, stream_id: str) -> Call[int]:
    """Stop a ``/work`` stream taking new deliveries: the number of leases it still holds."""
    path = f"{queue_path(queue)}/work/{quote(stream_id, safe='')}/stop"
    return Call("POST", path, lambda data: int(data["held"]), json={})


def browse(queue: str, state: str, limit: int, after: int) -> Call[list[dict[str, Any]]]:
    params = {"state": state, "limit": str(limit), "after": str(after)}
    return Call("GET", queue_path(queue) + "/messages", lambda data: list(data["messages"]), params=params)


def get_message(queue: str, message_id: str) -> Call[dict[str, Any]]:
    return Call("GET", f"{queue_path(queue)}/messages/{quote(message_id, safe='')}", _same)


def delete_message(queue: str, message_id: str) -> Call[None]:
    return Call("DELETE", f"{queue_path(queue)}/messages/{quote(message_id, safe='')}", _none)


def redrive(queue: str, ids: Iterable[str] | None, to: str | None) -> Call[dict[str, Any]]:
    body: dict[str, Any] = {"all": True} if ids is None else {"ids": list(ids)}
    if to is not None:
        body["to"] = to
    return Call("POST", queue_path(queue) + "/redrive", _same, json=body)
