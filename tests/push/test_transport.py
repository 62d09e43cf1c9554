"""The push's HTTP/1.1 client (broker/push/transport.py) against hand-written loopback servers, so a
test controls every byte and every close: keep-alive reuse and when a connection is dropped instead,
the bounded answer, no redirects, errors, cancellation, TLS, and the private-address check on the
addresses a name resolves to (names come from a resolver installed for the test's Trio run)."""

from __future__ import annotations

import base64
import errno
import os
import re
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.push.transport import (
    MAX_ANSWER_BYTES,
    Answer,
    ConnectError,
    ConnectionPool,
    LocalError,
    PrivateAddress,
    ReadError,
    RemoteProtocolError,
    TransportError,
    _plain_answer,
    _request,
    _target,
)

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
HEADERS = {"content-type": "application/json", "x-broker-message-id": "m-1"}

#: A self-signed certificate for localhost and 127.0.0.1, valid 2000 … 2100, and its key (test only).
CERTIFICATE = """-----BEGIN CERTIFICATE-----
MIIBijCCAS+gAwIBAgIBATAKBggqhkjOPQQDAjAUMRIwEAYDVQQDDAlsb2NhbGhv
c3QwIBcNMDAwMTAxMDAwMDAwWhgPMjEwMDAxMDEwMDAwMDBaMBQxEjAQBgNVBAMM
CWxvY2FsaG9zdDBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABACm8/QHbr2BACrj
pp2SnRNMMjLT3ZZFiAAv/Ki9vnGQcUgXLVfsKMQlJzpeistzaOkn+160klydVwwn
1rW7SuOjcDBuMBoGA1UdEQQTMBGCCWxvY2FsaG9zdIcEfwAAATAPBgNVHRMBAf8E
BTADAQH/MAsGA1UdDwQEAwIChDATBgNVHSUEDDAKBggrBgEFBQcDATAdBgNVHQ4E
FgQUqpBjZktAbgpXblGSZXYq4U9c/rQwCgYIKoZIzj0EAwIDSQAwRgIhAJ3eTETD
jRQ0vnWYORO6FVIjkkOVtTwHFhczVKrNt4MvAiEAr43/CVYMLsyousZSaQM3cxB1
B0weZfUHmgtxYbue1qk=
-----END CERTIFICATE-----
"""
PRIVATE_KEY = """-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgZwc+q510Yfvhzgpb
hEW/SwQ0Mg8OkixXQQe6fXfOXj6hRANCAAQApvP0B269gQAq46adkp0TTDIy092W
RYgAL/yovb5xkHFIFy1X7CjEJSc6XorLc2jpJ/tetJJcnVcMJ9a1u0rj
-----END PRIVATE KEY-----
"""

#: What the server answers the ``index``-th request on its ``connection``-th connection (both from 0):
#: the raw bytes to write, or ``None`` to close the connection without an answer.
Respond = Callable[[int, int], Awaitable[bytes | None]]


async def always_ok(connection: int, index: int) -> bytes | None:
    return OK


@dataclass
class Server:
    respond: Respond = always_ok
    connections: int = 0
    requests: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # (connection, head, body)

    async def handle(self, stream: trio.abc.Stream) -> None:
        number = self.connections
        self.connections += 1
        buffer = b""
        index = 0
        try:
            async with stream:
                while True:
                    while b"\r\n\r\n" not in buffer:
                        chunk = await stream.receive_some(65536)
                        if not chunk:
                            return
                        buffer += chunk
                    head, _, buffer = buffer.partition(b"\r\n\r\n")
                    found = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                    length = int(found.group(1)) if found else 0
                    while len(buffer) < length:
                        chunk = await stream.receive_some(65536)
                        if not chunk:
                            return
                        buffer += chunk
                    body, buffer = buffer[:length], buffer[length:]
                    self.requests.append((number, head, body))
                    answer = await self.respond(number, index)
                    index += 1
                    if answer is None:
                        return
                    await stream.send_all(answer)
                    if b"connection: close" in answer.lower():
                        return
        except trio.BrokenResourceError:  # the client dropped the connection
            return


