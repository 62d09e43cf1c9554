"""Graceful shutdown request by request (http/drain.py): once it begins, a request that starts is
refused whole, a long poll already waiting answers at once, and every answer closes its connection."""

from __future__ import annotations

from typing import Any

import trio

from broker.core.commands import GetStats
from broker.server import Broker
from tests.conftest import Client, make_queue


async def test_a_request_that_starts_after_shutdown_began_is_refused_and_changes_nothing(
    broker: Broker, client: Client
) -> None:
    await make_queue(client)
    broker.registry.begin_shutdown()
    for method, path, body in (
        ("POST", "/v1/queues/jobs/messages", {"messages": [{"payload": "late"}]}),
        ("PUT", "/v1/queues/other", {}),
        ("POST", "/v1/queues/jobs/claim", {"max": 1}),
        ("GET", "/v1/queues/jobs", None),
    ):
        response = await client.open(path, method=method, json=body)
        assert response.status_code == 503, (method, path)
        assert (await response.get_json())["error"]["code"] == "shutting_down"
        assert response.headers["connection"] == "close"
    stats = await broker.registry.get("jobs").request(GetStats())
    assert stats.ready == 0  # the refused publish left nothing behind
    assert "other" not in broker.registry


async def test_a_long_poll_waiting_when_shutdown_begins_answers_at_once_and_closes_its_connection(
    autojump_clock: Any, broker: Broker, client: Client
) -> None:
    await make_queue(client)
    answers: list[Any] = []

    async def long_poll() -> None:
        answers.append(await client.post("/v1/queues/jobs/claim", json={"max": 5, "wait": 20}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_poll)
        await trio.sleep(1)  # virtual time: the claim is parked
        assert not answers
        began = trio.current_time()
        broker.registry.begin_shutdown()
    assert trio.current_time() - began < 1  # not at the end of its 20 s wait
    (answer,) = answers
    assert answer.status_code == 200
    assert (await answer.get_json())["messages"] == []
    assert answer.headers["connection"] == "close"


async def test_before_shutdown_answers_keep_their_connection(client: Client) -> None:
    response = await client.put("/v1/queues/jobs", json={})
    assert response.status_code == 201
    assert "connection" not in response.headers
