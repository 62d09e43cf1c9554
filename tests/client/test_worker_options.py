"""The worker loop's checks of what it is given (the handler's kind, the ``lease`` option) and its
reconnect backoff, which starts over once the broker is back."""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from broker.client import AsyncClient, Client, Delivery, Message
from broker.client.worker import work

from .test_worker import Handler, run_until_done

# -- the handler's kind ------------------------------------------------------------------------------


async def record_payload(seen: list[Any], delivery: Delivery) -> None:
    seen.append(delivery.payload)


def test_the_blocking_worker_refuses_an_async_handler(thread_url: str) -> None:
    """In a thread, calling it would only make a coroutine, and every message was acked unhandled."""
    seen: list[Any] = []

    class AsyncCallable:
        async def __call__(self, delivery: Delivery) -> None:
            seen.append(delivery.payload)

    stop = threading.Event()
    stop.set()  # were the handler taken, the worker would stop at once rather than run on
    with Client(thread_url) as broker:
        broker.create_queue("jobs")
        broker.publish_batch("jobs", [Message(n) for n in range(3)])
        for handler in (functools.partial(record_payload, seen), AsyncCallable()):
            with pytest.raises(TypeError, match=r"AsyncClient\.work"):
                broker.work("jobs", handler, stop=stop, handle_signals=False)
        queue = broker.stats("jobs")
    assert (queue["ready"], queue["acked_total"], seen) == (3, 0, [])


def stopped() -> trio.Event:
    """A stop event already set: a worker that took what it was given would return at once."""
    stop = trio.Event()
    stop.set()
    return stop


async def test_an_async_handler_cannot_be_run_in_threads() -> None:
    async with AsyncClient("http://127.0.0.1:19601") as broker:  # never reached
        with pytest.raises(TypeError, match="threaded"):
            handler = functools.partial(record_payload, [])
            await work(broker, "jobs", handler, threaded=True, stop=stopped(), handle_signals=False)


