"""Brokers for the client's tests: one served in this test's Trio run (``live_url``, for async tests,
autojump clock included), and one served from a thread of its own (``thread_url``, for the blocking
client and asyncio), both in memory on an ephemeral port; and loopback servers whose every byte the
test writes (``raw_server``), for what the broker never does."""

from __future__ import annotations

import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from typing import Any

import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from broker.config import Settings
from broker.server import open_broker


def _config() -> Config:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 5
    return config


async def _serve(settings: Settings | None = None, *, task_status: trio.TaskStatus[str]) -> None:
    """A broker on an ephemeral port until cancelled; ``task_status`` gets its URL."""
    stop = trio.Event()
    settings = settings or Settings(in_memory=True)
    async with open_broker(settings) as broker, trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, broker.app, _config(), shutdown_trigger=stop.wait))
        task_status.started(binds[0])
        try:
            await trio.sleep_forever()
        finally:
            broker.registry.end_streams()
            stop.set()


@pytest.fixture
async def live_url() -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(_serve)
        yield url
        nursery.cancel_scope.cancel()


@pytest.fixture
async def serve_broker() -> AsyncIterator[Callable[[Settings], Awaitable[str]]]:
    """Start a broker of the given settings in this test's Trio run: ``url = await serve_broker(…)``."""
    async with trio.open_nursery() as nursery:

        async def start(settings: Settings) -> str:
            url: str = await nursery.start(_serve, settings)
            return url

        yield start
        nursery.cancel_scope.cancel()


@pytest.fixture
def thread_url() -> Iterator[str]:
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        box["token"] = trio.lowlevel.current_trio_token()
        box["cancel"] = cancel = trio.CancelScope()
        with cancel:
            async with trio.open_nursery() as nursery:
                box["url"] = await nursery.start(_serve)
                started.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(30), "the broker did not start"
    try:
        yield box["url"]
    finally:
        trio.from_thread.run_sync(box["cancel"].cancel, trio_token=box["token"])
        thread.join(15)


class RawServer:
    """A loopback TCP server whose connection handler the test writes; counts connections."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self._handle = handle
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._run, args=(connection,), daemon=True).start()

    def _run(self, connection: socket.socket) -> None:
        with connection:
            self._handle(connection)

    def close(self) -> None:
        self.listener.close()


def read_request(connection: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            while len(body) < int(value):
                body += connection.recv(65536)
    return head


@pytest.fixture
def raw_server(
    request: pytest.FixtureRequest,
) -> Iterator[Callable[[Callable[[socket.socket], None]], RawServer]]:
    servers: list[RawServer] = []

    def start(handle: Callable[[socket.socket], None]) -> RawServer:
        server = RawServer(handle)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()
