"""qhook's pull-mode queue API, under ``/compat/qhook`` (docs/compat.md): a consumer written for qhook
works against this broker once its base URL is ``http://<broker>/compat/qhook``.

Each route translates onto the native operations; nothing here keeps queue state:

* ``GET /api/queues`` → the queues the token may read or consume, in qhook's shape.
* ``GET /api/queues/{name}/messages?wait=10s&batch=5`` → ``Claim`` (``wait`` ≤ 30 s, ``batch`` 1…100).
* ``POST /api/queues/{name}/ack|nack`` ``{"ids": […]}`` → ``FindLeases`` (the lease of each message's
  latest delivery, which settles it while it holds that lease: ``QueueCore.find_leases``), then ``Ack`` /
  ``Nack`` of those leases: two commands, whatever the number of ids. No id → lease map is kept outside
  the queue's actor, so nothing here can go stale or grow.

Tokens stand in for qhook's per-queue keys: the gate asks ``consume:<name>`` for the three queue routes
and any valid token for the list (paths.py). Errors keep the broker's error body: qhook documents none.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import orjson
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import MethodNotAllowed

from broker.actor import QueueActor
from broker.clock import format_time
from broker.config import Limits
from broker.core import ClaimOutcome, SettleOutcome
from broker.core.commands import Ack, Claim, FindLeases, Nack
from broker.core.durations import parse_duration
from broker.core.model import Delivery
from broker.errors import InvalidRequest, quoted_value
from broker.http import parse
from broker.http.auth import grant_of
from broker.http.compat_io import json_response, lenient_body
from broker.http.observe import bind_request
from broker.registry import Registry

PREFIX = "/compat/qhook"
#: qhook's limits on a receive.
MAX_WAIT = 30.0
MAX_BATCH = 100
#: Message headers that carry qhook's event fields when a producer sets them (docs/compat.md).
EVENT_ID_HEADER = "x-event-id"
EVENT_TYPE_HEADER = "x-event-type"


def _consumer() -> str:
    grant = grant_of(request.scope)
    return "qhook" if grant is None else f"qhook:{grant.name}"


def duration_text(seconds: float) -> str:
    """A duration as qhook writes one: ``60s``, or ``500ms`` below whole seconds."""
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{round(seconds * 1000)}ms"


def message(item: Delivery) -> dict[str, Any]:
    """One delivery in qhook's shape: exactly its seven fields."""
    claimed, stored = item
    headers = dict(stored.headers or {})
    payload: Any = (
        base64.b64encode(stored.payload).decode() if stored.binary else orjson.Fragment(stored.payload)
    )
    return {
        "id": stored.id,
        "event_id": headers.get(EVENT_ID_HEADER) or stored.key or stored.id,
        "event_type": headers.get(EVENT_TYPE_HEADER),
        "payload": payload,
        "headers": headers,
        "attempt": claimed.attempt,
        "created_at": format_time(stored.published_at).removesuffix("Z"),  # qhook writes no zone
    }


def _batch(value: str | None) -> int:
    if value is None:
        return 1
    if parse.QUERY_INTEGER.fullmatch(value) is None:  # not int()'s: spaces, "1_0", any Unicode digit
        raise InvalidRequest(f"batch must be an integer from 1 to {MAX_BATCH}; got {quoted_value(value)}")
    batch = int(value)
    if not 1 <= batch <= MAX_BATCH:
        raise InvalidRequest(f"batch must be an integer from 1 to {MAX_BATCH}; got {batch}")
    return batch


def _ids(body: Any, limits: Limits) -> list[str]:
    if not isinstance(body, Mapping) or "ids" not in body or len(body) != 1:
        raise InvalidRequest('the body must be {"ids": [<message id>, …]}, with no other field')
    ids = body["ids"]
    if not isinstance(ids, list) or not all(isinstance(item, str) for item in ids):
        raise InvalidRequest("ids must be an array of message id strings")
    if len(ids) > limits.max_batch:
        raise InvalidRequest(f"ids holds at most {limits.max_batch} ids, not {len(ids)}")
    return ids


async def _leases(actor: QueueActor, message_ids: list[str]) -> list[str]:
    """The lease of each message's latest delivery, in one command; none for ids never delivered or
    unknown (a repeated id once)."""
    leases: dict[str, str] = await actor.request(FindLeases(message_ids))
    return list(leases.values())


def register(app: QuartTrio, registry: Registry, limits: Limits | None = None) -> None:
    limits = limits or Limits()

    @app.get(f"{PREFIX}/api/queues")
    async def qhook_list_queues() -> Response:
        grant = grant_of(request.scope)
        wanted = None if grant is None else lambda name: grant.may("read", name) or grant.may("consume", name)
        queues: list[dict[str, Any]] = [
            {
                "name": actor.name,
                "source": None,
                "events": [],
                "visibility_timeout": duration_text(actor.config.lease),
                "depth": stats.depth,
            }
            async for actor, stats in registry.each_with_stats(wanted)
        ]
        return json_response({"queues": queues})

    @app.get(f"{PREFIX}/api/queues/<queue>/messages")
    async def qhook_receive(queue: str) -> Response:
        if request.method == "HEAD":  # Werkzeug routes HEAD to every GET: this GET leases messages
            raise MethodNotAllowed(valid_methods=["GET"])
        actor = registry.get(queue)
        wait = parse_duration(request.args.get("wait", 0), "wait", high=MAX_WAIT)
        consumer = _consumer()
        bind_request(consumer=consumer)  # on the request's log lines (§10)
        claim = Claim(consumer, max_count=_batch(request.args.get("batch")), wait=wait)
        outcome: ClaimOutcome = await actor.request(claim)
        return json_response({"messages": [message(item) for item in outcome.deliveries]})

    @app.post(f"{PREFIX}/api/queues/<queue>/ack")
    async def qhook_ack(queue: str) -> Response:
        actor = registry.get(queue)
        leases = await _leases(actor, _ids(await lenient_body(), limits))
        if not leases:
            return json_response({"acked": 0})
        outcome: SettleOutcome = await actor.request(Ack(leases))
        return json_response({"acked": outcome.settled})

    @app.post(f"{PREFIX}/api/queues/<queue>/nack")
    async def qhook_nack(queue: str) -> Response:
        actor = registry.get(queue)
        leases = await _leases(actor, _ids(await lenient_body(), limits))
        if not leases:
            return json_response({"retried": 0, "dead": 0})
        outcome: SettleOutcome = await actor.request(Nack(leases))
        dead = outcome.dead_lettered
        return json_response({"retried": outcome.settled - dead, "dead": dead})


__all__ = ["PREFIX", "register"]