def test_a_plain_function_that_returns_a_coroutine_is_a_handler_error_not_an_ack(
    thread_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[Any] = []
    calls: list[Any] = []
    stop = threading.Event()

    def handle(delivery: Delivery) -> Any:
        calls.append(delivery.payload)
        if len(calls) == 3:
            stop.set()  # this call still finishes and is settled
        return record_payload(seen, delivery)  # a coroutine no thread will run

    with Client(thread_url) as broker:
        broker.create_queue("jobs", max_attempts=1)
        broker.publish_batch("jobs", [Message(n) for n in range(3)])
        stats = broker.work("jobs", handle, stop=stop, handle_signals=False)
        queue = broker.stats("jobs")
    assert (stats.acked, stats.nacked, seen) == (0, 3, [])
    assert (queue["acked_total"], queue["dead_lettered_total"]) == (0, 3)
    assert "handler failed" in caplog.text and "the handler returned coroutine, an awaitable" in caplog.text


# -- the lease option ---------------------------------------------------------------------------------


@pytest.fixture
async def broker(live_url: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(live_url) as client:
        yield client


async def sleep_ten_seconds(delivery: Delivery) -> None:
    await trio.sleep(10)


@pytest.mark.parametrize("lease", ["2s", "2000ms", " 2 s ", 2, 2.0])
async def test_a_lease_shorter_than_the_queues_is_asked_for_and_extended_in_time(
    autojump_clock: Any, broker: AsyncClient, lease: float | str
) -> None:
    await broker.create_queue("jobs", lease=30)
    await broker.publish("jobs", "slow")
    handler = Handler(lambda seen: True, sleep_ten_seconds)
    stats = await run_until_done(broker, handler, lease=lease)
    assert (stats.acked, stats.skipped) == (1, 0)
    assert stats.extended >= 5, "a 2 s lease, extended every second over the handler's 10 s"
    queue = await broker.stats("jobs")
    assert (queue["acked_total"], queue["lease_expired_total"]) == (1, 0)


async def test_a_lease_longer_than_the_queues_needs_no_extend(
    autojump_clock: Any, broker: AsyncClient
) -> None:
    await broker.create_queue("jobs", lease=2)
    await broker.publish("jobs", "slow")
    handler = Handler(lambda seen: True, sleep_ten_seconds)
    stats = await run_until_done(broker, handler, lease="5m")
    assert (stats.acked, stats.extended, stats.skipped) == (1, 0, 0), "the stream's leases were 300 s"
    queue = await broker.stats("jobs")
    assert (queue["acked_total"], queue["lease_expired_total"]) == (1, 0)


@pytest.mark.parametrize(
    ("lease", "error"),
    [
        (True, TypeError),
        ([5], TypeError),
        ("5 minutes", ValueError),
        ("", ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        pytest.param(10**400, ValueError, id="an-integer-beyond-floats"),
        (0.01, ValueError),
        ("13h", ValueError),
    ],
)
async def test_a_lease_the_broker_would_refuse_is_refused_up_front(
    lease: Any, error: type[Exception]
) -> None:
    async with AsyncClient("http://127.0.0.1:19601") as broker:  # never reached
        with pytest.raises(error, match="lease must be"):
            await work(
                broker, "jobs", Handler(lambda seen: True), lease=lease, stop=stopped(), handle_signals=False
            )


@pytest.mark.parametrize(
    ("prefetch", "error"), [(0, ValueError), (-1, ValueError), (True, TypeError), (2.5, TypeError)]
)
async def test_a_prefetch_the_broker_would_refuse_is_refused_up_front(
    prefetch: Any, error: type[Exception]
) -> None:
    async with AsyncClient("http://127.0.0.1:19601") as broker:  # never reached
        with pytest.raises(error, match="prefetch must be"):
            await work(
                broker,
                "jobs",
                Handler(lambda seen: True),
                prefetch=prefetch,
                stop=stopped(),
                handle_signals=False,
            )


# -- reconnects ---------------------------------------------------------------------------------------


class Outages:
    """A broker whose ``/work`` requests follow a script: ``"down"`` refuses the connection, ``"up"``
    answers 200 and drops the stream after ``up_for`` seconds; past the script the worker is stopped.
    Records when each request came and when each failed."""

    def __init__(self, script: list[str], up_for: float) -> None:
        self.script = script
        self.up_for = up_for
        self.requested_at: list[float] = []
        self.failed_at: list[float] = []
        self.stop = trio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/queues/jobs/work"
        self.requested_at.append(trio.current_time())
        step = self.script[len(self.requested_at) - 1] if len(self.requested_at) <= len(self.script) else None
        if step == "up":
            headers = {"content-type": "text/event-stream", "stream-id": "s1"}
            return httpx.Response(200, headers=headers, stream=self.DroppedStream(self))
        if step is None:
            self.stop.set()
        self.failed_at.append(trio.current_time())
        raise httpx.ConnectError("connection refused")

    class DroppedStream(httpx.AsyncByteStream):
        def __init__(self, outages: Outages) -> None:
            self.outages = outages

        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield b": stream open\n\n"
            await trio.sleep(self.outages.up_for)
            self.outages.failed_at.append(trio.current_time())
            raise httpx.ReadError("connection reset by peer")


async def test_the_reconnect_backoff_starts_over_once_a_stream_has_opened(autojump_clock: Any) -> None:
    """An outage long enough to climb the backoff to 3.2 s, a stream that works for 5 s, then a second
    outage: its first reconnect comes after 0.1 s again, not 5 s."""
    outages = Outages(["down"] * 6 + ["up", "down", "down"], up_for=5)
    async with AsyncClient("http://broker.invalid", transport=httpx.MockTransport(outages)) as broker:
        await work(broker, "jobs", Handler(lambda seen: False), stop=outages.stop, handle_signals=False)
    waits = [
        round(at - failed, 3)
        for failed, at in zip(outages.failed_at[:-1], outages.requested_at[1:], strict=True)
    ]
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 0.1, 0.2, 0.4]


class ClaimOutages:
    """A broker whose claims follow a script: ``"down"`` refuses the connection, ``"stopping"`` answers
    503 ``shutting_down`` (what a broker in a graceful stop answers a claim), ``"empty"`` answers an
    empty claim at once; past the script the worker is stopped. Records when each claim came."""

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.requested_at: list[float] = []
        self.stop = trio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/queues/jobs/claim"
        self.requested_at.append(trio.current_time())
        step = self.script[len(self.requested_at) - 1] if len(self.requested_at) <= len(self.script) else None
        if step == "stopping":
            error = {"code": "shutting_down", "message": "the broker is shutting down"}
            return httpx.Response(503, json={"error": error})
        if step == "down":
            raise httpx.ConnectError("connection refused")
        if step is None:
            self.stop.set()
            await trio.sleep_forever()
        return httpx.Response(200, json={"messages": [], "ready": 0})


async def test_a_polling_worker_outlasts_a_broker_that_stops_and_backs_off_as_a_stream_does(
    autojump_clock: Any,
) -> None:
    """A broker in a graceful stop answers the next claim 503 shutting_down: the polling worker died
    of it (ShuttingDown escaped work()), and retried failed claims every 0.1 s without backing off."""
    outages = ClaimOutages(["down", "stopping", "down", "empty", "stopping", "down", "empty"])
    async with AsyncClient("http://broker.invalid", transport=httpx.MockTransport(outages)) as broker:
        stats = await work(
            broker, "jobs", Handler(lambda seen: False), stream=False, stop=outages.stop, handle_signals=False
        )
    gaps = [round(later - earlier, 3) for earlier, later in itertools.pairwise(outages.requested_at)]
    assert gaps == [0.1, 0.2, 0.4, 0.0, 0.1, 0.2, 0.0]
    assert (stats.mode, stats.reconnects) == ("poll", 5)
