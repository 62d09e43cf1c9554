"""Request bodies and query strings → commands. Shapes and limits only: no queue logic.

Every problem becomes ``InvalidRequest`` (400), ``PayloadTooLarge`` (413) or ``UnsupportedMediaType``
(415) with a message that names the offending field, so nothing a client sends produces a 500.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from broker.config import Limits
from broker.core import NewMessage, State, check_queue_name, parse_duration
from broker.core.commands import Ack, Browse, Claim, Defer, Extend, Nack, Publish
from broker.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType, quoted_value
from broker.storage.codec import cbor_loads, check_plain_json, json_dumps, json_loads

JSON = "application/json"
CBOR = "application/cbor"

_MESSAGE_FIELDS = frozenset(
    {"payload", "payload_encoding", "headers", "key", "on_duplicate", "delay", "priority"}
)
_PRIORITY_LIMITS = (-(2**31), 2**31 - 1)


def decode_body(content_type: str | None, body: bytes) -> tuple[Any, bool]:
    """The decoded body and whether it was CBOR. An empty body is an empty object."""
    media = (content_type or JSON).split(";", 1)[0].strip().lower()
    if not body:
        return {}, media == CBOR
    if media == CBOR:
        return cbor_loads(body), True
    if media == JSON or media.endswith("+json"):
        return json_loads(body), False
    raise UnsupportedMediaType(f"the body must be {JSON} or {CBOR}, not {media!r}")


def wants_cbor(accept: str | None) -> bool:
    """Whether an ``Accept`` header asks for CBOR answers: it names ``application/cbor`` with a
    quality above 0 and not below JSON's, which is ``application/json``'s, else ``application/*``'s,
    else ``*/*``'s (the most specific range that covers it, RFC 9110 §12.5.1). A wildcard alone gets
    JSON, the default."""
    if not accept:
        return False
    lowered = accept.lower()
    if CBOR not in lowered:
        return False
    if lowered == CBOR:
        return True
    qualities: dict[str, float] = {}
    for item in lowered.split(","):
        media, *parameters = item.split(";")
        media = media.strip()
        if media in _NEGOTIATED:
            qualities.setdefault(media, _quality(parameters))
    cbor = qualities.get(CBOR, 0.0)
    json_quality = next((qualities[m] for m in (JSON, "application/*", "*/*") if m in qualities), 0.0)
    return cbor > 0 and cbor >= json_quality


_NEGOTIATED = frozenset({CBOR, JSON, "application/*", "*/*"})


def names_media(accept: str, media: str) -> bool:
    """Whether an ``Accept`` header names ``media`` itself (lower case) with a quality above 0: ``;q=0``
    refuses it (RFC 9110 §12.4.2)."""
    for item in accept.lower().split(","):
        named, *parameters = item.split(";")
        if named.strip() == media and _quality(parameters) > 0:
            return True
    return False


def _quality(parameters: list[str]) -> float:
    """A media range's ``q`` (RFC 9110 §12.4.2): 1 when absent, 0 when it is not a number."""
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        if name.strip() == "q":
            try:
                quality = float(value.strip())
            except ValueError:
                return 0.0
            return quality if 0 <= quality <= 1 else 0.0
    return 1.0


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"{what} must be an object")
    return value


def no_body(body: Any, what: str) -> None:
    """Refuse anything but an empty body or an empty object: ``what`` (a call) takes no parameters. A
    call that changes things must not go ahead on a body it does not understand."""
    if not isinstance(body, Mapping) or body:
        raise InvalidRequest(f"{what} takes no body (or an empty object)")


def known_fields(body: Mapping[str, Any], allowed: frozenset[str] | set[str], what: str) -> None:
    """Refuse a body with a field outside ``allowed`` (``what`` names the body in the message)."""
    unknown = [key for key in body if key not in allowed]
    if unknown:
        expected = f"expected some of: {', '.join(sorted(allowed))}" if allowed else "it takes no fields"
        raise InvalidRequest(f"unknown field {quoted_value(unknown[0])} in {what}; {expected}")


