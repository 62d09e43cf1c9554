"""Malformed input on every route gets a 4xx in the §2 error shape, never a 500, and changes nothing:
bad input loses nothing and adds nothing."""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import uuid
from dataclasses import dataclass
from typing import Any

import cbor2
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.config import Settings
from broker.errors import InvalidRequest
from broker.server import open_broker
from broker.storage.codec import cbor_loads
from tests.conftest import Client, make_queue

MiB = 1024 * 1024

PATHS = {
    "put": ("PUT", "/v1/queues/jobs"),
    "publish": ("POST", "/v1/queues/jobs/messages"),
    "claim": ("POST", "/v1/queues/jobs/claim"),
    "ack": ("POST", "/v1/queues/jobs/ack"),
    "nack": ("POST", "/v1/queues/jobs/nack"),
    "defer": ("POST", "/v1/queues/jobs/defer"),
    "extend": ("POST", "/v1/queues/jobs/extend"),
    "redrive": ("POST", "/v1/queues/jobs/redrive"),
    "purge": ("POST", "/v1/queues/jobs/purge"),  # takes no body: a body it cannot read must not purge
}
BODY_ROUTES = list(PATHS)
SETTLE_ROUTES = ["ack", "nack", "defer", "extend"]


@dataclass
class Seeded:
    """A queue "jobs" holding one ready and one delayed message and one leased under ``lease``."""

    lease: str
    before: dict[str, Any]


async def snapshot(client: Client) -> dict[str, Any]:
    """Everything a bad request must leave alone: the queue's config, its stats and its messages."""
    queue = await (await client.get("/v1/queues/jobs")).get_json()
    queue["stats"].pop("oldest_ready_age")  # moves with the clock
    browsed = await (await client.get("/v1/queues/jobs/messages")).get_json()
    return {"queue": queue, "messages": browsed["messages"]}


async def seed(client: Client) -> Seeded:
    await make_queue(client, lease=60)
    response = await client.post(
        "/v1/queues/jobs/messages",
        json={"messages": [{"payload": "leased"}, {"payload": "ready"}, {"payload": "later", "delay": 3600}]},
    )
    assert response.status_code == 201
    claimed = await (await client.post("/v1/queues/jobs/claim", json={})).get_json()
    [delivery] = claimed["messages"]
    return Seeded(delivery["lease_id"], await snapshot(client))


async def assert_untouched(client: Client, seeded: Seeded) -> None:
    """Nothing was added, removed or changed, and the lease in flight still settles."""
    assert await snapshot(client) == seeded.before
    response = await client.post("/v1/queues/jobs/ack", json={"leases": [seeded.lease]})
    assert await response.get_json() == {"acked": 1, "skipped": []}


async def send(client: Client, route: str, body: Any = None, **kwargs: Any) -> Any:
    method, path = PATHS[route]
    if body is not None:
        kwargs["json"] = body
    return await client.open(path, method=method, **kwargs)


async def send_raw(client: Client, route: str, data: bytes, content_type: str | None) -> Any:
    headers = {} if content_type is None else {"Content-Type": content_type}
    method, path = PATHS[route]
    return await client.open(path, method=method, data=data, headers=headers)


async def expect_error(response: Any, status: int, code: str) -> str:
    """Assert the §2 error shape with this status and code; return the message."""
    assert response.status_code == status, await response.get_data()
    assert response.content_type == "application/json"
    body = json.loads(await response.get_data())
    assert isinstance(body, dict) and set(body) == {"error"}
    assert isinstance(body["error"], dict) and set(body["error"]) == {"code", "message"}
    assert body["error"]["code"] == code
    message = body["error"]["message"]
    assert isinstance(message, str) and message
    return message


# -- bodies that are not what they claim to be ------------------------------------------------------


@pytest.mark.parametrize("route", BODY_ROUTES)
@pytest.mark.parametrize(
    "data",
    [
        b"{",
        b"{'payload': 1,}",
        b"\xff\xfe",
        b'{"a": 1} trailing',
        b"NaN",
        # Too large for a float, beside a 19-digit run (the exact parser's case): it was kept as null.
        b'{"payload": [1e400], "key": "1234567890123456789012"}',
    ],
)
async def test_invalid_json_is_400(client: Client, route: str, data: bytes) -> None:
    seeded = await seed(client)
    response = await send_raw(client, route, data, "application/json")
    assert "JSON" in await expect_error(response, 400, "invalid_request")
    await assert_untouched(client, seeded)


@pytest.mark.parametrize("route", BODY_ROUTES)
@pytest.mark.parametrize("body", [[{"payload": 1}], "text", 17, None])
async def test_a_body_that_is_not_an_object_is_400(client: Client, route: str, body: Any) -> None:
    seeded = await seed(client)
    response = await send_raw(client, route, json.dumps(body).encode(), "application/json")
    assert "object" in await expect_error(response, 400, "invalid_request")
    await assert_untouched(client, seeded)


#: {"payload": X} where X is a list that holds itself (shared references, tags 28 and 29): checking the
#: payload looped for ever, with the whole broker stalled.
SELF_HOLDING = bytes.fromhex("a1677061796c6f6164") + bytes.fromhex("d81c81d81d00")
#: {"payload": X} where X is a list of two references to one string (string references, tags 256, 25).
STRING_REFERENCES = bytes.fromhex("a1677061796c6f6164") + bytes.fromhex("d9010082636162636474657374d81900")


#: Integers past the 4300 digits Python turns into text: an error message naming one raised, a 500.
HUGE_BIGNUMS = [cbor2.dumps({"lease": 10**5000}), cbor2.dumps({10**5000: 1}), cbor2.dumps({"x": -(10**4300)})]


