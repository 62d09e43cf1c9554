"""The worker loop: messages pushed over the ``/work`` stream (§7) to a handler, outcomes settled for it.

``work(client, queue, handler, concurrency=N)`` runs until it is stopped (SIGINT or SIGTERM, or the
``stop`` event), and then returns its ``WorkerStats``. Inside, a handful of tasks share one table of the
leases the worker holds:

- the feeder reads the stream (``GET …/work?max=prefetch``) and queues each delivery for the runners;
  it reconnects with a backoff when the connection drops or the broker shuts down (starting over once a
  stream opens), and falls back to long-poll claims when the broker has no ``/work`` route;
- ``concurrency`` runners call the handler and map what it did to a settle call: return → ack,
  ``Defer`` → defer, ``Reject`` → nack with ``retryable: false``, ``Retry`` or any other exception →
  nack (after the queue's backoff, unless ``Retry`` says);
- the settler sends those calls, as many leases per call as have piled up while the previous call was
  in flight (so acks batch themselves under load and go out at once when idle);
- the extender extends each lease once half of it has passed (long handlers, and messages waiting in
  the prefetch buffer), several per call. It reads a lease's end from its delivery's ``lease_deadline``
  (and an extend's answer), not from the queue's config: a queue's lease may change while the worker
  runs, and a token with only ``consume:`` may not read the config.

A settle the broker refuses as invalid (400, 413) is logged and its messages are left to their leases'
expiry; it does not end the worker or hold up the other outcomes. Outcomes are first brought within
the broker's documented limits (``Defer`` up to 86400 s, ``Retry`` up to 604800 s, neither below 0,
reasons up to 4096 characters), so a handler's out-of-range value is clamped rather than refused.

Stopping is graceful, and spends no attempt on a message that was never started: no new handler
starts; the worker stops the stream (``POST …/work/{stream_id}/stop``, the id from the stream's
``stream-id`` header), so the broker pushes nothing more, and reads on until the stream's ``stopped``
event says everything pushed before has arrived; it gives back the messages never started (deferred
for 0 s, so no attempt is spent); running handlers get ``grace`` seconds to finish (then they are
cancelled), their outcomes are settled, and only then is the stream closed (the broker releases what is
left: the leases of handlers cut short, counted). Against a broker without the stop call (or when it
fails), the give-back waits for the runners to end, as before: the broker may then refill the freed
slots in the instant before the close, and those releases count an attempt. A second signal stops at
once.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import signal
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import httpx

from broker.client import calls, codec, durations
from broker.client.errors import BrokerError, NotAcceptable, NotFound, ShuttingDown, error_from
from broker.client.models import Defer, Delivery, Reject, Retry, Settled, WorkerStats
from broker.client.sse import Event, EventParser
from broker.client.wire import StreamedAnswer

if TYPE_CHECKING:
    from broker.client.client import AsyncClient

log = logging.getLogger("broker.client")

#: Seconds without a byte (the broker sends a heartbeat at least every 15 s) before the stream is
#: taken for dead and reopened.
STREAM_READ_TIMEOUT = 45.0
#: How long a long-poll claim waits when the worker falls back to polling.
POLL_WAIT = 20.0
#: Backoff between reconnects: first, then doubled up to the last.
BACKOFF = (0.1, 5.0)
#: Tries of a settle or extend call that fails on the network or with a 5xx.
SEND_TRIES = 6
#: A runner whose handlers never wait yields to the other tasks after this many messages (1 measured
#: best: the settler then sends acks while the rest of a pushed batch runs).
YIELD_EVERY = 1
#: Most leases per settle or extend call (the broker's batch limit).
MAX_BATCH = 1000
#: The broker's limits on settle values (§5, docs/api.md): outcomes are clamped to them, since a value
#: beyond them would have the whole settle call refused.
MAX_RETRY_AFTER = 86400.0
MAX_NACK_DELAY = 604800.0
MAX_REASON = 4096
#: Shortest and longest lease an extend may ask for (§3).
LEASE_RANGE = (0.1, 43200.0)

Outcome = tuple[str, Any, str | None]  # ("ack" | "nack" | "defer" | "reject" | "give_back", value, reason)


@dataclass(slots=True)
class _Job:
    delivery: Delivery
    #: When (``anyio.current_time``) to extend the lease: half of it before its end.
    extend_at: float
    #: The lease an extend asks for: the worker's ``lease``, else as long as the delivery's own.
    length: float
    started: bool = False
    #: The broker no longer counts this lease as ours (the stream ended, or an extend was skipped).
    lost: bool = False
    #: Given back on stopping (a defer of 0 s is on its way).
    given_back: bool = False
    #: Its settle call is on its way: an extend sent meanwhile may find the lease settled by it.
    settling: bool = False


def _clamp(value: Any, high: float) -> Any:
    """A duration within 0 … ``high``; text (``"5m"``) is left for the broker to judge."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return min(value, high) if value >= 0 else 0.0  # negative, or NaN
    return value


