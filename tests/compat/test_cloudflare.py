"""Cloudflare Queues' HTTP pull under /compat/cloudflare, driven as a Cloudflare pull consumer does."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import cbor2
import pytest
import structlog
import trio
from quart import Response

from broker.config import Settings, Token
from broker.server import Broker, open_broker
from tests.conftest import Client, make_queue

ACCOUNT = "023e105f4ecef8ad9ca31a8372d0c353"
QUEUE = "jobs"
API = f"/compat/cloudflare/client/v4/accounts/{ACCOUNT}/queues/{QUEUE}/messages"


async def publish(client: Client, *messages: dict[str, Any]) -> list[str]:
    response = await client.post(f"/v1/queues/{QUEUE}/messages", json={"messages": list(messages)})
    assert response.status_code == 201, await response.get_data()
    return [ref["id"] for ref in (await response.get_json())["messages"]]


async def call(client: Client, action: str, body: Any, status: int = 200) -> dict[str, Any]:
    response = await client.post(f"{API}/{action}", json=body)
    assert response.status_code == status, await response.get_data()
    answer: dict[str, Any] = await response.get_json()
    assert set(answer) == {"success", "errors", "messages", "result"}
    return answer


async def pull(client: Client, **body: Any) -> list[dict[str, Any]]:
    answer = await call(client, "pull", body)
    assert answer["success"] is True and answer["errors"] == []
    messages: list[dict[str, Any]] = answer["result"]["messages"]
    return messages


async def ack(client: Client, **body: Any) -> dict[str, Any]:
    answer = await call(client, "ack", body)
    assert answer["success"] is True
    result: dict[str, Any] = answer["result"]
    return result


async def message_state(client: Client, message_id: str) -> dict[str, Any]:
    body: dict[str, Any] = await (await client.get(f"/v1/queues/{QUEUE}/messages/{message_id}")).get_json()
    return body


async def test_a_pull_consumer_loop(client: Client) -> None:
    """The loop Cloudflare's guide describes: pull a batch, ack what worked, retry what did not."""
    await make_queue(client, QUEUE)
    ids = await publish(client, *({"payload": {"n": n}} for n in range(7)))
    done: list[int] = []
    failed_once = False
    while True:
        messages = await pull(client, visibility_timeout_ms=6000, batch_size=5)
        if not messages:
            break
        acks, retries = [], []
        for msg in messages:
            payload = json.loads(base64.b64decode(msg["body"]))
            if payload["n"] == 2 and not failed_once:
                failed_once = True
                retries.append({"lease_id": msg["lease_id"]})
            else:
                done.append(payload["n"])
                acks.append({"lease_id": msg["lease_id"]})
        result = await ack(client, acks=acks, retries=retries)
        assert result == {"ackCount": len(acks), "retryCount": len(retries), "warnings": []}
    assert sorted(done) == list(range(7))
    assert [(await message_state(client, i))["state"] for i in ids] == ["acked"] * 7


async def test_the_pull_answer_in_cloudflare_shape(client: Client) -> None:
    await make_queue(client, QUEUE)
    before = time.time() * 1000
    ids = await publish(
        client,
        {"payload": "plain text"},
        {"payload": {"a": 1}},
        {"payload": "AAEC", "payload_encoding": "base64"},
        {"payload": "as json", "headers": {"cf-content-type": "json"}},
        *({"payload": n} for n in range(3)),
    )
    answer = await call(client, "pull", {})
    assert answer["messages"] == []
    result = answer["result"]
    assert result["message_backlog_count"] == 2
    messages = result["messages"]
    assert [msg["id"] for msg in messages] == ids[:5]  # batch_size defaults to 5
    for msg in messages:
        assert set(msg) == {"id", "body", "timestamp_ms", "attempts", "lease_id", "metadata"}
        assert msg["attempts"] == 1 and isinstance(msg["lease_id"], str)
        assert before - 1000 <= msg["timestamp_ms"] <= time.time() * 1000 + 1000
    text, obj, raw, forced, number = messages
    assert (text["body"], text["metadata"]) == ("plain text", {"CF-Content-Type": "text"})
    assert json.loads(base64.b64decode(obj["body"])) == {"a": 1}
    assert obj["metadata"] == {"CF-Content-Type": "json"}
    assert base64.b64decode(raw["body"]) == b"\x00\x01\x02"
    assert raw["metadata"] == {"CF-Content-Type": "bytes"}
    assert json.loads(base64.b64decode(forced["body"])) == "as json"
    assert json.loads(base64.b64decode(number["body"])) == 0


