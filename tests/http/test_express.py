"""The express lane (``broker/http/express.py``): requests of the everyday shape served without h11.

The lane must be invisible to clients and apps, so most tests here run the same conversation twice,
once with the lane and once with Hypercorn and h11 alone, and compare every byte the client received
(the ``date`` header aside) and what the app was given. A real Hypercorn server in the test's Trio
run, raw sockets as clients.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import orjson
import pytest
import trio
from hypercorn.trio import serve

from broker.http import express
from broker.http.connection import ConnectionHandler, ServerConfig, install
from broker.http.express import NotExpress, parse_head

TIMEOUT = 0.15  # keep_alive_timeout, in seconds: an idle connection closes this long after its last answer
LIMIT = 16 * 1024
BIG_BODY = bytes(range(256)) * 1200  # 300 KiB: a body that arrives in several reads


def post(path: str, body: bytes, *headers: bytes) -> bytes:
    lines = [b"POST %s HTTP/1.1" % path.encode(), b"Host: test", b"Content-Length: %d" % len(body), *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def get(path: str, *headers: bytes) -> bytes:
    return b"\r\n".join([b"GET %s HTTP/1.1" % path.encode(), b"Host: test", *headers]) + b"\r\n\r\n"


async def app(seen: Seen, scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers by path; records what each request looked like to it in ``seen``."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]

    async def start(status: int = 200, headers: Any = ()) -> None:
        await send({"type": "http.response.start", "status": status, "headers": list(headers)})

    async def body(data: bytes, more: bool = False) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})

    if path == "/unread":  # answers without reading the body
        await start(200, [(b"content-length", b"2")])
        await body(b"ok")
        return
    if path == "/fail-before":
        raise RuntimeError("the app failed before answering")
    if path == "/wait":  # until the client leaves
        message = await receive()
        while message["type"] != "http.disconnect":
            message = await receive()
        seen.append({"path": path, "disconnect": True})
        return
    received = b""
    while True:
        message = await receive()
        assert message["type"] == "http.request"
        received += message["body"]
        if not message.get("more_body", False):
            break
    view = {key: scope[key] for key in ("type", "http_version", "asgi", "method", "scheme", "path")}
    view["root_path"] = scope["root_path"]
    view["extensions"] = sorted(scope["extensions"])  # the connection's ClientLink is one per connection
    view |= {key: scope[key].decode() for key in ("raw_path", "query_string")}
    view["headers"] = [[name.decode(), value.decode()] for name, value in scope["headers"]]
    view["body"] = [len(received), hashlib.sha256(received).hexdigest()]
    seen.append(view)
    answer = orjson.dumps(view)
    if path == "/chunked":  # no content-length: h11 sends it chunked
        await start(200, [(b"Content-Type", b"application/json")])
        await body(answer[:10], True)
        await body(b"", True)
        await body(answer[10:], True)
        await body(b"")
    elif path == "/nocontent":
        await start(204)
        await body(answer)  # dropped: a 204 has no body
    elif path == "/close":
        await start(200, [(b"content-length", b"%d" % len(answer)), (b"connection", b"close")])
        await body(answer)
    elif path == "/fail-after":
        await start(200, [(b"content-length", b"5")])
        raise RuntimeError("the app failed after its head")
    elif path == "/too-long":
        await start(200, [(b"content-length", b"2")])
        await body(b"12345")
    else:
        await start(201, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))])
        await body(answer[:7], True)
        await body(answer[7:])


class Seen(list[dict[str, Any]]):
    """What the app saw of each request, and an event set at each."""

    def __init__(self) -> None:
        super().__init__()
        self.grew = trio.Event()

    def append(self, item: dict[str, Any]) -> None:
        super().append(item)
        self.grew.set()


class Counter:
    """Counts the requests the express lane serves while entered."""

    def __init__(self) -> None:
        self.count = 0
        self._serve = express.ExpressRequest.serve

    async def __aenter__(self) -> Counter:
        serve_express = self._serve

        async def counting(exchange: express.ExpressRequest, the_app: Any) -> None:
            self.count += 1
            await serve_express(exchange, the_app)

        express.ExpressRequest.serve = counting  # type: ignore[method-assign]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        express.ExpressRequest.serve = self._serve  # type: ignore[method-assign]


@asynccontextmanager
async def broker_server(*, express_lane: bool, seen: Seen, **settings: Any) -> AsyncIterator[int]:
    """A Hypercorn server with the broker's connection handler, with or without the express lane;
    ``settings`` are Hypercorn's."""
    install()
    config = ServerConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = config.errorlog = None
    config.keep_alive_timeout = TIMEOUT
    config.h11_max_incomplete_size = LIMIT
    for name, value in settings.items():
        setattr(config, name, value)
    stop = trio.Event()
    allowed = ConnectionHandler._express_allowed
    ConnectionHandler._express_allowed = (  # type: ignore[method-assign]
        allowed if express_lane else lambda self: False
    )
    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                partial(serve, partial(app, seen), config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
            )
            yield int(binds[0].rsplit(":", 1)[1])
            stop.set()
    finally:
        ConnectionHandler._express_allowed = allowed  # type: ignore[method-assign]


