"""A broker with webhook push wired in, and receivers for it to push to.

``pushing`` opens an in-process broker whose push supervisor (started by ``open_broker``, with the push
routes registered) uses the test's transport. A ``Receiver`` is the user's endpoint: a small ASGI app
that records every request and answers with whatever the test's ``answer`` function says. It is served
two ways: on a real loopback socket by Hypercorn (``served``, for end-to-end tests under the real
clock, through the dispatcher's real connection pool), or in memory (``receiver.transport()``, a fake
of ``broker.push.transport.Transport`` that calls the receiver directly, for tests that move time with
the autojump clock, which a real socket would race).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from broker.config import Settings
from broker.push import PushSupervisor
from broker.push.transport import Answer as TransportAnswer
from broker.push.transport import Transport
from broker.server import Broker, open_broker
from tests.conftest import Client


@dataclass
class Received:
    """One request the receiver got."""

    at: float  # trio time
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


Answer = Callable[[Received], Awaitable[tuple[int, dict[str, str]]]]


async def ok(_: Received) -> tuple[int, dict[str, str]]:
    return 200, {}


@dataclass
class Receiver:
    answer: Answer = ok
    requests: list[Received] = field(default_factory=list)
    in_progress: int = 0
    most_in_progress: int = 0

    async def handle(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str]]:
        received = Received(trio.current_time(), method, path, headers, body)
        self.requests.append(received)
        self.in_progress += 1
        self.most_in_progress = max(self.most_in_progress, self.in_progress)
        try:
            return await self.answer(received)
        finally:
            self.in_progress -= 1

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app Hypercorn serves."""
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {name.decode().lower(): value.decode() for name, value in scope["headers"]}
        status, extra = await self.handle(scope["method"], scope["path"], headers, body)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(name.encode(), value.encode()) for name, value in extra.items()],
            }
        )
        await send({"type": "http.response.body", "body": b"{}"})

    def transport(self) -> InMemoryTransport:
        return InMemoryTransport(self)


@dataclass
class InMemoryTransport:
    """The dispatcher's transport, answered by a ``Receiver`` in the same task: no socket, so the
    autojump clock can move time without racing one. (Name resolution and the private-address check
    belong to the real pool: tests/push/test_transport.py.)"""

    receiver: Receiver
    closed: bool = False

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], *, allow_private: bool
    ) -> TransportAnswer:
        await trio.lowlevel.checkpoint()
        lowered = {name.lower(): value for name, value in headers.items()}
        status, extra = await self.receiver.handle("POST", urlsplit(url).path, lowered, body)
        extra = {name.lower(): value for name, value in extra.items()}
        return TransportAnswer(status, extra.get("retry-after"))

    def close(self) -> None:
        self.closed = True


@asynccontextmanager
async def served(receiver: Receiver) -> AsyncIterator[str]:
    """Serve ``receiver`` on a loopback port; yields its base URL."""
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn_serve, receiver, config))
        yield binds[0]
        nursery.cancel_scope.cancel()


@dataclass
class Pushing:
    broker: Broker
    supervisor: PushSupervisor
    client: Client


@asynccontextmanager
async def pushing(transport: Transport | None = None) -> AsyncIterator[Pushing]:
    """An in-memory broker with the push supervisor running and the push routes registered."""
    # An in-memory transport means an autojump clock, where every poll costs a wakeup of simulated time.
    options = {"poll_interval": 0.05 if transport is None else 0.5, "transport": transport}
    async with open_broker(Settings(in_memory=True), push_options=options) as broker:
        assert broker.push is not None
        async with broker.app.test_app() as test_app:
            yield Pushing(broker, broker.push, test_app.test_client())


async def wait_until(condition: Callable[[], Any], *, within: float = 10.0) -> None:
    """Wait until ``condition()`` is true, looking every 20 ms of the test's clock; fail after ``within``
    seconds of it. (What is awaited spans the receiver, the dispatcher and the actor, which offer no
    event for it; under the autojump clock the looking costs no real time.)"""
    with trio.fail_after(within):
        while not condition():  # noqa: ASYNC110
            await trio.sleep(0.02)


async def put_queue(client: Client, name: str = "jobs", **config: Any) -> dict[str, Any]:
    response = await client.put(f"/v1/queues/{name}", json=config)
    assert response.status_code in (200, 201), await response.get_data()
    body: dict[str, Any] = await response.get_json()
    return body


async def publish(client: Client, payload: Any = None, name: str = "jobs", **fields: Any) -> str:
    response = await client.post(f"/v1/queues/{name}/messages", json={"payload": payload, **fields})
    assert response.status_code == 201, await response.get_data()
    message_id: str = (await response.get_json())["messages"][0]["id"]
    return message_id


async def stats(client: Client, name: str = "jobs") -> dict[str, Any]:
    response = await client.get(f"/v1/queues/{name}")
    assert response.status_code == 200, await response.get_data()
    result: dict[str, Any] = (await response.get_json())["stats"]
    return result


async def message(client: Client, message_id: str, name: str = "jobs") -> dict[str, Any]:
    response = await client.get(f"/v1/queues/{name}/messages/{message_id}")
    assert response.status_code == 200, await response.get_data()
    result: dict[str, Any] = await response.get_json()
    return result
