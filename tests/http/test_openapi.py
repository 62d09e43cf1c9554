"""``GET /openapi.json`` against the app it describes: real answers of the in-process app checked against
the schema the document gives for their status and media type, each body's ``required`` flag against
what the app does without a body, every declared default against what the request parser applies, and
the fields that take ``null`` (docs/api.md). (That the document lists exactly the served routes is
tests/http/test_operations.py's.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import jsonschema_rs
import pytest
import trio

from broker.config import Limits, Settings, Token
from broker.core.durations import DURATION_PATTERN, parse_duration
from broker.errors import InvalidRequest
from broker.http import parse
from broker.http.openapi import NULL_AS_ABSENT, document, routes
from broker.http.stream import STREAM_ID_HEADER
from broker.server import open_broker
from broker.storage.codec import cbor_loads, json_loads
from tests.conftest import Client, make_queue
from tests.push.conftest import Receiver, publish, pushing, put_queue, wait_until

JSON = "application/json"
CBOR = "application/cbor"
HOOK = "http://receiver.test/hook"
ADMIN = "admin-secret-00000001"
PUBLISHER = "publisher-secret-0002"
TOKENS = (Token("admin", ADMIN, ("admin",)), Token("publisher", PUBLISHER, ("publish:*",)))


def operation(route: str) -> dict[str, Any]:
    method, path = route.split(" ", 1)
    found: dict[str, Any] = document()["paths"][path][method.lower()]
    return found


def body_schema(route: str) -> dict[str, Any]:
    schema: dict[str, Any] = operation(route)["requestBody"]["content"][JSON]["schema"]
    return resolved(schema)


def resolved(schema: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        found: dict[str, Any] = document()["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        return found
    return schema


def validator(schema: dict[str, Any]) -> Any:
    """A JSON Schema 2020-12 validator of ``schema``, its ``$ref`` to the document's components resolved."""
    return jsonschema_rs.Draft202012Validator({**schema, "components": document()["components"]})


def is_valid(schema: dict[str, Any], value: Any) -> bool:
    valid: bool = validator(schema).is_valid(value)
    return valid


def documented_answer(route: str, status: int) -> dict[str, Any]:
    """The response the document gives ``route`` for ``status``: its own, else its ``default``."""
    responses = operation(route)["responses"]
    assert str(status) in responses or status >= 400, f"{route} answered {status}, which it does not list"
    answer: dict[str, Any] = responses.get(str(status), responses["default"])
    return answer


async def check_answer(route: str, response: Any) -> Any:
    """Assert that ``response`` is what the document says ``route`` answers with its status: a media type
    it lists, and a body its schema there takes. Returns the decoded body."""
    answer = documented_answer(route, response.status_code)
    raw = await response.get_data()
    if "content" not in answer:
        assert raw == b"", (route, response.status_code, raw)
        return None
    media = (response.content_type or "").split(";", 1)[0]
    assert media in answer["content"], (route, response.status_code, media, list(answer["content"]))
    if media not in (JSON, CBOR):
        return raw
    body = cbor_loads(raw) if media == CBOR else json_loads(raw)
    schema = answer["content"][media]["schema"]
    errors = [error.message for error in validator(schema).iter_errors(body)]
    assert not errors, (route, response.status_code, media, errors, body)
    return body


# -- every route, answered as JSON and as CBOR --------------------------------------------------------

#: A body per route that has one the app takes (None: no body). Routes not here get none.
BODIES: dict[str, Any] = {
    "PUT /v1/queues/{queue}": {},
    "POST /v1/queues/{queue}/messages": {"payload": 1},
    "POST /v1/queues/{queue}/claim": {"max": 1},
    "POST /v1/queues/{queue}/ack": {"leases": ["no-such-lease"]},
    "POST /v1/queues/{queue}/nack": {"leases": ["no-such-lease"]},
    "POST /v1/queues/{queue}/defer": {"leases": ["no-such-lease"]},
    "POST /v1/queues/{queue}/extend": {"leases": ["no-such-lease"], "lease": 1},
    "POST /v1/queues/{queue}/redrive": {"ids": ["no-such-id"]},
    "POST /compat/qhook/api/queues/{queue}/ack": {"ids": ["no-such-id"]},
    "POST /compat/qhook/api/queues/{queue}/nack": {"ids": ["no-such-id"]},
    "POST /compat/cloudflare/client/v4/accounts/{account}/queues/{queue}/messages/pull": {},
    "POST /compat/cloudflare/client/v4/accounts/{account}/queues/{queue}/messages/ack": {},
    "POST /compat/simpleq/v1/queues": {"name": "simple", "webhookUrl": "https://hooks.example.com/q"},
    "PUT /compat/simpleq/v1/queues/{queue}": {},
    "POST /compat/simpleq/v1/queues/{queue}/jobs": {"payload": {"job": 1}, "idempotencyKey": "k"},
    "POST /compat/simpleq/v1/jobs/{id}/nack": {},
    "POST /compat/simpleq/v1/jobs/{id}/defer": {"retryAfter": "2s"},
    "POST /compat/simpleq/v1/queues/{queue}/dlq/retry": {"all": True},
}