@pytest.mark.parametrize("field", ["visibility_timeout_ms", "visibility_timeout"])
async def test_the_visibility_timeout_is_the_lease_in_milliseconds(
    autojump_clock: Any, client: Client, field: str
) -> None:
    await make_queue(client, QUEUE)
    await publish(client, {"payload": 1})
    [msg] = await pull(client, **{field: 2000})
    assert await pull(client) == []
    await trio.sleep(3)
    [again] = await pull(client)
    assert again["id"] == msg["id"] and again["attempts"] == 2


async def test_a_late_ack_is_accepted_even_after_redelivery(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, QUEUE)
    [message_id] = await publish(client, {"payload": 1})
    [first] = await pull(client, visibility_timeout_ms=1000)
    await trio.sleep(2)
    [second] = await pull(client, visibility_timeout_ms=60_000)
    assert second["lease_id"] != first["lease_id"]
    # the first consumer's late ack settles the message …
    assert await ack(client, acks=[{"lease_id": first["lease_id"]}]) == {
        "ackCount": 1,
        "retryCount": 0,
        "warnings": [],
    }
    assert (await message_state(client, message_id))["state"] == "acked"
    # … and the second consumer's ack is no error either
    result = await ack(client, acks=[{"lease_id": second["lease_id"]}])
    assert result["ackCount"] == 0 and len(result["warnings"]) == 1


async def test_late_acks_are_settled_with_one_lookup_and_one_ack_whatever_their_number(
    autojump_clock: Any, client: Client, sent: list[tuple[str, str]]
) -> None:
    """Each late ack took a ``GetMessage`` and an ``Ack`` of its own. Two late acks of one message settle
    its latest delivery once: the first, as before, and the second is warned about."""
    await make_queue(client, QUEUE)
    ids = await publish(client, {"payload": 1}, {"payload": 2}, {"payload": 3})
    first = await pull(client, batch_size=3, visibility_timeout_ms=1000)
    await trio.sleep(2)
    second = await pull(client, batch_size=2, visibility_timeout_ms=1000)  # the first two, again
    await trio.sleep(2)
    third = await pull(client, batch_size=1, visibility_timeout_ms=60_000)  # the first, a third time
    assert [msg["id"] for msg in first + second + third] == [*ids, ids[0], ids[1], ids[0]]
    sent.clear()
    stale = [first[0], second[0], first[1], first[2]]  # all late: the first's twice
    result = await ack(client, acks=[{"lease_id": msg["lease_id"]} for msg in stale])
    assert result == {
        "ackCount": 3,
        "retryCount": 0,
        "warnings": [
            f"lease_id {second[0]['lease_id']} settled nothing: message {ids[0]} was already acknowledged, "
            "put back in the queue, or removed"
        ],
    }
    assert sent == [(QUEUE, "Ack"), (QUEUE, "FindLeases"), (QUEUE, "Ack")]
    for message_id in ids:
        assert (await message_state(client, message_id))["state"] == "acked"
    sent.clear()
    result = await ack(client, acks=[{"lease_id": third[0]["lease_id"]}])  # acked already, by another
    assert (result["ackCount"], len(result["warnings"])) == (0, 1)
    assert sent == [(QUEUE, "Ack"), (QUEUE, "FindLeases")]  # its latest lease is the one sent: no Ack


async def test_an_ack_after_the_timeout_but_before_redelivery_settles(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, QUEUE)
    [message_id] = await publish(client, {"payload": 1})
    [msg] = await pull(client, visibility_timeout_ms=1000)
    await trio.sleep(2)
    assert (await ack(client, acks=[{"lease_id": msg["lease_id"]}]))["ackCount"] == 1
    assert (await message_state(client, message_id))["state"] == "acked"


