"""Push to a real receiver on a loopback socket (the real clock): the signed envelope, acks on 2xx,
failed attempts to dead letters, a refused connection, a host name that resolves to a link-local
address, and the secret shown once."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import structlog
import trio

from broker.push.request import verify
from tests.push.conftest import (
    Received,
    Receiver,
    message,
    publish,
    pushing,
    put_queue,
    served,
    stats,
    wait_until,
)
from tests.push.test_transport import Resolver


async def test_a_2xx_acks_the_message_and_the_request_is_signed_as_documented() -> None:
    receiver = Receiver()
    async with served(receiver) as base, pushing() as p:
        created = await put_queue(p.client, push={"url": f"{base}/hook?token=abc"})
        secret = created["config"]["push"]["secret"]
        assert len(secret) == 64
        message_id = await publish(p.client, {"n": 1}, headers={"trace": "t-1"}, key="k-1")

        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 1)
        assert (await stats(p.client))["acked_total"] == 1
        [request] = receiver.requests
        assert (request.method, request.path) == ("POST", "/hook")
        assert request.headers["content-type"] == "application/json"
        envelope = request.json
        assert set(envelope) == {
            "id",
            "queue",
            "payload",
            "attempt",
            "lease_id",
            "max_attempts",
            "published_at",
            "headers",
        }
        assert envelope["id"] == message_id and envelope["lease_id"].startswith(message_id)
        assert envelope["queue"] == "jobs"
        assert envelope["payload"] == {"n": 1}
        assert (envelope["attempt"], envelope["max_attempts"]) == (1, 0)
        assert envelope["headers"] == {"trace": "t-1"}
        assert envelope["published_at"].endswith("Z")
        assert verify(
            secret, request.headers["x-broker-timestamp"], request.body, request.headers["x-broker-signature"]
        )
        assert not verify("another secret", request.headers["x-broker-timestamp"], request.body,
                          request.headers["x-broker-signature"])  # fmt: skip

        history = (await message(p.client, message_id))["history"]
        assert [entry["event"] for entry in history][-2:] == ["claimed", "acked"]
        assert history[-2]["consumer"] == "push"


async def test_the_secret_is_shown_once_and_never_again() -> None:
    async with pushing() as p:
        created = await put_queue(p.client, push={"url": "http://127.0.0.1:9/hook"})
        secret = created["config"]["push"]["secret"]
        shown = await (await p.client.get("/v1/queues/jobs")).get_json()
        assert "secret" not in shown["config"]["push"]
        listed = await (await p.client.get("/v1/queues")).get_json()
        assert secret not in str(listed)
        updated = await put_queue(p.client, push={"url": "http://127.0.0.1:9/other", "concurrency": 2})
        assert "secret" not in updated["config"]["push"], "an update keeps the secret and does not show it"
        assert p.broker.registry.get("jobs").core.config.push.secret == secret  # type: ignore[union-attr]
        assert secret not in repr(p.broker.registry.get("jobs").core.config)


async def test_a_500_is_a_failed_attempt_retried_then_dead_lettered() -> None:
    async def fail(_: Received) -> tuple[int, dict[str, str]]:
        return 500, {}

    receiver = Receiver(fail)
    async with served(receiver) as base, pushing() as p:
        await put_queue(p.client, max_attempts=3, push={"url": f"{base}/hook"})
        message_id = await publish(p.client, "x")
        await wait_until(lambda: "jobs.dlq" in p.broker.registry)
        await wait_until(lambda: p.broker.registry.get("jobs.dlq").core.ready_count == 1)
        assert [request.json["attempt"] for request in receiver.requests] == [1, 2, 3]
        assert (await stats(p.client))["dead_lettered_total"] == 1
        history = await (await p.client.get(f"/v1/queues/jobs/push/messages/{message_id}")).get_json()
        assert [(a["attempt"], a["status"], a["outcome"]) for a in history["attempts"]] == [
            (1, 500, "failed"),
            (2, 500, "failed"),
            (3, 500, "failed"),
        ]


async def test_a_refused_connection_is_a_failed_attempt() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    async with pushing() as p:
        await put_queue(p.client, max_attempts=2, push={"url": f"http://127.0.0.1:{port}/hook"})
        message_id = await publish(p.client, "x")
        await wait_until(lambda: "jobs.dlq" in p.broker.registry)
        history = await (await p.client.get(f"/v1/queues/jobs/push/messages/{message_id}")).get_json()
        attempts = history["attempts"]
        assert [a["attempt"] for a in attempts] == [1, 2]
        assert all(a["status"] is None and a["error"].startswith("ConnectError") for a in attempts)


async def test_a_name_that_resolves_to_a_link_local_address_is_refused_unless_allowed() -> None:
    trio.socket.set_custom_hostname_resolver(Resolver({"hooks.test": ["127.0.0.1", "169.254.169.254"]}))
    receiver = Receiver()
    async with served(receiver) as base, pushing() as p:
        port = urlsplit(base).port
        with structlog.testing.capture_logs() as logs:
            await put_queue(p.client, max_attempts=2, push={"url": f"http://hooks.test:{port}/hook?token=t"})
            message_id = await publish(p.client, "x")
            await wait_until(lambda: "jobs.dlq" in p.broker.registry)
        assert receiver.requests == []
        history = await (await p.client.get(f"/v1/queues/jobs/push/messages/{message_id}")).get_json()
        assert [(a["status"], a["outcome"]) for a in history["attempts"]] == [(None, "failed")] * 2
        error = history["attempts"][0]["error"]
        assert error.startswith("PrivateAddress: hooks.test resolves to 169.254.169.254, a link-local")
        assert "push.allow_private" in error
        refusals = [entry for entry in logs if entry["event"] == "push_private_address_refused"]
        assert len(refusals) == 1, "logged once, not once per attempt"
        assert refusals[0]["log_level"] == "error" and refusals[0]["host"] == f"hooks.test:{port}"
        assert "token" not in str(refusals[0])

        await put_queue(p.client, push={"url": f"http://hooks.test:{port}/hook", "allow_private": True})
        await publish(p.client, "y")
        await wait_until(lambda: len(receiver.requests) == 1)
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 1)
        assert receiver.requests[0].headers["host"] == f"hooks.test:{port}"