@pytest.mark.parametrize("route", BODY_ROUTES)
@pytest.mark.parametrize(
    "data", [b"\xff", b"\xa1", b"\x7f\x61", SELF_HOLDING, STRING_REFERENCES, *HUGE_BIGNUMS]
)
async def test_invalid_cbor_is_400(client: Client, route: str, data: bytes) -> None:
    seeded = await seed(client)
    with trio.fail_after(10):
        response = await send_raw(client, route, data, "application/cbor")
    assert "CBOR" in await expect_error(response, 400, "invalid_request")
    await assert_untouched(client, seeded)


def test_a_tree_of_shared_references_is_refused_before_it_is_built() -> None:
    """28 levels of a list of two references to the level below: a 170-byte body of 2**28 leaves,
    which hashing, walking or repr-ing took minutes (any valid token could send one to a push
    callback, whose body is read before any scope is checked)."""
    data = bytes.fromhex("d81c8100")  # level 0: a shareable [0]
    for level in range(1, 28):
        # Shareables are numbered in the order they open, outermost first: level L is number 27 - L.
        data = bytes.fromhex("d81c82") + data + cbor2.dumps(cbor2.CBORTag(29, 28 - level))
    with pytest.raises(InvalidRequest, match="references"):
        cbor_loads(data)


@pytest.mark.parametrize("route", BODY_ROUTES)
@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/octet-stream",
    ],
)
async def test_an_unsupported_content_type_is_415(client: Client, route: str, content_type: str) -> None:
    seeded = await seed(client)
    response = await send_raw(client, route, b'{"payload": 1, "leases": []}', content_type)
    await expect_error(response, 415, "unsupported_media_type")
    await assert_untouched(client, seeded)


@pytest.mark.parametrize("route", BODY_ROUTES)
async def test_a_body_over_16_mib_is_413(client: Client, route: str) -> None:
    seeded = await seed(client)
    data = b'{"payload": "' + b"x" * (16 * MiB) + b'"}'
    response = await send_raw(client, route, data, "application/json")
    await expect_error(response, 413, "payload_too_large")
    await assert_untouched(client, seeded)


# -- fields: types, ranges, unknown names ---------------------------------------------------------