def _last(route: str) -> bool:
    """Deletes and purges go last, so that the routes before them find the queue and its messages."""
    return route.startswith("DELETE") or route.endswith("/purge")


@pytest.mark.parametrize("accept", [JSON, CBOR])
async def test_every_answer_of_the_app_is_the_one_the_document_gives(client: Client, accept: str) -> None:
    """Each route once, as JSON and as CBOR (``Accept``): native answers come as CBOR then, errors
    included, and the document must list it; the compatibility surfaces answer JSON whatever."""
    await make_queue(client)
    published = await (await client.post("/v1/queues/jobs/messages", json={"payload": {"n": 1}})).get_json()
    message_id = published["messages"][0]["id"]
    answered = set()
    for route in sorted(routes(), key=_last):
        method, template = route.split(" ", 1)
        path = (
            template.replace("{queue}", "jobs")
            .replace("{account}", "account")
            .replace("{stream_id}", "no-such-stream")
            .replace("{id}", message_id if method == "GET" else "no-such-id")
        )
        options: dict[str, Any] = {"method": method, "headers": {"Accept": accept}}
        if route in BODIES:
            options["json"] = BODIES[route]
        response = await client.open(path, **options)
        await check_answer(route, response)
        answered.add((route, response.status_code))
    # The check saw answers worth checking, not only errors.
    assert {route for route, status in answered if status < 300} >= {
        "GET /v1/queues/{queue}",
        "POST /v1/queues/{queue}/messages",
        "GET /v1/queues/{queue}/messages/{id}",
        "POST /compat/simpleq/v1/queues/{queue}/jobs",
        "POST /compat/cloudflare/client/v4/accounts/{account}/queues/{queue}/messages/pull",
        "GET /openapi.json",
        "GET /metrics",
    }


def test_native_answers_list_cbor_and_the_compatibility_surfaces_do_not() -> None:
    for path, operations in document()["paths"].items():
        for method, described in operations.items():
            for status, answer in described["responses"].items():
                media = set(answer.get("content", ()))
                if path.startswith("/compat/"):
                    assert CBOR not in media, (method, path, status)
                elif JSON in media:
                    assert CBOR in media, (method, path, status)
                    assert answer["content"][CBOR] == answer["content"][JSON]


# -- 1. SimpleQ: a repeated idempotencyKey, to a token that may not read the queue --------------------


@pytest.fixture
async def guarded() -> AsyncIterator[Client]:
    async with open_broker(Settings(in_memory=True, tokens=TOKENS)) as broker, broker.app.test_app() as app:
        yield app.test_client()


async def test_a_repeated_simpleq_job_to_a_token_without_read_is_documented(guarded: Client) -> None:
    route = "POST /compat/simpleq/v1/queues/{queue}/jobs"
    admin, publisher = ({"Authorization": f"Bearer {secret}"} for secret in (ADMIN, PUBLISHER))
    assert (await guarded.put("/v1/queues/jobs", json={}, headers=admin)).status_code == 201
    job = {"payload": {"to": "ada"}, "idempotencyKey": "order-17"}
    first = await guarded.post("/compat/simpleq/v1/queues/jobs/jobs", json=job, headers=publisher)
    assert first.status_code == 201
    created = await check_answer(route, first)
    again = await guarded.post("/compat/simpleq/v1/queues/jobs/jobs", json=job, headers=publisher)
    assert again.status_code == 200
    assert await check_answer(route, again) == {
        "id": created["id"],
        "queue": "jobs",
        "idempotencyKey": "order-17",
    }
    as_admin = await guarded.post("/compat/simpleq/v1/queues/jobs/jobs", json=job, headers=admin)
    assert (await check_answer(route, as_admin))["state"] == "queued"  # the whole job, to a reader


