"""SimpleQ's job API under /compat/simpleq, driven as SimpleQ's documented clients drive it, with pushes
to real receivers on loopback (the real clock) that verify ``x-simpleq-signature`` as SimpleQ's docs
tell a receiver to."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import cbor2
import pytest
import trio
import trio.testing

from broker.actor import QueueActor
from broker.config import Settings, Token
from broker.core import FinishedHistory
from broker.core.commands import GetMessage
from broker.server import open_broker
from tests.conftest import Client
from tests.push.conftest import Received, Receiver, pushing, served, wait_until

BASE = "/compat/simpleq"
ENVELOPE = {"id", "queue", "payload", "attempt", "maxAttempts", "createdAt"}
QUEUE_FIELDS = {
    "id",
    "name",
    "webhookUrl",
    "mode",
    "concurrency",
    "maxAttempts",
    "ackTimeout",
    "ackTimeoutAction",
    "backoffType",
    "backoffDelay",
    "rateLimitMax",
    "rateLimitWindow",
    "dlqEnabled",
    "depth",
}
JOB_FIELDS = {
    "id",
    "queue",
    "state",
    "payload",
    "idempotencyKey",
    "attempt",
    "maxAttempts",
    "createdAt",
    "runAt",
    "attempts",
}
ATTEMPT_FIELDS = {"attempt", "status", "error", "webhookStatusCode", "timestamp"}


def verify_signature(secret: str, raw_body: bytes, header: str | None) -> bool:
    """What SimpleQ's docs have a receiver do: HMAC-SHA256 of the raw body keyed with the queue's
    signing secret, ``sha256=`` + lowercase hex, compared in constant time (written out here)."""
    if not header:
        return False
    expected = "sha256=" + hmac.new(secret.encode(), raw_body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, header)


def verifying(secrets: list[str]) -> Any:
    """A receiver answer: 200 when the push verifies with ``secrets[0]``, else 401."""

    async def answer(received: Received) -> tuple[int, dict[str, str]]:
        if verify_signature(secrets[0], received.body, received.headers.get("x-simpleq-signature")):
            return 200, {}
        return 401, {}

    return answer


async def call(client: Client, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    response = await client.open(f"{BASE}{path}", method=method, json=body)
    data = await response.get_data()
    return response.status_code, (json.loads(data) if data else None)


async def create(client: Client, **fields: Any) -> dict[str, Any]:
    status, queue = await call(client, "POST", "/v1/queues", fields)
    assert status == 201, queue
    assert isinstance(queue, dict)
    return queue


async def job(client: Client, job_id: str) -> dict[str, Any]:
    status, answer = await call(client, "GET", f"/v1/jobs/{job_id}")
    assert status == 200, answer
    assert isinstance(answer, dict)
    return answer


async def publish(client: Client, queue: str, payload: Any, **fields: Any) -> str:
    status, answer = await call(client, "POST", f"/v1/queues/{queue}/jobs", {"payload": payload, **fields})
    assert status == 201, answer
    job_id: str = answer["id"]
    return job_id


# -- queues --------------------------------------------------------------------------------------------


async def test_create_shows_every_field_and_the_signing_secret_once(client: Client) -> None:
    body = {
        "name": "emails",
        "webhookUrl": "https://worker.example.com/webhook",
        "mode": "ack",
        "concurrency": 7,
        "maxAttempts": 5,
        "ackTimeout": 120,
        "ackTimeoutAction": "dead",
        "backoffType": "exponential",
        "backoffDelay": 3,
        "rateLimitMax": 800,
        "rateLimitWindow": 60,
        "dlqEnabled": True,
    }
    queue = await create(client, **body)
    assert set(queue) == QUEUE_FIELDS | {"signingSecret"}
    assert re.fullmatch(r"[0-9a-f]{64}", queue.pop("signingSecret"))
    assert queue == {**body, "id": "emails", "depth": 0}
    assert (await call(client, "GET", "/v1/queues/emails")) == (200, queue)
    assert (await call(client, "GET", "/v1/queues")) == (200, [queue])  # no secret in either
    native = await (await client.get("/v1/queues/emails")).get_json()
    push = native["config"]["push"]
    assert (push["format"], push["mode"], push["ack_timeout"]) == ("simpleq", "ack", 120.0)
    assert native["config"]["rate_limit"] == {"max": 800, "per": 60.0}
    assert native["config"]["dead_letter"] == "emails.dlq"
    # SimpleQ has no cap: a backoffDelay over the queue's raises it, rather than being cut to it; a cap
    # set natively stays while the delay is within it.
    native_backoff = {"type": "fixed", "base": 10, "max": 60}
    assert (await client.put("/v1/queues/emails", json={"retry_backoff": native_backoff})).status_code == 200
    assert (await call(client, "PUT", "/v1/queues/emails", {"backoffType": "exponential"}))[0] == 200
    native = await (await client.get("/v1/queues/emails")).get_json()
    assert native["config"]["retry_backoff"] == {"type": "exponential", "base": 10.0, "max": 60.0}
    assert (await call(client, "PUT", "/v1/queues/emails", {"backoffDelay": 7200}))[0] == 200
    native = await (await client.get("/v1/queues/emails")).get_json()
    assert native["config"]["retry_backoff"] == {"type": "exponential", "base": 7200.0, "max": 7200.0}


async def test_the_defaults_and_the_list_of_simpleq_queues_only(client: Client) -> None:
    queue = await create(client, name="plain", webhookUrl="https://w.example.com/hook")
    del queue["signingSecret"]
    assert queue == {
        "id": "plain",
        "name": "plain",
        "webhookUrl": "https://w.example.com/hook",
        "mode": "standard",
        "concurrency": 10,
        "maxAttempts": 0,
        "ackTimeout": 300.0,
        "ackTimeoutAction": "retry",
        "backoffType": "fixed",
        "backoffDelay": 0.0,
        "rateLimitMax": None,
        "rateLimitWindow": None,
        "dlqEnabled": True,
        "depth": 0,
    }
    assert (await client.put("/v1/queues/native", json={})).status_code == 201
    status, listed = await call(client, "GET", "/v1/queues")
    assert status == 200 and [item["name"] for item in listed] == ["plain"]


async def test_a_template_prefills_and_explicit_fields_override(client: Client) -> None:
    claude = await create(client, template="anthropic", name="claude", webhookUrl="https://w.example.com/a")
    assert {key: claude[key] for key in ("mode", "maxAttempts", "concurrency", "ackTimeout")} == {
        "mode": "ack",
        "maxAttempts": 4,
        "concurrency": 20,
        "ackTimeout": 600.0,
    }
    assert (claude["ackTimeoutAction"], claude["backoffType"], claude["backoffDelay"]) == (
        "retry",
        "exponential",
        2.0,
    )
    assert claude["dlqEnabled"] is True
    gpt = await create(
        client,
        template="openai",
        name="gpt",
        webhookUrl="https://w.example.com/o",
        concurrency=50,
        backoffDelay=5,
        dlqEnabled=False,
    )
    assert (gpt["ackTimeout"], gpt["concurrency"], gpt["dlqEnabled"]) == (300.0, 50, False)
    assert (gpt["backoffType"], gpt["backoffDelay"]) == ("exponential", 5.0)
    status, answer = await call(
        client,
        "POST",
        "/v1/queues",
        {"template": "gemini", "name": "g", "webhookUrl": "https://w.example.com"},
    )
    assert status == 400 and "'anthropic' or 'openai'" in answer["error"]["message"]


async def test_update_delete_and_refusals(client: Client) -> None:
    first = await create(client, name="q", webhookUrl="https://w.example.com/1", maxAttempts=3)
    status, updated = await call(
        client, "PUT", "/v1/queues/q", {"webhookUrl": "https://w.example.com/2", "rateLimitMax": 10}
    )
    assert status == 200, updated
    assert (updated["webhookUrl"], updated["maxAttempts"]) == ("https://w.example.com/2", 3)
    assert (updated["rateLimitMax"], updated["rateLimitWindow"]) == (10, 60.0)
    assert updated["signingSecret"] == first["signingSecret"]  # kept; SimpleQ's PUT answer shows it
    status, updated = await call(
        client, "PUT", "/v1/queues/q", {"rateLimitMax": None, "backoffType": "exponential"}
    )
    assert (status, updated["rateLimitMax"], updated["backoffType"]) == (200, None, "exponential")
    assert (await client.put("/v1/queues/native", json={})).status_code == 201  # it does not push
    refusals = [
        # Well-formed, but the queue has no webhook to keep: its state refuses the change.
        ("PUT", "/v1/queues/native", {"ackTimeoutAction": "dead"}, 409, "does not push"),
        ("PUT", "/v1/queues/q", {"name": "other"}, 400, "name cannot be changed"),
        ("PUT", "/v1/queues/q", {"maxAttempts": -1}, 400, "maxAttempts must be"),
        ("PUT", "/v1/queues/q", {"mode": "sometimes"}, 400, "mode must be"),
        ("PUT", "/v1/queues/q", {"colour": "red"}, 400, "colour"),
        ("POST", "/v1/queues", {"name": "n"}, 400, "webhookUrl is required"),
        ("POST", "/v1/queues", {"webhookUrl": "https://w.example.com"}, 400, "name is required"),
        ("POST", "/v1/queues", {"name": "q", "webhookUrl": "https://w.example.com"}, 409, "exists"),
        ("POST", "/v1/queues", {"name": "n", "webhookUrl": "ftp://x"}, 400, "webhookUrl must be"),
        ("PUT", "/v1/queues/none", {}, 404, "does not exist"),
    ]
    for method, path, body, expected, text in refusals:
        status, answer = await call(client, method, path, body)
        assert status == expected, (path, body, answer)
        assert text in answer["error"]["message"], answer
    assert (await call(client, "DELETE", "/v1/queues/q"))[0] == 204
    assert (await call(client, "GET", "/v1/queues/q"))[0] == 404


# -- jobs -----------------------------------------------------------------------------------------------


async def test_a_key_whose_job_finished_and_was_let_go_is_answered_200_with_its_id() -> None:
    """The key outlives the job (``dedup_window`` against ``finished_history``): a publish retried with
    it was answered 404 ``message_not_found`` for the job it matched."""
    settings = Settings(in_memory=True, finished_history=FinishedHistory(1, 1 << 20))
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        assert (await client.put("/v1/queues/docs", json={})).status_code == 201
        status, first = await call(
            client, "POST", "/v1/queues/docs/jobs", {"payload": {}, "idempotencyKey": "k0"}
        )
        assert status == 201
        for _ in range(2):  # ack it, and one more after it: only the newest finished job is kept
            await call(client, "POST", "/v1/queues/docs/jobs", {"payload": {}})
            claimed = await (await client.post("/v1/queues/docs/claim", json={"max": 1})).get_json()
            leases = [message["lease_id"] for message in claimed["messages"]]
            assert (await client.post("/v1/queues/docs/ack", json={"leases": leases})).status_code == 200
        assert (await client.get(f"/v1/queues/docs/messages/{first['id']}")).status_code == 404
        again = {"payload": {"other": 1}, "idempotencyKey": "k0"}
        status, answer = await call(client, "POST", "/v1/queues/docs/jobs", again)
        assert (status, answer) == (200, {"id": first["id"], "queue": "docs", "idempotencyKey": "k0"})


async def test_a_job_from_before_a_restart_is_looked_up_in_the_queue_that_holds_it_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its id has no queue's prefix of this boot, so every queue was asked through its inbox, as for an
    id no queue has: at tens of thousands of queues, ~1 s of the event loop per lookup, and the waits it
    left behind walked by every young collection (``Registry.holding``)."""
    settings = Settings(data_dir=tmp_path)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        for name in ("a", "b", "c"):
            assert (await client.put(f"/v1/queues/{name}", json={})).status_code == 201
        job_id = await publish(client, "b", {"n": 1})
        acked = await publish(client, "c", {"n": 2})
        claimed = await (await client.post("/v1/queues/c/claim", json={"max": 1})).get_json()
        leases = [message["lease_id"] for message in claimed["messages"]]
        assert (await client.post("/v1/queues/c/ack", json={"leases": leases})).status_code == 200
    asked: list[str] = []
    request = QueueActor.request

    async def counted(actor: QueueActor, command: Any) -> Any:
        if isinstance(command, GetMessage):
            asked.append(actor.core.name)
        return await request(actor, command)

    monkeypatch.setattr(QueueActor, "request", counted)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        assert not any(job_id.startswith(broker.registry.get(name).core.id_prefix) for name in "abc")
        assert ((await job(client, job_id))["queue"], asked) == ("b", ["b"])
        asked.clear()
        assert ((await job(client, acked))["state"], asked) == ("completed", ["c"])  # finished, remembered
        asked.clear()
        assert (await call(client, "GET", "/v1/jobs/no-such-job"))[0] == 404
        assert asked == []


