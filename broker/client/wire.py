"""The blocking client's HTTP/1.1: keep-alive connections from the standard library's ``http.client``.

httpx spends about 3.5 times the CPU of ``http.client`` per request (660 µs against 190 µs for a claim
on the development VM, client side), and a consumer's CPU is taken from the broker it shares a machine
with. So ``Client`` sends its calls through ``Wire`` unless it was given an httpx transport, or the URL
would go through a proxy (``$HTTP_PROXY`` and friends), which httpx honours and this does not.

``Wire`` keeps a small pool of idle connections, so one ``Client`` may be used from several threads
(each request takes a connection of its own). An idle connection that the server closed meanwhile
(it closes them after 75 s) is noticed before it is reused, so a request is never sent on a dead
connection and never sent twice. Failures are raised as httpx's exceptions, the ones ``Client``
raised before: ``httpx.ConnectError``, ``httpx.ConnectTimeout``, ``httpx.WriteTimeout``,
``httpx.ReadTimeout``, ``httpx.RemoteProtocolError``, ``httpx.ReadError`` and ``httpx.WriteError``,
all ``TransportError``.

Both wires bound a request's send by the read timeout, and then its whole answer by the read timeout
(not each read of it: a server sending a byte a second held a call for ever). A send that fails because
the server stopped reading (it answered 413 to a body over its limit, and closed) is followed by a read
of the answer the server sent, which says more than the broken pipe.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import select
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import SplitResult, urlencode, urlsplit

import anyio
import httpx
from anyio.abc import SocketAttribute, SocketStream

from broker.client import codec

#: Idle connections kept for reuse; more may be open while as many threads send at once.
MAX_IDLE = 8


_CAN_POLL = hasattr(select, "poll")


def usable_async(url: str) -> bool:
    """Whether ``AsyncWire`` can carry requests to ``url``: plain http, and no proxy in the way."""
    return urlsplit(url).scheme == "http" and usable(url)


def usable(url: str) -> bool:
    """Whether ``Wire`` can carry requests to ``url``: http or https, and no proxy in the way; and the
    platform has ``select.poll``, with which an idle connection is checked before it is reused (not
    Windows: there httpx carries them)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or not _CAN_POLL:
        return False
    proxies = urllib.request.getproxies()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return True
    return bool(urllib.request.proxy_bypass(parts.hostname))


def _target(base: str, path: str, params: Mapping[str, str] | None) -> str:
    """The request target: the URL's path prefix, the call's path, and its query."""
    return base + path + ("?" + urlencode(params) if params else "")


def host_field(parts: SplitResult) -> str:
    """The ``Host`` header for a URL: its host (an IPv6 address in brackets) and the port it names, never
    its user-info (``netloc`` would copy ``user:password@`` into every request)."""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return host if parts.port is None else f"{host}:{parts.port}"


class _Reader(io.RawIOBase):
    """The socket's reads for one answer of ``Wire``'s, all within one deadline: the socket's timeout
    (``Wire.request`` sets it to the read timeout before sending) from the first read on. That read
    keeps the timeout the socket has; a later one, rare for the broker's answers, is given what is left
    (one more system call). Notes whether the stream ended (``ended``)."""

    def __init__(self, raw: io.RawIOBase, sock: socket.socket) -> None:
        super().__init__()
        self._raw = raw
        self._sock = sock
        self._timeout = sock.gettimeout()
        self._deadline = 0.0
        self.ended = False

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._raw.fileno()

    def readinto(self, buffer: Any) -> int | None:
        if self._deadline:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            self._sock.settimeout(left)
        elif self._timeout is not None:
            self._deadline = time.monotonic() + self._timeout
        count = self._raw.readinto(buffer)
        if not count:
            self.ended = True
        return count

    def close(self) -> None:
        if not self.closed:
            self._raw.close()  # the socket's file: the socket closes once it and the connection let go
        super().close()


