"""The push's HTTP/1.1 client: one request at a time per connection, a small pool of keep-alive ones.

Why not httpx: push sends one kind of request (a POST with a small body, answer mostly ignored) at up
to ``concurrency`` at once, and a profile of the push benchmark put ~1.6 ms of server CPU per message
in httpx and httpcore (the pool scanning every connection per request, its locks, its request and
response models). This client does only what push needs:

* ``ConnectionPool.post`` takes an idle connection to the URL's (scheme, host, port), or opens one
  (a ``trio.SocketStream``, in a ``trio.SSLStream`` for https), writes the request in one
  ``send_all``, reads the answer's status and headers, then up to ``MAX_ANSWER_BYTES`` of body
  (dropped), and puts the connection back when the receiver keeps it alive. A connection is in one
  request at a time, so the pool holds at most as many connections as there were requests in flight
  at once: one per concurrency slot. It is closed instead of pooled on ``Connection: close`` (or an
  HTTP/1.0 answer), on any error, when a cancellation (the push's timeout) interrupts the request,
  and when more than ``MAX_ANSWER_BYTES`` would have to be read.
* Answers: the usual one (HTTP/1.1, a Content-Length body, its head in the first read) is read by
  ``_plain_answer``, a few lines that take the status, Content-Length, Connection and Retry-After;
  anything else (chunked, 1xx, 204/304, HTTP/1.0, a body delimited by the close, a head split across
  reads, or what is not HTTP at all) by h11, which frames it as HTTP/1.1 says. The plain path exists
  because h11's per-event work was ~40% of the server's CPU per push: with it the push benchmark
  went from ~3,600 to ~5,400 msg/s (docs/benchmarks.md). Requests are written by ``_request``, which
  checks header names and values as h11 would (no CR, LF or other control character).
* No timeout of its own: the caller's cancel scope covers connect, send and the whole answer.
* No redirects: a 3xx is an answer like any other.
* Before opening a connection the host is resolved once (``trio.socket.getaddrinfo``), and unless the
  push config has ``allow_private``, refused when any of its addresses is one push may not reach
  (``broker.core.config``'s predicate, the one the URL check uses: link-local, cloud metadata); the
  socket then connects to an address just checked, so a second, different answer from DNS (rebinding)
  cannot slip past.
* https: ``ssl.create_default_context()`` (certificates and host names verified), made once per pool.

Errors, all ``TransportError``; the dispatcher reports ``f"{type(error).__name__}: {error}"``::

    TransportError
    ├── ConnectError            no connection: name not found, refused, unreachable, TLS handshake
    │   └── PrivateAddress      the host resolves to an address push may not reach (allow_private)
    ├── LocalError              the broker could not open a connection: out of files, memory or ports
    ├── WriteError, ReadError   the connection broke during the request
    └── RemoteProtocolError     the answer is not HTTP/1.1
"""

from __future__ import annotations

import base64
import errno
import functools
import os
import re
import ssl
from collections import deque
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote, unquote_to_bytes, urlsplit

import h11
import trio

# The URL check's own predicate: one rule for the host a URL names and for the addresses it resolves to.
from broker.core.config import is_metadata_or_link_local

#: Bytes of an answer's body read (and dropped) so its connection can be reused; beyond, it is closed.
MAX_ANSWER_BYTES = 64 * 1024
#: The most bytes asked of the socket at once.
RECEIVE_SIZE = 64 * 1024


class TransportError(Exception):
    """The request got no (whole) answer."""


class ConnectError(TransportError):
    """No connection to the receiver could be made."""


class PrivateAddress(ConnectError):
    """The host resolves to an address push may not reach unless the config sets ``allow_private``."""


class LocalError(TransportError):
    """This process could not open a connection (``LOCAL_ERRNOS``): nothing was sent, and the receiver is
    not to blame."""


#: Errors of ``socket()`` or ``connect()`` that are this host's, not the receiver's: no file descriptor,
#: no buffer or memory. No address would do better.
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: Errors of one address that are this host's too, but another address of the name may not meet: no
#: local port left, or no source address or support for its family (``::1`` where IPv6 is disabled, as
#: in many containers). The next address is tried; when every one failed so, nothing could be sent.
LOCAL_ADDRESS_ERRNOS = frozenset({errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT})


class WriteError(TransportError):
    """The connection broke while the request was sent."""


class ReadError(TransportError):
    """The connection broke before the whole answer came."""


class RemoteProtocolError(TransportError):
    """The receiver's answer is not valid HTTP/1.1."""


@dataclass(frozen=True, slots=True)
class Answer:
    """What push needs of a receiver's answer."""

    status: int
    retry_after: str | None  # the Retry-After header, as sent