# -- 2. Cloudflare: what comes before its routes, in the broker's error body --------------------------

PULL = "POST /compat/cloudflare/client/v4/accounts/{account}/queues/{queue}/messages/pull"
CLOUDFLARE_ACK = "POST /compat/cloudflare/client/v4/accounts/{account}/queues/{queue}/messages/ack"


@pytest.mark.parametrize("route", [PULL, CLOUDFLARE_ACK])
async def test_the_refusals_before_a_cloudflare_route_are_documented(guarded: Client, route: str) -> None:
    admin, publisher = ({"Authorization": f"Bearer {secret}"} for secret in (ADMIN, PUBLISHER))
    assert (await guarded.put("/v1/queues/jobs", json={}, headers=admin)).status_code == 201
    path = route.split(" ", 1)[1].replace("{account}", "account").replace("{queue}", "{}")
    refusals = [
        (401, "POST", path.format("jobs"), {}),
        (403, "POST", path.format("jobs"), publisher),  # publish, not consume
        (415, "POST", path.format("jobs"), {**admin, "Content-Encoding": "gzip"}),
        (405, "GET", path.format("jobs"), admin),
        (404, "POST", path.format("jobs") + "/", admin),  # no such path: routing
        (404, "POST", path.format("nowhere"), admin),  # no such queue: the route, in Cloudflare's envelope
    ]
    shapes = []
    for status, method, target, headers in refusals:
        response = await guarded.open(target, method=method, json={}, headers=headers)
        assert response.status_code == status
        assert str(status) in operation(route)["responses"], "not left to the default (Cloudflare's envelope)"
        shapes.append(set(await check_answer(route, response)))
    assert shapes[:5] == [{"error"}] * 5
    assert shapes[5] == {"success", "errors", "messages", "result"}


# -- 3. QueueConfig: a template alone, on a queue that pushes already ---------------------------------


async def test_a_template_alone_is_valid_on_a_queue_that_pushes_already(client: Client) -> None:
    route = "PUT /v1/queues/{queue}"
    body = {"template": "anthropic"}
    assert is_valid(body_schema(route), body)
    await make_queue(client, push={"url": "https://hooks.example.com/jobs"})
    response = await client.put("/v1/queues/jobs", json=body)
    assert response.status_code == 200
    assert (await check_answer(route, response))["config"]["push"]["mode"] == "ack"


# -- 4. SimpleQ's durations: numbers or strings with a unit, within the bounds the broker enforces ------

SIMPLEQ_DURATIONS = [
    ("POST /compat/simpleq/v1/queues/{queue}/jobs", "delay"),
    ("POST /compat/simpleq/v1/queues", "rateLimitWindow"),
    ("POST /compat/simpleq/v1/queues", "ackTimeout"),
    ("POST /compat/simpleq/v1/queues", "backoffDelay"),
    ("PUT /compat/simpleq/v1/queues/{queue}", "rateLimitWindow"),
    ("PUT /compat/simpleq/v1/queues/{queue}", "ackTimeout"),
    ("PUT /compat/simpleq/v1/queues/{queue}", "backoffDelay"),
]


@pytest.mark.parametrize(("route", "field"), SIMPLEQ_DURATIONS)
async def test_simpleq_durations_take_what_the_broker_takes(client: Client, route: str, field: str) -> None:
    schema = body_schema(route)
    number, text = schema["properties"][field]["oneOf"]
    low, high = number["minimum"], number["maximum"]
    step = 0.001
    await make_queue(client, "native")  # jobs are published into a queue without push: nothing is pushed
    created = 0

    async def send(value: Any) -> int:
        nonlocal created
        method, template = route.split(" ", 1)
        body: dict[str, Any] = {field: value}
        if field == "rateLimitWindow":
            body["rateLimitMax"] = 5
        if template.endswith("/jobs"):
            body["payload"] = {"job": 1}
        elif method == "POST":
            created += 1
            body |= {"name": f"simple-{created}", "webhookUrl": "https://hooks.example.com/q"}
        else:
            await client.delete("/compat/simpleq/v1/queues/simple")
            made = {"name": "simple", "webhookUrl": "https://hooks.example.com/q"}
            assert (await client.post("/compat/simpleq/v1/queues", json=made)).status_code == 201
        path = template.replace("{queue}", "native" if template.endswith("/jobs") else "simple")
        response = await client.open(path, method=method, json=body)
        await check_answer(route, response)
        return response.status_code

    def plain(seconds: float) -> str:
        return f"{seconds:.3f}".rstrip("0").rstrip(".")

    for value in (low, high, f"{plain(low)}s", f"{plain(high)}s", f"{round(high * 1000)}ms"):
        assert is_valid(schema["properties"][field], value), value
        assert await send(value) < 300, value
    for value in (low - step, high + step, f"{plain(high + 1)}s"):
        assert await send(value) == 400, value
    assert text["type"] == "string"


