"""Answers: replies → plain values for JSON or CBOR, and those → a body (``encode``); errors → their
answer, through the one mapping (``error_answer``, §2), which every layer uses for every error.

Payloads are embedded as stored: JSON text goes into the JSON response as an ``orjson.Fragment`` (never
parsed again); bytes become base64 in JSON (with ``"payload_encoding": "base64"``) and stay bytes in CBOR.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson
import structlog
from hypercorn.typing import ASGISendCallable, HTTPScope
from werkzeug.exceptions import HTTPException

from broker.clock import format_time
from broker.core import ClaimOutcome, MessageView, QueueConfig, QueueStats, SettleOutcome
from broker.core.model import CREATED, DUPLICATE, REPLACED, Delivery, Message, PublishedRef, RedriveOutcome
from broker.core.records import HISTORY_ONLY_TYPES, RECORD_TYPES, Claimed, HistoryOmitted
from broker.errors import (
    BrokerError,
    InvalidRequest,
    MethodNotAllowed,
    NotAcceptable,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)
from broker.http import parse
from broker.http.paths import COMPAT_PREFIX
from broker.storage.codec import cbor_array_head, cbor_dumps, cbor_map_head, cbor_text, json_loads

log = structlog.get_logger("broker.http")


def encode(data: Any, cbor: bool) -> tuple[bytes, str]:
    """The response body and its media type: CBOR when the client accepts it, else JSON."""
    if cbor:
        return cbor_dumps(data), parse.CBOR
    return orjson.dumps(data), parse.JSON


def encode_listing(key: str, items: Sequence[bytes], cbor: bool) -> tuple[bytes, str]:
    """``encode({key: [...]}, cbor)`` of items each already encoded alone (by ``encode``): a listing of
    tens of thousands then never holds them all as objects, which the garbage collector would walk
    (and promote) while it is built."""
    if cbor:
        return cbor_map_head(1) + cbor_text(key) + cbor_array_head(len(items)) + b"".join(items), parse.CBOR
    return b'{"%s":[%s]}' % (key.encode(), b",".join(items)), parse.JSON


def _put_payload(out: dict[str, Any], payload: bytes, binary: bool, cbor: bool) -> None:
    if binary:
        if cbor:
            out["payload"] = payload
        else:
            out["payload"] = base64.b64encode(payload).decode()
            out["payload_encoding"] = "base64"
    elif cbor:
        out["payload"] = json_loads(payload)
    else:
        out["payload"] = orjson.Fragment(payload)


def deliveries(outcome: ClaimOutcome, cbor: bool) -> dict[str, Any]:
    rendered = delivery_list(outcome.deliveries, cbor)
    if outcome.retry_after is None:
        return {"messages": rendered, "ready": outcome.ready}
    return {"messages": rendered, "ready": outcome.ready, "retry_after": round(outcome.retry_after, 3)}


def delivery_list(items: Iterable[Delivery], cbor: bool) -> list[dict[str, Any]]:
    """Deliveries as an answer or a push stream shows them, in order."""
    rendered = []
    deadline, deadline_text = None, ""
    for claimed, message in items:
        if claimed.deadline != deadline:  # one claim gives every delivery the same deadline
            deadline, deadline_text = claimed.deadline, format_time(claimed.deadline)
        rendered.append(_delivery(claimed, message, deadline_text, cbor))
    return rendered


def _delivery(claimed: Claimed, message: Message, deadline: str, cbor: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": claimed.id,
        "seq": message.seq,
        "lease_id": claimed.lease_id,
        "lease_deadline": deadline,
        "attempt": claimed.attempt,
        "headers": message.headers or {},
        "key": message.key,
        "priority": message.priority,
        "published_at": format_time(message.published_at),
    }
    if cbor or message.binary:
        _put_payload(out, message.payload, message.binary, cbor)
    else:
        out["payload"] = orjson.Fragment(message.payload)
    return out


def published(refs: list[PublishedRef]) -> dict[str, Any]:
    return {"messages": [_published_one(id, seq, outcome) for id, seq, outcome in refs]}


def _published_one(id: str, seq: int, outcome: int) -> dict[str, Any]:
    if outcome == CREATED:
        return {"id": id, "seq": seq, "duplicate": False}
    if outcome == DUPLICATE:
        return {"id": id, "seq": seq, "duplicate": True}
    if outcome == REPLACED:
        return {"id": id, "seq": seq, "duplicate": True, "replaced": True}
    return {"id": id, "seq": seq, "duplicate": True, "error": conflict_error(id)["error"]}


def conflict_error(message_id: str) -> Mapping[str, Any]:
    """The answer for a replace that found its message leased (§4)."""
    return error_body(
        "conflict", f"message {message_id} has the same key but is leased; it cannot be replaced now"
    )


def settled(outcome: SettleOutcome, verb: str) -> dict[str, Any]:
    out: dict[str, Any] = {verb: outcome.settled}
    if verb == "nacked":
        out["dead_lettered"] = outcome.dead_lettered
    out["skipped"] = list(outcome.skipped)
    if outcome.deadlines is not None:
        out["deadlines"] = {lease: format_time(at) for lease, at in outcome.deadlines.items()}
    return out


def stats(value: QueueStats) -> dict[str, Any]:
    return {
        "ready": value.ready,
        "delayed": value.delayed,
        "in_flight": value.in_flight,
        "published_total": value.published_total,
        "acked_total": value.acked_total,
        "nacked_total": value.nacked_total,
        "deferred_total": value.deferred_total,
        "dead_lettered_total": value.dead_lettered_total,
        "expired_total": value.expired_total,
        "lease_expired_total": value.lease_expired_total,
        "oldest_ready_age": value.oldest_ready_age,
    }


def queue(name: str, config: QueueConfig, queue_stats: QueueStats) -> dict[str, Any]:
    return {"name": name, "config": config.to_dict(name), "stats": stats(queue_stats)}


def redriven(outcome: RedriveOutcome) -> dict[str, Any]:
    return {
        "redriven": outcome.redriven,
        "unknown": list(outcome.unknown),
        "skipped": [{"id": id, "reason": reason} for id, reason in outcome.skipped],
    }


# Which record fields the history of a message shows, and how.
_HISTORY_FIELDS = ("lease_id", "consumer", "attempt", "delay", "retry_after", "reason", "to", "refunded")


def history_entry(at: float, record: Any) -> dict[str, Any]:
    if type(record) is HistoryOmitted:  # the entries dropped past MAX_HISTORY, counted (docs/api.md)
        return {"event": HISTORY_ONLY_TYPES[HistoryOmitted], "at": format_time(at), "count": record.count}
    out: dict[str, Any] = {"event": RECORD_TYPES[type(record)], "at": format_time(at)}
    for field in _HISTORY_FIELDS:
        value = getattr(record, field, None)
        if value is not None:
            out[field] = value
    deadline = getattr(record, "deadline", None)
    if deadline is not None:
        out["lease_deadline"] = format_time(deadline)
    return out


def message_view(view: MessageView, cbor: bool, *, with_history: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": view.id,
        "seq": view.seq,
        "state": view.state.value,
        "attempt": view.attempt,
        "headers": view.headers or {},
        "key": view.key,
        "priority": view.priority,
        "published_at": format_time(view.published_at),
        "available_at": None if view.available_at is None else format_time(view.available_at),
        "lease_id": view.lease_id,
        "lease_deadline": None if view.lease_deadline is None else format_time(view.lease_deadline),
        "consumer": view.consumer,
    }
    if view.payload is None:  # a finished message's, let go (§6 keeps its state and history)
        out["payload"] = None
        out["payload_dropped"] = True
    else:
        _put_payload(out, view.payload, view.binary, cbor)
    if with_history:
        out["history"] = [history_entry(at, record) for at, record in view.history]
    return out


def error_body(code: str, message: str) -> Mapping[str, Any]:
    return {"error": {"code": code, "message": message}}


#: The error tree's code for each status of an ``HTTPException`` (Werkzeug's and Quart's: routing's 404
#: and 405, a body's 408, 413 …); any other status is ``invalid_request``, or ``internal_error`` from 500.
_HTTP_CODES = {
    error.status: error.code
    for error in (
        InvalidRequest,
        NotFound,
        MethodNotAllowed,
        NotAcceptable,
        RequestTimeout,
        PayloadTooLarge,
        UnsupportedMediaType,
    )
}


def error_answer(error: Exception, method: str, path: str) -> tuple[int, Any, Sequence[tuple[str, str]]]:
    """The one error mapping: status, §2 error body and extra headers (e.g. ``Allow`` on a 405).

    Broker errors and HTTP errors (a 405 from routing, a 413 or 408 while reading a body) carry their
    own status. Anything else is a bug in the broker: it is logged as ``request_failed`` and answered
    500 ``internal_error``; client input never gets here.
    """
    if isinstance(error, BrokerError):
        return error.status, error_body(error.code, error.message), ()
    if isinstance(error, HTTPException):
        status = error.code or 500
        code = _HTTP_CODES.get(status, "internal_error" if status >= 500 else "invalid_request")
        headers = [(name, value) for name, value in error.get_headers() if name.lower() != "content-type"]
        return status, error_body(code, error.description or error.name), headers
    log.exception("request_failed", path=path, method=method, exc_info=error)
    return 500, error_body("internal_error", "the broker hit a bug; the error was logged"), ()


def answers_cbor(scope: Mapping[str, Any]) -> bool:
    """Whether an answer the layers outside the routes make (a refusal) is CBOR: the request's
    ``Accept`` prefers it (``parse.wants_cbor``), outside the compatibility surfaces (JSON only)."""
    if scope["path"].startswith(COMPAT_PREFIX):
        return False
    accept = next((value for name, value in scope["headers"] if name.lower() == b"accept"), None)
    return accept is not None and parse.wants_cbor(accept.decode("latin1"))


async def send_error(
    send: ASGISendCallable,
    scope: HTTPScope,
    error: Exception,
    *headers: tuple[bytes, bytes],
    cbor: bool | None = None,
) -> None:
    """Answer ``error`` through the one mapping (``error_answer``), as the two ASGI messages every layer
    outside Quart sends (the observer, the drain, the token gate, the fast path, the push stream): the
    §2 body in JSON, or in CBOR when ``cbor`` (by default when the request prefers it,
    ``answers_cbor``); its content headers, then the mapping's (``Allow`` …), then ``headers``."""
    status, data, mapped = error_answer(error, scope["method"], scope["path"])
    body, media_type = encode(data, answers_cbor(scope) if cbor is None else cbor)
    raw = [(b"content-type", media_type.encode()), (b"content-length", b"%d" % len(body))]
    raw += [(name.lower().encode("latin1"), value.encode("latin1")) for name, value in mapped]
    raw += headers
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})