# (route, body, a word the error message must contain: the field at fault)
BAD_FIELDS: list[tuple[str, Any, str]] = [
    # publish: the message fields
    ("publish", {}, "payload"),
    ("publish", {"headers": {}}, "payload"),
    ("publish", {"payload": 1, "dealy": 5}, "dealy"),
    ("publish", {"payload": 1, "Payload": 1}, "Payload"),
    ("publish", {"payload": 1, "delay": -1}, "delay"),
    ("publish", {"payload": 1, "delay": 604801}, "delay"),
    ("publish", {"payload": 1, "delay": "8d"}, "delay"),
    ("publish", {"payload": 1, "delay": "soon"}, "delay"),
    ("publish", {"payload": 1, "delay": "-5s"}, "delay"),
    ("publish", {"payload": 1, "delay": "5 min"}, "delay"),
    ("publish", {"payload": 1, "delay": True}, "delay"),
    ("publish", {"payload": 1, "delay": [1]}, "delay"),
    ("publish", {"payload": 1, "delay": {"s": 1}}, "delay"),
    ("publish", {"payload": 1, "priority": 1.5}, "priority"),
    ("publish", {"payload": 1, "priority": "high"}, "priority"),
    ("publish", {"payload": 1, "priority": True}, "priority"),
    ("publish", {"payload": 1, "priority": 2**31}, "priority"),
    ("publish", {"payload": 1, "priority": -(2**31) - 1}, "priority"),
    ("publish", {"payload": 1, "key": 17}, "key"),
    ("publish", {"payload": 1, "key": ""}, "key"),
    ("publish", {"payload": 1, "key": "k" * 1025}, "key"),
    ("publish", {"payload": 1, "key": ["a"]}, "key"),
    ("publish", {"payload": 1, "headers": "a=b"}, "headers"),
    ("publish", {"payload": 1, "headers": ["a"]}, "headers"),
    ("publish", {"payload": 1, "headers": {"a": 1}}, "headers"),
    ("publish", {"payload": 1, "headers": {"a": None}}, "headers"),
    ("publish", {"payload": 1, "headers": {"a": {"b": "c"}}}, "headers"),
    ("publish", {"payload": 1, "headers": {f"h{i}": "v" for i in range(65)}}, "headers"),
    ("publish", {"payload": 1, "headers": {"big": "v" * (8 * 1024)}}, "headers"),
    ("publish", {"payload": 1, "on_duplicate": "replace"}, "needs a key"),
    ("publish", {"payload": 1, "on_duplicate": "ignore"}, "on_duplicate"),
    ("publish", {"payload": "AAE=", "payload_encoding": "hex"}, "payload_encoding"),
    ("publish", {"payload": "AAE=", "payload_encoding": "BASE64"}, "payload_encoding"),
    ("publish", {"payload": [1], "payload_encoding": "base64"}, "payload_encoding"),
    ("publish", {"payload": "not base64!", "payload_encoding": "base64"}, "base64"),
    ("publish", {"payload": "AAE", "payload_encoding": "base64"}, "base64"),
    ("publish", {"payload": "é", "payload_encoding": "base64"}, "base64"),
    ("publish", {"messages": [{"payload": "\u0663", "payload_encoding": "base64"}]}, "base64"),
    # publish: batches
    ("publish", {"messages": []}, "messages"),
    ("publish", {"messages": {"payload": 1}}, "messages"),
    ("publish", {"messages": None}, "messages"),
    ("publish", {"messages": [{"payload": i} for i in range(1001)]}, "1000"),
    ("publish", {"messages": [{"payload": 1}], "payload": 2}, "payload"),
    ("publish", {"messages": [{"payload": 1}, 2]}, "messages[1]"),
    ("publish", {"messages": [{"payload": 1}, {"payload": 2, "dealy": 1}]}, "dealy"),
    ("publish", {"messages": [{"payload": 1}, {"delay": 1}]}, "messages[1].payload"),
    ("publish", {"messages": [{"payload": 1}, {"payload": 2, "on_duplicate": "replace"}]}, "messages[1]"),
    # claim
    ("claim", {"consumer": "w", "maxx": 2}, "maxx"),
    ("claim", {"consumer": 7}, "consumer"),
    ("claim", {"consumer": ""}, "consumer"),
    ("claim", {"consumer": "w" * 257}, "consumer"),
    ("claim", {"max": 0}, "max"),
    ("claim", {"max": 1001}, "max"),
    ("claim", {"max": -1}, "max"),
    ("claim", {"max": 2.0}, "max"),
    ("claim", {"max": "5"}, "max"),
    ("claim", {"max": True}, "max"),
    ("claim", {"lease": 0}, "lease"),
    ("claim", {"lease": 0.05}, "lease"),
    ("claim", {"lease": "50ms"}, "lease"),
    ("claim", {"lease": 43201}, "lease"),
    ("claim", {"lease": "13h"}, "lease"),
    ("claim", {"lease": -30}, "lease"),
    ("claim", {"lease": "thirty"}, "lease"),
    ("claim", {"lease": False}, "lease"),
    ("claim", {"wait": -1}, "wait"),
    ("claim", {"wait": 31}, "wait"),
    ("claim", {"wait": "1m"}, "wait"),
    ("claim", {"wait": [5]}, "wait"),
    # settling: shared fields (extend also needs its lease, so that leases is the only fault)
    *((route, {}, "leases") for route in ("ack", "nack", "defer")),
    ("extend", {"lease": 5}, "leases"),
    *(
        (route, {"leases": leases, **({"lease": 5} if route == "extend" else {})}, named)
        for route in SETTLE_ROUTES
        for leases, named in [
            ("abc", "leases"),
            ([1, 2], "leases"),
            ([None], "leases"),
            ({"a": "b"}, "leases"),
            ([f"l{i}" for i in range(1001)], "1000"),
        ]
    ),
    *((route, {"leases": [], "lease_ids": []}, "lease_ids") for route in SETTLE_ROUTES),
    ("ack", {"leases": [], "reason": "x"}, "reason"),
    ("nack", {"leases": [], "reason": 5}, "reason"),
    ("nack", {"leases": [], "reason": "r" * 4097}, "reason"),
    ("defer", {"leases": [], "reason": ["x"]}, "reason"),
    # nack
    ("nack", {"leases": [], "delay": -1}, "delay"),
    ("nack", {"leases": [], "delay": 604801}, "delay"),
    ("nack", {"leases": [], "delay": "later"}, "delay"),
    ("nack", {"leases": [], "retryable": "no"}, "retryable"),
    ("nack", {"leases": [], "retryable": 0}, "retryable"),
    ("nack", {"leases": [], "retry_after": 5}, "retry_after"),
    # defer
    ("defer", {"leases": [], "retry_after": -1}, "retry_after"),
    ("defer", {"leases": [], "retry_after": 86401}, "retry_after"),
    ("defer", {"leases": [], "retry_after": "2d"}, "retry_after"),
    ("defer", {"leases": [], "delay": 5}, "delay"),
    # extend
    ("extend", {"leases": []}, "lease"),
    ("extend", {"leases": [], "lease": 0}, "lease"),
    ("extend", {"leases": [], "lease": 43201}, "lease"),
    ("extend", {"leases": [], "lease": "forever"}, "lease"),
    ("extend", {"leases": [], "lease": None}, "lease"),
    ("extend", {"leases": [], "lease": 5, "wait": 1}, "wait"),
    # queue config (an update of the existing queue)
    ("put", {"lease": "5 minutes"}, "lease"),
    ("put", {"dealy": 1}, "dealy"),
    ("put", {"max_depth": -1}, "max_depth"),
    ("put", {"durable": "false"}, "durable"),
    ("put", {"max_attempts": 1.5}, "max_attempts"),
    ("put", {"max_attempts": 1_000_001}, "max_attempts"),
    ("put", {"rate_limit": {"max": 1}}, "rate_limit"),
    ("put", {"rate_limit": {"max": 0, "per": 1}}, "rate_limit.max"),
    ("put", {"rate_limit": {"max": 1, "per": 0}}, "rate_limit.per"),
    ("put", {"message_ttl": -1}, "message_ttl"),
    ("put", {"message_ttl": "1y"}, "message_ttl"),
    ("put", {"claim_window": 5.5}, "claim_window"),
    ("put", {"claim_window": "1m"}, "claim_window"),
    ("put", {"dead_letter": "jobs"}, "dead_letter"),
    ("put", {"dead_letter": "no spaces"}, "dead_letter"),
    ("put", {"retry_backoff": {"type": "linear"}}, "retry_backoff.type"),
    ("put", {"retry_backoff": {"base": -1}}, "retry_backoff.base"),
    # redrive
    ("redrive", {}, "ids"),
    ("redrive", {"ids": []}, "ids"),
    ("redrive", {"ids": [1]}, "ids"),
    ("redrive", {"ids": ["a"], "all": True}, "all"),
    ("redrive", {"all": "yes"}, "all"),
    ("redrive", {"all": False}, "ids"),
    ("redrive", {"all": True, "to": 5}, "to"),
    ("redrive", {"all": True, "to": "bad name"}, "to"),
    ("redrive", {"all": True, "to": "jobs"}, "to"),
    ("redrive", {"all": True, "too": "x"}, "too"),
    ("redrive", {"ids": [str(i) for i in range(1001)]}, "1000"),
    ("purge", {"dry_run": True}, "the purge takes no body"),
]


