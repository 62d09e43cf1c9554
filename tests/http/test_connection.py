"""Hypercorn's connection handler as the broker installs it (``broker/http/connection.py``): the
keep-alive timer that moves its deadline instead of starting a task per request, writes that take
their lock without a checkpoint, and the headers of every answer made once a second. A real Hypercorn
server in the test's Trio run, raw sockets as clients.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any
from wsgiref.handlers import format_date_time

import hypercorn.config
import hypercorn.trio.run
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.events import Closed, RawData
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext

from broker.http import connection
from broker.http.connection import AppInbox, ConnectionHandler, ServerConfig, install

TIMEOUT = 0.3  # keep_alive_timeout, in seconds
REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"
ANSWER_END = b"ok"
BIG = 16 * 1024 * 1024  # bytes: the body of /big


@dataclass
class Server:
    port: int
    stop: trio.Event
    release: trio.Event  # a request to /slow waits for it
    arrived: trio.Event  # set once a request to /slow is in the app
    stopped: trio.Event  # set once Hypercorn's serve has returned
    config: ServerConfig  # read again when the server stops (its graceful_timeout)


async def app(
    release: trio.Event, arrived: trio.Event, scope: dict[str, Any], receive: Any, send: Any
) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/slow":
        arrived.set()
        await release.wait()
    elif scope["path"] == "/stream":  # no content-length: the head goes out before the body is known
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await release.wait()
        await send({"type": "http.response.body", "body": ANSWER_END})
        return
    elif scope["path"] == "/empty":
        await send({"type": "http.response.start", "status": 204, "headers": [(b"Content-Length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    elif scope["path"] == "/big":  # more than the socket's buffers hold: written in several goes
        body = bytes(range(256)) * (BIG // 256)
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % BIG)]}
        )
        await send({"type": "http.response.body", "body": body})
        return
    elif scope["path"] == "/fails":  # a head, then the app fails before its body
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        raise RuntimeError("the app failed after its head")
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER_END})


@pytest.fixture
async def server(nursery: trio.Nursery) -> AsyncIterator[Server]:
    install()
    config = ServerConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = config.errorlog = None
    config.keep_alive_timeout = TIMEOUT
    config.graceful_timeout = 5
    stop, release, stopped, arrived = trio.Event(), trio.Event(), trio.Event(), trio.Event()

    async def serving(task_status: trio.TaskStatus[list[str]]) -> None:
        served = partial(app, release, arrived)
        await serve(served, config, shutdown_trigger=stop.wait, task_status=task_status)  # type: ignore[arg-type]
        stopped.set()

    binds = await nursery.start(serving)
    yield Server(int(binds[0].rsplit(":", 1)[1]), stop, release, arrived, stopped, config)
    stop.set()


async def request(stream: trio.SocketStream, path: str = "/") -> bytes:
    await stream.send_all(REQUEST.replace(b"GET / ", f"GET {path} ".encode()))
    received = b""
    with trio.fail_after(5):
        while not received.endswith(ANSWER_END):
            chunk = await stream.receive_some()
            assert chunk, f"closed before the answer; got {received!r}"
            received += chunk
    return received


async def closed_after(stream: trio.SocketStream) -> float:
    """Seconds until the server closes the connection."""
    started = trio.current_time()
    with trio.fail_after(TIMEOUT + 5):
        assert await stream.receive_some() == b""
    return trio.current_time() - started


def test_install_puts_the_handler_where_hypercorns_trio_worker_builds_connections() -> None:
    install()
    install()  # twice is harmless
    assert hypercorn.trio.run.TCPServer is ConnectionHandler
    assert issubclass(ConnectionHandler, TCPServer)


async def test_requests_keep_a_connection_open_and_it_closes_a_timeout_after_the_last(server: Server) -> None:
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        for _ in range(5):  # 0.6 timeouts apart, five times: three timeouts in all
            assert (await request(stream)).startswith(b"HTTP/1.1 200")
            await trio.sleep(TIMEOUT * 0.6)
        assert (await request(stream)).startswith(b"HTTP/1.1 200")
        assert TIMEOUT * 0.8 <= await closed_after(stream) < TIMEOUT + 2


async def test_each_answer_carries_the_date_it_was_made_in(server: Server) -> None:
    for _ in range(3):
        async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
            before = int(time.time())
            answer = await request(stream)
            after = int(time.time())
        head = dict(line.split(b": ", 1) for line in answer.split(b"\r\n\r\n")[0].split(b"\r\n")[1:])
        assert head[b"date"] in {format_date_time(second).encode() for second in range(before, after + 1)}
        assert head[b"server"] == b"hypercorn-h11"
        await trio.sleep(0.6)  # so that the three span at least one change of second


def test_the_headers_of_every_answer_are_made_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    now = 1_700_000_000.25
    made = 0

    def wall_clock() -> float:
        return now

    def hypercorns_clock() -> float:  # Hypercorn reads the time once per set of headers it makes
        nonlocal made
        made += 1
        return now

    monkeypatch.setattr(time, "time", wall_clock)
    monkeypatch.setattr(hypercorn.config, "time", hypercorns_clock)
    config = ServerConfig()

    first = config.response_headers("h11")
    assert first == [(b"date", format_date_time(now).encode()), (b"server", b"hypercorn-h11")]
    first.append((b"x-mine", b"1"))  # the caller's own list: the next answer does not get this
    now += 0.7
    assert config.response_headers("h11") == first[:2]
    assert config.response_headers("h2") == [(b"date", first[0][1]), (b"server", b"hypercorn-h2")]
    assert made == 2  # once for each protocol in that second

    now += 0.1  # the next second
    assert config.response_headers("h11") == [
        (b"date", format_date_time(now).encode()),
        (b"server", b"hypercorn-h11"),
    ]
    assert format_date_time(now) != format_date_time(now - 0.1)
    assert made == 3


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """What the server's connection handlers write to their sockets, one item per write."""
    written: list[bytes] = []
    write = ConnectionHandler._write

    async def recording_write(self: ConnectionHandler, data: bytes) -> None:
        written.append(data)
        await write(self, data)

    monkeypatch.setattr(ConnectionHandler, "_write", recording_write)
    return written


