"""Tokens and scopes: what each route needs, and the gate in front of every route."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote

import cbor2
import orjson
import pytest
import trio

from broker.config import Settings, Token
from broker.errors import Unauthorized
from broker.http import auth
from broker.http.auth import ADMIN, ANY, OPEN, Gate, Grant, Need, grant_of, need_of
from broker.http.openapi import routes
from broker.http.paths import origin_scope, target_of
from broker.server import Broker, open_broker
from tests.push.conftest import Receiver, wait_until

if TYPE_CHECKING:
    from hypercorn.typing import HTTPScope

SECRET = "a-secret-of-24-characters"


@pytest.mark.parametrize(
    ("method", "path", "need"),
    [
        ("GET", "/healthz", OPEN),
        ("GET", "/readyz", OPEN),
        ("GET", "/openapi.json", OPEN),
        ("GET", "/metrics", Need("read_all")),
        ("GET", "/v1/admin/snapshots", ADMIN),
        ("POST", "/v1/admin/snapshots", ADMIN),
        ("GET", "/v1/queues", ANY),
        ("GET", "/v1/queues/jobs", Need("read", "jobs")),
        ("PUT", "/v1/queues/jobs", ADMIN),
        ("DELETE", "/v1/queues/jobs", ADMIN),
        ("POST", "/v1/queues/jobs/messages", Need("publish", "jobs")),
        ("GET", "/v1/queues/jobs/messages", Need("read", "jobs")),
        ("GET", "/v1/queues/jobs/messages/m-1", Need("read", "jobs")),
        ("DELETE", "/v1/queues/jobs/messages/m-1", ADMIN),
        ("POST", "/v1/queues/jobs/claim", Need("consume", "jobs")),
        ("POST", "/v1/queues/jobs/ack", Need("consume", "jobs")),
        ("POST", "/v1/queues/jobs/nack", Need("consume", "jobs")),
        ("POST", "/v1/queues/jobs/defer", Need("consume", "jobs")),
        ("POST", "/v1/queues/jobs/extend", Need("consume", "jobs")),
        ("GET", "/v1/queues/jobs/work", Need("consume", "jobs")),
        ("POST", "/v1/queues/jobs/purge", ADMIN),
        ("POST", "/v1/queues/jobs/redrive", ADMIN),
        ("GET", "/v1/queues/jobs/nonsense/deeper", ANY),
        ("GET", "/nowhere", ANY),
    ],
)
def test_every_route_needs_its_scope(method: str, path: str, need: Need) -> None:
    assert need_of(method, path) == need


def test_a_grant_matches_queue_globs_per_kind_and_admin_may_everything() -> None:
    grant = Grant(Token("ci", SECRET, ("publish:jobs-*", "consume:jobs-eu", "read:*")))
    assert grant.allows(Need("publish", "jobs-1")) and not grant.allows(Need("publish", "mail"))
    assert grant.allows(Need("consume", "jobs-eu")) and not grant.allows(Need("consume", "jobs-us"))
    assert grant.allows(Need("read", "anything")) and grant.allows(Need("read_all"))
    assert not grant.allows(ADMIN)
    assert not Grant(Token("r", SECRET, ("read:jobs-*",))).allows(Need("read_all"))
    admin = Grant(Token("ops", SECRET, ("admin",)))
    assert all(admin.allows(need) for need in (ADMIN, Need("read_all"), Need("consume", "x")))


class Recorder:
    """An inner ASGI app that records what reached it."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scopes.append(scope)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def call(
    gate: Gate, method: str, path: str, authorization: str | None
) -> tuple[int, dict[bytes, bytes], Any]:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await gate(scope, receive, send)  # type: ignore[arg-type]
    start, body = sent
    return start["status"], dict(start["headers"]), orjson.loads(body["body"]) if body["body"] else None