async def conversation(port: int, *sends: bytes) -> bytes:
    """Everything the server sent on one connection for ``sends`` (each sent whole, in order), until it
    closed the connection (the keep-alive timeout at the latest) or reset it."""
    received = b""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        try:
            for data in sends:
                await stream.send_all(data)
            with trio.fail_after(10):
                while chunk := await stream.receive_some():
                    received += chunk
        except (
            trio.BrokenResourceError
        ):  # the server closed the connection while the client sent, or reset it
            pass
    return re.sub(rb"date: [^\r]*\r\n", b"date: -\r\n", received)


async def both_lanes(*sends: bytes, **settings: Any) -> tuple[tuple[bytes, Seen], tuple[bytes, Seen], int]:
    """The conversation and what the app saw, with the express lane and without; and how many requests
    the lane served."""
    outcomes = []
    async with Counter() as served:
        for express_lane in (True, False):
            seen = Seen()
            async with broker_server(express_lane=express_lane, seen=seen, **settings) as port:
                outcomes.append((await conversation(port, *sends), seen))
    return outcomes[0], outcomes[1], served.count


CONVERSATIONS = {
    "a body, headers of every case and spacing, a query": [
        post(
            "/echo?x=1&y=%20",
            b'{"a": 1}',
            b"Content-Type:  application/json ",
            b"X-MiXed: a  b",
            b"Accept: */*",
        )
    ],
    "a quoted path, no body": [get("/a%20b/%C3%A9", b"Connection: keep-alive")],
    "pipelined, in one send": [get("/one") + post("/two", b"2") + get("/three")],
    "the head and the start of a big body, then the rest": [
        post("/big", BIG_BODY)[:1000],
        post("/big", BIG_BODY)[1000:],
    ],
    "an answer of unknown length (chunked)": [post("/chunked", b"x"), get("/after")],
    "a 204 whose app gave a body anyway": [get("/nocontent"), get("/after")],
    "the app asks to close": [get("/close"), get("/never")],
    "the app fails before answering": [post("/fail-before", b"x"), get("/never")],
    "the app fails after its head": [get("/fail-after"), get("/never")],
    "the app sends more than its content-length": [get("/too-long"), get("/never")],
}


@pytest.mark.parametrize("name", CONVERSATIONS)
async def test_the_lane_answers_every_byte_as_h11_does(name: str) -> None:
    sends = CONVERSATIONS[name]
    (lane, lane_seen), (h11, h11_seen), served = await both_lanes(*sends)
    assert lane == h11
    assert lane_seen == h11_seen
    assert served >= 1, "the express lane served the conversation"
    assert lane.startswith(b"HTTP/1.1 500" if "fails before" in name else b"HTTP/1.1 20")
    # Every request reached the app, but those sent after an answer that closed the connection.
    paths = [
        match[1].decode() for match in re.finditer(rb"(?:GET|POST) (/[^ ?]*)[^ ]* HTTP", b"".join(sends))
    ]
    expected = [path for path in paths if path not in ("/never", "/fail-before")]
    assert [view["raw_path"] for view in lane_seen] == expected


