"""qhook's pull mode under /compat/qhook, driven as qhook's documented consumer drives it."""

from __future__ import annotations

import re
from typing import Any

import pytest
import structlog
import trio
from quart import Response

from broker.config import Settings, Token
from broker.server import Broker, open_broker
from tests.conftest import Client, make_queue

BASE = "/compat/qhook"
QUEUE = "billing"


async def publish(client: Client, *messages: dict[str, Any], queue: str = QUEUE) -> list[str]:
    response = await client.post(f"/v1/queues/{queue}/messages", json={"messages": list(messages)})
    assert response.status_code == 201, await response.get_data()
    return [ref["id"] for ref in (await response.get_json())["messages"]]


async def receive(client: Client, **params: Any) -> list[dict[str, Any]]:
    response = await client.get(f"{BASE}/api/queues/{QUEUE}/messages", query_string=params)
    assert response.status_code == 200, await response.get_data()
    messages: list[dict[str, Any]] = (await response.get_json()).get("messages", [])
    return messages


async def post_ids(client: Client, action: str, ids: list[str]) -> dict[str, Any]:
    response = await client.post(f"{BASE}/api/queues/{QUEUE}/{action}", json={"ids": ids})
    assert response.status_code == 200, await response.get_data()
    body: dict[str, Any] = await response.get_json()
    return body


async def state(client: Client, message_id: str) -> str:
    response = await client.get(f"/v1/queues/{QUEUE}/messages/{message_id}")
    result: str = (await response.get_json())["state"]
    return result


async def test_the_documented_python_consumer_loop(autojump_clock: Any, client: Client) -> None:
    """qhook's Python snippet, with requests swapped for the in-process client and one failure."""
    await make_queue(client, QUEUE)
    ids = await publish(client, *({"payload": {"n": n}} for n in range(7)))
    processed: list[Any] = []

    def process(payload: Any) -> None:
        if payload == {"n": 3} and payload not in processed:
            processed.append(payload)
            raise ValueError("first try fails")
        processed.append(payload)

    for _ in range(4):  # the snippet's `while True`, bounded
        messages = await receive(client, wait="10s", batch=5)
        if not messages:
            continue
        ack_ids = []
        for msg in messages:
            try:
                process(msg["payload"])
                ack_ids.append(msg["id"])
            except Exception:
                assert await post_ids(client, "nack", [msg["id"]]) == {"retried": 1, "dead": 0}
        if ack_ids:
            assert await post_ids(client, "ack", ack_ids) == {"acked": len(ack_ids)}
    assert sorted(p["n"] for p in processed) == [0, 1, 2, 3, 3, 4, 5, 6]
    assert [await state(client, message_id) for message_id in ids] == ["acked"] * 7


async def test_a_message_has_exactly_the_documented_fields(client: Client) -> None:
    await make_queue(client, QUEUE)
    [plain] = await publish(client, {"payload": {"amount_due": 1200}, "headers": {"content-type": "x"}})
    [event] = await publish(
        client,
        {"payload": [1], "headers": {"x-event-id": "evt_1", "x-event-type": "invoice.paid"}},
    )
    [keyed] = await publish(client, {"payload": "s", "key": "k-1"})
    [binary] = await publish(client, {"payload": "AAE=", "payload_encoding": "base64"})
    messages = await receive(client, batch=10)
    assert [msg["id"] for msg in messages] == [plain, event, keyed, binary]
    for msg in messages:
        assert set(msg) == {"id", "event_id", "event_type", "payload", "headers", "attempt", "created_at"}
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}", msg["created_at"])
        assert msg["attempt"] == 1
    first, second, third, fourth = messages
    assert first["payload"] == {"amount_due": 1200} and first["headers"] == {"content-type": "x"}
    assert (first["event_id"], first["event_type"]) == (plain, None)
    assert (second["event_id"], second["event_type"]) == ("evt_1", "invoice.paid")
    assert third["event_id"] == "k-1" and third["payload"] == "s"
    assert fourth["payload"] == "AAE="  # bytes as base64 text


async def test_an_empty_queue_answers_no_messages_after_the_wait(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, QUEUE)
    started = trio.current_time()
    assert await receive(client, wait="10s", batch=5) == []
    assert trio.current_time() - started == pytest.approx(10, abs=0.5)