async def test_a_retry_with_delay_seconds_holds_the_message_back(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, QUEUE)
    await publish(client, {"payload": 1})
    [msg] = await pull(client)
    result = await ack(client, retries=[{"lease_id": msg["lease_id"], "delay_seconds": 10}])
    assert result == {"ackCount": 0, "retryCount": 1, "warnings": []}
    assert await pull(client) == []
    await trio.sleep(11)
    assert [again["attempts"] for again in await pull(client)] == [2]


async def test_a_stale_retry_and_a_foreign_lease_id_are_warnings(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, QUEUE)
    await publish(client, {"payload": 1})
    [first] = await pull(client, visibility_timeout_ms=1000)
    await trio.sleep(2)
    await pull(client)
    result = await ack(client, acks=[{"lease_id": "not-ours"}], retries=[{"lease_id": first["lease_id"]}])
    assert (result["ackCount"], result["retryCount"], len(result["warnings"])) == (0, 0, 2)


async def test_each_lease_is_settled_and_warned_about_once(autojump_clock: Any, client: Client) -> None:
    """A lease named twice was acked once yet warned about as "already acknowledged", and the warnings
    showed Python's reprs of what the client sent (``None``, ``['a']``)."""
    await make_queue(client, QUEUE)
    await publish(client, {"payload": 1}, {"payload": 2})
    first, second = await pull(client, batch_size=2)
    result = await ack(
        client,
        acks=[{"lease_id": first["lease_id"]}, {"lease_id": first["lease_id"]}]
        + [{"lease_id": foreign} for foreign in ("garbage", None, ["a"], "garbage")],
        retries=[
            {"lease_id": second["lease_id"], "delay_seconds": 5},
            {"lease_id": second["lease_id"]},
            {"lease_id": "garbage"},  # named in acks already: one warning for the call
        ],
    )
    assert result == {
        "ackCount": 1,
        "retryCount": 1,
        "warnings": [
            'lease_id "garbage" is not one this broker handed out',
            "lease_id null is not one this broker handed out",
            'lease_id ["a"] is not one this broker handed out',
        ],
    }
    assert await pull(client) == []  # the first retry of the lease gave its delay: 5 s
    await trio.sleep(6)
    assert [again["id"] for again in await pull(client)] == [second["id"]]
    cbor = await client.post(
        f"{API}/ack",
        data=cbor2.dumps(
            {"acks": [{"lease_id": value} for value in (b"bytes", float("nan"), None, b"other", b"bytes")]}
        ),
        headers={"Content-Type": "application/cbor"},
    )
    # What JSON cannot write shows as its type: orjson wrote NaN as null, one warning with a real null.
    # Two byte strings are two leases, each warned about once, though both show as <bytes>.
    assert (await cbor.get_json())["result"]["warnings"] == [
        "lease_id <bytes> is not one this broker handed out",
        "lease_id <float> is not one this broker handed out",
        "lease_id null is not one this broker handed out",
        "lease_id <bytes> is not one this broker handed out",
    ]