class _Answer(http.client.HTTPResponse):
    """``http.client``'s answer, read within one deadline (``_Reader``), whose head must end before the
    connection does: ``http.client`` takes the stream's end for the head's, so a head cut short was an
    answer (a success, for a call whose body is not read), where ``AsyncWire`` raises
    ``RemoteProtocolError``."""

    def __init__(
        self, sock: socket.socket, debuglevel: int = 0, method: str | None = None, url: str | None = None
    ) -> None:
        super().__init__(sock, debuglevel, method, url)
        self._reader = _Reader(self.fp.detach(), sock)
        self.fp = io.BufferedReader(self._reader)

    def begin(self) -> None:
        super().begin()
        # A complete head ends with an empty line, found without reading on: a read that met the
        # stream's end means the connection closed before the head did.
        if self._reader.ended:
            raise http.client.HTTPException("the connection closed in the answer's head")
        lengths = {value.strip(" \t") for value in self.headers.get_all("Content-Length") or ()}
        if len(lengths) > 1:  # http.client takes the first: the rest of the body would be the next answer
            raise http.client.HTTPException(f"content-lengths that differ: {sorted(lengths)[:2]!r}")
        for length in lengths:
            if not (length.isdigit() and length.isascii()):
                # http.client reads "-1" as no length (a body that ends with the connection), takes "+5".
                raise http.client.HTTPException(f"content-length {length[:80]!r}")

    def _read_status(self) -> tuple[str, int, str]:
        """The next status line, past informational answers: ``begin`` skips only 100 Continue's, and
        took any other (103 Early Hints from a proxy) for the answer, leaving the real one to be read as
        the next request's."""
        while True:
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if status == 101:  # a protocol switch, which no request of the client's asks for
                raise http.client.HTTPException("101 Switching Protocols, which nothing asked for")
            if not 100 < status < 200:
                return version, status, reason
            http.client.parse_headers(self.fp)  # the informational answer's head, skipped


class _HTTPConnection(http.client.HTTPConnection):
    response_class = _Answer


class _HTTPSConnection(http.client.HTTPSConnection):
    response_class = _Answer