async def test_publish_is_201_then_200_with_the_same_job_for_the_same_idempotency_key(client: Client) -> None:
    assert (await client.put("/v1/queues/docs", json={})).status_code == 201  # no push: jobs stay queued
    body = {"payload": {"userId": "123"}, "idempotencyKey": "welcome-email-user-123"}
    status, first = await call(client, "POST", "/v1/queues/docs/jobs", body)
    assert status == 201, first
    assert set(first) == JOB_FIELDS
    assert first["queue"] == "docs" and first["state"] == "queued" and first["attempts"] == []
    assert (first["payload"], first["idempotencyKey"], first["attempt"]) == (
        {"userId": "123"},
        body["idempotencyKey"],
        0,
    )
    assert first["createdAt"].endswith("Z") and first["runAt"] is None
    again = {"payload": {"userId": "other"}, "idempotencyKey": "welcome-email-user-123"}
    status, second = await call(client, "POST", "/v1/queues/docs/jobs", again)
    assert status == 200 and second["id"] == first["id"] and second["payload"] == {"userId": "123"}
    status, delayed = await call(client, "POST", "/v1/queues/docs/jobs", {"payload": {}, "delay": 30.5})
    assert status == 201 and delayed["state"] == "queued" and delayed["runAt"] is not None
    for bad, text in [
        ({"payload": [1]}, "payload is required: a JSON object"),
        ({"idempotencyKey": "k"}, "payload is required"),
        ({"payload": {}, "delay": 86401}, "delay"),
        ({"payload": {}, "idempotencyKey": 7}, "idempotencyKey"),
        ({"payload": {}, "priority": 1}, "priority"),
    ]:
        status, answer = await call(client, "POST", "/v1/queues/docs/jobs", bad)
        assert status == 400 and text in answer["error"]["message"], (bad, answer)
    assert (await call(client, "POST", "/v1/queues/none/jobs", {"payload": {}}))[0] == 404
    assert (await call(client, "GET", "/v1/jobs/no-such-job"))[0] == 404