def given(body: Mapping[str, Any], field: str, default: Any) -> Any:
    """An optional field's value, ``default`` when it is left out or ``null`` (the same thing, docs/api.md;
    queue configs differ: there ``null`` has meanings of its own)."""
    value = body.get(field)
    return default if value is None else value


def _string(value: Any, field: str, max_length: int, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{field} must be a string")
    if not allow_empty and not value:
        raise InvalidRequest(f"{field} must not be empty")
    if len(value) > max_length:
        raise InvalidRequest(f"{field} must be at most {max_length} characters")
    return value


def _integer(value: Any, field: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"{field} must be an integer from {low} to {high}")
    return value


def _field(index: int | None) -> str:
    """How errors name a published message: its place in the batch, or "the message" of a single one."""
    return "the message" if index is None else f"messages[{index}]"


def _message(raw: Any, index: int | None, limits: Limits, from_cbor: bool) -> NewMessage:
    if type(raw) is dict and len(raw) == 1 and "payload" in raw and not from_cbor:
        return NewMessage(_json_payload(raw["payload"], index, limits))  # the common case: no other field
    field = _field(index)
    body = raw if type(raw) is dict else _object(raw, field)
    if len(body) != 1 or "payload" not in body:
        known_fields(body, _MESSAGE_FIELDS, field)
    if "payload" not in body:
        raise InvalidRequest(f"{field}.payload is required")
    payload = body["payload"]
    encoding = body.get("payload_encoding")
    if encoding is not None:
        if encoding != "base64" or not isinstance(payload, str):
            raise InvalidRequest(
                f'{field}.payload_encoding may only be "base64", with the payload as base64 text'
            )
        try:
            encoded, binary = base64.b64decode(payload, validate=True), True
        except (binascii.Error, ValueError):  # ValueError: a character beyond ASCII ("é")
            raise InvalidRequest(f"{field}.payload is not valid base64") from None
        _check_size(encoded, index, limits)
    elif from_cbor and isinstance(payload, bytes | bytearray):
        encoded, binary = bytes(payload), True
        _check_size(encoded, index, limits)
    else:
        if from_cbor:
            try:
                check_plain_json(payload)
            except ValueError as error:
                raise InvalidRequest(
                    f"{_field(index)}.payload must be a JSON value or a CBOR byte string: {error}"
                ) from None
        encoded, binary = _json_payload(payload, index, limits), False
    headers = body.get("headers")
    if headers is not None:
        headers = _headers(headers, f"{field}.headers", limits)
    key = body.get("key")
    if key is not None:
        key = _string(key, f"{field}.key", limits.max_key_length)
    on_duplicate = given(body, "on_duplicate", "return")
    if on_duplicate != "return" and on_duplicate != "replace":
        raise InvalidRequest(f'{field}.on_duplicate must be "return" or "replace"')
    replace = on_duplicate == "replace"
    if replace and key is None:
        raise InvalidRequest(
            f'{field}.on_duplicate "replace" needs a key: it replaces the message with that key'
        )
    delay = body.get("delay")
    priority = body.get("priority")
    return NewMessage(
        encoded,
        binary,
        headers,
        key,
        0.0 if delay is None else parse_duration(delay, f"{field}.delay", high=604800),
        0 if priority is None else _integer(priority, f"{field}.priority", *_PRIORITY_LIMITS),
        replace,
    )


def _json_payload(payload: Any, index: int | None, limits: Limits) -> bytes:
    try:
        encoded = json_dumps(payload)
    except ValueError as error:
        raise InvalidRequest(f"{_field(index)}.payload cannot be kept: {error}") from None
    except TypeError:
        raise InvalidRequest(
            f"{_field(index)}.payload must be a JSON value or a CBOR byte string "
            "(byte strings nested inside other values cannot be kept)"
        ) from None
    _check_size(encoded, index, limits)
    return encoded


def _check_size(encoded: bytes, index: int | None, limits: Limits) -> None:
    limit = limits.max_payload_bytes
    if len(encoded) > limit:
        raise PayloadTooLarge(
            f"{_field(index)}.payload is {len(encoded)} bytes encoded; the limit is {limit}"
        )


def _headers(value: Any, field: str, limits: Limits) -> dict[str, str] | None:
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"{field} must be an object of strings")
    if len(value) > limits.max_headers:
        raise InvalidRequest(f"{field} has {len(value)} entries; the limit is {limits.max_headers}")
    size = 0
    for name, text in value.items():
        if not isinstance(name, str) or not isinstance(text, str):
            raise InvalidRequest(f"{field} must map strings to strings")
        size += len(name.encode()) + len(text.encode())
    if size > limits.max_headers_bytes:
        raise InvalidRequest(f"{field} is {size} bytes; the limit is {limits.max_headers_bytes}")
    return dict(value) or None


