"""The operator's surface on a running broker: /metrics after a known workload, /openapi.json in step
with the routes the app serves, and the token gate in front of every route."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from broker.config import Settings, Token
from broker.http.openapi import document, routes
from broker.http.paths import target_of
from broker.server import Broker, open_broker
from tests.conftest import Client, make_queue

PUBLISHER = "publisher-secret-0001"
CONSUMER = "consumer-secret-0002"
READER = "reader-secret-000003"
ADMIN = "admin-secret-00000004"
TOKENS = (
    Token("publisher", PUBLISHER, ("publish:jobs",)),
    Token("consumer", CONSUMER, ("consume:jobs",)),
    Token("reader", READER, ("read:*",)),
    Token("admin", ADMIN, ("admin",)),
)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_show_a_known_workload(tmp_path: Path) -> None:
    async with open_broker(Settings(data_dir=tmp_path)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await make_queue(client)
        body = {"messages": [{"payload": n} for n in range(3)]}
        assert (await client.post("/v1/queues/jobs/messages", json=body)).status_code == 201
        claimed = await (await client.post("/v1/queues/jobs/claim", json={"max": 2})).get_json()
        ack = {"leases": [claimed["messages"][0]["lease_id"]]}
        assert (await client.post("/v1/queues/jobs/ack", json=ack)).status_code == 200
        assert (await client.get("/v1/queues/nowhere")).status_code == 404
        response = await client.get("/metrics")
        assert response.status_code == 200
        assert response.content_type.startswith("text/plain")
        seen = samples((await response.get_data()).decode())
    jobs = (("queue", "jobs"),)
    assert seen[("broker_queue_messages", (*jobs, ("state", "ready")))] == 1
    assert seen[("broker_queue_messages", (*jobs, ("state", "in_flight")))] == 1
    assert seen[("broker_messages_published_total", jobs)] == 3
    assert seen[("broker_messages_acked_total", jobs)] == 1
    assert seen[("broker_journal_healthy", ())] == 1
    assert seen[("broker_journal_flushes_total", ())] >= 1
    assert seen[("broker_journal_fsync_seconds_count", ())] == seen[("broker_journal_flushes_total", ())]
    assert seen[("broker_journal_flush_records_sum", ())] == seen[("broker_journal_records_total", ())]
    claim = (("route", "POST /v1/queues/{queue}/claim"), ("status", "200"))
    assert seen[("broker_http_request_duration_seconds_count", claim)] == 1
    missing = (("route", "GET /v1/queues/{queue}"), ("status", "404"))
    assert seen[("broker_http_request_duration_seconds_count", missing)] == 1


async def test_every_response_carries_a_request_id(client: Client) -> None:
    first = await client.get("/healthz")
    second = await client.get("/healthz", headers={"X-Request-Id": "mine-1"})
    assert first.headers["X-Request-Id"] and second.headers["X-Request-Id"] == "mine-1"


def _template(rule: str) -> str:
    return re.sub(
        r"<([a-z_]+)>", lambda m: "{id}" if m.group(1) == "message_id" else f"{{{m.group(1)}}}", rule
    )


async def test_the_openapi_document_lists_exactly_the_routes_the_app_serves(
    broker: Broker, client: Client
) -> None:
    served = {
        f"{method} {_template(rule.rule)}"
        for rule in broker.app.url_map.iter_rules()
        for method in rule.methods or ()
        if method not in ("HEAD", "OPTIONS") and not rule.rule.startswith("/static")
    }
    assert served == set(routes())
    answer = await client.get("/openapi.json")
    assert answer.status_code == 200
    served_document = await answer.get_json()
    assert served_document == document()
    assert served_document["openapi"] == "3.1.0"
    for path, operations in served_document["paths"].items():
        for method in operations:
            assert (
                target_of(method.upper(), path.replace("{queue}", "q").replace("{id}", "m")).route != "other"
            )


async def test_the_priority_range_the_openapi_document_gives_is_the_one_publish_enforces(
    client: Client,
) -> None:
    await make_queue(client)
    schema = document()["components"]["schemas"]["NewMessage"]["properties"]["priority"]
    low, high = schema["minimum"], schema["maximum"]
    for priority, status in ((low, 201), (high, 201), (low - 1, 400), (high + 1, 400)):
        answer = await client.post("/v1/queues/jobs/messages", json={"payload": 1, "priority": priority})
        assert answer.status_code == status, (priority, await answer.get_data())


# -- the token gate on every route ------------------------------------------------------------------------

#: A token whose scopes do not cover the route, for each scope kind a route may need.
WRONG_SCOPE = {
    "publish": CONSUMER,
    "consume": PUBLISHER,
    "read": PUBLISHER,
    "admin": READER,
    "read_all": PUBLISHER,
}
RIGHT_SCOPE = {
    "publish": PUBLISHER,
    "consume": CONSUMER,
    "read": READER,
    "admin": ADMIN,
    "read_all": READER,
    "any": PUBLISHER,
}


def _request(route: str) -> tuple[str, str, Any]:
    method, template = route.split(" ", 1)
    path = template.replace("{queue}", "jobs").replace("{id}", "no-such-id")
    body: Any = None
    if method in ("POST", "PUT"):
        body = {
            "/messages": {"payload": 1},
            "/claim": {"max": 1},
            "/extend": {"leases": [], "lease": 1},
            "/redrive": {"all": True, "to": "jobs"},
        }.get(template[template.rfind("/") :], {"leases": []} if "{queue}/" in template else {})
        if (
            template.endswith("/purge")
            or template.startswith("/v1/admin")
            or template == "/v1/queues/{queue}"
        ):
            body = {} if method == "PUT" else None
    return method, path, body


async def send(client: Client, route: str, token: str | None) -> int:
    method, path, body = _request(route)
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    if route.endswith("/work"):
        headers["Accept"] = "text/event-stream"
        path += "?max=0"  # past the gate, a 400 rather than a stream that stays open (test_stream.py)
    response = await client.open(path, method=method, json=body, headers=headers)
    return response.status_code


@pytest.fixture
async def guarded(tmp_path: Path) -> Any:
    async with open_broker(Settings(in_memory=True, tokens=TOKENS)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        response = await client.put("/v1/queues/jobs", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert response.status_code == 201
        yield client


@pytest.mark.parametrize("route", sorted(routes()))
async def test_every_route_checks_the_token_and_its_scope(guarded: Client, route: str) -> None:
    method = route.split(" ", 1)[0]
    scope = target_of(method, _request(route)[1]).scope
    if scope == "open":
        assert await send(guarded, route, None) not in (401, 403)
        return
    assert await send(guarded, route, None) == 401
    assert await send(guarded, route, "not-a-token-at-all-x") == 401
    if scope in WRONG_SCOPE:
        assert await send(guarded, route, WRONG_SCOPE[scope]) == 403
    assert await send(guarded, route, RIGHT_SCOPE[scope]) not in (401, 403)


async def test_the_queue_list_shows_only_what_the_token_may_read() -> None:
    tokens = (*TOKENS, Token("mail-reader", "mail-reader-secret-05", ("read:mail-*",)))
    async with open_broker(Settings(in_memory=True, tokens=tokens)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        for name in ("jobs", "mail-eu", "mail-us"):
            answer = await client.put(
                f"/v1/queues/{name}", json={}, headers={"Authorization": f"Bearer {ADMIN}"}
            )
            assert answer.status_code == 201

        async def listed(secret: str) -> list[str]:
            answer = await client.get("/v1/queues", headers={"Authorization": f"Bearer {secret}"})
            return [queue["name"] for queue in (await answer.get_json())["queues"]]

        assert await listed(ADMIN) == ["jobs", "mail-eu", "mail-us"]
        assert await listed(READER) == ["jobs", "mail-eu", "mail-us"]
        assert await listed("mail-reader-secret-05") == ["mail-eu", "mail-us"]
        assert await listed(PUBLISHER) == []


async def test_a_claims_log_line_names_its_consumer(client: Client) -> None:
    await make_queue(client)
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        assert (await client.post("/v1/queues/jobs/claim", json={"consumer": "w1"})).status_code == 200
        assert (await client.get("/healthz")).status_code == 200
    claim, health = [entry for entry in logs if entry["event"] == "request"]
    assert (claim["consumer"], claim["queue"], claim["status"]) == ("w1", "jobs", 200)
    assert "consumer" not in health and health["queue"] is None


async def test_a_path_is_named_by_a_route_exactly_when_the_app_routes_it(client: Client) -> None:
    """Each documented route; the same path with a trailing slash; and with each of its parameters
    empty (no route has those): the request logs, the metrics label and the token gate name a route for
    the first and ``other`` for the rest, as the router answers. ``/v1/queues/jobs/`` was labelled
    ``GET /v1/queues/{queue}`` and checked for ``read:jobs``, then answered 404; so was
    ``…/push/messages/`` with its route."""
    await make_queue(client)
    for template, operations in document()["paths"].items():

        def filled(template: str) -> str:
            return re.sub(r"\{[a-z_]+\}", "x", template.replace("{queue}", "jobs"))

        path = filled(template)
        emptied = [
            filled(template[: found.start()] + template[found.end() :])
            for found in re.finditer(r"\{[a-z_]+\}", template)
        ]
        for method in (method.upper() for method in operations):
            for sent in (path, f"{path}/", *emptied):
                if method == "GET" and sent.endswith("/work"):
                    continue  # a stream that stays open; its trailing-slash form is checked
                answer = await client.open(
                    sent, method=method, json={} if method in ("POST", "PUT") else None
                )
                body = await answer.get_json()
                unrouted = isinstance(body, dict) and body.get("error", {}).get("code") == "not_found"
                assert unrouted == (target_of(method, sent).route == "other"), (method, sent, body)
                assert unrouted == (sent != path), (method, sent, body)