# -- 5. A body is required exactly when the app refuses a request without one -------------------------


async def test_a_body_is_required_exactly_when_the_app_needs_one(client: Client) -> None:
    await make_queue(client)
    with_bodies = [route for route in routes() if "requestBody" in operation(route)]
    optional = set()
    for route in with_bodies:
        method, template = route.split(" ", 1)
        path = (
            template.replace("{queue}", "jobs")
            .replace("{account}", "account")
            .replace("{stream_id}", "no-such-stream")
            .replace("{id}", "no-such-id")
        )
        response = await client.open(path, method=method)
        refused = response.status_code == 400
        assert operation(route)["requestBody"]["required"] is refused, (route, await response.get_data())
        if not refused:
            optional.add(route)
    assert optional >= {
        "POST /v1/queues/{queue}/claim",
        "PUT /v1/queues/{queue}",
        "POST /v1/queues/{queue}/work/{stream_id}/stop",
        "POST /v1/messages/{id}/ack",
        "POST /v1/messages/{id}/nack",
        "POST /v1/messages/{id}/defer",
        "POST /compat/simpleq/v1/jobs/{id}/ack",
        "POST /compat/cloudflare/client/v4/accounts/{account}/queues/{queue}/messages/pull",
    }


# -- 6. The push stream's header, and defaults ----------------------------------------------------------


def test_the_push_stream_declares_the_header_its_stop_call_names() -> None:
    answer = operation("GET /v1/queues/{queue}/work")["responses"]["200"]
    assert STREAM_ID_HEADER.decode() in answer["headers"]
    stop = operation("POST /v1/queues/{queue}/work/{stream_id}/stop")
    assert any("stream-id" in parameter.get("description", "") for parameter in stop["parameters"])


def declared_defaults() -> dict[tuple[str, str], Any]:
    """Every ``default`` the document declares: (route, field or query parameter) → value."""
    found: dict[tuple[str, str], Any] = {}
    for route in routes():
        described = operation(route)
        for parameter in described["parameters"]:
            if "default" in parameter["schema"]:
                found[(route, parameter["name"])] = parameter["schema"]["default"]
        if "requestBody" in described:
            schema = body_schema(route)
            for option in [schema, *(resolved(choice) for choice in schema.get("oneOf", ()))]:
                for name, field in option.get("properties", {}).items():
                    if "default" in field:
                        found[(route, name)] = field["default"]
    return found


LIMITS = Limits()
#: Native routes whose request parser is a function of the body (or the query): route → (parser, the
#: least request it takes). The default of a field is right when giving it changes nothing.
PARSERS: dict[str, tuple[Callable[[Any], Any], dict[str, Any]]] = {
    "POST /v1/queues/{queue}/messages": (lambda body: parse.publish(body, LIMITS, False), {"payload": 1}),
    "POST /v1/queues/{queue}/claim": (lambda body: parse.claim(body, LIMITS), {}),
    "POST /v1/queues/{queue}/nack": (lambda body: parse.nack(body, LIMITS), {"leases": ["l"]}),
    "POST /v1/queues/{queue}/defer": (lambda body: parse.defer(body, LIMITS), {"leases": ["l"]}),
    "GET /v1/queues/{queue}/messages": (parse.browse, {}),
    "GET /v1/queues/{queue}/work": (lambda query: parse.work(query, LIMITS), {}),
}
#: Defaults checked through the app below, as their routes parse inline.
CHECKED_BY_THE_APP = {
    ("POST /v1/messages/{id}/nack", "retryable"),
    ("POST /v1/messages/{id}/defer", "retry_after"),
    ("POST /compat/simpleq/v1/jobs/{id}/nack", "retryable"),
    ("GET /compat/simpleq/v1/queues/{queue}/dlq", "limit"),
}


