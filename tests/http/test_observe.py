"""One log line, one timing and a request id per request."""

from __future__ import annotations

from typing import Any

import structlog

from broker.http.observe import CLIENT_LEFT, Observer
from broker.metrics import RequestTimes

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