async def test_the_gate_answers_401_403_or_passes_the_request_on_with_its_grant() -> None:
    inner = Recorder()
    gate = Gate(inner, [Token("ci", SECRET, ("publish:jobs",)), Token("ops", SECRET + "-ops", ("admin",))])
    status, headers, body = await call(gate, "POST", "/v1/queues/jobs/messages", None)
    assert status == 401 and body["error"]["code"] == "unauthorized"
    assert headers[b"www-authenticate"] == b'Bearer realm="broker"'
    for wrong in ("Bearer nope", f"Basic {SECRET}", "Bearer", f"Bearer {SECRET}x"):
        status, _, body = await call(gate, "POST", "/v1/queues/jobs/messages", wrong)
        assert status == 401, wrong
        assert SECRET not in orjson.dumps(body).decode()
    status, _, body = await call(gate, "POST", "/v1/queues/jobs/claim", f"Bearer {SECRET}")
    assert status == 403 and body["error"] == {
        "code": "forbidden",
        "message": "the token 'ci' lacks the scope consume:jobs",
    }
    assert inner.scopes == []
    assert (await call(gate, "POST", "/v1/queues/jobs/messages", f"bearer  {SECRET} "))[0] == 204
    assert (await call(gate, "DELETE", "/v1/queues/jobs", f"Bearer {SECRET}-ops"))[0] == 204
    assert (await call(gate, "GET", "/healthz", None))[0] == 204
    ci, ops, healthz = inner.scopes
    assert grant_of(ci).name == "ci" and grant_of(ops).name == "ops"  # type: ignore[union-attr]
    assert grant_of(healthz) is None


async def test_the_gate_refuses_websockets_without_asking_the_app() -> None:
    inner = Recorder()
    gate = Gate(inner, [Token("ci", SECRET, ("admin",))])
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/queues/jobs/work", "headers": [], "asgi": {"version": "3.0"}}
    await gate(scope, receive, send)  # type: ignore[arg-type]
    assert [message["type"] for message in sent] == ["websocket.close"] and inner.scopes == []


@pytest.mark.parametrize(
    ("method", "path", "route", "queue"),
    [
        ("POST", "/v1/queues/jobs/claim", "POST /v1/queues/{queue}/claim", "jobs"),
        ("HEAD", "/v1/queues/jobs", "GET /v1/queues/{queue}", "jobs"),
        ("DELETE", "/v1/queues/jobs/messages/m-1", "DELETE /v1/queues/{queue}/messages/{id}", "jobs"),
        ("GET", "/v1/queues", "GET /v1/queues", None),
        ("GET", "/metrics", "GET /metrics", None),
        ("PATCH", "/v1/queues/jobs", "other", None),
        ("GET", "/v1/queues/jobs/messages/m-1/x", "other", None),
    ],
)
def test_requests_are_named_by_their_route_template(
    method: str, path: str, route: str, queue: str | None
) -> None:
    assert (target_of(method, path).route, target_of(method, path).queue) == (route, queue)


