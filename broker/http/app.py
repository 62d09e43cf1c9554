"""The Quart-trio application: each route parses, sends one command to a queue's actor, and renders.

No queue logic lives here. The hot routes (publish, claim and the four settle calls) are plain
functions in ``routes.py``: they are registered here as Quart views, and served in practice by the ASGI
fast path (``fastpath.py``) that ``create_app`` installs in front of Quart; so is the push stream
(``GET …/work``, ``stream.py``). Errors from anywhere become the contract's error body (§2) through one
mapping, ``render.error_answer``; only a bug in the broker answers 500. Bodies are read, and answers
made, by ``quart_io``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import MethodNotAllowed

from broker.config import Limits
from broker.core import MessageView, QueueConfig, QueueStats
from broker.core.commands import (
    Command,
    DeleteMessage,
    GetMessage,
    Purge,
)
from broker.errors import Conflict, StorageUnavailable
from broker.http import parse, render
from broker.http.auth import grant_of
from broker.http.fastpath import FastPath
from broker.http.quart_io import no_content, prefers_cbor, read_body, respond
from broker.http.render import encode, encode_listing, error_answer
from broker.http.routes import HotRoute, hot_routes
from broker.http.stream import HEARTBEAT_CONFIG, WorkRoute
from broker.registry import Registry
from broker.storage.store import Snapshotter
from broker.stream import HEARTBEAT_INTERVAL

Route = Callable[[str], Awaitable[Response]]
T = TypeVar("T")


def _nothing() -> None:
    pass


class _QuartExchange:
    """A hot route's request through Quart (see ``routes.Exchange``)."""

    __slots__ = ("cbor",)

    def __init__(self) -> None:
        self.cbor = prefers_cbor()

    async def read_body(self) -> tuple[Any, bool]:
        return await read_body()

    async def long_poll(self, request: Callable[[Callable[[], None]], Awaitable[T]]) -> T:
        return await request(_nothing)  # Quart-trio cancels the whole view when the client disconnects


def _view(route: HotRoute) -> Route:
    """The Quart view of a hot route: the same logic, with the body and headers from Quart's request."""

    async def view(queue: str, **parameters: str) -> Response:  # parameters: the segment's, in order
        status, data = await route.handle(queue, _QuartExchange(), *parameters.values())
        return respond(data, status)

    return view


