"""The client's worker loop (``work``) against a broker served in this test's Trio run.

Handlers record what they saw and set events; the tests wait on those events (or on the loop's own end)
rather than on time. Where a handler must run for a while (past its lease, or a defer's delay), the
autojump clock makes that time virtual: the broker, the client and the handler share Trio's clock.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import types
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from broker import clock as clock_module
from broker.client import (
    AsyncClient,
    Client,
    Defer,
    Delivery,
    Forbidden,
    InvalidRequest,
    Message,
    QueueNotFound,
    Reject,
    Retry,
    calls,
)
from broker.client.calls import Call
from broker.client.worker import SEND_TRIES, _Worker, work
from broker.config import Settings, Token


@pytest.fixture
async def broker(live_url: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(live_url) as client:
        yield client


class Handler:
    """Records deliveries; ``behave`` decides each outcome; ``done`` is set when a call starts with
    ``until(seen)`` true."""

    def __init__(self, until: Any, behave: Any = None) -> None:
        self.seen: list[Delivery] = []
        self.until = until
        self.behave = behave
        self.done = trio.Event()

    async def __call__(self, delivery: Delivery) -> None:
        self.seen.append(delivery)
        if self.until(self.seen):
            self.done.set()  # a stop now still lets this call finish and be settled
        if self.behave is not None:
            await self.behave(delivery)


async def run_until_done(
    broker: AsyncClient,
    handler: Handler,
    queue: str = "jobs",
    *,
    until: trio.Event | None = None,
    **options: Any,
) -> Any:
    """Run the worker until the handler says it is done (or ``until`` is set), then stop it and return
    its stats."""
    stop = trio.Event()
    result: list[Any] = []

    async def worker() -> None:
        result.append(await work(broker, queue, handler, stop=stop, handle_signals=False, **options))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker)
        await (handler.done if until is None else until).wait()
        stop.set()
    return result[0]


async def test_handlers_that_return_have_their_messages_acked(
    autojump_clock: Any, broker: AsyncClient
) -> None:
    await broker.create_queue("jobs")
    await broker.publish_batch("jobs", [Message(n) for n in range(50)])
    handler = Handler(lambda seen: len(seen) == 50)
    stats = await run_until_done(broker, handler, concurrency=4)
    assert sorted(d.payload for d in handler.seen) == list(range(50))
    assert (stats.delivered, stats.acked, stats.nacked, stats.skipped, stats.mode) == (50, 50, 0, 0, "stream")
    queue = await broker.stats("jobs")
    assert (queue["acked_total"], queue["in_flight"], queue["ready"]) == (50, 0, 0)


async def test_acks_are_batched_under_load(autojump_clock: Any, broker: AsyncClient, live_url: str) -> None:
    await broker.create_queue("jobs")
    await broker.publish_batch("jobs", [Message(n) for n in range(200)])
    acks: list[Call[Any]] = []

    async with AsyncClient(live_url) as counted:
        send = counted.send

        async def counting_send(call: Call[Any]) -> Any:
            if call.path.endswith("/ack"):
                acks.append(call)
            return await send(call)

        counted.send = counting_send  # type: ignore[method-assign]
        stats = await run_until_done(counted, Handler(lambda seen: len(seen) == 200), concurrency=8)
    assert stats.acked == 200
    assert sum(len(call.json["leases"]) for call in acks) == 200
    assert len(acks) < 100, f"{len(acks)} ack calls for 200 messages: acks should share calls"


async def test_a_failing_handler_nacks_and_the_message_comes_back(
    autojump_clock: Any, broker: AsyncClient
) -> None:
    await broker.create_queue("jobs", retry_backoff={"type": "fixed", "base": 2})

    async def fail_first(delivery: Delivery) -> None:
        if delivery.attempt == 1:
            raise ValueError("flaky")

    handler = Handler(lambda seen: len(seen) == 2, fail_first)
    await broker.publish("jobs", "job")
    stats = await run_until_done(broker, handler)
    assert [d.attempt for d in handler.seen] == [1, 2]
    assert (stats.nacked, stats.acked) == (1, 1)
    history = (await broker.get_message("jobs", handler.seen[0].id))["history"]
    nacked = next(entry for entry in history if entry["event"] == "nacked")
    assert nacked["reason"] == "ValueError: flaky"
    assert nacked["delay"] == 2, "the queue's backoff"


async def test_retry_sets_the_nack_delay(autojump_clock: Any, broker: AsyncClient) -> None:
    await broker.create_queue("jobs")

    async def retry_later(delivery: Delivery) -> None:
        if delivery.attempt == 1:
            raise Retry(delay=7, reason="upstream down")

    handler = Handler(lambda seen: len(seen) == 2, retry_later)
    await broker.publish("jobs", "job")
    start = trio.current_time()
    stats = await run_until_done(broker, handler)
    assert stats.nacked == 1
    assert trio.current_time() - start >= 7


async def test_defer_gives_the_message_back_without_spending_an_attempt(
    autojump_clock: Any, broker: AsyncClient
) -> None:
    await broker.create_queue("jobs", max_attempts=1)

    async def defer_first(delivery: Delivery) -> None:
        if len(handler.seen) == 1:
            raise Defer(5, reason="busy")

    handler = Handler(lambda seen: len(seen) == 2, defer_first)
    await broker.publish("jobs", "job")
    start = trio.current_time()
    stats = await run_until_done(broker, handler)
    assert [d.attempt for d in handler.seen] == [1, 1], "the defer refunded the attempt"
    assert trio.current_time() - start == pytest.approx(5, abs=0.5)
    assert (stats.deferred, stats.acked) == (1, 1)
    assert (await broker.stats("jobs"))["dead_lettered_total"] == 0


async def test_reject_dead_letters_at_once(autojump_clock: Any, broker: AsyncClient) -> None:
    await broker.create_queue("jobs")

    async def reject(delivery: Delivery) -> None:
        raise Reject("malformed")

    handler = Handler(lambda seen: len(seen) == 1, reject)
    await broker.publish("jobs", "bad")
    stats = await run_until_done(broker, handler)
    assert stats.rejected == 1
    [dead] = await broker.browse("jobs.dlq")
    assert dead["headers"]["x-dead-letter-reason"] == "rejected"


async def test_long_handlers_have_their_leases_extended(autojump_clock: Any, broker: AsyncClient) -> None:
    await broker.create_queue("jobs")

    async def slow(delivery: Delivery) -> None:
        await trio.sleep(10)  # five leases long

    handler = Handler(lambda seen: len(seen) == 1, slow)
    await broker.publish("jobs", "slow")
    stats = await run_until_done(broker, handler, lease=2)
    assert (stats.acked, stats.skipped) == (1, 0)
    assert stats.extended >= 5
    queue = await broker.stats("jobs")
    assert (queue["acked_total"], queue["lease_expired_total"]) == (1, 0)


async def test_stopping_lets_running_handlers_finish_and_gives_back_the_rest(
    autojump_clock: Any, broker: AsyncClient
) -> None:
    await broker.create_queue("jobs")
    await broker.publish_batch("jobs", [Message(n) for n in range(10)])
    release = trio.Event()

    async def block(delivery: Delivery) -> None:
        await release.wait()

    handler = Handler(lambda seen: len(seen) == 1, block)
    stop = trio.Event()
    result: list[Any] = []

    async def worker() -> None:
        result.append(await work(broker, "jobs", handler, stop=stop, prefetch=5, handle_signals=False))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker)
        await handler.done.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert (await broker.stats("jobs"))["in_flight"] == 5
        stop.set()
        await trio.sleep(1)  # the running handler is not cut short by the stop
        assert not result
        release.set()
    [stats] = result
    assert stats.acked == 1
    assert stats.given_back == 4, "the four prefetched ones; the stopped stream refilled nothing"
    queue = await broker.stats("jobs")
    assert (queue["acked_total"], queue["ready"], queue["in_flight"]) == (1, 9, 0)
    assert [d.payload for d in handler.seen] == [0], "nothing else was handled"
    for message in await browse_all(broker):
        history = [entry["event"] for entry in (await broker.get_message("jobs", message["id"]))["history"]]
        assert history[-1] in {"deferred", "published"}, history
        assert message["attempt"] == 0, "given back by a defer (attempt refunded), or never delivered"


async def browse_all(broker: AsyncClient) -> list[dict[str, Any]]:
    return await broker.browse("jobs", state="ready")


async def test_a_handler_past_the_grace_period_is_cancelled_and_its_lease_released(
    autojump_clock: Any, broker: AsyncClient
) -> None:
    await broker.create_queue("jobs")
    await broker.publish("jobs", "stuck")

    async def stuck(delivery: Delivery) -> None:
        await trio.sleep_forever()

    handler = Handler(lambda seen: True, stuck)
    start = trio.current_time()
    stats = await run_until_done(broker, handler, grace=3)
    assert trio.current_time() - start == pytest.approx(3, abs=0.5)
    assert stats.acked == 0
    queue = await broker.stats("jobs")
    assert (queue["ready"], queue["in_flight"]) == (1, 0), "released when the stream closed"


async def test_the_worker_falls_back_to_long_polls(
    autojump_clock: Any, broker: AsyncClient, live_url: str
) -> None:
    class NoStreams(httpx.AsyncBaseTransport):
        """An older broker: no /work route."""

        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/work"):
                return httpx.Response(404, json={"error": {"code": "not_found", "message": "no route"}})
            return await self.inner.handle_async_request(request)

        async def aclose(self) -> None:
            await self.inner.aclose()

    await broker.create_queue("jobs")
    await broker.publish_batch("jobs", [Message(n) for n in range(20)])
    async with AsyncClient(live_url, transport=NoStreams()) as old:
        handler = Handler(lambda seen: len(seen) == 20)
        stats = await run_until_done(old, handler, concurrency=3)
    assert (stats.mode, stats.acked) == ("poll", 20)
    await broker.publish("jobs", "polled")
    stats = await run_until_done(broker, Handler(lambda seen: True), stream=False, concurrency=1)
    assert (stats.mode, stats.acked) == ("poll", 1)


async def test_deleting_the_queue_ends_the_worker_with_queue_not_found(
    autojump_clock: Any, broker: AsyncClient
) -> None:
    await broker.create_queue("jobs")
    await broker.publish("jobs", 1)
    handler = Handler(lambda seen: True)
    async with trio.open_nursery() as nursery:

        async def delete_when_handled() -> None:
            await handler.done.wait()
            await broker.delete_queue("jobs")

        nursery.start_soon(delete_when_handled)
        with pytest.raises(QueueNotFound) as ended:
            await work(broker, "jobs", handler, handle_signals=False)
    assert ended.value.status == 404  # a stream's error event has no status: it takes its class's


async def test_sigint_stops_the_worker_cleanly(autojump_clock: Any, broker: AsyncClient) -> None:
    await broker.create_queue("jobs")
    await broker.publish_batch("jobs", [Message(n) for n in range(3)])
    handler = Handler(lambda seen: len(seen) == 3)
    async with trio.open_nursery() as nursery:

        async def interrupt() -> None:
            await handler.done.wait()
            os.kill(os.getpid(), signal.SIGINT)

        nursery.start_soon(interrupt)
        stats = await work(broker, "jobs", handler, handle_signals=True)
    assert stats.acked == 3
    assert (await broker.stats("jobs"))["in_flight"] == 0


def test_the_blocking_client_runs_handlers_in_threads(thread_url: str) -> None:
    stop = threading.Event()
    seen: list[Any] = []
    lock = threading.Lock()

    def handle(delivery: Delivery) -> None:
        with lock:
            seen.append(delivery.payload)
            if len(seen) == 30:
                stop.set()
        if delivery.payload == 0 and delivery.attempt == 1:
            raise RuntimeError("once")

    with Client(thread_url) as broker:
        broker.create_queue("jobs")
        broker.publish_batch("jobs", [Message(n) for n in range(29)])
        stats = broker.work("jobs", handle, concurrency=4, stop=stop, handle_signals=False)
        assert sorted(seen) == [0, *range(29)]
        assert (stats.acked, stats.nacked) == (29, 1)
        assert broker.stats("jobs")["in_flight"] == 0


def test_the_async_worker_under_asyncio(thread_url: str) -> None:
    import asyncio

    async def main() -> Any:
        async with AsyncClient(thread_url) as broker:
            await broker.create_queue("jobs")
            await broker.publish_batch("jobs", [Message(n) for n in range(10)])
            done = asyncio.Event()
            seen: list[int] = []

            async def handle(delivery: Delivery) -> None:
                seen.append(delivery.payload)
                if len(seen) == 10:
                    done.set()

            stop = threading.Event()
            task = asyncio.create_task(broker.work("jobs", handle, stop=stop, handle_signals=False))
            await done.wait()
            stop.set()
            return await task

    stats = asyncio.run(main())
    assert stats.acked == 10


# Outcomes the broker would refuse, a consume-only token, leases that change, settles that keep failing


async def test_an_outcome_beyond_the_brokers_limits_is_clamped_and_the_worker_goes_on(
    autojump_clock: Any, broker: AsyncClient
) -> None:
    await broker.create_queue("jobs")
    await broker.publish_batch("jobs", [Message(n) for n in range(6)])

    async def misbehave(delivery: Delivery) -> None:
        if delivery.payload == 1:
            raise Defer(100000, reason="tomorrow")  # the broker takes 0 … 86400
        if delivery.payload == 2:
            raise Retry(delay=-5, reason="x" * 5000)  # a negative delay; a reason over 4096 characters
        if delivery.payload == 3:
            raise Reject("y" * 5000)

    handler = Handler(lambda seen: len(seen) == 6, misbehave)
    stats = await run_until_done(broker, handler, concurrency=2)
    assert (stats.acked, stats.deferred, stats.nacked, stats.rejected, stats.refused) == (3, 1, 1, 1, 0)
    [deferred] = await broker.browse("jobs", state="delayed")
    assert deferred["payload"] == 1
    history = (await broker.get_message("jobs", deferred["id"]))["history"]
    assert next(entry for entry in history if entry["event"] == "deferred")["retry_after"] == 86400
    [retried] = await broker.browse("jobs", state="ready")
    assert retried["payload"] == 2, "nacked with no delay"
    [dead] = await broker.browse("jobs.dlq")
    assert dead["payload"] == 3


async def test_a_settle_the_broker_refuses_is_left_to_lease_expiry_and_the_others_go_through(
    autojump_clock: Any, broker: AsyncClient, live_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    await broker.create_queue("jobs", lease=5)
    await broker.publish_batch("jobs", [Message(n) for n in range(4)])

    async def defer_one(delivery: Delivery) -> None:
        if delivery.payload == 0 and delivery.attempt == 1:
            raise Defer(1, reason="busy")

    async with AsyncClient(live_url) as refusing:
        send = refusing.send

        async def refuse_defers(call: Call[Any]) -> Any:
            if call.path.endswith("/defer"):  # as a broker with a lower max_reason_length would
                raise InvalidRequest("reason: at most 2 characters")
            return await send(call)

        refusing.send = refuse_defers  # type: ignore[method-assign]
        handler = Handler(lambda seen: len(seen) == 5, defer_one)  # the refused one, back after its lease
        stats = await run_until_done(refusing, handler)
    assert (stats.acked, stats.refused) == (4, 1)
    assert [d.attempt for d in handler.seen if d.payload == 0] == [1, 2]
    assert "refused to defer 1 messages (invalid_request" in caplog.text


async def test_a_token_that_may_only_consume_can_run_a_worker(autojump_clock: Any, serve_broker: Any) -> None:
    tokens = (
        Token("admin", "admin-secret", ("admin",)),
        Token("worker", "worker-secret", ("consume:jobs",)),
    )
    url = await serve_broker(Settings(in_memory=True, tokens=tokens))
    async with AsyncClient(url, token="admin-secret") as admin:
        await admin.create_queue("jobs", lease=2)
        await admin.publish_batch("jobs", [Message(n) for n in range(3)])
        async with AsyncClient(url, token="worker-secret") as worker:
            with pytest.raises(Forbidden):
                await worker.get_queue("jobs")  # no read: scope

            async def slow(delivery: Delivery) -> None:
                await trio.sleep(5)  # past the 2 s lease: extended

            stats = await run_until_done(worker, Handler(lambda seen: len(seen) == 3, slow))
        queue = await admin.stats("jobs")
    assert (stats.acked, stats.skipped) == (3, 0) and stats.extended >= 3
    assert (queue["acked_total"], queue["lease_expired_total"]) == (3, 0)


async def test_an_extend_that_its_own_ack_overtook_is_not_counted_skipped(
    autojump_clock: Any, live_url: str
) -> None:
    """The extender's call went out just before the handler's ack and reached the broker after it: the
    broker skipped the lease, settled by the ack, and the stats counted a skip, which docs/workers.md
    says means the lease expired and the message went to someone else."""
    async with AsyncClient(live_url) as broker:
        await broker.create_queue("jobs", lease=2)
        await broker.publish("jobs", "long")
        send = broker.send
        acked, extend_answered = trio.Event(), trio.Event()
        extends: list[Any] = []

        async def ack_first(call: Call[Any]) -> Any:
            if call.path.endswith("/extend") and not extends:
                await acked.wait()  # on its way meanwhile: the broker sees the ack first
                extends.append(answer := await send(call))
                extend_answered.set()
                return answer
            answer = await send(call)
            if call.path.endswith("/ack"):
                acked.set()
            return answer

        broker.send = ack_first  # type: ignore[method-assign]

        async def long_job(delivery: Delivery) -> None:
            await trio.sleep(1.5)  # past the extend due at half the 2 s lease

        handler = Handler(lambda seen: len(seen) == 1, long_job)
        stats = await run_until_done(broker, handler, until=extend_answered)
        [answer] = extends
        assert len(answer.skipped) == 1, "the broker did skip the lease the ack had settled"
        assert (stats.acked, stats.skipped) == (1, 0)


async def test_a_lease_shortened_while_the_worker_runs_is_still_extended_in_time(
    autojump_clock: Any, broker: AsyncClient
) -> None:
    await broker.create_queue("jobs", lease=30)

    async def long_job(delivery: Delivery) -> None:
        await trio.sleep(5)

    handler = Handler(lambda seen: len(seen) == 1, long_job)
    stop = trio.Event()
    result: list[Any] = []

    async def worker() -> None:
        result.append(await work(broker, "jobs", handler, stop=stop, handle_signals=False))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker)
        await trio.testing.wait_all_tasks_blocked()  # the worker holds its stream, 30 s leases then
        await broker.update_queue("jobs", lease=2)
        await broker.publish("jobs", "long")
        await handler.done.wait()
        stop.set()
    [stats] = result
    assert (stats.acked, stats.skipped) == (1, 0) and stats.extended >= 2
    queue = await broker.stats("jobs")
    assert (queue["acked_total"], queue["lease_expired_total"]) == (1, 0)


@pytest.mark.parametrize(
    ("stream", "lease"),
    [(True, None), (True, 2.0), (False, 2.0)],
    ids=["stream, the queue's lease", "stream, a lease asked for", "long polls, a lease asked for"],
)
async def test_a_broker_whose_clock_is_an_hour_ahead_has_its_leases_extended_in_time(
    autojump_clock: Any,
    serve_broker: Any,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
    lease: float | None,
) -> None:
    """The host's clock was an hour ahead when the broker started, and NTP stepped it back since (or the
    worker runs on a host an hour behind): every ``lease_deadline`` read an hour away, so the worker
    never extended, and each lease ran out under its handler, again and again."""
    real_time = time.time
    monkeypatch.setattr(
        clock_module,
        "time",
        types.SimpleNamespace(time=lambda: real_time() + 3600, strftime=time.strftime, gmtime=time.gmtime),
    )
    url = await serve_broker(Settings(in_memory=True))
    async with AsyncClient(url) as broker:
        await broker.create_queue("jobs", lease=2)

        async def slow(delivery: Delivery) -> None:
            await trio.sleep(10)  # five leases long

        handler = Handler(lambda seen: len(seen) == 1, slow)
        await broker.publish("jobs", "slow")
        options = {} if lease is None else {"lease": lease}
        stats = await run_until_done(broker, handler, stream=stream, **options)
        assert (stats.acked, stats.skipped) == (1, 0) and stats.extended >= 4
        queue = await broker.stats("jobs")
        assert (queue["acked_total"], queue["lease_expired_total"]) == (1, 0)


async def test_a_settle_that_keeps_failing_gives_up_without_a_last_pointless_wait(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    broker = AsyncClient("http://127.0.0.1:1")  # never reached: ``send`` is replaced
    worker = _Worker(broker, "jobs", lambda delivery: None, 1, 2, None, None, 30.0, False)
    worker.settle_send.close()
    worker.settle_receive.close()
    sends: list[float] = []

    async def unreachable(call: Call[Any]) -> Any:
        sends.append(trio.current_time())
        raise httpx.ConnectError("refused")

    broker.send = unreachable  # type: ignore[method-assign]
    start = trio.current_time()
    assert await worker._send_retrying(calls.ack("jobs", ["l1"])) is None
    assert len(sends) == SEND_TRIES
    assert trio.current_time() == sends[-1], "no sleep after the last try"
    assert trio.current_time() - start == pytest.approx(0.1 + 0.2 + 0.4 + 0.8 + 1.6)
    messages = [record.getMessage() for record in caplog.records]
    assert sum("retrying in" in message for message in messages) == SEND_TRIES - 1
    assert "gave up after 6 tries" in messages[-1] and "retrying" not in messages[-1]
