"""Every error answer the HTTP layer writes, byte for byte: status, headers in the order sent, and body.

The answers come from several places (the observer's 431 and 415, the drain's 503, the token gate's 401
and 403, the fast path's refusals and the push stream's, the Quart routes' body readers) that all go
through the one error mapping; these tests pin what a client sees of each, through the whole stack as
Hypercorn calls it, so that none of them changes when that plumbing does. A request id is sent with
each request, so the answer's ``x-request-id`` (added by the outermost layer, last) is pinned too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import cbor2
import orjson
import pytest
import structlog
import trio

from broker.config import Limits, Settings, Token
from broker.errors import RequestHeadersTooLarge
from broker.http import parse
from broker.http.observe import MAX_HEAD_BYTES
from broker.server import Broker, open_broker

Header = tuple[bytes, bytes]
#: What a client sees of an answer: status, headers as sent, body.
Answer = tuple[int, list[Header], bytes]

REQUEST_ID: Header = (b"x-request-id", b"pinned")
JSON: Header = (b"content-type", b"application/json")
TEXT: Header = (b"content-type", b"text/plain")
CBOR_BODY: Header = (b"content-type", b"application/cbor")
ACCEPT_CBOR: Header = (b"accept", b"application/cbor")
ACCEPT_EVENTS: Header = (b"accept", b"text/event-stream")
CHALLENGE: Header = (b"www-authenticate", b'Bearer realm="broker"')
CLOSE: Header = (b"connection", b"close")
SECRET = "secret-0000000000001"

#: Werkzeug's messages, which the fast path repeats word for word where it stands in for Quart.
TOO_LARGE = "The data value transmitted exceeds the capacity limit."
TIMED_OUT = (
    "The server closed the network connection because the browser didn't finish the request within the"
    " specified time."
)
NOT_JSON_OR_CBOR = "the body must be application/json or application/cbor, not 'text/plain'"
NOT_JSON = "the body is not valid JSON: unexpected end of data: line 1 column 2 (char 1)"


def error_answer(status: int, code: str, message: str, *headers: Header, cbor: bool = False) -> Answer:
    """The §2 error answer, encoded here independently of the broker's own encoders."""
    error = {"error": {"code": code, "message": message}}
    body = cbor2.dumps(error) if cbor else orjson.dumps(error)
    media_type = b"application/cbor" if cbor else b"application/json"
    content = [(b"content-type", media_type), (b"content-length", b"%d" % len(body))]
    return status, [*content, *headers, REQUEST_ID], body


async def answer_of(
    broker: Broker,
    method: str,
    path: str,
    headers: Sequence[Header] = (),
    chunks: Sequence[bytes] = (),
    query: bytes = b"",
    *,
    ends: bool = True,
) -> Answer:
    """``method path?query`` through the app as Hypercorn calls it, the body in ``chunks`` (and its
    end unless ``ends`` is false): the answer as the ASGI messages sent."""
    to_app, from_client = trio.open_memory_channel[dict[str, Any]](100)
    for chunk in chunks:
        to_app.send_nowait({"type": "http.request", "body": chunk, "more_body": True})
    if ends:
        to_app.send_nowait({"type": "http.request", "body": b"", "more_body": False})
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
        "root_path": "", "headers": [REQUEST_ID, *headers], "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8080), "state": {}, "extensions": {},
    }  # fmt: skip
    await broker.app.asgi_app(scope, from_client.receive, send)  # type: ignore[arg-type]
    start, *body = sent
    assert start["type"] == "http.response.start"
    assert [message["type"] for message in body] == ["http.response.body"] * len(body)
    assert body[-1].get("more_body", False) is False  # Quart sends the body, then an empty end
    return start["status"], list(start["headers"]), b"".join(message["body"] for message in body)


@pytest.fixture
async def small_broker() -> AsyncIterator[Broker]:
    """A broker whose request bodies are limited to 1,000 bytes, with queues ``jobs`` and ``gone``."""
    settings = Settings(limits=Limits(max_body_bytes=1000), in_memory=True)
    async with open_broker(settings) as running, running.app.test_app():
        for name in ("jobs", "gone", "sq"):
            await running.registry.create(name, {}).wait()
        yield running


