"""The HTTP stack without the broker, to measure its own cost per request.

``python -m bench.floor_server asgi`` serves a bare ASGI callable on Hypercorn's Trio worker;
``python -m bench.floor_server quart`` serves one Quart-trio route; ``python -m bench.floor_server
asgi-handler`` serves the bare callable with the broker's connection handler installed
(``broker/http/connection.py``). All three answer ``GET /healthz`` with
the broker's body, use the broker's Hypercorn settings and garbage-collector tuning, listen on
127.0.0.1 on a free port, and print ``{"event": "listening", "url": ...}`` on stdout.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import orjson
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart import Response
from quart_trio import QuartTrio

from broker.http.connection import install as install_connection_handler
from broker.runtime import tune_gc

BODY = b'{"status":"ok"}'
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def bare_asgi(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


def quart_app() -> QuartTrio:
    app = QuartTrio("floor")

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response(BODY, 200, content_type="application/json")

    return app


async def main(kind: str) -> None:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    config.keep_alive_timeout = 75
    if kind == "asgi-handler":
        install_connection_handler()
    app: Any = quart_app() if kind == "quart" else bare_asgi
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config))
        sys.stdout.write(orjson.dumps({"event": "listening", "url": binds[0]}).decode() + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] not in (["asgi"], ["quart"], ["asgi-handler"]):
        sys.exit("usage: python -m bench.floor_server asgi|quart|asgi-handler")
    tune_gc()
    trio.run(main, sys.argv[1])
