"""The API as an OpenAPI 3.1 document, served at ``GET /openapi.json`` (§10).

Its paths and methods come from the route table in ``paths.py`` (the one the token gate and the
metrics use), so a route cannot be added there without a description here: ``document`` raises for a
route with none, and a test checks that every route the app serves (Quart's URL map and the fast path's)
is in the document and nothing else is. The schemas say what docs/api.md says, in JSON Schema; bodies
may also be CBOR (``application/cbor``) with the same structure, and so may the native routes' answers
(the compatibility surfaces answer JSON only). tests/http/test_openapi.py checks real answers of the app
against the schemas, the ``required`` flag of each body and every ``default`` against the broker.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from broker.core.config import MAX_QUEUE_NAME
from broker.core.durations import DURATION_PATTERN
from broker.http.paths import (
    CALLBACK_ROUTES,
    COMPAT_ROUTES,
    FIXED_ROUTES,
    MESSAGE_ROUTES,
    PUSH_ROUTES,
    QUEUE_ROUTES,
    WORK_ROUTES,
)

_DURATION_PATTERN = f"^{DURATION_PATTERN}$"
_DURATION_TEXT = "seconds, or a string with a unit: 250ms, 30s, 5m, 12h, 7d"
_LEASES = {"type": "array", "items": {"type": "string"}, "maxItems": 1000}


def _duration(low: float, high: float) -> dict[str, Any]:
    """A duration the broker takes within ``[low, high]`` seconds. The bounds hold the number form; the
    string form (``30s``) says them in its description, as a pattern cannot bound a magnitude."""
    return {
        "oneOf": [
            {"type": "number", "minimum": low, "maximum": high},
            {"type": "string", "pattern": _DURATION_PATTERN},
        ],
        "description": f"{_DURATION_TEXT}; {low:.15g} to {high:.15g} seconds",
    }


_LEASE = _duration(0.1, 43200)
_PUSH_LEASE_ID = {
    "type": "string",
    "description": "the push envelope's lease_id: settle that delivery only (a retried callback never "
    "settles a later push of the message)",
}
_DELAY = _duration(0, 604800)  # a nack's delay, a message's delay, a backoff
_RETRY_AFTER = _duration(0, 86400)
_WAIT = _duration(0, 30)
_REASON = {"type": "string", "maxLength": 4096}
#: An http or https URL with a host (link-local and metadata hosts are refused unless push allows
#: private addresses, which a pattern cannot say).
_URL = {
    "type": "string",
    "maxLength": 2048,
    "pattern": r"^https?://[A-Za-z0-9][A-Za-z0-9.-]*(:[1-9][0-9]{0,3})?(/[^\s\x00-\x1f\x7f-\x9f]*)?$",
}


def _default(schema: dict[str, Any], value: Any) -> dict[str, Any]:
    """``schema`` with the value the broker applies when the field or parameter is left out."""
    return {**schema, "default": value}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` also taking ``null``: a type gains ``"null"``, an enum ``None``; anything else (a
    duration's choice of forms) becomes a choice between ``null`` and itself. A schema that takes
    anything takes ``null`` already."""
    if not schema:
        return schema
    kind = schema.get("type")
    if isinstance(kind, str):
        return {**schema, "type": [kind, "null"]}
    if isinstance(kind, list):
        return schema if "null" in kind else {**schema, "type": [*kind, "null"]}
    if "enum" in schema and "type" not in schema:
        return schema if None in schema["enum"] else {**schema, "enum": [*schema["enum"], None]}
    outer = {key: schema[key] for key in ("default",) if key in schema}
    inner = {key: value for key, value in schema.items() if key not in outer}
    return {"oneOf": [{"type": "null"}, inner], **outer}


#: How a body whose optional fields take ``null`` says so (the native message routes: docs/api.md).
NULL_AS_ABSENT = "An optional field given as null is taken as if left out."


def _object(
    properties: dict[str, Any],
    *,
    required: tuple[str, ...] = (),
    closed: bool = True,
    null_as_absent: bool = False,
) -> dict[str, Any]:
    """An object schema; with ``null_as_absent``, each property not in ``required`` also takes ``null``
    (the request parser reads it as the field left out), and the description says so."""
    if null_as_absent:
        properties = {
            name: value if name in required else _nullable(value) for name, value in properties.items()
        }
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    if null_as_absent:
        schema["description"] = NULL_AS_ABSENT
    return schema


