"""An ASGI fast path in front of the Quart app for the six hot routes (and the ``/work`` stream).

Why it exists: on the benchmark machine a request through a Quart-trio route costs 1.5 to 2.0 ms of server
CPU against 1.0 to 1.35 ms for a bare ASGI callable on the same Hypercorn/Trio stack (``python -m bench
floor``), and the hot routes are nearly all of a drain's requests. Quart's share is its request and
response objects, header models, URL routing, app and request contexts, and two tasks per request (one
reading the body, one running the view). This middleware serves ``POST
/v1/queues/{queue}/messages|claim|ack|nack|defer|extend`` straight from the ASGI messages and passes
every other request (other methods, other paths, lifespan, websockets) to Quart unchanged. See
docs/benchmarks.md for what it saves.

It is installed as the app's ``asgi_app`` (Flask's middleware idiom), so Hypercorn and Quart's test
client both go through it. It holds no route logic: it calls the same functions as the Quart views
(``routes.hot_routes``) and maps errors with the same ``render.error_answer``. What it re-implements is
Quart's handling of a request around a view, exactly as these routes see it:

- the body: a ``Content-Length`` over ``MAX_CONTENT_LENGTH`` is 413 before anything is read (the
  view's own check); a body that grows past it while arriving is 413 as Quart's ``RequestEntityTooLarge``;
  one that takes longer than ``BODY_TIMEOUT`` is Quart's 408;
- ``Content-Type`` and ``Accept`` are read from the first header of each name, case-insensitively;
- a client that hangs up during a long poll (a claim with ``wait`` that the actor holds because
  nothing is ready) cancels it, as Quart-trio does, so the claim is withdrawn rather than left parked.
  Other requests, and claims the actor answers at once, are not watched: they are answered within one
  round trip to the actor, and a command once sent is carried out anyway. Watching them too, as Quart
  does, takes a second task per request, about 0.1 ms of server CPU here. (The one difference: a
  request that waits to be queued behind a full actor inbox is no longer dropped when its client
  leaves meanwhile; a claim among them is answered, and its leases expire unless the client returns.)
- one ``http.response.start`` with ``content-type`` and ``content-length``, one ``http.response.body``.

It also serves ``GET /v1/queues/{queue}/work``, the push stream (``stream.py``): a response that lasts
as long as its client stays, which Quart's response timeout would cut short; and the stream's stop call
(``POST /v1/queues/{queue}/work/{stream_id}/stop``), a hot route with a path parameter, matched
segment by segment after the six plain ones miss.

A query on a route under ``/v1/`` that reads none (every one but browse and ``/work``) is refused here,
for the Quart routes too, with a 400 as an unknown field in a body is (``paths.QUERY_ROUTES``).

Anything added to Quart around requests (``before_request`` hooks, authentication) does not run for
these routes: it must be added here too.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote_plus

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope, Scope
from werkzeug.exceptions import RequestEntityTooLarge, RequestTimeout
from werkzeug.sansio.utils import get_content_length

from broker.errors import InvalidRequest, quoted_value
from broker.http import parse
from broker.http.asgi import ASGIApp, cancel_on_disconnect
from broker.http.paths import takes_no_query, target_of
from broker.http.render import encode, send_error
from broker.http.routes import HotRoute, body_too_large
from broker.http.stream import WorkRoute

T = TypeVar("T")

_PREFIX = "/v1/queues/"
_WORK = "/work"
_CBOR = parse.CBOR.encode()
_MEDIA_TYPES = {parse.JSON: parse.JSON.encode(), parse.CBOR: _CBOR}


class _Disconnected(Exception):
    """The client went away before its answer: nobody is left to answer."""


class FastPath:
    """ASGI middleware: serves the hot routes itself and hands everything else to ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        routes: Mapping[str, HotRoute],
        config: Mapping[str, Any],
        work: WorkRoute | None = None,
    ) -> None:
        self._app = app
        self._routes = routes
        #: The hot routes whose segment holds path parameters, split into segments.
        self._templates = [
            (segment.split("/"), route) for segment, route in routes.items() if route.parameters
        ]
        #: The Quart app's config, read per request as Quart reads it: MAX_CONTENT_LENGTH, BODY_TIMEOUT.
        self._config = config
        #: ``GET /v1/queues/{queue}/work``, the push stream (``stream.py``).
        self._work = work

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            method = scope["method"]
            if scope["query_string"]:
                route_name = target_of(method, scope["path"]).route
                if takes_no_query(route_name):
                    await self._refuse_query(route_name, scope, send)
                    return
            if method == "POST":
                path: str = scope["path"]
                if path.startswith(_PREFIX):
                    queue, _, segment = path[len(_PREFIX) :].partition("/")
                    route = self._routes.get(segment)
                    if route is not None and queue:
                        await self._serve(route, queue, scope, receive, send)
                        return
                    if queue and self._templates and "/" in segment:
                        found = self._match(segment)
                        if found is not None:
                            await self._serve(found[0], queue, scope, receive, send, found[1])
                            return
            elif method == "GET" and self._work is not None:
                path = scope["path"]
                if path.startswith(_PREFIX) and path.endswith(_WORK):
                    queue = path[len(_PREFIX) : -len(_WORK)]
                    if queue and "/" not in queue:
                        await self._work(queue, scope, receive, send)
                        return
        await self._app(scope, receive, send)

    @staticmethod
    async def _refuse_query(route: str, scope: HTTPScope, send: ASGISendCallable) -> None:
        """400 for a query on a native route that reads none (``paths.QUERY_ROUTES``), as an unknown field
        in a body is: ``POST …/claim?wait=5`` was silently a claim with no long poll."""
        name = unquote_plus(scope["query_string"].partition(b"&")[0].partition(b"=")[0].decode("latin1"))
        refusal = InvalidRequest(f"unknown field {quoted_value(name)} in the query; {route} takes no query")
        await send_error(send, scope, refusal)

    def _match(self, segment: str) -> tuple[HotRoute, list[str]] | None:
        """The hot route with path parameters that ``segment`` matches, and their values."""
        parts = segment.split("/")
        for template, route in self._templates:
            if len(template) != len(parts):
                continue
            values = []
            for expected, actual in zip(template, parts, strict=True):
                if expected.startswith("<"):
                    if not actual:
                        break
                    values.append(actual)
                elif expected != actual:
                    break
            else:
                return route, values
        return None

    async def _serve(
        self,
        route: HotRoute,
        queue: str,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        parameters: Sequence[str] = (),
    ) -> None:
        exchange = _Exchange(scope, receive, self._config)
        try:
            status, data = await route.handle(queue, exchange, *parameters)
            body, media_type = encode(data, exchange.cbor)
        except _Disconnected:
            return
        except Exception as error:  # an answer that cannot be encoded too: a bug, but §2's error body
            await send_error(send, scope, error, cbor=exchange.cbor)
            return
        raw_headers = [(b"content-type", _MEDIA_TYPES[media_type]), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": raw_headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class _Exchange:
    """One hot-route request straight from the ASGI messages (see ``routes.Exchange``)."""

    __slots__ = ("_config", "_receive", "cbor", "content_length", "content_type")

    def __init__(self, scope: HTTPScope, receive: ASGIReceiveCallable, config: Mapping[str, Any]) -> None:
        self._receive = receive
        self._config = config
        content_type = content_length = transfer_encoding = accept = None
        for raw_name, value in scope["headers"]:
            name = raw_name.lower()
            # The first header of each name counts, as with werkzeug's Headers.get.
            if name == b"content-type":
                if content_type is None:
                    content_type = value.decode("latin1")
            elif name == b"accept":
                if accept is None:
                    accept = value
            elif name == b"content-length":
                if content_length is None:
                    content_length = value.decode("latin1")
            elif name == b"transfer-encoding" and transfer_encoding is None:
                transfer_encoding = value.decode("latin1")
        self.content_type: str | None = content_type
        self.content_length = (
            None if content_length is None else get_content_length(content_length, transfer_encoding)
        )
        self.cbor = accept is not None and parse.wants_cbor(accept.decode("latin1"))

    async def read_body(self) -> tuple[Any, bool]:
        limit: int | None = self._config["MAX_CONTENT_LENGTH"]
        length = self.content_length
        # The test is written out, not called: a call would cost every request (~30 ns). The refusal is
        # the Quart routes' (quart_io.read_body).
        if length is not None and limit is not None and length > limit:
            raise body_too_large(length, limit)
        timeout: float | None = self._config["BODY_TIMEOUT"]
        with trio.move_on_after(math.inf if timeout is None else timeout) as waited:
            data = await self._receive_body(limit)
        if waited.cancelled_caught:
            raise RequestTimeout()
        return parse.decode_body(self.content_type, data)

    async def _receive_body(self, limit: int | None) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] != "http.request":
                raise _Disconnected
            chunk = message.get("body", b"")
            if chunk:
                parts.append(chunk)
                size += len(chunk)
                if limit is not None and size > limit:
                    raise RequestEntityTooLarge()
            if not message.get("more_body", False):
                return parts[0] if len(parts) == 1 else b"".join(parts)

    async def long_poll(self, request: Callable[[Callable[[], None]], Awaitable[T]]) -> T:
        # Only once the actor holds the claim is a second task worth its cost (~0.1 ms of the server's
        # CPU per request here): it waits for the client to hang up while this one waits for the answer.
        # A claim answered at once, the common case under load, never starts it.
        answer: tuple[T] | None = None
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:

            def watch() -> None:
                nursery.start_soon(cancel_on_disconnect, self._receive, nursery.cancel_scope)

            try:
                answer = (await request(watch),)
            except Exception as error:  # raised below: the nursery would wrap it in an exception group
                failure = error
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if answer is None:  # the watcher cancelled the nursery: nobody is left to answer
            raise _Disconnected
        return answer[0]