class Transport(Protocol):
    """What the dispatcher sends its requests through: a ``ConnectionPool``, or a test's fake."""

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], *, allow_private: bool
    ) -> Answer: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Target:
    scheme: str
    host: str
    port: int
    host_header: str
    path: str  # path and query, as the request line carries them
    head: str  # the request line, the Host header and any Authorization from user-info, as sent


@functools.lru_cache(maxsize=256)
def _target(url: str) -> _Target:
    parts = urlsplit(url)
    host = parts.hostname or ""
    default = 443 if parts.scheme == "https" else 80
    port = parts.port or default
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    path = quote(path, safe=_VISIBLE_ASCII)  # as httpx did: a space or a non-ASCII character encoded
    try:
        name = host if ":" in host else host.encode("idna").decode("ascii")
    except UnicodeError:
        raise TransportError(f"the URL's host is not a valid name: {host!r}") from None
    host_header = (f"[{name}]" if ":" in name else name) + (f":{parts.port}" if parts.port else "")
    head = f"POST {path} HTTP/1.1\r\nhost: {host_header}\r\n"
    if parts.username is not None:  # user-info is HTTP Basic auth, as curl and browsers send it
        # The bytes the URL encodes, as curl sends them (not decoded as UTF-8, which is lossy).
        credentials = unquote_to_bytes(parts.username) + b":" + unquote_to_bytes(parts.password or "")
        head += f"authorization: Basic {base64.b64encode(credentials).decode('ascii')}\r\n"
    return _Target(parts.scheme, host, port, host_header, path, head)


_TOKEN = re.compile(r"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_TOKEN_BYTES = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")  # no control character but tab
_VISIBLE_ASCII = "".join(chr(code) for code in range(0x21, 0x7F))
#: Headers the client writes itself, which a caller may not give (they frame the request).
_FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection"})
#: An HTTP/1.1 status line with a final status (1xx, and 204 and 304 which never have a body, go to h11).
_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([2-5][0-9][0-9])(?: [^\r\n]*)?")


def _request(target: _Target, body: bytes, headers: dict[str, str]) -> bytes:
    """The whole request, head and body, as one byte string."""
    parts = [target.head, "content-length: ", str(len(body)), "\r\n"]
    for name, value in headers.items():
        if (
            _TOKEN.fullmatch(name) is None
            or _FIELD_VALUE.fullmatch(value) is None
            or name.lower() in _FRAMING
        ):
            raise TransportError(f"the request cannot be sent: header {name!r} is not allowed or not valid")
        parts += (name, ": ", value, "\r\n")
    parts.append("\r\n")
    try:
        return "".join(parts).encode("latin-1") + body
    except UnicodeEncodeError:
        raise TransportError("the request cannot be sent: a header value is not Latin-1") from None


