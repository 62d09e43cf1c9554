"""One log line and one timing per request, with a request id (§10).

``Observer`` is the outermost ASGI layer. For each HTTP request it takes the client's ``X-Request-Id``
(when it is a short, printable token) or makes one, echoes it in the answer, binds it and the queue to
structlog's context for every line logged while the request runs (a claim adds its consumer), and when
the answer ends (for a push stream: when it closes) records its duration under its route template and
status (``metrics.RequestTimes``) and logs ``request`` at info: method, route, path, status, duration.

It also answers a request whose head (request line and headers) is longer than ``MAX_HEAD_BYTES`` with
431 and the contract's error body, before any other layer sees it (Hypercorn's own limit sits above this
one, ``server.py``, and answers 431 with no body, so this is the limit clients meet), and one whose
body has a ``Content-Encoding`` (gzip …) with 415: the broker reads bodies only as they are.

And it holds back the ``http.disconnect`` that Hypercorn hands the app while the answer's last part is
still being sent (it recycles the connection inside that ``send``) until that ``send`` has returned.
Delivered at once, it lets the app cancel its own sending task (Quart-trio does, and so does a push
stream's disconnect watcher) in the middle of Hypercorn restarting the connection's keep-alive timer,
which is then lost: the kept-alive connection would never be closed however long it stays idle.
"""

from __future__ import annotations

import itertools
import time
from contextvars import ContextVar
from typing import Any

import structlog
import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope, Scope

from broker.errors import BrokerError, RequestHeadersTooLarge, UnsupportedMediaType
from broker.http.asgi import ASGIApp
from broker.http.paths import origin_scope, target_of
from broker.http.render import send_error
from broker.metrics import RequestTimes

log = structlog.get_logger("broker.http")

_MAX_ID = 64
#: The longest request head served, in bytes: request line and headers (nginx reads 8 KiB per line).
MAX_HEAD_BYTES = 16 * 1024
#: The status logged for a request that ended without an answer (nginx's "client closed request").
CLIENT_LEFT = 499


#: What routes add to the ``request`` line of the request in hand (``bind_request``): a dict of the
#: Observer's, which the tasks a request runs in share (Quart runs a view in a task of its own, whose
#: changes to its context the Observer's task never sees).
_REQUEST_FIELDS: ContextVar[dict[str, Any] | None] = ContextVar("request_fields", default=None)


def bind_request(**fields: Any) -> None:
    """Name ``fields`` (a claim's consumer) on every line logged for the request in hand from now on,
    its ``request`` line included, whichever task of the request calls this."""
    structlog.contextvars.bind_contextvars(**fields)
    shared = _REQUEST_FIELDS.get()
    if shared is not None:
        shared.update(fields)


def read_head(scope: HTTPScope) -> tuple[int, bytes | None, bytes | None]:
    """In one pass over the headers: the request head's size as sent, near enough (request line, and
    each header with its ``: `` and line end), the first ``X-Request-Id``, and every ``Content-Encoding``
    joined by commas, as one list (None when absent)."""
    target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")  # optional in ASGI
    size = len(scope["method"]) + target + 12
    request_id = encoding = None
    for name, value in scope["headers"]:
        size += len(name) + len(value) + 4
        if len(name) == 12 and name.lower() == b"x-request-id":
            request_id = request_id or value
        elif len(name) == 16 and name.lower() == b"content-encoding":
            encoding = value if encoding is None else encoding + b"," + value
    return size, request_id, encoding


def _unsupported_coding(encoding: bytes) -> bool:
    """Whether a ``Content-Encoding`` names a coding of the body other than none: the broker reads bodies
    as they are, and would take a gzipped one for malformed JSON (or worse, publish it)."""
    return any(coding.strip().lower() not in (b"", b"identity") for coding in encoding.split(b","))


def _usable_id(value: bytes) -> str | None:
    if 0 < len(value) <= _MAX_ID and value.isascii():
        text = value.decode()
        if text.isprintable() and " " not in text:
            return text
    return None


class Observer:
    def __init__(self, app: ASGIApp, times: RequestTimes) -> None:
        self._app = app
        self._times = times
        self._numbers = itertools.count(1)
        self._prefix = f"{int(time.time() * 1000) % (1 << 32):08x}"

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started = time.perf_counter()
        scope = origin_scope(scope)
        size, given_id, encoding = read_head(scope)
        request_id = None if given_id is None else _usable_id(given_id)
        if request_id is None:
            request_id = f"{self._prefix}-{next(self._numbers):x}"
        method, path = scope["method"], scope["path"]
        target = target_of(method, path)
        status = 0  # until the app answers
        echoed = request_id.encode()

        last_sent: trio.Event | None = None  # while the answer's last part is on its way

        async def observed_send(message: Any) -> None:
            nonlocal status, last_sent
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", echoed)]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                last_sent = trio.Event()
                try:
                    await send(message)
                finally:
                    last_sent.set()
                return
            await send(message)

        async def observed_receive() -> Any:
            message = await receive()
            if message["type"] == "http.disconnect" and last_sent is not None:
                await last_sent.wait()
            return message

        bound = structlog.contextvars.bind_contextvars(request_id=request_id, queue=target.queue)
        fields: dict[str, Any] = {}
        shared = _REQUEST_FIELDS.set(fields)
        try:
            refusal: BrokerError | None = None
            if size > MAX_HEAD_BYTES:
                refusal = RequestHeadersTooLarge(
                    f"the request line and headers are {size} bytes; the limit is {MAX_HEAD_BYTES}"
                )
            elif encoding is not None and _unsupported_coding(encoding):
                shown = encoding.decode("latin-1")
                refusal = UnsupportedMediaType(
                    f"Content-Encoding {shown!r} is not supported: send the body as it is (identity)"
                )
            if refusal is not None:  # in CBOR when Accept prefers it, as every error (§2)
                await send_error(observed_send, scope, refusal)
                return
            await self._app(scope, observed_receive, observed_send)
        finally:
            seconds = time.perf_counter() - started
            if status == 0:  # no answer: the client left (a cancelled long poll), or a bug raised
                status = CLIENT_LEFT
            self._times.observe(target.route, status, seconds)
            log.info(
                "request",
                method=method,
                route=target.route,
                path=path,
                status=status,
                ms=round(seconds * 1000, 3),
                **fields,
            )
            _REQUEST_FIELDS.reset(shared)
            structlog.contextvars.reset_contextvars(**bound)
            structlog.contextvars.unbind_contextvars(*fields)  # bound in this task too, by a fast route
