"""The ASGI fast path (``broker/http/fastpath.py``): it, not Quart, serves the six hot routes; it answers
exactly as the Quart views do; and it handles the edges of a request that Quart used to handle for
them (body limits and timeouts, headers, disconnects), passing everything else to Quart.

Most tests drive the app's ASGI callable directly, to control the ASGI messages: a body in chunks with
no ``Content-Length``, a body that never comes, a client that goes away.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import cbor2
import orjson
import pytest
import structlog
import trio
import trio.testing
from quart import has_request_context, request

from broker.config import Limits, Settings
from broker.http import fastpath, parse
from broker.server import Broker, open_broker
from tests.conftest import Client, make_queue

HOT = ["messages", "claim", "ack", "nack", "defer", "extend"]
JSON = [(b"content-type", b"application/json")]


def scope(method: str, path: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"spec_version": "2.1", "version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": list(headers),
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
        "state": {},
        "extensions": {},
    }


def body_messages(*chunks: bytes) -> list[dict[str, Any]]:
    """A body as Hypercorn delivers it: each chunk with ``more_body``, then an empty last message."""
    return [
        *({"type": "http.request", "body": chunk, "more_body": True} for chunk in chunks),
        {"type": "http.request", "body": b"", "more_body": False},
    ]


class Exchange:
    """One request through an ASGI callable: the messages it receives and the ones it sends."""

    def __init__(self, asgi: Any, method: str, path: str, headers: Sequence[tuple[bytes, bytes]] = JSON):
        self.asgi = asgi
        self.scope = scope(method, path, headers)
        self.to_app, self._receive = trio.open_memory_channel[dict[str, Any]](100)
        self.sent: list[dict[str, Any]] = []
        self.finished = False

    async def run(self, *messages: dict[str, Any]) -> Exchange:
        for message in messages:
            self.to_app.send_nowait(message)
        await self.asgi(self.scope, self._receive.receive, self._send)
        self.finished = True
        return self

    async def _send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return list(self.sent[0]["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(message.get("body", b"") for message in self.sent[1:])

    def json(self) -> Any:
        return orjson.loads(self.body)


async def fast(broker: Broker, method: str, path: str, *messages: dict[str, Any], **kw: Any) -> Exchange:
    """Through the app as Hypercorn calls it: the fast path first. The request id that the outermost
    layer adds (``observe.py``) is left out of the headers, so answers compare with Quart's alone."""
    exchange = await Exchange(broker.app, method, path, **kw).run(*messages)
    start = exchange.sent[0]
    start["headers"] = [(name, value) for name, value in start["headers"] if name != b"x-request-id"]
    return exchange


async def quart_only(
    broker: Broker, method: str, path: str, *messages: dict[str, Any], **kw: Any
) -> Exchange:
    """Through Quart alone, as before the fast path existed (the class's ``asgi_app``, unwrapped)."""
    app = broker.app
    return await Exchange(lambda *args: type(app).asgi_app(app, *args), method, path, **kw).run(*messages)


@pytest.fixture
async def small_broker() -> AsyncIterator[Broker]:
    """A broker whose request bodies are limited to 1,000 bytes."""
    settings = Settings(limits=Limits(max_body_bytes=1000), in_memory=True)
    async with open_broker(settings) as running, running.app.test_app():
        yield running


# -- who serves what ---------------------------------------------------------------------------------


