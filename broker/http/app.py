"""The Quart-trio application: each route parses, sends one command to a queue's actor, and renders.

No queue logic lives here. Errors from anywhere become the contract's error body (§2) in one place,
``_error_response``; only a bug in the broker answers 500.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from broker.config import Limits
from broker.core import ClaimOutcome, MessageView, PublishedRef, QueueStats, SettleOutcome
from broker.core.commands import (
    Command,
    DeleteMessage,
    GetMessage,
    GetStats,
    Purge,
    UpdateConfig,
)
from broker.core.model import CONFLICT
from broker.errors import BrokerError, Conflict, PayloadTooLarge, StorageUnavailable
from broker.http import parse, render
from broker.registry import Registry
from broker.storage.codec import cbor_dumps
from broker.storage.store import Snapshotter

log = structlog.get_logger("broker.http")

Route = Callable[[str], Awaitable[Response]]

_HTTP_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def _wants_cbor() -> bool:
    return parse.CBOR in request.headers.get("Accept", "")


def respond(data: Any, status: int = 200) -> Response:
    if _wants_cbor():
        return Response(cbor_dumps(data), status, content_type=parse.CBOR)
    return Response(orjson.dumps(data), status, content_type=parse.JSON)


def _no_content() -> Response:
    response = Response(b"", 204)
    del response.headers["Content-Type"]
    return response


def _error_response(status: int, code: str, message: str) -> Response:
    return respond(render.error_body(code, message), status)


async def _body() -> tuple[Any, bool]:
    length = request.content_length
    limit = request.max_content_length
    if length is not None and limit is not None and length > limit:
        raise PayloadTooLarge(f"the body is {length} bytes; the limit is {limit}")
    data = await request.get_data(cache=False)
    return parse.decode_body(request.content_type, data if isinstance(data, bytes) else data.encode())


def create_app(
    registry: Registry, limits: Limits | None = None, snapshots: Snapshotter | None = None
) -> QuartTrio:
    limits = limits or Limits()
    app = QuartTrio("broker")
    app.config["MAX_CONTENT_LENGTH"] = limits.max_body_bytes
    app.config["BODY_TIMEOUT"] = 60

    async def ask(queue: str, command: Command) -> Any:
        return await registry.get(queue).request(command)

    @app.errorhandler(BrokerError)
    async def broker_error(error: BrokerError) -> Response:
        return _error_response(error.status, error.code, error.message)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        code = _HTTP_CODES.get(status, "internal_error" if status >= 500 else "invalid_request")
        response = _error_response(status, code, error.description or error.name)
        for name, value in error.get_headers():
            if name.lower() != "content-type":
                response.headers[name] = value  # e.g. Allow on a 405
        return response

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception) -> Response:
        log.exception("request_failed", path=request.path, method=request.method)
        return _error_response(500, "internal_error", "the broker hit a bug; the error was logged")

    @app.get("/healthz")
    async def healthz() -> Response:
        return respond({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        """Ready once recovered (the server listens only after recovery) and while the journal can be
        written; else 503, so a load balancer sends durable writes elsewhere."""
        if not registry.journal.healthy:
            raise StorageUnavailable("the journal cannot be written; reads still work")
        return respond({"status": "ready"})

    # -- snapshots (§8) ------------------------------------------------------------------------------

    def snapshotter() -> Snapshotter:
        if snapshots is None:
            raise Conflict("this broker runs in memory (--in-memory): it keeps no snapshots")
        return snapshots

    @app.get("/v1/admin/snapshots")
    async def list_snapshots() -> Response:
        return respond({"snapshots": [info.to_dict() for info in await snapshotter().list()]})

    @app.post("/v1/admin/snapshots")
    async def take_snapshot() -> Response:
        taker = snapshotter()
        info = await taker.take()
        if info is None:  # nothing new since the newest one: that one covers everything
            newest = await taker.list()
            return respond({"snapshot": newest[0].to_dict() if newest else None, "new": False})
        return respond({"snapshot": info.to_dict(), "new": True}, 201)

    # -- queues (§3) ---------------------------------------------------------------------------------

    async def describe(name: str) -> dict[str, Any]:
        actor = registry.get(name)
        queue_stats: QueueStats = await actor.request(GetStats())
        return render.queue(name, actor.core.config, queue_stats)

    @app.get("/v1/queues")
    async def list_queues() -> Response:
        queues = []
        for name in registry.names():
            try:
                queues.append(await describe(name))
            except BrokerError:  # deleted while we were listing
                continue
        return respond({"queues": queues})

    @app.put("/v1/queues/<queue>")
    async def put_queue(queue: str) -> Response:
        body, _ = await _body()
        if queue in registry:
            await ask(queue, UpdateConfig(parse.queue_config(body)))
            return respond(await describe(queue), 200)
        await registry.create(queue, parse.queue_config(body)).wait()
        return respond(await describe(queue), 201)

    @app.get("/v1/queues/<queue>")
    async def get_queue(queue: str) -> Response:
        return respond(await describe(queue))

    @app.delete("/v1/queues/<queue>")
    async def delete_queue(queue: str) -> Response:
        await registry.delete(queue).wait()
        return _no_content()

    @app.post("/v1/queues/<queue>/purge")
    async def purge(queue: str) -> Response:
        purged: int = await ask(queue, Purge())
        return respond({"purged": purged})

    # -- publishing (§4) -------------------------------------------------------------------------

    @app.post("/v1/queues/<queue>/messages")
    async def publish(queue: str) -> Response:
        actor = registry.get(queue)
        body, from_cbor = await _body()
        refs: list[PublishedRef] = await actor.request(parse.publish(body, limits, from_cbor))
        if all(outcome == CONFLICT for _, _, outcome in refs):
            return respond(render.conflict_error(refs[0][0]), 409)
        status = 200 if all(outcome for _, _, outcome in refs) else 201
        return respond(render.published(refs), status)

    # -- claiming and settling (§5) --------------------------------------------------------------

    @app.post("/v1/queues/<queue>/claim")
    async def claim(queue: str) -> Response:
        actor = registry.get(queue)
        body, _ = await _body()
        outcome: ClaimOutcome = await actor.request(parse.claim(body, limits))
        return respond(render.deliveries(outcome, _wants_cbor()))

    def settle_route(
        verb: str, parser: Callable[[Any, Limits], Command]
    ) -> Callable[[str], Awaitable[Response]]:
        async def settle(queue: str) -> Response:
            actor = registry.get(queue)
            body, _ = await _body()
            outcome: SettleOutcome = await actor.request(parser(body, limits))
            return respond(render.settled(outcome, verb))

        return settle

    for path, verb, parser in (
        ("ack", "acked", parse.ack),
        ("nack", "nacked", parse.nack),
        ("defer", "deferred", parse.defer),
        ("extend", "extended", parse.extend),
    ):
        app.add_url_rule(f"/v1/queues/<queue>/{path}", path, settle_route(verb, parser), methods=["POST"])

    # -- dead letters and inspection (§6) ---------------------------------------------------------

    @app.post("/v1/queues/<queue>/redrive")
    async def redrive(queue: str) -> Response:
        body, _ = await _body()
        ids, to = parse.redrive(body, limits)
        return respond(render.redriven(await registry.redrive(queue, ids, to)))

    @app.get("/v1/queues/<queue>/messages")
    async def browse(queue: str) -> Response:
        command = parse.browse(request.args)
        views: list[MessageView] = await ask(queue, command)
        cbor = _wants_cbor()
        return respond({"messages": [render.message_view(view, cbor, with_history=False) for view in views]})

    @app.get("/v1/queues/<queue>/messages/<message_id>")
    async def get_message(queue: str, message_id: str) -> Response:
        view: MessageView = await ask(queue, GetMessage(message_id))
        return respond(render.message_view(view, _wants_cbor(), with_history=True))

    @app.delete("/v1/queues/<queue>/messages/<message_id>")
    async def delete_message(queue: str, message_id: str) -> Response:
        await ask(queue, DeleteMessage(message_id))
        return _no_content()

    return app


__all__ = ["create_app"]