async def test_a_cbor_publish_refuses_what_json_cannot_hold_as_the_native_one_does(client: Client) -> None:
    """A CBOR body may hold NaN, infinities, dates and UUIDs, which the JSON encoder would have stored
    as ``null`` or as a string: the publish said 201 and kept another payload than the one sent."""
    assert (await client.put("/v1/queues/docs", json={})).status_code == 201  # no push: jobs stay queued
    path = f"{BASE}/v1/queues/docs/jobs"
    cbor = {"Content-Type": "application/cbor"}
    for value, text in [
        (float("nan"), "nan is not a JSON number"),
        (float("inf"), "inf is not a JSON number"),
        (datetime(2026, 1, 2, tzinfo=UTC), "a datetime is not JSON"),
        (uuid.UUID(int=7), "a UUID is not JSON"),
        (b"bytes", "a byte string is not JSON"),
        (cbor2.undefined, "undefined is not JSON"),
        (cbor2.CBORTag(999, 1), "a CBOR tag (999) is not JSON"),
    ]:
        response = await client.post(path, data=cbor2.dumps({"payload": {"a": value}}), headers=cbor)
        answer = await response.get_json()
        assert response.status_code == 400, (value, answer)
        error = answer["error"]
        assert error["message"] == f"payload must hold JSON values only: {text}", error
    # What JSON holds comes through a CBOR body as it was sent.
    body = cbor2.dumps({"payload": {"a": [1.5, "x", None]}, "idempotencyKey": "k"})
    response = await client.post(path, data=body, headers=cbor)
    assert response.status_code == 201
    assert (await response.get_json())["payload"] == {"a": [1.5, "x", None]}
    # Refusals of the native publish name SimpleQ's fields, whatever the body's encoding.
    status, answer = await call(client, "POST", "/v1/queues/docs/jobs", {"payload": {}, "idempotencyKey": ""})
    assert status == 400 and answer["error"]["message"].startswith("idempotencyKey "), answer


