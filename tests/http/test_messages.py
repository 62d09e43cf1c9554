"""§4, §5 and §6 over HTTP: publishing, claiming, settling, browsing, getting and deleting messages,
and the JSON/CBOR encodings of payloads."""

from __future__ import annotations

import base64
import re
from datetime import UTC, datetime
from typing import Any

import cbor2
import orjson
import pytest
import trio

from tests.conftest import Client, make_queue

TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
DELIVERY_FIELDS = {
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
}
VIEW_FIELDS = {
    "id",
    "seq",
    "state",
    "attempt",
    "payload",
    "headers",
    "key",
    "priority",
    "published_at",
    "available_at",
    "lease_id",
    "lease_deadline",
    "consumer",
}
CBOR_HEADERS = {"Content-Type": "application/cbor", "Accept": "application/cbor"}


def seconds(timestamp: str) -> float:
    """An RFC 3339 millisecond UTC timestamp as seconds since the epoch."""
    assert TIMESTAMP.match(timestamp), timestamp
    return datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


async def expect_error(response: Any, status: int, code: str) -> str:
    assert response.status_code == status, await response.get_data()
    body = await response.get_json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
    assert body["error"]["code"] == code
    message: str = body["error"]["message"]
    return message


async def post(client: Client, path: str, body: Any, status: int = 200) -> Any:
    response = await client.post(path, json=body)
    assert response.status_code == status, await response.get_data()
    return await response.get_json()


async def publish(client: Client, *messages: dict[str, Any], status: int = 201) -> list[dict[str, Any]]:
    body = await post(client, "/v1/queues/jobs/messages", {"messages": list(messages)}, status)
    refs: list[dict[str, Any]] = body["messages"]
    return refs


