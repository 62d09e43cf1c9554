"""§3 over HTTP: creating, updating, reading, listing, deleting and purging queues, and the §2 error
shape of the routes around them."""

from __future__ import annotations

from typing import Any

import cbor2
import pytest
import trio

from tests.conftest import Client, make_queue

DEFAULT_CONFIG = {
    "lease": 30.0,
    "max_attempts": 0,
    "dead_letter": "jobs.dlq",
    "retry_backoff": {"type": "fixed", "base": 0.0, "max": 3600.0},
    "max_depth": 0,
    "rate_limit": None,
    "message_ttl": 0.0,
    "claim_window": 0.0,
    "durable": True,
    "dedup_window": 86400.0,
    "push": None,
}

EMPTY_STATS = {
    "ready": 0,
    "delayed": 0,
    "in_flight": 0,
    "published_total": 0,
    "acked_total": 0,
    "nacked_total": 0,
    "deferred_total": 0,
    "dead_lettered_total": 0,
    "expired_total": 0,
    "lease_expired_total": 0,
    "oldest_ready_age": None,
}


async def expect_error(response: Any, status: int, code: str) -> str:
    """Assert the §2 error shape with this status and code; return the message."""
    assert response.status_code == status, await response.get_data()
    body = await response.get_json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message"}
    assert body["error"]["code"] == code
    message: str = body["error"]["message"]
    assert isinstance(message, str) and message
    return message


async def get_queue(client: Client, name: str = "jobs") -> dict[str, Any]:
    response = await client.get(f"/v1/queues/{name}")
    assert response.status_code == 200, await response.get_data()
    body: dict[str, Any] = await response.get_json()
    return body


async def publish(client: Client, *payloads: Any, queue: str = "jobs", **fields: Any) -> list[str]:
    response = await client.post(
        f"/v1/queues/{queue}/messages", json={"messages": [{"payload": p, **fields} for p in payloads]}
    )
    assert response.status_code == 201, await response.get_data()
    return [m["id"] for m in (await response.get_json())["messages"]]


async def claim(client: Client, queue: str = "jobs", **fields: Any) -> dict[str, Any]:
    response = await client.post(f"/v1/queues/{queue}/claim", json=fields)
    assert response.status_code == 200, await response.get_data()
    body: dict[str, Any] = await response.get_json()
    return body


async def send(client: Client, method: str, path: str, body: Any = None) -> Any:
    if body is None:
        return await client.open(path, method=method)
    return await client.open(path, method=method, json=body)


# -- create and update ---------------------------------------------------------------------------


async def test_put_creates_a_queue_with_the_default_config(client: Client) -> None:
    response = await client.put("/v1/queues/jobs", json={})
    assert response.status_code == 201
    assert await response.get_json() == {"name": "jobs", "config": DEFAULT_CONFIG, "stats": EMPTY_STATS}


async def test_put_with_no_body_creates_with_defaults(client: Client) -> None:
    response = await client.put("/v1/queues/jobs")
    assert response.status_code == 201
    assert (await response.get_json())["config"] == DEFAULT_CONFIG


async def test_put_creates_with_a_partial_config(client: Client) -> None:
    body = await make_queue(client, lease=5, max_depth=10, durable=False)
    assert body["name"] == "jobs"
    assert body["config"] == {**DEFAULT_CONFIG, "lease": 5.0, "max_depth": 10, "durable": False}
    assert body["stats"] == EMPTY_STATS


async def test_default_dead_letter_names_the_queue_itself(client: Client) -> None:
    body = await make_queue(client, "orders.v2")
    assert body["config"]["dead_letter"] == "orders.v2.dlq"


async def test_put_on_an_existing_queue_updates_only_the_fields_sent(client: Client) -> None:
    await make_queue(client, lease=5)
    response = await client.put("/v1/queues/jobs", json={"max_depth": 100})
    assert response.status_code == 200
    body = await response.get_json()
    assert set(body) == {"name", "config", "stats"}
    assert body["config"] == {**DEFAULT_CONFIG, "lease": 5.0, "max_depth": 100}
    assert (await get_queue(client))["config"] == body["config"]