def _reason(reason: str | None) -> str | None:
    return reason[:MAX_REASON] if isinstance(reason, str) else reason


def _lease_step(seconds: float) -> float:
    """A lease length to three significant digits, within the broker's range: leases measured from
    deliveries pushed together (29.998, 29.996 s) ask for the same lease, so share extend calls."""
    return min(max(float(f"{seconds:.3g}"), LEASE_RANGE[0]), LEASE_RANGE[1])


def _lease_seconds(lease: float | str) -> float:
    """The worker's ``lease`` in seconds: a number, or a string with a unit as the other calls take
    (``"250ms"``, ``"30s"``, ``"5m"``, ``"12h"``). Checked once, up front: the worker computes with it
    (when to extend) and sends it on every reconnect and extend."""
    try:
        seconds = durations.seconds(lease)
    except TypeError as error:
        raise TypeError(f"lease must be a duration: {error}") from None
    except ValueError as error:
        raise ValueError(f"lease must be a duration: {error}") from None
    if not LEASE_RANGE[0] <= seconds <= LEASE_RANGE[1]:
        raise ValueError(
            f"lease must be between {LEASE_RANGE[0]:g} and {LEASE_RANGE[1]:g} seconds; got {lease!r}"
        )
    return seconds


class _StreamUnavailable(Exception):
    """The broker has no ``/work`` route: poll instead."""