@asynccontextmanager
async def serving(server: Server, tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    """Serve on 127.0.0.1; yields the port."""
    async with trio.open_nursery() as nursery:
        if tls is None:
            [listener] = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
        else:
            serve = partial(trio.serve_ssl_over_tcp, server.handle, 0, tls, host="127.0.0.1")
            [tls_listener] = await nursery.start(serve)
            listener = tls_listener.transport_listener
        yield listener.socket.getsockname()[1]
        nursery.cancel_scope.cancel()


@pytest.fixture
async def pool() -> AsyncIterator[ConnectionPool]:
    pool = ConnectionPool()
    yield pool
    pool.close()


async def post(pool: ConnectionPool, url: str, *, allow_private: bool = False) -> Answer:
    return await pool.post(url, b'{"n": 1}', HEADERS, allow_private=allow_private)


def answers(*sequence: bytes | None) -> Respond:
    """Answer the requests in order, whatever their connection; then 200."""
    queue = list(sequence)

    async def respond(connection: int, index: int) -> bytes | None:
        return queue.pop(0) if queue else OK

    return respond


# -- keep-alive --------------------------------------------------------------------------------------


async def test_one_connection_is_kept_alive_and_the_request_is_as_sent(pool: ConnectionPool) -> None:
    server = Server()
    async with serving(server) as port:
        for _ in range(3):
            assert await post(pool, f"http://127.0.0.1:{port}/hook?token=abc") == Answer(200, None)
        assert server.connections == 1
        assert pool.statistics() == {f"http://127.0.0.1:{port}": 1}
        _, head, body = server.requests[0]
        lines = head.decode().split("\r\n")
        assert lines[0] == "POST /hook?token=abc HTTP/1.1"
        assert {f"host: 127.0.0.1:{port}", "content-length: 8", "x-broker-message-id: m-1"} <= set(lines)
        assert body == b'{"n": 1}'
        pool.close()
        assert pool.statistics() == {}
        assert await post(pool, f"http://127.0.0.1:{port}/") == Answer(200, None)
        assert pool.statistics() == {}, "a closed pool keeps nothing"


async def test_concurrent_requests_get_a_connection_each_then_share_them(pool: ConnectionPool) -> None:
    all_in = trio.Event()
    release = trio.Event()
    waiting = 0

    async def respond(connection: int, index: int) -> bytes | None:
        nonlocal waiting
        waiting += 1
        if waiting == 3:
            all_in.set()
        if waiting <= 3:
            await release.wait()
        return OK

    server = Server(respond)
    async with serving(server) as port:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(post, pool, f"http://127.0.0.1:{port}/")
            await all_in.wait()  # three requests in flight at once
            release.set()
        assert server.connections == 3
        assert pool.statistics() == {f"http://127.0.0.1:{port}": 3}
        pool.max_idle = 2
        await post(pool, f"http://127.0.0.1:{port}/")
        assert server.connections == 3, "an idle connection is reused"
        assert pool.statistics() == {f"http://127.0.0.1:{port}": 2}, "beyond max_idle the oldest is closed"


async def test_connection_close_and_http_1_0_are_not_reused(pool: ConnectionPool) -> None:
    close = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
    old = b"HTTP/1.0 204 No Content\r\n\r\n"
    server = Server(answers(close, old))
    async with serving(server) as port:
        assert (await post(pool, f"http://127.0.0.1:{port}/")).status == 200
        assert (await post(pool, f"http://127.0.0.1:{port}/")).status == 204
        assert pool.statistics() == {}
        assert (await post(pool, f"http://127.0.0.1:{port}/")).status == 200
        assert server.connections == 3


async def test_a_connection_the_receiver_closed_while_idle_is_replaced(pool: ConnectionPool) -> None:
    async def respond(connection: int, index: int) -> bytes | None:
        if connection == 0 and index == 1:
            return None  # the request that found the connection closing: no answer
        return OK

    server = Server(respond)
    async with serving(server) as port:
        await post(pool, f"http://127.0.0.1:{port}/")
        assert await post(pool, f"http://127.0.0.1:{port}/") == Answer(200, None)
        assert [connection for connection, _, _ in server.requests] == [0, 0, 1], "sent once more, anew"


async def test_a_new_connection_closed_without_an_answer_is_an_error(pool: ConnectionPool) -> None:
    server = Server(answers(None))
    async with serving(server) as port:
        with pytest.raises(ReadError, match="without an answer"):
            await post(pool, f"http://127.0.0.1:{port}/")
        assert len(server.requests) == 1, "a request on a new connection is not repeated"


# -- the answer --------------------------------------------------------------------------------------


async def test_status_and_retry_after_are_returned_and_redirects_not_followed(pool: ConnectionPool) -> None:
    server = Server(
        answers(
            b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 30\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 302 Found\r\nlocation: http://127.0.0.1:9/elsewhere\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Busy\r\ntransfer-encoding: chunked\r\n\r\n"
            b"2\r\nno\r\n0\r\n\r\n",
        )
    )
    async with serving(server) as port:
        assert await post(pool, f"http://127.0.0.1:{port}/") == Answer(429, "30")
        assert await post(pool, f"http://127.0.0.1:{port}/") == Answer(302, None)
        assert await post(pool, f"http://127.0.0.1:{port}/") == Answer(503, None)
        assert len(server.requests) == 3 and server.connections == 1


async def test_an_answer_is_read_up_to_64_kib_then_its_connection_dropped(pool: ConnectionPool) -> None:
    big = MAX_ANSWER_BYTES + 1
    server = Server(answers(b"HTTP/1.1 500 Oops\r\ncontent-length: %d\r\n\r\n" % big + b"x" * big))
    async with serving(server) as port:
        assert await post(pool, f"http://127.0.0.1:{port}/") == Answer(500, None)
        assert pool.statistics() == {}
        await post(pool, f"http://127.0.0.1:{port}/")
        assert server.connections == 2
    exactly = Server(
        answers(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % MAX_ANSWER_BYTES + b"x" * MAX_ANSWER_BYTES)
    )
    async with serving(exactly) as port:
        await post(pool, f"http://127.0.0.1:{port}/")
        await post(pool, f"http://127.0.0.1:{port}/")
        assert exactly.connections == 1, "64 KiB is read whole and the connection kept"


async def test_an_answer_that_is_not_http_is_an_error(pool: ConnectionPool) -> None:
    server = Server(answers(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"))
    async with serving(server) as port:
        with pytest.raises(RemoteProtocolError):
            await post(pool, f"http://127.0.0.1:{port}/")
        assert pool.statistics() == {}


async def test_a_refused_connection_is_a_connect_error(pool: ConnectionPool) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(ConnectError, match=f"cannot connect to 127.0.0.1:{port}: Connection refused"):
        await post(pool, f"http://127.0.0.1:{port}/")


class NoFilesLeft(trio.abc.SocketFactory):
    """This process out of file descriptors, as ``socket()`` says it."""

    def socket(self, family: Any = None, type: Any = None, proto: Any = None) -> Any:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))


async def test_a_socket_this_host_cannot_open_is_a_local_error_not_a_connect_error(
    pool: ConnectionPool,
) -> None:
    """The dispatcher charges a ``ConnectError`` to the receiver (a failed attempt); this one is not."""
    trio.socket.set_custom_socket_factory(NoFilesLeft())
    with pytest.raises(LocalError, match="cannot open a socket: Too many open files") as raised:
        await post(pool, "http://127.0.0.1:9/")
    assert not isinstance(raised.value, ConnectError)


async def test_a_cancelled_request_closes_its_connection(pool: ConnectionPool) -> None:
    arrived = trio.Event()

    async def respond(connection: int, index: int) -> bytes | None:
        if index == 1:
            arrived.set()
            await trio.sleep_forever()
        return OK

    server = Server(respond)
    async with serving(server) as port:
        await post(pool, f"http://127.0.0.1:{port}/")
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as scope:  # what the push's timeout does
                nursery.start_soon(_cancel_when, arrived, scope)
                await post(pool, f"http://127.0.0.1:{port}/")
        assert scope.cancelled_caught
        assert pool.statistics() == {}, "a request cut short leaves its connection in no known state"
        await post(pool, f"http://127.0.0.1:{port}/")
        assert server.connections == 2


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


# -- TLS -----------------------------------------------------------------------------------------------


async def test_https_verifies_the_certificate_and_keeps_the_connection(
    pool: ConnectionPool, tmp_path: Path
) -> None:
    (tmp_path / "cert.pem").write_text(CERTIFICATE)
    (tmp_path / "key.pem").write_text(PRIVATE_KEY)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server = Server()
    async with serving(server, server_context) as port:
        trusting = ConnectionPool(ssl_context=ssl.create_default_context(cadata=CERTIFICATE))
        for _ in range(2):
            assert await post(trusting, f"https://127.0.0.1:{port}/hook") == Answer(200, None)
        assert server.connections == 1
        trusting.close()
        # Saying why, not the errno's "Operation not permitted" (OpenSSL 1.1 spells it "self signed").
        why = r"TLS handshake with 127\.0\.0\.1 failed: certificate verify failed: self.signed certificate$"
        with pytest.raises(ConnectError, match=why):
            await post(pool, f"https://127.0.0.1:{port}/hook")  # the system's CAs only


# -- private addresses ------------------------------------------------------------------------------


class Resolver(trio.abc.HostnameResolver):
    """Names for one test's Trio run: ``trio.socket.set_custom_hostname_resolver``; counts lookups."""

    def __init__(self, names: dict[str, list[str]]) -> None:
        self.names = names
        self.asked: list[str] = []

    async def getaddrinfo(  # type: ignore[override]
        self, host: bytes | str, port: bytes | str | int | None, *args: object, **kwargs: object
    ) -> list[tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[Any, ...]]]:
        await trio.lowlevel.checkpoint()
        name = host.decode() if isinstance(host, bytes) else host
        self.asked.append(name)
        if name not in self.names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        assert isinstance(port, int)
        return [
            (socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port, 0, 0))
            if ":" in address
            else (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port))
            for address in self.names[name]
        ]

    async def getnameinfo(self, sockaddr: tuple[str, int], flags: int) -> tuple[str, str]:
        raise NotImplementedError