@pytest.mark.parametrize(("route", "body", "named"), BAD_FIELDS)
async def test_a_bad_field_is_400_naming_it(client: Client, route: str, body: Any, named: str) -> None:
    seeded = await seed(client)
    message = await expect_error(await send(client, route, body), 400, "invalid_request")
    assert named in message
    await assert_untouched(client, seeded)


# CBOR bodies reach the same field checks once decoded: every third case is enough to show it.
@pytest.mark.parametrize(("route", "body", "named"), BAD_FIELDS[::3])
async def test_a_bad_field_in_cbor_is_400_too(client: Client, route: str, body: Any, named: str) -> None:
    seeded = await seed(client)
    method, path = PATHS[route]
    response = await client.open(
        path, method=method, data=cbor2.dumps(body), headers={"Content-Type": "application/cbor"}
    )
    assert named in await expect_error(response, 400, "invalid_request")
    await assert_untouched(client, seeded)


# -- CBOR values JSON cannot hold ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"payload": [b"nested bytes"]}, "payload"),
        ({"payload": {"k": b"nested bytes"}}, "payload"),
        ({"payload": {1: "non-string key"}}, "payload"),
        ({"payload": {1, 2}}, "payload"),
        ({"payload": cbor2.undefined}, "payload"),
        ({"payload": cbor2.CBORTag(4711, "x")}, "payload"),
        ({"payload": b"x", "payload_encoding": "base64"}, "payload_encoding"),
        ({"payload": 1, "headers": {"a": b"bytes"}}, "headers"),
        ({"payload": 1, "key": b"bytes"}, "key"),
        ({"payload": 1, "delay": float("nan")}, "delay"),
        ({"payload": 1, "delay": float("inf")}, "delay"),
        ({1: "x"}, "1"),
    ],
)
async def test_cbor_values_that_cannot_be_kept_are_400(client: Client, body: Any, named: str) -> None:
    seeded = await seed(client)
    response = await client.post(
        "/v1/queues/jobs/messages", data=cbor2.dumps(body), headers={"Content-Type": "application/cbor"}
    )
    assert named in await expect_error(response, 400, "invalid_request")
    await assert_untouched(client, seeded)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("publish", {"payload": 1, "delay": 10**400}),
        ("claim", {"lease": 10**400}),
        ("claim", {"wait": -(10**400)}),
        ("nack", {"leases": [], "delay": 10**400}),
        ("defer", {"leases": [], "retry_after": 10**400}),
        ("extend", {"leases": [], "lease": 10**400}),
        ("put", {"lease": 10**400}),
    ],
)
async def test_a_huge_cbor_integer_duration_is_400(client: Client, route: str, body: Any) -> None:
    seeded = await seed(client)
    method, path = PATHS[route]
    response = await client.open(
        path, method=method, data=cbor2.dumps(body), headers={"Content-Type": "application/cbor"}
    )
    await expect_error(response, 400, "invalid_request")
    await assert_untouched(client, seeded)


async def test_creating_a_queue_with_a_huge_cbor_duration_is_400(client: Client) -> None:
    response = await client.put(
        "/v1/queues/fresh",
        data=cbor2.dumps({"dedup_window": 10**400}),
        headers={"Content-Type": "application/cbor"},
    )
    await expect_error(response, 400, "invalid_request")


# -- limits (§2) ------------------------------------------------------------------------------------


async def test_a_payload_of_exactly_1_mib_encoded_is_accepted(client: Client) -> None:
    await make_queue(client)
    response = await client.post("/v1/queues/jobs/messages", json={"payload": "x" * (MiB - 2)})
    assert response.status_code == 201


@pytest.mark.parametrize(
    ("data", "content_type", "named"),
    [
        (json.dumps({"payload": "x" * (MiB - 1)}).encode(), "application/json", "the message.payload"),
        (json.dumps({"payload": ["x" * 1000] * 1100}).encode(), "application/json", "the message.payload"),
        (
            json.dumps(
                {"payload": base64.b64encode(b"\0" * (MiB + 1)).decode(), "payload_encoding": "base64"}
            ).encode(),
            None,
            "the message.payload",
        ),
        (cbor2.dumps({"payload": b"\0" * (MiB + 1)}), "application/cbor", "the message.payload"),
        (
            json.dumps({"messages": [{"payload": 1}, {"payload": "x" * MiB}]}).encode(),
            "application/json",
            "messages[1].payload",
        ),
        (
            cbor2.dumps({"messages": [{"payload": b"\1"}, {"payload": 2}, {"payload": b"\0" * (MiB + 1)}]}),
            "application/cbor",
            "messages[2].payload",
        ),
    ],
)
async def test_a_payload_over_1_mib_encoded_is_413(
    client: Client, data: bytes, content_type: str | None, named: str
) -> None:
    seeded = await seed(client)
    response = await send_raw(client, "publish", data, content_type)
    assert named in await expect_error(response, 413, "payload_too_large")
    await assert_untouched(client, seeded)


