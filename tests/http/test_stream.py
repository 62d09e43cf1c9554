"""§7 push streams over the in-process app: ``GET /v1/queues/{queue}/work`` as Server-Sent Events.

Streams are read through Quart-trio's streaming test connection and parsed with the client's SSE parser.
With the ``autojump_clock``, "at once" means "without Trio's clock moving": a refill, or another stream
receiving released messages, happens in the same virtual instant as the call that caused it.
"""

from __future__ import annotations

import base64
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlencode

import cbor2
import orjson
import pytest
import structlog
import structlog.testing
import trio
import trio.testing

from broker.client.sse import Comment, Event, EventParser
from broker.errors import BrokerError, NotFound
from broker.http import parse
from broker.http.connection import ClientLink
from broker.http.stream import CHUNK, HEARTBEAT_CONFIG, _pump
from broker.server import Broker
from broker.storage.restore import parse_time
from broker.stream import CloseStream, OpenStream, ResumeStream, Stopped, StopStream, Stream
from tests.conftest import Client, make_queue

EVENT_STREAM = {"Accept": "text/event-stream"}


class StreamEnded(Exception):
    pass


class EventStream:
    """One ``/work`` response, driven at the ASGI level: its status, headers and events as they arrive.

    (Quart's streaming test connection cannot be used: after a client disconnect it waits forever for
    the end of a body that a cancelled response never sends.)"""

    def __init__(self) -> None:
        self.to_app, self.app_receives = trio.open_memory_channel[dict[str, Any]](10)
        self.app_sends, self.from_app = trio.open_memory_channel[dict[str, Any]](math.inf)
        self.parser = EventParser()
        self.pending: list[Event | Comment] = []
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.ended = False
        self.hung_up = False
        self._reading: trio.Event | None = None  # set while the client reads; None: not stalled

    def stall(self) -> None:
        """Stop reading: the app's next write of a body waits, as on a socket whose buffer is full."""
        self._reading = trio.Event()

    def read_again(self) -> None:
        """Read again: the write that waited goes through."""
        if self._reading is not None:
            self._reading.set()
            self._reading = None

    async def app_send(self, message: dict[str, Any]) -> None:
        reading = self._reading
        if reading is not None and message["type"] == "http.response.body":
            await reading.wait()
        await self.app_sends.send(message)

    async def next(self) -> Event | Comment:
        while not self.pending:
            if self.ended:
                raise StreamEnded
            message = await self.from_app.receive()
            if message["type"] == "http.response.start":
                self.status = message["status"]
                self.headers = {name.decode(): value.decode() for name, value in message["headers"]}
            else:
                self.pending.extend(self.parser.feed(message.get("body", b"")))
                self.ended = not message.get("more_body", False)
        return self.pending.pop(0)

    async def next_event(self) -> Event:
        while True:
            item = await self.next()
            if isinstance(item, Event):
                return item

    async def messages(self, count: int) -> list[dict[str, Any]]:
        out = []
        while len(out) < count:
            event = await self.next_event()
            assert event.event == "message", event
            delivery = orjson.loads(event.data)
            assert event.id == str(delivery["seq"])
            out.append(delivery)
        return out

    async def end(self) -> None:
        """Read to the end of the response."""
        with pytest.raises(StreamEnded):
            while True:
                await self.next()

    async def hang_up(self) -> None:
        if not self.hung_up:
            self.hung_up = True
            await self.to_app.send({"type": "http.disconnect"})


@asynccontextmanager
async def work(
    client: Client, queue: str = "jobs", headers: dict[str, str] | None = None, **query: Any
) -> AsyncIterator[EventStream]:
    """Open a stream; leaving the block hangs up, and waits for the server to be done with it."""
    path = f"/v1/queues/{queue}/work"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": urlencode({key: str(value) for key, value in query.items()}).encode(),
        "root_path": "",
        "headers": [
            (name.lower().encode(), value.encode())
            for name, value in (EVENT_STREAM if headers is None else headers).items()
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
        "extensions": {},
    }
    stream = EventStream()
    await stream.to_app.send({"type": "http.request", "body": b"", "more_body": False})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.app, scope, stream.app_receives.receive, stream.app_send)  # type: ignore[attr-defined]
        try:
            yield stream
        finally:
            await stream.hang_up()


async def publish(client: Client, *payloads: Any, queue: str = "jobs", **fields: Any) -> list[str]:
    response = await client.post(
        f"/v1/queues/{queue}/messages", json={"messages": [{"payload": p, **fields} for p in payloads]}
    )
    assert response.status_code == 201, await response.get_data()
    return [m["id"] for m in (await response.get_json())["messages"]]


async def settle(client: Client, verb: str, leases: list[str], **fields: Any) -> dict[str, Any]:
    response = await client.post(f"/v1/queues/jobs/{verb}", json={"leases": leases, **fields})
    assert response.status_code == 200, await response.get_data()
    body: dict[str, Any] = await response.get_json()
    return body


async def stats(client: Client, queue: str = "jobs") -> dict[str, Any]:
    response = await client.get(f"/v1/queues/{queue}")
    result: dict[str, Any] = (await response.get_json())["stats"]
    return result


async def history(client: Client, message_id: str) -> list[str]:
    body = await (await client.get(f"/v1/queues/jobs/messages/{message_id}")).get_json()
    return [entry["event"] for entry in body["history"]]