async def test_a_push_is_simpleqs_envelope_signed_as_simpleq_signs() -> None:
    secrets: list[str] = []
    receiver = Receiver(verifying(secrets))
    async with served(receiver) as base, pushing() as p:
        queue = await create(p.client, name="ai-jobs", webhookUrl=f"{base}/webhook", maxAttempts=5)
        secrets.append(queue["signingSecret"])
        job_id = await publish(p.client, "ai-jobs", {"model": "m", "messages": [{"role": "user"}]})
        await wait_until(lambda: bool(receiver.requests))
        await wait_until(lambda: (p.supervisor.status("ai-jobs") or {}).get("acked_total") == 1)
        [request] = receiver.requests
        assert (request.method, request.path) == ("POST", "/webhook")
        assert request.headers["content-type"] == "application/json"
        envelope = request.json
        assert set(envelope) == ENVELOPE
        assert (envelope["id"], envelope["queue"]) == (job_id, "ai-jobs")
        assert envelope["payload"] == {"model": "m", "messages": [{"role": "user"}]}
        assert (envelope["attempt"], envelope["maxAttempts"]) == (1, 5)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", envelope["createdAt"])
        assert re.fullmatch(r"sha256=[0-9a-f]{64}", request.headers["x-simpleq-signature"])
        assert "x-broker-signature" not in request.headers
        done = await job(p.client, job_id)
        assert done["state"] == "completed"
        [attempt] = done["attempts"]
        assert set(attempt) == ATTEMPT_FIELDS
        assert (attempt["attempt"], attempt["status"], attempt["webhookStatusCode"]) == (1, "completed", 200)


async def test_a_receiver_with_the_wrong_secret_refuses_the_push() -> None:
    receiver = Receiver(verifying(["not-the-signing-secret-of-this-queue"]))
    async with served(receiver) as base, pushing() as p:
        await create(p.client, name="ai-jobs", webhookUrl=f"{base}/webhook")
        job_id = await publish(p.client, "ai-jobs", {"n": 1})
        await wait_until(lambda: (p.supervisor.status("ai-jobs") or {}).get("refused_total") == 1)
        refused = await job(p.client, job_id)
        assert refused["state"] == "queued"  # deferred: the broker's push pauses (docs/push.md)
        assert [(a["status"], a["webhookStatusCode"]) for a in refused["attempts"]] == [("deferred", 401)]
        assert refused["attempt"] == 0  # a refusal spends no attempt


async def test_failed_attempts_show_in_the_job_history() -> None:
    answers = iter([500, 200])

    async def flaky(_: Received) -> tuple[int, dict[str, str]]:
        return next(answers), {}

    receiver = Receiver(flaky)
    async with served(receiver) as base, pushing() as p:
        await create(p.client, name="jobs", webhookUrl=f"{base}/hook", maxAttempts=3)
        job_id = await publish(p.client, "jobs", {"n": 1})
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 1)
        done = await job(p.client, job_id)
        assert done["state"] == "completed" and done["attempt"] == 2
        assert [(a["attempt"], a["status"], a["webhookStatusCode"]) for a in done["attempts"]] == [
            (1, "failed", 500),
            (2, "completed", 200),
        ]
        assert done["attempts"][0]["error"] == "push: HTTP 500"