async def test_a_byte_payload_of_exactly_1_mib_is_accepted(client: Client) -> None:
    await make_queue(client)
    response = await send_raw(client, "publish", cbor2.dumps({"payload": b"\1" * MiB}), "application/cbor")
    assert response.status_code == 201


async def test_headers_at_the_limits_are_accepted(client: Client) -> None:
    await make_queue(client)
    # 64 entries of 3 + 125 bytes: exactly 8 KiB
    headers = {f"h{i:02d}": "v" * 125 for i in range(64)}
    assert sum(len(k) + len(v) for k, v in headers.items()) == 8 * 1024
    response = await client.post("/v1/queues/jobs/messages", json={"payload": 1, "headers": headers})
    assert response.status_code == 201
    delivery = (await (await client.post("/v1/queues/jobs/claim", json={})).get_json())["messages"][0]
    assert delivery["headers"] == headers


async def test_headers_one_byte_over_8_kib_are_400(client: Client) -> None:
    seeded = await seed(client)
    headers = {f"h{i:02d}": "v" * 125 for i in range(64)}
    headers["h00"] += "v"
    response = await send(client, "publish", {"payload": 1, "headers": headers})
    assert "headers" in await expect_error(response, 400, "invalid_request")
    await assert_untouched(client, seeded)


async def test_a_batch_of_1000_is_accepted_and_1001_is_not(client: Client) -> None:
    seeded = await seed(client)
    response = await send(client, "publish", {"messages": [{"payload": i} for i in range(1001)]})
    await expect_error(response, 400, "invalid_request")
    await assert_untouched(client, seeded)
    response = await send(client, "publish", {"messages": [{"payload": i} for i in range(1000)]})
    assert response.status_code == 201
    assert len((await response.get_json())["messages"]) == 1000


async def test_a_batch_with_one_bad_message_publishes_none(client: Client) -> None:
    seeded = await seed(client)
    messages: list[Any] = [{"payload": i} for i in range(999)]
    messages.append({"payload": 1, "priority": "high"})
    response = await send(client, "publish", {"messages": messages})
    assert "messages[999].priority" in await expect_error(response, 400, "invalid_request")
    await assert_untouched(client, seeded)


@pytest.mark.parametrize("max_count", [1, 1000])
async def test_max_at_the_limits_is_accepted(client: Client, max_count: int) -> None:
    await make_queue(client)
    response = await client.post("/v1/queues/jobs/claim", json={"max": max_count})
    assert response.status_code == 200


async def test_1000_lease_ids_are_accepted(client: Client) -> None:
    await make_queue(client)
    leases = [f"l{i}" for i in range(1000)]
    response = await client.post("/v1/queues/jobs/ack", json={"leases": leases})
    assert await response.get_json() == {"acked": 0, "skipped": leases}


# -- accepted forms: unit strings, explicit defaults ------------------------------------------------


@pytest.mark.parametrize(
    ("route", "extra"),
    [
        ("nack", {"delay": "250ms"}),
        ("nack", {"delay": "5m"}),
        ("nack", {"delay": " 30s "}),
        ("nack", {"delay": ".5"}),
        ("nack", {"retryable": True, "reason": ""}),
        ("defer", {"retry_after": "250ms"}),
        ("defer", {"retry_after": "1d"}),
        ("defer", {"retry_after": 86400}),
        ("extend", {"lease": "250ms"}),
        ("extend", {"lease": "5m"}),
        ("extend", {"lease": "12h"}),
    ],
)
async def test_settle_accepts_unit_strings(client: Client, route: str, extra: dict[str, Any]) -> None:
    seeded = await seed(client)
    response = await send(client, route, {"leases": [seeded.lease], **extra})
    assert response.status_code == 200, await response.get_data()
    body = await response.get_json()
    assert body["skipped"] == []


@pytest.mark.parametrize(
    "fields",
    [
        {"delay": "250ms"},
        {"delay": "5m"},
        {"delay": "12h"},
        {"delay": "7d"},
        {"delay": 604800},
        {"delay": 0},
        {"delay": 0.5},
        {"priority": 2**31 - 1},
        {"priority": -(2**31)},
        {"on_duplicate": "return"},
        {"key": "k" * 1024},
        {"headers": {}},
        {"payload_encoding": None},
    ],
)
async def test_publish_accepts_edge_values(client: Client, fields: dict[str, Any]) -> None:
    await make_queue(client)
    response = await client.post("/v1/queues/jobs/messages", json={"payload": 1, **fields})
    assert response.status_code == 201, await response.get_data()


@pytest.mark.parametrize(
    "fields",
    [
        {"lease": "250ms"},
        {"lease": "5m"},
        {"lease": "12h"},
        {"lease": 0.1},
        {"wait": "250ms"},
        {"wait": 0},
        {"consumer": "w" * 256},
        {"max": 1000, "lease": 43200},
    ],
)
async def test_claim_accepts_edge_values(autojump_clock: Any, client: Client, fields: dict[str, Any]) -> None:
    await make_queue(client)
    response = await client.post("/v1/queues/jobs/claim", json=fields)
    assert response.status_code == 200, await response.get_data()