async def test_a_publish_wakes_a_waiting_receive(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, QUEUE)
    got: list[dict[str, Any]] = []

    async def consumer() -> None:
        got.extend(await receive(client, wait="30s"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.sleep(2)
        await publish(client, {"payload": 1})
    assert [msg["payload"] for msg in got] == [1]


async def test_ack_by_id_settles_the_current_lease_after_a_redelivery(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, QUEUE, lease=1)
    [message_id] = await publish(client, {"payload": 1})
    assert [msg["attempt"] for msg in await receive(client)] == [1]
    await trio.sleep(5)  # the lease expires …
    assert [msg["attempt"] for msg in await receive(client)] == [2]  # … and the message goes out again
    assert await post_ids(client, "ack", [message_id]) == {"acked": 1}
    assert await state(client, message_id) == "acked"
    assert await post_ids(client, "ack", [message_id]) == {"acked": 0}  # idempotent


async def test_ack_by_id_settles_an_expired_lease_nobody_took_since(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, QUEUE, lease=1)
    [message_id] = await publish(client, {"payload": 1})
    await receive(client)
    await trio.sleep(5)
    assert (await (await client.get(f"/v1/queues/{QUEUE}")).get_json())["stats"]["ready"] == 1
    assert await post_ids(client, "ack", [message_id]) == {"acked": 1}
    assert await receive(client) == []


async def test_an_ack_or_nack_of_many_ids_is_two_commands(
    autojump_clock: Any, client: Client, sent: list[tuple[str, str]]
) -> None:
    """Each id's lease was asked for with a ``GetMessage`` of its own: up to 1,000 round trips to the
    queue's actor before the ``Ack``. The queue's core now answers them all in one ``FindLeases``."""
    await make_queue(client, QUEUE, lease=1)
    ids = await publish(client, *({"payload": n} for n in range(6)))
    await receive(client, batch=3)  # the first three, whose leases run out …
    await trio.sleep(5)
    await receive(client, batch=2)  # … and two of them go out again, under new leases
    never = ids[5]
    sent.clear()
    asked = [*ids[:4], ids[0], never, "no-such-id"]
    assert await post_ids(client, "ack", asked) == {"acked": 3}  # the redelivered two, the expired one
    assert sent == [(QUEUE, "FindLeases"), (QUEUE, "Ack")]
    sent.clear()
    assert await post_ids(client, "nack", [ids[3], ids[4]]) == {"retried": 0, "dead": 0}
    assert sent == [(QUEUE, "FindLeases")]  # never delivered: nothing to settle
    await receive(client, batch=2)
    sent.clear()
    assert await post_ids(client, "nack", [ids[3], ids[4], ids[0]]) == {"retried": 2, "dead": 0}
    assert sent == [(QUEUE, "FindLeases"), (QUEUE, "Nack")]


async def test_ids_never_delivered_or_unknown_settle_nothing(client: Client) -> None:
    await make_queue(client, QUEUE)
    [waiting] = await publish(client, {"payload": 1})
    assert await post_ids(client, "ack", [waiting, "no-such-id"]) == {"acked": 0}
    assert await post_ids(client, "nack", ["no-such-id"]) == {"retried": 0, "dead": 0}
    assert await state(client, waiting) == "ready"


async def test_nack_retries_until_max_attempts_then_counts_dead(client: Client) -> None:
    await make_queue(client, QUEUE, max_attempts=2)
    [message_id] = await publish(client, {"payload": 1})
    await receive(client)
    assert await post_ids(client, "nack", [message_id]) == {"retried": 1, "dead": 0}
    assert [msg["attempt"] for msg in await receive(client)] == [2]
    assert await post_ids(client, "nack", [message_id]) == {"retried": 0, "dead": 1}
    dead = await (await client.get(f"/v1/queues/{QUEUE}.dlq/messages")).get_json()
    assert [msg["headers"]["x-original-id"] for msg in dead["messages"]] == [message_id]


async def test_list_queues_in_qhook_shape(client: Client) -> None:
    await make_queue(client, QUEUE, lease=60)
    await make_queue(client, "fast", lease=0.5)
    await publish(client, {"payload": 1}, {"payload": 2})
    await receive(client)
    answer = await (await client.get(f"{BASE}/api/queues")).get_json()
    assert answer == {
        "queues": [
            {"name": QUEUE, "source": None, "events": [], "visibility_timeout": "60s", "depth": 2},
            {"name": "fast", "source": None, "events": [], "visibility_timeout": "500ms", "depth": 0},
        ]
    }


@pytest.mark.parametrize(
    "params",
    [
        {"wait": "31s"},
        {"wait": "soon"},
        {"batch": 0},
        {"batch": 101},
        {"batch": "five"},
        {"batch": "\u0662"},  # an Arabic-Indic 2: int() took it, as it takes "1_0" and " 2 "
        {"batch": "1_0"},
        {"batch": " 2 "},
    ],
)
async def test_receive_limits(client: Client, params: dict[str, Any]) -> None:
    await make_queue(client, QUEUE)
    response = await client.get(f"{BASE}/api/queues/{QUEUE}/messages", query_string=params)
    assert response.status_code == 400
    assert (await response.get_json())["error"]["code"] == "invalid_request"


@pytest.mark.parametrize("body", [{}, {"ids": "x"}, {"ids": [1]}, [], {"ids": [], "idz": ["x"]}])
async def test_a_malformed_ack_is_refused(client: Client, body: Any) -> None:
    await make_queue(client, QUEUE)
    response = await client.post(f"{BASE}/api/queues/{QUEUE}/ack", json=body)
    assert response.status_code == 400


async def test_a_head_request_leases_nothing(client: Client) -> None:
    """Werkzeug serves HEAD with every GET view, and this GET claims: a HEAD (a link checker, a proxy
    probing) leased messages and threw the answer away."""
    await make_queue(client, QUEUE)
    await publish(client, {"payload": 1})
    probed = await client.head(f"{BASE}/api/queues/{QUEUE}/messages")
    assert probed.status_code == 405 and probed.headers["Allow"] == "GET"
    assert [msg["attempt"] for msg in await receive(client)] == [1]  # still there, never leased


async def test_an_unknown_queue_is_404(client: Client) -> None:
    response = await client.get(f"{BASE}/api/queues/nowhere/messages")
    assert response.status_code == 404
    assert (await response.get_json())["error"]["code"] == "queue_not_found"


async def test_bearer_keys_are_broker_tokens() -> None:
    tokens = (
        Token("admin", "admin-secret-000000001", ("admin",)),
        Token("billing-key", "billing-secret-0000002", ("consume:billing",)),
        Token("other-key", "other-secret-000000003", ("consume:other",)),
    )
    async with open_broker(Settings(in_memory=True, tokens=tokens)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        admin = {"Authorization": "Bearer admin-secret-000000001"}
        for name in (QUEUE, "other"):
            assert (await client.put(f"/v1/queues/{name}", json={}, headers=admin)).status_code == 201
        url = f"{BASE}/api/queues/{QUEUE}/messages"
        assert (await client.get(url)).status_code == 401
        wrong = {"Authorization": "Bearer other-secret-000000003"}
        assert (await client.get(url, headers=wrong)).status_code == 403
        right = {"Authorization": "Bearer billing-secret-0000002"}
        assert (await client.get(url, headers=right)).status_code == 200
        ack = await client.post(f"{BASE}/api/queues/{QUEUE}/ack", json={"ids": []}, headers=wrong)
        assert ack.status_code == 403
        listed = await (await client.get(f"{BASE}/api/queues", headers=right)).get_json()
        assert [queue["name"] for queue in listed["queues"]] == [QUEUE]


async def test_lines_logged_during_a_receive_name_its_consumer(broker: Broker, client: Client) -> None:
    """§10: the consumer is bound on the log lines of its requests, as the native claim binds it."""

    @broker.app.after_request
    async def log_inside(response: Response) -> Response:  # runs in the view's own task
        structlog.get_logger("test").info("inside")
        return response

    await make_queue(client, QUEUE)
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        await receive(client)
    [line] = [entry for entry in logs if entry["event"] == "inside"]
    assert line["consumer"] == "qhook"
    [request] = [entry for entry in logs if entry["event"] == "request"]  # the Observer's, in its task
    assert request["consumer"] == "qhook"
