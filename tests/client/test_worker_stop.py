"""A clean stop of the worker loop spends no attempt on a message it never handled.

The worker stops its stream first (``POST …/work/{stream_id}/stop``), so the broker refills nothing
while it winds down, then gives back what never started (a defer of 0 s refunds the attempt), lets the
running handler finish and only then closes the stream. With ``max_attempts: 1`` any attempt spent on a
never-handled message dead-letters it, so the tests below count dead letters and attempts.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from broker.client import AsyncClient, Delivery, Message, WorkerStats
from broker.client.worker import work

MESSAGES = 8


@pytest.fixture
async def broker(live_url: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(live_url) as client:
        await client.create_queue("jobs", max_attempts=1)
        await client.publish_batch("jobs", [Message(n) for n in range(MESSAGES)])
        yield client


class Blocking:
    """A handler that holds its first message until ``release`` is set; ``started`` when it has it."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.started = trio.Event()
        self.release = trio.Event()

    async def __call__(self, delivery: Delivery) -> None:
        self.seen.append(delivery.payload)
        self.started.set()
        await self.release.wait()


async def stop_while_one_runs(broker: AsyncClient, stop_worker: Any, **options: Any) -> WorkerStats:
    """Run a worker (one handler, three more messages prefetched), stop it with ``stop_worker()`` while
    the handler runs, let the handler finish a virtual second later, and return the worker's stats."""
    handler = Blocking()
    result: list[WorkerStats] = []

    async def worker() -> None:
        result.append(await work(broker, "jobs", handler, concurrency=1, prefetch=4, **options))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker)
        await handler.started.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert (await broker.stats("jobs"))["in_flight"] == 4
        stop_worker()
        await trio.sleep(1)  # the give-back happens while the handler still runs
        assert not result
        handler.release.set()
    assert handler.seen == [0], "nothing else was handled"
    return result[0]


async def assert_nothing_spent(broker: AsyncClient) -> None:
    queue = await broker.stats("jobs")
    assert queue["dead_lettered_total"] == 0
    assert (queue["acked_total"], queue["ready"], queue["in_flight"]) == (1, MESSAGES - 1, 0)
    ready = await broker.browse("jobs", state="ready")
    assert len(ready) == MESSAGES - 1
    assert all(message["attempt"] == 0 for message in ready), [m["attempt"] for m in ready]
    assert all(message["payload"] != 0 for message in ready)


async def test_a_stop_event_gives_back_unstarted_messages_without_spending_attempts(
    autojump_clock: Any, broker: AsyncClient
) -> None:
    stop = trio.Event()
    stats = await stop_while_one_runs(broker, stop.set, stop=stop, handle_signals=False)
    assert (stats.acked, stats.given_back) == (1, 3)
    await assert_nothing_spent(broker)


async def test_sigterm_gives_back_unstarted_messages_without_spending_attempts(
    autojump_clock: Any, broker: AsyncClient
) -> None:
    assert threading.current_thread() is threading.main_thread()
    stats = await stop_while_one_runs(
        broker, lambda: os.kill(os.getpid(), signal.SIGTERM), handle_signals=True
    )
    assert (stats.acked, stats.given_back) == (1, 3)
    await assert_nothing_spent(broker)


async def test_without_the_stop_call_the_worker_still_stops_cleanly(
    autojump_clock: Any, broker: AsyncClient, live_url: str
) -> None:
    """An older broker (404 on the stop route): the give-back waits for the handler, as before; the
    worker still ends with every lease settled or released, and the running message acked."""

    class NoStop(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/stop"):
                return httpx.Response(404, json={"error": {"code": "not_found", "message": "no route"}})
            return await self.inner.handle_async_request(request)

        async def aclose(self) -> None:
            await self.inner.aclose()

    async with AsyncClient(live_url, transport=NoStop()) as old:
        stop = trio.Event()
        stats = await stop_while_one_runs(old, stop.set, stop=stop, handle_signals=False)
    assert stats.acked == 1
    queue = await broker.stats("jobs")
    assert (queue["acked_total"], queue["in_flight"]) == (1, 0)


async def test_a_sync_handler_past_its_lease_has_it_extended(autojump_clock: Any, live_url: str) -> None:
    """A blocking handler runs in a worker thread; while it runs for five leases (virtual time), the
    worker extends its lease, so it never expires and the message is acked once."""
    release = threading.Event()
    started = trio.Event()
    seen: list[Any] = []

    def blocking(delivery: Delivery) -> None:
        seen.append(delivery.payload)
        trio.from_thread.run_sync(started.set)
        release.wait(30)

    async with AsyncClient(live_url) as client:
        await client.create_queue("slow")
        await client.publish("slow", "long job")
        stop = trio.Event()
        result: list[WorkerStats] = []

        async def worker() -> None:
            result.append(await work(client, "slow", blocking, lease=2, stop=stop, handle_signals=False))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker)
            await started.wait()
            await trio.sleep(10)  # five leases long
            assert (await client.stats("slow"))["in_flight"] == 1
            release.set()
            stop.set()  # the running handler still finishes and is acked
        [stats] = result
        queue = await client.stats("slow")
    assert seen == ["long job"]
    assert (stats.acked, stats.skipped) == (1, 0)
    assert stats.extended >= 4
    assert (queue["acked_total"], queue["lease_expired_total"], queue["in_flight"]) == (1, 0, 0)
