"""One log line and one timing per request, with a request id (§10).

``Observer`` is the outermost ASGI layer. For each HTTP request it takes the client's ``X-Request-Id``
(when it is a short, printable token) or makes one, echoes it in the answer, binds it and the queue to
structlog's context for every line logged while the request runs (a claim adds its consumer), and when
the answer ends (for a push stream: when it closes) records its duration under its route template and
status (``metrics.RequestTimes``) and logs ``request`` at info: method, route, path, status, duration.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

from broker.http.paths import target_of
from broker.metrics import RequestTimes

ASGIApp = Callable[[Scope, ASGIReceiveCallable, ASGISendCallable], Awaitable[None]]

log = structlog.get_logger("broker.http")

_MAX_ID = 64
#: The status logged for a request that ended without an answer (nginx's "client closed request").
CLIENT_LEFT = 499


def _usable_id(value: bytes) -> str | None:
    if 0 < len(value) <= _MAX_ID and value.isascii():
        text = value.decode()
        if text.isprintable() and " " not in text:
            return text
    return None


class Observer:
    def __init__(self, app: ASGIApp, times: RequestTimes) -> None:
        self._app = app
        self._times = times
        self._numbers = itertools.count(1)
        self._prefix = f"{int(time.time() * 1000) % (1 << 32):08x}"

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = None
        for name, value in scope["headers"]:
            if name.lower() == b"x-request-id":
                request_id = _usable_id(value)
                break
        if request_id is None:
            request_id = f"{self._prefix}-{next(self._numbers):x}"
        method, path = scope["method"], scope["path"]
        target = target_of(method, path)
        status = 0  # until the app answers
        echoed = request_id.encode()

        async def observed_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", echoed)]}
            await send(message)

        bound = structlog.contextvars.bind_contextvars(request_id=request_id, queue=target.queue)
        try:
            await self._app(scope, receive, observed_send)
        finally:
            seconds = time.perf_counter() - started
            if status == 0:  # no answer: the client left (a cancelled long poll), or a bug raised
                status = CLIENT_LEFT
            self._times.observe(target.route, status, seconds)
            log.info(
                "request",
                method=method,
                route=target.route,
                path=path,
                status=status,
                ms=round(seconds * 1000, 3),
            )
            structlog.contextvars.reset_contextvars(**bound)
            structlog.contextvars.unbind_contextvars("consumer")  # a route may have bound it