async def test_a_put_answers_with_its_own_change_among_puts_and_deletes(client: Client) -> None:
    """A PUT's answer was a read after its change: another PUT's config, or a 404 once a DELETE came
    between, though the PUT had been applied (``registry.put`` never answers 404)."""
    answers: list[tuple[int, Any, float]] = []

    async def put(lease: float) -> None:
        response = await client.put("/v1/queues/race", json={"lease": lease})
        answers.append((response.status_code, (await response.get_json())["config"]["lease"], lease))

    async def delete() -> None:
        assert (await client.delete("/v1/queues/race")).status_code in (204, 404)

    for _ in range(20):
        answers.clear()
        async with trio.open_nursery() as nursery:
            for n in range(1, 7):
                nursery.start_soon(put, float(n))
            nursery.start_soon(delete)
        assert [(shown, status in (200, 201)) for status, shown, lease in answers] == [
            (lease, True) for _, _, lease in answers
        ]
        await client.delete("/v1/queues/race")


async def test_update_keeps_the_messages(client: Client) -> None:
    await make_queue(client)
    await publish(client, 1, 2)
    response = await client.put("/v1/queues/jobs", json={"lease": 60})
    assert response.status_code == 200
    assert (await response.get_json())["stats"]["ready"] == 2


async def test_update_with_an_empty_body_changes_nothing(client: Client) -> None:
    created = await make_queue(client, lease=7)
    response = await client.put("/v1/queues/jobs", json={})
    assert response.status_code == 200
    assert (await response.get_json())["config"] == created["config"]


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("lease", "250ms", 0.25),
        ("lease", "5m", 300.0),
        ("lease", "12h", 43200.0),
        ("lease", 0.1, 0.1),
        ("dedup_window", "30s", 30.0),
        ("dedup_window", 0, 0.0),
        ("dead_letter", None, None),
        ("dead_letter", "graveyard", "graveyard"),
        (
            "retry_backoff",
            {"type": "exponential", "base": 2},
            {"type": "exponential", "base": 2.0, "max": 3600.0},
        ),
        ("retry_backoff", {"base": "1m", "max": "1h"}, {"type": "fixed", "base": 60.0, "max": 3600.0}),
        ("max_attempts", 0, 0),
        ("rate_limit", None, None),
        ("message_ttl", 0, 0.0),
        ("claim_window", "0s", 0.0),
    ],
)
async def test_valid_config_values_are_accepted(client: Client, field: str, value: Any, shown: Any) -> None:
    body = await make_queue(client, **{field: value})
    assert body["config"][field] == shown


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lease", 0),
        ("lease", 0.05),
        ("lease", 43200.5),
        ("lease", -1),
        ("lease", "soon"),
        ("lease", "5 minutes"),
        ("lease", True),
        ("lease", None),
        ("lease", [30]),
        ("max_depth", -1),
        ("max_depth", 1.5),
        ("max_depth", "10"),
        ("max_depth", False),
        ("durable", "yes"),
        ("durable", 1),
        ("dedup_window", -5),
        ("dedup_window", "1y"),
        ("dead_letter", 7),
        ("retry_backoff", "fixed"),
        ("retry_backoff", {"type": "linear"}),
        ("retry_backoff", {"type": "fixed", "factor": 2}),
        ("retry_backoff", {"base": -1}),
        ("retry_backoff", None),
        ("max_attempts", -1),
        ("max_attempts", "3"),
        ("rate_limit", {"max": 0, "per": 1}),
        ("rate_limit", {"max": 5}),
        ("rate_limit", 5),
        ("message_ttl", -1),
        ("claim_window", 6),
    ],
)
async def test_invalid_config_values_are_400_naming_the_field(client: Client, field: str, value: Any) -> None:
    response = await client.put("/v1/queues/jobs", json={field: value})
    message = await expect_error(response, 400, "invalid_request")
    assert field in message
    assert (await client.get("/v1/queues/jobs")).status_code == 404, "a refused create leaves no queue"


@pytest.mark.parametrize("value", ["bad name", "", "-x"])
async def test_an_invalid_dead_letter_name_is_400_naming_the_field(client: Client, value: str) -> None:
    response = await client.put("/v1/queues/jobs", json={"dead_letter": value})
    message = await expect_error(response, 400, "invalid_request")
    assert "dead_letter" in message


async def test_an_unknown_config_field_is_400_naming_it(client: Client) -> None:
    response = await client.put("/v1/queues/jobs", json={"leese": 30})
    message = await expect_error(response, 400, "invalid_request")
    assert "leese" in message