async def test_the_fast_path_serves_the_hot_routes_and_quart_the_rest(
    broker: Broker, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    through_quart: list[tuple[str, str]] = []

    @broker.app.before_request
    async def record() -> None:
        through_quart.append((request.method, request.path))

    claim_contexts: list[bool] = []
    original_claim = parse.claim

    def claim(body: Any, limits: Limits) -> Any:
        claim_contexts.append(has_request_context())
        return original_claim(body, limits)

    monkeypatch.setattr(parse, "claim", claim)
    await make_queue(client)
    assert (await client.post("/v1/queues/jobs/messages", json={"payload": 1})).status_code == 201
    lease = (await (await client.post("/v1/queues/jobs/claim", json={})).get_json())["messages"][0][
        "lease_id"
    ]
    for verb, body in [
        ("extend", {"leases": [lease], "lease": 60}),
        ("defer", {"leases": [lease]}),
        ("nack", {"leases": [lease]}),
        ("ack", {"leases": [lease]}),
    ]:
        assert (await client.post(f"/v1/queues/jobs/{verb}", json=body)).status_code == 200
    assert (await client.get("/v1/queues/jobs/messages")).status_code == 200

    assert claim_contexts == [False], "the claim ran outside Quart's request context"
    assert through_quart == [("PUT", "/v1/queues/jobs"), ("GET", "/v1/queues/jobs/messages")]


async def test_every_hot_route_is_still_a_registered_quart_view(broker: Broker) -> None:
    posts = {
        (rule.rule, rule.endpoint)
        for rule in broker.app.url_map.iter_rules()
        if "POST" in (rule.methods or set())
    }
    endpoints = {"messages": "publish"}
    assert {(f"/v1/queues/<queue>/{segment}", endpoints.get(segment, segment)) for segment in HOT} <= posts


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/queues/jobs/claim"),
        ("HEAD", "/v1/queues/jobs/ack"),
        ("PUT", "/v1/queues/jobs/messages"),
        ("DELETE", "/v1/queues/jobs/extend"),
        ("post", "/v1/queues/jobs/claim"),  # a lower-case method is Quart's business
        ("POST", "/v1/queues//claim"),
        ("POST", "/v1/queues/jobs/claim/"),
        ("POST", "/v1/queues/jobs/claims"),
        ("POST", "/v1/queues/jobs/nack/more"),
        ("POST", "/v1/queue/jobs/claim"),
    ],
)
async def test_other_methods_and_paths_fall_through_to_quart(
    broker: Broker, client: Client, method: str, path: str
) -> None:
    through_quart: list[str] = []

    @broker.app.before_request
    async def record() -> None:
        through_quart.append(request.path)

    await make_queue(client)
    through_quart.clear()
    answered = await fast(broker, method, path, *body_messages(b"{}"))
    assert through_quart, "Quart served it"
    reference = await quart_only(broker, method, path, *body_messages(b"{}"))
    assert (answered.status, answered.headers, answered.body) == (
        reference.status,
        reference.headers,
        reference.body,
    )


async def test_a_wrong_method_on_a_hot_path_is_quarts_405_with_allow(broker: Broker, client: Client) -> None:
    await make_queue(client)
    for method in ("GET", "HEAD"):
        answered = await fast(broker, method, "/v1/queues/jobs/claim", *body_messages())
        assert answered.status == 405
        assert set(dict(answered.headers)[b"allow"].split(b", ")) == {b"POST"}
        if method == "GET":
            assert answered.json()["error"]["code"] == "method_not_allowed"


async def test_options_is_405_like_any_method_a_route_does_not_serve(client: Client) -> None:
    """Quart answered OPTIONS on every route with an empty text/html 200, no part of the API."""
    await make_queue(client)
    for path in ("/v1/queues/jobs", "/v1/queues/jobs/claim", "/v1/queues/jobs/messages"):
        response = await client.options(path)
        assert response.status_code == 405 and response.content_type == "application/json"
        assert (await response.get_json())["error"]["code"] == "method_not_allowed"


# -- the same answers as the Quart views -------------------------------------------------------------