async def test_a_name_that_resolves_to_a_link_local_address_is_refused(pool: ConnectionPool) -> None:
    refused = {
        "hooks.test": "169.254.169.254",
        "metadata.test": "169.254.169.254",
        "aws.test": "fd00:ec2::254",
        "mapped.test": "::ffff:169.254.169.254",  # an IPv6 socket reaches 169.254.169.254 this way
    }
    resolver = Resolver({name: [address] for name, address in refused.items()})
    resolver.names["hooks.test"] = ["127.0.0.1", "169.254.169.254"]  # any one address refuses the name
    trio.socket.set_custom_hostname_resolver(resolver)
    server = Server()
    async with serving(server) as port:
        for name, address in refused.items():
            with pytest.raises(PrivateAddress) as refusal:
                await post(pool, f"http://{name}:{port}/")
            assert f"{name} resolves to {address}, a link-local or metadata address" in str(refusal.value)
            assert "push.allow_private" in str(refusal.value)
        assert server.connections == 0

        assert await post(pool, f"http://hooks.test:{port}/", allow_private=True) == Answer(200, None)
        assert await post(pool, f"http://hooks.test:{port}/", allow_private=True) == Answer(200, None)
        assert server.connections == 1, "connected to the first address checked, and kept"
        assert resolver.asked == [*refused, "hooks.test"], "resolved once per connection"