async def test_an_invalid_update_is_refused_whole_and_changes_nothing(client: Client) -> None:
    created = await make_queue(client, lease=5)
    response = await client.put("/v1/queues/jobs", json={"max_depth": 10, "lease": -1})
    message = await expect_error(response, 400, "invalid_request")
    assert "lease" in message
    assert (await get_queue(client))["config"] == created["config"]


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("max_attempts", 3, 3),
        ("rate_limit", {"max": 10, "per": "500ms"}, {"max": 10, "per": 0.5}),
        ("message_ttl", "1h", 3600.0),
        ("claim_window", 0.5, 0.5),
        ("dead_letter", None, None),
        ("dead_letter", "failures", "failures"),
    ],
)
async def test_policies_are_set_at_creation_and_by_update(
    client: Client, field: str, value: Any, shown: Any
) -> None:
    created = await make_queue(client, **{field: value})
    assert created["config"] == {**DEFAULT_CONFIG, field: shown}
    await make_queue(client, "other")
    response = await client.put("/v1/queues/other", json={field: value})
    assert response.status_code == 200
    assert (await response.get_json())["config"] == {
        **DEFAULT_CONFIG,
        "dead_letter": "other.dlq",
        field: shown,
    }


@pytest.mark.parametrize("body", [[], "lease", 30, None, True])
async def test_a_config_that_is_not_an_object_is_400(client: Client, body: Any) -> None:
    await expect_error(await client.put("/v1/queues/jobs", json=body), 400, "invalid_request")
    await make_queue(client)
    await expect_error(await client.put("/v1/queues/jobs", json=body), 400, "invalid_request")


async def test_max_depth_refuses_the_whole_batch_with_429(client: Client) -> None:
    await make_queue(client, max_depth=2)
    await publish(client, "a")
    response = await client.post(
        "/v1/queues/jobs/messages", json={"messages": [{"payload": "b"}, {"payload": "c"}]}
    )
    await expect_error(response, 429, "queue_full")
    stats = (await get_queue(client))["stats"]
    assert (stats["ready"], stats["published_total"]) == (1, 1)
    await publish(client, "b")  # exactly at max_depth is fine
    assert (await get_queue(client))["stats"]["ready"] == 2


# -- read and list -------------------------------------------------------------------------------


async def test_get_one_answers_name_config_and_stats(client: Client) -> None:
    await make_queue(client, lease=12)
    await publish(client, 1, 2, 3)
    await publish(client, 4, delay=60)
    await claim(client)
    body = await get_queue(client)
    assert body["name"] == "jobs"
    assert body["config"]["lease"] == 12.0
    stats = body["stats"]
    assert set(stats) == set(EMPTY_STATS)
    assert (stats["ready"], stats["delayed"], stats["in_flight"], stats["published_total"]) == (2, 1, 1, 4)
    assert isinstance(stats["oldest_ready_age"], float) and stats["oldest_ready_age"] >= 0


async def test_get_a_missing_queue_is_404(client: Client) -> None:
    await expect_error(await client.get("/v1/queues/nope"), 404, "queue_not_found")


async def test_list_is_empty_at_first(client: Client) -> None:
    response = await client.get("/v1/queues")
    assert response.status_code == 200
    assert await response.get_json() == {"queues": []}


async def test_list_shows_every_queue_sorted_by_name(client: Client) -> None:
    for name in ("zeta", "alpha", "mid-1"):
        await make_queue(client, name)
    await publish(client, "x", queue="mid-1")
    body = await (await client.get("/v1/queues")).get_json()
    assert [q["name"] for q in body["queues"]] == ["alpha", "mid-1", "zeta"]
    by_name = {q["name"]: q for q in body["queues"]}
    alone = await get_queue(client, "mid-1")
    assert by_name["mid-1"]["config"] == alone["config"]
    assert {**by_name["mid-1"]["stats"], "oldest_ready_age": 0} == {**alone["stats"], "oldest_ready_age": 0}
    assert by_name["mid-1"]["stats"]["ready"] == 1
    assert by_name["alpha"]["config"]["dead_letter"] == "alpha.dlq"