SCHEMAS: dict[str, Any] = {
    "Error": _object(
        {
            "error": _object(
                {"code": {"type": "string"}, "message": {"type": "string"}}, required=("code", "message")
            )
        },
        required=("error",),
    ),
    "QueueConfig": _object(
        {
            "lease": _LEASE,
            "max_attempts": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
            "dead_letter": {
                "type": ["string", "null"],
                "pattern": rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_QUEUE_NAME - 1}}}$",
            },
            "retry_backoff": {
                **_object({"type": {"enum": ["fixed", "exponential"]}, "base": _DELAY, "max": _DELAY}),
                "description": "base must not be over max; without max, the cap is 3600 s or base if longer",
            },
            "max_depth": {"type": "integer", "minimum": 0, "maximum": 1_000_000_000},
            "rate_limit": {
                "oneOf": [
                    {"type": "null"},
                    _object(
                        {
                            "max": {"type": "integer", "minimum": 1, "maximum": 1_000_000_000},
                            "per": _duration(0.001, 86400),
                        },
                        required=("max", "per"),
                    ),
                ]
            },
            "message_ttl": _duration(0, 31_536_000),
            "claim_window": _duration(0, 5),
            "durable": {"type": "boolean"},
            "dedup_window": _duration(0, 31_536_000),
            "push": {
                "oneOf": [
                    {"type": "null"},
                    _object(
                        {
                            "url": _URL,
                            "mode": {"enum": ["standard", "ack"]},
                            "timeout": _duration(0.1, 3600),
                            "concurrency": {"type": "integer", "minimum": 1, "maximum": 1000},
                            "ack_timeout": _duration(1, 43000),
                            "ack_timeout_action": {"enum": ["retry", "dead"]},
                            "allow_private": {"type": "boolean"},
                            "secret": {"type": "string", "minLength": 16, "maxLength": 256},
                            "format": {"enum": ["broker", "simpleq"]},
                        },
                        required=("url",),
                    ),
                ]
            },
            # Not a schema rule: the URL may be the queue's own, which a schema cannot see.
            "template": {
                "enum": ["anthropic", "openai"],
                "description": "presets for push (docs/push.md); needs push.url, given here or already set",
            },
        }
    )
    | {
        # A template configures push: it cannot go with "push": null (stop pushing) in the same body.
        "not": {"required": ["template", "push"], "properties": {"push": {"type": "null"}}},
    },
    "CloudflareError": _object(
        {
            "success": {"const": False},
            "errors": {
                "type": "array",
                "minItems": 1,
                "items": _object(
                    {"code": {"type": "integer"}, "message": {"type": "string"}}, required=("code", "message")
                ),
            },
            "messages": {"type": "array"},
            "result": {},
        },
        required=("success", "errors"),
    ),
    "Queue": _object(
        {"name": {"type": "string"}, "config": {"type": "object"}, "stats": {"type": "object"}},
        required=("name", "config", "stats"),
        closed=False,
    ),
    "NewMessage": _object(
        {
            "payload": {},
            "payload_encoding": {"enum": ["base64"]},
            "headers": {"type": "object", "additionalProperties": {"type": "string"}},
            "key": {"type": "string", "maxLength": 1024},
            "on_duplicate": _default({"enum": ["return", "replace"]}, "return"),
            "delay": _default(_DELAY, 0),
            "priority": _default({"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}, 0),
        },
        required=("payload",),
        null_as_absent=True,
    ),
    "Delivery": _object(
        {
            "id": {"type": "string"},
            "seq": {"type": "integer"},
            "lease_id": {"type": "string"},
            "lease_deadline": {"type": "string"},
            "attempt": {"type": "integer"},
            "payload": {},
        },
        required=("id", "seq", "lease_id", "lease_deadline", "attempt", "payload"),
        closed=False,
    ),
}


_ERROR = {
    "description": "an error (docs/api.md, Errors)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}
#: The compatibility surfaces answer JSON only, whatever the request's ``Accept`` (docs/compat.md).
_COMPAT = "/compat/"
#: The Cloudflare surface answers errors in Cloudflare's envelope (docs/compat.md)...
_CLOUDFLARE = "/compat/cloudflare/"
_CLOUDFLARE_ERROR = {
    "description": "an error, in Cloudflare's envelope (docs/compat.md)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CloudflareError"}}},
}
#: ... except those made before its routes run, in the broker's error body: the token gate's, routing's
#: (a path no route has, another method) and the refusal of a compressed body.
_CLOUDFLARE_REFUSALS = {
    "401": "no token, or a wrong one (the broker's error body)",
    "403": "a token without consume:{queue} (the broker's error body)",
    "405": "another method (the broker's error body)",
    "415": "a compressed body (the broker's error body)",
}
_CLOUDFLARE_NOT_FOUND = {
    "description": "no such queue (Cloudflare's envelope), or no such path (the broker's error body)",
    "content": {
        "application/json": {
            "schema": {
                "oneOf": [
                    {"$ref": "#/components/schemas/CloudflareError"},
                    {"$ref": "#/components/schemas/Error"},
                ]
            }
        }
    },
}


