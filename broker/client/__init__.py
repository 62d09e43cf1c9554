"""The broker's Python client (§11): ``Client`` (blocking) and ``AsyncClient`` (trio or asyncio).

    from broker.client import Client

    with Client("http://127.0.0.1:8080") as broker:
        broker.create_queue("emails", lease=30)
        broker.publish("emails", {"to": "ada@example.com"})
        for delivery in broker.claim("emails", max=10):
            send(delivery.payload)
            broker.ack("emails", delivery)

A worker that is pushed messages and settles them itself (see docs/workers.md)::

    def handle(delivery):
        send(delivery.payload)          # return: ack; raise Defer(30) / Reject() / anything: see Worker

    Client().work("emails", handle, concurrency=8)

Errors are ``BrokerError`` subclasses, one per error code of the contract (``errors.py``).
"""

from broker.client.client import AsyncClient, Client
from broker.client.errors import (
    BrokerError,
    Conflict,
    Forbidden,
    InternalError,
    InvalidRequest,
    MessageNotFound,
    MethodNotAllowed,
    NotAcceptable,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    QueueNotFound,
    RequestHeadersTooLarge,
    RequestTimeout,
    ShuttingDown,
    StorageUnavailable,
    Unauthorized,
    UnsupportedMediaType,
)
from broker.client.models import (
    ClaimResult,
    Defer,
    Delivery,
    Message,
    Published,
    Reject,
    Retry,
    Settled,
    WorkerStats,
)

__all__ = [
    "AsyncClient",
    "BrokerError",
    "ClaimResult",
    "Client",
    "Conflict",
    "Defer",
    "Delivery",
    "Forbidden",
    "InternalError",
    "InvalidRequest",
    "Message",
    "MessageNotFound",
    "MethodNotAllowed",
    "NotAcceptable",
    "NotFound",
    "PayloadTooLarge",
    "Published",
    "QueueFull",
    "QueueNotFound",
    "Reject",
    "RequestHeadersTooLarge",
    "RequestTimeout",
    "Retry",
    "Settled",
    "ShuttingDown",
    "StorageUnavailable",
    "Unauthorized",
    "UnsupportedMediaType",
    "WorkerStats",
]