async def test_null_in_an_optional_field_is_the_same_as_leaving_it_out(client: Client) -> None:
    """Generated clients send ``null`` for a field they were given no value for: each optional field of
    the message routes takes it as its default (some did; ``max``, ``consumer``, ``on_duplicate``,
    ``retryable``, ``retry_after`` and ``all`` answered 400)."""
    await make_queue(client, max_attempts=2, retry_backoff={"type": "fixed", "base": 0})
    nulls = {"headers": None, "key": None, "delay": None, "priority": None, "payload_encoding": None}
    batch = [{"payload": n, **nulls, "on_duplicate": None} for n in (1, 2)]
    published = await client.post("/v1/queues/jobs/messages", json={"messages": batch})
    assert published.status_code == 201, await published.get_data()

    claim = {"consumer": None, "max": None, "lease": None, "wait": None}
    [first] = (await (await client.post("/v1/queues/jobs/claim", json=claim)).get_json())["messages"]
    assert (first["payload"], first["priority"], first["key"]) == (1, 0, None)  # max: 1
    shown = await (await client.get(f"/v1/queues/jobs/messages/{first['id']}")).get_json()
    assert shown["consumer"] == "anonymous"
    nack = {"leases": [first["lease_id"]], "retryable": None, "delay": None, "reason": None}
    nacked = await client.post("/v1/queues/jobs/nack", json=nack)
    assert await nacked.get_json() == {"nacked": 1, "dead_lettered": 0, "skipped": []}, "retryable: true"

    [second] = (await (await client.post("/v1/queues/jobs/claim", json={})).get_json())["messages"]
    defer = {"leases": [second["lease_id"]], "retry_after": None, "reason": None}
    assert (await (await client.post("/v1/queues/jobs/defer", json=defer)).get_json())["deferred"] == 1
    shown = await (await client.get(f"/v1/queues/jobs/messages/{second['id']}")).get_json()
    assert shown["state"] == "ready", "retry_after: 0"

    [again] = (await (await client.post("/v1/queues/jobs/claim", json={"max": 1})).get_json())["messages"]
    reject = {"leases": [again["lease_id"]], "retryable": False}
    assert (await (await client.post("/v1/queues/jobs/nack", json=reject)).get_json())["dead_lettered"] == 1
    redrive = {"ids": [again["id"]], "all": None, "to": None}
    redriven = await client.post("/v1/queues/jobs.dlq/redrive", json=redrive)
    assert redriven.status_code == 200, await redriven.get_data()


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/queues/jobs/claim?wait=5&max=10", {}),
        ("POST", "/v1/queues/jobs/messages?wait=5", {"payload": 1}),
        ("POST", "/v1/queues/jobs/ack?wait", {"leases": []}),
        ("PUT", "/v1/queues/jobs?lease=5", {}),
        ("GET", "/v1/queues/jobs?wait=5", None),
        ("GET", "/v1/queues?wait=5", None),
        ("POST", "/v1/queues/jobs/purge?wait=5", None),
        ("GET", "/v1/admin/snapshots?wait=5", None),
        ("POST", "/v1/messages/some-id/ack?wait=5", None),
    ],
)
async def test_a_query_on_a_route_that_reads_none_is_400(
    client: Client, method: str, path: str, body: Any
) -> None:
    """Browse and ``/work`` refused an unknown query parameter, every other route ignored one: a claim's
    ``?wait=5`` was answered at once, empty, a ``PUT ?lease=5`` left the lease as it was."""
    await make_queue(client, lease=30)
    kwargs = {} if body is None else {"json": body}
    message = await expect_error(await client.open(path, method=method, **kwargs), 400, "invalid_request")
    assert "unknown field 'wait' in the query" in message or "unknown field 'lease'" in message
    assert (await (await client.get("/v1/queues/jobs")).get_json())["config"]["lease"] == 30
    assert (await (await client.get("/v1/queues/jobs")).get_json())["stats"]["ready"] == 0


async def test_routes_that_read_a_query_and_those_outside_v1_still_take_one(client: Client) -> None:
    await make_queue(client)
    assert (await client.get("/v1/queues/jobs/messages?limit=5&state=ready")).status_code == 200
    assert (await client.get("/healthz?probe=1")).status_code == 200
    assert (await client.get("/compat/qhook/api/queues/jobs/messages?batch=1&extra=1")).status_code == 200
    cbor = await client.post("/v1/queues/jobs/claim?wait=5", json={}, headers={"Accept": "application/cbor"})
    assert cbor.status_code == 400 and cbor.content_type == "application/cbor"


async def test_an_empty_claim_body_uses_every_default(client: Client) -> None:
    await make_queue(client)
    await client.post("/v1/queues/jobs/messages", json={"payload": 1})
    response = await send_raw(client, "claim", b"", None)
    body = await response.get_json()
    assert len(body["messages"]) == 1
    response = await send_raw(client, "claim", b"", "application/cbor")
    assert response.status_code == 200


# -- Hypothesis: random JSON and CBOR values on every body route ----------------------------------

FIELD_NAMES = st.sampled_from(
    [
        "payload",
        "payload_encoding",
        "headers",
        "key",
        "on_duplicate",
        "delay",
        "priority",
        "messages",
        "consumer",
        "max",
        "lease",
        "wait",
        "leases",
        "retryable",
        "reason",
        "retry_after",
        "dealy",
    ]
)
DURATION_TEXT = st.sampled_from(["250ms", "5m", "12h", "0", "-1s", "1e3", "nan", "inf", "30 s", "", "base64"])


def values(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(FIELD_NAMES | st.text(max_size=8), children, max_size=5)
        ),
        max_leaves=16,
    )


JSON_VALUES = values(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=16)
    | DURATION_TEXT
)
# Integers stay within 64 bits here: beyond the float range they hit the OverflowError bug shown by
# test_a_huge_cbor_integer_duration_is_400, which would otherwise fail this test on every run.
CBOR_VALUES = values(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16)
    | DURATION_TEXT
)
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