async def test_a_head_with_a_content_length_is_written_with_its_body(
    server: Server, writes: list[bytes]
) -> None:
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        for _ in range(2):
            answer = await request(stream)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(ANSWER_END)
        assert writes == [answer, answer], "one write per answer"

        await stream.send_all(REQUEST.replace(b"GET / ", b"GET /empty "))
        with trio.fail_after(5):
            empty = await stream.receive_some()
        assert empty.startswith(b"HTTP/1.1 204") and empty.endswith(b"\r\n\r\n")
        assert writes[2:] == [empty]


async def test_a_head_without_a_content_length_is_written_at_once(
    server: Server, writes: list[bytes]
) -> None:
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        await stream.send_all(REQUEST.replace(b"GET / ", b"GET /stream "))
        with trio.fail_after(5):
            head = await stream.receive_some()  # while the app still waits for its body
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
        server.release.set()
        rest = b""
        with trio.fail_after(5):
            while not rest.endswith(b"0\r\n\r\n"):
                rest += await stream.receive_some()
        assert ANSWER_END in rest
    assert writes[0] == head


async def test_a_head_held_for_a_body_that_never_comes_is_still_written(server: Server) -> None:
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        await stream.send_all(REQUEST.replace(b"GET / ", b"GET /fails "))
        received = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some():
                received += chunk
    assert received.startswith(b"HTTP/1.1 200") and b"content-length: 5" in received
    assert received.endswith(b"\r\n\r\n"), "the head, then the connection closed: no body"