def publish(body: Any, limits: Limits, from_cbor: bool) -> Publish:
    """One message, or ``{"messages": [...]}``."""
    body = _object(body, "the body")
    if "messages" in body:
        known_fields(body, {"messages"}, "the body")
        raw = body["messages"]
        if not isinstance(raw, list) or not raw:
            raise InvalidRequest("messages must be a non-empty array")
        if len(raw) > limits.max_batch:
            raise InvalidRequest(f"a batch holds at most {limits.max_batch} messages, not {len(raw)}")
        return Publish([_message(item, index, limits, from_cbor) for index, item in enumerate(raw)])
    return Publish([_message(body, None, limits, from_cbor)])


_CLAIM_FIELDS = frozenset({"consumer", "max", "lease", "wait"})


def claim(body: Any, limits: Limits) -> Claim:
    body = _object(body, "the body")
    known_fields(body, _CLAIM_FIELDS, "the claim")
    consumer = given(body, "consumer", "anonymous")
    lease = body.get("lease")
    wait = body.get("wait")
    return Claim(
        consumer=_string(consumer, "consumer", limits.max_consumer_length),
        max_count=_integer(given(body, "max", 1), "max", 1, limits.max_batch),
        lease=None if lease is None else parse_duration(lease, "lease", low=0.1, high=43200),
        wait=0.0 if wait is None else parse_duration(wait, "wait", high=30),
    )


def _lease_ids(body: Mapping[str, Any], limits: Limits) -> list[str]:
    if "leases" not in body:
        raise InvalidRequest("leases is required: an array of lease ids")
    leases = body["leases"]
    if not isinstance(leases, list) or not all(isinstance(lease, str) for lease in leases):
        raise InvalidRequest("leases must be an array of lease id strings")
    if len(leases) > limits.max_batch:
        raise InvalidRequest(f"leases holds at most {limits.max_batch} ids, not {len(leases)}")
    return leases


def reason(body: Mapping[str, Any], limits: Limits) -> str | None:
    """The optional ``reason`` of a nack or defer: a string of at most ``max_reason_length``."""
    value = body.get("reason")
    if value is None:
        return None
    return _string(value, "reason", limits.max_reason_length, allow_empty=True)


def ack(body: Any, limits: Limits) -> Ack:
    body = _object(body, "the body")
    known_fields(body, {"leases"}, "the ack")
    return Ack(_lease_ids(body, limits))


def nack(body: Any, limits: Limits) -> Nack:
    body = _object(body, "the body")
    known_fields(body, {"leases", "delay", "retryable", "reason"}, "the nack")
    return nack_of(_lease_ids(body, limits), body, limits)


def nack_of(leases: Sequence[str], body: Mapping[str, Any], limits: Limits) -> Nack:
    """A nack of ``leases`` as ``body``'s optional ``retryable``, ``delay`` and ``reason`` say (the lease
    API's nack and ack mode's callback)."""
    retryable = given(body, "retryable", True)
    if not isinstance(retryable, bool):
        raise InvalidRequest("retryable must be true or false")
    delay = body.get("delay")
    return Nack(
        leases,
        delay=None if delay is None else parse_duration(delay, "delay", high=604800),
        reason=reason(body, limits),
        retryable=retryable,
    )


def defer(body: Any, limits: Limits) -> Defer:
    body = _object(body, "the body")
    known_fields(body, {"leases", "retry_after", "reason"}, "the defer")
    return defer_of(_lease_ids(body, limits), body, limits)