# (name, (method, path, headers, body chunks, query), the answer)
PINNED: list[tuple[str, tuple[str, str, list[Header], list[bytes], bytes], Answer]] = [
    # -- the observer, before anything else sees the request
    (
        "head too large",
        ("GET", "/v1/queues", [(b"x-pad", b"x" * 17_000)], [], b""),
        error_answer(
            431,
            "request_headers_too_large",
            "the request line and headers are 17056 bytes; the limit is 16384",
        ),
    ),
    (
        "head too large, CBOR",
        ("GET", "/v1/queues", [ACCEPT_CBOR, (b"x-pad", b"x" * 17_000)], [], b""),
        error_answer(
            431,
            "request_headers_too_large",
            "the request line and headers are 17082 bytes; the limit is 16384",
            cbor=True,
        ),
    ),
    (
        "content coding",
        ("POST", "/v1/queues/jobs/messages", [JSON, (b"content-encoding", b"gzip")], [b"{}"], b""),
        error_answer(
            415,
            "unsupported_media_type",
            "Content-Encoding 'gzip' is not supported: send the body as it is (identity)",
        ),
    ),
    (
        "content coding, CBOR",
        ("POST", "/v1/queues/jobs/messages", [JSON, ACCEPT_CBOR, (b"content-encoding", b"br")], [], b""),
        error_answer(
            415,
            "unsupported_media_type",
            "Content-Encoding 'br' is not supported: send the body as it is (identity)",
            cbor=True,
        ),
    ),
    # -- the fast path
    (
        "query on a route that reads none",
        ("POST", "/v1/queues/jobs/claim", [JSON], [b"{}"], b"wait=5"),
        error_answer(
            400,
            "invalid_request",
            "unknown field 'wait' in the query; POST /v1/queues/{queue}/claim takes no query",
        ),
    ),
    (
        "query on a route that reads none, CBOR",
        ("POST", "/v1/queues/jobs/claim", [JSON, ACCEPT_CBOR], [b"{}"], b"wait=5&x=1"),
        error_answer(
            400,
            "invalid_request",
            "unknown field 'wait' in the query; POST /v1/queues/{queue}/claim takes no query",
            cbor=True,
        ),
    ),
    (
        "hot route, unknown queue",
        ("POST", "/v1/queues/ghost/claim", [JSON], [b"{}"], b""),
        error_answer(404, "queue_not_found", "queue 'ghost' does not exist"),
    ),
    (
        "hot route, unknown queue, CBOR",
        ("POST", "/v1/queues/ghost/claim", [JSON, ACCEPT_CBOR], [b"{}"], b""),
        error_answer(404, "queue_not_found", "queue 'ghost' does not exist", cbor=True),
    ),
    (
        "hot route, Content-Length over the limit",
        ("POST", "/v1/queues/jobs/claim", [JSON, (b"content-length", b"5000")], [], b""),
        error_answer(413, "payload_too_large", "the body is 5000 bytes; the limit is 1000"),
    ),
    (
        "hot route, a body that grows over the limit",
        ("POST", "/v1/queues/jobs/claim", [JSON], [b" " * 600, b" " * 600], b""),
        error_answer(413, "payload_too_large", TOO_LARGE),
    ),
    (
        "hot route, neither JSON nor CBOR",
        ("POST", "/v1/queues/jobs/claim", [TEXT], [b"{}"], b""),
        error_answer(415, "unsupported_media_type", NOT_JSON_OR_CBOR),
    ),
    (
        "hot route, malformed JSON",
        ("POST", "/v1/queues/jobs/claim", [JSON], [b"{"], b""),
        error_answer(400, "invalid_request", NOT_JSON),
    ),
    # -- the push stream
    (
        "stream, unknown queue",
        ("GET", "/v1/queues/ghost/work", [ACCEPT_EVENTS], [], b""),
        error_answer(404, "queue_not_found", "queue 'ghost' does not exist"),
    ),
    (
        "stream, not acceptable",
        ("GET", "/v1/queues/jobs/work", [], [], b""),
        error_answer(
            406,
            "not_acceptable",
            "the work stream is only served as text/event-stream: send that in Accept",
        ),
    ),
    (
        "stream, not acceptable, CBOR",
        ("GET", "/v1/queues/jobs/work", [ACCEPT_CBOR], [], b""),
        error_answer(
            406,
            "not_acceptable",
            "the work stream is only served as text/event-stream: send that in Accept",
            cbor=True,
        ),
    ),
    (
        "stream, bad parameter",
        ("GET", "/v1/queues/jobs/work", [ACCEPT_EVENTS], [], b"max=0"),
        error_answer(400, "invalid_request", "max must be an integer from 1 to 1000"),
    ),
    # -- the Quart routes
    (
        "wrong method",
        ("GET", "/v1/queues/jobs/claim", [], [], b""),
        error_answer(
            405, "method_not_allowed", "The method is not allowed for the requested URL.", (b"allow", b"POST")
        ),
    ),
    (
        "native body, Content-Length over the limit",
        ("PUT", "/v1/queues/other", [JSON, (b"content-length", b"5000")], [], b""),
        error_answer(413, "payload_too_large", "the body is 5000 bytes; the limit is 1000"),
    ),
    (
        "native body, a body that grows over the limit",
        ("PUT", "/v1/queues/other", [JSON], [b" " * 600, b" " * 600], b""),
        error_answer(413, "payload_too_large", TOO_LARGE),
    ),
    (
        "native body, neither JSON nor CBOR",
        ("PUT", "/v1/queues/other", [TEXT], [b"{}"], b""),
        error_answer(415, "unsupported_media_type", NOT_JSON_OR_CBOR),
    ),
    (
        "native body where none is taken",
        ("POST", "/v1/queues/jobs/purge", [JSON], [b"[1]"], b""),
        error_answer(400, "invalid_request", "the purge takes no body (or an empty object)"),
    ),
    (
        "no content",
        ("DELETE", "/v1/queues/gone", [], [], b""),
        (204, [(b"content-length", b"0"), REQUEST_ID], b""),
    ),
    # -- the push routes
    (
        "push callback, not an object",
        ("POST", "/v1/messages/abc/ack", [JSON], [b"[1]"], b""),
        error_answer(400, "invalid_request", "the body must be an object"),
    ),
    (
        "push callback, Content-Length over the limit",
        ("POST", "/v1/messages/abc/ack", [JSON, (b"content-length", b"5000")], [], b""),
        error_answer(413, "payload_too_large", "the body is 5000 bytes; the limit is 1000"),
    ),
    (
        "push callback, neither JSON nor CBOR",
        ("POST", "/v1/messages/abc/ack", [TEXT], [b"{}"], b""),
        error_answer(415, "unsupported_media_type", NOT_JSON_OR_CBOR),
    ),
    (
        "push callback, nothing waits",
        ("POST", "/v1/messages/abc/ack", [JSON], [b"{}"], b""),
        error_answer(404, "message_not_found", "no push of message 'abc' waits for a callback"),
    ),
    (
        "push status, CBOR",
        ("GET", "/v1/queues/jobs/push", [ACCEPT_CBOR], [], b""),
        (
            200,
            [CBOR_BODY, (b"content-length", b"28"), REQUEST_ID],
            cbor2.dumps({"queue": "jobs", "config": None, "status": None}),
        ),
    ),
    # -- the compatibility surfaces: a body is JSON whatever its Content-Type, unless labelled CBOR
    (
        "SimpleQ, not an object",
        ("POST", "/compat/simpleq/v1/queues", [TEXT], [b"[1]"], b""),
        error_answer(400, "invalid_request", "the body must be a JSON object"),
    ),
    (
        "SimpleQ, not an object in CBOR",
        ("POST", "/compat/simpleq/v1/queues/sq/jobs", [CBOR_BODY], [cbor2.dumps([1])], b""),
        error_answer(400, "invalid_request", "the body must be a JSON object"),
    ),
    (
        "SimpleQ, a JSON body labelled text",
        ("POST", "/compat/simpleq/v1/queues", [TEXT], [b'{"name": "sq2"}'], b""),
        error_answer(400, "invalid_request", "webhookUrl is required: the URL SimpleQ jobs are pushed to"),
    ),
    (
        "SimpleQ, Content-Length over the limit",
        ("POST", "/compat/simpleq/v1/queues", [JSON, (b"content-length", b"5000")], [], b""),
        error_answer(413, "payload_too_large", "the body is 5000 bytes; the limit is 1000"),
    ),
    (
        "SimpleQ, no content",
        ("DELETE", "/compat/simpleq/v1/queues/gone", [], [], b""),
        (204, [(b"content-length", b"0"), REQUEST_ID], b""),
    ),
    (
        "qhook, malformed JSON labelled text",
        ("POST", "/compat/qhook/api/queues/jobs/ack", [TEXT], [b"{"], b""),
        error_answer(400, "invalid_request", NOT_JSON),
    ),
    (
        "qhook, Content-Length over the limit",
        ("POST", "/compat/qhook/api/queues/jobs/ack", [JSON, (b"content-length", b"5000")], [], b""),
        error_answer(413, "payload_too_large", "the body is 5000 bytes; the limit is 1000"),
    ),
    (
        "Cloudflare, not an object",
        ("POST", "/compat/cloudflare/client/v4/accounts/acc/queues/jobs/messages/ack", [JSON], [b"[1]"], b""),
        (
            400,
            [JSON, (b"content-length", b"129"), REQUEST_ID],
            b'{"success":false,"errors":[{"code":400,"message":"invalid_request: the body must be a JSON'
            b' object"}],"messages":[],"result":null}',
        ),
    ),
]