def _one_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error that ended the worker: the task groups wrap it; one kind of error (several tasks may
    meet the same, e.g. a deleted queue) is raised as it is."""
    leaves: list[BaseException] = []

    def collect(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                collect(inner)
        else:
            leaves.append(error)

    collect(group)
    return leaves[0] if len({type(leaf) for leaf in leaves}) == 1 else group


async def work(
    client: AsyncClient,
    queue: str,
    handler: Callable[[Delivery], Any],
    *,
    concurrency: int = 1,
    prefetch: int | None = None,
    consumer: str | None = None,
    lease: float | str | None = None,
    stop: anyio.Event | threading.Event | None = None,
    handle_signals: bool = True,
    grace: float = 30.0,
    stream: bool = True,
    threaded: bool | None = None,
) -> WorkerStats:
    """Run ``handler(delivery)`` on the queue's messages until stopped; return what was done.

    - ``concurrency``: handlers running at once.
    - ``prefetch``: messages held at once (the stream's ``max``, at least 1), default twice ``concurrency``:
      the extra ones wait in memory, so the next handler starts without a round trip.
    - ``consumer``: the name the broker records; ``lease``: seconds per lease (default: the queue's), a
      number or a string such as ``"30s"`` or ``"5m"``.
    - ``stop``: an event that stops the worker when set (an anyio event, or a ``threading.Event``).
    - ``handle_signals``: stop on SIGINT and SIGTERM (only in the main thread).
    - ``grace``: seconds running handlers get to finish once stopping.
    - ``stream``: ``False`` to use long-poll claims instead of the push stream.
    - ``threaded``: run the handler in worker threads (default: when it is not a coroutine function;
      a coroutine function cannot run in a thread, so ``threaded=True`` refuses it).
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if prefetch is None:
        prefetch = min(2 * concurrency, MAX_BATCH)
    elif isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise TypeError(f"prefetch must be an integer, not {type(prefetch).__name__}")
    elif prefetch < 1:  # the top is the broker's max_batch (1000 unless configured): it says so
        raise ValueError(f"prefetch must be at least 1, not {prefetch}")
    if threaded is None:
        threaded = not _is_async(handler)
    elif threaded and _is_async(handler):
        raise TypeError("an async handler cannot run in worker threads (threaded=True): leave threaded unset")
    lease_seconds = None if lease is None else _lease_seconds(lease)
    worker = _Worker(client, queue, handler, concurrency, prefetch, consumer, lease_seconds, grace, threaded)
    return await worker.run(stop, handle_signals, stream)


def _is_async(handler: Callable[..., Any]) -> bool:
    """Whether calling ``handler`` gives an awaitable: a coroutine function, a partial of one, or an
    object whose ``__call__`` is one."""
    while isinstance(handler, functools.partial):
        handler = handler.func
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - the method, not callability
    )


def run_blocking(
    url: str, token: str | None, timeout: float, queue: str, handler: Callable[[Delivery], Any], options: Any
) -> WorkerStats:
    """``Client.work``: the loop above on an event loop of its own, the handler in worker threads."""
    from broker.client.client import AsyncClient

    if _is_async(handler):
        # In a thread, calling it would only make a coroutine: every message would be acked unhandled.
        raise TypeError(
            "Client.work runs the handler in threads, so it must be a plain function; "
            "run an async handler with AsyncClient.work"
        )

    backend = options.pop("backend", "asyncio")

    async def main() -> WorkerStats:
        async with AsyncClient(url, token=token, timeout=timeout) as client:
            return await work(client, queue, handler, threaded=True, **options)

    result: WorkerStats = anyio.run(main, backend=backend)
    return result


class _Worker:
    def __init__(
        self,
        client: AsyncClient,
        queue: str,
        handler: Callable[[Delivery], Any],
        concurrency: int,
        prefetch: int,
        consumer: str | None,
        lease: float | None,
        grace: float,
        threaded: bool,
    ) -> None:
        self.client = client
        self.queue = queue
        self.handler = handler
        self.concurrency = concurrency
        self.prefetch = prefetch
        self.consumer = consumer
        #: Seconds per lease asked for (``None``: the queue's), checked by ``work``.
        self.lease = lease
        #: Broker wall time minus ``anyio.current_time()``: turns a ``lease_deadline`` into a time of
        #: this event loop. The local wall clock's at first (set in ``run``), then measured by each
        #: extend's answer (the broker's clock, so a skewed local clock is corrected).
        self.clock_offset = 0.0
        #: The last ``lease_deadline`` read, when, the time it ends and its length: deliveries pushed
        #: together share them, and parsing a timestamp per message would be a tenth of its CPU.
        self.last_deadline: tuple[str, float, float, float] = ("", 0.0, 0.0, 0.0)
        #: Set when a lease arrives that must be extended before the extender's next wake-up.
        self.extend_soon = anyio.Event()
        self.next_extend_at = math.inf
        self.grace = grace
        self.threaded = threaded
        self.limiter = anyio.CapacityLimiter(concurrency) if threaded else None
        self.stats = WorkerStats()
        #: Every lease the worker holds, by lease id: queued, running, or waiting to be settled.
        self.held: dict[str, _Job] = {}
        #: Deliveries waiting for a runner; runners drain it without yielding between jobs whose
        #: handler does not (a memory stream would cost an event-loop turn per message).
        self.jobs: deque[_Job] = deque()
        self.jobs_closed = False
        self.idle_runners = 0
        self.jobs_waiting = anyio.Event()
        self.settle_send, self.settle_receive = anyio.create_memory_object_stream[tuple[_Job, Outcome]](
            math.inf
        )
        self.stopping = anyio.Event()
        #: Set once stopping has stopped the stream and given back what never started (or could not).
        self.stream_stopped = anyio.Event()
        #: The open stream's id (its ``stream-id`` header), and an event set once it will push nothing
        #: more: its ``stopped`` event arrived, or it ended.
        self.stream_id: str | None = None
        self.stream_drained = anyio.Event()
        #: The last ``/work`` request was answered 200 (the reconnect backoff starts over once it was).
        self.stream_opened = False
        self.slot_freed = anyio.Event()
        self.runner_scope = anyio.CancelScope()
        self.outer_scope: anyio.CancelScope | None = None

    # -- the whole run ------------------------------------------------------------------------------

    async def run(
        self, stop: anyio.Event | threading.Event | None, handle_signals: bool, stream: bool
    ) -> WorkerStats:
        # The queue's config is not read (it needs a ``read:`` scope; ``consume:`` is enough to work):
        # each delivery says when its lease ends.
        self.clock_offset = time.time() - anyio.current_time()
        try:
            await self._run_tasks(stop, handle_signals, stream)
        except BaseExceptionGroup as group:
            raise _one_error(group) from None
        finally:
            for channel in (self.settle_send, self.settle_receive):
                channel.close()
        return self.stats

    async def _run_tasks(
        self, stop: anyio.Event | threading.Event | None, handle_signals: bool, stream: bool
    ) -> None:
        async with anyio.create_task_group() as outer:
            self.outer_scope = outer.cancel_scope
            outer.start_soon(self._feed, stream)
            outer.start_soon(self._extend_leases)
            outer.start_soon(self._stop_stream)
            if stop is not None:
                outer.start_soon(self._watch_stop, stop)
            if handle_signals and threading.current_thread() is threading.main_thread():
                outer.start_soon(self._watch_signals)
            async with anyio.create_task_group() as settling:
                settling.start_soon(self._settle)
                with self.runner_scope:
                    async with anyio.create_task_group() as runners:
                        for _ in range(self.concurrency):
                            runners.start_soon(self._run_jobs)
                # Every runner is done: give back what never started, while the stream still holds it
                # (all of it already, unless the stream could not be stopped).
                await self.stream_stopped.wait()
                self._give_back_unstarted()
                self.settle_send.close()
            outer.cancel_scope.cancel()  # closes the stream: the broker releases anything left

    def stop(self) -> None:
        """Stop taking messages; running handlers get ``grace`` seconds to finish."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.jobs_closed = True
        self.jobs_waiting.set()
        self.runner_scope.deadline = anyio.current_time() + self.grace

    async def _stop_stream(self) -> None:
        """Once stopping: stop the stream, read on until it has pushed all it will, and give back what
        never started, while running handlers finish. Any failure leaves the give-back to the end."""
        await self.stopping.wait()
        try:
            stream_id, drained = self.stream_id, self.stream_drained
            if stream_id is None:
                return
            try:
                await self.client.stop_stream(self.queue, stream_id)
            except (httpx.TransportError, BrokerError) as error:
                log.info("could not stop the work stream (%s); giving back after the handlers", error)
                return
            with anyio.move_on_after(self.client.timeout):
                await drained.wait()
            self._give_back_unstarted()
        finally:
            self.stream_stopped.set()

    def _give_back_unstarted(self) -> None:
        """Defer for 0 s (no attempt spent) every held message no handler started."""
        for job in list(self.held.values()):
            if not (job.started or job.lost or job.given_back):
                job.given_back = True
                self.settle_send.send_nowait((job, ("give_back", 0, None)))

    async def _watch_stop(self, stop: anyio.Event | threading.Event) -> None:
        if isinstance(stop, threading.Event):
            # A threading.Event cannot wake a task: look at it every 50 ms.
            while not stop.is_set():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        else:
            await stop.wait()
        self.stop()

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                if self.stopping.is_set():  # a second signal: stop now
                    log.warning("worker stopped at once by a second signal %s", signum)
                    assert self.outer_scope is not None
                    self.outer_scope.cancel()
                    return
                log.info("worker stopping on signal %s", signum)
                self.stop()

    # -- feeding ------------------------------------------------------------------------------------

    def _take(self, delivery: Delivery, now: float) -> None:
        """Hold a delivery that arrived at ``now`` (``anyio.current_time``: read once per batch of them,
        since anyio looks up the running event loop each time) and queue it for a runner."""
        text, read_at, ends, length = self.last_deadline
        if delivery.lease_deadline != text or now != read_at:
            text = delivery.lease_deadline
            ends = datetime.fromisoformat(text).timestamp() - self.clock_offset
            if self.lease is not None:  # it was leased before now: a clock ahead of ours shows no later
                ends = min(ends, now + self.lease)
            length = self.lease or _lease_step(ends - now)
            self.last_deadline = (text, now, ends, length)
        job = _Job(delivery, ends - length / 2, length)
        if job.extend_at < self.next_extend_at:
            self.extend_soon.set()  # sooner than the extender will wake: e.g. the queue's lease shrank
        self.held[delivery.lease_id] = job
        self.stats.delivered += 1
        if not self.stopping.is_set():
            self.jobs.append(job)
            if self.idle_runners:
                self.jobs_waiting.set()

    async def _feed(self, use_stream: bool) -> None:
        backoff = BACKOFF[0]
        while use_stream:
            self.stream_opened = False
            try:
                await self._stream_once()
            except _StreamUnavailable:
                break
            except (httpx.TransportError, ShuttingDown) as error:
                if self.stream_opened:  # the broker was back: this is a new outage, not the same one
                    backoff = BACKOFF[0]
                log.info("work stream interrupted (%s); reconnecting in %.1f s", error, backoff)
            else:
                backoff = BACKOFF[0]
            self._lose_all()
            if self.stopping.is_set():
                await anyio.sleep_forever()  # nothing more to take; wait to be cancelled
            self.stats.reconnects += 1
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF[1])
        self.stats.mode = "poll"
        await self._poll()

    def _lose_all(self) -> None:
        """The stream ended: the broker released every lease it pushed on it."""
        for job in self.held.values():
            job.lost = True
        self.held.clear()

    async def _stream_once(self) -> None:
        params: dict[str, str] = {"max": str(self.prefetch)}
        if self.consumer is not None:
            params["consumer"] = self.consumer
        if self.lease is not None:
            params["lease"] = repr(self.lease)  # seconds: a float's repr in the lease range has no exponent
        async with self.client.open_stream(
            calls.queue_path(self.queue) + "/work",
            params,
            {"Accept": "text/event-stream"},
            STREAM_READ_TIMEOUT,
        ) as response:
            if response.status_code >= 400:
                await response.aread()
                try:
                    body = response.json()
                except ValueError:
                    body = None
                error = error_from(response.status_code, body)
                if type(error) is NotFound or isinstance(error, NotAcceptable) or response.status_code == 405:
                    raise _StreamUnavailable from error
                raise error
            self.stream_opened = True
            self._read_broker_time(response.headers.get("broker-time"))
            drained = self.stream_drained = anyio.Event()
            self.stream_id = response.headers.get("stream-id")
            try:
                await self._read_stream(response, drained)
            finally:
                self.stream_id = None
                drained.set()

    def _read_broker_time(self, shown: str | None) -> None:
        """Measure the broker's clock by a stream's ``broker-time``, against when its answer arrived: off
        by the answer's way here (well under a millisecond on a LAN, against the half lease an extend
        leaves), late rather than early. Not against when the request went out: that would count the
        connection's making too (seconds, when SYNs are retried), and the lease lengths read from the
        deliveries would shrink by it. A broker of before 2026-11-24 sends none, and the worker keeps to
        its own clock until an extend answers."""
        if shown is None:
            return
        try:
            self.clock_offset = datetime.fromisoformat(shown).timestamp() - anyio.current_time()
        except ValueError:
            return

    async def _read_stream(self, response: StreamedAnswer | httpx.Response, drained: anyio.Event) -> None:
        parser = EventParser()
        ended: BrokerError | None = None
        # Read to the end even after an error event (the broker ends the response right after it):
        # leaving httpx's chunk iterator early leaves its inner generators to the GC.
        async for chunk in response.aiter_raw():
            now = anyio.current_time()
            for item in parser.feed(chunk):
                if not isinstance(item, Event):
                    continue  # a heartbeat
                if item.event == "message" and ended is None:
                    self._take(Delivery.from_json(codec.loads(item.data)), now)
                elif item.event == "stopped":
                    drained.set()  # everything pushed before the stop has arrived
                elif item.event == "error":
                    ended = error_from(None, {"error": codec.loads(item.data)})
        if ended is not None:
            raise ended

    async def _poll(self) -> None:
        """Long-poll claims while there is room. A broker that cannot be reached, is shutting down or
        answers 5xx is tried again with the stream's backoff (0.1 s doubling to 5 s), as docs/workers.md
        says of reconnects; any other refusal (the queue deleted, a scope missing) ends ``work()``."""
        backoff = BACKOFF[0]
        while not self.stopping.is_set():
            free = self.prefetch - len(self.held)
            if free <= 0:
                freed = self.slot_freed
                await freed.wait()
                continue
            try:
                result = await self.client.claim(
                    self.queue, consumer=self.consumer, max=free, lease=self.lease, wait=POLL_WAIT
                )
            except (httpx.TransportError, BrokerError) as error:
                if isinstance(error, BrokerError) and error.status < 500:
                    raise
                log.info("claim failed (%s); retrying in %.1f s", error, backoff)
                self.stats.reconnects += 1
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF[1])
                continue
            backoff = BACKOFF[0]
            now = anyio.current_time()
            for delivery in result:
                self._take(delivery, now)

    # -- running handlers ---------------------------------------------------------------------------

    async def _run_jobs(self) -> None:
        jobs = self.jobs
        ran = 0
        while True:
            while jobs:
                job = jobs.popleft()
                if job.lost or self.stopping.is_set():
                    continue  # given back at the end (or already released by the broker)
                job.started = True
                outcome = await self._call_handler(job.delivery)
                self.settle_send.send_nowait((job, outcome))
                ran += 1
                if ran % YIELD_EVERY == 0:
                    # Let the settler send what is done while the rest runs: acks keep flowing.
                    await anyio.lowlevel.checkpoint()
            if self.jobs_closed:
                return
            self.idle_runners += 1
            waiting = self.jobs_waiting
            try:
                await waiting.wait()
            finally:
                self.idle_runners -= 1
            if waiting is self.jobs_waiting and not self.jobs_closed:
                self.jobs_waiting = anyio.Event()  # the first one woken re-arms it

    async def _call_handler(self, delivery: Delivery) -> Outcome:
        try:
            if self.threaded:
                result = await anyio.to_thread.run_sync(
                    self.handler, delivery, limiter=self.limiter, abandon_on_cancel=True
                )
                if result is not None and isinstance(result, Awaitable):
                    # Nothing awaits it in a thread: the work it stands for was never done.
                    if inspect.iscoroutine(result):
                        result.close()  # no "never awaited" warning on top of the error below
                    raise TypeError(
                        f"the handler returned {type(result).__name__}, an awaitable, from a worker "
                        "thread, where nothing awaits it; run async handlers with AsyncClient.work"
                    )
            else:
                result = self.handler(delivery)
                if isinstance(result, Awaitable):
                    await result
        except Defer as defer:
            return ("defer", _clamp(defer.retry_after, MAX_RETRY_AFTER), _reason(defer.reason))
        except Reject as reject:
            return ("reject", None, _reason(reject.reason))
        except Retry as retry:
            delay = None if retry.delay is None else _clamp(retry.delay, MAX_NACK_DELAY)
            return ("nack", delay, _reason(retry.reason))
        except Exception as error:
            log.exception("handler failed on message %s (attempt %d)", delivery.id, delivery.attempt)
            return ("nack", None, f"{type(error).__name__}: {error}"[:1000])
        return ("ack", None, None)

    # -- settling -----------------------------------------------------------------------------------

    async def _settle(self) -> None:
        receive = self.settle_receive
        async with receive:
            while True:
                try:
                    batch = [await receive.receive()]
                except anyio.EndOfStream:
                    return
                while len(batch) < 10 * MAX_BATCH:
                    try:
                        batch.append(receive.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                await self._settle_batch(batch)

    async def _settle_batch(self, batch: list[tuple[_Job, Outcome]]) -> None:
        groups: dict[tuple[str, Any, str | None], list[_Job]] = {}
        for job, outcome in batch:
            groups.setdefault(outcome, []).append(job)
        for (kind, value, reason), jobs in groups.items():
            for start in range(0, len(jobs), MAX_BATCH):
                chunk = jobs[start : start + MAX_BATCH]
                leases = [job.delivery.lease_id for job in chunk]
                for job in chunk:
                    job.settling = True
                if kind == "ack":
                    call = calls.ack(self.queue, leases)
                elif kind == "defer" or kind == "give_back":
                    call = calls.defer(self.queue, leases, value, reason)
                elif kind == "reject":
                    call = calls.nack(self.queue, leases, None, False, reason)
                else:
                    call = calls.nack(self.queue, leases, value, True, reason)
                try:
                    settled = await self._send_retrying(call)
                except BrokerError as error:
                    if error.status not in (400, 413):
                        raise  # e.g. the queue is gone, or the token may not settle: nothing can go on
                    # The leases of one call share the outcome, so one by one they would be refused
                    # too: leave them to expire (the messages come back) and keep working.
                    log.error(
                        "the broker refused to %s %d messages (%s: %s); their leases will expire",
                        "defer" if kind == "give_back" else kind,
                        len(chunk),
                        error.code,
                        error.message,
                    )
                    self.stats.refused += len(chunk)
                    settled = None
                for job in chunk:
                    self.held.pop(job.delivery.lease_id, None)
                if settled is not None:
                    self.stats.skipped += len(settled.skipped)
                    count = settled.count
                    if kind == "ack":
                        self.stats.acked += count
                    elif kind == "defer":
                        self.stats.deferred += count
                    elif kind == "give_back":
                        self.stats.given_back += count
                    elif kind == "reject":
                        self.stats.rejected += count
                    else:
                        self.stats.nacked += count
        self.slot_freed.set()
        self.slot_freed = anyio.Event()

    async def _send_retrying(self, call: calls.Call[Any]) -> Any:
        """Send a settle or extend call (idempotent), retrying network failures a few times; the
        leases expire on their own if it never lands."""
        delay = BACKOFF[0]
        for attempt in range(1, SEND_TRIES + 1):
            try:
                return await self.client.send(call)
            except httpx.TransportError as error:
                failure = f"failed ({error})"
            except BrokerError as error:
                if error.status < 500:
                    raise
                failure = f"answered {error.code}"
            if attempt == SEND_TRIES:  # no sleep, and no promise of a retry, after the last try
                log.error(
                    "%s %s; gave up after %d tries, its leases will expire", call.path, failure, attempt
                )
                return None
            log.warning("%s %s; retrying in %.1f s", call.path, failure, delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, BACKOFF[1])
        raise AssertionError("unreachable")

    # -- extending ----------------------------------------------------------------------------------

    async def _extend_leases(self) -> None:
        while True:
            now = anyio.current_time()
            soonest = min((job.extend_at for job in self.held.values()), default=math.inf)
            if soonest > now:
                self.next_extend_at = soonest
                woken = self.extend_soon = anyio.Event()
                with anyio.move_on_after(soonest - now):
                    await woken.wait()
                continue
            self.next_extend_at = math.inf
            # Extend what is due now, and what would be due within a quarter lease, in one call per
            # lease length asked for.
            groups: dict[float, list[_Job]] = {}
            for job in self.held.values():
                if job.extend_at <= now + job.length / 4:
                    groups.setdefault(job.length, []).append(job)
            for length, due in groups.items():
                for start in range(0, len(due), MAX_BATCH):
                    await self._extend(due[start : start + MAX_BATCH], length)

    async def _extend(self, chunk: list[_Job], length: float) -> None:
        sent_at = anyio.current_time()
        settled: Settled | None = await self._send_retrying(
            calls.extend(self.queue, [job.delivery.lease_id for job in chunk], length)
        )
        skipped = set(settled.skipped) if settled is not None else set()
        # A lease this worker's own settle took meanwhile (its call went out while this one did) is
        # not lost: the settle answers for it.
        skipped -= {job.delivery.lease_id for job in chunk if job.settling}
        deadlines = (settled.deadlines if settled is not None else None) or {}
        if deadlines:
            # The broker set each deadline to its now + length, some time after ``sent_at``: measured
            # from ``sent_at`` the offset is at most a round trip too large, so leases read with it
            # are extended early rather than late.
            wall = datetime.fromisoformat(next(iter(deadlines.values()))).timestamp()
            self.clock_offset = wall - length - sent_at
        for job in chunk:
            if job.delivery.lease_id in skipped:
                job.lost = True  # expired and given to someone else: its settle will be skipped
                self.held.pop(job.delivery.lease_id, None)
            elif settled is None:
                job.extend_at = anyio.current_time() + job.length / 4  # try again before it ends
            else:
                job.extend_at = sent_at + length / 2  # half the new lease, counted from before it began
        if settled is not None:
            self.stats.extended += settled.count
            self.stats.skipped += len(skipped)