async def check_fuzzed_request(route: str, data: bytes, content_type: str) -> None:
    # A broker of its own per example: pytest-trio sets up the `client` fixture once per test, and
    # its broker's nursery is closed after the first example's trio.run.
    async with open_broker(Settings(in_memory=True)) as broker, broker.app.test_app() as test_app:
        await check_request_on(test_app.test_client(), route, data, content_type)


async def check_request_on(client: Client, route: str, data: bytes, content_type: str) -> None:
    seeded = await seed(client)
    response = await send_raw(client, route, data, content_type)
    assert response.status_code < 500, await response.get_data()
    if response.status_code >= 400:
        assert 400 <= response.status_code < 500
        body = json.loads(await response.get_data())
        assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
        assert isinstance(body["error"]["code"], str) and isinstance(body["error"]["message"], str)
        await assert_untouched(client, seeded)


@FUZZ
@given(route=st.sampled_from(BODY_ROUTES), body=JSON_VALUES | st.dictionaries(FIELD_NAMES, JSON_VALUES))
async def test_random_json_never_gets_a_500(autojump_clock: Any, route: str, body: Any) -> None:
    await check_fuzzed_request(route, json.dumps(body).encode(), "application/json")


@FUZZ
@given(route=st.sampled_from(BODY_ROUTES), body=CBOR_VALUES | st.dictionaries(FIELD_NAMES, CBOR_VALUES))
async def test_random_cbor_never_gets_a_500(autojump_clock: Any, route: str, body: Any) -> None:
    await check_fuzzed_request(route, cbor2.dumps(body), "application/cbor")


@settings(FUZZ, max_examples=50)
@given(
    route=st.sampled_from(BODY_ROUTES),
    data=st.binary(max_size=64),
    content_type=st.sampled_from(["application/json", "application/cbor"]),
)
async def test_random_bytes_never_get_a_500(
    autojump_clock: Any, route: str, data: bytes, content_type: str
) -> None:
    await check_fuzzed_request(route, data, content_type)


