"""``broker.client``: every call of the blocking and the async client against a real broker, typed errors,
and the SSE parser."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from broker.client import (
    AsyncClient,
    BrokerError,
    Client,
    Conflict,
    InvalidRequest,
    Message,
    MessageNotFound,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    QueueNotFound,
    ShuttingDown,
    StorageUnavailable,
)
from broker.client.errors import ERRORS_BY_CODE, error_from
from broker.client.sse import Comment, Event, EventParser
from broker.errors import BrokerError as ServerError


def test_queues(thread_url: str) -> None:
    with Client(thread_url) as broker:
        created = broker.create_queue("jobs", lease=12, max_attempts=3)
        assert created["config"]["lease"] == 12
        assert broker.update_queue("jobs", lease=20)["config"]["lease"] == 20
        assert broker.get_queue("jobs")["config"]["max_attempts"] == 3
        assert [queue["name"] for queue in broker.list_queues()] == ["jobs"]
        broker.publish("jobs", 1)
        broker.publish("jobs", 2, delay=60)
        assert (broker.stats("jobs")["ready"], broker.stats("jobs")["delayed"]) == (1, 1)
        assert broker.purge("jobs") == 2
        broker.delete_queue("jobs")
        assert broker.list_queues() == []


def test_publish_single_and_batch(thread_url: str) -> None:
    with Client(thread_url) as broker:
        broker.create_queue("jobs")
        first = broker.publish("jobs", {"to": "ada"}, headers={"h": "1"}, key="k1", priority=5)
        assert (first.seq, first.duplicate) == (1, False)
        again = broker.publish("jobs", {"to": "someone else"}, key="k1")
        assert (again.id, again.duplicate) == (first.id, True)
        batch = broker.publish_batch(
            "jobs",
            [Message(b"\x00\xffbytes"), {"payload": "later", "delay": "5m"}, Message("low", priority=-1)],
        )
        assert [ref.seq for ref in batch] == [2, 3, 4]
        claimed = broker.claim("jobs", max=10)
        assert [d.payload for d in claimed] == [{"to": "ada"}, b"\x00\xffbytes", "low"], "priority, then seq"
        assert claimed.messages[0].headers == {"h": "1"}
        assert claimed.messages[0].key == "k1"
        assert claimed.ready == 0


def test_a_batch_of_plain_payload_dicts_sends_bytes_as_base64_and_leaves_the_dicts_alone(
    thread_url: str,
) -> None:
    with Client(thread_url) as broker:
        broker.create_queue("jobs")
        batch = [{"payload": b"\x00raw"}, {"payload": "text"}, {"payload": {"n": 1}}]
        sent = [dict(message) for message in batch]
        assert len(broker.publish_batch("jobs", batch)) == 3
        assert batch == sent
        claimed = broker.claim("jobs", max=3)
        assert [d.payload for d in claimed] == [b"\x00raw", "text", {"n": 1}]


def test_claim_and_settle(thread_url: str) -> None:
    with Client(thread_url) as broker:
        broker.create_queue("jobs", retry_backoff={"type": "fixed", "base": 0})
        broker.publish_batch("jobs", [Message(n) for n in range(4)])
        a, b, c, d = broker.claim("jobs", consumer="me", max=4, lease=30)
        assert a.attempt == 1 and a.lease_deadline.endswith("Z")
        assert broker.ack("jobs", a).count == 1
        assert broker.ack("jobs", [a.lease_id]).skipped == [a.lease_id], "settling is idempotent"
        nacked = broker.nack("jobs", b, delay=0, reason="flaky")
        assert (nacked.count, nacked.dead_lettered) == (1, 0)
        assert broker.defer("jobs", [c], retry_after=60, reason="busy").count == 1
        extended = broker.extend("jobs", d, lease=120)
        assert extended.count == 1 and extended.deadlines is not None and d.lease_id in extended.deadlines
        [again] = broker.claim("jobs", max=5)
        assert (again.id, again.attempt) == (b.id, 2)
        rejected = broker.nack("jobs", again, retryable=False)
        assert rejected.dead_lettered == 1
        assert broker.claim("jobs", wait=0.2).messages == []


def test_inspection_and_redrive(thread_url: str) -> None:
    with Client(thread_url) as broker:
        broker.create_queue("jobs", max_attempts=1)
        ref = broker.publish("jobs", "poison")
        other = broker.publish("jobs", "fine")
        assert [m["id"] for m in broker.browse("jobs", state="ready")] == [ref.id, other.id]
        assert broker.browse("jobs", after=ref.seq, limit=1)[0]["id"] == other.id
        [delivery] = broker.claim("jobs")
        broker.nack("jobs", delivery)
        assert broker.get_message("jobs", ref.id)["state"] == "dead_lettered"
        [dead] = broker.browse("jobs.dlq")
        assert dead["headers"]["x-dead-letter-reason"] == "max_attempts"
        assert broker.redrive("jobs.dlq")["redriven"] == 1
        assert broker.redrive("jobs.dlq", [dead["id"]], to="jobs")["unknown"] == [dead["id"]]
        broker.delete_message("jobs", other.id)
        with pytest.raises(MessageNotFound):
            broker.get_message("jobs", other.id + "-nope")
        assert [m["payload"] for m in broker.browse("jobs")] == ["poison"]


def test_errors_are_typed_and_carry_the_contract_code(thread_url: str) -> None:
    with Client(thread_url) as broker:
        with pytest.raises(QueueNotFound) as missing:
            broker.publish("ghost", 1)
        assert (missing.value.code, missing.value.status) == ("queue_not_found", 404)
        assert isinstance(missing.value, NotFound) and isinstance(missing.value, BrokerError)
        assert "ghost" in missing.value.message
        broker.create_queue("jobs", max_depth=1)
        with pytest.raises(InvalidRequest) as bad:
            broker.claim("jobs", lease=0)
        assert bad.value.code == "invalid_request" and "lease" in bad.value.message
        with pytest.raises(InvalidRequest):
            broker.create_queue("bad name!")
        broker.publish("jobs", "one", key="k")
        with pytest.raises(QueueFull):
            broker.publish("jobs", "two")
        broker.claim("jobs")
        with pytest.raises(Conflict):
            broker.publish("jobs", "new", key="k", on_duplicate="replace")
        with pytest.raises(PayloadTooLarge):
            broker.publish("jobs", "x" * (1024 * 1024 + 1))


def test_every_contract_code_has_a_class() -> None:
    codes = {cls.code for cls in ServerError.__subclasses__() if cls.code != "internal_error"}
    codes |= {"queue_not_found", "message_not_found"}
    assert codes <= set(ERRORS_BY_CODE)
    assert (
        type(error_from(503, {"error": {"code": "storage_unavailable", "message": "m"}}))
        is StorageUnavailable
    )
    assert type(error_from(503, {"error": {"code": "shutting_down", "message": "m"}})) is ShuttingDown
    unknown = error_from(418, {"error": {"code": "teapot", "message": "short and stout"}})
    assert (type(unknown), unknown.code, unknown.status) == (BrokerError, "teapot", 418)
    assert type(error_from(404, None)) is NotFound


def test_the_async_client_under_asyncio(thread_url: str) -> None:
    async def main() -> list[Any]:
        async with AsyncClient(thread_url) as broker:
            await broker.create_queue("jobs")
            await broker.publish("jobs", "a")
            await broker.publish_batch("jobs", [Message("b"), Message("c")])
            claimed = await broker.claim("jobs", max=3, wait=1)
            await broker.ack("jobs", claimed.messages[:1])
            await broker.nack("jobs", claimed.messages[1], delay=60)
            await broker.defer("jobs", claimed.messages[2], 60)
            with pytest.raises(QueueNotFound):
                await broker.get_queue("ghost")
            stats = await broker.stats("jobs")
            return [len(claimed), stats["acked_total"], stats["delayed"]]

    assert asyncio.run(main()) == [3, 1, 2]


async def test_the_async_client_under_trio(live_url: str) -> None:
    async with AsyncClient(live_url) as broker:
        await broker.create_queue("jobs")
        await broker.publish("jobs", {"n": 1})
        [delivery] = await broker.claim("jobs", wait=1)
        assert (await broker.extend("jobs", delivery, 60)).count == 1
        assert (await broker.ack("jobs", delivery)).count == 1
        assert (await broker.get_message("jobs", delivery.id))["state"] == "acked"
        assert [q["name"] for q in await broker.list_queues()] == ["jobs"]
        assert await broker.browse("jobs") == []
        assert await broker.purge("jobs") == 0
        await broker.delete_queue("jobs")
        with pytest.raises(QueueNotFound):
            await broker.delete_queue("jobs")


# -- the SSE parser --------------------------------------------------------------------------------


def test_sse_events_split_anywhere_across_chunks() -> None:
    text = b': stream open\n\nevent: message\nid: 7\ndata: {"a":\ndata: 1}\n\nretry: 500\ndata: x\n\n'
    for size in (1, 2, 5, len(text)):
        parser = EventParser()
        out = []
        for start in range(0, len(text), size):
            out.extend(parser.feed(text[start : start + size]))
        assert out == [
            Comment("stream open"),
            Event("message", '{"a":\n1}', "7"),
            Event("message", "x", None, 500),
        ]
        assert parser.last_event_id == "7"


@pytest.mark.parametrize(
    ("block", "expected", "last_id"),
    [
        # the broker's own layout, and near misses that the general reading must get right
        (b"event: message\nid: 7\ndata: {}", [Event("message", "{}", "7")], "7"),
        (b"event: message\nid: 7\ndata: a\ndata: b", [Event("message", "a\nb", "7")], "7"),
        (b"event: message\nid: 7\ndata: a\nretry: 5", [Event("message", "a", "7", 5)], "7"),
        (b"event: message\nid: 7\n: note\ndata: a", [Comment("note"), Event("message", "a", "7")], "7"),
        (b"event: message\nid: 7", [], "7"),  # no data: nothing to dispatch, but the id counts
        (b"event: message\nid: 7\x00\ndata: a", [Event("message", "a")], None),
        (b"event: message\nid: \ndata: a", [Event("message", "a", "")], ""),
        (b"event: message\nid: 7\ndata:a", [Event("message", "a", "7")], "7"),
    ],
)
def test_sse_blocks_in_the_brokers_layout_read_as_the_general_rules_say(
    block: bytes, expected: list[Event | Comment], last_id: str | None
) -> None:
    parser = EventParser()
    assert parser.feed(block + b"\n\n") == expected
    assert parser.last_event_id == last_id


def test_sse_accepts_every_line_ending() -> None:
    parser = EventParser()
    assert parser.feed(b"event: error\r\ndata: e\r") == []
    assert parser.feed(b"\n\r\n") == [Event("error", "e")]
    assert parser.feed(b"data:no space\r\rdata: y\n\n") == [
        Event("message", "no space"),
        Event("message", "y"),
    ]
    assert parser.feed(b"event: lonely\n\n") == [], "an event without data is not dispatched"