# (method, path, headers, body chunks): requests whose answers do not depend on ids or the clock
SAME_ANSWERS: list[tuple[str, list[tuple[bytes, bytes]], list[bytes]]] = [
    ("/v1/queues/ghost/messages", JSON, [b'{"payload": 1}']),
    ("/v1/queues/ghost/claim", JSON, [b"not even json"]),
    ("/v1/queues/bad name!/claim", JSON, [b"{}"]),
    ("/v1/queues/jobs/claim", JSON, [b"{}"]),
    ("/v1/queues/jobs/claim", [], [b'{"max": 5}']),
    ("/v1/queues/jobs/claim", [(b"accept", b"application/cbor"), *JSON], [b"{}"]),
    ("/v1/queues/jobs/claim", [(b"Accept", b"text/html"), (b"Accept", b"application/cbor")], [b"{}"]),
    ("/v1/queues/jobs/claim", [(b"accept", b"Application/CBOR"), *JSON], [b"{}"]),
    ("/v1/queues/jobs/claim", [(b"accept", b"application/json, application/cbor;q=0"), *JSON], [b"{}"]),
    ("/v1/queues/jobs/claim", [(b"content-type", b"application/cbor")], [cbor2.dumps({"max": 2})]),
    ("/v1/queues/jobs/claim", [(b"Content-Type", b"text/plain")], [b"{}"]),
    ("/v1/queues/jobs/claim", [(b"content-type", b"text/plain"), *JSON], [b"{}"]),
    ("/v1/queues/jobs/claim", JSON, [b'{"max": 0}']),
    ("/v1/queues/jobs/claim", JSON, [b'{"ma', b'x": 2, "lease": "5m"}']),
    ("/v1/queues/jobs/claim", JSON, [b"{"]),
    ("/v1/queues/jobs/claim", [(b"content-length", b"1001"), *JSON], []),
    ("/v1/queues/jobs/claim", [(b"content-length", b"1000"), *JSON], [b" " * 998 + b"{}"]),
    ("/v1/queues/jobs/claim", JSON, [b" " * 600, b" " * 600]),
    ("/v1/queues/jobs/ack", JSON, [b'{"leases": ["nope"]}']),
    ("/v1/queues/jobs/ack", [(b"accept", b"application/cbor")], [b'{"leases": 1}']),
    ("/v1/queues/jobs/nack", JSON, [b'{"leases": [], "retryable": false}']),
    ("/v1/queues/jobs/defer", JSON, [b'{"leases": ["a"], "retry_after": "1h"}']),
    ("/v1/queues/jobs/extend", JSON, [b'{"leases": ["a"]}']),
    ("/v1/queues/jobs/extend", JSON, [b'{"leases": ["a"], "lease": 10}']),
    ("/v1/queues/jobs/messages", JSON, [b"[]"]),
    ("/v1/queues/jobs/messages", JSON, [b'{"messages": []}']),
    ("/v1/queues/jobs/work/no-such-stream/stop", JSON, [b"{}"]),
    ("/v1/queues/jobs/work/no-such-stream/stop", JSON, [b'{"now": true}']),
]


@pytest.mark.parametrize(("path", "headers", "chunks"), SAME_ANSWERS)
async def test_the_fast_path_answers_as_the_quart_view_does(
    small_broker: Broker, path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]
) -> None:
    await small_broker.registry.create("jobs", {}).wait()
    answered = await fast(small_broker, "POST", path, *body_messages(*chunks), headers=headers)
    reference = await quart_only(small_broker, "POST", path, *body_messages(*chunks), headers=headers)
    assert answered.status == reference.status
    assert answered.headers == reference.headers
    assert answered.body == reference.body


async def test_one_response_start_and_one_body_message(broker: Broker, client: Client) -> None:
    await make_queue(client)
    answered = await fast(broker, "POST", "/v1/queues/jobs/messages", *body_messages(b'{"payload": 1}'))
    assert [message["type"] for message in answered.sent] == ["http.response.start", "http.response.body"]
    assert answered.sent[1].get("more_body", False) is False
    assert answered.status == 201
    assert answered.headers == [(b"content-type", b"application/json"), (b"content-length", b"65")]


# -- the edges of a request ----------------------------------------------------------------------------


async def test_a_chunked_body_over_the_limit_is_413_as_soon_as_it_is(small_broker: Broker) -> None:
    await small_broker.registry.create("jobs", {}).wait()
    exchange = Exchange(small_broker.app, "POST", "/v1/queues/jobs/messages")
    # 1,001 bytes arrive and the rest never does: the answer cannot wait for the end of the body.
    await exchange.run(
        {"type": "http.request", "body": b"x" * 600, "more_body": True},
        {"type": "http.request", "body": b"x" * 401, "more_body": True},
    )
    assert exchange.status == 413
    assert exchange.json()["error"]["code"] == "payload_too_large"


