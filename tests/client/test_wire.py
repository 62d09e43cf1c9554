"""The clients' own HTTP/1.1 (broker/client/wire.py), ``Client``'s and ``AsyncClient``'s: reuse, stale
connections, failures as httpx's exceptions, proxies left to httpx, one blocking client shared by
threads, and how the async one reads the framings of HTTP/1.1 answers."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import pytest
import trio
from anyio.abc import SocketAttribute

from broker.client import AsyncClient, Client, wire
from tests.client.conftest import RawServer, read_request

BODY = b'{"queues":[]}'
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)


def test_a_connection_is_reused_while_the_server_keeps_it(thread_url: str) -> None:
    with Client(thread_url) as client:
        client.create_queue("reuse")
        assert client._wire is not None
        for _ in range(20):
            client.stats("reuse")
        assert len(client._wire._idle) == 1  # one connection carried all of them


def test_an_idle_connection_the_server_closed_is_not_used_again(raw_server: Callable[..., RawServer]) -> None:
    def answer_once_then_close(connection: socket.socket) -> None:
        read_request(connection)
        connection.sendall(ANSWER)  # keep-alive by default, then the server goes away anyway

    server = raw_server(answer_once_then_close)
    with Client(server.url) as client:
        assert client._wire is not None
        for _ in range(3):
            assert client.list_queues() == []
            (idle,) = client._wire._idle
            poller = select.poll()  # wait (bounded) until the server's close has reached the client
            poller.register(idle.sock, select.POLLIN)
            assert poller.poll(5000)
    assert server.connections == 3  # a fresh connection each time, and no request failed


def test_a_refused_connection_is_an_httpx_connect_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed again below: nothing listens there
    with Client(f"http://127.0.0.1:{port}") as client, pytest.raises(httpx.ConnectError):
        client.list_queues()


def test_no_answer_within_the_timeout_is_an_httpx_read_timeout(raw_server: Callable[..., RawServer]) -> None:
    done = threading.Event()

    def never_answer(connection: socket.socket) -> None:
        read_request(connection)
        done.wait(10)

    server = raw_server(never_answer)
    try:
        with Client(server.url, timeout=0.2) as client, pytest.raises(httpx.ReadTimeout):
            client.list_queues()
    finally:
        done.set()


def test_an_answer_cut_short_is_an_httpx_transport_error(raw_server: Callable[..., RawServer]) -> None:
    def cut_short(connection: socket.socket) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n[1,")

    server = raw_server(cut_short)
    with Client(server.url) as client, pytest.raises(httpx.RemoteProtocolError):
        client.list_queues()


def test_error_answers_still_raise_the_contract_errors(thread_url: str) -> None:
    from broker.client.errors import QueueNotFound

    with Client(thread_url) as client, pytest.raises(QueueNotFound):
        client.stats("no-such-queue")


def test_a_proxy_in_the_environment_leaves_the_request_to_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    assert wire.usable("http://broker.internal:8080")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.internal:3128")
    assert not wire.usable("http://broker.internal:8080")
    with Client("http://broker.internal:8080") as client:
        assert client._wire is None and client._http is not None
    monkeypatch.setenv("NO_PROXY", "broker.internal")
    assert wire.usable("http://broker.internal:8080")
    assert not wire.usable("ftp://broker.internal")


def test_one_client_serves_many_threads(thread_url: str) -> None:
    with Client(thread_url) as client:
        client.create_queue("threads")

        def publish_and_count(n: int) -> int:
            for i in range(20):
                client.publish("threads", {"n": n, "i": i})
            return n

        with ThreadPoolExecutor(max_workers=8) as pool:
            assert sorted(pool.map(publish_and_count, range(8))) == list(range(8))
        assert client.stats("threads")["ready"] == 160
        assert client._wire is not None and len(client._wire._idle) <= wire.MAX_IDLE


# AsyncClient's own HTTP/1.1 (wire.AsyncWire), under trio here (test_client.py runs it under asyncio too)


async def test_the_async_client_reuses_a_connection_while_the_server_keeps_it(live_url: str) -> None:
    async with AsyncClient(live_url) as client:
        await client.create_queue("reuse")
        assert client._wire is not None and client._http is None  # no httpx client made at all
        for _ in range(20):
            await client.stats("reuse")
        assert len(client._wire._idle) == 1


async def test_the_async_client_does_not_reuse_a_connection_the_server_closed(
    raw_server: Callable[..., RawServer],
) -> None:
    def answer_once_then_close(connection: socket.socket) -> None:
        read_request(connection)
        connection.sendall(ANSWER)

    server = raw_server(answer_once_then_close)
    async with AsyncClient(server.url) as client:
        assert client._wire is not None
        for _ in range(3):
            assert await client.list_queues() == []
            (idle,) = client._wire._idle
            await trio.lowlevel.wait_readable(
                idle.stream.extra(SocketAttribute.raw_socket)
            )  # the close is in
    assert server.connections == 3


async def test_the_async_clients_failures_are_httpxs(raw_server: Callable[..., RawServer]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    async with AsyncClient(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(httpx.ConnectError):
            await client.list_queues()

    done = threading.Event()

    def never_answer(connection: socket.socket) -> None:
        read_request(connection)
        done.wait(10)

    def cut_short(connection: socket.socket) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n[1,")

    def close_at_once(connection: socket.socket) -> None:
        read_request(connection)

    try:
        async with AsyncClient(raw_server(never_answer).url, timeout=0.2) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.list_queues()
            assert client._wire is not None and client._wire._idle == []
    finally:
        done.set()
    async with AsyncClient(raw_server(cut_short).url) as client:
        with pytest.raises(httpx.RemoteProtocolError, match="body"):
            await client.list_queues()
    async with AsyncClient(raw_server(close_at_once).url) as client:
        with pytest.raises(httpx.RemoteProtocolError, match="without response"):
            await client.list_queues()


@pytest.mark.parametrize(
    ("answer", "reused"),
    [
        (b"HTTP/1.1 100 Continue\r\n\r\n" + ANSWER, True),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\n"
            + BODY[:5]
            + b"\r\n"
            + b"%x\r\n" % (len(BODY) - 5)
            + BODY[5:]
            + b"\r\n0\r\nX-T: 1\r\n\r\n",
            True,
        ),
        (ANSWER.replace(b"Content-Type", b"Connection: close\r\nContent-Type"), False),
        (b"HTTP/1.0 200 OK\r\n\r\n" + BODY, False),  # no length: the body ends with the connection
    ],
)
async def test_the_async_client_reads_answers_as_http_frames_them(
    raw_server: Callable[..., RawServer], answer: bytes, reused: bool
) -> None:
    def respond(connection: socket.socket) -> None:
        while read_request(connection):
            connection.sendall(answer)
            if not reused:
                return

    server = raw_server(respond)
    async with AsyncClient(server.url) as client:
        assert await client.list_queues() == []
        assert await client.list_queues() == []
        assert client._wire is not None and len(client._wire._idle) == int(reused)
    assert server.connections == (1 if reused else 2)


async def test_bytes_after_a_chunked_answer_are_never_read_as_the_next_answer(
    raw_server: Callable[..., RawServer],
) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunked = head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    stray = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nno"  # sent unasked: not JSON, not ours
    first = threading.Event()

    def respond(connection: socket.socket) -> None:
        junk = not first.is_set()
        first.set()
        while read_request(connection):
            connection.sendall(chunked + stray if junk else ANSWER)
            junk = False

    server = raw_server(respond)
    async with AsyncClient(server.url) as client:
        assert await client.list_queues() == []
        assert await client.list_queues() == []  # on a fresh connection, not the stray bytes
    assert server.connections == 2


@pytest.mark.parametrize("informational", [b"103 Early Hints\r\nLink: </x>; rel=preload", b"102 Processing"])
def test_the_blocking_client_skips_every_informational_answer(
    raw_server: Callable[..., RawServer], informational: bytes
) -> None:
    def respond(connection: socket.socket) -> None:
        n = 0
        while read_request(connection):
            n += 1
            body = b'{"queues":[{"name":"q%d"}]}' % n
            connection.sendall(b"HTTP/1.1 %s\r\n\r\n" % informational)
            connection.sendall(ANSWER.replace(BODY, body).replace(b"%d" % len(BODY), b"%d" % len(body)))

    server = raw_server(respond)
    with Client(server.url) as client:  # each call gets its own answer, never the one before
        assert [queue["name"] for queue in client.list_queues()] == ["q1"]
        assert [queue["name"] for queue in client.list_queues()] == ["q2"]
    assert server.connections == 1


@pytest.mark.parametrize(
    "length", [b"-1", b"+13", b"1_3", b"\xd9\xa1\xd9\xa3"]
)  # the last: Arabic-Indic digits
async def test_a_content_length_that_is_not_digits_is_a_protocol_error_for_both_clients(
    raw_server: Callable[..., RawServer], length: bytes
) -> None:
    def respond(connection: socket.socket) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %s\r\n\r\n%s" % (length, BODY))

    url = raw_server(respond).url
    with pytest.raises(httpx.RemoteProtocolError, match="content-length"):
        await trio.to_thread.run_sync(lambda: Client(url, timeout=5).list_queues())
    async with AsyncClient(url, timeout=5) as client:
        with pytest.raises(httpx.RemoteProtocolError, match="content-length"):
            await client.list_queues()


@pytest.mark.parametrize(
    ("head", "refused"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: \t13  \r\n", None),  # spaces around it are not the value
        (b"HTTP/1.1 200 OK\r\nContent-Length: 13\r\nContent-Length: 13\r\n", None),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 13\r\nContent-Length: 11\r\n", "content-lengths that differ"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\nContent-Length: 13\r\n", "content-lengths that differ"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n" + ANSWER.split(b"\r\n\r\n")[0] + b"\r\n", "101"),
    ],
)
async def test_both_clients_frame_an_answer_alike(
    raw_server: Callable[..., RawServer], head: bytes, refused: str | None
) -> None:
    """They disagreed: the blocking client refused "13  " and took the first of two lengths that differ
    (the rest of the body then read as the next answer), the async one the last; a 101 was an answer
    for one and skipped by the other."""

    def respond(connection: socket.socket) -> None:
        while read_request(connection):
            connection.sendall(head + b"\r\n" + BODY)
            if refused:
                return

    url = raw_server(respond).url
    with Client(url, timeout=5) as client:
        if refused:
            with pytest.raises(httpx.RemoteProtocolError, match=refused):
                await trio.to_thread.run_sync(client.list_queues)
        else:
            assert await trio.to_thread.run_sync(client.list_queues) == []
    async with AsyncClient(url, timeout=5) as async_client:
        if refused:
            with pytest.raises(httpx.RemoteProtocolError, match=refused):
                await async_client.list_queues()
        else:
            assert await async_client.list_queues() == []


async def test_a_cancelled_async_request_closes_its_connection(raw_server: Callable[..., RawServer]) -> None:
    done = threading.Event()

    def never_answer(connection: socket.socket) -> None:
        read_request(connection)
        done.wait(10)

    try:
        async with AsyncClient(raw_server(never_answer).url) as client:
            with trio.move_on_after(0.2):
                await client.list_queues()
            assert client._wire is not None and client._wire._idle == []  # half a request: not reused
    finally:
        done.set()


def test_https_and_proxies_leave_the_async_client_to_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    assert AsyncClient("http://broker.internal:8080")._wire is not None
    assert AsyncClient("https://broker.internal:8443")._wire is None
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.internal:3128")
    assert AsyncClient("http://broker.internal:8080")._wire is None


async def test_a_streamed_answer_is_read_as_its_chunks_arrive(raw_server: Callable[..., RawServer]) -> None:
    sent_second = threading.Event()
    read_first = threading.Event()

    def stream_in_two_goes(connection: socket.socket) -> None:
        assert b"GET /v1/queues/q/work?max=2 HTTP/1.1" in read_request(connection)
        connection.sendall(
            b"HTTP/1.1 200 OK\r\nStream-Id: s1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde"
        )
        read_first.wait(10)  # the client has the first part before the rest is sent
        connection.sendall(b"\r\n1\r\nf\r\n0\r\n\r\n")
        sent_second.set()

    server = raw_server(stream_in_two_goes)
    async with AsyncClient(server.url) as client:
        parts = []
        async with client.open_stream("/v1/queues/q/work", {"max": "2"}, {"Accept": "x"}, 5) as answer:
            assert (answer.status_code, answer.headers.get("stream-id")) == (200, "s1")
            async for part in answer.aiter_raw():
                parts.append(part)
                read_first.set()
    # The server thread sets it just after its last send, which the client may have read already.
    assert parts == [b"abc", b"def"] and sent_second.wait(10)
    assert client._http is None


async def test_a_streamed_answer_that_goes_quiet_is_a_read_timeout(
    raw_server: Callable[..., RawServer],
) -> None:
    done = threading.Event()

    def one_part_then_silence(connection: socket.socket) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        done.wait(10)

    try:
        client = AsyncClient(raw_server(one_part_then_silence).url)
        async with client, client.open_stream("/s", {}, {}, 0.2) as answer:
            chunks = answer.aiter_raw()
            assert await chunks.__anext__() == b"abc"
            with pytest.raises(httpx.ReadTimeout):
                await chunks.__anext__()
    finally:
        done.set()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 13\r\n\r\n" + BODY,
        b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\nd\r\n" + BODY + b"\r\n0\r\n\r\n",
        b"HTTP/1.0 404 Not Found\r\n\r\n" + BODY,
    ],
)
async def test_a_streamed_answer_can_be_read_whole(
    raw_server: Callable[..., RawServer], answer: bytes
) -> None:
    def respond(connection: socket.socket) -> None:
        read_request(connection)
        connection.sendall(answer)

    client = AsyncClient(raw_server(respond).url)
    async with client, client.open_stream("/s", {}, {}, 5) as streamed:
        assert streamed.status_code == 404
        assert await streamed.aread() == BODY and streamed.json() == {"queues": []}


def test_without_select_poll_both_clients_use_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "_CAN_POLL", False)  # as on Windows
    assert not wire.usable("http://127.0.0.1:8080") and not wire.usable_async("http://127.0.0.1:8080")
    with Client("http://127.0.0.1:8080") as client:
        assert client._wire is None
    assert AsyncClient("http://127.0.0.1:8080")._wire is None


# Reading large answers: AsyncWire's buffer must grow linearly, not be copied whole on every read


class PiecesStream:
    """A stand-in for anyio's ``SocketStream``: hands out ``data`` in pieces of the given sizes (cycled),
    never more than the reader asks for, then the end of the stream."""

    def __init__(self, data: bytes, sizes: tuple[int, ...]) -> None:
        self.data = data
        self.sizes = sizes
        self.position = 0
        self.reads = 0

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self.position >= len(self.data):
            raise anyio.EndOfStream
        size = min(self.sizes[self.reads % len(self.sizes)], max_bytes)
        self.reads += 1
        piece = self.data[self.position : self.position + size]
        self.position += len(piece)
        return piece


class CountingConnection(wire._Connection):
    """A connection that adds up the bytes of every new buffer it makes: what reading costs in copies."""

    copied = 0

    @property  # type: ignore[override]
    def _buffer(self) -> bytes:
        value: bytes = wire._Connection._buffer.__get__(self)  # type: ignore[attr-defined]
        return value

    @_buffer.setter
    def _buffer(self, value: bytes) -> None:
        try:
            same = value is wire._Connection._buffer.__get__(self)  # type: ignore[attr-defined]
        except AttributeError:  # the first assignment
            same = False
        if not same:
            CountingConnection.copied += len(value)
        wire._Connection._buffer.__set__(self, value)  # type: ignore[attr-defined]


def counting_connection(data: bytes, sizes: tuple[int, ...]) -> CountingConnection:
    CountingConnection.copied = 0
    return CountingConnection(PiecesStream(data, sizes))  # type: ignore[arg-type]


BIG = bytes(range(256)) * (8 * 1024)  # 2 MiB


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BIG), BIG),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(BIG), BIG),
        b"HTTP/1.0 200 OK\r\n\r\n" + BIG,  # the body ends with the connection
    ],
    ids=["length", "one-chunk", "until-close"],
)
async def test_a_large_body_arriving_in_small_reads_is_copied_a_bounded_number_of_times(
    answer: bytes,
) -> None:
    connection = counting_connection(answer, (4096,))
    status, body, _ = await connection.read_answer("GET")
    assert (status, body == BIG) == (200, True)
    # 512 reads: growing the buffer read by read copied ~256 times the body (quadratic); joined once,
    # the body is copied a few times at most, whatever the number of reads.
    assert CountingConnection.copied <= 3 * len(answer), CountingConnection.copied / len(answer)


async def test_a_large_chunk_of_a_stream_is_copied_a_bounded_number_of_times() -> None:
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(BIG), BIG)
    connection = counting_connection(answer + b"3\r\nabc\r\n0\r\n\r\n", (4096,))
    head = await connection.read_head("GET")
    assert head.chunked
    parts = []
    while (part := await connection.read_chunks()) is not None:
        parts.append(part)
    assert b"".join(parts) == BIG + b"abc"
    assert CountingConnection.copied <= 3 * len(answer), CountingConnection.copied / len(answer)


async def test_a_chunked_body_split_anywhere_across_reads_is_read_whole() -> None:
    parts = [BIG[:100_000], b"", BIG[100_000:100_001], BIG[100_001:1_500_000], BIG[1_500_000:]]
    chunks = b"".join(b"%x;n=%d\r\n%s\r\n" % (len(part), n, part) for n, part in enumerate(parts) if part)
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\nX-T: 1\r\n\r\n"
    # Read sizes that fall inside size lines, inside the CRLFs after data, and inside the trailers.
    for sizes in ((1, 2, 3, 7, 65536), (99_999, 3, 1, 65536), (65536,), (5, 1, 40_000)):
        connection = wire._Connection(PiecesStream(answer * 2, sizes))  # type: ignore[arg-type]
        for _ in range(2):  # two answers back to back on one connection
            status, body, reusable = await connection.read_answer("GET")
            assert (status, body == BIG) == (200, True), sizes
            assert reusable == (connection._buffer == b""), sizes  # bytes left over: not reused
        assert reusable, sizes  # the last answer left nothing behind