def _plain_answer(data: bytes) -> tuple[int, str | None, int, bool, int] | None:
    """``(status, Retry-After, Content-Length, keep-alive, where the body starts)`` when ``data`` holds
    the answer's whole head and the answer is of the plain kind: HTTP/1.1, a final status other than
    204 and 304, one Content-Length, no Transfer-Encoding. ``None`` for anything else, which h11 reads."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = data[:end].split(b"\r\n")
    status_line = _STATUS_LINE.fullmatch(lines[0])
    if status_line is None:
        return None
    status = int(status_line[1])
    if status in (204, 304):
        return None
    length: int | None = None
    retry_after: str | None = None
    keep_alive = True
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or _TOKEN_BYTES.fullmatch(name) is None:
            return None  # a folded or malformed line: h11 says what it is
        name = name.lower()
        if name == b"content-length":
            value = value.strip(b" \t")
            if length is not None or not value.isdigit() or len(value) > 18:  # int() of 5000 digits raises
                return None
            length = int(value)
        elif name == b"transfer-encoding":
            return None
        elif name == b"connection":
            keep_alive = keep_alive and b"close" not in [token.strip().lower() for token in value.split(b",")]
        elif name == b"retry-after":
            retry_after = value.strip(b" \t").decode("latin-1")
    if length is None:
        return None
    return status, retry_after, length, keep_alive, end + 4


class _Connection:
    """One keep-alive connection: its stream (TLS for https) and its socket.

    The request is written whole by ``_request``. The answer is read by ``_plain_answer`` when it is of
    the usual kind (a Content-Length body, the head in the first read), else by h11, which is then
    told what was sent so that it frames the answer as HTTP/1.1 says. The plain path exists because
    h11's per-event work was ~40% of the server's CPU per push in the push benchmark (docs/benchmarks.md).
    """

    __slots__ = ("socket", "stream")

    def __init__(self, stream: trio.abc.Stream, sock: trio.socket.SocketType) -> None:
        self.stream = stream
        self.socket = sock

    def close(self) -> None:
        """Close at once, with no await (also from a cancelled scope); an https connection ends with no
        ``close_notify``, which HTTP/1.1 allows."""
        self.socket.close()

    def usable(self) -> bool:
        """Whether an idle connection can take a request: not readable (readable while idle means the
        receiver closed it, or sent what no request asked for)."""
        return not self.socket.is_readable()

    async def exchange(self, target: _Target, body: bytes, headers: dict[str, str]) -> tuple[Answer, bool]:
        """Send one request and read its answer: ``(answer, reusable)``. A failure before one byte of
        the answer came is raised as ``_Unanswered``, so that a request on a connection the receiver
        had just closed can go again on a new one."""
        request = _request(target, body, headers)
        try:
            await self.stream.send_all(request)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            raise _Unanswered(WriteError(_reason(error))) from None
        try:
            data = bytes(await self.stream.receive_some(RECEIVE_SIZE))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            raise _Unanswered(ReadError(_reason(error))) from None
        if not data:
            raise _Unanswered(ReadError("the receiver closed the connection without an answer"))
        plain = _plain_answer(data)
        if plain is None:
            return await self._read_with_h11(target, body, headers, data)
        status, retry_after, length, keep_alive, body_at = plain
        answer = Answer(status, retry_after)
        if length > MAX_ANSWER_BYTES:  # not worth reading: the connection is dropped
            return answer, False
        received = len(data) - body_at
        try:
            while received < length:
                chunk = await self.stream.receive_some(RECEIVE_SIZE)
                if not chunk:
                    raise ReadError("the receiver closed the connection mid-answer")
                received += len(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            raise ReadError(_reason(error)) from None
        return answer, keep_alive and received == length  # more than the answer: out of step, dropped

    async def _read_with_h11(
        self, target: _Target, body: bytes, headers: dict[str, str], data: bytes
    ) -> tuple[Answer, bool]:
        protocol = h11.Connection(h11.CLIENT)
        fields = [("host", target.host_header), ("content-length", str(len(body))), *headers.items()]
        try:  # what was sent, as h11 needs to know it to frame the answer (its bytes are not used)
            protocol.send(h11.Request(method="POST", target=target.path, headers=fields))
            protocol.send(h11.Data(data=body))
            protocol.send(h11.EndOfMessage())
        except h11.LocalProtocolError as error:  # pragma: no cover - ``_request`` checked the same
            raise TransportError(f"the request cannot be sent: {error}") from None
        protocol.receive_data(data)
        status: int | None = None
        retry_after: str | None = None
        read = 0
        try:
            while True:
                event = protocol.next_event()
                if event is h11.NEED_DATA:
                    protocol.receive_data(bytes(await self.stream.receive_some(RECEIVE_SIZE)))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    for name, value in event.headers:
                        if name == b"retry-after":
                            retry_after = value.decode("latin-1")
                elif isinstance(event, h11.Data):
                    read += len(event.data)
                    if read > MAX_ANSWER_BYTES:  # not worth draining: the connection is dropped
                        assert status is not None
                        return Answer(status, retry_after), False
                elif isinstance(event, h11.EndOfMessage):
                    assert status is not None
                    break
                elif isinstance(event, h11.ConnectionClosed):  # pragma: no cover - h11 raises first
                    raise ReadError("the receiver closed the connection mid-answer")
                # an h11.InformationalResponse (1xx) comes before the real answer: skipped
        except h11.RemoteProtocolError as error:
            raise RemoteProtocolError(str(error)) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            raise ReadError(_reason(error)) from None
        reusable = protocol.their_state is h11.DONE and not protocol.trailing_data[0]
        return Answer(status, retry_after), reusable  # not after Connection: close, or HTTP/1.0


class _Unanswered(Exception):
    """Internal: the request failed with not one byte of answer (``error`` is what to report)."""

    def __init__(self, error: TransportError) -> None:
        super().__init__(str(error))
        self.error = error


class ConnectionPool:
    """Keep-alive connections per (scheme, host, port, allow_private), for one dispatcher.

    Idle connections are kept newest last and taken newest first (the likeliest to be still open);
    ``max_idle`` bounds them per target (the dispatcher sets it to its concurrency), the oldest closed
    first. Not shared between tasks in the middle of a request: a connection is taken out while used.
    """

    def __init__(self, *, ssl_context: ssl.SSLContext | None = None, max_idle: int = 1000) -> None:
        self.max_idle = max_idle
        self._ssl_context = ssl_context
        self._idle: dict[tuple[str, str, int, bool], deque[_Connection]] = {}
        self._closed = False

    async def post(self, url: str, body: bytes, headers: dict[str, str], *, allow_private: bool) -> Answer:
        """POST ``body`` with ``headers`` (lowercase names; Host and Content-Length are added) to
        ``url``: the answer's status and Retry-After, or a ``TransportError``."""
        target = _target(url)
        key = (target.scheme, target.host, target.port, allow_private)
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if not connection.usable():
                connection.close()
                continue
            try:
                return await self._exchange(connection, key, target, body, headers)
            except _Unanswered:
                # The receiver closed this idle connection as the request went out (its keep-alive
                # timeout): nothing was answered, so the request goes once more on a new connection.
                break
        connection = await self._connect(target, allow_private)
        try:
            return await self._exchange(connection, key, target, body, headers)
        except _Unanswered as unanswered:
            raise unanswered.error from None

    async def _exchange(
        self,
        connection: _Connection,
        key: tuple[str, str, int, bool],
        target: _Target,
        body: bytes,
        headers: dict[str, str],
    ) -> Answer:
        try:
            answer, reusable = await connection.exchange(target, body, headers)
        except BaseException:  # an error, or the push's timeout cancelling it: its state is unknown
            connection.close()
            raise
        if reusable and not self._closed:
            idle = self._idle.setdefault(key, deque())
            idle.append(connection)
            while len(idle) > self.max_idle:
                idle.popleft().close()
        else:
            connection.close()
        return answer

    async def _connect(self, target: _Target, allow_private: bool) -> _Connection:
        host, port = target.host, target.port
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
        except OSError as error:  # socket.gaierror
            raise ConnectError(f"cannot resolve {host}: {_reason(error)}") from None
        if not allow_private:
            resolved = {str(info[4][0]) for info in infos}
            refused = sorted(address for address in resolved if is_metadata_or_link_local(address))
            if refused:
                raise PrivateAddress(
                    f"{host} resolves to {', '.join(refused)}, a link-local or metadata address; "
                    "set push.allow_private to allow it"
                )
            if is_metadata_or_link_local(host):
                raise PrivateAddress(f"{host} is a cloud metadata host; set push.allow_private to allow it")
        connected: trio.socket.SocketType | None = None
        failure: OSError | None = None  # the receiver's side: refused, unreachable, timed out
        local: OSError | None = None  # this host's, for one address (``LOCAL_ADDRESS_ERRNOS``)
        for family, kind, proto, _, address in infos:  # the addresses checked above, in DNS order
            try:
                candidate = trio.socket.socket(family, kind, proto)
            except OSError as error:
                if error.errno not in LOCAL_ADDRESS_ERRNOS:
                    raise LocalError(f"cannot open a socket: {_reason(error)}") from None
                local = error
                continue
            try:
                await candidate.connect(address)
            except OSError as error:
                candidate.close()
                if error.errno in LOCAL_ERRNOS:
                    raise LocalError(f"cannot connect to {host}:{port}: {_reason(error)}") from None
                if error.errno in LOCAL_ADDRESS_ERRNOS:
                    local = error
                else:
                    failure = error
                continue
            except BaseException:
                candidate.close()
                raise
            connected = candidate
            break
        if connected is None:
            if failure is None and local is not None:  # no address could even be tried from here
                raise LocalError(f"cannot connect to {host}:{port}: {_reason(local)}")
            reason = _reason(failure) if failure is not None else "no address"
            raise ConnectError(f"cannot connect to {host}:{port}: {reason}")
        stream = trio.SocketStream(connected)  # with TCP_NODELAY: a request goes out whole, at once
        if target.scheme != "https":
            return _Connection(stream, connected)
        if self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
            self._ssl_context.set_alpn_protocols(["http/1.1"])
        tls = trio.SSLStream(stream, self._ssl_context, server_hostname=host, https_compatible=True)
        try:
            await tls.do_handshake()
        except BaseException as error:
            connected.close()
            if isinstance(error, trio.BrokenResourceError | OSError):
                cause = error.__cause__ or error
                raise ConnectError(f"TLS handshake with {host} failed: {_reason(cause)}") from None
            raise
        return _Connection(tls, connected)

    def close(self) -> None:
        """Close every idle connection; connections in use are closed when their request ends."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.popleft().close()
        self._idle.clear()

    def statistics(self) -> dict[str, int]:
        """Idle connections per target, as ``"scheme://host:port"`` → count."""
        return {
            f"{scheme}://{host}:{port}": len(idle)
            for (scheme, host, port, _), idle in self._idle.items()
            if idle
        }


def _reason(error: BaseException) -> str:
    if isinstance(error, ssl.SSLCertVerificationError):  # an OSError whose errno (1) says nothing
        return f"certificate verify failed: {error.verify_message}"
    if isinstance(error, ssl.SSLError):
        return error.reason or str(error)
    if isinstance(error, OSError):
        if isinstance(error.errno, int) and error.errno > 0:
            return os.strerror(error.errno)  # not Trio's "Error connecting to ('…', …): …" around it
        if error.strerror:  # socket.gaierror: its errno is an EAI_ code
            return error.strerror
    return str(error) or type(error).__name__