async def test_a_huge_foreign_lease_id_is_quoted_cut_short(client: Client) -> None:
    """It came back whole, seven times its size as JSON escapes ("\\u0000" for each NUL)."""
    await make_queue(client, QUEUE)
    result = await ack(client, acks=[{"lease_id": "\0" * 1_000_000}])
    [warning] = result["warnings"]
    assert len(warning) < 200 and "(6000002 characters)" in warning
    refused = await call(client, "ack", {"retries": [{"lease_id": "x", "delay_seconds": "9" * 100_000}]}, 400)
    assert len(refused["errors"][0]["message"]) < 300
    deep = "[" * 1000 + "]" * 1000  # a repr this deep raised RecursionError: a 500
    response = await client.post(
        f"{API}/ack",
        data=f'{{"acks": [{{"lease_id": {deep}}}]}}',
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 200
    assert (await response.get_json())["result"]["warnings"] == [
        "lease_id <list> is not one this broker handed out"
    ]


async def test_a_late_ack_of_a_message_another_consumer_retried_says_so(
    autojump_clock: Any, client: Client
) -> None:
    """The warning said "already acknowledged or is gone" of a message that was back in the queue."""
    await make_queue(client, QUEUE)
    [message_id] = await publish(client, {"payload": 1})
    [first] = await pull(client, visibility_timeout_ms=1000)
    await trio.sleep(2)
    [second] = await pull(client)
    retried = await ack(client, retries=[{"lease_id": second["lease_id"], "delay_seconds": 60}])
    assert retried["retryCount"] == 1
    result = await ack(client, acks=[{"lease_id": first["lease_id"]}])
    assert result == {
        "ackCount": 0,
        "retryCount": 0,
        "warnings": [
            f"lease_id {first['lease_id']} settled nothing: message {message_id} was already acknowledged, "
            "put back in the queue, or removed"
        ],
    }
    assert (await message_state(client, message_id))["state"] == "delayed"


@pytest.mark.parametrize(
    ("action", "body"),
    [
        ("pull", {"batch_size": 101}),
        ("pull", {"batch_size": 0}),
        ("pull", {"visibility_timeout_ms": 50}),
        ("pull", {"visibility_timeout_ms": 43_200_001}),
        ("pull", {"visibility_timeout": "10s"}),
        ("pull", []),
        ("ack", {"acks": [{"id": "x"}]}),
        ("ack", {"acks": "x"}),
        ("ack", {"retries": [{"lease_id": "x", "delay_seconds": -1}]}),
    ],
)
async def test_bad_requests_answer_the_error_envelope(client: Client, action: str, body: Any) -> None:
    await make_queue(client, QUEUE)
    answer = await call(client, action, body, status=400)
    assert answer["success"] is False and answer["result"] is None
    [error] = answer["errors"]
    assert error["code"] == 400 and error["message"].startswith("invalid_request: ")


async def test_an_unknown_queue_answers_the_error_envelope(client: Client) -> None:
    response = await client.post(f"/compat/cloudflare/client/v4/accounts/{ACCOUNT}/queues/nope/messages/pull")
    assert response.status_code == 404
    answer = await response.get_json()
    assert answer["success"] is False and answer["errors"][0]["code"] == 404


async def test_a_body_over_the_limit_answers_the_envelope_with_the_broker_s_code(client: Client) -> None:
    await make_queue(client, QUEUE)
    response = await client.post(f"{API}/ack", data=b" " * (16 * 1024 * 1024 + 1))
    assert response.status_code == 413
    [error] = (await response.get_json())["errors"]
    assert error["code"] == 413 and error["message"].startswith("payload_too_large: "), error


async def test_a_body_without_a_json_content_type_is_read_as_json(client: Client) -> None:
    await make_queue(client, QUEUE)
    await publish(client, {"payload": 1}, {"payload": 2})
    response = await client.post(
        f"{API}/pull",
        data=b'{"batch_size": 1}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert len((await response.get_json())["result"]["messages"]) == 1


async def test_the_api_token_is_a_broker_token() -> None:
    tokens = (
        Token("admin", "admin-secret-000000001", ("admin",)),
        Token("puller", "puller-secret-00000002", (f"consume:{QUEUE}",)),
        Token("publisher", "publisher-secret-00003", (f"publish:{QUEUE}",)),
    )
    async with open_broker(Settings(in_memory=True, tokens=tokens)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        created = await client.put(
            f"/v1/queues/{QUEUE}", json={}, headers={"Authorization": "Bearer admin-secret-000000001"}
        )
        assert created.status_code == 201
        for secret, status in (
            (None, 401),
            ("publisher-secret-00003", 403),
            ("puller-secret-00000002", 200),
        ):
            headers = {} if secret is None else {"Authorization": f"Bearer {secret}"}
            for action in ("pull", "ack"):
                response = await client.post(f"{API}/{action}", json={}, headers=headers)
                assert response.status_code == status


async def test_lines_logged_during_a_pull_name_its_consumer(broker: Broker, client: Client) -> None:
    """§10: the consumer is bound on the log lines of its requests, as the native claim binds it."""

    @broker.app.after_request
    async def log_inside(response: Response) -> Response:  # runs in the view's own task
        structlog.get_logger("test").info("inside")
        return response

    await make_queue(client, QUEUE)
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        await pull(client)
    [line] = [entry for entry in logs if entry["event"] == "inside"]
    assert line["consumer"] == "cloudflare"
    [request] = [entry for entry in logs if entry["event"] == "request"]  # the Observer's, in its task
    assert request["consumer"] == "cloudflare"