@pytest.mark.parametrize("count", [0, 1, 30])
async def test_the_list_in_cbor_holds_what_the_list_in_json_holds(client: Client, count: int) -> None:
    """The listing is written a queue at a time (``routes.encode_listing``), in either encoding."""
    for number in range(count):
        await make_queue(client, f"q{number:02d}", max_attempts=number)
    as_json = await client.get("/v1/queues")
    as_cbor = await client.get("/v1/queues", headers={"Accept": "application/cbor"})
    assert (as_json.content_type, as_cbor.content_type) == ("application/json", "application/cbor")
    listed = await as_json.get_json()
    assert cbor2.loads(await as_cbor.get_data()) == listed
    assert [q["config"]["max_attempts"] for q in listed["queues"]] == list(range(count))


# -- delete ----------------------------------------------------------------------------------------


async def test_delete_is_204_and_the_queue_is_gone(client: Client) -> None:
    await make_queue(client)
    await publish(client, 1)
    response = await client.delete("/v1/queues/jobs")
    assert response.status_code == 204
    assert await response.get_data() == b""
    assert await (await client.get("/v1/queues")).get_json() == {"queues": []}


ROUTES_OF_A_QUEUE = [
    ("GET", "/v1/queues/jobs", None),
    ("DELETE", "/v1/queues/jobs", None),
    ("POST", "/v1/queues/jobs/purge", None),
    ("POST", "/v1/queues/jobs/messages", {"payload": 1}),
    ("GET", "/v1/queues/jobs/messages", None),
    ("GET", "/v1/queues/jobs/messages/some-id", None),
    ("DELETE", "/v1/queues/jobs/messages/some-id", None),
    ("POST", "/v1/queues/jobs/claim", {"consumer": "w"}),
    ("POST", "/v1/queues/jobs/ack", {"leases": ["x"]}),
    ("POST", "/v1/queues/jobs/nack", {"leases": ["x"]}),
    ("POST", "/v1/queues/jobs/defer", {"leases": ["x"]}),
    ("POST", "/v1/queues/jobs/extend", {"leases": ["x"], "lease": 10}),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES_OF_A_QUEUE)
async def test_a_deleted_queue_is_404_on_every_route(
    client: Client, method: str, path: str, body: Any
) -> None:
    await make_queue(client)
    await publish(client, 1)
    assert (await client.delete("/v1/queues/jobs")).status_code == 204
    response = await send(client, method, path, body)
    await expect_error(response, 404, "queue_not_found")


@pytest.mark.parametrize(("method", "path", "body"), ROUTES_OF_A_QUEUE)
async def test_a_queue_that_never_existed_is_404_on_every_route(
    client: Client, method: str, path: str, body: Any
) -> None:
    response = await send(client, method, path, body)
    await expect_error(response, 404, "queue_not_found")


async def test_a_deleted_queue_can_be_created_again_empty_with_fresh_ids(client: Client) -> None:
    await make_queue(client, lease=5)
    [old_id] = await publish(client, "old")
    assert (await client.delete("/v1/queues/jobs")).status_code == 204
    body = await make_queue(client)
    assert body["config"] == DEFAULT_CONFIG
    assert body["stats"] == EMPTY_STATS
    [new_id] = await publish(client, "new")
    assert new_id != old_id
    claimed = await claim(client, max=10)
    assert [m["payload"] for m in claimed["messages"]] == ["new"]


# -- purge -----------------------------------------------------------------------------------------


async def test_purge_removes_ready_and_delayed_and_leaves_leases_to_finish(client: Client) -> None:
    await make_queue(client)
    await publish(client, "leased-1", "leased-2")
    leased = (await claim(client, max=2))["messages"]
    await publish(client, "ready-1", "ready-2")
    await publish(client, "later", delay=300)

    response = await client.post("/v1/queues/jobs/purge")
    assert response.status_code == 200
    assert await response.get_json() == {"purged": 3}
    stats = (await get_queue(client))["stats"]
    assert (stats["ready"], stats["delayed"], stats["in_flight"]) == (0, 0, 2)

    acked = await client.post("/v1/queues/jobs/ack", json={"leases": [leased[0]["lease_id"]]})
    assert await acked.get_json() == {"acked": 1, "skipped": []}
    nacked = await client.post("/v1/queues/jobs/nack", json={"leases": [leased[1]["lease_id"]]})
    assert (await nacked.get_json())["nacked"] == 1
    again = await claim(client, max=10)
    assert [m["payload"] for m in again["messages"]] == ["leased-2"]


async def test_purge_of_an_empty_queue_purges_nothing(client: Client) -> None:
    await make_queue(client)
    response = await client.post("/v1/queues/jobs/purge")
    assert response.status_code == 200
    assert await response.get_json() == {"purged": 0}


