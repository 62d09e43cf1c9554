"""How the clients' own HTTP/1.1 (broker/client/wire.py) fails, the blocking and the async one alike: a
peer that stops reading a request (``WriteTimeout``, not a hang), a broker that answers 413 before the
body is sent (``PayloadTooLarge``, not a broken pipe), a peer that drips its answer (the timeout bounds
the whole answer), an answer whose head the connection cut short (``RemoteProtocolError``, not a
success), and the ``Host`` header of a URL (never its user-info)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anyio
import httpx
import pytest
import trio

from broker.client import AsyncClient, Client, PayloadTooLarge, wire
from tests.client.conftest import RawServer, read_request

T = TypeVar("T")

BODY = b'{"queues":[]}'
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)
#: A payload no socket buffers absorb whole: its send waits for the peer to read, and it is over the
#: broker's 16 MiB body limit.
BIG = "x" * (17 * 1024 * 1024)


@pytest.fixture
def released() -> Iterator[threading.Event]:
    """Set when the test ends: what a server thread holding a connection open waits for."""
    event = threading.Event()
    yield event
    event.set()


def on_asyncio(make: Callable[[], Awaitable[T]]) -> T:
    """Run ``make()`` under asyncio, at most 20 s (a client that hangs fails rather than hangs the run)."""

    async def bounded() -> T:
        with anyio.fail_after(20):
            return await make()

    return asyncio.run(bounded())


# -- a peer that stops reading: the send has the timeout too -----------------------------------------


def test_a_request_the_peer_does_not_read_is_a_write_timeout(
    raw_server: Callable[..., RawServer], released: threading.Event
) -> None:
    server = raw_server(lambda connection: released.wait(20))  # a hung broker: reads nothing
    with Client(server.url, timeout=0.3) as client, pytest.raises(httpx.WriteTimeout):
        client.publish("jobs", BIG)


async def test_the_async_client_does_not_hang_on_a_peer_that_does_not_read(
    raw_server: Callable[..., RawServer], released: threading.Event
) -> None:
    server = raw_server(lambda connection: released.wait(20))
    async with AsyncClient(server.url, timeout=0.3) as client:
        with trio.fail_after(20), pytest.raises(httpx.WriteTimeout):  # it hung for ever
            await client.publish("jobs", BIG)
        assert client._wire is not None and client._wire._idle == []


def test_the_async_client_does_not_hang_on_a_peer_that_does_not_read_under_asyncio(
    raw_server: Callable[..., RawServer], released: threading.Event
) -> None:
    server = raw_server(lambda connection: released.wait(20))

    async def publish() -> None:
        async with AsyncClient(server.url, timeout=0.3) as client:
            await client.publish("jobs", BIG)

    with pytest.raises(httpx.WriteTimeout):
        on_asyncio(publish)


# -- a body over the limit: the broker's 413, read although the send broke off ---------------------


def test_a_body_over_the_limit_is_the_brokers_413_not_a_broken_pipe(thread_url: str) -> None:
    with Client(thread_url) as client:
        client.create_queue("big")
        for _ in range(2):  # and the client goes on working: the connection is not kept
            with pytest.raises(PayloadTooLarge, match="limit"):
                client.publish("big", BIG)
        with pytest.raises(PayloadTooLarge):
            client.publish_batch("big", [{"payload": BIG[: 9 * 1024 * 1024]} for _ in range(2)])
        assert client.stats("big")["ready"] == 0


async def test_the_async_client_reads_the_413_too(live_url: str) -> None:
    async with AsyncClient(live_url) as client:
        await client.create_queue("big")
        for _ in range(2):
            with trio.fail_after(20), pytest.raises(PayloadTooLarge, match="limit"):
                await client.publish("big", BIG)
        assert (await client.stats("big"))["ready"] == 0


def test_the_async_client_reads_the_413_under_asyncio(thread_url: str) -> None:
    """asyncio's transport closes its socket when a send fails, the answer with it: the client reads it
    from a duplicate of the socket."""

    async def publish_twice() -> int:
        async with AsyncClient(thread_url) as client:
            await client.create_queue("big")
            for _ in range(2):
                with pytest.raises(PayloadTooLarge, match="limit"):
                    await client.publish("big", BIG)
            ready: int = (await client.stats("big"))["ready"]
            return ready

    assert on_asyncio(publish_twice) == 0


def reset_without_answer(connection: socket.socket) -> None:
    read_request_head(connection)
    connection.close()  # with the body unread: a reset, and no answer


def read_request_head(connection: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(65536)


def test_a_send_broken_off_without_an_answer_is_still_a_write_error(
    raw_server: Callable[..., RawServer],
) -> None:
    with Client(raw_server(reset_without_answer).url) as client, pytest.raises(httpx.WriteError):
        client.publish("jobs", BIG)


async def test_the_async_clients_send_broken_off_without_an_answer_is_still_a_write_error(
    raw_server: Callable[..., RawServer],
) -> None:
    async with AsyncClient(raw_server(reset_without_answer).url) as client:
        with trio.fail_after(20), pytest.raises(httpx.WriteError):
            await client.publish("jobs", BIG)


# -- an answer dripped a byte at a time: the timeout is the whole answer's --------------------------


def test_the_timeout_bounds_the_whole_answer_not_each_read(
    raw_server: Callable[..., RawServer], released: threading.Event
) -> None:
    def drip(connection: socket.socket) -> None:
        read_request(connection)
        for byte in ANSWER:  # about 4 s in all, each byte well within the client's timeout
            connection.sendall(bytes([byte]))
            if released.wait(0.05):
                return

    with Client(raw_server(drip).url, timeout=0.5) as client, pytest.raises(httpx.ReadTimeout):
        client.list_queues()  # answered after ~4 s: each read was within 0.5 s


def test_an_answer_read_in_several_reads_within_the_timeout_is_read_whole(
    raw_server: Callable[..., RawServer],
) -> None:
    def in_three_goes(connection: socket.socket) -> None:
        while read_request(connection):
            for part in (ANSWER[:10], ANSWER[10:50], ANSWER[50:]):
                connection.sendall(part)

    with Client(raw_server(in_three_goes).url) as client:
        for _ in range(3):  # on one connection, its timeout set again for each request
            assert client.list_queues() == []


# -- a head cut short by the connection's end ---------------------------------------------------------


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nContent-Ty",  # in a header line
        b"HTTP/1.1 200 OK\r\n",  # after the status line
        b"HTTP/1.1 200 OK\r\nContent-Length: 13\r\n",  # before the empty line
    ],
)
def test_a_head_cut_short_is_a_remote_protocol_error_not_an_answer(
    raw_server: Callable[..., RawServer], head: bytes
) -> None:
    def cut(connection: socket.socket) -> None:
        read_request(connection)
        connection.sendall(head)

    server = raw_server(cut)
    with Client(server.url) as client:
        with pytest.raises(httpx.RemoteProtocolError, match="head"):
            client.delete_queue("jobs")  # an answer whose body is not read: it was a success
        with pytest.raises(httpx.RemoteProtocolError, match="head"):
            client.list_queues()


async def test_the_async_client_raises_the_same_for_a_head_cut_short(
    raw_server: Callable[..., RawServer],
) -> None:
    def cut(connection: socket.socket) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Ty")

    async with AsyncClient(raw_server(cut).url) as client:
        with pytest.raises(httpx.RemoteProtocolError, match="head"):
            await client.delete_queue("jobs")


def test_an_answer_without_a_body_whose_connection_then_closes_is_still_an_answer(
    raw_server: Callable[..., RawServer],
) -> None:
    def answer_then_close(connection: socket.socket) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")

    with Client(raw_server(answer_then_close).url) as client:
        client.delete_queue("jobs")


# -- the Host header, and user-info in the URL ---------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("http://user:secret@127.0.0.1:8080/prefix", "127.0.0.1:8080"),
        ("http://broker.internal", "broker.internal"),
        ("http://[::1]:8080", "[::1]:8080"),
        ("https://u@[fe80::1]", "[fe80::1]"),
    ],
)
def test_the_host_header_is_the_urls_host_and_port(url: str, host: str) -> None:
    assert wire.host_field(urlsplit(url)) == host


def capture_heads(heads: list[bytes]) -> Callable[[socket.socket], None]:
    def respond(connection: socket.socket) -> None:
        while head := read_request(connection):
            heads.append(head)
            connection.sendall(ANSWER)

    return respond


def test_neither_wire_copies_user_info_into_the_host_header(raw_server: Callable[..., RawServer]) -> None:
    heads: list[bytes] = []
    server = raw_server(capture_heads(heads))
    port = urlsplit(server.url).port
    url = f"http://user:s3cret@127.0.0.1:{port}"
    blocking = wire.Wire(url, {})
    try:
        assert blocking.request("GET", "/v1/queues", None, None, 5, 5)[0] == 200
    finally:
        blocking.close()

    async def through_async_wire() -> int:
        async_wire = wire.AsyncWire(url, {})
        try:
            return (await async_wire.request("GET", "/v1/queues", None, None, 5, 5))[0]
        finally:
            await async_wire.aclose()

    assert on_asyncio(through_async_wire) == 200
    assert len(heads) == 2
    for head in heads:
        assert f"\r\nHost: 127.0.0.1:{port}\r\n".encode() in head
        assert b"s3cret" not in head


@pytest.mark.parametrize("make", [Client, AsyncClient])
def test_user_info_in_the_url_is_refused_without_quoting_it(
    make: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A password holding "/", "?" or "#" ends what urlsplit takes for the host: "ops" at port "s3" here,
    # and urllib's error quoted the port; or host "ops", port 1234, with the rest as a fragment.
    for url in (
        "http://user:s3cret@127.0.0.1:8080",
        "https://s3cret@broker.internal/",
        "http://ops:s3/cret@127.0.0.1:8080",
        "http://ops:1234#s3cret@127.0.0.1:8080",
        "http://ops:1234?s3cret@127.0.0.1:8080",
        "ops:s3cret@127.0.0.1:8080",  # curl's form, without "//"
        "http:ops:s3cret@127.0.0.1:8080",
    ):
        with pytest.raises(ValueError, match="token") as refused:
            make(url)
        assert "s3cret" not in str(refused.value) and "s3" not in str(refused.value)
    monkeypatch.setenv("BROKER_URL", "http://user:s3cret@127.0.0.1:8080")
    with pytest.raises(ValueError, match="token") as refused:
        make()
    assert "s3cret" not in str(refused.value)