async def test_each_attempt_shows_its_own_pushs_answer_while_the_next_push_is_in_progress(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The push history has no entry for a push in progress: pairing the two histories by position
    showed attempt 1 without its 500 and the push in progress with it."""
    release = trio.Event()

    async def fails_then_hangs(received: Received) -> tuple[int, dict[str, str]]:
        if received.json["attempt"] == 1:
            return 500, {}
        await release.wait()
        return 200, {}

    receiver = Receiver(fails_then_hangs)
    async with pushing(receiver.transport()) as p:
        await create(p.client, name="jobs", webhookUrl="https://worker.example.com/hook", maxAttempts=3)
        job_id = await publish(p.client, "jobs", {"n": 1})
        await wait_until(lambda: receiver.in_progress == 1)
        shown = (await job(p.client, job_id))["attempts"]
        assert [(a["attempt"], a["status"], a["webhookStatusCode"], a["error"]) for a in shown] == [
            (1, "failed", 500, "push: HTTP 500"),
            (2, "processing", None, None),
        ]
        release.set()
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 1)
        done = await job(p.client, job_id)
        assert [(a["status"], a["webhookStatusCode"]) for a in done["attempts"]] == [
            ("failed", 500),
            ("completed", 200),
        ]


async def test_ack_nack_and_defer_by_job_id_settle_ack_mode_jobs() -> None:
    receiver = Receiver()
    async with served(receiver) as base, pushing() as p:
        await create(p.client, name="claude", template="anthropic", webhookUrl=f"{base}/webhook")
        acked, nacked, deferred, deferred_text = [
            await publish(p.client, "claude", {"n": n}) for n in range(4)
        ]
        await wait_until(lambda: len(receiver.requests) == 4)
        # The receiver counts a request as it arrives; the dispatcher records its 2xx (and counts it
        # pushed, in the same step) a moment later.
        await wait_until(lambda: (p.supervisor.status("claude") or {}).get("pushed_total") == 4)
        assert (p.supervisor.status("claude") or {})["in_flight"] == 4
        waiting = await job(p.client, acked)
        assert waiting["state"] == "awaiting_ack"
        assert [(a["status"], a["webhookStatusCode"]) for a in waiting["attempts"]] == [("awaiting_ack", 200)]

        status, answer = await call(p.client, "POST", f"/v1/jobs/{acked}/ack", {})
        assert status == 200 and answer["state"] == "completed", answer
        assert await call(p.client, "POST", f"/v1/jobs/{acked}/ack", {}) == (200, answer)  # idempotent
        status, again = await call(p.client, "POST", f"/v1/jobs/{acked}/nack", {"retryable": True})
        assert status == 400 and "not awaiting ack" in again["error"]["message"]

        status, answer = await call(
            p.client, "POST", f"/v1/jobs/{nacked}/nack", {"retryable": False, "reason": "anthropic 400"}
        )
        assert status == 200 and answer["state"] == "dead", answer
        assert (answer["attempts"][-1]["status"], answer["attempts"][-1]["error"]) == (
            "dead",
            "anthropic 400",
        )

        status, answer = await call(
            p.client, "POST", f"/v1/jobs/{deferred}/defer", {"retryAfter": 3600, "reason": "anthropic 429"}
        )
        assert status == 200 and answer["state"] == "queued", answer
        assert answer["attempt"] == 0 and answer["runAt"] is not None  # no attempt spent
        assert answer["attempts"][-1]["status"] == "deferred"

        # The text a provider hands the worker (a Retry-After header's value) is passed through as is.
        status, answer = await call(p.client, "POST", f"/v1/jobs/{deferred_text}/defer", {"retryAfter": "90"})
        assert status == 200 and answer["state"] == "queued" and answer["attempt"] == 0, answer
        held = datetime.fromisoformat(answer["runAt"]) - datetime.now(UTC)
        assert timedelta(seconds=80) < held <= timedelta(seconds=90), held
        for body, text in [
            ({}, "retryAfter is required"),
            ({"retryAfter": True}, "retryAfter"),
            ({"retryAfter": 3601}, "retryAfter"),
            ({"retryAfter": "soon"}, "retryAfter"),
            ({"retryAfter": 1, "delay": 1}, "delay"),
        ]:
            status, answer = await call(p.client, "POST", f"/v1/jobs/{deferred}/defer", body)
            assert status == 400 and text in answer["error"]["message"], (body, answer)
        assert (await call(p.client, "POST", "/v1/jobs/nothing-here/ack", {}))[0] == 404
        status, answer = await call(p.client, "POST", f"/v1/jobs/{acked}/ack", {"extra": 1})
        assert status == 400

        dead = await (await p.client.get("/v1/queues/claude.dlq/messages")).get_json()
        assert [message["headers"]["x-original-id"] for message in dead["messages"]] == [nacked]


async def test_a_retried_callback_naming_its_attempt_settles_nothing_more(
    autojump_clock: trio.testing.MockClock, sent: list[tuple[str, str]]
) -> None:
    """SimpleQ's callbacks name only the job: the same nack retried after the job was pushed again (at
    once, with backoffDelay 0) settled the new push, and three of them dead-lettered the job. Naming
    the push envelope's ``attempt`` makes the retry answer that push only."""
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        url = "https://worker.example.com/hook"
        await create(p.client, name="jobs", webhookUrl=url, mode="ack", maxAttempts=3, backoffDelay=0)
        job_id = await publish(p.client, "jobs", {"n": 1})

        def pushed(count: int) -> bool:
            return bool((p.supervisor.status("jobs") or {}).get("pushed_total") == count)

        await wait_until(lambda: pushed(1))
        nack = {"retryable": True, "reason": "transient", "attempt": receiver.requests[-1].json["attempt"]}
        status, first = await call(p.client, "POST", f"/v1/jobs/{job_id}/nack", nack)
        assert status == 200 and first["attempts"][0]["status"] == "failed", first
        await wait_until(lambda: pushed(2))
        assert receiver.requests[-1].json["attempt"] == 2
        for _ in range(2):  # the worker's HTTP client retries the nack it sent for attempt 1
            status, again = await call(p.client, "POST", f"/v1/jobs/{job_id}/nack", nack)
            assert status == 200, again
            assert (again["state"], again["attempt"]) == ("awaiting_ack", 2), again
        for body, text in [
            ({"attempt": 1}, "already nacked"),  # that push was nacked, not acked
            ({"attempt": 3}, "no push of attempt 3"),
            ({"attempt": 0}, "attempt must be"),
            ({"attempt": "2"}, "attempt must be"),
            ({"attempt": True}, "attempt must be"),
        ]:
            status, answer = await call(p.client, "POST", f"/v1/jobs/{job_id}/ack", body)
            assert status == 400 and text in answer["error"]["message"], (body, answer)
        sent.clear()
        status, done = await call(p.client, "POST", f"/v1/jobs/{job_id}/ack", {"attempt": 2})
        assert status == 200 and done["state"] == "completed", done
        # the push of attempt 2 is found by the queue's core (FindDelivery), acked, and shown
        reads = {"FindDelivery", "GetMessage", "Ack"}
        assert [command for _, command in sent if command in reads] == ["FindDelivery", "Ack", "GetMessage"]
        assert [attempt["status"] for attempt in done["attempts"]] == ["failed", "completed"]
        assert await call(p.client, "POST", f"/v1/jobs/{job_id}/ack", {"attempt": 2}) == (200, done)