def create_app(
    registry: Registry,
    limits: Limits | None = None,
    snapshots: Snapshotter | None = None,
    push_status: Callable[[str], Mapping[str, Any] | None] | None = None,
) -> QuartTrio:
    limits = limits or Limits()
    app = QuartTrio("broker")
    # Werkzeug's router would otherwise serve ``//v1/queues/x`` (and ``/%2Fv1/…``) as
    # ``/v1/queues/x``, and redirect ``/v1//queues/x`` to it, while the token gate, which names a
    # request by its path as sent (paths.py), sees no route there and lets any valid token through:
    # both layers must read a path alike, so a path with an empty segment is no route at all.
    app.url_map.merge_slashes = False
    app.config["MAX_CONTENT_LENGTH"] = limits.max_body_bytes
    app.config["BODY_TIMEOUT"] = 60
    app.config[HEARTBEAT_CONFIG] = HEARTBEAT_INTERVAL
    # Quart answers OPTIONS on every route with an empty text/html 200 (and any token passes the gate
    # for it): no part of the API, which sends no CORS headers either. It is a 405, as other methods are.
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False

    async def ask(queue: str, command: Command) -> Any:
        return await registry.get(queue).request(command)

    @app.errorhandler(Exception)  # BrokerError, HTTPException (e.g. a 405) and bugs alike
    async def error_response(error: Exception) -> Response:
        status, data, headers = error_answer(error, request.method, request.path)
        body, media_type = encode(data, render.answers_cbor(request.scope))  # JSON under /compat/
        response = Response(body, status, content_type=media_type)
        for name, value in headers:
            response.headers[name] = value
        return response

    @app.get("/healthz")
    async def healthz() -> Response:
        return respond({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        """Ready once recovered (the server listens only after recovery) and while the journal can be
        written, which takes room on its disk too; else 503, so a load balancer sends durable writes
        elsewhere before they fail."""
        journal = registry.journal
        if not journal.healthy:
            raise StorageUnavailable("the journal cannot be written; reads still work")
        if not journal.has_room():
            raise StorageUnavailable(
                "the journal's disk is full: durable writes would fail; reads still work"
            )
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
        parse.no_body((await read_body())[0], "taking a snapshot")
        taker = snapshotter()
        info = await taker.take()
        if info is None:  # nothing new since the newest one: that one covers everything
            newest = await taker.list()
            return respond({"snapshot": newest[0].to_dict() if newest else None, "new": False})
        return respond({"snapshot": info.to_dict(), "new": True}, 201)

    # -- queues (§3) ---------------------------------------------------------------------------------

    async def describe(name: str) -> dict[str, Any]:
        actor = registry.get(name)
        return described(name, actor.config, await actor.stats())

    def described(name: str, config: QueueConfig, queue_stats: QueueStats) -> dict[str, Any]:
        answer = render.queue(name, config, queue_stats)
        if push_status is not None and config.push is not None:
            answer["push"] = push_status(name)  # running or paused (and why), counters; null until it runs
        return answer

    @app.get("/v1/queues")
    async def list_queues() -> Response:
        """Every queue; with tokens, the queues the request's token may read."""
        grant = grant_of(request.scope)
        cbor = prefers_cbor()
        wanted = None if grant is None else lambda name: grant.may("read", name)
        queues = [
            encode(described(actor.name, actor.config, stats), cbor)[0]
            async for actor, stats in registry.each_with_stats(wanted)
        ]
        body, media_type = encode_listing("queues", queues, cbor)
        return Response(body, 200, content_type=media_type)

    @app.put("/v1/queues/<queue>")
    async def put_queue(queue: str) -> Response:
        body, _ = await read_body()
        created, change = await registry.put(queue, parse.queue_config(body))
        g.config_change = change  # for push_routes: a push secret this change made is shown once
        return respond(described(queue, change.after, change.stats), 201 if created else 200)

    @app.get("/v1/queues/<queue>")
    async def get_queue(queue: str) -> Response:
        return respond(await describe(queue))

    @app.delete("/v1/queues/<queue>")
    async def delete_queue(queue: str) -> Response:
        await registry.delete(queue).wait()
        return no_content()

    @app.post("/v1/queues/<queue>/purge")
    async def purge(queue: str) -> Response:
        parse.no_body((await read_body())[0], "the purge")
        purged: int = await ask(queue, Purge())
        return respond({"purged": purged})

    # -- publishing (§4), claiming and settling (§5): the hot routes ---------------------------------

    routes = hot_routes(registry, limits)
    for route in routes.values():
        app.add_url_rule(
            f"/v1/queues/<queue>/{route.segment}", route.endpoint, _view(route), methods=["POST"]
        )

    # -- dead letters and inspection (§6) ---------------------------------------------------------

    @app.post("/v1/queues/<queue>/redrive")
    async def redrive(queue: str) -> Response:
        body, _ = await read_body()
        ids, to = parse.redrive(body, limits)
        return respond(render.redriven(await registry.redrive(queue, ids, to)))

    @app.get("/v1/queues/<queue>/messages")
    async def browse(queue: str) -> Response:
        command = parse.browse(parse.query_values(request.args.items(multi=True)))
        views: list[MessageView] = await ask(queue, command)
        cbor = prefers_cbor()
        return respond({"messages": [render.message_view(view, cbor, with_history=False) for view in views]})

    @app.get("/v1/queues/<queue>/messages/<message_id>")
    async def get_message(queue: str, message_id: str) -> Response:
        view: MessageView = await ask(queue, GetMessage(message_id))
        return respond(render.message_view(view, prefers_cbor(), with_history=True))

    @app.delete("/v1/queues/<queue>/messages/<message_id>")
    async def delete_message(queue: str, message_id: str) -> Response:
        await ask(queue, DeleteMessage(message_id))
        return no_content()

    # -- push to workers (§7) -----------------------------------------------------------------------

    @app.get("/v1/queues/<queue>/work")
    async def work(queue: str) -> Response:
        """Kept in the URL map (so other methods get 405); GET is served by the fast path, which only
        leaves a HEAD here (Werkzeug routes HEAD to every GET): a 405 too, as a stream that would lease
        messages has no head to show."""
        raise MethodNotAllowed(valid_methods=["GET"])

    # Flask's middleware idiom: Hypercorn and the test client both call app.asgi_app.
    work_route = WorkRoute(registry, limits, app.config)
    app.asgi_app = FastPath(app.asgi_app, routes, app.config, work_route)  # type: ignore[method-assign]
    return app


__all__ = ["create_app"]
