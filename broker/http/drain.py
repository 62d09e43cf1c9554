"""Graceful shutdown, request by request (§10).

Once the broker begins to shut down, ``Drain`` refuses every request that starts: 503
``shutting_down``, nothing applied. Requests already running finish within the grace period, and
every answer given from then on says ``Connection: close``, so no client sends another request on
a connection the server is about to close.

Why refuse rather than serve: the HTTP server closes idle keep-alive connections when it stops, and
a request that arrives on one at that moment can be applied and still lose its answer (the client
sees a dropped connection and cannot tell). A request refused at its start changes nothing, so its
fate is never in doubt, and a client that sees ``shutting_down`` knows to retry elsewhere or later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

from broker.errors import ShuttingDown
from broker.http.asgi import ASGIApp
from broker.http.render import send_error

_CLOSE = (b"connection", b"close")


class Drain:
    def __init__(self, app: ASGIApp, draining: Callable[[], bool]) -> None:
        self._app = app
        self._draining = draining

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if self._draining():
            refusal = ShuttingDown("the broker is shutting down; retry on another or later")
            await send_error(send, scope, refusal, _CLOSE)
            return

        async def closing_send(message: Any) -> None:
            if message["type"] == "http.response.start" and self._draining():
                message = {**message, "headers": [*message.get("headers", ()), _CLOSE]}
            await send(message)

        await self._app(scope, receive, closing_send)
