"""The broker's one error tree.

Every error a client can cause, or that the broker reports, is a ``BrokerError``. Each class carries the
HTTP status and the snake_case code of the contract (§2); its docstring is the default message. Domain
code raises these; the HTTP layer maps them to responses in exactly one handler::

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
     ├── StorageUnavailable      503 storage_unavailable
     │    ├── DataDirectoryInUse  another broker holds the data directory (storage/store.py)
     │    └── SnapshotFailed  a snapshot could not be made (storage/store.py)
     ├── ShuttingDown            503 shutting_down
     └── InternalError           500 internal_error (a bug in the broker, never client input)
          └── IllegalTransition  a message was asked to make a move its state table forbids
"""

from __future__ import annotations


class BrokerError(Exception):
    """The broker could not do what was asked."""

    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str | None = None) -> None:
        self.message = message or (self.__doc__ or self.code).strip()
        super().__init__(self.message)


#: How much of a value a client sent a refusal or a warning quotes.
QUOTED_CHARS = 80


def quoted(text: str) -> str:
    """``text`` (a value as a message shows it) cut short past ``QUOTED_CHARS``: a client may send
    megabytes where a duration or an id goes, and the answer would carry them back, grown by escaping."""
    return text if len(text) <= QUOTED_CHARS else f"{text[:QUOTED_CHARS]}… ({len(text)} characters)"


def quoted_value(value: object) -> str:
    """A value a client sent, as a refusal quotes it: a string's or a number's ``repr``, cut short
    (``quoted``), else only its kind (``a list``): the ``repr`` of a list nested 1,000 deep raised
    ``RecursionError``, a 500."""
    if value is None or isinstance(value, str | int | float | bool):
        return quoted(repr(value))
    return f"a {type(value).__name__}"


class InvalidRequest(BrokerError):
    """The request is not valid."""

    status = 400
    code = "invalid_request"


class Unauthorized(BrokerError):
    """A valid bearer token is required."""

    status = 401
    code = "unauthorized"


class Forbidden(BrokerError):
    """The token does not allow this."""

    status = 403
    code = "forbidden"


class NotFound(BrokerError):
    """Nothing is there."""

    status = 404
    code = "not_found"


class QueueNotFound(NotFound):
    """The queue does not exist."""

    code = "queue_not_found"


class MessageNotFound(NotFound):
    """The message does not exist in this queue."""

    code = "message_not_found"


class MethodNotAllowed(BrokerError):
    """The route does not take this method."""

    status = 405
    code = "method_not_allowed"


class NotAcceptable(BrokerError):
    """The response cannot be given in any of the accepted media types."""

    status = 406
    code = "not_acceptable"


class RequestTimeout(BrokerError):
    """The request's body did not arrive in time."""

    status = 408
    code = "request_timeout"


class Conflict(BrokerError):
    """The request conflicts with the current state."""

    status = 409
    code = "conflict"


class PayloadTooLarge(BrokerError):
    """The request or one of its messages is larger than the broker accepts."""

    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(BrokerError):
    """The request body must be application/json or application/cbor."""

    status = 415
    code = "unsupported_media_type"


class QueueFull(BrokerError):
    """The queue is at its max_depth; the whole batch was rejected."""

    status = 429
    code = "queue_full"


class RequestHeadersTooLarge(BrokerError):
    """The request line and headers are larger than the broker accepts."""

    status = 431
    code = "request_headers_too_large"


class StorageUnavailable(BrokerError):
    """The broker cannot write its journal right now."""

    status = 503
    code = "storage_unavailable"


class ShuttingDown(BrokerError):
    """The broker is shutting down (a push stream ends, a new one is refused)."""

    status = 503
    code = "shutting_down"


class InternalError(BrokerError):
    """The broker hit a bug."""


class IllegalTransition(InternalError):
    """A message was asked to make a move that its state table forbids."""