async def test_a_name_that_resolves_to_loopback_is_pushed_to(pool: ConnectionPool) -> None:
    # The same predicate as the URL check (broker.core.config): loopback and private ranges are
    # allowed, as a literal 127.0.0.1 in the URL is; link-local and metadata addresses are not.
    trio.socket.set_custom_hostname_resolver(Resolver({"localhost": ["127.0.0.1"]}))
    server = Server()
    async with serving(server) as port:
        assert await post(pool, f"http://localhost:{port}/") == Answer(200, None)
        assert server.requests[0][1].split(b"\r\n")[1] == b"host: localhost:%d" % port


async def test_a_name_that_does_not_resolve_is_a_connect_error(pool: ConnectionPool) -> None:
    trio.socket.set_custom_hostname_resolver(Resolver({}))
    with pytest.raises(ConnectError, match=r"cannot resolve nowhere\.test: Name or service not known"):
        await post(pool, "http://nowhere.test/")


class NoIPv6(trio.abc.SocketFactory):
    """A host with IPv6 disabled, as many containers are: an IPv6 socket's ``connect()`` fails with
    ``EADDRNOTAVAIL`` (no source address), or, with ``at_socket``, ``socket()`` with ``EAFNOSUPPORT``."""

    def __init__(self, *, at_socket: bool = False) -> None:
        self.at_socket = at_socket

    def socket(self, family: Any = None, type: Any = None, proto: Any = None) -> Any:
        if family == socket.AF_INET6:
            if self.at_socket:
                raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
            return NoSourceAddress()
        return trio.socket.from_stdlib_socket(socket.socket(family, type, proto))