@pytest.mark.parametrize(
    ("request_", "answer"), [case[1:] for case in PINNED], ids=[case[0] for case in PINNED]
)
async def test_each_error_answer_is_pinned(
    small_broker: Broker, request_: tuple[str, str, list[Header], list[bytes], bytes], answer: Answer
) -> None:
    method, path, headers, chunks, query = request_
    assert await answer_of(small_broker, method, path, headers, chunks, query) == answer


async def test_the_head_limits_answer_is_request_headers_too_large_of_the_error_tree() -> None:
    assert (RequestHeadersTooLarge.status, RequestHeadersTooLarge.code) == (431, "request_headers_too_large")
    async with open_broker(Settings(in_memory=True)) as broker:
        padding = b"x" * (MAX_HEAD_BYTES - 100)
        status, _, body = await answer_of(broker, "GET", "/v1/queues", [(b"x-pad", padding)])
        assert status == 200
        status, _, body = await answer_of(broker, "GET", "/v1/queues", [(b"x-pad", padding + b"x" * 100)])
        assert status == 431 and orjson.loads(body)["error"]["code"] == RequestHeadersTooLarge.code


async def test_a_body_that_never_comes_is_pinned(autojump_clock: Any, small_broker: Broker) -> None:
    answer = await answer_of(small_broker, "POST", "/v1/queues/jobs/claim", [JSON], [b"{"], ends=False)
    assert answer == error_answer(408, "request_timeout", TIMED_OUT)