def test_every_default_is_what_the_parser_applies() -> None:
    defaults = declared_defaults()
    assert {("POST /v1/queues/{queue}/claim", "max"), ("GET /v1/queues/{queue}/messages", "limit")} <= set(
        defaults
    )
    checked = set()
    for (route, name), value in defaults.items():
        if route not in PARSERS:
            continue
        parser, least = PARSERS[route]
        given = str(value) if route.startswith("GET") else value  # a query's values are text
        assert parser({**least, name: given}) == parser(least), (route, name, value)
        checked.add((route, name))
    assert set(defaults) - checked == CHECKED_BY_THE_APP


async def test_the_simpleq_dlq_page_is_as_long_as_its_default_limit(client: Client) -> None:
    limit = declared_defaults()[("GET /compat/simpleq/v1/queues/{queue}/dlq", "limit")]
    await make_queue(client, "jobs.dlq")
    await make_queue(client)
    batch = {
        "messages": [{"payload": n, "headers": {"x-dead-letter-from": "jobs"}} for n in range(limit + 1)]
    }
    assert (await client.post("/v1/queues/jobs.dlq/messages", json=batch)).status_code == 201
    page = await (await client.get("/compat/simpleq/v1/queues/jobs/dlq")).get_json()
    assert (len(page["data"]), page["nextCursor"]) == (limit, str(limit))