async def test_a_body_of_exactly_the_limit_in_chunks_is_read(small_broker: Broker) -> None:
    await small_broker.registry.create("jobs", {}).wait()
    body = b'{"payload": "' + b"x" * 985 + b'"}'
    assert len(body) == 1000
    answered = await fast(
        small_broker, "POST", "/v1/queues/jobs/messages", *body_messages(body[:10], body[10:])
    )
    assert answered.status == 201


async def test_a_content_length_over_the_limit_is_413_before_any_body(small_broker: Broker) -> None:
    await small_broker.registry.create("jobs", {}).wait()
    exchange = Exchange(
        small_broker.app, "POST", "/v1/queues/jobs/claim", headers=[(b"content-length", b"5000"), *JSON]
    )
    await exchange.run()  # no body message at all: answered without reading one
    assert exchange.status == 413
    assert exchange.json()["error"]["message"] == "the body is 5000 bytes; the limit is 1000"


async def test_a_missing_content_type_means_json(broker: Broker, client: Client) -> None:
    await make_queue(client)
    answered = await fast(
        broker, "POST", "/v1/queues/jobs/messages", *body_messages(b'{"payload": 7}'), headers=[]
    )
    assert answered.status == 201
    claimed = await fast(broker, "POST", "/v1/queues/jobs/claim", *body_messages(), headers=[])
    assert [m["payload"] for m in claimed.json()["messages"]] == [7]


@pytest.mark.parametrize("accept", [b"text/html", b"*/*", b"application/xml, text/plain;q=0.5"])
async def test_an_unknown_accept_gets_json(broker: Broker, client: Client, accept: bytes) -> None:
    await make_queue(client)
    answered = await fast(
        broker, "POST", "/v1/queues/jobs/claim", *body_messages(b"{}"), headers=[(b"accept", accept), *JSON]
    )
    assert answered.status == 200
    assert dict(answered.headers)[b"content-type"] == b"application/json"
    assert answered.json() == {"messages": [], "ready": 0}


async def test_accept_cbor_gets_cbor_errors_too(broker: Broker) -> None:
    answered = await fast(
        broker,
        "POST",
        "/v1/queues/ghost/ack",
        *body_messages(b"{}"),
        headers=[(b"accept", b"application/cbor")],
    )
    assert answered.status == 404
    assert dict(answered.headers)[b"content-type"] == b"application/cbor"
    assert cbor2.loads(answered.body)["error"]["code"] == "queue_not_found"


async def test_a_body_that_never_comes_is_408_after_the_body_timeout(
    autojump_clock: Any, broker: Broker, client: Client
) -> None:
    await make_queue(client)
    start = trio.current_time()
    exchange = await Exchange(broker.app, "POST", "/v1/queues/jobs/claim").run(
        {"type": "http.request", "body": b"{", "more_body": True}
    )
    assert exchange.status == 408
    assert exchange.json()["error"]["code"] == "request_timeout"
    assert trio.current_time() - start == pytest.approx(60)


async def test_a_client_gone_before_its_body_ends_gets_no_answer(broker: Broker, client: Client) -> None:
    await make_queue(client)
    exchange = await Exchange(broker.app, "POST", "/v1/queues/jobs/messages").run(
        {"type": "http.request", "body": b'{"payload"', "more_body": True}, {"type": "http.disconnect"}
    )
    assert exchange.sent == []
    assert (await (await client.get("/v1/queues/jobs")).get_json())["stats"]["ready"] == 0


async def test_a_client_gone_during_a_long_poll_withdraws_its_claim(
    autojump_clock: Any, broker: Broker, client: Client
) -> None:
    await make_queue(client)
    exchange = Exchange(broker.app, "POST", "/v1/queues/jobs/claim")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(exchange.run, *body_messages(b'{"consumer": "gone", "wait": 30}'))
        await trio.testing.wait_all_tasks_blocked()
        assert not exchange.finished, "the claim is parked"
        await exchange.to_app.send({"type": "http.disconnect"})
    assert exchange.sent == [] and trio.current_time() < 1, "it stopped at once, without an answer"
    assert (await client.post("/v1/queues/jobs/messages", json={"payload": "next"})).status_code == 201
    claimed = await (await client.post("/v1/queues/jobs/claim", json={"consumer": "present"})).get_json()
    assert [m["payload"] for m in claimed["messages"]] == ["next"]