async def test_a_bug_in_a_hot_route_is_pinned(small_broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(body: Any, limits: Limits) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(parse, "claim", broken)
    with structlog.testing.capture_logs() as logs:
        answer = await answer_of(small_broker, "POST", "/v1/queues/jobs/claim", [JSON], [b"{}"])
    assert answer == error_answer(500, "internal_error", "the broker hit a bug; the error was logged")
    [failed] = [entry for entry in logs if entry["event"] == "request_failed"]
    assert (failed["method"], failed["path"], type(failed["exc_info"])) == (
        "POST",
        "/v1/queues/jobs/claim",
        RuntimeError,
    )


async def test_a_refused_stream_once_streams_ended_is_pinned(small_broker: Broker) -> None:
    small_broker.registry.end_streams()
    answer = await answer_of(small_broker, "GET", "/v1/queues/jobs/work", [ACCEPT_EVENTS])
    assert answer == error_answer(
        503, "shutting_down", "the broker is shutting down; reconnect to another or later"
    )


async def test_the_drains_refusals_are_pinned(small_broker: Broker) -> None:
    small_broker.registry.begin_shutdown()
    message = "the broker is shutting down; retry on another or later"
    answer = await answer_of(small_broker, "POST", "/v1/queues/jobs/claim", [JSON], [b"{}"])
    assert answer == error_answer(503, "shutting_down", message, CLOSE)
    answer = await answer_of(small_broker, "GET", "/v1/queues", [ACCEPT_CBOR])
    assert answer == error_answer(503, "shutting_down", message, CLOSE, cbor=True)


async def test_the_gates_refusals_are_pinned() -> None:
    tokens = (Token("ci", SECRET, ("publish:jobs",)),)
    async with open_broker(Settings(in_memory=True, tokens=tokens)) as broker, broker.app.test_app():
        needs = "this broker needs a token: send Authorization: Bearer <token>"
        answer = await answer_of(broker, "POST", "/v1/queues/jobs/claim", [JSON], [b"{}"])
        assert answer == error_answer(401, "unauthorized", needs, CHALLENGE)
        answer = await answer_of(broker, "GET", "/v1/queues", [ACCEPT_CBOR])
        assert answer == error_answer(401, "unauthorized", needs, CHALLENGE, cbor=True)
        answer = await answer_of(broker, "GET", "/compat/qhook/api/queues", [ACCEPT_CBOR])
        assert answer == error_answer(401, "unauthorized", needs, CHALLENGE)  # JSON only there
        wrong = [(b"authorization", b"Bearer nope")]
        answer = await answer_of(broker, "GET", "/v1/queues", wrong)
        assert answer == error_answer(401, "unauthorized", "the token is not valid", CHALLENGE)
        token = [JSON, (b"authorization", f"Bearer {SECRET}".encode())]
        answer = await answer_of(broker, "POST", "/v1/queues/jobs/claim", token, [b"{}"])
        assert answer == error_answer(403, "forbidden", "the token 'ci' lacks the scope consume:jobs")