async def test_an_answer_bigger_than_the_sockets_buffers_arrives_whole(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed_to_trio: list[tuple[trio.SocketStream, int]] = []  # sent by Trio's streams, the client's too
    send_all = trio.SocketStream.send_all

    async def recording_send_all(self: trio.SocketStream, data: Any) -> None:
        handed_to_trio.append((self, len(data)))
        await send_all(self, data)

    monkeypatch.setattr(trio.SocketStream, "send_all", recording_send_all)
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        await stream.send_all(REQUEST.replace(b"GET / ", b"GET /big "))
        received = bytearray()
        with trio.fail_after(30):
            while b"\r\n\r\n" not in received or len(received) < received.index(b"\r\n\r\n") + 4 + BIG:
                chunk = await stream.receive_some()
                assert chunk, "closed before the whole answer"
                received += chunk
        head, body = bytes(received).split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200")
        assert body == bytes(range(256)) * (BIG // 256)
        assert (await request(stream)).endswith(ANSWER_END), "the connection serves on"
    servers = [size for sender, size in handed_to_trio if sender is not stream]
    assert len(servers) == 1 and 0 < servers[0] < BIG, "what did not fit at once, and only that"


async def test_where_descriptors_are_not_sockets_reads_and_writes_go_through_trios_stream(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "_DESCRIPTORS_ARE_SOCKETS", False)  # as on Windows
    sent: list[bytes] = []
    send_all = trio.SocketStream.send_all

    async def recording_send_all(self: trio.SocketStream, data: Any) -> None:
        sent.append(bytes(data))
        await send_all(self, data)

    monkeypatch.setattr(trio.SocketStream, "send_all", recording_send_all)
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        answers = [await request(stream) for _ in range(2)]
    assert all(answer.startswith(b"HTTP/1.1 200") and answer.endswith(ANSWER_END) for answer in answers)
    assert answers[0] in sent and answers[1] in sent, "each answer, head and body, in one of Trio's sends"


async def test_a_client_that_resets_its_connection_mid_request_leaves_the_server_serving(
    server: Server,
) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    await stream.send_all(REQUEST.replace(b"GET / ", b"GET /slow "))
    await server.arrived.wait()  # the slow request is in hand
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await stream.aclose()  # a reset, not an orderly close
    server.release.set()  # the answer goes to a connection that is gone
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as other:
        assert (await request(other)).endswith(ANSWER_END)


async def test_a_request_in_hand_is_not_cut_by_the_timer(server: Server, nursery: trio.Nursery) -> None:
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        answer = trio.Event()

        async def slow() -> None:
            assert (await request(stream, "/slow")).startswith(b"HTTP/1.1 200")
            answer.set()

        nursery.start_soon(slow)
        await trio.sleep(3 * TIMEOUT)
        assert not answer.is_set()
        server.release.set()
        await answer.wait()
        assert TIMEOUT * 0.8 <= await closed_after(stream) < TIMEOUT + 2


async def test_shutting_down_closes_idle_connections_at_once_and_busy_ones_after_their_answer(
    server: Server, nursery: trio.Nursery
) -> None:
    idle = await trio.open_tcp_stream("127.0.0.1", server.port)
    busy = await trio.open_tcp_stream("127.0.0.1", server.port)
    assert (await request(idle)).startswith(b"HTTP/1.1 200")
    await busy.send_all(REQUEST.replace(b"GET / ", b"GET /slow "))
    await server.arrived.wait()  # the slow request is in hand
    server.stop.set()
    assert await closed_after(idle) < TIMEOUT / 2, "closed at once, not after the keep-alive timeout"
    server.release.set()
    received = b""
    while chunk := await busy.receive_some():
        received += chunk
    assert received.startswith(b"HTTP/1.1 200") and received.endswith(ANSWER_END), "answered, then closed"
    await idle.aclose()
    await busy.aclose()


async def test_a_connection_busy_at_shutdown_does_not_hold_the_server_past_its_answer(server: Server) -> None:
    busy = await trio.open_tcp_stream("127.0.0.1", server.port)
    await busy.send_all(REQUEST.replace(b"GET / ", b"GET /slow "))
    await server.arrived.wait()  # the slow request is in hand
    server.stop.set()
    await trio.sleep(TIMEOUT / 3)  # the server has begun to shut down while the request is in hand
    server.release.set()
    received = b""
    with trio.fail_after(2):
        while chunk := await busy.receive_some():
            received += chunk
    assert received.endswith(ANSWER_END), "answered, then closed"
    with trio.fail_after(2):  # the graceful timeout, 5 s, would end a handler that lingered
        await server.stopped.wait()
    await busy.aclose()


async def test_a_write_to_a_client_that_stopped_reading_ends_at_the_graceful_timeout(server: Server) -> None:
    """Hypercorn shields each write: one waiting for a client that reads nothing (a push stream's
    worker, hung) held the server's shutdown for ever, past any deadline. It now ends, with its
    connection, once the graceful timeout has passed."""
    stuck = await trio.open_tcp_stream("127.0.0.1", server.port)
    await stuck.send_all(REQUEST.replace(b"GET / ", b"GET /big "))
    with trio.fail_after(5):
        assert (await stuck.receive_some(16)).startswith(b"HTTP/1.1 200")  # then it reads no more
    server.config.graceful_timeout = 0.5
    server.stop.set()
    with trio.fail_after(5):
        await server.stopped.wait()
    await stuck.aclose()


class Recorder:
    """Stand-ins for Hypercorn's protocol (records the events the handler passes back to it) and for the
    connection's stream (records when each write starts and ends; each waits for ``flowing``, as a write
    to a slow client waits for room; broken once ``broken`` is set)."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.writes: list[tuple[str, bytes]] = []
        self.flowing = trio.Event()
        self.flowing.set()
        self.broken = False

    async def handle(self, event: Any) -> None:
        self.events.append(event)

    async def send_all(self, data: bytes) -> None:
        if self.broken:
            raise trio.BrokenResourceError
        self.writes.append(("start", bytes(data)))
        await self.flowing.wait()
        self.writes.append(("end", bytes(data)))


def handler_on(recorder: Recorder) -> ConnectionHandler:
    handler = ConnectionHandler(app, Config(), WorkerContext(None), {}, recorder)
    handler.protocol = recorder  # type: ignore[assignment]
    return handler


async def test_a_write_waits_for_the_one_under_way() -> None:
    recorder = Recorder()
    handler = handler_on(recorder)
    recorder.flowing = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(handler.protocol_send, RawData(b"first"))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(handler.protocol_send, RawData(b"second"))
        await trio.testing.wait_all_tasks_blocked()
        recorder.flowing.set()
    assert recorder.writes == [
        ("start", b"first"),
        ("end", b"first"),
        ("start", b"second"),
        ("end", b"second"),
    ]
    assert recorder.events == []


async def test_an_empty_write_sends_nothing_and_a_broken_connection_is_reported_closed() -> None:
    recorder = Recorder()
    handler = handler_on(recorder)
    await handler.protocol_send(RawData(b"head"))
    await handler.protocol_send(RawData(b""))  # h11's end of a message whose length was announced
    assert recorder.writes == [("start", b"head"), ("end", b"head")]
    recorder.broken = True
    await handler.protocol_send(RawData(b"late"))
    assert [type(event) for event in recorder.events] == [Closed]
    assert not handler.send_lock.locked()


async def test_a_requests_inbox_checkpoints_only_when_it_must_wait() -> None:
    inbox = AppInbox(2)
    message: Any = {"type": "http.request", "body": b"", "more_body": False}
    with trio.testing.assert_no_checkpoints():
        await inbox.put(message)
        await inbox.put(message)
        assert await inbox.get() is message
    got: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inbox.put, {"type": "third"})  # full: waits for room
        await trio.testing.wait_all_tasks_blocked()
        assert await inbox.get() is message
        await trio.testing.wait_all_tasks_blocked()
        assert (await inbox.get())["type"] == "third"
        nursery.start_soon(lambda: _append(got, inbox))  # empty: waits for a message
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        await inbox.put({"type": "http.disconnect"})
    assert got == [{"type": "http.disconnect"}]


async def _append(got: list[Any], inbox: AppInbox) -> None:
    got.append(await inbox.get())