class NoSourceAddress:
    async def connect(self, address: Any) -> None:
        await trio.lowlevel.checkpoint()
        raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("at_socket", [False, True])
async def test_an_address_this_host_cannot_use_is_skipped_for_the_next(
    pool: ConnectionPool, at_socket: bool
) -> None:
    """``::1`` first, where IPv6 is off: the push went no further (a LocalError, released with no attempt
    spent, every second, for ever), though 127.0.0.1 was up; and with the receiver down it was no
    ConnectError, so its messages were never failed nor dead-lettered."""
    trio.socket.set_custom_hostname_resolver(Resolver({"dual.test": ["::1", "127.0.0.1"]}))
    trio.socket.set_custom_socket_factory(NoIPv6(at_socket=at_socket))
    server = Server()
    async with serving(server) as port:
        assert await post(pool, f"http://dual.test:{port}/", allow_private=True) == Answer(200, None)
    pool.close()
    with pytest.raises(ConnectError, match=r"cannot connect to dual\.test:\d+: Connection refused") as raised:
        await post(pool, f"http://dual.test:{port}/", allow_private=True)  # nothing listens there now
    assert not isinstance(raised.value, LocalError)


async def test_a_name_whose_every_address_this_host_cannot_use_is_a_local_error(pool: ConnectionPool) -> None:
    trio.socket.set_custom_hostname_resolver(Resolver({"six.test": ["::1"]}))
    trio.socket.set_custom_socket_factory(NoIPv6())
    with pytest.raises(LocalError, match=r"cannot connect to six\.test:9: Cannot assign requested address"):
        await post(pool, "http://six.test:9/", allow_private=True)


# -- the request and the plain answer ---------------------------------------------------------------


def test_the_request_is_written_whole_and_checked() -> None:
    target = _target("http://hooks.example.com:8080/in?token=a%20b")
    assert _request(target, b"{}", {"x-broker-attempt": "1"}) == (
        b"POST /in?token=a%20b HTTP/1.1\r\nhost: hooks.example.com:8080\r\ncontent-length: 2\r\n"
        b"x-broker-attempt: 1\r\n\r\n{}"
    )
    for bad in ({"x-a": "1\r\nx-injected: 1"}, {"x a": "1"}, {"Content-Length": "5"}, {"x-a": "\u20ac"}):
        with pytest.raises(TransportError, match="the request cannot be sent"):
            _request(target, b"{}", bad)
    unusual = _target("http://user:secret@B\u00fccher.example:81/a b/\u00e9?q=%20")
    assert unusual.head == (  # the URL's user-info is Basic auth, as curl sends it
        "POST /a%20b/%C3%A9?q=%20 HTTP/1.1\r\nhost: xn--bcher-kva.example:81\r\n"
        f"authorization: Basic {base64.b64encode(b'user:secret').decode()}\r\n"
    )
    for url, credentials in (("http://a%40b:p%3Aw@h/", b"a@b:p:w"), ("http://b%20o:p%FFx@h/", b"b o:p\xffx")):
        encoded = _target(url).head.split("authorization: Basic ")[1].strip()
        assert base64.b64decode(encoded) == credentials  # the bytes the URL encodes, as curl sends
    assert _target("http://[::1]:8080/").head == "POST / HTTP/1.1\r\nhost: [::1]:8080\r\n"


def test_plain_answers_are_read_without_h11_and_the_rest_left_to_it() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    assert _plain_answer(ok) == (200, None, 2, True, len(ok) - 2)
    busy = (
        b"HTTP/1.1 429 Slow down\r\nretry-after:  7 \r\nconnection: keep-alive, close\r\n"
        b"content-length: 0\r\n\r\n"
    )
    assert _plain_answer(busy) == (429, "7", 0, False, len(busy))
    for other in (
        b"HTTP/1.1 200 OK\r\ncontent-length: 2",  # the head is not all there yet
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\ncontent-length: 10\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\ncontent-length: -2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx-a: 1\r\n folded\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n",  # delimited by the close
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    ):
        assert _plain_answer(other) is None, other


async def test_an_answer_delimited_by_the_close_is_read_by_h11(pool: ConnectionPool) -> None:
    server = Server(answers(b"HTTP/1.1 201 Created\r\nconnection: close\r\n\r\nwhatever"))
    async with serving(server) as port:
        assert await post(pool, f"http://127.0.0.1:{port}/") == Answer(201, None)
        assert pool.statistics() == {}