async def test_a_retried_callback_without_its_attempt_is_answered_again_until_the_next_push(
    autojump_clock: trio.testing.MockClock,
) -> None:
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        url = "https://worker.example.com/hook"
        await create(p.client, name="jobs", webhookUrl=url, mode="ack", maxAttempts=3, backoffDelay=60)
        job_id = await publish(p.client, "jobs", {"n": 1})
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("pushed_total") == 1)
        nack = {"reason": "transient"}
        status, first = await call(p.client, "POST", f"/v1/jobs/{job_id}/nack", nack)
        assert status == 200 and (first["state"], first["attempt"]) == ("queued", 1), first
        # Held for its backoff, the job is not pushed again yet: the same nack answers the same.
        assert await call(p.client, "POST", f"/v1/jobs/{job_id}/nack", nack) == (200, first)


async def test_ack_of_a_standard_mode_job_is_a_400(client: Client) -> None:
    await create(client, name="std", webhookUrl="https://w.example.com/hook")
    assert (await client.put("/v1/queues/std", json={"push": None})).status_code == 200  # keep it queued
    job_id = await publish(client, "std", {"n": 1})
    status, answer = await call(client, "POST", f"/v1/jobs/{job_id}/ack", {})
    assert status == 400 and "ack mode" in answer["error"]["message"]


# -- the dead-letter queue -------------------------------------------------------------------------------


async def test_errors_are_json_like_every_answer_of_the_surface(client: Client) -> None:
    """The compatibility surfaces answer JSON only, yet their errors came as CBOR to Accept: cbor."""
    response = await client.get(f"{BASE}/v1/queues/ghost/dlq", headers={"Accept": "application/cbor"})
    assert response.status_code == 404 and response.content_type == "application/json"


async def test_a_dead_letter_listing_shows_attempts_any_publisher_wrote_without_failing(
    client: Client,
) -> None:
    """The dead-letter headers are a message's headers, which any publisher may set: "²" passed
    ``str.isdigit`` and 5,000 digits passed int()'s check, and both made the listing a 500."""
    await create(client, name="jobs", webhookUrl="https://w.example.com/hook")
    assert (await client.put("/v1/queues/jobs", json={"push": None})).status_code == 200
    assert (await client.put("/v1/queues/jobs.dlq", json={})).status_code == 201
    for attempts in ("\u00b2", "9" * 5000, "3"):
        headers = {"x-dead-letter-from": "jobs", "x-dead-letter-attempts": attempts}
        published = await client.post("/v1/queues/jobs.dlq/messages", json={"payload": 1, "headers": headers})
        assert published.status_code == 201
    status, page = await call(client, "GET", "/v1/queues/jobs/dlq")
    assert status == 200 and [entry["attempts"] for entry in page["data"]] == [None, None, 3]