async def assert_open(stream: EventStream) -> None:
    """The first thing on a stream is a comment, sent with the headers."""
    first = await stream.next()
    assert first == Comment("stream open")
    assert stream.status == 200
    assert stream.headers["content-type"] == "text/event-stream"


# -- delivery and backpressure ---------------------------------------------------------------------


async def test_a_stream_pushes_ready_messages_as_message_events(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    ids = await publish(client, {"n": 1}, "two")
    async with work(client, consumer="w1", max=5) as stream:
        await assert_open(stream)
        first, second = await stream.messages(2)
        assert [first["id"], second["id"]] == ids
        assert (first["payload"], second["payload"]) == ({"n": 1}, "two")
        assert set(first) == {
            "id",
            "seq",
            "lease_id",
            "lease_deadline",
            "attempt",
            "payload",
            "headers",
            "key",
            "priority",
            "published_at",
        }, "the same shape as a claim's delivery"
        assert first["attempt"] == 1
        queue_stats = await stats(client)
        assert (queue_stats["ready"], queue_stats["in_flight"]) == (0, 2)
        body = await (await client.get(f"/v1/queues/jobs/messages/{ids[0]}")).get_json()
        assert body["consumer"] == "w1"


async def test_a_publish_is_pushed_to_an_idle_stream_at_once(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    async with work(client, max=1) as stream:
        await assert_open(stream)
        await trio.testing.wait_all_tasks_blocked()
        published_at = trio.current_time()
        await publish(client, "hello")
        [delivery] = await stream.messages(1)
        assert delivery["payload"] == "hello"
        assert trio.current_time() == published_at


async def test_a_stream_holds_at_most_max_leases(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    await publish(client, 1, 2, 3, 4, 5)
    async with work(client, max=2, lease=600) as stream:
        await assert_open(stream)
        assert [m["payload"] for m in await stream.messages(2)] == [1, 2]
        for _ in range(4):  # a minute passes: nothing settles, so nothing but heartbeats comes
            assert await stream.next() == Comment("heartbeat")
        queue_stats = await stats(client)
        assert (queue_stats["ready"], queue_stats["in_flight"]) == (3, 2)


async def test_each_settle_refills_its_slot_at_once(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    await publish(client, 1, 2, 3, 4, 5)
    async with work(client, max=2) as stream:
        await assert_open(stream)
        one, two = await stream.messages(2)
        start = trio.current_time()
        await settle(client, "ack", [one["lease_id"]])
        [three] = await stream.messages(1)
        assert three["payload"] == 3
        await settle(client, "nack", [two["lease_id"]], delay=60)
        [four] = await stream.messages(1)
        assert four["payload"] == 4
        await settle(client, "defer", [three["lease_id"]], retry_after=60)
        [five] = await stream.messages(1)
        assert five["payload"] == 5
        assert trio.current_time() == start, "every refill came in the same instant as its settle"
        queue_stats = await stats(client)
        assert (queue_stats["in_flight"], queue_stats["delayed"]) == (2, 2)


async def test_a_batch_ack_refills_several_slots_in_one_write(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    await publish(client, *range(6))
    async with work(client, max=3) as stream:
        await assert_open(stream)
        first = await stream.messages(3)
        await settle(client, "ack", [m["lease_id"] for m in first])
        assert [m["payload"] for m in await stream.messages(3)] == [3, 4, 5]


async def test_an_expired_stream_lease_frees_its_slot_when_due(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    await publish(client, "slow")
    async with work(client, max=1, lease=2) as stream:
        await assert_open(stream)
        [first] = await stream.messages(1)
        start = trio.current_time()
        [again] = await stream.messages(1)  # nobody asked: the actor wakes at the lease's deadline
        assert trio.current_time() - start == pytest.approx(2)
        assert (again["id"], again["attempt"]) == (first["id"], 2)
        assert again["lease_id"] != first["lease_id"]


async def test_deleting_a_held_message_frees_its_slot(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    await publish(client, "a", "b")
    async with work(client, max=1) as stream:
        await assert_open(stream)
        [first] = await stream.messages(1)
        assert (await client.delete(f"/v1/queues/jobs/messages/{first['id']}")).status_code == 204
        [second] = await stream.messages(1)
        assert second["payload"] == "b"


async def test_stream_leases_extend_and_settle_like_any_other(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    await publish(client, "long")
    async with work(client, max=1, lease=5) as stream:
        await assert_open(stream)
        [delivery] = await stream.messages(1)
        await trio.sleep(4)
        extended = await settle(client, "extend", [delivery["lease_id"]], lease=5)
        assert extended["extended"] == 1
        await trio.sleep(4)  # past the first deadline, within the extended one
        acked = await settle(client, "ack", [delivery["lease_id"]])
        assert acked == {"acked": 1, "skipped": []}


async def test_bytes_payloads_are_pushed_as_base64(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    raw = bytes(range(256))
    await publish(client, base64.b64encode(raw).decode(), payload_encoding="base64")
    async with work(client) as stream:
        await assert_open(stream)
        [delivery] = await stream.messages(1)
        assert delivery["payload_encoding"] == "base64"
        assert base64.b64decode(delivery["payload"]) == raw


# -- release on disconnect -------------------------------------------------------------------------


async def test_a_streams_log_lines_name_its_consumer(autojump_clock: Any, client: Client) -> None:
    """§10: the consumer is bound on the stream's log lines, its ``request`` line when it closes too."""
    await make_queue(client)
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        async with work(client, consumer="sse-worker", max=1) as stream:
            await assert_open(stream)
    [request] = [entry for entry in logs if entry["event"] == "request" and entry["route"].endswith("work")]
    assert request["consumer"] == "sse-worker"


async def test_a_closed_streams_leases_are_released_and_journaled(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    ids = await publish(client, 1, 2, 3)
    async with work(client, consumer="first", max=5) as first:
        await assert_open(first)
        assert [m["id"] for m in await first.messages(3)] == ids
    queue_stats = await stats(client)
    assert (queue_stats["ready"], queue_stats["in_flight"]) == (3, 0)
    assert await history(client, ids[0]) == ["published", "claimed", "released"]
    async with work(client, consumer="second", max=5) as second:
        await assert_open(second)
        again = await second.messages(3)
    assert [m["id"] for m in again] == ids, "released messages come back first, in order"
    assert all(m["attempt"] == 2 for m in again), "the first stream's client saw them: counted"


async def test_release_on_disconnect_reaches_a_waiting_stream_in_the_same_instant(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    ids = await publish(client, "a", "b")
    async with work(client, consumer="leaving", max=2) as leaving:
        await assert_open(leaving)
        assert [m["id"] for m in await leaving.messages(2)] == ids
        async with work(client, consumer="staying", max=2) as staying:
            await assert_open(staying)
            await trio.testing.wait_all_tasks_blocked()
            closed_at = trio.current_time()
            await leaving.hang_up()
            released = await staying.messages(2)
            assert sorted(m["id"] for m in released) == ids
            assert trio.current_time() == closed_at
            queue_stats = await stats(client)
            assert (queue_stats["ready"], queue_stats["in_flight"]) == (0, 2)


async def test_a_settled_lease_is_not_released_again_on_disconnect(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    ids = await publish(client, "done", "held")
    async with work(client, max=2) as stream:
        await assert_open(stream)
        done, _ = await stream.messages(2)
        await settle(client, "ack", [done["lease_id"]])
    queue_stats = await stats(client)
    assert (queue_stats["ready"], queue_stats["in_flight"], queue_stats["acked_total"]) == (1, 0, 1)
    assert (await history(client, ids[1]))[-1] == "released"


async def test_deliveries_never_written_are_released_with_the_attempt_refunded(broker: Broker) -> None:
    """The actor's side, without HTTP: deliveries handed to a stream whose client left before they were
    written are released as unseen (refunded); the written ones count as an attempt."""
    registry = broker.registry
    await registry.create("jobs", {}).wait()
    actor = registry.get("jobs")
    client_stream = Stream("w", 3, None)
    await actor.request(OpenStream(client_stream))
    ids = [ref[0] for ref in await actor.request(_publish("a", "b", "c"))]
    written = client_stream.receive_nowait()
    assert written is not None and not isinstance(written, Exception)
    assert [claimed.id for claimed, _ in written] == ids  # one refill took all three
    unsent = [claimed.lease_id for claimed, _ in written[1:]]  # as if only the first were written
    await actor.request(CloseStream(client_stream, unsent))
    views = [await actor.request(_get(message_id)) for message_id in ids]
    assert [view.state.value for view in views] == ["ready"] * 3
    assert [view.attempt for view in views] == [1, 0, 0]
    refunded = [record.refunded for _, record in (view.history[-1] for view in views)]
    assert refunded == [False, True, True]


async def test_at_shutdown_deliveries_never_written_are_refunded_and_never_written(broker: Broker) -> None:
    """The broker ends its streams while one write is under way and more deliveries wait behind it (a
    client that stopped reading): the waiting ones are released unseen (refunded, so ``max_attempts:
    1`` dead-letters nothing), and the HTTP task gets the error next, not them."""
    registry = broker.registry
    await registry.create("jobs", {"max_attempts": 1}).wait()
    actor = registry.get("jobs")
    client_stream = Stream("w", 4, None)
    await actor.request(OpenStream(client_stream))
    first = [ref[0] for ref in await actor.request(_publish("a", "b"))]
    in_the_write = client_stream.receive_nowait()  # taken by the HTTP task: the write under way
    assert in_the_write is not None and not isinstance(in_the_write, Exception)
    client_stream.sending(len(in_the_write))
    waiting = [ref[0] for ref in await actor.request(_publish("c", "d"))]
    registry.end_streams()
    await actor.request(_get(first[0]))  # the actor has handled the end
    item = client_stream.receive_nowait()
    assert isinstance(item, BrokerError) and item.code == "shutting_down"
    views = [await actor.request(_get(message_id)) for message_id in first + waiting]
    assert [view.state.value for view in views] == ["dead_lettered"] * 2 + ["ready"] * 2
    assert [view.attempt for view in views[2:]] == [0, 0]


async def test_big_deliveries_go_out_in_writes_of_their_own_and_those_never_begun_are_refunded(
    broker: Broker,
) -> None:
    """Past ``CHUNK`` bytes the pump writes a delivery at a time: the client leaving during the second
    write costs the first two an attempt (written, and in the write), not the third (never begun)."""
    registry = broker.registry
    await registry.create("jobs", {}).wait()
    actor = registry.get("jobs")
    client_stream = Stream("w", 3, None)
    await actor.request(OpenStream(client_stream))
    ids = [ref[0] for ref in await actor.request(_publish(*("x" * CHUNK,) * 3))]
    writes: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        writes.append(message["body"])
        if len(writes) == 2:
            await trio.sleep_forever()  # a client that stopped reading

    async def resume() -> None:
        raise AssertionError("nothing stalled")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_pump, client_stream, send, ClientLink(), 60.0, resume)
        await trio.testing.wait_all_tasks_blocked()
        assert [write.count(b"event: message") for write in writes] == [1, 1]
        nursery.cancel_scope.cancel()  # the client left
    await actor.request(CloseStream(client_stream, client_stream.close_nowait()))
    views = [await actor.request(_get(message_id)) for message_id in ids]
    assert [view.attempt for view in views] == [1, 1, 0]


async def test_once_a_write_failed_the_pump_counts_nothing_more_as_sent(broker: Broker) -> None:
    """Hypercorn's ``send`` returns as usual once the client is gone (and at once from then on, without
    a checkpoint for the disconnect to land): the pump stops at the write that failed, so the
    deliveries behind it are refunded as never begun rather than charged an attempt each."""
    registry = broker.registry
    await registry.create("jobs", {"max_attempts": 1}).wait()
    actor = registry.get("jobs")
    client_stream = Stream("w", 4, None)
    await actor.request(OpenStream(client_stream))
    ids = [ref[0] for ref in await actor.request(_publish(*("x" * CHUNK,) * 4))]
    link = ClientLink()
    writes: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        writes.append(message["body"])
        if len(writes) == 2:
            link.lost = True  # the connection was reset during this write: it returns all the same

    async def resume() -> None:
        raise AssertionError("nothing stalled")

    with trio.fail_after(5):
        await _pump(client_stream, send, link, 60.0, resume)  # returns: nothing more can be written
    assert [write.count(b"event: message") for write in writes] == [1, 1]
    await actor.request(CloseStream(client_stream, client_stream.close_nowait()))
    views = [await actor.request(_get(message_id)) for message_id in ids]
    assert [(view.attempt, view.state) for view in views] == [
        (1, "dead_lettered"),
        (1, "dead_lettered"),
        (0, "ready"),
        (0, "ready"),
    ]


def _publish(*payloads: str) -> Any:
    from broker.core import NewMessage
    from broker.core.commands import Publish

    return Publish([NewMessage(orjson.dumps(p), False, None, None, 0.0, 0, False) for p in payloads])


def _get(message_id: str) -> Any:
    from broker.core.commands import GetMessage

    return GetMessage(message_id)


# -- a client that stops reading -------------------------------------------------------------------


async def claim(client: Client, **fields: Any) -> list[dict[str, Any]]:
    response = await client.post("/v1/queues/jobs/claim", json={"consumer": "poller", **fields})
    assert response.status_code == 200, await response.get_data()
    messages: list[dict[str, Any]] = (await response.get_json())["messages"]
    return messages


async def test_a_stream_whose_client_stops_reading_takes_no_more_messages(
    autojump_clock: Any, client: Client
) -> None:
    """The auditor's case: the stream's write waits on a client that does not read while its leases
    expire. It is not given the messages again (spending attempts nobody saw) and buffers nothing more;
    they stay with the queue for other consumers."""
    await make_queue(client, max_attempts=3)
    async with work(client, consumer="stuck", max=2, lease=1) as stream:
        await assert_open(stream)
        await trio.testing.wait_all_tasks_blocked()
        stream.stall()
        ids = await publish(client, *range(6))
        await trio.sleep(10)  # ten lease periods
        queue_stats = await stats(client)
        assert (queue_stats["lease_expired_total"], queue_stats["dead_lettered_total"]) == (2, 0)
        assert (queue_stats["ready"], queue_stats["in_flight"]) == (6, 0)
        assert await history(client, ids[0]) == ["published", "claimed", "lease_expired"]
        assert await history(client, ids[2]) == ["published"], "never leased to the stuck stream"
        polled = await claim(client, max=10)
        assert [m["id"] for m in polled] == ids
        assert [m["attempt"] for m in polled] == [2, 2, 1, 1, 1, 1]
        stream.read_again()
        written = await stream.messages(2)  # the write under way was not taken back
        assert [(m["id"], m["attempt"]) for m in written] == [(ids[0], 1), (ids[1], 1)]
        await trio.testing.wait_all_tasks_blocked()
        resumed_at = trio.current_time()
        await publish(client, "fresh")
        [fresh] = await stream.messages(1)
        assert fresh["payload"] == "fresh", "once it is read again, the stream takes messages again"
        assert trio.current_time() == resumed_at


async def test_deliveries_whose_lease_expired_before_they_were_written_are_dropped(
    autojump_clock: Any, client: Client
) -> None:
    """The write under way may have reached the client: its lease expires, spending the attempt. The
    deliveries queued behind it cannot have: they are released with their attempt refunded, so a client
    that stops reading cannot dead-letter a message it never got (here ``max_attempts`` is 1)."""
    await make_queue(client, max_attempts=1)
    async with work(client, consumer="slow", max=3, lease=5) as stream:
        await assert_open(stream)
        await trio.testing.wait_all_tasks_blocked()
        stream.stall()
        [first] = await publish(client, "first")  # its write waits on the client
        await trio.testing.wait_all_tasks_blocked()
        queued = await publish(client, "second", "third")  # queued behind that write
        await trio.sleep(6)
        queue_stats = await stats(client)
        assert (queue_stats["lease_expired_total"], queue_stats["dead_lettered_total"]) == (1, 1)
        assert await history(client, first) == ["published", "claimed", "lease_expired", "dead_lettered"]
        assert await history(client, queued[0]) == ["published", "claimed", "released"]
        polled = await claim(client, max=10)
        assert [(m["id"], m["attempt"]) for m in polled] == [(queued[0], 1), (queued[1], 1)]
        stream.read_again()
        [written] = await stream.messages(1)
        assert written["id"] == first
        await publish(client, "fresh")
        [fresh] = await stream.messages(1)
        assert fresh["payload"] == "fresh", "second and third were never written: their leases were stale"
        queue_stats = await stats(client)
        assert (queue_stats["in_flight"], queue_stats["lease_expired_total"]) == (3, 1)


async def test_a_stalled_stream_waiting_in_line_does_not_keep_messages_from_pollers(
    autojump_clock: Any, client: Client
) -> None:
    """A stream with free slots waits in line ahead of a long poll. When the claim made for it finds its
    own unwritten delivery expired, that message is not given to it again: the poller behind gets it."""
    await make_queue(client)
    async with work(client, consumer="stuck", max=5, lease=2) as stream:
        await assert_open(stream)
        await trio.testing.wait_all_tasks_blocked()
        stream.stall()
        [stuck] = await publish(client, "stuck")
        await trio.testing.wait_all_tasks_blocked()
        polled: list[dict[str, Any]] = []
        async with trio.open_nursery() as nursery:

            async def poll() -> None:
                polled.extend(await claim(client, max=5, wait=30))

            nursery.start_soon(poll)
            await trio.testing.wait_all_tasks_blocked()
            start = trio.current_time()
        assert trio.current_time() - start == pytest.approx(2), "served when the lease expired"
        assert [(m["id"], m["attempt"]) for m in polled] == [(stuck, 2)]
        assert await history(client, stuck) == [
            "published",
            "claimed",
            "lease_expired",
            "claimed",
            "released",
            "claimed",
        ], "taken for the stream in the same claim that noticed the expiry, and given back unseen"
        await publish(client, "next")
        polled = await claim(client)
        assert [m["payload"] for m in polled] == ["next"], "the stalled stream takes nothing"


async def test_in_a_claim_window_a_message_a_stalled_stream_gives_back_goes_to_the_cohort_at_once(
    autojump_clock: Any, client: Client
) -> None:
    """With a claim window the waiting line is served as one cohort: the stalled stream's share of it
    (here all of it: it asks for far more) is given back, and the cohort is served again at once."""
    await make_queue(client, claim_window=1)
    async with work(client, consumer="stuck", max=50, lease=5) as stream:
        await assert_open(stream)
        await trio.testing.wait_all_tasks_blocked()
        stream.stall()
        opened_at = trio.current_time()
        [stuck] = await publish(client, "stuck")  # the stream gets it when the window closes
        await trio.sleep(2)
        polled: list[dict[str, Any]] = []
        async with trio.open_nursery() as nursery:

            async def poll() -> None:
                polled.extend(await claim(client, max=1, wait=30))

            nursery.start_soon(poll)
        assert trio.current_time() - opened_at == pytest.approx(6), "when the stream's lease expired"
        assert [(m["id"], m["attempt"]) for m in polled] == [(stuck, 2)]


async def test_a_stream_never_buffers_more_than_max_deliveries(autojump_clock: Any, broker: Broker) -> None:
    """The actor's side, without HTTP: deliveries handed to a stream whose HTTP task never takes them
    hold their slots after their leases run out, so nothing more is handed over; and since their client
    never had them, they go back with their attempt refunded."""
    registry = broker.registry
    await registry.create("jobs", {}).wait()
    actor = registry.get("jobs")
    client_stream = Stream("w", 2, 1.0)
    await actor.request(OpenStream(client_stream))
    await actor.request(_publish("a", "b", "c", "d"))
    await trio.sleep(10)
    buffered = client_stream.receive_nowait()
    assert buffered is not None and not isinstance(buffered, Exception | Stopped) and len(buffered) == 2
    assert client_stream.receive_nowait() is None
    assert (client_stream.free, client_stream.held) == (0, {})
    assert client_stream.current(buffered) == [], "both stale"
    assert client_stream.written_nowait(), "caught up: the stream takes messages again"
    await actor.request(ResumeStream(client_stream))
    refilled = client_stream.receive_nowait()
    assert refilled is not None and not isinstance(refilled, Exception | Stopped)
    assert [(message.payload, message.attempt) for _, message in refilled] == [(b'"a"', 1), (b'"b"', 1)]
    await actor.request(CloseStream(client_stream, client_stream.close_nowait()))


# -- heartbeats ------------------------------------------------------------------------------------


async def test_an_idle_stream_gets_a_heartbeat_every_14_seconds(autojump_clock: Any, client: Client) -> None:
    """§7 promises at least one every 15 s: 14 leaves room for the write to follow its timer."""
    await make_queue(client)
    async with work(client) as stream:
        await assert_open(stream)
        opened_at = trio.current_time()
        for beat in range(1, 4):
            assert await stream.next() == Comment("heartbeat")
            assert trio.current_time() - opened_at == pytest.approx(14 * beat)


async def test_the_heartbeat_interval_is_a_setting_and_counts_from_the_last_write(
    autojump_clock: Any, broker: Broker, client: Client
) -> None:
    broker.app.config[HEARTBEAT_CONFIG] = 2.0
    await make_queue(client)
    async with work(client, max=5) as stream:
        await assert_open(stream)
        await trio.sleep(1.5)
        await publish(client, "x")
        await stream.messages(1)
        sent_at = trio.current_time()
        assert await stream.next() == Comment("heartbeat")
        assert trio.current_time() - sent_at == pytest.approx(2)


# -- fairness and rate limits -----------------------------------------------------------------------


async def test_streams_and_pollers_share_a_claim_windows_cohort(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, claim_window=1)
    async with work(client, consumer="stream", max=10) as stream:
        await assert_open(stream)
        async with trio.open_nursery() as nursery:
            answers: list[Any] = []

            async def poll() -> None:
                response = await client.post(
                    "/v1/queues/jobs/claim", json={"consumer": "poller", "max": 10, "wait": 10}
                )
                answers.append(await response.get_json())

            nursery.start_soon(poll)
            await trio.testing.wait_all_tasks_blocked()
            await publish(client, *range(10))
        pushed = await stream.messages(5)
    [polled] = answers
    assert len(polled["messages"]) == 5, "ten ready, two members asking for ten each: five each"
    payloads = sorted([m["payload"] for m in pushed] + [m["payload"] for m in polled["messages"]])
    assert payloads == list(range(10))


async def test_two_streams_in_a_claim_window_divide_a_batch_evenly(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, claim_window="200ms")
    async with work(client, consumer="a", max=100) as first, work(client, consumer="b", max=100) as second:
        await assert_open(first)
        await assert_open(second)
        await trio.testing.wait_all_tasks_blocked()
        await publish(client, *range(50))
        one = await first.messages(25)
        two = await second.messages(25)
    assert sorted(m["payload"] for m in one + two) == list(range(50))


async def test_without_a_window_streams_and_pollers_are_served_in_arrival_order(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    answers: list[Any] = []
    async with trio.open_nursery() as nursery:

        async def poll() -> None:
            response = await client.post("/v1/queues/jobs/claim", json={"max": 2, "wait": 10})
            answers.append(await response.get_json())

        nursery.start_soon(poll)  # waits first
        await trio.testing.wait_all_tasks_blocked()
        async with work(client, max=5) as stream:
            await assert_open(stream)
            await trio.testing.wait_all_tasks_blocked()
            await publish(client, *range(4))
            pushed = await stream.messages(2)
    assert [m["payload"] for m in answers[0]["messages"]] == [0, 1]
    assert [m["payload"] for m in pushed] == [2, 3]


async def test_a_stream_is_held_to_the_rate_limit(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, rate_limit={"max": 2, "per": 10})
    await publish(client, *range(5))
    async with work(client, max=10) as stream:
        await assert_open(stream)
        start = trio.current_time()
        assert [m["payload"] for m in await stream.messages(2)] == [0, 1]
        assert [m["payload"] for m in await stream.messages(2)] == [2, 3]
        assert trio.current_time() - start == pytest.approx(10)


# -- ends and errors -------------------------------------------------------------------------------


async def test_deleting_the_queue_ends_its_streams_with_an_error_event(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    async with work(client) as stream:
        await assert_open(stream)
        assert (await client.delete("/v1/queues/jobs")).status_code == 204
        event = await stream.next_event()
        assert event.event == "error"
        assert orjson.loads(event.data)["code"] == "queue_not_found"
        await stream.end()


async def test_shutdown_ends_streams_with_an_error_event_and_releases_their_leases(
    autojump_clock: Any, broker: Broker, client: Client
) -> None:
    await make_queue(client)
    await publish(client, "held")
    async with work(client) as stream:
        await assert_open(stream)
        await stream.messages(1)
        broker.registry.end_streams()
        event = await stream.next_event()
        assert (event.event, orjson.loads(event.data)["code"]) == ("error", "shutting_down")
        await stream.end()
    queue_stats = await stats(client)
    assert (queue_stats["ready"], queue_stats["in_flight"]) == (1, 0)
    late = await client.get("/v1/queues/jobs/work", headers=EVENT_STREAM)
    assert late.status_code == 503
    assert (await late.get_json())["error"]["code"] == "shutting_down"


async def test_without_accept_event_stream_it_is_406(client: Client) -> None:
    await make_queue(client)
    refusing = ("text/event-stream;q=0", "application/json, text/event-stream; q=0.0")
    for accept in ({}, {"Accept": "application/json"}, {"Accept": "*/*"}, *({"Accept": a} for a in refusing)):
        response = await client.get("/v1/queues/jobs/work", headers=accept)
        assert response.status_code == 406
        assert (await response.get_json())["error"]["code"] == "not_acceptable"
    assert (await stats(client))["in_flight"] == 0


async def test_a_head_request_is_405_and_leases_nothing(client: Client) -> None:
    """It was a 406 asking for the Accept the request had sent."""
    await make_queue(client)
    await client.post("/v1/queues/jobs/messages", json={"payload": 1})
    response = await client.head("/v1/queues/jobs/work", headers=EVENT_STREAM)
    assert response.status_code == 405 and response.headers["Allow"] == "GET"
    assert (await stats(client))["in_flight"] == 0


async def test_a_refused_stream_answers_cbor_when_asked_like_every_other_route(client: Client) -> None:
    """Its errors were always JSON, where every other native route honours Accept."""
    response = await client.get(
        "/v1/queues/ghost/work", headers={"Accept": "text/event-stream, application/cbor"}
    )
    assert response.status_code == 404 and response.content_type == "application/cbor"
    assert cbor2.loads(await response.get_data())["error"]["code"] == "queue_not_found"


async def test_an_unknown_queue_is_404(client: Client) -> None:
    response = await client.get("/v1/queues/ghost/work", headers=EVENT_STREAM)
    assert response.status_code == 404
    assert (await response.get_json())["error"]["code"] == "queue_not_found"


@pytest.mark.parametrize(
    "query",
    [
        "max=0",
        "max=1001",
        "max=many",
        "lease=0",
        "lease=forever",
        "lease=50000",
        "wait=5",
        "consumer=",
        "consumer=" + "x" * 257,
        "max=1&max=2",  # which one? neither
        "max=%D9%A3",  # an Arabic-Indic 3: int() took it
        "max=1_0",
        "max=%202",
        "max=" + "9" * 5000,  # past int()'s 4300 digits: it raised, a 500
    ],
)
async def test_bad_parameters_are_400(client: Client, query: str) -> None:
    await make_queue(client)
    response = await client.get(f"/v1/queues/jobs/work?{query}", headers=EVENT_STREAM)
    assert response.status_code == 400
    assert (await response.get_json())["error"]["code"] == "invalid_request"


async def test_a_bad_queue_name_is_400(client: Client) -> None:
    response = await client.get("/v1/queues/-bad/work", headers=EVENT_STREAM)
    assert response.status_code == 400


async def test_other_methods_are_405(client: Client) -> None:
    await make_queue(client)
    response = await client.post("/v1/queues/jobs/work", json={})
    assert response.status_code == 405
    assert "GET" in response.headers["Allow"]


async def test_a_stream_accepts_durations_with_units(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    await publish(client, "x")
    async with work(client, lease="2m", consumer="units") as stream:
        await assert_open(stream)
        [delivery] = await stream.messages(1)
    body = await (await client.get(f"/v1/queues/jobs/messages/{delivery['id']}")).get_json()
    claimed = next(entry for entry in body["history"] if entry["event"] == "claimed")
    assert claimed["lease_deadline"] == delivery["lease_deadline"]
    assert claimed["consumer"] == "units"


# -- stopping a stream (POST …/work/{stream_id}/stop) ------------------------------------------------


async def stop(client: Client, stream_id: str, queue: str = "jobs", **kw: Any) -> Any:
    return await client.post(f"/v1/queues/{queue}/work/{stream_id}/stop", **kw)


async def test_a_stream_names_itself_in_a_stream_id_header(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    async with work(client) as first, work(client) as second:
        await assert_open(first)
        await assert_open(second)
        ids = {first.headers["stream-id"], second.headers["stream-id"]}
    assert len(ids) == 2 and all(ids), "one id per stream"


async def test_a_stream_shows_the_time_its_lease_deadlines_are_measured_by(
    autojump_clock: Any, client: Client
) -> None:
    """A worker whose clock disagrees with the broker's reads the broker's time here (docs/workers.md)."""
    await make_queue(client, lease=30)
    async with work(client) as stream:
        await assert_open(stream)
        opened_at = parse_time(stream.headers["broker-time"])
        await trio.sleep(5)
        await publish(client, "x")
        [delivery] = await stream.messages(1)
    assert parse_time(delivery["lease_deadline"]) - opened_at == pytest.approx(35, abs=0.002)


async def test_a_stopped_stream_gets_no_refills_and_keeps_its_leases_until_settled(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    await publish(client, *range(5))
    async with work(client, max=2, lease=600) as stream:
        await assert_open(stream)
        one, two = await stream.messages(2)
        stream_id = stream.headers["stream-id"]
        answer = await stop(client, stream_id)
        assert answer.status_code == 200
        assert await answer.get_json() == {"stream": stream_id, "held": 2}
        event = await stream.next_event()
        assert (event.event, orjson.loads(event.data)) == ("stopped", {"stream": stream_id, "held": 2})
        await settle(client, "ack", [one["lease_id"]])
        await publish(client, "late")
        for _ in range(4):  # a minute: heartbeats, no refill of the acked one's slot, no new message
            assert await stream.next() == Comment("heartbeat")
        queue_stats = await stats(client)
        assert (queue_stats["ready"], queue_stats["in_flight"]) == (4, 1), "the other lease is still held"
        again = await stop(client, stream_id)  # idempotent
        assert (again.status_code, await again.get_json()) == (200, {"stream": stream_id, "held": 1})
        await settle(client, "extend", [two["lease_id"]], lease=60)  # still the stream's, still settles
    queue_stats = await stats(client)
    assert (queue_stats["ready"], queue_stats["in_flight"]) == (5, 0), "the close released what was left"
    assert (await history(client, two["id"]))[-1] == "released"


async def test_a_stopped_stream_leaves_the_line_to_the_others(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    async with work(client, consumer="stopped", max=5) as first:
        await assert_open(first)
        await trio.testing.wait_all_tasks_blocked()  # lined up first, waiting for messages
        assert (await stop(client, first.headers["stream-id"])).status_code == 200
        assert (await first.next_event()).event == "stopped"
        async with work(client, consumer="second", max=5) as second:
            await assert_open(second)
            await trio.testing.wait_all_tasks_blocked()
            await publish(client, 1, 2)
            with trio.fail_after(60):
                assert [m["payload"] for m in await second.messages(2)] == [1, 2]


async def test_stopping_an_unknown_or_closed_stream_is_404(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    answer = await stop(client, "no-such-stream")
    assert answer.status_code == 404
    body = await answer.get_json()
    assert body["error"]["code"] == "not_found" and body["error"]["message"]
    async with work(client) as stream:
        await assert_open(stream)
        stream_id = stream.headers["stream-id"]
    assert (await stop(client, stream_id)).status_code == 404, "closed"
    await make_queue(client, "other")
    async with work(client) as stream:
        await assert_open(stream)
        assert (await stop(client, stream.headers["stream-id"], queue="other")).status_code == 404
    assert (await stop(client, "x", queue="ghost")).status_code == 404


async def test_the_stop_call_takes_no_body_or_an_empty_object(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    async with work(client) as stream:
        await assert_open(stream)
        stream_id = stream.headers["stream-id"]
        assert (await stop(client, stream_id)).status_code == 200
        assert (await stop(client, stream_id, json={})).status_code == 200
        for body in ({"leases": []}, [1]):
            answer = await stop(client, stream_id, json=body)
            assert answer.status_code == 400
            assert (await answer.get_json())["error"]["code"] == "invalid_request"
    assert (await client.get("/v1/queues/jobs/work/x/stop")).status_code == 405


async def test_the_stop_marker_comes_after_every_delivery_pushed_before_it(broker: Broker) -> None:
    """The actor's side: deliveries handed to the stream before the stop come out before its marker,
    and nothing comes after it."""
    registry = broker.registry
    await registry.create("jobs", {}).wait()
    actor = registry.get("jobs")
    client_stream = Stream("w", 3, None)
    await actor.request(OpenStream(client_stream))
    await actor.request(_publish("a", "b"))
    assert await actor.request(StopStream(client_stream.id)) == 2
    await actor.request(_publish("c"))
    pushed = client_stream.receive_nowait()
    assert pushed is not None and not isinstance(pushed, Exception | Stopped) and len(pushed) == 2
    assert client_stream.receive_nowait() == Stopped(2)
    assert client_stream.receive_nowait() is None
    assert await actor.request(StopStream(client_stream.id)) == 2, "idempotent, and no second marker"
    assert client_stream.receive_nowait() is None
    await actor.request(CloseStream(client_stream, client_stream.close_nowait()))
    with pytest.raises(NotFound):
        await actor.request(StopStream(client_stream.id))


# -- the stream and polling claimers under one rate limit; no response timeout ------------------------


async def test_a_stream_and_a_poller_share_one_rate_limit(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, rate_limit={"max": 2, "per": 10})
    await publish(client, *range(10))
    polled = await (await client.post("/v1/queues/jobs/claim", json={"max": 1})).get_json()
    assert len(polled["messages"]) == 1
    async with work(client, max=10) as stream:
        await assert_open(stream)
        start = trio.current_time()
        assert len(await stream.messages(1)) == 1, "one delivery left in the window"
        polled = await (await client.post("/v1/queues/jobs/claim", json={"max": 5})).get_json()
        assert polled["messages"] == [], "the window is spent for pollers too"
        await trio.sleep(9)
        queue_stats = await stats(client)
        assert (queue_stats["in_flight"], queue_stats["ready"]) == (2, 8), "two deliveries in the window"
        assert len(await stream.messages(2)) == 2, "the next window"
        assert trio.current_time() - start == pytest.approx(10)
        assert (await stats(client))["in_flight"] == 4


async def test_a_stream_has_no_response_timeout(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    async with work(client, max=1) as stream:
        await assert_open(stream)
        opened_at = trio.current_time()
        while trio.current_time() - opened_at <= 150:  # well past Quart's 60 s and any 120 s limit
            assert await stream.next() == Comment("heartbeat")
        await publish(client, "still there")
        [delivery] = await stream.messages(1)
        assert delivery["payload"] == "still there"


@pytest.mark.parametrize(
    ("accept", "named"),
    [
        ("text/event-stream", True),
        ("Text/Event-Stream; charset=utf-8", True),
        ("application/json, text/event-stream;q=0.5", True),
        ("text/event-stream;q=0", False),
        ("text/event-stream;q=nope", False),
        ("text/event-streams", False),
        ("*/*", False),
    ],
)
def test_an_accept_header_names_the_event_stream_only_with_a_quality_above_0(
    accept: str, named: bool
) -> None:
    assert parse.names_media(accept, "text/event-stream") is named