def defer_of(leases: Sequence[str], body: Mapping[str, Any], limits: Limits) -> Defer:
    """A defer of ``leases`` as ``body``'s optional ``retry_after`` and ``reason`` say."""
    return Defer(
        leases,
        retry_after=parse_duration(given(body, "retry_after", 0), "retry_after", high=86400),
        reason=reason(body, limits),
    )


def extend(body: Any, limits: Limits) -> Extend:
    body = _object(body, "the body")
    known_fields(body, {"leases", "lease"}, "the extend")
    if "lease" not in body:
        raise InvalidRequest("lease is required: the new lease in seconds from now")
    return Extend(_lease_ids(body, limits), lease=parse_duration(body["lease"], "lease", low=0.1, high=43200))


def redrive(body: Any, limits: Limits) -> tuple[list[str] | None, str | None]:
    """``{"ids": [...]}`` or ``{"all": true}``, with an optional ``"to"``: the ids (``None`` for all)
    and the destination."""
    body = _object(body, "the body")
    known_fields(body, {"ids", "all", "to"}, "the redrive")
    every = given(body, "all", False)
    if not isinstance(every, bool):
        raise InvalidRequest("all must be true or false")
    ids = body.get("ids")
    if (ids is not None) == every:
        raise InvalidRequest('say which messages to redrive: either "ids": [...] or "all": true')
    if not every:
        if not isinstance(ids, list) or not ids or not all(isinstance(item, str) for item in ids):
            raise InvalidRequest("ids must be a non-empty array of message id strings")
        if len(ids) > limits.max_batch:
            raise InvalidRequest(f"ids holds at most {limits.max_batch} ids, not {len(ids)}")
    to = body.get("to")
    if to is not None:
        if not isinstance(to, str):
            raise InvalidRequest("to must be a queue name")
        check_queue_name(to, "to")
    return ids, to


_BROWSE_STATES = {"ready": State.READY, "delayed": State.DELAYED, "in_flight": State.IN_FLIGHT, "all": None}


def browse(args: Mapping[str, str]) -> Browse:
    known_fields(args, {"state", "limit", "after"}, "the query")
    state = args.get("state", "all")
    if state not in _BROWSE_STATES:
        raise InvalidRequest("state must be one of ready, delayed, in_flight, all")
    return Browse(
        state=_BROWSE_STATES[state],
        limit=query_integer(args, "limit", 100, 1, 1000),
        after=query_integer(args, "after", 0, 0, 2**63),
    )


# Not int()'s syntax: it takes spaces, underscores and any Unicode digit, and past 4300 digits it raises.
QUERY_INTEGER = re.compile(r"-?[0-9]{1,30}")


def query_values(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """A query's parameters by name. One given twice (``max=1&max=2``) is refused rather than one of
    them silently winning."""
    values: dict[str, str] = {}
    for name, value in pairs:
        if name in values:
            raise InvalidRequest(f"{name} is given more than once in the query")
        values[name] = value
    return values


def query_integer(args: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    """The integer query parameter ``name`` (``default`` when absent), ``low`` … ``high``; else 400."""
    text = args.get(name)
    if text is None:
        return default
    if QUERY_INTEGER.fullmatch(text) is None:
        raise InvalidRequest(f"{name} must be an integer from {low} to {high}")
    return _integer(int(text), name, low, high)


def work(args: Mapping[str, str], limits: Limits) -> Claim:
    """The query of ``GET …/work`` (§7): ``consumer``, ``max`` (1 … max_batch, default 1) and ``lease``,
    as the claim a stream's refills are made of."""
    known_fields(args, {"consumer", "max", "lease"}, "the query")
    lease = args.get("lease")
    return Claim(
        consumer=_string(args.get("consumer", "anonymous"), "consumer", limits.max_consumer_length),
        max_count=query_integer(args, "max", 1, 1, limits.max_batch),
        lease=None if lease is None else parse_duration(lease, "lease", low=0.1, high=43200),
    )


def queue_config(body: Any) -> Mapping[str, Any]:
    """A queue's config changes: an object of config fields (checked by the core's ``QueueConfig``)."""
    return _object(body, "the queue config")