def test_every_token_is_compared_in_constant_time_whatever_matched(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", compare_digest)
    tokens = [Token(f"t{n}", f"{SECRET}-{n}", ("admin",)) for n in range(4)]
    gate = Gate(Recorder(), tokens)
    for presented, name in (
        (f"{SECRET}-0", "t0"),
        (f"{SECRET}-3", "t3"),
        ("a-wrong-secret-of-24-chars", None),
    ):
        compared.clear()
        if name is None:
            with pytest.raises(Unauthorized):
                gate.identify(f"Bearer {presented}".encode())
        else:
            assert gate.identify(f"Bearer {presented}".encode()).name == name
        assert len(compared) == len(tokens), "every token, however early one matched"
        assert all(len(a) == len(b) == 32 for a, b in compared), "digests of equal length, not secrets"
        assert all(presented.encode() not in pair for pair in compared)


async def test_push_callbacks_check_the_consume_scope_of_the_messages_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``/v1/messages/{id}/…`` needs only a valid token at the gate; the route then finds the message's
    queue and needs ``consume`` on it. A token that may not even read that queue gets a 404, as for an
    id that is nowhere: ids are predictable, and a 403 would say where the message is."""
    admin, other, worker = "admin-secret-0000000001", "other-secret-0000000002", "worker-secret-000000003"
    stranger = "stranger-secret-00000004"
    tokens = (
        Token("admin", admin, ("admin",)),
        Token("other", other, ("consume:other", "read:*", "publish:*")),
        Token("worker", worker, ("consume:jobs",)),
        Token("stranger", stranger, ("consume:other",)),
    )
    receiver = Receiver()
    options = {"poll_interval": 0.5, "transport": receiver.transport()}
    async with (
        open_broker(Settings(in_memory=True, tokens=tokens), push_options=options) as broker,
        broker.app.test_app() as app,
    ):
        client = app.test_client()

        def auth(secret: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {secret}"}

        push = {"url": "http://receiver.test/hook", "mode": "ack", "ack_timeout": 600}
        assert (
            await client.put("/v1/queues/jobs", json={"push": push}, headers=auth(admin))
        ).status_code == 201
        published = await client.post("/v1/queues/jobs/messages", json={"payload": 1}, headers=auth(admin))
        message_id = (await published.get_json())["messages"][0]["id"]
        await wait_until(lambda: len(receiver.requests) == 1)

        for verb, body in (("ack", {}), ("nack", {"delay": 5}), ("defer", {"retry_after": 5})):
            path = f"/v1/messages/{message_id}/{verb}"
            assert (await client.post(path, json=body)).status_code == 401
            refused = await client.post(path, json=body, headers=auth(other))
            assert refused.status_code == 403, verb
            error = (await refused.get_json())["error"]
            assert error["code"] == "forbidden" and "consume:jobs" in error["message"], error
            hidden = await client.post(path, json=body, headers=auth(stranger))
            assert hidden.status_code == 404 and "jobs" not in (await hidden.get_data()).decode(), verb
        acked = await client.post(f"/v1/messages/{message_id}/ack", json={}, headers=auth(worker))
        assert acked.status_code == 200 and (await acked.get_json())["acked"] == 1


async def test_a_target_in_absolute_form_is_judged_by_the_path_it_routes_to() -> None:
    """``GET http://host/v1/admin/snapshots`` (RFC 9112's absolute form) reaches the same route as
    ``GET /v1/admin/snapshots``, so it needs the same scope: the gate judges the path the router sees."""
    inner = Recorder()
    gate = Gate(inner, [Token("worker", SECRET, ("consume:jobs",))])
    for target in (
        "http://127.0.0.1/v1/admin/snapshots",
        "x:/v1/admin/snapshots",
        "http://h:1/v1/admin/snapshots",
    ):
        status, _, body = await call(gate, "GET", target, f"Bearer {SECRET}")
        assert status == 403 and body["error"]["code"] == "forbidden", target
    assert (await call(gate, "POST", "http://127.0.0.1/v1/queues/jobs/claim", f"Bearer {SECRET}"))[0] == 204
    (passed,) = inner.scopes
    assert passed["path"] == "/v1/queues/jobs/claim" and passed["raw_path"] == b"/v1/queues/jobs/claim"


async def served(
    broker: Broker, method: str, target: str, secret: str, raw_target: bytes | None = None
) -> tuple[int, Any]:
    """``method target`` as Hypercorn hands it to the whole app (``raw_target``: as sent, when Hypercorn
    decoded it), with an empty body; its status and decoded answer."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": target, "raw_path": raw_target or target.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8080),
        "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {secret}".encode())],
        "extensions": {}, "state": {},
    }  # fmt: skip
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with trio.fail_after(10):
        await broker.app.asgi_app(scope, receive, send)  # type: ignore[arg-type]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    if sent[0]["status"] == 200 and target.endswith("/metrics"):
        return 200, body
    return sent[0]["status"], orjson.loads(body) if body else None


async def test_the_served_app_refuses_an_absolute_form_target_the_token_may_not_use() -> None:
    """The whole app, as Hypercorn hands it a request whose target is in absolute form: a consume-only
    token can neither read the snapshots nor create a queue that way, and an admin token can."""
    worker, admin = "worker-secret-000000003", "admin-secret-0000000001"
    tokens = (Token("worker", worker, ("consume:jobs",)), Token("admin", admin, ("admin",)))
    async with open_broker(Settings(in_memory=True, tokens=tokens)) as broker:

        async def request(method: str, target: str, secret: str) -> tuple[int, Any]:
            return await served(broker, method, target, secret)

        assert (await request("GET", "http://127.0.0.1/v1/admin/snapshots", worker))[0] == 403
        assert (await request("PUT", "http://127.0.0.1/v1/queues/made-by-a-worker", worker))[0] == 403
        assert (await request("GET", "/v1/queues/made-by-a-worker", admin))[0] == 404
        status, answer = await request("PUT", "http://127.0.0.1/v1/queues/made-by-admin", admin)
        assert status == 201 and answer["name"] == "made-by-admin"