def _cloudflare_refusals() -> dict[str, Any]:
    answers: dict[str, Any] = {
        status: {"description": text, "content": _ERROR["content"]}
        for status, text in _CLOUDFLARE_REFUSALS.items()
    }
    answers["404"] = _CLOUDFLARE_NOT_FOUND
    return dict(sorted(answers.items()))


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _needs_a_body(schema: dict[str, Any]) -> bool:
    """Whether a request must have a body: when its schema requires a field (in every choice it offers).
    Otherwise no body is as good as an empty object, which the broker reads it as (``parse.decode_body``)."""
    if "$ref" in schema:
        return _needs_a_body(SCHEMAS[schema["$ref"].rsplit("/", 1)[1]])
    if schema.get("required"):
        return True
    choices: list[dict[str, Any]] = schema.get("oneOf", [])
    return bool(choices) and all(_needs_a_body(choice) for choice in choices)


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "required": _needs_a_body(schema),
        "content": {"application/json": {"schema": schema}, "application/cbor": {"schema": schema}},
    }


def _with_cbor(answer: dict[str, Any]) -> dict[str, Any]:
    """A native answer: CBOR, same structure, when the request's ``Accept`` prefers it (docs/api.md)."""
    content = answer.get("content", {})
    if "application/json" not in content:  # none, or not JSON (the metrics' text, the event stream)
        return answer
    return {**answer, "content": {**content, "application/cbor": content["application/json"]}}


def _answer(status: str, text: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    answer: dict[str, Any] = {"description": text}
    if schema is not None:
        answer["content"] = {"application/json": {"schema": schema}}
    return {status: answer}


_QUEUE_PARAMETER = {
    "name": "queue",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_QUEUE_NAME - 1}}}$"},
}


def _ids_or_all(ids: str, *, null_as_absent: bool = False) -> dict[str, Any]:
    """A bulk call's choice: ``ids`` (a list) or ``"all": true``, never both, never neither. With
    ``null_as_absent``, a field given as null counts as left out."""
    if null_as_absent:
        return {
            "oneOf": [
                {"required": [ids], "properties": {ids: {"type": "array"}, "all": {"enum": [False, None]}}},
                {"required": ["all"], "properties": {"all": {"const": True}, ids: {"type": "null"}}},
            ]
        }
    return {
        "oneOf": [
            {"required": [ids], "properties": {"all": {"const": False}}},
            {"required": ["all"], "properties": {"all": {"const": True}}, "not": {"required": [ids]}},
        ]
    }


_ID_PARAMETER = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
#: The body of a call without parameters: none, or an empty object (anything else is 400).
_NO_FIELDS = {"type": "object", "maxProperties": 0}
_STREAM_PARAMETER = {
    "name": "stream_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "the stream's stream-id response header",
}
_ACCOUNT_PARAMETER = {
    "name": "account",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "accepted and ignored (docs/compat.md)",
}
_QHOOK_IDS = _object(
    {"ids": {"type": "array", "items": {"type": "string"}, "maxItems": 1000}}, required=("ids",)
)
_CLOUDFLARE_ENVELOPE = {
    "success": {"type": "boolean"},
    "errors": {"type": "array", "items": {"type": "object"}},
    "messages": {"type": "array"},
}


def _cloudflare(result: dict[str, Any]) -> dict[str, Any]:
    return _object({**_CLOUDFLARE_ENVELOPE, "result": result}, required=("success", "errors", "result"))


_SETTLED = {"skipped": {"type": "array", "items": {"type": "string"}}}