async def test_dead_letter_jobs_are_listed_and_retried_one_by_one_or_in_bulk() -> None:
    code = [500]

    async def answer(_: Received) -> tuple[int, dict[str, str]]:
        return code[0], {}

    receiver = Receiver(answer)
    async with served(receiver) as base, pushing() as p:
        await create(p.client, name="jobs", webhookUrl=f"{base}/hook", maxAttempts=1)
        assert await call(p.client, "GET", "/v1/queues/jobs/dlq") == (200, {"data": [], "nextCursor": None})
        ids = [await publish(p.client, "jobs", {"n": n}) for n in range(3)]

        async def dlq() -> list[dict[str, Any]]:
            status, page = await call(p.client, "GET", "/v1/queues/jobs/dlq")
            assert status == 200, page
            entries: list[dict[str, Any]] = page["data"]
            return entries

        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("failed_total") == 3)
        with trio.fail_after(10):  # the dead letters reach jobs.dlq through its actor's inbox
            while len(entries := await dlq()) < 3:  # noqa: ASYNC110 - no event spans the queues
                await trio.sleep(0.02)
        assert sorted(entry["jobId"] for entry in entries) == sorted(ids)
        # A message published straight into the dead-letter queue is not one of jobs' dead letters: the
        # route needs read:jobs only, and a dead-letter queue may be shared with other queues' secrets.
        direct = await p.client.post("/v1/queues/jobs.dlq/messages", json={"payload": "not from jobs"})
        assert direct.status_code == 201
        assert [entry["id"] for entry in await dlq()] == [entry["id"] for entry in entries]
        first = entries[0]
        assert set(first) == {
            "id", "jobId", "queue", "payload", "attempts", "reason", "idempotencyKey", "failedAt", "state"
        }  # fmt: skip
        assert (first["queue"], first["attempts"], first["reason"], first["state"]) == (
            "jobs",
            1,
            "max_attempts",
            "dead",
        )
        assert (await job(p.client, first["jobId"]))["state"] == "dead"
        status, page = await call(p.client, "GET", "/v1/queues/jobs/dlq?limit=2")
        assert len(page["data"]) == 2 and page["nextCursor"] is not None
        status, rest = await call(p.client, "GET", f"/v1/queues/jobs/dlq?limit=2&cursor={page['nextCursor']}")
        assert [entry["id"] for entry in page["data"] + rest["data"]] == [entry["id"] for entry in entries]
        assert rest["nextCursor"] is None, "the last page (full: jobs' third entry and the direct one)"

        code[0] = 200  # the receiver is fixed: retried jobs now succeed
        status, retried = await call(p.client, "POST", f"/v1/queues/jobs/dlq/{first['jobId']}/retry")
        assert status == 201 and retried == {"id": first["id"], "queue": "jobs", "retried": 1}
        status, again = await call(p.client, "POST", f"/v1/queues/jobs/dlq/{first['id']}/retry")
        assert status == 409 and "already retried" in again["error"]["message"]
        assert (await call(p.client, "POST", "/v1/queues/jobs/dlq/unknown-id/retry"))[0] == 404

        status, bulk = await call(
            p.client, "POST", "/v1/queues/jobs/dlq/retry", {"jobIds": [entries[1]["jobId"], "gone"]}
        )
        assert (status, bulk) == (200, {"retried": 1, "notFound": ["gone"], "skipped": []})
        status, bulk = await call(p.client, "POST", "/v1/queues/jobs/dlq/retry", {"all": True})
        assert (status, bulk) == (200, {"retried": 1, "notFound": [], "skipped": []})
        assert await dlq() == []
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 3)
        for body in ({}, {"all": True, "jobIds": ["x"]}, {"jobIds": []}, {"all": "yes"}):
            assert (await call(p.client, "POST", "/v1/queues/jobs/dlq/retry", body))[0] == 400


async def test_dead_letter_lookups_are_one_command_however_long_the_dead_letter_queue(
    client: Client, sent: list[tuple[str, str]]
) -> None:
    """A retry by job id browsed the whole dead-letter queue a thousand entries at a time, and filtered
    them in the route, then asked for the entry once more to tell a 409 from a 404."""
    for name in ("jobs", "jobs.dlq"):
        assert (await client.put(f"/v1/queues/{name}", json={})).status_code == 201

    def entry(n: int) -> dict[str, Any]:
        origin = "other" if n % 10 == 0 else "jobs"  # a dead-letter queue may be shared
        return {"payload": n, "headers": {"x-dead-letter-from": origin, "x-original-id": f"job-{n}"}}

    entry_ids: list[str] = []
    for start in range(0, 2500, 1000):
        batch = [entry(n) for n in range(start, min(start + 1000, 2500))]
        published = await client.post("/v1/queues/jobs.dlq/messages", json={"messages": batch})
        assert published.status_code == 201
        entry_ids += [ref["id"] for ref in (await published.get_json())["messages"]]
    sent.clear()
    status, page = await call(client, "GET", "/v1/queues/jobs/dlq?limit=1000&cursor=0")
    assert (status, len(page["data"]), page["nextCursor"]) == (200, 900, "1000")
    assert sent == [("jobs.dlq", "BrowseDeadLetters")]

    async def retry(job_id: str) -> tuple[int, Any]:
        sent.clear()
        return await call(client, "POST", f"/v1/queues/jobs/dlq/{job_id}/retry")

    assert await retry("job-2498") == (201, {"id": entry_ids[2498], "queue": "jobs", "retried": 1})
    assert sent == [("jobs.dlq", "FindDeadLetters"), ("jobs.dlq", "Redrive")]
    status, answer = await retry(entry_ids[2498])
    assert (status, answer["error"]["code"], sent) == (409, "conflict", [("jobs.dlq", "FindDeadLetters")])
    assert (await retry("job-2498"))[0] == 404  # by the job's id, once its entry was retried
    assert (await retry(entry_ids[2490]))[0] == 404  # another queue's entry
    assert sent == [("jobs.dlq", "FindDeadLetters")]
    sent.clear()
    status, bulk = await call(
        client, "POST", "/v1/queues/jobs/dlq/retry", {"jobIds": ["job-2497", entry_ids[2496], "job-2490"]}
    )
    assert (status, bulk) == (200, {"retried": 2, "notFound": ["job-2490"], "skipped": []})
    assert sent == [("jobs.dlq", "FindDeadLetters"), ("jobs.dlq", "Redrive")]


