"""HTTP/1.1 requests of the everyday shape, read and answered without h11.

Hypercorn serves HTTP/1.1 through h11, a careful pure-Python implementation of the whole protocol, and
through a task per request with a channel for its body. In the in-memory drain h11 alone was ~14% of
the server's CPU and Hypercorn's own protocol objects ~6% more, for requests that are nearly all alike:
a request line, a handful of headers, a body of known length, and an answer of known length.

The connection handler (``connection.py``) serves such requests itself, one at a time, in the task that
reads the connection: ``parse_head`` reads a request's head, ``ExpressRequest`` is the request's ASGI
``receive`` and ``send``. What a request must look like to be served here (anything else, and everything
after it on its connection, goes to Hypercorn and h11 as before, from the first byte of that request):

- ``HTTP/1.1``, a method other than ``HEAD``, a target that starts with ``/``, one ``Host``;
- headers that h11 would accept as they are (names are tokens, values printable, no line folding), the
  whole head within Hypercorn's ``h11_max_incomplete_size``, lines that end with CRLF;
- no ``Transfer-Encoding``, ``Expect`` or ``Upgrade`` header, and ``Connection`` only as ``keep-alive``;
  at most one ``Content-Length``.

What the app and the client see is what Hypercorn and h11 give them: the same ASGI scope (headers with
lower-case names, the path unquoted), the body as it arrives, ``http.disconnect`` once the client has
gone or the answer is complete, the same bytes on the wire for the answer (``date`` and ``server``
appended, ``Transfer-Encoding: chunked`` for an answer of unknown length, ``Connection: close`` on the
connection's last answer, ``keep_alive_max_requests``), and a 500 for an app that fails before
answering. The differences a client could notice: time, and a request body its app answered without
reading (a 404, a 413) is read past (``ExpressRequest.skip_body``, up to a bound in ``connection.py``) and
the connection kept, where Hypercorn closed it with the body unread, and the kernel then reset it
(which could lose the answer before the client read it). And a request pipelined behind one in hand is
read while it runs, so a client leaving is noticed there too (h11 stops reading until the answer).
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Iterable
from enum import Enum, auto
from typing import Any, cast
from urllib.parse import unquote

import trio
from hypercorn.config import Config
from hypercorn.typing import ASGIReceiveEvent, ASGISendEvent, HTTPScope, ResponseSummary
from hypercorn.utils import UnexpectedMessageError, build_and_validate_headers

_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
#: A request header as this lane takes it: h11's rule, without the control characters it lets through.
_REQUEST_HEADER = re.compile(
    rb"([-!#$%&'*+.^_`|~0-9A-Za-z]+):[ \t]*((?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?)[ \t]*"
)
#: A response header's value as h11 checks it before sending (its ``field_value``).
_RESPONSE_VALUE = re.compile(rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?")
_TARGET = re.compile(rb"/[\x21-\x7e]*")
_DIGITS = re.compile(rb"[0-9]{1,18}")
#: Request headers whose handling is h11's: the request goes there.
_NOT_HERE = frozenset((b"transfer-encoding", b"expect", b"upgrade"))
#: Answers that have no body, whatever their headers say (h11's framing).
_NO_BODY = frozenset((204, 304))


class NotExpress(Exception):
    """The request is not of the shape this lane serves: Hypercorn and h11 take it."""


class Head:
    """A request's line and headers, as ``parse_head`` read them."""

    __slots__ = ("content_length", "headers", "method", "size", "target")

    def __init__(
        self, method: str, target: bytes, headers: list[tuple[bytes, bytes]], content_length: int, size: int
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers  # names in lower case, values without the whitespace around them
        self.content_length = content_length
        self.size = size  # bytes, up to and including the empty line


def parse_head(buffer: bytes, limit: int, searched: int = 0) -> Head | None:
    """The head at the start of ``buffer``; ``None`` if it is not all there yet. Raises ``NotExpress``
    if the request is not of this lane's shape, or its head is longer than ``limit`` bytes.
    ``searched``: how much of ``buffer`` an earlier call saw without finding the head's end, so that
    a head arriving a few bytes at a time is not scanned again from its start each time (quadratic)."""
    start = max(searched - 3, 0)  # the end marker may straddle what was seen and what is new
    end = buffer.find(b"\r\n\r\n", start)
    if end == -1:
        # A head that ends with bare line feeds never ends here: h11 reads it.
        if len(buffer) > limit or buffer.find(b"\n\n", start) != -1 or buffer.find(b"\n\r\n", start) != -1:
            raise NotExpress
        return None
    if end + 4 > limit:
        raise NotExpress
    lines = buffer[:end].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise NotExpress
    method, target, version = parts
    if (
        version != b"HTTP/1.1"
        or _TOKEN.fullmatch(method) is None
        or method.upper() in (b"HEAD", b"CONNECT")
        or _TARGET.fullmatch(target) is None
    ):
        raise NotExpress
    headers = []
    content_length = -1
    hosts = 0
    for line in lines[1:]:
        match = _REQUEST_HEADER.fullmatch(line)
        if match is None:
            raise NotExpress
        name = match[1].lower()
        value = match[2]
        if name == b"content-length":
            if content_length != -1 or _DIGITS.fullmatch(value) is None:
                raise NotExpress
            content_length = int(value)
        elif name == b"host":
            hosts += 1
        elif name in _NOT_HERE or (name == b"connection" and value.lower() != b"keep-alive"):
            raise NotExpress
        headers.append((name, value))
    if hosts != 1:
        raise NotExpress
    return Head(method.decode("ascii").upper(), target, headers, max(content_length, 0), end + 4)


class _State(Enum):
    REQUEST = auto()  # no answer yet
    RESPONSE = auto()  # the answer's head is made, its body under way
    CLOSED = auto()  # the answer is complete


class ExpressRequest:
    """One request on this lane: its ASGI scope, ``receive`` and ``send``, and ``serve`` to run the app.

    ``read`` gives what the client sends next (``b""`` once it has gone), ``write`` puts bytes on the
    connection. ``received`` is what was read past the head; what is left of it, and of what
    ``receive`` read while waiting for a disconnect, after the body is ``rest``: the next requests.
    ``extensions`` is the scope's (the connection's ``ClientLink``).
    """

    def __init__(
        self,
        head: Head,
        received: bytes,
        *,
        read: Callable[[], Awaitable[bytes]],
        write: Callable[[bytes], Awaitable[None]],
        extensions: dict[str, dict[str, Any]],
        config: Config,
        client: tuple[str, int] | None,
        server: tuple[str, int] | None,
        state: dict[str, Any],
        last: bool,
    ) -> None:
        path, _, query_string = head.target.partition(b"?")
        self.scope: HTTPScope = {
            "type": "http",
            "http_version": "1.1",
            "asgi": {"spec_version": "2.1", "version": "3.0"},
            "method": head.method,
            "scheme": "http",
            "path": unquote(path.decode("ascii")),
            "raw_path": path,
            "query_string": query_string,
            "root_path": config.root_path,
            "headers": head.headers,
            "client": client,
            "server": server,
            "state": state.copy(),  # type: ignore[typeddict-item]
            "extensions": extensions,
        }
        self.rest = received
        self._unread = head.content_length  # bytes of the body not yet handed to the app
        self._body_given = False
        self._read = read
        self._write = write
        self._config = config
        self._last = last  # the connection's last request (keep_alive_max_requests)
        self._state = _State.REQUEST
        self._status = 0
        self._response: ResponseSummary = {"status": 0, "headers": []}  # for the access log
        self._head = b""  # the answer's head, written with the first part of its body
        self._left = -1  # bytes of a fixed-length answer still to come; -1: chunked
        self._start_time = time.time()
        #: The client closed its end of the connection, or reset it.
        self.gone = False
        #: The connection must close after this answer.
        self.close = last

    @property
    def reusable(self) -> bool:
        """Whether the connection can carry the next request: the answer is complete, the request's body
        was read to its end, and neither side asked to close."""
        return self._state is _State.CLOSED and not self._unread and not self.close and not self.gone

    async def serve(self, app: Callable[..., Awaitable[None]]) -> None:
        """Run ``app`` on this request, as Hypercorn's request task does."""
        try:
            await app(self.scope, self.receive, self.send, trio.to_thread.run_sync, trio.from_thread.run)
        except trio.Cancelled:
            raise
        except BaseExceptionGroup as error:
            _, others = error.split(trio.Cancelled)
            if others is None:
                raise
            await self._config.log.exception("Error in ASGI Framework")
        except Exception:
            await self._config.log.exception("Error in ASGI Framework")
        if self._state is _State.REQUEST:
            await self._error(500)
        elif self._state is _State.RESPONSE:
            # An answer cut short: its head goes out as it is (as h11 writes it), and the connection
            # closing is how the client can tell.
            self.close = True
            head, self._head = self._head, b""
            if head:
                await self._write(head)

    @property
    def unread(self) -> int:
        """Bytes of the request's body that the app has not read."""
        return self._unread

    async def skip_body(self) -> None:
        """Read the rest of the body, which the app did not want (it answered without it), so that the
        connection can carry the next request. Closed with the body's end unread, the connection would
        be reset, and the client could lose the answer before reading it."""
        while self._unread and not self.gone:
            if not self.rest:
                data = await self._read()
                if not data:
                    self.gone = True
                    return
                self.rest = data
            taken = min(len(self.rest), self._unread)
            self.rest = self.rest[taken:]
            self._unread -= taken

    async def receive(self) -> ASGIReceiveEvent:
        if not self._body_given:
            if self._unread and not self.rest:
                data = await self._read()
                if not data:
                    self.gone = True
                    return {"type": "http.disconnect"}
                self.rest = data
            chunk = self.rest[: self._unread]
            if chunk:
                self.rest = self.rest[len(chunk) :]
                self._unread -= len(chunk)
            self._body_given = not self._unread
            return {"type": "http.request", "body": chunk, "more_body": not self._body_given}
        # The body is in: what is left to tell is the client leaving. Anything it sends meanwhile is
        # its next request, kept for after this one (up to a head's worth, then it is not read).
        while not self.gone and self._state is not _State.CLOSED:
            if len(self.rest) > self._config.h11_max_incomplete_size:
                await trio.sleep_forever()
            data = await self._read()
            if data:
                self.rest += data
            else:
                self.gone = True
        return {"type": "http.disconnect"}

    async def send(self, event: ASGISendEvent) -> None:
        message = cast(dict[str, Any], event)
        kind = message["type"]
        if kind == "http.response.start" and self._state is _State.REQUEST:
            self._start(int(message["status"]), build_and_validate_headers(message.get("headers", [])))
            self._state = _State.RESPONSE
            if self._left == -1:  # a length not known ahead (a stream): its head goes out now
                head, self._head = self._head, b""
                await self._write(head)
        elif kind == "http.response.body" and self._state is _State.RESPONSE:
            body = bytes(message.get("body", b""))
            more = bool(message.get("more_body", False))
            await self._body(body, more)
            if not more:
                self._state = _State.CLOSED
                await self._config.log.access(self.scope, self._response, time.time() - self._start_time)
        else:
            raise UnexpectedMessageError(self._state, kind)

    def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Make the answer's head as Hypercorn and h11 would: the server's headers, ``Connection: close``
        on the connection's last answer, chunked framing for a body of unknown length."""
        if status < 200:
            raise ValueError(f"an informational answer ({status}) is not sent on HTTP/1.1 here")
        self._status = status
        self._response = {"status": status, "headers": headers}
        headers = headers + self._config.response_headers("h11")
        if self._last:
            headers.append((b"connection", b"close"))
        length = None
        connection: list[bytes] = []
        for name, value in headers:
            if _TOKEN.fullmatch(name) is None or _RESPONSE_VALUE.fullmatch(value) is None:
                raise ValueError(f"a response header h11 would refuse: {name!r}: {value!r}")
            lowered = name.lower()
            if lowered == b"content-length" and length is None:
                if _DIGITS.fullmatch(value) is None:
                    raise ValueError(f"content-length {value!r}")
                length = int(value)
            elif lowered == b"connection":
                connection.extend(token.strip().lower() for token in value.split(b","))
        if status in _NO_BODY:
            self._left = 0
        elif length is not None and not any(name.lower() == b"transfer-encoding" for name, _ in headers):
            self._left = length
        else:
            headers = _replace(headers, b"content-length", [])
            headers = _replace(headers, b"transfer-encoding", [b"chunked"])
            self._left = -1
        if b"close" in connection:  # the header stays as given: h11 leaves it so on a keep-alive request
            self.close = True
        lines = [b"HTTP/1.1 %d \r\n" % status]
        lines.extend(b"%s: %s\r\n" % header for header in headers)
        lines.append(b"\r\n")
        self._head = b"".join(lines)

    async def _body(self, body: bytes, more: bool) -> None:
        if self._status in _NO_BODY:
            body = b""  # Hypercorn drops what the app gives: this answer has no body
        if self._left == -1:
            data = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more:
                data += b"0\r\n\r\n"
        else:
            if len(body) > self._left:
                self.close = True
                raise ValueError("the body is longer than the answer's content-length")
            self._left -= len(body)
            if not more and self._left:
                self.close = True
                raise ValueError("the body is shorter than the answer's content-length")
            data = body
        if self._head:
            data, self._head = self._head + data, b""
        if data:
            await self._write(data)

    async def _error(self, status: int) -> None:
        """An answer with no body that closes the connection: what Hypercorn sends for an app that ended
        without answering."""
        self._start(status, [(b"content-length", b"0"), (b"connection", b"close")])
        self._state = _State.RESPONSE
        await self._body(b"", False)
        self._state = _State.CLOSED
        await self._config.log.access(self.scope, self._response, time.time() - self._start_time)


def _replace(
    headers: Iterable[tuple[bytes, bytes]], name: bytes, values: list[bytes]
) -> list[tuple[bytes, bytes]]:
    """``headers`` without those named ``name`` and with one ``Name: value`` at the end per value, as
    h11's ``set_comma_header`` makes them."""
    kept = [header for header in headers if header[0].lower() != name]
    kept.extend((name.title(), value) for value in values)
    return kept