@pytest.mark.parametrize("route", routes())
@pytest.mark.parametrize("prefix", ["//", "///"])
async def test_a_path_with_leading_slashes_needs_the_scope_of_the_route_it_is_served_by(
    route: str, prefix: str
) -> None:
    """Werkzeug's router drops a path's leading slashes: so ``//v1/queues/x`` is served as
    ``/v1/queues/x``, and must need what that route needs. A token
    whose only scope is on another queue may use none of the routes that need a scope (this let any
    valid token create, purge and delete queues, publish, claim, and take snapshots)."""
    method, template = route.split(" ", 1)
    path = template.replace("{queue}", "jobs").replace("{id}", "m-1").replace("{stream_id}", "s-1")
    path = path.replace("{account}", "a").replace("{name}", "n")
    need = need_of(method, path)
    bystander, admin = "bystander-secret-000001", "admin-secret-0000000001"
    tokens = (Token("bystander", bystander, ("read:elsewhere",)), Token("admin", admin, ("admin",)))
    async with open_broker(Settings(in_memory=True, tokens=tokens)) as broker:
        await served(broker, "PUT", "/v1/queues/jobs", admin)
        decoded = "/" + path  # what Hypercorn hands on for "//…" and "///…" (one more)
        if prefix == "///":
            decoded = "/" + decoded
        raw = (prefix + path.lstrip("/")).encode()
        status, answer = await served(broker, method, decoded, bystander, raw)
        if need in (OPEN, ANY):
            assert status != 403, (route, answer)
        else:
            assert status == 403 and answer["error"]["code"] == "forbidden", (route, status, answer)
            stats = (await served(broker, "GET", "/v1/queues/jobs", admin))[1]["stats"]
            assert stats["published_total"] == 0 and stats["ready"] == 0


async def test_an_encoded_slash_stays_in_its_segment_rather_than_routing_elsewhere() -> None:
    """Hypercorn decodes ``%2F`` with the rest of the path: ``/v1/queues/jobs%2Fclaim`` was served as a
    claim on ``jobs``, ``/%2Fv1/queues/jobs`` as ``/v1/queues/jobs``, and ``PUT /v1/queues/a%2Fb``
    was Werkzeug's 404 page for a path no route has. An encoded slash is part of its segment now: a
    name no queue can have (400), or no route."""
    admin = "admin-secret-0000000001"
    headers = {"Authorization": f"Bearer {admin}"}
    async with (
        open_broker(Settings(in_memory=True, tokens=(Token("admin", admin, ("admin",)),))) as broker,
        broker.app.test_app() as app,
    ):
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={}, headers=headers)
        await client.post("/v1/queues/jobs/messages", json={"payload": 1}, headers=headers)
        for method, raw in (("PUT", b"/v1/queues/a%2Fb"), ("GET", b"/v1/queues/jobs%2fmessages")):
            status, answer = await served(broker, method, unquote(raw.decode()), admin, raw)
            assert status == 400 and answer["error"]["code"] == "invalid_request", (raw, answer)
            assert "%2F" in answer["error"]["message"] or "%2f" in answer["error"]["message"]
        for method, raw in (("POST", b"/v1/queues/jobs%2Fclaim"), ("GET", b"/%2Fv1/queues/jobs")):
            status, answer = await served(broker, method, unquote(raw.decode()), admin, raw)
            assert status in (404, 405) and answer["error"]["code"] in ("not_found", "method_not_allowed")
        stats = (await (await client.get("/v1/queues/jobs", headers=headers)).get_json())["stats"]
        assert (stats["ready"], stats["in_flight"]) == (1, 0)  # the message was not claimed
        # In absolute form the target was decoded before it was split: %3F and %23 became a query and
        # a fragment, cut off, and /v1/queues/jobs%3Fx served jobs.
        for raw in (b"http://h/v1/queues/jobs%3Fx", b"http://h/v1/queues/jobs%23x"):
            status, answer = await served(broker, "GET", unquote(raw.decode()), admin, raw)
            assert status == 400 and answer["error"]["code"] == "invalid_request", (raw, answer)
        status, answer = await served(
            broker, "GET", "http://h/v1/queues/jobs", admin, b"http://h/v1/queues/jobs"
        )
        assert status == 200 and answer["name"] == "jobs"