class Wire:
    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._base = parts.path.rstrip("/")
        self._headers = {**headers, "Host": host_field(parts), "Accept-Encoding": "identity"}
        self._context = ssl.create_default_context() if self._https else None
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        params: Mapping[str, str] | None,
        connect_timeout: float,
        read_timeout: float,
    ) -> tuple[int, bytes]:
        """Send one request and read its whole answer: ``(status, body)``."""
        target = _target(self._base, path, params)
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        connection = self._take() or self._connect(connect_timeout)
        try:
            sock = connection.sock
            if sock is not None:
                sock.settimeout(read_timeout)  # the send's, then the whole answer's (``_Reader``)
            try:
                connection.request(method, target, body, headers)
            except TimeoutError as error:
                raise httpx.WriteTimeout(f"could not send the request within {read_timeout:g} s") from error
            except OSError as error:
                early = self._early_answer(connection, read_timeout)
                if early is None:
                    raise httpx.WriteError(str(error) or type(error).__name__) from error
                connection.close()
                return early
            try:
                response = connection.getresponse()
                data = response.read()
            except TimeoutError as error:
                raise httpx.ReadTimeout(f"no answer within {read_timeout:g} s") from error
            except (http.client.RemoteDisconnected, http.client.IncompleteRead) as error:
                raise httpx.RemoteProtocolError(str(error) or type(error).__name__) from error
            except http.client.HTTPException as error:
                raise httpx.RemoteProtocolError(str(error) or type(error).__name__) from error
            except OSError as error:
                raise httpx.ReadError(str(error) or type(error).__name__) from error
        except BaseException:
            connection.close()
            raise
        if response.will_close:
            connection.close()
        else:
            self._give_back(connection)
        return response.status, data

    @staticmethod
    def _early_answer(connection: http.client.HTTPConnection, timeout: float) -> tuple[int, bytes] | None:
        """The answer the server sent before it stopped reading the request, whose send then failed
        (a 413 for a body over its limit, then the connection closed): ``None`` if there is none within
        ``timeout``."""
        sock = connection.sock
        if sock is None:
            return None
        sock.settimeout(timeout)
        try:
            response = connection.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException):
            return None

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        connection: http.client.HTTPConnection
        if self._https:
            connection = _HTTPSConnection(self._host, self._port, timeout=timeout, context=self._context)
        else:
            connection = _HTTPConnection(self._host, self._port, timeout=timeout)
        try:
            connection.connect()
        except TimeoutError as error:
            raise httpx.ConnectTimeout(
                f"could not connect to {self._host}:{self._port} within {timeout:g} s"
            ) from error
        except OSError as error:
            raise httpx.ConnectError(str(error) or type(error).__name__) from error
        if connection.sock is not None:
            connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return connection

    def _take(self) -> http.client.HTTPConnection | None:
        """An idle connection the server has not closed, or None."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                connection = self._idle.pop()
            sock = connection.sock
            if sock is not None:
                poller = select.poll()
                poller.register(sock, select.POLLIN)
                if not poller.poll(0):
                    return connection  # nothing to read: still open (EOF or stray bytes would be readable)
            connection.close()

    def _give_back(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(connection)
                return
        connection.close()


#: The longest answer head ``AsyncWire`` reads, in bytes.
MAX_HEAD = 64 * 1024
_RECEIVE = 65536
#: Requests of more bytes than this keep a duplicate of their socket while they are sent, from which the
#: answer is read if the send fails (``_early_answer``): smaller ones fit in the sockets' buffers, so
#: their send does not wait for the server to read, and the duplicate (two system calls) is saved.
SPARE_FROM = 64 * 1024


class AsyncWire:
    """``Wire`` for ``AsyncClient``: keep-alive HTTP/1.1 connections on anyio's TCP streams (so on trio
    or asyncio), each request written and each answer read here rather than through httpx, whose
    per-request CPU a worker pays on every settle call. Plain ``http://`` only (``usable_async``);
    failures are raised as the same httpx exceptions as ``Wire``'s. One connection carries one request
    at a time: concurrent requests take connections of their own, and at most ``MAX_IDLE`` are kept."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        self._host = parts.hostname or ""
        self._port = parts.port or 80
        self._base = parts.path.rstrip("/")
        fixed = {**headers, "Host": host_field(parts), "Accept-Encoding": "identity"}
        self._fields = "".join(f"{name}: {value}\r\n" for name, value in fixed.items()).encode("latin-1")
        self._idle: list[_Connection] = []

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            await anyio.aclose_forcefully(connection.stream)

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        params: Mapping[str, str] | None,
        connect_timeout: float,
        read_timeout: float,
    ) -> tuple[int, bytes]:
        """Send one request and read its whole answer: ``(status, body)``. The send, and then the whole
        answer, have ``read_timeout`` each."""
        data = self._request_bytes(method, path, body, params, {})
        connection = await self._take() or await self._connect(connect_timeout)
        spare = None
        try:
            if len(data) > SPARE_FROM:
                spare = connection.stream.extra(SocketAttribute.raw_socket).dup()
            sent = False
            try:
                with anyio.fail_after(read_timeout) as scope:
                    await connection.send(data)
                    sent = True
                    if spare is not None:  # a large body may have taken a while to send
                        scope.deadline = anyio.current_time() + read_timeout
                    status, content, reusable = await connection.read_answer(method)
            except TimeoutError as error:
                if sent:
                    raise httpx.ReadTimeout(f"no answer within {read_timeout:g} s") from error
                raise httpx.WriteTimeout(f"could not send the request within {read_timeout:g} s") from error
            except httpx.WriteError:
                early = None
                if spare is not None:
                    with anyio.move_on_after(read_timeout):
                        early = await _early_answer(spare, method)
                if early is None:
                    raise
                status, content = early
                reusable = False
        except BaseException:
            await anyio.aclose_forcefully(connection.stream)
            raise
        finally:
            if spare is not None:
                spare.close()
        if reusable and len(self._idle) < MAX_IDLE:
            self._idle.append(connection)
        else:
            await anyio.aclose_forcefully(connection.stream)
        return status, content

    @contextlib.asynccontextmanager
    async def stream(
        self,
        path: str,
        params: Mapping[str, str] | None,
        headers: Mapping[str, str],
        connect_timeout: float,
        read_timeout: float,
    ) -> AsyncIterator[StreamedAnswer]:
        """``GET path`` on a connection of its own, whose answer's body is read as it arrives
        (``StreamedAnswer``); the connection is closed when the block ends."""
        connection = await self._connect(connect_timeout)
        try:
            sent = False
            try:
                with anyio.fail_after(read_timeout):  # the request is short: one deadline for both
                    await connection.send(self._request_bytes("GET", path, None, params, headers))
                    sent = True
                    answer = await connection.read_head("GET")
            except TimeoutError as error:
                if sent:
                    raise httpx.ReadTimeout(f"no answer within {read_timeout:g} s") from error
                raise httpx.WriteTimeout(f"could not send the request within {read_timeout:g} s") from error
            yield StreamedAnswer(connection, answer, read_timeout)
        finally:
            await anyio.aclose_forcefully(connection.stream)

    def _request_bytes(
        self,
        method: str,
        path: str,
        body: bytes | None,
        params: Mapping[str, str] | None,
        headers: Mapping[str, str],
    ) -> bytes:
        target = _target(self._base, path, params)
        data = b"%s %s HTTP/1.1\r\n%s" % (method.encode("ascii"), target.encode("ascii"), self._fields)
        for name, value in headers.items():
            data += b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
        if body is not None:
            return data + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
                len(body),
                body,
            )
        if method in ("POST", "PUT", "PATCH"):
            return data + b"Content-Length: 0\r\n\r\n"
        return data + b"\r\n"

    async def _connect(self, seconds: float) -> _Connection:
        try:
            with anyio.fail_after(seconds):
                stream = await anyio.connect_tcp(self._host, self._port)
        except TimeoutError as error:
            raise httpx.ConnectTimeout(
                f"could not connect to {self._host}:{self._port} within {seconds:g} s"
            ) from error
        except OSError as error:
            raise httpx.ConnectError(str(error) or type(error).__name__) from error
        return _Connection(stream)

    async def _take(self) -> _Connection | None:
        """An idle connection the server has not closed, or None. One that has something to read (the
        server's close, or stray bytes) is closed and dropped."""
        while self._idle:
            connection = self._idle.pop()
            poller = select.poll()
            poller.register(connection.stream.extra(SocketAttribute.raw_socket), select.POLLIN)
            if not poller.poll(0):
                return connection
            await anyio.aclose_forcefully(connection.stream)
        return None