# -- tokens ----------------------------------------------------------------------------------------------


async def test_routes_by_job_id_check_the_scope_on_the_jobs_queue() -> None:
    tokens = (
        Token("admin", "admin-secret-00000001", ("admin",)),
        Token("other", "other-secret-00000002", ("read:other", "consume:other")),
        Token("reader", "reader-secret-0000003", ("read:docs",)),
        Token("stranger", "stranger-secret-000004", ("publish:other",)),
    )
    async with open_broker(Settings(in_memory=True, tokens=tokens)) as broker, broker.app.test_app() as app:
        client = app.test_client()

        def auth(secret: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {secret}"}

        assert (
            await client.put("/v1/queues/docs", json={}, headers=auth("admin-secret-00000001"))
        ).status_code == 201
        response = await client.post(
            f"{BASE}/v1/queues/docs/jobs", json={"payload": {}}, headers=auth("admin-secret-00000001")
        )
        job_id = (await response.get_json())["id"]
        path = f"{BASE}/v1/jobs/{job_id}"
        # A token that may not read the job's queue learns nothing from its id, not even that it exists
        # (ids are predictable): the same 404 as for an id that is nowhere.
        hidden = await client.get(path, headers=auth("other-secret-00000002"))
        nowhere = await client.get(f"{BASE}/v1/jobs/{job_id}0", headers=auth("other-secret-00000002"))
        assert (hidden.status_code, nowhere.status_code) == (404, 404)
        assert "docs" not in (await hidden.get_data()).decode()
        assert (await client.get(path, headers=auth("reader-secret-0000003"))).status_code == 200
        for verb, body in (("ack", {}), ("nack", {"reason": "no"}), ("defer", {"retryAfter": 5})):
            for secret in ("other-secret-00000002", "stranger-secret-000004"):
                settled = await client.post(f"{path}/{verb}", json=body, headers=auth(secret))
                assert settled.status_code == 404 and "docs" not in (await settled.get_data()).decode(), verb
            # one that may read it is told what it lacks
            settled = await client.post(f"{path}/{verb}", json=body, headers=auth("reader-secret-0000003"))
            assert settled.status_code == 403, verb
            error = (await settled.get_json())["error"]
            assert error["code"] == "forbidden" and "consume:docs" in error["message"], error


async def test_a_duplicate_publish_shows_the_existing_job_only_to_a_token_that_may_read_it() -> None:
    """A publish-only token that reuses an idempotency key must not read the job the key matched: its
    payload, state and attempts (the reasons of its nacks) are read:<queue>'s."""
    tokens = (
        Token("admin", "admin-secret-00000001", ("admin",)),
        Token("producer", "producer-secret-000002", ("publish:pay",)),
    )
    async with open_broker(Settings(in_memory=True, tokens=tokens)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        admin = {"Authorization": "Bearer admin-secret-00000001"}
        producer = {"Authorization": "Bearer producer-secret-000002"}
        assert (await client.put("/v1/queues/pay", json={}, headers=admin)).status_code == 201
        first = {"payload": {"iban": "DE00-SECRET"}, "idempotencyKey": "inv-77"}
        created = await client.post(f"{BASE}/v1/queues/pay/jobs", json=first, headers=admin)
        job_id = (await created.get_json())["id"]

        again = {"payload": {}, "idempotencyKey": "inv-77"}
        duplicate = await client.post(f"{BASE}/v1/queues/pay/jobs", json=again, headers=producer)
        assert duplicate.status_code == 200
        assert await duplicate.get_json() == {"id": job_id, "queue": "pay", "idempotencyKey": "inv-77"}
        shown = await client.post(f"{BASE}/v1/queues/pay/jobs", json=again, headers=admin)
        assert (await shown.get_json())["payload"] == {"iban": "DE00-SECRET"}  # one that may read it


async def test_the_simpleq_push_format_and_secret_survive_a_restart(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        queue = await create(app.test_client(), name="ai-jobs", webhookUrl="https://w.example.com/hook")
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        push = broker.registry.get("ai-jobs").core.config.push
        assert push is not None and (push.format, push.secret) == ("simpleq", queue["signingSecret"])
        status, shown = await call(app.test_client(), "GET", "/v1/queues/ai-jobs")
        assert status == 200 and "signingSecret" not in shown


async def test_a_rotated_secret_keeps_the_simpleq_format(client: Client) -> None:
    first = await create(client, name="ai-jobs", webhookUrl="https://w.example.com/hook")
    rotated = await (await client.post("/v1/queues/ai-jobs/push/rotate-secret")).get_json()
    assert rotated["secret"] != first["signingSecret"]
    native = await (await client.get("/v1/queues/ai-jobs")).get_json()
    assert native["config"]["push"]["format"] == "simpleq"