async def test_the_last_request_of_a_connection_is_answered_with_connection_close() -> None:
    (lane, _), (h11, _), served = await both_lanes(
        get("/1") + get("/2") + get("/3") + get("/4"), keep_alive_max_requests=3
    )
    assert lane == h11
    assert served == 3
    assert (
        lane.count(b"HTTP/1.1 201") == 3 and lane.endswith(b"}") and lane.count(b"connection: close\r\n") == 1
    )


@pytest.mark.parametrize(
    "request_",
    [
        b"GET /old HTTP/1.0\r\nHost: test\r\n\r\n",
        post("/expect", b"body", b"Expect: 100-continue"),
        get("/chunked-request", b"Transfer-Encoding: chunked").replace(b"GET", b"POST")
        + b"3\r\nabc\r\n0\r\n\r\n",
        get("/folded", b"X-Long: a", b" b"),
        get("/no-host").replace(b"Host: test\r\n", b""),
        b"GET /bare-line-feeds HTTP/1.1\nHost: test\n\n",
        b"HEAD /head HTTP/1.1\r\nHost: test\r\n\r\n",
    ],
)
async def test_a_request_of_another_shape_and_all_after_it_go_to_h11(request_: bytes) -> None:
    (lane, lane_seen), (h11, h11_seen), served = await both_lanes(get("/first") + request_ + get("/last"))
    assert lane == h11 and lane_seen == h11_seen
    assert served == 1, "only the first request took the lane"
    assert lane.startswith(b"HTTP/1.1 201") and lane.count(b"HTTP/1.1 ") >= 2  # h11 answered the second


async def test_a_body_the_app_did_not_read_is_skipped_and_the_connection_kept() -> None:
    # Hypercorn closes such a connection while the body is still arriving, so the client may be reset
    # before it reads the answer; the lane reads past the body and serves the next request.
    seen = Seen()
    async with Counter() as served, broker_server(express_lane=True, seen=seen) as port:
        answers = await conversation(port, post("/unread", BIG_BODY) + get("/next"))
    assert answers.startswith(b"HTTP/1.1 200 \r\ncontent-length: 2\r\n") and answers.count(b"HTTP/1.1 ") == 2
    assert [view["path"] for view in seen] == ["/next"]
    assert served.count == 2


@pytest.mark.parametrize(("express_lane", "pipelined"), [(True, False), (False, False), (True, True)])
async def test_a_client_leaving_is_told_to_the_app(express_lane: bool, pipelined: bool) -> None:
    # With a request pipelined behind the one in hand, Hypercorn stops reading until the answer (so it
    # would not notice the client leave); the lane keeps reading, and keeps what it read for later.
    seen = Seen()
    async with broker_server(express_lane=express_lane, seen=seen) as port:
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(post("/wait", b"x") + (get("/behind") if pipelined else b""))
        with trio.fail_after(5):
            await seen.grew.wait()
    assert seen == [{"path": "/wait", "disconnect": True}]


async def test_hypercorns_server_names_keep_connections_off_the_lane() -> None:
    seen = Seen()
    served = Counter()
    async with broker_server(express_lane=True, seen=seen, server_names=["good"]) as port, served:
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(get("/x"))
            with trio.fail_after(5):
                refused = await stream.receive_some()  # (Hypercorn leaves this connection open)
        served_by_h11 = await conversation(port, get("/y").replace(b"Host: test", b"Host: good"))
    assert refused.startswith(b"HTTP/1.1 404") and served_by_h11.startswith(b"HTTP/1.1 201")
    assert served.count == 0


# parse_head, on its own