async def test_purged_messages_are_gone_for_good(client: Client) -> None:
    await make_queue(client)
    [message_id] = await publish(client, "x")
    await client.post("/v1/queues/jobs/purge")
    await expect_error(await client.get(f"/v1/queues/jobs/messages/{message_id}"), 404, "message_not_found")
    assert (await claim(client))["messages"] == []
    await publish(client, "y")
    assert [m["payload"] for m in (await claim(client))["messages"]] == ["y"]


# -- names and routes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["-leading-dash", ".hidden", "_under", "a" * 129, "has%20space", "semi;colon", "caf%C3%A9", "a+b", "a~b"],
)
async def test_invalid_queue_names_are_400(client: Client, name: str) -> None:
    message = await expect_error(await client.put(f"/v1/queues/{name}", json={}), 400, "invalid_request")
    assert "queue name" in message
    await expect_error(await client.get(f"/v1/queues/{name}"), 400, "invalid_request")
    await expect_error(
        await client.post(f"/v1/queues/{name}/messages", json={"payload": 1}), 400, "invalid_request"
    )
    assert await (await client.get("/v1/queues")).get_json() == {"queues": []}


@pytest.mark.parametrize("name", ["a", "A9", "a" * 128, "x.y-z_0", "9lives", "a..b", "a-"])
async def test_valid_queue_names_are_accepted(client: Client, name: str) -> None:
    body = await make_queue(client, name)
    assert body["name"] == name
    assert (await get_queue(client, name))["name"] == name


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/nope"),
        ("GET", "/v1"),
        ("GET", "/v1/queue/jobs"),
        ("POST", "/v1/queues/jobs/claims"),
        ("GET", "/v1/queues/jobs/messages/an-id/history"),
        ("PUT", "/v1/queues/a/b"),
    ],
)
async def test_an_unknown_route_is_404_in_the_error_shape(client: Client, method: str, path: str) -> None:
    await expect_error(await client.open(path, method=method), 404, "not_found")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/queues"),
        ("PATCH", "/v1/queues/jobs"),
        ("POST", "/v1/queues/jobs"),
        ("GET", "/v1/queues/jobs/claim"),
        ("PUT", "/v1/queues/jobs/messages"),
        ("GET", "/v1/queues/jobs/ack"),
        ("GET", "/v1/queues/jobs/purge"),
        ("POST", "/v1/queues/jobs/messages/an-id"),
    ],
)
async def test_a_wrong_method_is_405_in_the_error_shape(client: Client, method: str, path: str) -> None:
    await make_queue(client)
    response = await client.open(path, method=method)
    await expect_error(response, 405, "method_not_allowed")


async def test_a_405_names_the_allowed_methods(client: Client) -> None:
    await make_queue(client)
    response = await client.open("/v1/queues/jobs/claim", method="GET")
    assert response.status_code == 405
    assert "POST" in response.headers.get("Allow", "")


async def test_errors_come_as_cbor_when_asked(client: Client) -> None:
    response = await client.get("/v1/queues/nope", headers={"Accept": "application/cbor"})
    assert response.status_code == 404
    assert response.content_type == "application/cbor"
    body = cbor2.loads(await response.get_data())
    assert body["error"]["code"] == "queue_not_found"


@pytest.mark.parametrize(
    ("accept", "media_type"),
    [
        ("application/cbor", "application/cbor"),
        ("Application/CBOR", "application/cbor"),
        ("application/json, application/cbor", "application/cbor"),
        ("application/cbor;q=0.5, */*;q=0.1", "application/cbor"),
        ("application/cbor;q=0.5, */*", "application/json"),  # */* gives JSON a quality of 1
        ("application/cbor;q=0.5, application/*;q=0.4, */*", "application/cbor"),  # the closer range
        ("application/cbor;q=0", "application/json"),
        ("application/json, application/cbor; q=0", "application/json"),
        ("application/json, application/cbor;q=0.9", "application/json"),
        ("application/cbor;q=x", "application/json"),
        ("application/cbor-seq", "application/json"),
        ("*/*", "application/json"),
    ],
)
async def test_cbor_is_answered_only_when_the_accept_header_prefers_it(
    client: Client, accept: str, media_type: str
) -> None:
    await make_queue(client)
    response = await client.get("/v1/queues/jobs", headers={"Accept": accept})
    assert response.status_code == 200
    assert response.content_type == media_type