#: SimpleQ's queue fields (docs/compat.md), writable ones first.
_SIMPLEQ_QUEUE_FIELDS: dict[str, Any] = {
    "webhookUrl": _URL,
    "maxAttempts": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
    "concurrency": {"type": "integer", "minimum": 1, "maximum": 1000},
    "dlqEnabled": {"type": "boolean"},
    "mode": {"enum": ["standard", "ack"]},
    "rateLimitMax": {"type": ["integer", "null"], "minimum": 1, "maximum": 1_000_000_000},
    "rateLimitWindow": _duration(0.001, 86400),
    "ackTimeout": _duration(1, 43000),
    "ackTimeoutAction": {"enum": ["retry", "dead"]},
    "backoffType": {"enum": ["fixed", "exponential"]},
    "backoffDelay": _duration(0, 604800),
}
_SIMPLEQ_QUEUE_CREATE = _object(
    {
        "name": {"type": "string", "pattern": rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_QUEUE_NAME - 1}}}$"},
        **_SIMPLEQ_QUEUE_FIELDS,
        "template": {"enum": ["anthropic", "openai"]},
    },
    required=("name", "webhookUrl"),
) | {"dependentRequired": {"rateLimitWindow": ["rateLimitMax"]}}
#: ``name`` is accepted when it is the queue's own, which a schema cannot say, so it is left out; and
#: a window alone also changes an existing rate limit, which a schema cannot know of.
_SIMPLEQ_QUEUE_UPDATE = _object(_SIMPLEQ_QUEUE_FIELDS) | {
    "dependentRequired": {"rateLimitWindow": ["rateLimitMax"]}
}
_SIMPLEQ_QUEUE = _object(
    {"id": {"type": "string"}, "name": {"type": "string"}, "depth": {"type": "integer"}},
    required=("id", "name"),
    closed=False,
)
_SIMPLEQ_QUEUE_ANSWER = _object(
    {"id": {"type": "string"}, "name": {"type": "string"}, "signingSecret": {"type": ["string", "null"]}},
    required=("id", "name", "signingSecret"),
    closed=False,
)
#: A repeated idempotencyKey's answer to a token that may not read the queue (docs/compat.md, Jobs).
_SIMPLEQ_DUPLICATE = _object(
    {"id": {"type": "string"}, "queue": {"type": "string"}, "idempotencyKey": {"type": "string"}},
    required=("id", "queue", "idempotencyKey"),
)
_SIMPLEQ_JOB = _object(
    {
        "id": {"type": "string"},
        "queue": {"type": "string"},
        "state": {"type": "string"},
        "payload": {},
        "attempt": {"type": "integer"},
        "maxAttempts": {"type": "integer"},
        "createdAt": {"type": "string"},
        "attempts": {"type": "array"},
    },
    required=("id", "queue", "state", "payload", "attempts"),
    closed=False,
)