def test_a_scope_made_for_the_router_is_not_decoded_again() -> None:
    """The observer and then the gate each make the routed path: the second decoded it again, so with
    tokens ``%2573ecret`` (``%73ecret``, no queue name) was served as the queue ``secret``."""
    raw = b"http://h/compat/cloudflare/client/v4/accounts/a%2Fb/queues/%2573ecret/messages/pull"
    scope = cast("HTTPScope", {"path": unquote(raw.decode()), "raw_path": raw, "headers": []})
    once = origin_scope(scope)
    assert once["path"].endswith("/queues/%73ecret/messages/pull")
    assert origin_scope(once)["path"] == once["path"]


async def test_a_refusal_answers_cbor_when_asked_except_on_the_compatibility_surfaces() -> None:
    """The gate's 401 and 403 were JSON whatever the request's Accept, unlike every route's errors."""
    admin = "admin-secret-0000000001"
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async with open_broker(Settings(in_memory=True, tokens=(Token("admin", admin, ("admin",)),))) as broker:
        for path, media_type in (
            ("/v1/queues/jobs", b"application/cbor"),
            ("/compat/qhook/api/queues", b"application/json"),  # the surfaces answer JSON only
        ):
            sent.clear()
            scope = {
                "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8080),
                "headers": [(b"host", b"127.0.0.1"), (b"accept", b"application/cbor")],
                "extensions": {}, "state": {},
            }  # fmt: skip
            with trio.fail_after(10):
                await broker.app.asgi_app(scope, receive, send)  # type: ignore[arg-type]
            assert sent[0]["status"] == 401
            assert dict(sent[0]["headers"])[b"content-type"] == media_type
            body = sent[1]["body"]
            error = (cbor2.loads(body) if media_type == b"application/cbor" else orjson.loads(body))["error"]
            assert error["code"] == "unauthorized"


async def test_a_target_that_is_neither_a_path_nor_a_url_is_no_route_rather_than_a_500() -> None:
    """``GET http://[/v1/queues``: urlsplit raised (an unclosed IPv6 bracket) in the outermost layer,
    before any answer or log line, and Hypercorn sent a bare 500, without even asking for a token."""
    admin = "admin-secret-0000000001"
    async with open_broker(Settings(in_memory=True, tokens=(Token("admin", admin, ("admin",)),))) as broker:
        for target in ("http://[/v1/queues", "http://[::1/v1/queues", "http://]x/v1/queues"):
            status, answer = await served(broker, "GET", target, admin)
            assert status == 404 and answer["error"]["code"] == "not_found", (target, status, answer)
            assert (await served(broker, "GET", target, "not-a-token-at-all"))[0] == 401


async def test_an_empty_segment_inside_a_path_is_no_route_rather_than_a_redirect_to_one() -> None:
    """The router no longer merges ``/v1//queues/x`` into ``/v1/queues/x`` (Werkzeug answered a 308 to
    it, in HTML): a path reads the same to the gate and to the router, or it is no route at all."""
    admin = "admin-secret-0000000001"
    async with open_broker(Settings(in_memory=True, tokens=(Token("admin", admin, ("admin",)),))) as broker:
        for target in ("/v1//queues/x", "/v1/queues//x", "/v1/admin//snapshots"):
            status, answer = await served(broker, "PUT" if "queues" in target else "GET", target, admin)
            assert status == 404 and answer["error"]["code"] == "not_found", (target, status, answer)
        assert (await served(broker, "GET", "/v1/queues/x", admin))[0] == 404, "nothing was created"