async def claim(client: Client, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = await post(client, "/v1/queues/jobs/claim", fields)
    return body


async def claim_one(client: Client, **fields: Any) -> dict[str, Any]:
    messages = (await claim(client, **fields))["messages"]
    assert len(messages) == 1, messages
    delivery: dict[str, Any] = messages[0]
    return delivery


async def stats(client: Client) -> dict[str, Any]:
    body = await (await client.get("/v1/queues/jobs")).get_json()
    result: dict[str, Any] = body["stats"]
    return result


async def get_message(client: Client, message_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/queues/jobs/messages/{message_id}")
    assert response.status_code == 200, await response.get_data()
    body: dict[str, Any] = await response.get_json()
    return body


async def browse(client: Client, query: str = "") -> list[dict[str, Any]]:
    response = await client.get(f"/v1/queues/jobs/messages{query}")
    assert response.status_code == 200, await response.get_data()
    messages: list[dict[str, Any]] = (await response.get_json())["messages"]
    return messages


# -- publishing (§4) ---------------------------------------------------------------------------------


async def test_publish_one_message(client: Client) -> None:
    await make_queue(client)
    body = await post(client, "/v1/queues/jobs/messages", {"payload": {"to": "ada"}}, 201)
    [ref] = body["messages"]
    assert set(body) == {"messages"}
    assert set(ref) == {"id", "seq", "duplicate"}
    assert isinstance(ref["id"], str) and ref["id"]
    assert (ref["seq"], ref["duplicate"]) == (1, False)
    assert (await stats(client))["ready"] == 1


async def test_publish_a_batch_answers_in_request_order(client: Client) -> None:
    await make_queue(client)
    refs = await publish(client, *({"payload": n} for n in range(5)))
    assert [r["seq"] for r in refs] == [1, 2, 3, 4, 5]
    assert [r["duplicate"] for r in refs] == [False] * 5
    assert len({r["id"] for r in refs}) == 5
    delivered = (await claim(client, max=5))["messages"]
    assert [(m["id"], m["seq"], m["payload"]) for m in delivered] == [
        (r["id"], r["seq"], n) for n, r in enumerate(refs)
    ]


async def test_ids_are_unique_across_queues(client: Client) -> None:
    await make_queue(client, "a")
    await make_queue(client, "b")
    a = await post(client, "/v1/queues/a/messages", {"payload": 1}, 201)
    b = await post(client, "/v1/queues/b/messages", {"payload": 1}, 201)
    assert a["messages"][0]["seq"] == b["messages"][0]["seq"] == 1
    assert a["messages"][0]["id"] != b["messages"][0]["id"]


async def test_a_duplicate_key_answers_the_existing_message_with_200(client: Client) -> None:
    await make_queue(client)
    [first] = await publish(client, {"payload": "original", "key": "order-17"})
    [again] = await publish(client, {"payload": "changed", "key": "order-17"}, status=200)
    assert again == {"id": first["id"], "seq": first["seq"], "duplicate": True}
    assert (await stats(client))["published_total"] == 1
    delivery = await claim_one(client)
    assert (delivery["payload"], delivery["key"]) == ("original", "order-17")


async def test_a_duplicate_key_is_still_answered_after_ack(client: Client) -> None:
    await make_queue(client)
    [first] = await publish(client, {"payload": 1, "key": "k"})
    delivery = await claim_one(client)
    await post(client, "/v1/queues/jobs/ack", {"leases": [delivery["lease_id"]]})
    [again] = await publish(client, {"payload": 1, "key": "k"}, status=200)
    assert again == {**first, "duplicate": True}
    assert (await claim(client))["messages"] == []


async def test_a_batch_with_some_duplicates_is_201_and_flags_each(client: Client) -> None:
    await make_queue(client)
    [old] = await publish(client, {"payload": "a", "key": "a"})
    refs = await publish(
        client,
        {"payload": "b", "key": "b"},
        {"payload": "a2", "key": "a"},
        {"payload": "none"},
        {"payload": "b2", "key": "b"},  # a duplicate of a message earlier in the same batch
    )
    assert [r["duplicate"] for r in refs] == [False, True, False, True]
    assert refs[1]["id"] == old["id"]
    assert refs[3]["id"] == refs[0]["id"]
    assert [r["seq"] for r in refs] == [2, 1, 3, 2]
    assert (await stats(client))["published_total"] == 3


async def test_publish_to_a_missing_queue_is_404_and_creates_nothing(client: Client) -> None:
    response = await client.post("/v1/queues/ghost/messages", json={"payload": 1})
    await expect_error(response, 404, "queue_not_found")
    assert await (await client.get("/v1/queues")).get_json() == {"queues": []}


@pytest.mark.parametrize(
    "payload",
    [
        None,
        0,
        -17,
        3.25,
        True,
        "",
        "ünïcødé ✓ \u2028",
        [],
        {},
        {"nested": [1, {"deep": [None, False, "x"]}], "n": 1e-7},
        [[[[[]]]]],
        2**63 - 1,
    ],
)
async def test_json_payloads_are_delivered_verbatim(client: Client, payload: Any) -> None:
    await make_queue(client)
    await publish(client, {"payload": payload})
    delivery = await claim_one(client)
    assert delivery["payload"] == payload
    assert "payload_encoding" not in delivery


async def test_a_big_integer_payload_is_delivered_verbatim(client: Client) -> None:
    await make_queue(client)
    response = await client.post(
        "/v1/queues/jobs/messages",
        data=b'{"payload": 123456789012345678901234567890}',
        headers={"Content-Type": "application/json"},
    )
    if response.status_code == 201:
        delivery = await claim_one(client)
        assert delivery["payload"] == 123456789012345678901234567890
    else:  # refusing it with a 400 would keep the promise too
        await expect_error(response, 400, "invalid_request")


async def test_headers_key_and_priority_are_delivered(client: Client) -> None:
    await make_queue(client)
    await publish(
        client, {"payload": 1, "headers": {"trace": "abc", "empty": ""}, "key": "k1", "priority": 7}
    )
    delivery = await claim_one(client)
    assert delivery["headers"] == {"trace": "abc", "empty": ""}
    assert (delivery["key"], delivery["priority"]) == ("k1", 7)


async def test_a_delayed_message_is_claimable_only_after_its_delay(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    await publish(client, {"payload": "later", "delay": "5m"})
    assert (await stats(client))["delayed"] == 1
    assert (await claim(client))["messages"] == []
    await trio.sleep(299)
    assert (await claim(client))["messages"] == []
    await trio.sleep(1)
    assert (await claim_one(client))["payload"] == "later"


# -- claiming (§5) --------------------------------------------------------------------------------


async def test_a_delivery_has_the_contract_fields(client: Client) -> None:
    await make_queue(client)
    [ref] = await publish(client, {"payload": {"to": "ada"}})
    body = await claim(client, consumer="worker-1")
    assert set(body) == {"messages", "ready"}
    [delivery] = body["messages"]
    assert set(delivery) == DELIVERY_FIELDS
    assert (delivery["id"], delivery["seq"]) == (ref["id"], ref["seq"])
    assert isinstance(delivery["lease_id"], str) and delivery["lease_id"]
    assert delivery["attempt"] == 1
    assert delivery["payload"] == {"to": "ada"}
    assert (delivery["headers"], delivery["key"], delivery["priority"]) == ({}, None, 0)
    assert TIMESTAMP.match(delivery["published_at"])
    assert TIMESTAMP.match(delivery["lease_deadline"])


async def test_claim_order_is_priority_then_seq(client: Client) -> None:
    await make_queue(client)
    await publish(
        client,
        {"payload": "low-1", "priority": -1},
        {"payload": "mid-1"},
        {"payload": "high-1", "priority": 5},
        {"payload": "mid-2"},
        {"payload": "high-2", "priority": 5},
        {"payload": "top", "priority": 100},
    )
    claimed = (await claim(client, max=10))["messages"]
    assert [m["payload"] for m in claimed] == ["top", "high-1", "high-2", "mid-1", "mid-2", "low-1"]


async def test_reclaimed_messages_come_before_higher_priority_fresh_ones(client: Client) -> None:
    await make_queue(client)
    await publish(client, {"payload": "first"})
    delivery = await claim_one(client)
    await publish(client, {"payload": "urgent", "priority": 10}, {"payload": "plain"})
    await post(client, "/v1/queues/jobs/nack", {"leases": [delivery["lease_id"]], "delay": 0})
    claimed = (await claim(client, max=3))["messages"]
    assert [(m["payload"], m["attempt"]) for m in claimed] == [("first", 2), ("urgent", 1), ("plain", 1)]


async def test_claim_takes_up_to_max_and_reports_ready(client: Client) -> None:
    await make_queue(client)
    await publish(client, *({"payload": n} for n in range(5)))
    first = await claim(client, max=2)
    assert [m["payload"] for m in first["messages"]] == [0, 1]
    assert first["ready"] == 3
    second = await claim(client, max=10)
    assert [m["payload"] for m in second["messages"]] == [2, 3, 4]
    assert second["ready"] == 0
    third = await claim(client, max=10)
    assert third == {"messages": [], "ready": 0}
    assert (await stats(client))["in_flight"] == 5


async def test_claim_defaults_to_one_message(client: Client) -> None:
    await make_queue(client)
    await publish(client, {"payload": 1}, {"payload": 2})
    body = await claim(client)
    assert len(body["messages"]) == 1
    assert body["ready"] == 1


async def test_claim_on_an_empty_queue_is_an_empty_answer(client: Client) -> None:
    await make_queue(client)
    assert await claim(client, consumer="w", max=1000) == {"messages": [], "ready": 0}


async def test_the_lease_defaults_to_the_queues_and_a_claim_may_override_it(client: Client) -> None:
    await make_queue(client, lease=45)
    refs = await publish(client, {"payload": "default"}, {"payload": "override"}, {"payload": "unit"})
    await claim_one(client)
    await claim_one(client, lease=120)
    await claim_one(client, lease="250ms")
    leases = []
    for ref in refs:
        claimed = (await get_message(client, ref["id"]))["history"][1]
        assert claimed["event"] == "claimed"
        leases.append(seconds(claimed["lease_deadline"]) - seconds(claimed["at"]))
    assert leases == pytest.approx([45, 120, 0.25], abs=0.002)


async def test_the_lease_deadline_is_claim_time_plus_lease(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    await publish(client, {"payload": 1})
    delivery = await claim_one(client, lease=90)
    await trio.sleep(10)
    view = await get_message(client, delivery["id"])
    assert seconds(view["lease_deadline"]) == pytest.approx(seconds(delivery["published_at"]) + 90, abs=0.002)
    assert view["lease_deadline"] == delivery["lease_deadline"]


async def test_the_consumer_name_is_recorded(client: Client) -> None:
    await make_queue(client)
    [ref] = await publish(client, {"payload": 1})
    delivery = await claim_one(client, consumer="worker-7")
    view = await get_message(client, ref["id"])
    assert (view["consumer"], view["lease_id"]) == ("worker-7", delivery["lease_id"])


# -- settling (§5) --------------------------------------------------------------------------------


async def test_ack_removes_the_message(client: Client) -> None:
    await make_queue(client)
    await publish(client, {"payload": 1}, {"payload": 2})
    deliveries = (await claim(client, max=2))["messages"]
    leases = [d["lease_id"] for d in deliveries]
    assert await post(client, "/v1/queues/jobs/ack", {"leases": leases}) == {"acked": 2, "skipped": []}
    queue_stats = await stats(client)
    assert (queue_stats["in_flight"], queue_stats["acked_total"]) == (0, 2)
    assert (await claim(client))["messages"] == []


async def test_ack_is_idempotent_and_skips_unknown_leases(client: Client) -> None:
    await make_queue(client)
    await publish(client, {"payload": 1})
    lease = (await claim_one(client))["lease_id"]
    answer = await post(client, "/v1/queues/jobs/ack", {"leases": ["nope", lease, lease]})
    assert answer == {"acked": 1, "skipped": ["nope", lease]}
    assert await post(client, "/v1/queues/jobs/ack", {"leases": [lease]}) == {"acked": 0, "skipped": [lease]}
    assert await post(client, "/v1/queues/jobs/ack", {"leases": []}) == {"acked": 0, "skipped": []}
    assert (await stats(client))["acked_total"] == 1


async def test_nack_returns_the_message_for_another_attempt(client: Client) -> None:
    await make_queue(client)
    await publish(client, {"payload": 1})
    lease = (await claim_one(client))["lease_id"]
    answer = await post(client, "/v1/queues/jobs/nack", {"leases": [lease, "nope"], "reason": "boom"})
    assert (answer["nacked"], answer["skipped"]) == (1, ["nope"])
    again = await claim_one(client)
    assert again["attempt"] == 2
    assert again["lease_id"] != lease
    assert (await stats(client))["nacked_total"] == 1


async def test_the_nack_answer_has_the_contract_shape(client: Client) -> None:
    await make_queue(client)
    await publish(client, {"payload": 1})
    lease = (await claim_one(client))["lease_id"]
    answer = await post(client, "/v1/queues/jobs/nack", {"leases": [lease]})
    assert answer == {"nacked": 1, "dead_lettered": 0, "skipped": []}


async def test_nack_with_a_delay_holds_the_message_back(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    [ref] = await publish(client, {"payload": 1})
    lease = (await claim_one(client))["lease_id"]
    await post(client, "/v1/queues/jobs/nack", {"leases": [lease], "delay": "1m"})
    queue_stats = await stats(client)
    assert (queue_stats["ready"], queue_stats["delayed"], queue_stats["in_flight"]) == (0, 1, 0)
    view = await get_message(client, ref["id"])
    assert view["state"] == "delayed"
    assert TIMESTAMP.match(view["available_at"])
    assert (await claim(client))["messages"] == []
    await trio.sleep(60)
    assert (await claim_one(client))["attempt"] == 2


async def test_nack_without_a_delay_uses_the_queues_retry_backoff(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, retry_backoff={"type": "exponential", "base": 10, "max": 15})
    await publish(client, {"payload": 1})
    for expected_delay in (10, 15):  # 10·2^0, then 10·2^1 capped at 15
        lease = (await claim_one(client))["lease_id"]
        await post(client, "/v1/queues/jobs/nack", {"leases": [lease]})
        await trio.sleep(expected_delay - 0.5)
        assert (await claim(client))["messages"] == []
        await trio.sleep(0.5)
    assert (await claim_one(client))["attempt"] == 3


async def test_defer_refunds_the_attempt(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    [ref] = await publish(client, {"payload": 1})
    lease = (await claim_one(client))["lease_id"]
    answer = await post(
        client, "/v1/queues/jobs/defer", {"leases": [lease, "nope"], "retry_after": 30, "reason": "busy"}
    )
    assert answer == {"deferred": 1, "skipped": ["nope"]}
    assert (await get_message(client, ref["id"]))["state"] == "delayed"
    assert (await claim(client))["messages"] == []
    await trio.sleep(30)
    again = await claim_one(client)
    assert again["attempt"] == 1
    assert (await stats(client))["deferred_total"] == 1


async def test_defer_without_retry_after_makes_the_message_ready_at_once(client: Client) -> None:
    await make_queue(client)
    await publish(client, {"payload": 1})
    lease = (await claim_one(client))["lease_id"]
    assert await post(client, "/v1/queues/jobs/defer", {"leases": [lease]}) == {"deferred": 1, "skipped": []}
    assert (await claim_one(client))["attempt"] == 1


async def test_extend_sets_the_deadline_from_now(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    await publish(client, {"payload": 1})
    delivery = await claim_one(client, lease=30)
    claimed_at = seconds(delivery["lease_deadline"]) - 30
    await trio.sleep(10)
    answer = await post(
        client, "/v1/queues/jobs/extend", {"leases": [delivery["lease_id"], "nope"], "lease": 60}
    )
    assert set(answer) == {"extended", "deadlines", "skipped"}
    assert (answer["extended"], answer["skipped"]) == (1, ["nope"])
    assert list(answer["deadlines"]) == [delivery["lease_id"]]
    deadline = answer["deadlines"][delivery["lease_id"]]
    assert TIMESTAMP.match(deadline)
    assert seconds(deadline) == pytest.approx(claimed_at + 10 + 60, abs=0.002)  # sets, does not add

    await trio.sleep(25)  # t=35: past the first deadline (30), before the new one (70)
    assert (await claim(client))["messages"] == []
    assert (await stats(client))["in_flight"] == 1
    await trio.sleep(35)
    assert (await claim_one(client))["attempt"] == 2


async def test_extend_can_shorten_a_lease(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    await publish(client, {"payload": 1})
    lease = (await claim_one(client, lease=3600))["lease_id"]
    await post(client, "/v1/queues/jobs/extend", {"leases": [lease], "lease": "2s"})
    await trio.sleep(2)
    assert (await claim_one(client))["attempt"] == 2


async def test_an_expired_lease_still_settles_until_redelivery(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    await publish(client, {"payload": 1})
    lease = (await claim_one(client, lease=1))["lease_id"]
    await trio.sleep(5)
    assert (await stats(client))["ready"] == 1  # the expiry is noticed
    assert await post(client, "/v1/queues/jobs/ack", {"leases": [lease]}) == {"acked": 1, "skipped": []}
    assert (await claim(client))["messages"] == []


@pytest.mark.parametrize(
    ("verb", "extra", "answer_key"),
    [
        ("ack", {}, "acked"),
        ("nack", {"delay": 0}, "nacked"),
        ("defer", {"retry_after": 0}, "deferred"),
        ("extend", {"lease": 60}, "extended"),
    ],
)
async def test_a_lease_is_stale_once_its_message_is_redelivered(
    autojump_clock: Any, client: Client, verb: str, extra: dict[str, Any], answer_key: str
) -> None:
    await make_queue(client)
    await publish(client, {"payload": 1})
    old = await claim_one(client, lease=1)
    await trio.sleep(2)
    new = await claim_one(client, lease=60)
    assert (new["id"], new["attempt"]) == (old["id"], 2)
    assert new["lease_id"] != old["lease_id"]
    answer = await post(client, f"/v1/queues/jobs/{verb}", {"leases": [old["lease_id"]], **extra})
    assert (answer[answer_key], answer["skipped"]) == (0, [old["lease_id"]])
    assert (await stats(client))["in_flight"] == 1
    assert await post(client, "/v1/queues/jobs/ack", {"leases": [new["lease_id"]]}) == {
        "acked": 1,
        "skipped": [],
    }


# -- inspection (§6) ------------------------------------------------------------------------------


async def test_browse_shows_live_messages_in_seq_order_without_claiming(client: Client) -> None:
    await make_queue(client)
    refs = await publish(
        client,
        {"payload": "a", "priority": 1},
        {"payload": "b", "delay": 60},
        {"payload": "c", "key": "kc", "headers": {"h": "v"}},
    )
    lease = (await claim_one(client))["lease_id"]  # "a" (priority 1)
    views = await browse(client)
    assert [v["id"] for v in views] == [r["id"] for r in refs]
    for view in views:
        assert set(view) == VIEW_FIELDS
        assert TIMESTAMP.match(view["published_at"])
    a, b, c = views
    assert (a["state"], a["lease_id"], a["consumer"], a["attempt"]) == ("in_flight", lease, "anonymous", 1)
    assert TIMESTAMP.match(a["lease_deadline"])
    assert (b["state"], b["lease_id"], b["lease_deadline"]) == ("delayed", None, None)
    assert TIMESTAMP.match(b["available_at"])
    assert (c["state"], c["payload"], c["key"], c["headers"], c["available_at"]) == (
        "ready",
        "c",
        "kc",
        {"h": "v"},
        None,
    )
    assert (await stats(client))["ready"] == 1


@pytest.mark.parametrize(
    ("query", "payloads"),
    [
        ("?state=all", ["leased", "later", "r1", "r2"]),
        ("?state=ready", ["r1", "r2"]),
        ("?state=delayed", ["later"]),
        ("?state=in_flight", ["leased"]),
        ("?limit=2", ["leased", "later"]),
        ("?after=2", ["r1", "r2"]),
        ("?after=2&limit=1", ["r1"]),
        ("?state=ready&after=3", ["r2"]),
        ("?after=4", []),
    ],
)
async def test_browse_filters(client: Client, query: str, payloads: list[str]) -> None:
    await make_queue(client)
    await publish(
        client,
        {"payload": "leased"},
        {"payload": "later", "delay": 60},
        {"payload": "r1"},
        {"payload": "r2"},
    )
    await claim_one(client)
    assert [v["payload"] for v in await browse(client, query)] == payloads


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("?state=acked", "state"),
        ("?state=READY", "state"),
        ("?state=", "state"),
        ("?limit=0", "limit"),
        ("?limit=1001", "limit"),
        ("?limit=-1", "limit"),
        ("?limit=ten", "limit"),
        ("?limit=1.5", "limit"),
        ("?limit=", "limit"),
        ("?limit=5&limit=6", "limit"),
        ("?limit=1_0", "limit"),
        ("?limit=%EF%BC%95", "limit"),  # a full-width 5
        ("?after=-1", "after"),
        ("?after=x", "after"),
        ("?after=" + "9" * 40, "after"),
        ("?after=" + "9" * 5000, "after"),  # past int()'s 4300 digits: it raised, a 500
        ("?limit=" + "1" * 5000, "limit"),
        ("?offset=3", "offset"),
        ("?stat=ready", "stat"),
    ],
)
async def test_browse_with_a_bad_query_is_400_naming_it(client: Client, query: str, field: str) -> None:
    await make_queue(client)
    response = await client.get(f"/v1/queues/jobs/messages{query}")
    assert field in await expect_error(response, 400, "invalid_request")


async def test_get_one_shows_its_history_through_ack(client: Client) -> None:
    await make_queue(client)
    [ref] = await publish(client, {"payload": {"n": 1}, "key": "k"})
    fresh = await get_message(client, ref["id"])
    assert set(fresh) == VIEW_FIELDS | {"history"}
    assert (fresh["state"], fresh["attempt"], fresh["payload"]) == ("ready", 0, {"n": 1})
    assert [h["event"] for h in fresh["history"]] == ["published"]
    assert fresh["history"][0]["at"] == fresh["published_at"]

    delivery = await claim_one(client, consumer="w1")
    await post(client, "/v1/queues/jobs/ack", {"leases": [delivery["lease_id"]]})

    acked = await get_message(client, ref["id"])
    assert (acked["state"], acked["payload"], acked["key"], acked["attempt"]) == ("acked", {"n": 1}, "k", 1)
    published, claimed, ack = acked["history"]
    assert published["event"] == "published"
    assert claimed["event"] == "claimed"
    assert (claimed["consumer"], claimed["lease_id"], claimed["attempt"]) == ("w1", delivery["lease_id"], 1)
    assert claimed["lease_deadline"] == delivery["lease_deadline"]
    assert ack["event"] == "acked"
    assert ack["lease_id"] == delivery["lease_id"]
    for entry in acked["history"]:
        assert TIMESTAMP.match(entry["at"])
    assert seconds(published["at"]) <= seconds(claimed["at"]) <= seconds(ack["at"])
    assert await browse(client) == []  # acked is not live


async def test_history_records_nack_and_defer_reasons(client: Client) -> None:
    await make_queue(client)
    [ref] = await publish(client, {"payload": 1})
    lease = (await claim_one(client))["lease_id"]
    await post(client, "/v1/queues/jobs/nack", {"leases": [lease], "delay": 0, "reason": "flaky upstream"})
    lease = (await claim_one(client))["lease_id"]
    await post(
        client, "/v1/queues/jobs/defer", {"leases": [lease], "retry_after": 5, "reason": "rate limited"}
    )
    history = (await get_message(client, ref["id"]))["history"]
    assert [h["event"] for h in history] == ["published", "claimed", "nacked", "claimed", "deferred"]
    assert (history[2]["reason"], history[2]["delay"]) == ("flaky upstream", 0)
    assert (history[4]["reason"], history[4]["retry_after"]) == ("rate limited", 5)


async def test_get_an_unknown_message_is_404(client: Client) -> None:
    await make_queue(client)
    await expect_error(await client.get("/v1/queues/jobs/messages/nope"), 404, "message_not_found")


async def test_a_message_is_found_only_in_its_own_queue(client: Client) -> None:
    await make_queue(client)
    await make_queue(client, "other")
    [ref] = await publish(client, {"payload": 1})
    response = await client.get(f"/v1/queues/other/messages/{ref['id']}")
    await expect_error(response, 404, "message_not_found")


@pytest.mark.parametrize("state", ["ready", "delayed", "in_flight"])
async def test_delete_one_message_then_it_is_gone(client: Client, state: str) -> None:
    await make_queue(client)
    [ref] = await publish(client, {"payload": 1, "delay": 60 if state == "delayed" else 0})
    lease = (await claim_one(client))["lease_id"] if state == "in_flight" else None
    response = await client.delete(f"/v1/queues/jobs/messages/{ref['id']}")
    assert response.status_code == 204
    assert await response.get_data() == b""
    await expect_error(await client.get(f"/v1/queues/jobs/messages/{ref['id']}"), 404, "message_not_found")
    await expect_error(await client.delete(f"/v1/queues/jobs/messages/{ref['id']}"), 404, "message_not_found")
    queue_stats = await stats(client)
    assert (queue_stats["ready"], queue_stats["delayed"], queue_stats["in_flight"]) == (0, 0, 0)
    if lease is not None:  # its lease went stale
        assert await post(client, "/v1/queues/jobs/ack", {"leases": [lease]}) == {
            "acked": 0,
            "skipped": [lease],
        }
    assert (await claim(client))["messages"] == []


async def test_delete_leaves_the_other_messages(client: Client) -> None:
    await make_queue(client)
    refs = await publish(client, {"payload": 1}, {"payload": 2}, {"payload": 3})
    assert (await client.delete(f"/v1/queues/jobs/messages/{refs[1]['id']}")).status_code == 204
    assert [m["payload"] for m in (await claim(client, max=10))["messages"]] == [1, 3]


# -- encodings (§2) -------------------------------------------------------------------------------


async def test_a_cbor_byte_payload_comes_back_as_base64_in_json(client: Client) -> None:
    await make_queue(client)
    raw = bytes(range(256))
    response = await client.post(
        "/v1/queues/jobs/messages",
        data=cbor2.dumps({"payload": raw, "headers": {"kind": "blob"}}),
        headers={"Content-Type": "application/cbor"},
    )
    assert response.status_code == 201
    assert response.content_type == "application/json"
    delivery = await claim_one(client)
    assert delivery["payload_encoding"] == "base64"
    assert base64.b64decode(delivery["payload"], validate=True) == raw
    assert delivery["headers"] == {"kind": "blob"}
    view = await get_message(client, delivery["id"])
    assert (view["payload"], view["payload_encoding"]) == (delivery["payload"], "base64")
    [browsed] = await browse(client)
    assert (browsed["payload"], browsed["payload_encoding"]) == (delivery["payload"], "base64")


async def test_a_cbor_byte_payload_comes_back_as_bytes_in_cbor(client: Client) -> None:
    await make_queue(client)
    raw = b"\x00\xffbinary\x80"
    response = await client.post(
        "/v1/queues/jobs/messages", data=cbor2.dumps({"payload": raw}), headers=CBOR_HEADERS
    )
    assert response.status_code == 201
    assert response.content_type == "application/cbor"
    [ref] = cbor2.loads(await response.get_data())["messages"]
    assert ref["duplicate"] is False

    response = await client.post(
        "/v1/queues/jobs/claim", data=cbor2.dumps({"consumer": "w", "max": 5}), headers=CBOR_HEADERS
    )
    assert response.content_type == "application/cbor"
    body = cbor2.loads(await response.get_data())
    [delivery] = body["messages"]
    assert set(delivery) == DELIVERY_FIELDS
    assert delivery["payload"] == raw
    assert delivery["id"] == ref["id"]
    assert TIMESTAMP.match(delivery["lease_deadline"])

    response = await client.get(
        f"/v1/queues/jobs/messages/{ref['id']}", headers={"Accept": "application/cbor"}
    )
    view = cbor2.loads(await response.get_data())
    assert view["payload"] == raw
    assert "payload_encoding" not in view

    response = await client.post(
        "/v1/queues/jobs/ack", data=cbor2.dumps({"leases": [delivery["lease_id"]]}), headers=CBOR_HEADERS
    )
    assert cbor2.loads(await response.get_data()) == {"acked": 1, "skipped": []}


async def test_a_json_base64_payload_round_trips_as_bytes(client: Client) -> None:
    await make_queue(client)
    raw = b"\x89PNG\r\n\x1a\n\x00"
    text = base64.b64encode(raw).decode()
    await publish(client, {"payload": text, "payload_encoding": "base64"})
    response = await client.post("/v1/queues/jobs/claim", json={}, headers={"Accept": "application/cbor"})
    assert cbor2.loads(await response.get_data())["messages"][0]["payload"] == raw
    [view] = await browse(client)
    assert (view["payload"], view["payload_encoding"]) == (text, "base64")


async def test_a_cbor_structured_payload_is_plain_json(client: Client) -> None:
    await make_queue(client)
    payload = {"list": [1, 2.5, None, True], "text": "é"}
    response = await client.post(
        "/v1/queues/jobs/messages",
        data=cbor2.dumps({"payload": payload}),
        headers={"Content-Type": "application/cbor"},
    )
    assert response.status_code == 201
    delivery = await claim_one(client)
    assert delivery["payload"] == payload
    assert "payload_encoding" not in delivery


async def test_a_json_payload_comes_back_as_structure_in_cbor(client: Client) -> None:
    await make_queue(client)
    await publish(client, {"payload": {"a": [1, "two"]}})
    response = await client.post("/v1/queues/jobs/claim", json={}, headers={"Accept": "application/cbor"})
    assert cbor2.loads(await response.get_data())["messages"][0]["payload"] == {"a": [1, "two"]}


async def test_json_with_a_charset_parameter_is_json(client: Client) -> None:
    await make_queue(client)
    response = await client.post(
        "/v1/queues/jobs/messages",
        data=orjson.dumps({"payload": "ok"}),
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert response.status_code == 201
    assert (await claim_one(client))["payload"] == "ok"


async def test_a_body_without_content_type_is_json(client: Client) -> None:
    await make_queue(client)
    response = await client.post("/v1/queues/jobs/messages", data=b'{"payload": [1]}')
    assert response.status_code == 201
    assert (await claim_one(client))["payload"] == [1]