#: route template → (summary, request body schema or None, query parameters, success answers).
OPERATIONS: dict[str, tuple[str, dict[str, Any] | None, list[dict[str, Any]], dict[str, Any]]] = {
    "GET /healthz": ("Alive", None, [], _answer("200", "serving", {"type": "object"})),
    "GET /readyz": (
        "Recovered and the journal writable (else 503)",
        None,
        [],
        _answer("200", "ready", {"type": "object"}),
    ),
    "GET /openapi.json": ("This document", None, [], _answer("200", "OpenAPI 3.1", {"type": "object"})),
    "GET /metrics": (
        "Prometheus metrics",
        None,
        [],
        {"200": {"description": "text format", "content": {"text/plain": {"schema": {"type": "string"}}}}},
    ),
    "GET /v1/queues": (
        "Every queue, by name",
        None,
        [],
        _answer("200", "the queues", _object({"queues": {"type": "array", "items": _ref("Queue")}})),
    ),
    "GET /v1/admin/snapshots": (
        "The snapshots, newest first",
        None,
        [],
        _answer("200", "snapshots", {"type": "object"}),
    ),
    "POST /v1/admin/snapshots": (
        "Take a snapshot now",
        _NO_FIELDS,
        [],
        {**_answer("201", "taken", {"type": "object"}), **_answer("200", "nothing new", {"type": "object"})},
    ),
    "GET /v1/queues/{queue}": (
        "A queue's config and stats",
        None,
        [],
        _answer("200", "the queue", _ref("Queue")),
    ),
    "PUT /v1/queues/{queue}": (
        "Create a queue, or change its config",
        _ref("QueueConfig"),
        [],
        {**_answer("201", "created", _ref("Queue")), **_answer("200", "updated", _ref("Queue"))},
    ),
    "DELETE /v1/queues/{queue}": ("Delete a queue", None, [], _answer("204", "deleted")),
    "POST /v1/queues/{queue}/messages": (
        "Publish one message or a batch",
        {
            "oneOf": [
                _ref("NewMessage"),
                _object(
                    {
                        "messages": {
                            "type": "array",
                            "items": _ref("NewMessage"),
                            "minItems": 1,
                            "maxItems": 1000,
                        }
                    },
                    required=("messages",),
                ),
            ]
        },
        [],
        {
            **_answer("201", "published", {"type": "object"}),
            **_answer("200", "every one a duplicate", {"type": "object"}),
        },
    ),
    "GET /v1/queues/{queue}/messages": (
        "Browse live messages without claiming them",
        None,
        [
            {
                "name": "state",
                "in": "query",
                "schema": _default({"enum": ["ready", "delayed", "in_flight", "all"]}, "all"),
            },
            {
                "name": "limit",
                "in": "query",
                "schema": _default({"type": "integer", "minimum": 1, "maximum": 1000}, 100),
            },
            {"name": "after", "in": "query", "schema": {"type": "integer", "minimum": 0}},
        ],
        _answer("200", "messages", _object({"messages": {"type": "array"}})),
    ),
    "GET /v1/queues/{queue}/messages/{id}": (
        "One message, with its history",
        None,
        [],
        _answer("200", "the message", {"type": "object"}),
    ),
    "DELETE /v1/queues/{queue}/messages/{id}": (
        "Remove one live message",
        None,
        [],
        _answer("204", "removed"),
    ),
    "POST /v1/queues/{queue}/claim": (
        "Lease up to max messages (optionally waiting for them)",
        _object(
            {
                "consumer": _default({"type": "string", "maxLength": 256}, "anonymous"),
                "max": _default({"type": "integer", "minimum": 1, "maximum": 1000}, 1),
                "lease": _LEASE,  # the queue's when left out
                "wait": _default(_WAIT, 0),
            },
            null_as_absent=True,
        ),
        [],
        _answer(
            "200",
            "the deliveries",
            _object(
                {
                    "messages": {"type": "array", "items": _ref("Delivery")},
                    "ready": {"type": "integer"},
                    "retry_after": {"type": "number"},
                },
                required=("messages", "ready"),
            ),
        ),
    ),
    "POST /v1/queues/{queue}/ack": (
        "Acknowledge leases",
        _object({"leases": _LEASES}, required=("leases",)),
        [],
        _answer("200", "acked", _object({"acked": {"type": "integer"}, **_SETTLED}, required=("acked",))),
    ),
    "POST /v1/queues/{queue}/nack": (
        "Give leases back as failed attempts (retry later, or dead-letter)",
        _object(
            {
                "leases": _LEASES,
                "delay": _DELAY,  # the queue's retry_backoff when left out
                "retryable": _default({"type": "boolean"}, True),
                "reason": _REASON,
            },
            required=("leases",),
            null_as_absent=True,
        ),
        [],
        _answer("200", "nacked", {"type": "object"}),
    ),
    "POST /v1/queues/{queue}/defer": (
        "Give leases back without spending an attempt",
        _object(
            {"leases": _LEASES, "retry_after": _default(_RETRY_AFTER, 0), "reason": _REASON},
            required=("leases",),
            null_as_absent=True,
        ),
        [],
        _answer("200", "deferred", {"type": "object"}),
    ),
    "POST /v1/queues/{queue}/extend": (
        "Extend leases",
        _object({"leases": _LEASES, "lease": _LEASE}, required=("leases", "lease")),
        [],
        _answer("200", "extended", {"type": "object"}),
    ),
    "GET /v1/queues/{queue}/work": (
        "Server-Sent Events: messages pushed up to max in flight (docs/workers.md)",
        None,
        [
            {
                "name": "consumer",
                "in": "query",
                "schema": _default({"type": "string", "maxLength": 256}, "anonymous"),
            },
            {
                "name": "max",
                "in": "query",
                "schema": _default({"type": "integer", "minimum": 1, "maximum": 1000}, 1),
            },
            {"name": "lease", "in": "query", "schema": _LEASE},
        ],
        {
            "200": {
                "description": "an event stream",
                "headers": {
                    "stream-id": {
                        "description": "names the stream, for its stop call",
                        "required": True,
                        "schema": {"type": "string"},
                    },
                    "broker-time": {
                        "description": "the broker's time as the stream opened, which its lease deadlines "
                        "are measured by",
                        "required": True,
                        "schema": {"type": "string", "format": "date-time"},
                    },
                },
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            }
        },
    ),
    "POST /v1/queues/{queue}/work/{stream_id}/stop": (
        "Stop a push stream taking new deliveries; it keeps its leases until settled or closed",
        _NO_FIELDS,
        [],
        _answer(
            "200",
            "stopped (again)",
            _object({"stream": {"type": "string"}, "held": {"type": "integer"}}, required=("stream", "held")),
        ),
    ),
    "GET /v1/queues/{queue}/push": (
        "The queue's push config (secret hidden) and its dispatcher's state (docs/push.md)",
        None,
        [],
        _answer("200", "push", {"type": "object"}),
    ),
    "POST /v1/queues/{queue}/push/rotate-secret": (
        "A new signing secret for push, shown in this answer only",
        _NO_FIELDS,
        [],
        _answer(
            "200", "the new secret", _object({"queue": {"type": "string"}, "secret": {"type": "string"}})
        ),
    ),
    "GET /v1/queues/{queue}/push/messages/{id}": (
        "The push attempts of one message: time, status or error, duration",
        None,
        [],
        _answer("200", "attempts", {"type": "object"}),
    ),
    "POST /v1/messages/{id}/ack": (
        "Ack mode: the receiver acknowledges a pushed message by its id (its delivery: lease_id)",
        _object({"lease_id": _PUSH_LEASE_ID}, null_as_absent=True),
        [],
        _answer("200", "acked", {"type": "object"}),
    ),
    "POST /v1/messages/{id}/nack": (
        "Ack mode: the receiver fails a pushed message",
        _object(
            {
                "retryable": _default({"type": "boolean"}, True),
                "delay": _DELAY,  # the queue's retry_backoff when left out
                "reason": _REASON,
                "lease_id": _PUSH_LEASE_ID,
            },
            null_as_absent=True,
        ),
        [],
        _answer("200", "nacked", {"type": "object"}),
    ),
    "POST /v1/messages/{id}/defer": (
        "Ack mode: the receiver defers a pushed message, spending no attempt",
        _object(
            {"retry_after": _default(_RETRY_AFTER, 0), "reason": _REASON, "lease_id": _PUSH_LEASE_ID},
            null_as_absent=True,
        ),
        [],
        _answer("200", "deferred", {"type": "object"}),
    ),
    # -- compatibility surfaces (docs/compat.md) ------------------------------------------------------
    "GET /compat/qhook/api/queues": (
        "qhook: the queues this token may read or consume",
        None,
        [],
        _answer("200", "the queues", _object({"queues": {"type": "array"}})),
    ),
    "GET /compat/qhook/api/queues/{queue}/messages": (
        "qhook: receive up to batch messages, long-polling up to wait",
        None,
        [
            {"name": "wait", "in": "query", "schema": _WAIT},
            {"name": "batch", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
        ],
        _answer("200", "the messages", _object({"messages": {"type": "array"}})),
    ),
    "POST /compat/qhook/api/queues/{queue}/ack": (
        "qhook: acknowledge messages by id",
        _QHOOK_IDS,
        [],
        _answer("200", "acked", _object({"acked": {"type": "integer"}})),
    ),
    "POST /compat/qhook/api/queues/{queue}/nack": (
        "qhook: give messages back for retry (or the dead-letter queue) by id",
        _QHOOK_IDS,
        [],
        _answer("200", "nacked", _object({"retried": {"type": "integer"}, "dead": {"type": "integer"}})),
    ),
    "POST /compat/cloudflare/client/v4/accounts/{account}/queues/{queue}/messages/pull": (
        "Cloudflare Queues: pull a batch of messages",
        _object(
            {
                "batch_size": {"type": "integer", "minimum": 1, "maximum": 100},
                "visibility_timeout_ms": {"type": "number", "minimum": 100, "maximum": 43_200_000},
                "visibility_timeout": {"type": "number", "minimum": 100, "maximum": 43_200_000},
            },
            closed=False,
        ),
        [],
        _answer("200", "the messages", _cloudflare({"type": "object"})),
    ),
    "POST /compat/cloudflare/client/v4/accounts/{account}/queues/{queue}/messages/ack": (
        "Cloudflare Queues: acknowledge and retry messages by lease id",
        _object(
            {
                "acks": {"type": "array", "items": {"type": "object"}},
                "retries": {"type": "array", "items": {"type": "object"}},
            },
            closed=False,
        ),
        [],
        _answer("200", "settled", _cloudflare({"type": "object"})),
    ),
    "POST /compat/simpleq/v1/queues": (
        "SimpleQ: create a queue pushed in SimpleQ's format; the answer alone shows its signingSecret",
        _SIMPLEQ_QUEUE_CREATE,
        [],
        _answer("201", "created", _SIMPLEQ_QUEUE_ANSWER),
    ),
    "GET /compat/simpleq/v1/queues": (
        "SimpleQ: the SimpleQ queues this token may read (signingSecret omitted)",
        None,
        [],
        _answer("200", "the queues", {"type": "array", "items": _SIMPLEQ_QUEUE}),
    ),
    "GET /compat/simpleq/v1/queues/{queue}": (
        "SimpleQ: a queue (signingSecret omitted)",
        None,
        [],
        _answer("200", "the queue", _SIMPLEQ_QUEUE),
    ),
    "PUT /compat/simpleq/v1/queues/{queue}": (
        "SimpleQ: change a queue's config (partial update)",
        _SIMPLEQ_QUEUE_UPDATE,
        [],
        _answer("200", "updated", _SIMPLEQ_QUEUE_ANSWER),
    ),
    "DELETE /compat/simpleq/v1/queues/{queue}": (
        "SimpleQ: delete a queue",
        None,
        [],
        _answer("204", "deleted"),
    ),
    "POST /compat/simpleq/v1/queues/{queue}/jobs": (
        "SimpleQ: publish a job (idempotencyKey: a repeat answers 200 with the existing job)",
        _object(
            {
                "payload": {"type": "object"},
                "idempotencyKey": {"type": "string", "minLength": 1, "maxLength": 1024},
                "delay": _duration(0, 86400),
            },
            required=("payload",),
        ),
        [],
        {
            **_answer("201", "created", _SIMPLEQ_JOB),
            **_answer(
                "200",
                "the existing job; to a token without read:{queue}, only its id, queue and key",
                {"oneOf": [_SIMPLEQ_JOB, _SIMPLEQ_DUPLICATE]},
            ),
        },
    ),
    "GET /compat/simpleq/v1/jobs/{id}": (
        "SimpleQ: a job's state and its attempts",
        None,
        [],
        _answer("200", "the job", _SIMPLEQ_JOB),
    ),
    "POST /compat/simpleq/v1/jobs/{id}/ack": (
        "SimpleQ: ack mode: the job succeeded",
        _NO_FIELDS,
        [],
        _answer("200", "acked; the job", _SIMPLEQ_JOB),
    ),
    "POST /compat/simpleq/v1/jobs/{id}/nack": (
        "SimpleQ: ack mode: the job failed (retryable: false dead-letters it)",
        _object({"retryable": _default({"type": "boolean"}, True), "reason": _REASON}),
        [],
        _answer("200", "nacked; the job", _SIMPLEQ_JOB),
    ),
    "POST /compat/simpleq/v1/jobs/{id}/defer": (
        "SimpleQ: ack mode: hold the job for retryAfter seconds, spending no attempt",
        _object(
            {"retryAfter": _duration(0, 3600), "reason": _REASON},
            required=("retryAfter",),
        ),
        [],
        _answer("200", "deferred; the job", _SIMPLEQ_JOB),
    ),
    "GET /compat/simpleq/v1/queues/{queue}/dlq": (
        "SimpleQ: the queue's dead-letter jobs, a page at a time",
        None,
        [
            {
                "name": "limit",
                "in": "query",
                "schema": _default({"type": "integer", "minimum": 1, "maximum": 1000}, 100),
            },
            {"name": "cursor", "in": "query", "schema": {"type": "integer", "minimum": 0}},
        ],
        _answer(
            "200",
            "a page of entries",
            _object(
                {"data": {"type": "array"}, "nextCursor": {"type": ["string", "null"]}},
                required=("data", "nextCursor"),
            ),
        ),
    ),
    "POST /compat/simpleq/v1/queues/{queue}/dlq/{id}/retry": (
        "SimpleQ: retry one dead-letter job (by its entry id or its job id) as a new job",
        None,
        [],
        _answer("201", "retried", {"type": "object"}),
    ),
    "POST /compat/simpleq/v1/queues/{queue}/dlq/retry": (
        "SimpleQ: retry up to 1000 dead-letter jobs: jobIds, or all",
        _object(
            {
                "jobIds": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1000},
                "all": {"type": "boolean"},
            }
        )
        | _ids_or_all("jobIds"),
        [],
        _answer(
            "200",
            "retried",
            _object(
                {"retried": {"type": "integer"}, "notFound": {"type": "array"}, "skipped": {"type": "array"}}
            ),
        ),
    ),
    "POST /v1/queues/{queue}/purge": (
        "Remove every ready and delayed message",
        _NO_FIELDS,
        [],
        _answer("200", "purged", _object({"purged": {"type": "integer"}})),
    ),
    "POST /v1/queues/{queue}/redrive": (
        "Move dead letters back to where they came from, or elsewhere",
        _object(
            {
                "ids": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1000},
                "all": {"type": "boolean"},
                "to": _QUEUE_PARAMETER["schema"],
            },
            null_as_absent=True,
        )
        | _ids_or_all("ids", null_as_absent=True),
        [],
        _answer("200", "redriven", {"type": "object"}),
    ),
}


