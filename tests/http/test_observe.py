"""One log line, one timing and a request id per request."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
import structlog
import trio
import trio.testing

from broker.config import Settings, Token
from broker.http.observe import CLIENT_LEFT, MAX_HEAD_BYTES, Observer
from broker.logging import configure
from broker.metrics import RequestTimes
from broker.server import open_broker
from broker.storage.codec import cbor_loads

log = structlog.get_logger("test")


async def answer_204(scope: Any, receive: Any, send: Any) -> None:
    log.info("inside")  # a line logged while the request runs carries its request id and queue
    await send({"type": "http.response.start", "status": 204, "headers": [(b"x-other", b"1")]})
    await send({"type": "http.response.body", "body": b""})


async def no_answer(scope: Any, receive: Any, send: Any) -> None:
    return  # as a long poll cancelled because its client left


async def call(app: Any, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> list[Any]:
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    await app({"type": "http", "method": method, "path": path, "headers": headers}, receive, send)
    return sent


async def test_each_request_gets_an_id_a_log_line_and_a_timing() -> None:
    times = RequestTimes()
    observer = Observer(answer_204, times)
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        first = await call(observer, "POST", "/v1/queues/jobs/claim", [])
        second = await call(observer, "POST", "/v1/queues/jobs/claim", [(b"X-Request-Id", b"trace-42")])
        third = await call(observer, "GET", "/v1/queues/jobs", [(b"x-request-id", b"bad id with spaces")])
    ids = [dict(sent[0]["headers"])[b"x-request-id"].decode() for sent in (first, second, third)]
    assert ids[1] == "trace-42"
    assert len(set(ids)) == 3 and "bad id" not in ids[2]
    assert dict(first[0]["headers"])[b"x-other"] == b"1"  # the app's own headers stay
    inside = [entry for entry in logs if entry["event"] == "inside"]
    assert [entry["request_id"] for entry in inside] == ids
    assert {entry["queue"] for entry in inside} == {"jobs"}
    requests = [entry for entry in logs if entry["event"] == "request"]
    assert [(r["method"], r["route"], r["status"]) for r in requests] == [
        ("POST", "POST /v1/queues/{queue}/claim", 204),
        ("POST", "POST /v1/queues/{queue}/claim", 204),
        ("GET", "GET /v1/queues/{queue}", 204),
    ]
    assert all(r["ms"] >= 0 for r in requests)
    assert times.histograms[("POST /v1/queues/{queue}/claim", 204)].count == 2
    assert times.histograms[("GET /v1/queues/{queue}", 204)].count == 1
    assert structlog.contextvars.get_contextvars() == {}  # nothing left bound for the next request


async def test_a_request_that_ends_without_an_answer_counts_as_the_client_leaving() -> None:
    times = RequestTimes()
    with structlog.testing.capture_logs() as logs:
        await call(Observer(no_answer, times), "POST", "/v1/queues/jobs/claim", [])
    assert [entry["status"] for entry in logs if entry["event"] == "request"] == [CLIENT_LEFT]
    assert times.histograms[("POST /v1/queues/{queue}/claim", CLIENT_LEFT)].count == 1


async def test_a_head_beyond_the_limit_is_answered_431_before_the_app_sees_it() -> None:
    reached: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope)
        await answer_204(scope, receive, send)

    observer = Observer(app, RequestTimes())
    with structlog.testing.capture_logs() as logs:
        big = await call(observer, "GET", "/v1/queues", [(b"x-padding", b"x" * MAX_HEAD_BYTES)])
        small = await call(observer, "GET", "/v1/queues", [(b"x-padding", b"x" * (MAX_HEAD_BYTES - 100))])
    assert big[0]["status"] == 431 and small[0]["status"] == 204
    assert orjson.loads(big[1]["body"])["error"]["code"] == "request_headers_too_large"
    assert len(reached) == 1
    assert [entry["status"] for entry in logs if entry["event"] == "request"] == [431, 204]


async def test_a_disconnect_waits_until_the_answers_last_part_is_sent() -> None:
    """Hypercorn hands over ``http.disconnect`` from inside the last ``send``; the app must not see it
    until that ``send`` returned, or it cancels its own sending task halfway (see observe.py)."""
    events: list[str] = []
    sending = trio.Event()
    may_return = trio.Event()

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            sending.set()
            await may_return.wait()
            events.append("sent")

    async def receive() -> Any:
        await sending.wait()
        return {"type": "http.disconnect"}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        async def watch() -> None:
            await receive()
            events.append("disconnect seen")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            nursery.start_soon(send, {"type": "http.response.body", "body": b"done"})
            await trio.testing.wait_all_tasks_blocked()
            may_return.set()

    scope = {"type": "http", "method": "GET", "path": "/healthz", "headers": []}
    await Observer(app, RequestTimes())(scope, receive, send)  # type: ignore[arg-type]
    assert events == ["sent", "disconnect seen"]


# -- what the configured logger writes (broker/logging.py) ------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def logged(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Callable[[], str]]]:
    """``logged(level, terminal=False)`` configures logging as ``broker serve`` does, onto a buffer in
    place of stderr, and gives a function returning everything written so far."""
    saved = structlog.get_config()

    def configured(level: str = "info", *, terminal: bool = False) -> Callable[[], str]:
        if terminal:
            stream: Any = _Terminal()
            monkeypatch.setattr(sys, "stderr", stream)
            configure(level)
            read: Callable[[], str] = stream.getvalue
        else:
            raw = io.BytesIO()
            monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8"))
            configure(level)

            def read() -> str:
                return raw.getvalue().decode()

        # Loggers made under this config must not outlive the test (other tests capture logs).
        structlog.configure(cache_logger_on_first_use=False)
        return read

    yield configured
    structlog.reset_defaults()
    structlog.configure(**saved)


async def test_logs_are_json_lines_off_a_terminal(logged: Callable[..., Callable[[], str]]) -> None:
    output = logged("info")
    await call(Observer(answer_204, RequestTimes()), "GET", "/v1/queues/jobs", [])
    records = [orjson.loads(line) for line in output().splitlines()]
    assert [record["event"] for record in records] == ["inside", "request"]
    assert records[1]["status"] == 204 and records[1]["level"] == "info" and "timestamp" in records[1]


async def test_on_a_terminal_logs_are_readable_lines(logged: Callable[..., Callable[[], str]]) -> None:
    output = logged("info", terminal=True)
    await call(Observer(answer_204, RequestTimes()), "GET", "/v1/queues/jobs", [])
    lines = output().splitlines()
    assert len(lines) == 2 and "request" in lines[1] and "status" in lines[1]
    for line in lines:
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(line)


async def test_log_level_warning_drops_the_request_line(logged: Callable[..., Callable[[], str]]) -> None:
    output = logged("warning")
    await call(Observer(answer_204, RequestTimes()), "GET", "/v1/queues/jobs", [])
    structlog.get_logger("test").warning("kept")
    assert [orjson.loads(line)["event"] for line in output().splitlines()] == ["kept"]


async def test_no_token_reaches_a_log_line(logged: Callable[..., Callable[[], str]]) -> None:
    right, wrong, in_query = "right-secret-0123456789", "wrong-secret-9876543210", "query-secret-5555555555"
    output = logged("debug")
    tokens = (
        Token("worker", right, ("consume:jobs", "publish:jobs")),
        Token("ops", "ops-secret-00000000", ("admin",)),
    )
    async with open_broker(Settings(in_memory=True, tokens=tokens)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        admin = {"Authorization": "Bearer ops-secret-00000000"}
        assert (await client.put("/v1/queues/jobs", json={}, headers=admin)).status_code == 201
        answers = [
            await client.post(
                "/v1/queues/jobs/messages", json={"payload": 1}, headers={"Authorization": f"Bearer {right}"}
            ),
            await client.post(
                "/v1/queues/jobs/claim", json={"consumer": "c"}, headers={"Authorization": f"Bearer {right}"}
            ),
            await client.post("/v1/queues/jobs/claim", json={}, headers={"Authorization": f"Bearer {wrong}"}),
            await client.post("/v1/queues/jobs/claim", json={}, headers={"Authorization": wrong}),
            await client.post(f"/v1/queues/jobs/claim?token={in_query}&access_token={in_query}", json={}),
            await client.get(f"/v1/queues/jobs?token={right}", headers={"Authorization": f"Bearer {right}x"}),
            await client.get(
                "/v1/queues/ghost", headers={"Authorization": f"Bearer {right}", "X-Request-Id": "r1"}
            ),
        ]
    assert [answer.status_code for answer in answers] == [201, 200, 401, 401, 401, 401, 403]
    text = output()
    lines = text.splitlines()
    assert sum(orjson.loads(line)["event"] == "request" for line in lines) == 8
    for secret in (right, wrong, in_query, "ops-secret-00000000"):
        assert secret not in text


async def test_a_route_that_finds_its_queue_from_an_id_names_it_on_the_request_line() -> None:
    """§10: the queue is bound on every request's log lines, also when the path holds only an id."""
    async with open_broker(Settings(in_memory=True)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        assert (await client.put("/v1/queues/sq", json={})).status_code == 201
        published = await client.post("/v1/queues/sq/messages", json={"payload": 1})
        [message] = (await published.get_json())["messages"]
        with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            assert (await client.get(f"/compat/simpleq/v1/jobs/{message['id']}")).status_code == 200
            assert (await client.get("/compat/simpleq/v1/jobs/nowhere")).status_code == 404
    requests = [(entry["route"], entry.get("queue")) for entry in logs if entry["event"] == "request"]
    assert requests == [
        ("GET /compat/simpleq/v1/jobs/{id}", "sq"),
        ("GET /compat/simpleq/v1/jobs/{id}", None),
    ]


@pytest.mark.parametrize("encoding", ["gzip", "br", "identity, gzip", "x-unknown"])
async def test_a_body_in_a_content_coding_is_refused_415_and_nothing_is_published(encoding: str) -> None:
    """The broker reads a body as it is: a gzipped one was read as malformed JSON (400), and a body
    that merely said gzip was published."""
    async with open_broker(Settings(in_memory=True)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        assert (await client.put("/v1/queues/jobs", json={})).status_code == 201
        refused = await client.post(
            "/v1/queues/jobs/messages", json={"payload": 1}, headers={"Content-Encoding": encoding}
        )
        assert refused.status_code == 415
        error = (await refused.get_json())["error"]
        assert error["code"] == "unsupported_media_type" and "Content-Encoding" in error["message"]
        plain = await client.post(
            "/v1/queues/jobs/messages", json={"payload": 2}, headers={"Content-Encoding": "identity"}
        )
        assert plain.status_code == 201
        browsed = await (await client.get("/v1/queues/jobs/messages")).get_json()
        assert [message["payload"] for message in browsed["messages"]] == [2]


async def test_a_refusal_before_the_routes_is_cbor_when_accept_prefers_it() -> None:
    """§2: errors too are CBOR when the request's Accept asks for it; the 415 and 431 the observer gives
    before any route were always JSON."""
    cbor = {"Accept": "application/cbor"}
    async with open_broker(Settings(in_memory=True)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        coded = await client.post(
            "/v1/queues/jobs/messages", json={}, headers={"Content-Encoding": "gzip", **cbor}
        )
        too_long = await client.get("/v1/queues", headers={"X-Pad": "x" * 17_000, **cbor})
    for answer, status in ((coded, 415), (too_long, 431)):
        assert (answer.status_code, answer.content_type) == (status, "application/cbor")
        assert "code" in cbor_loads(await answer.get_data())["error"]


async def test_every_content_encoding_line_counts() -> None:
    """Two lines, gzip then identity: only the last was looked at, and the body was read as it was."""
    times = RequestTimes()
    headers = [(b"content-encoding", b"gzip"), (b"content-encoding", b"identity")]
    answer = await call(Observer(answer_204, times), "POST", "/v1/queues/jobs/messages", headers)
    assert answer[0]["status"] == 415