async def test_a_client_gone_while_its_claim_waits_for_the_claim_window_withdraws_it(
    autojump_clock: Any, broker: Broker, client: Client
) -> None:
    """A claim without ``wait`` is held too when the queue has a claim window: one whose client left
    (a read timeout shorter than the window) took its message at the window's end, leased to nobody
    until the lease ran out, an attempt spent (api.md, "When a client goes away")."""
    await make_queue(client, claim_window=3)
    assert (await client.post("/v1/queues/jobs/messages", json={"payload": "only"})).status_code == 201
    exchange = Exchange(broker.app, "POST", "/v1/queues/jobs/claim")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(exchange.run, *body_messages(b'{"consumer": "gone"}'))
        await trio.testing.wait_all_tasks_blocked()
        assert not exchange.finished, "held for the window"
        await trio.sleep(1)
        await exchange.to_app.send({"type": "http.disconnect"})
    assert exchange.sent == [] and trio.current_time() < 2, "it stopped at once, without an answer"
    await trio.sleep(5)  # past the window
    stats = (await (await client.get("/v1/queues/jobs")).get_json())["stats"]
    assert (stats["ready"], stats["in_flight"]) == (1, 0)
    claimed = await (await client.post("/v1/queues/jobs/claim", json={"consumer": "present"})).get_json()
    assert [(m["payload"], m["attempt"]) for m in claimed["messages"]] == [("only", 1)]


async def test_a_long_poll_answered_at_once_does_not_watch_for_a_hang_up(
    broker: Broker, client: Client
) -> None:
    # Watching takes a second task; a claim that finds messages ready is answered within one round trip
    # to the actor, like the other hot routes, so it reads nothing from the client after its body.
    await make_queue(client)
    assert (await client.post("/v1/queues/jobs/messages", json={"payload": "ready"})).status_code == 201
    exchange = Exchange(broker.app, "POST", "/v1/queues/jobs/claim")
    hang_up = {"type": "http.disconnect"}  # would end the claim unanswered if it were read
    await exchange.run(*body_messages(b'{"consumer": "here", "wait": 30}'), hang_up)
    assert exchange.status == 200 and [m["payload"] for m in exchange.json()["messages"]] == ["ready"]
    assert exchange.to_app.statistics().current_buffer_used == 1, "the hang-up message was never read"


async def test_a_bug_is_logged_and_answered_500_internal_error(
    broker: Broker, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    await make_queue(client)

    def broken(body: Any, limits: Limits) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(parse, "claim", broken)
    with structlog.testing.capture_logs() as logs:
        answered = await fast(broker, "POST", "/v1/queues/jobs/claim", *body_messages(b"{}"))
    assert answered.status == 500
    assert answered.json() == {
        "error": {"code": "internal_error", "message": "the broker hit a bug; the error was logged"}
    }
    [logged] = [entry for entry in logs if entry["event"] == "request_failed"]
    assert (logged["method"], logged["path"], logged["log_level"]) == (
        "POST",
        "/v1/queues/jobs/claim",
        "error",
    )
    assert isinstance(logged["exc_info"], RuntimeError)


async def test_an_answer_that_cannot_be_encoded_is_a_logged_500_with_its_error_body(
    broker: Broker, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Encoding the answer is part of the request: a failure there is the same logged 500 as any bug,
    with §2's body, rather than an empty answer from the server."""
    await make_queue(client)
    encode = fastpath.encode
    calls = 0

    def fails_once(data: Any, cbor: bool) -> tuple[bytes, str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise TypeError("str is not valid UTF-8: surrogates not allowed")
        return encode(data, cbor)

    monkeypatch.setattr(fastpath, "encode", fails_once)
    with structlog.testing.capture_logs() as logs:
        answered = await fast(broker, "POST", "/v1/queues/jobs/claim", *body_messages(b"{}"))
    assert answered.status == 500 and answered.json()["error"]["code"] == "internal_error"
    assert [entry["event"] for entry in logs if entry["log_level"] == "error"] == ["request_failed"]