def test_parse_head_reads_a_request_line_and_headers() -> None:
    data = post("/v1/queues/q/claim?x=%41", b"{}", b"Content-Type: application/json", b"X-Tab:\tv\t")
    head = parse_head(data + b"NEXT", LIMIT)
    assert head is not None
    assert (head.method, head.target, head.content_length) == ("POST", b"/v1/queues/q/claim?x=%41", 2)
    assert head.headers == [
        (b"host", b"test"),
        (b"content-length", b"2"),
        (b"content-type", b"application/json"),
        (b"x-tab", b"v"),
    ]
    assert data[head.size :] == b"{}"


@pytest.mark.parametrize("cut", [0, 1, 10, 30, 40])
def test_parse_head_waits_for_the_rest_of_a_head(cut: int) -> None:
    data = get("/x", b"Accept: */*")
    assert parse_head(data[:cut], LIMIT) is None
    assert parse_head(data, LIMIT) is not None


def fed_byte_by_byte(data: bytes) -> Any:
    """What parse_head makes of ``data`` arriving a byte per read, told each time how much it saw."""
    searched = 0
    for end in range(1, len(data) + 1):
        try:
            head = parse_head(data[:end], LIMIT, searched)
        except NotExpress:
            return NotExpress
        if head is not None:
            return head
        searched = end
    return None


OTHER_SHAPES = [
    b"GET /x HTTP/1.0\r\nHost: a\r\n\r\n",
    b"HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n",
    b"CONNECT /x HTTP/1.1\r\nHost: a\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET http://a/x HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET /x  HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET /x\x7f HTTP/1.1\r\nHost: a\r\n\r\n",
    b"G(T /x HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET /x HTTP/1.1\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nX : b\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nX: a\rb\r\n\r\n",
    b"GET /x HTTP/1.1\nHost: a\n\n",
    b"GET /x HTTP/1.1\r\nHost: a\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nX: " + b"v" * LIMIT + b"\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nX: " + b"v" * LIMIT,
]


@pytest.mark.parametrize("data", OTHER_SHAPES)
def test_parse_head_leaves_other_shapes_to_h11(data: bytes) -> None:
    with pytest.raises(NotExpress):
        parse_head(data, LIMIT)


@pytest.mark.parametrize("data", [get("/x", b"Accept: */*"), *OTHER_SHAPES[:-2]])
def test_a_head_arriving_a_byte_at_a_time_reads_as_it_does_whole(data: bytes) -> None:
    """Each call searches only past what the last one saw (a head trickled in was scanned from its
    start on every read: quadratic, before any token was checked); the outcome must not change."""

    def seen(head: Any) -> Any:
        return head if head in (None, NotExpress) else (head.method, head.target, head.headers, head.size)

    try:
        whole: Any = parse_head(data, LIMIT)
    except NotExpress:
        whole = NotExpress
    assert seen(fed_byte_by_byte(data)) == seen(whole)


async def test_requests_pipelined_in_one_read_let_other_tasks_run_between_them() -> None:
    # The test app answers a GET without waiting for anything: only the lane's checkpoint between
    # requests lets another task run while the 200 pipelined requests are served. The ticker notes how
    # many had been served each time it ran.
    seen = Seen()
    progress: set[int] = set()

    async def ticker() -> None:
        while True:
            progress.add(len(seen))
            await trio.lowlevel.checkpoint()

    async with broker_server(express_lane=True, seen=seen) as port, trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(b"".join(get(f"/{n}") for n in range(200)))
            with trio.fail_after(10):
                while len(seen) < 200:
                    await seen.grew.wait()
                    seen.grew = trio.Event()
        nursery.cancel_scope.cancel()
    assert len(progress & set(range(1, 200))) >= 100, "the ticker ran between the pipelined requests"


async def test_a_client_that_stalls_in_a_body_its_app_did_not_read_is_closed() -> None:
    async with broker_server(express_lane=True, seen=Seen()) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(post("/unread", BIG_BODY)[:1000])  # the head, and the body's start
            received = b""
            with trio.fail_after(TIMEOUT + 5):
                while chunk := await stream.receive_some():
                    received += chunk
    assert received.startswith(b"HTTP/1.1 200 ") and received.endswith(b"ok")  # and then closed