@pytest.mark.parametrize("big_integer", [False, True])
async def test_json_nested_too_deeply_is_400(client: Client, big_integer: bool) -> None:
    await make_queue(client)
    leaf = b"12345678901234567890" if big_integer else b"1"  # a 19-digit run takes the exact parser
    body = b'{"payload": ' + b"[" * 100_000 + leaf + b"]" * 100_000 + b"}"
    response = await client.post(
        "/v1/queues/jobs/messages", data=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert (await response.get_json())["error"]["code"] == "invalid_request"


@pytest.mark.parametrize("from_cbor", [False, True])
async def test_a_payload_nested_past_254_levels_is_400_saying_so(client: Client, from_cbor: bool) -> None:
    await make_queue(client)

    def body(depth: int) -> tuple[bytes, str]:
        payload: Any = 1
        for _ in range(depth):
            payload = [payload]
        if from_cbor:
            return cbor2.dumps({"payload": payload}), "application/cbor"
        return json.dumps({"payload": payload}).encode(), "application/json"

    data, media_type = body(254)
    response = await client.post("/v1/queues/jobs/messages", data=data, headers={"Content-Type": media_type})
    assert response.status_code == 201
    data, media_type = body(255)
    response = await client.post("/v1/queues/jobs/messages", data=data, headers={"Content-Type": media_type})
    assert "nested more than 254 levels" in await expect_error(response, 400, "invalid_request")


async def test_the_nesting_limit_holds_with_an_integer_beyond_64_bits_first(client: Client) -> None:
    """orjson fails on the big integer before it reaches the depth, and the standard library's encoder,
    which then writes the payload, had no depth limit: 950 levels were kept."""
    await make_queue(client)
    for depth, status in ((253, 201), (254, 400), (900, 400)):
        payload: Any = 1
        for _ in range(depth):
            payload = [payload]
        body = json.dumps({"payload": [12345678901234567890123, payload]}).encode()
        response = await client.post(
            "/v1/queues/jobs/messages", data=body, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == status, depth


async def test_a_cbor_bignum_within_4300_digits_is_kept_exactly(client: Client) -> None:
    await make_queue(client)
    payload = [10**4299, -(10**4299), 2**64]
    response = await client.post(
        "/v1/queues/jobs/messages",
        data=cbor2.dumps({"payload": payload}),
        headers={"Content-Type": "application/cbor", "Accept": "application/cbor"},
    )
    assert response.status_code == 201
    claimed = await client.post("/v1/queues/jobs/claim", json={}, headers={"Accept": "application/cbor"})
    assert cbor2.loads(await claimed.get_data())["messages"][0]["payload"] == payload


async def test_a_refusal_never_quotes_a_value_whole_nor_fails_on_a_deep_one(client: Client) -> None:
    """A list nested 1,000 deep as ``template`` was a 500 (``RecursionError`` in ``repr``); a megabyte
    field name or queue name came back whole in the refusal."""
    deep = "[" * 1000 + "]" * 1000
    for _ in range(2):  # creating the queue, then updating it
        response = await client.put(
            "/v1/queues/jobs", data=f'{{"template": {deep}}}', headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400 and "not a list" in (await response.get_data(as_text=True))
        if "jobs" not in [q["name"] for q in (await (await client.get("/v1/queues")).get_json())["queues"]]:
            await make_queue(client)
    big = "x" * 1_000_000
    for body in ({big: 1}, {"dead_letter": big}, {"retry_backoff": {big: 1}}, {"push": {big: 1}}):
        response = await client.put("/v1/queues/jobs", json=body)
        assert response.status_code == 400 and len(await response.get_data()) < 600, list(body)
    response = await client.post("/v1/queues/jobs/claim", json={big: 1})
    assert response.status_code == 400 and len(await response.get_data()) < 600
    many = {f"field-{n:04}-" + "x" * 60: 1 for n in range(2000)}  # each cut short, yet all listed
    for body in ({"retry_backoff": many}, {"push": {"url": "http://a.test/", **many}}):
        response = await client.put("/v1/queues/jobs", json=body)
        assert response.status_code == 400 and len(await response.get_data()) < 600
        assert "and 1997 more" in await response.get_data(as_text=True)
    for url in ("ftp://a.test/" + "x" * 2000, "http://ops:s3cr/t-pw@a.test/"):  # a password with "/"
        response = await client.put("/v1/queues/jobs", json={"push": {"url": url}})
        text = await response.get_data(as_text=True)
        assert response.status_code == 400 and len(text) < 400 and "s3cr" not in text, text
    long_id = "z" * 10_000  # ids in paths too (the URL's limit lets ~15 kB through)
    for method, path in (
        ("GET", f"/v1/queues/jobs/messages/{long_id}"),
        ("POST", f"/v1/messages/{long_id}/ack"),
    ):
        response = await client.open(path, method=method, json={} if method == "POST" else None)
        assert response.status_code == 404 and len(await response.get_data()) < 400, path


async def test_self_described_cbor_is_read_as_its_content(client: Client) -> None:
    """Tag 55799 only marks the bytes as CBOR (RFC 8949 §3.4.6); it was refused as "a tuple is not JSON"."""
    await make_queue(client)
    payload = {"a": [1, {"b": [2]}]}
    body = cbor2.dumps(cbor2.CBORTag(55799, {"payload": cbor2.CBORTag(55799, payload)}))
    response = await client.post(
        "/v1/queues/jobs/messages", data=body, headers={"Content-Type": "application/cbor"}
    )
    assert response.status_code == 201, await response.get_data()
    claimed = await client.post("/v1/queues/jobs/claim", json={})
    assert (await claimed.get_json())["messages"][0]["payload"] == payload


async def test_invalid_utf8_in_json_is_400(client: Client) -> None:
    await make_queue(client)
    response = await client.post(
        "/v1/queues/jobs/messages",
        data=b'{"payload": "\xff\xfe"}',
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400


@pytest.mark.parametrize("name", ["..", "../etc", "..%2Fetc", "%2e%2e", "a/../b", ".hidden", "x" * 129])
async def test_queue_names_that_are_no_names_are_refused(client: Client, name: str) -> None:
    response = await client.put(f"/v1/queues/{name}", json={})
    assert response.status_code in (400, 404, 405)
    assert set((await response.get_json())["error"]) == {"code", "message"}


# -- text that UTF-8 cannot hold -------------------------------------------------------------------

LONE_SURROGATE = "\\udc00"  # the JSON escape of a lone low surrogate: orjson refuses it, json.loads not
BIG = "12345678901234567890"  # a run of 19 digits or more sends a body to the exact (standard) parser


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("publish", f'{{"payload": 1, "key": "{LONE_SURROGATE}{BIG}"}}'),
        ("publish", f'{{"payload": {BIG}, "headers": {{"h": "{LONE_SURROGATE}"}}}}'),
        ("publish", f'{{"payload": ["{LONE_SURROGATE}", {BIG}]}}'),
        ("publish", f'{{"payload": {{"{LONE_SURROGATE}": {BIG}}}}}'),
        ("claim", f'{{"consumer": "{LONE_SURROGATE}{BIG}"}}'),
        ("nack", f'{{"leases": ["{BIG}"], "reason": "{LONE_SURROGATE}"}}'),
    ],
)
async def test_a_lone_surrogate_escape_is_400_whichever_parser_reads_it(
    client: Client, route: str, body: str
) -> None:
    seeded = await seed(client)
    response = await send_raw(client, route, body.encode(), "application/json")
    assert "surrogate" in await expect_error(response, 400, "invalid_request")
    await assert_untouched(client, seeded)


async def test_a_lone_surrogate_escape_leaves_a_durable_broker_serving(tmp_path: Any) -> None:
    """Accepted, such a key failed in the journal's encoder and took the whole server down."""
    async with open_broker(Settings(data_dir=tmp_path)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await make_queue(client)
        body = f'{{"payload": 1, "key": "{LONE_SURROGATE}{BIG}"}}'.encode()
        response = await send_raw(client, "publish", body, "application/json")
        await expect_error(response, 400, "invalid_request")
        paired = f'{{"payload": 1, "key": "\\ud83d\\ude00{BIG}"}}'.encode()  # a pair is one character
        response = await send_raw(client, "publish", paired, "application/json")
        assert response.status_code == 201
        [delivery] = (await (await client.post("/v1/queues/jobs/claim", json={})).get_json())["messages"]
        assert delivery["key"] == f"\U0001f600{BIG}"


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (float("nan"), "nan"),
        ([1.0, float("inf")], "inf"),
        ({"at": datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)}, "datetime"),
        (uuid.UUID(int=7), "UUID"),
        (decimal.Decimal("1.5"), "Decimal"),
    ],
)
async def test_a_cbor_payload_json_would_change_is_400(client: Client, payload: Any, named: str) -> None:
    """§4: a payload is delivered verbatim. orjson writes NaN as null and a date or UUID as a string."""
    seeded = await seed(client)
    response = await client.post(
        "/v1/queues/jobs/messages",
        data=cbor2.dumps({"payload": payload}),
        headers={"Content-Type": "application/cbor"},
    )
    assert named in await expect_error(response, 400, "invalid_request")
    await assert_untouched(client, seeded)
