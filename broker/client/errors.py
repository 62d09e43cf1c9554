"""The client's error tree: one exception class per error code of the contract (§2).

Every error answer of the broker becomes a ``BrokerError`` carrying the answer's ``code``, ``message``
and HTTP ``status``; catch the base class, or a precise one::

    BrokerError
     ├── InvalidRequest          400 invalid_request
     ├── Unauthorized            401 unauthorized
     ├── Forbidden               403 forbidden
     ├── NotFound                404 not_found (no such route)
     │    ├── QueueNotFound      404 queue_not_found
     │    └── MessageNotFound    404 message_not_found
     ├── MethodNotAllowed        405 method_not_allowed
     ├── NotAcceptable           406 not_acceptable
     ├── RequestTimeout          408 request_timeout
     ├── Conflict                409 conflict
     ├── PayloadTooLarge         413 payload_too_large
     ├── UnsupportedMediaType    415 unsupported_media_type
     ├── QueueFull               429 queue_full
     ├── RequestHeadersTooLarge  431 request_headers_too_large
     ├── InternalError           500 internal_error
     ├── StorageUnavailable      503 storage_unavailable
     └── ShuttingDown            503 shutting_down (a work stream ended by a broker going down)

Network failures are not broker answers: they are httpx's ``TransportError`` (connect errors, timeouts).
This module imports nothing of the server: the client can be copied or installed on its own.
"""

from __future__ import annotations

from typing import Any


class BrokerError(Exception):
    """The broker answered with an error."""

    code: str = "unknown_error"
    status: int = 0
    #: Whether the answer had the contract's error body (§2, ``{"error": {"code", "message"}}``).
    #: False: an answer without it, e.g. from another server at the broker's address (the CLI's
    #: ``bad_answer``); the class then comes from the status alone.
    well_formed: bool = True

    def __init__(self, message: str | None = None, *, code: str | None = None, status: int | None = None):
        self.message = message or (type(self).__doc__ or "").strip() or self.code
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        super().__init__(self.message)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, status={self.status}, message={self.message!r})"


class InvalidRequest(BrokerError):
    """The request is not valid."""

    code, status = "invalid_request", 400


class Unauthorized(BrokerError):
    """A valid bearer token is required."""

    code, status = "unauthorized", 401


class Forbidden(BrokerError):
    """The token does not allow this."""

    code, status = "forbidden", 403


class NotFound(BrokerError):
    """Nothing is there."""

    code, status = "not_found", 404


class QueueNotFound(NotFound):
    """The queue does not exist."""

    code = "queue_not_found"


class MessageNotFound(NotFound):
    """The message does not exist in this queue."""

    code = "message_not_found"


class MethodNotAllowed(BrokerError):
    """The route does not take this method."""

    code, status = "method_not_allowed", 405


class NotAcceptable(BrokerError):
    """The broker cannot answer in the accepted media type."""

    code, status = "not_acceptable", 406


class RequestTimeout(BrokerError):
    """The request's body did not arrive in time."""

    code, status = "request_timeout", 408


class Conflict(BrokerError):
    """The request conflicts with the current state."""

    code, status = "conflict", 409


class PayloadTooLarge(BrokerError):
    """The request or one of its messages is too large."""

    code, status = "payload_too_large", 413


class UnsupportedMediaType(BrokerError):
    """The request body must be JSON or CBOR."""

    code, status = "unsupported_media_type", 415


class QueueFull(BrokerError):
    """The queue is at its max_depth; the whole batch was rejected."""

    code, status = "queue_full", 429


class RequestHeadersTooLarge(BrokerError):
    """The request line and headers are larger than the broker accepts."""

    code, status = "request_headers_too_large", 431


class InternalError(BrokerError):
    """The broker hit a bug."""

    code, status = "internal_error", 500


class StorageUnavailable(BrokerError):
    """The broker cannot write its journal right now; retry later."""

    code, status = "storage_unavailable", 503


class ShuttingDown(BrokerError):
    """The broker is shutting down."""

    code, status = "shutting_down", 503


ERRORS_BY_CODE: dict[str, type[BrokerError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        QueueNotFound,
        MessageNotFound,
        MethodNotAllowed,
        NotAcceptable,
        RequestTimeout,
        Conflict,
        PayloadTooLarge,
        UnsupportedMediaType,
        QueueFull,
        RequestHeadersTooLarge,
        InternalError,
        StorageUnavailable,
        ShuttingDown,
    )
}
_BY_STATUS = {cls.status: cls for cls in reversed(list(ERRORS_BY_CODE.values()))}


def error_from(status: int | None, body: Any) -> BrokerError:
    """The exception for an error answer: by its ``code``, else by its status, else the base class.
    ``None`` for an error with no HTTP status of its own (a stream's ``error`` event): it takes its
    class's."""
    code = message = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        message = body["error"].get("message")
    well_formed = isinstance(code, str) and bool(code) and isinstance(message, str)
    if not isinstance(code, str):
        code = None
    cls = ERRORS_BY_CODE.get(code or "") or (status is not None and _BY_STATUS.get(status)) or BrokerError
    error = cls(message if isinstance(message, str) else None, code=code or None, status=status)
    if not well_formed:
        error.well_formed = False
    return error