async def _early_answer(spare: socket.socket, method: str) -> tuple[int, bytes] | None:
    """The answer the server sent before it stopped reading a request whose send then failed (a 413 for
    a body over its limit, then the connection closed), read from ``spare``, a duplicate of the
    connection's socket: on asyncio the stream's transport closes its socket when a send fails, and the
    answer, received but not yet read, would go with it. ``None`` if there is none."""
    spare.setblocking(False)
    try:
        status, content, _ = await _SpareConnection(spare).read_answer(method)
    except httpx.TransportError:
        return None
    return status, content


class _Head:
    """An answer's status line and headers, as ``_Connection.read_head`` read them."""

    __slots__ = ("chunked", "close", "headers", "length", "status")

    def __init__(self, status: int, headers: dict[str, str], length: int | None, chunked: bool, close: bool):
        self.status = status
        self.headers = headers  # names in lower case; of a repeated header, the last
        self.length = length  # None: chunked, or the body ends with the connection
        self.chunked = chunked
        self.close = close


class _Connection:
    """One keep-alive connection and what was read past the last answer (nothing, from a sound server)."""

    __slots__ = ("_buffer", "stream")

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self._buffer = b""

    async def send(self, data: bytes) -> None:
        try:
            await self.stream.send(data)
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as error:
            raise httpx.WriteError(str(error) or type(error).__name__) from error

    async def _receive(self) -> bytes:
        """What the server sent next; ``b""`` once it has closed the connection."""
        try:
            return await self.stream.receive(_RECEIVE)
        except anyio.EndOfStream:
            return b""
        except (OSError, anyio.BrokenResourceError) as error:
            raise httpx.ReadError(str(error) or type(error).__name__) from error

    async def _more(self, what: str) -> None:
        """Read once more onto the buffer: for a head or a chunk's size line, which are short (a head
        is at most ``MAX_HEAD``); a body or a chunk's data is read with ``_fill``."""
        data = await self._receive()
        if not data:
            if what == "head" and not self._buffer:
                raise httpx.RemoteProtocolError("Remote end closed connection without response")
            raise httpx.RemoteProtocolError(f"the connection closed in the answer's {what}")
        self._buffer += data

    async def _fill(self, size: int) -> None:
        """Read until the buffer holds at least ``size`` bytes of a body. What arrives is kept in parts
        and joined once: adding each read to the buffer (immutable bytes) would copy all of it again
        on every read, quadratic in the body's size (a 100 MB stream write took minutes)."""
        parts = [self._buffer]
        have = len(self._buffer)
        try:
            while have < size:
                data = await self._receive()
                if not data:
                    raise httpx.RemoteProtocolError("the connection closed in the answer's body")
                parts.append(data)
                have += len(data)
        finally:  # also when cancelled: what was read stays read
            self._buffer = b"".join(parts)

    async def read_answer(self, method: str) -> tuple[int, bytes, bool]:
        """The next answer: its status, its body, and whether the connection can carry another
        request."""
        head = await self.read_head(method)
        if head.chunked:
            parts = []
            while (part := await self.read_chunks()) is not None:
                parts.append(part)
            return head.status, b"".join(parts), not head.close and not self._buffer
        if head.length is None:  # the body ends with the connection
            parts = [self._buffer]
            while data := await self._receive():
                parts.append(data)
            self._buffer = b""
            return head.status, b"".join(parts), False
        if len(self._buffer) < head.length:
            await self._fill(head.length)
        content, self._buffer = self._buffer[: head.length], self._buffer[head.length :]
        return head.status, content, not head.close and not self._buffer

    async def read_head(self, method: str) -> _Head:
        """The next answer's head; informational answers (1xx) are skipped. A body the answer does not
        have (``HEAD``, 204, 304) is given a length of 0."""
        while True:
            while (end := self._buffer.find(b"\r\n\r\n")) == -1:
                if len(self._buffer) > MAX_HEAD:
                    raise httpx.RemoteProtocolError("the answer's head is too long")
                await self._more("head")
            lines = self._buffer[:end].split(b"\r\n")
            self._buffer = self._buffer[end + 4 :]
            version, _, rest = lines[0].partition(b" ")
            try:
                status = int(rest[:3])
            except ValueError:
                raise httpx.RemoteProtocolError(f"not an HTTP answer: {lines[0][:80]!r}") from None
            if not version.startswith(b"HTTP/1.") or not 100 <= status <= 999:
                raise httpx.RemoteProtocolError(f"not an HTTP answer: {lines[0][:80]!r}")
            if status == 101:  # a protocol switch, which no request of the client's asks for
                raise httpx.RemoteProtocolError("101 Switching Protocols, which nothing asked for")
            if status >= 200:
                break
        headers: dict[str, str] = {}
        length = None
        chunked = False
        close = version != b"HTTP/1.1"
        for line in lines[1:]:
            raw_name, _, raw_value = line.partition(b":")
            name = raw_name.strip().lower().decode("latin-1")
            value = headers[name] = raw_value.strip().decode("latin-1")
            if name == "content-length":
                if not value.isdigit() or not value.isascii():  # int() takes "-1", "+5" and "1_0"
                    raise httpx.RemoteProtocolError(f"content-length {value[:80]!r}")
                if length is not None and int(value) != length:  # which would be the body's end?
                    raise httpx.RemoteProtocolError(f"content-lengths that differ: {length}, {value[:80]}")
                length = int(value)
            elif name == "transfer-encoding":
                chunked = value.lower().endswith("chunked")
            elif name == "connection":
                tokens = {token.strip().lower() for token in value.split(",")}
                close = "close" in tokens or (close and "keep-alive" not in tokens)
        if method == "HEAD" or status in (204, 304):
            length, chunked = 0, False
        elif chunked:
            length = None
        return _Head(status, headers, length, chunked, close)

    async def read_part(self, left: int | None) -> bytes:
        """What has arrived of a body of ``left`` more bytes (``None``: until the connection closes),
        reading if nothing has; ``b""`` once a body that ends with the connection has ended."""
        if not self._buffer:
            data = await self._receive()
            if not data:
                if left is None:
                    return b""
                raise httpx.RemoteProtocolError("the connection closed in the answer's body")
            self._buffer = data
        part = self._buffer if left is None else self._buffer[:left]
        self._buffer = self._buffer[len(part) :]
        return part

    async def read_chunks(self) -> bytes | None:
        """The data of the chunks of a chunked body that are complete in what has arrived, reading
        until there is at least one; ``None`` after the last (its trailers read past). The buffer is
        read from an offset and cut once on the way out, so that many small chunks in one read do
        not copy the rest of it once each."""
        parts: list[bytes] = []
        buffer = self._buffer
        start = 0  # where the next chunk begins in ``buffer``
        try:
            while True:
                end = buffer.find(b"\r\n", start)
                if end == -1:
                    if parts:
                        return b"".join(parts)
                    self._buffer = buffer = buffer[start:]
                    start = 0
                    await self._more("body")
                    buffer = self._buffer
                    continue
                size_field = buffer[start:end].split(b";", 1)[0].strip()
                try:
                    size = int(size_field, 16)
                except ValueError:
                    raise httpx.RemoteProtocolError(f"chunk size {size_field[:20]!r}") from None
                if size == 0:
                    if parts:
                        return b"".join(parts)  # the end is for the next call
                    start = end + 2
                    while (end := buffer.find(b"\r\n", start)) != start:  # trailers, up to the empty line
                        if end == -1:
                            self._buffer = buffer = buffer[start:]
                            start = 0
                            await self._more("body")
                            buffer = self._buffer
                        else:
                            start = end + 2
                    start += 2
                    return None
                stop = end + 2 + size + 2
                if len(buffer) < stop:
                    if parts:
                        return b"".join(parts)
                    self._buffer = buffer = buffer[start:]
                    stop -= start
                    end -= start
                    start = 0
                    await self._fill(stop)
                    buffer = self._buffer
                parts.append(buffer[end + 2 : end + 2 + size])
                start = stop
        finally:
            # ``start`` is 0 whenever a read is under way (``buffer`` is then the buffer itself), so
            # a read cut short by an error or a cancel keeps what it read.
            if start:
                self._buffer = buffer[start:]