def routes() -> list[str]:
    """Every route template the broker serves, from the route table."""
    found = [f"{method} {path}" for method, path in FIXED_ROUTES]
    for method, action in QUEUE_ROUTES:
        found.append(f"{method} /v1/queues/{{queue}}" + (f"/{action}" if action else ""))
    found += [f"{method} /v1/queues/{{queue}}/messages/{{id}}" for method in MESSAGE_ROUTES]
    found += [f"{method} /v1/queues/{{queue}}/work/{{stream_id}}/{action}" for method, action in WORK_ROUTES]
    found += [f"{method} /v1/queues/{{queue}}/push/{action}" for method, action in PUSH_ROUTES]
    found.append("GET /v1/queues/{queue}/push/messages/{id}")
    found += [f"{method} /v1/messages/{{id}}/{action}" for method, action in CALLBACK_ROUTES]
    found += [f"{method} {template}" for method, template in COMPAT_ROUTES]
    return found


@functools.cache
def document() -> dict[str, Any]:
    """The OpenAPI document, made once: callers must not change it."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes():
        if route not in OPERATIONS:
            raise LookupError(f"the route {route} has no OpenAPI description in broker/http/openapi.py")
        method, path = route.split(" ", 1)
        summary, body, query, answers = OPERATIONS[route]
        parameters = [_QUEUE_PARAMETER] if "{queue}" in path else []
        if "{id}" in path:
            parameters.append(_ID_PARAMETER)
        if "{stream_id}" in path:
            parameters.append(_STREAM_PARAMETER)
        if "{account}" in path:
            parameters.insert(0, _ACCOUNT_PARAMETER)
        responses: dict[str, Any]
        if path.startswith(_CLOUDFLARE):
            responses = {**answers, **_cloudflare_refusals(), "default": _CLOUDFLARE_ERROR}
        elif path.startswith(_COMPAT):
            responses = {**answers, "default": _ERROR}
        else:
            responses = {
                status: _with_cbor(answer) for status, answer in {**answers, "default": _ERROR}.items()
            }
        operation: dict[str, Any] = {
            "operationId": route.replace(" ", "_"),
            "summary": summary,
            "parameters": [*parameters, *query],
            "responses": responses,
        }
        if body is not None:
            operation["requestBody"] = _body(body)
        paths.setdefault(path, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "broker",
            "version": "1",
            "description": "A lease-based, at-least-once job broker over HTTP (docs/api.md).",
        },
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}, {}],
        "paths": paths,
    }


def reference_markdown() -> str:
    """docs/api-reference.md: every operation of the document, its parameters and body fields, as
    Markdown (``python -m broker.http.openapi > docs/api-reference.md``; a test keeps it in step)."""
    doc = document()
    lines = [
        "# API reference",
        "",
        "Generated from `GET /openapi.json` by",
        "`python -m broker.http.openapi > docs/api-reference.md`; do not edit by hand. The guide with",
        "examples is [api.md](api.md). Answers are JSON, or CBOR when the request's `Accept` prefers it;",
        "the compatibility surfaces ([compat.md](compat.md)) answer JSON only. Every error answers",
        '`{"error": {"code", "message"}}`, but those of the Cloudflare routes themselves, in its envelope.',
        "A field marked `?` may be left out; `=` gives the value that then applies. In the bodies of",
        "the native message routes, such a field may also be `null`, as if left out.",
        "",
    ]
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            lines += [f"## `{method.upper()} {path}`", "", operation["summary"] + ".", ""]
            parameters = [p for p in operation["parameters"] if p["in"] == "query"]
            if parameters:
                named = [f"`{p['name']}`" + _default_text(p["schema"]) for p in parameters]
                lines.append("Query: " + ", ".join(named) + ".")
                lines.append("")
            body = operation.get("requestBody")
            if body is not None:
                schema = body["content"]["application/json"]["schema"]
                optional = "" if body["required"] else ", or none"
                lines.append(f"Body (JSON or CBOR{optional}): {_describe(schema, doc)}.")
                lines.append("")
            answers = ", ".join(
                f"{status} {answer['description']}"
                for status, answer in operation["responses"].items()
                if status != "default"
            )
            lines += [f"Answers: {answers}.", ""]
    return "\n".join(lines)


def _describe(schema: dict[str, Any], doc: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return f"{name} ({_describe(doc['components']['schemas'][name], doc)})"
    properties = schema.get("properties")
    if "oneOf" in schema and properties is None:
        return " or ".join(_describe(option, doc) for option in schema["oneOf"])
    if properties is None:
        return "an object without fields" if schema.get("maxProperties") == 0 else "an object"
    required = set(schema.get("required", ()))
    fields = [
        f"`{name}`" + ("" if name in required else "?" + _default_text(field))
        for name, field in properties.items()
    ]
    text = "fields " + ", ".join(fields) if fields else "an empty object"
    # A choice among the fields (a bulk call's ids or all) names the field each option requires.
    choices = [" and ".join(f"`{name}`" for name in option["required"]) for option in schema.get("oneOf", ())]
    return f"{text}; exactly one of {' or '.join(choices)}" if choices else text


def _default_text(schema: dict[str, Any]) -> str:
    """``=<default>`` for a field or parameter the broker fills in when left out (JSON), else nothing."""
    return f"={json.dumps(schema['default'])}" if "default" in schema else ""


if __name__ == "__main__":
    print(reference_markdown(), end="")
