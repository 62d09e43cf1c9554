"""The routes of webhook push (docs/push.md), registered on the app by ``register``.

* ``POST /v1/messages/{id}/ack|nack|defer``: ack mode's callbacks, by message id (the dispatcher knows
  which queue and lease each waiting message has). Authorised like the queue's own settle calls:
  ``consume:<queue>``.
* ``POST /v1/queues/{queue}/push/rotate-secret``: a fresh signing secret, shown in this answer only
  (admin).
* ``GET /v1/queues/{queue}/push``: the push config and the dispatcher's state (running or paused on a
  401/403, counters); ``GET /v1/queues/{queue}/push/messages/{id}``: one message's push attempts
  (``read:<queue>``).
* The answer to ``PUT /v1/queues/{queue}`` gains ``config.push.secret`` when that PUT made the secret
  (push configured for the first time): an ``after_request`` hook, so ``app.py`` needs no change.

The token gate (``auth.py``) sees these paths as needing only a valid token, since their queue is not in
the path (or not where ``paths.py`` looks); the scope is checked here once the queue is known.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

from quart import Response, g, request
from quart_trio import QuartTrio

from broker.config import Limits
from broker.core.commands import Ack, Command, UpdateConfig
from broker.core.model import ConfigChange
from broker.errors import BrokerError, Forbidden, InvalidRequest, MessageNotFound, quoted_value
from broker.http import parse
from broker.http.auth import SCOPE_KEY, Grant
from broker.http.observe import bind_request
from broker.http.quart_io import read_object, respond
from broker.http.render import encode
from broker.push import PushSupervisor, secret
from broker.registry import Registry
from broker.storage.codec import cbor_loads, json_loads


def may(kind: str, queue: str) -> bool:
    """Whether the token of the request being served has ``kind`` (``admin``, or ``read``, ``publish``,
    ``consume`` on ``queue``); True with no tokens configured (the gate is not installed)."""
    grant = cast("Grant | None", request.scope.get(SCOPE_KEY))
    if grant is None:
        return True
    return grant.admin if kind == "admin" else grant.may(kind, queue)


def require_scope(kind: str, queue: str) -> None:
    """Refuse (403) the request being served unless its token has ``kind`` on ``queue`` (``may``): for
    routes whose queue the token gate cannot see."""
    if not may(kind, queue):
        raise Forbidden(f"this needs the scope {kind if kind == 'admin' else f'{kind}:{queue}'}")


def require_scope_by_id(kind: str, queue: str, not_found: BrokerError) -> None:
    """As ``require_scope``, for a route that found ``queue`` from a message's id. A token that may not
    even read that queue gets ``not_found``, as for an id that is nowhere: ids are predictable, and a
    403 naming the scope would tell it that the message exists, and in which queue. A token that may
    gets the queue named on the request's log lines (§10), which the route's path could not do."""
    if may(kind, queue):
        bind_request(queue=queue)
        return
    if kind != "read" and may("read", queue):
        require_scope(kind, queue)  # it may see the message: say what it lacks
    raise not_found


async def settle_callback(
    supervisor: PushSupervisor,
    message_id: str,
    verb: str,
    command: Callable[[Sequence[str]], Command],
    lease_id: str | None = None,
) -> dict[str, Any]:
    """Carry out an ack-mode callback (``verb``: ack, nack or defer) for the pushed message
    ``message_id`` (its delivery ``lease_id`` only, when given), authorised like a settle call on its
    queue (``consume``). Raises ``MessageNotFound`` when no push waits on it, ``Conflict`` when it was
    settled otherwise (acks.py)."""
    queue = supervisor.queue_of(message_id)
    not_found = MessageNotFound(f"no push of message {quoted_value(message_id)} waits for a callback")
    if queue is None:
        raise not_found
    require_scope_by_id("consume", queue, not_found)
    return await supervisor.settle(message_id, verb, command, lease_id)


def register(
    app: QuartTrio, registry: Registry, supervisor: PushSupervisor, limits: Limits | None = None
) -> None:
    limits = limits or Limits()

    async def body_object() -> Mapping[str, Any]:
        return (await read_object())[0]

    need = require_scope

    async def callback(
        message_id: str, body: Mapping[str, Any], verb: str, command: Callable[[Sequence[str]], Command]
    ) -> Response:
        lease_id = body.get("lease_id")
        if lease_id is not None and not isinstance(lease_id, str):
            raise InvalidRequest("lease_id must be the push envelope's lease_id, a string")
        return respond(await settle_callback(supervisor, message_id, verb, command, lease_id))

    # -- ack mode's callbacks ------------------------------------------------------------------------

    @app.post("/v1/messages/<message_id>/ack")
    async def push_ack(message_id: str) -> Response:
        body = await body_object()
        parse.known_fields(body, {"lease_id"}, "the ack")
        return await callback(message_id, body, "ack", Ack)

    @app.post("/v1/messages/<message_id>/nack")
    async def push_nack(message_id: str) -> Response:
        body = await body_object()
        parse.known_fields(body, {"retryable", "delay", "reason", "lease_id"}, "the nack")
        nack = parse.nack_of((), body, limits)  # checked before anything is settled
        return await callback(message_id, body, "nack", lambda leases: replace(nack, lease_ids=leases))

    @app.post("/v1/messages/<message_id>/defer")
    async def push_defer(message_id: str) -> Response:
        body = await body_object()
        parse.known_fields(body, {"retry_after", "reason", "lease_id"}, "the defer")
        defer = parse.defer_of((), body, limits)
        return await callback(message_id, body, "defer", lambda leases: replace(defer, lease_ids=leases))

    # -- the secret ----------------------------------------------------------------------------------

    @app.post("/v1/queues/<queue>/push/rotate-secret")
    async def push_rotate_secret(queue: str) -> Response:
        need("admin", queue)
        parse.no_body(await body_object(), "rotating the secret")
        change: ConfigChange = await registry.get(queue).request(UpdateConfig({}, new_push_secret=True))
        push = change.after.push  # the secret this rotation made, not one a PUT made since
        assert push is not None  # the rotation's change holds a whole push config
        return respond({"queue": queue, "secret": push.secret})

    @app.after_request
    async def show_a_new_secret_once(response: Response) -> Response:
        """The answer to the PUT whose own change made a push secret shows it (app.py sets
        ``g.config_change``): no other answer does, nor a PUT that ran while another made one."""
        change: ConfigChange | None = g.get("config_change")
        if change is None or response.status_code not in (200, 201):
            return response
        new_secret = secret.revealed(change.before, change.after)
        if new_secret is None:
            return response
        raw = await response.get_data(as_text=False)
        cbor = response.mimetype == parse.CBOR
        answer = cbor_loads(raw) if cbor else json_loads(raw)
        push = answer.get("config", {}).get("push")
        if isinstance(push, dict):
            push["secret"] = new_secret
            response.set_data(encode(answer, cbor)[0])
        return response

    # -- state and history ---------------------------------------------------------------------------

    @app.get("/v1/queues/<queue>/push")
    async def push_status(queue: str) -> Response:
        need("read", queue)
        push = registry.get(queue).config.push
        return respond(
            {
                "queue": queue,
                "config": None if push is None else push.to_dict(),
                "status": supervisor.status(queue),
            }
        )

    @app.get("/v1/queues/<queue>/push/messages/<message_id>")
    async def push_history(queue: str, message_id: str) -> Response:
        need("read", queue)
        registry.get(queue)
        attempts = supervisor.history(queue, message_id)
        if attempts is None:
            raise MessageNotFound(
                f"no push of message {quoted_value(message_id)} is remembered for queue {queue!r}"
            )
        return respond({"id": message_id, "queue": queue, "attempts": [a.to_dict() for a in attempts]})


__all__ = ["register", "require_scope", "require_scope_by_id", "settle_callback"]