async def test_the_callbacks_defaults_are_what_the_broker_applies(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A nack callback without ``retryable`` retries (native and SimpleQ), a defer without
    ``retry_after`` holds the message 0 s: the defaults the document declares."""
    defaults = declared_defaults()
    assert defaults[("POST /v1/messages/{id}/nack", "retryable")] is True
    assert defaults[("POST /compat/simpleq/v1/jobs/{id}/nack", "retryable")] is True
    retry_after = defaults[("POST /v1/messages/{id}/defer", "retry_after")]
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": HOOK, "mode": "ack", "format": "simpleq"})
        message_id = await publish(p.client, {"job": 1})
        await wait_until(lambda: len(receiver.requests) == 1)
        nacked = await p.client.post(f"/v1/messages/{message_id}/nack", json={})
        assert (await nacked.get_json())["dead_lettered"] == 0
        await wait_until(lambda: len(receiver.requests) == 2)
        deferred = await p.client.post(f"/v1/messages/{message_id}/defer")
        assert (await deferred.get_json())["deferred"] == 1
        shown = await (await p.client.get(f"/v1/queues/jobs/messages/{message_id}")).get_json()
        defers = [entry for entry in shown["history"] if entry["event"] == "deferred"]
        assert [entry["retry_after"] for entry in defers] == [retry_after]
        await wait_until(lambda: len(receiver.requests) == 3)
        job = await p.client.post(f"/compat/simpleq/v1/jobs/{message_id}/nack", json={})
        assert job.status_code == 200
        assert (await job.get_json())["state"] != "dead"


# -- 7. null in the optional fields of the native message routes -------------------------------------

#: Every optional field that takes null, by route (the request parser reads null as the field left out).
NULLABLE = {
    "POST /v1/queues/{queue}/messages": {
        "payload_encoding",
        "headers",
        "key",
        "on_duplicate",
        "delay",
        "priority",
    },
    "POST /v1/queues/{queue}/claim": {"consumer", "max", "lease", "wait"},
    "POST /v1/queues/{queue}/ack": set(),
    "POST /v1/queues/{queue}/nack": {"delay", "retryable", "reason"},
    "POST /v1/queues/{queue}/defer": {"retry_after", "reason"},
    "POST /v1/queues/{queue}/extend": set(),
    "POST /v1/queues/{queue}/purge": set(),
    "POST /v1/queues/{queue}/redrive": {"ids", "all", "to"},
    "POST /v1/queues/{queue}/work/{stream_id}/stop": set(),
    "POST /v1/messages/{id}/ack": {"lease_id"},
    "POST /v1/messages/{id}/nack": {"retryable", "delay", "reason", "lease_id"},
    "POST /v1/messages/{id}/defer": {"retry_after", "reason", "lease_id"},
}
#: The least valid body of each, which a null field is added to.
LEAST = {
    "POST /v1/queues/{queue}/messages": {"payload": 1},
    "POST /v1/queues/{queue}/ack": {"leases": []},
    "POST /v1/queues/{queue}/nack": {"leases": []},
    "POST /v1/queues/{queue}/defer": {"leases": []},
    "POST /v1/queues/{queue}/extend": {"leases": [], "lease": 1},
}


def _takes_null(schema: dict[str, Any], fields: dict[str, Any], least: dict[str, Any]) -> set[str]:
    """The ``fields`` not in ``least`` that ``schema`` takes as null beside it."""
    return {name for name in fields if name not in least and is_valid(schema, {**least, name: None})}


@pytest.mark.parametrize("route", sorted(NULLABLE))
def test_the_optional_fields_of_the_native_message_routes_take_null(route: str) -> None:
    schema = operation(route)["requestBody"]["content"][JSON]["schema"]
    if route.endswith("/messages"):
        single = resolved(schema["oneOf"][0])
        assert single["description"] == NULL_AS_ABSENT
        assert _takes_null(schema, single["properties"], LEAST[route]) == NULLABLE[route]
        in_a_batch = {
            name for name in NULLABLE[route] if is_valid(schema, {"messages": [{"payload": 1, name: None}]})
        }
        assert in_a_batch == NULLABLE[route]
        return
    least = {"all": True} if route.endswith("/redrive") else LEAST.get(route, {})
    nullable = _takes_null(schema, resolved(schema).get("properties", {}), least)
    if route.endswith("/redrive"):  # either choice, with the other field null
        nullable |= {"all"} if is_valid(schema, {"ids": ["m"], "all": None}) else set()
        assert is_valid(schema, {"ids": None, "all": True, "to": None})
        assert not is_valid(schema, {"ids": None, "all": None})
    assert nullable == NULLABLE[route]
    if nullable:
        assert schema["description"] == NULL_AS_ABSENT


@pytest.mark.parametrize(
    ("route", "field"),
    [(route, field) for route, fields in sorted(NULLABLE.items()) for field in sorted(fields)],
)
async def test_the_app_takes_null_where_the_document_says(client: Client, route: str, field: str) -> None:
    """The request parser agrees: a null field is no 400 (the callbacks find no message waiting: 404)."""
    await make_queue(client)
    await make_queue(client, "other")
    method, template = route.split(" ", 1)
    path = template.replace("{queue}", "jobs").replace("{id}", "no-such-id")
    least = {"all": True, "to": "other"} if route.endswith("/redrive") else LEAST.get(route, {})
    if field == "all":
        least = {"ids": ["no-such-id"]}
    response = await client.open(path, method=method, json={**least, field: None})
    expected = 404 if template.startswith("/v1/messages/") else 201 if route.endswith("/messages") else 200
    assert response.status_code == expected, await response.get_data()
    await check_answer(route, response)


def test_null_is_not_taken_where_it_means_something_else_or_nothing() -> None:
    """The queue config (there null drops, removes, stops: docs/api.md) and the compatibility surfaces
    take null where they always did, nowhere more."""
    config = body_schema("PUT /v1/queues/{queue}")
    assert {name for name in config["properties"] if is_valid(config, {name: None})} == {
        "dead_letter",
        "rate_limit",
        "push",
    }
    assert "description" not in config
    for route in routes():
        if route.split(" ", 1)[1].startswith("/compat/") and "requestBody" in operation(route):
            assert body_schema(route).get("description") != NULL_AS_ABSENT, route


#: Durations, and near misses: Unicode spaces, a control character Python's ``\s`` takes, a digit of
#: another script.
DURATION_TEXTS = ("5s", " 5 ms ", "\t.5h\n", "1.25d", "5", "5x", "", "\xa05s", "5s\u2028", "\ufeff5")
DURATION_TEXTS += ("\u20035ms", "\x1c5", "5s\x85", "\u0665s")


@pytest.mark.parametrize("text", DURATION_TEXTS)
def test_the_published_duration_pattern_takes_what_the_parser_takes(text: str) -> None:
    """The document's pattern used ``\\s``, which Python's parser reads as ASCII whitespace and a
    JSON Schema validator as Unicode's too: "\\xa05s" matched the schema and was refused."""
    schema = {"type": "string", "pattern": f"^{DURATION_PATTERN}$"}
    try:
        parse_duration(text, "lease")
    except InvalidRequest:
        parsed = False
    else:
        parsed = True
    assert jsonschema_rs.Draft202012Validator(schema).is_valid(text) is parsed