class _SpareConnection(_Connection):
    """A ``_Connection`` that reads from a socket of its own rather than a stream (``_early_answer``)."""

    __slots__ = ("_socket",)

    def __init__(self, sock: socket.socket) -> None:  # no stream: only ever read from
        self._socket = sock
        self._buffer = b""

    async def _receive(self) -> bytes:
        while True:
            await anyio.wait_readable(self._socket)
            try:
                return self._socket.recv(_RECEIVE)
            except BlockingIOError:  # woken with nothing to read after all
                continue
            except OSError as error:
                raise httpx.ReadError(str(error) or type(error).__name__) from error


class StreamedAnswer:
    """The answer to ``AsyncWire.stream``, read as it arrives: what the worker loop uses of an httpx
    ``Response`` (``status_code``, ``headers``, ``aread``, ``json``, ``aiter_raw``)."""

    def __init__(self, connection: _Connection, head: _Head, read_timeout: float) -> None:
        self._connection = connection
        self._head = head
        self._read_timeout = read_timeout
        self._content: bytes | None = None
        self.status_code = head.status
        self.headers = head.headers

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's parts as they arrive (chunked framing removed), each within the read timeout."""
        connection, head = self._connection, self._head
        left = head.length
        try:
            while True:
                with anyio.fail_after(self._read_timeout):
                    if head.chunked:
                        part = await connection.read_chunks()
                        if part is None:
                            return
                    elif left == 0:
                        return
                    else:
                        part = await connection.read_part(left)
                        if not part:
                            return  # a body that ends with the connection has ended
                        if left is not None:
                            left -= len(part)
                if part:
                    yield part
        except TimeoutError as error:
            raise httpx.ReadTimeout(f"nothing read within {self._read_timeout:g} s") from error

    async def aread(self) -> bytes:
        if self._content is None:
            self._content = b"".join([part async for part in self.aiter_raw()])
        return self._content

    def json(self) -> Any:
        return codec.loads(self._content or b"")
