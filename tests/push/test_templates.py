"""Queue templates (docs/push.md, Templates): ``"template": "anthropic" | "openai"`` in a queue's config
prefills push in ack mode and a retry policy; fields given beside it win; it needs a push URL."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core.config import DEFAULT_DEAD_LETTER, QueueConfig, RetryBackoff
from broker.errors import InvalidRequest
from tests.conftest import Client

URL = "https://worker.example.com/hooks"


async def put(client: Client, name: str, body: Any) -> tuple[int, dict[str, Any]]:
    response = await client.put(f"/v1/queues/{name}", json=body)
    answer: dict[str, Any] = await response.get_json()
    return response.status_code, answer


@pytest.mark.parametrize(("template", "ack_timeout"), [("anthropic", 600.0), ("openai", 300.0)])
async def test_a_template_expands_to_ack_mode_push_and_a_retry_policy(
    client: Client, template: str, ack_timeout: float
) -> None:
    status, answer = await put(client, "claude", {"template": template, "push": {"url": URL}})
    assert status == 201, answer
    config = answer["config"]
    assert config["max_attempts"] == 4
    assert config["retry_backoff"] == {"type": "exponential", "base": 2.0, "max": 3600.0}
    assert config["dead_letter"] == "claude.dlq"
    push = config["push"]
    assert {
        key: push[key] for key in ("url", "mode", "ack_timeout", "ack_timeout_action", "concurrency")
    } == {
        "url": URL,
        "mode": "ack",
        "ack_timeout": ack_timeout,
        "ack_timeout_action": "retry",
        "concurrency": 20,
    }
    assert push["timeout"] == 15.0  # the request itself keeps its usual ceiling
    assert len(push["secret"]) == 64  # shown once, as for any first push config
    assert "template" not in config  # the expansion is stored, not the template
    shown = await (await client.get("/v1/queues/claude")).get_json()
    assert shown["config"]["push"]["mode"] == "ack" and "secret" not in shown["config"]["push"]


async def test_fields_given_beside_the_template_win(client: Client) -> None:
    body = {
        "template": "anthropic",
        "max_attempts": 9,
        "retry_backoff": {"type": "fixed", "base": 5},
        "dead_letter": "failures",
        "push": {"url": URL, "concurrency": 50, "ack_timeout": 900, "timeout": 10},
    }
    status, answer = await put(client, "claude", body)
    assert status == 201, answer
    config = answer["config"]
    assert config["max_attempts"] == 9
    assert config["retry_backoff"] == {"type": "fixed", "base": 5.0, "max": 3600.0}
    assert config["dead_letter"] == "failures"
    push = config["push"]
    assert (push["concurrency"], push["ack_timeout"], push["timeout"]) == (50, 900.0, 10.0)
    assert (push["mode"], push["ack_timeout_action"]) == ("ack", "retry")  # from the template


async def test_a_template_without_a_push_url_is_refused_naming_it(client: Client) -> None:
    for body in ({"template": "openai"}, {"template": "openai", "push": {"concurrency": 5}}):
        status, answer = await put(client, "gpt", body)
        assert status == 400, answer
        assert answer["error"]["code"] == "invalid_request"
        assert "push.url" in answer["error"]["message"] and "openai" in answer["error"]["message"]
    status, answer = await put(client, "gpt", {"template": "openai", "push": None})
    assert status == 400 and "push" in answer["error"]["message"]
    assert (await client.get("/v1/queues/gpt")).status_code == 404  # nothing was created


async def test_an_unknown_template_is_refused_naming_the_allowed_ones(client: Client) -> None:
    for template in ("gemini", 3, None):
        status, answer = await put(client, "q", {"template": template, "push": {"url": URL}})
        assert status == 400, answer
        message = answer["error"]["message"]
        assert "'anthropic'" in message and "'openai'" in message


async def test_on_an_existing_queue_a_template_keeps_its_url_and_secret(client: Client) -> None:
    status, _ = await put(client, "jobs", {"push": {"url": URL}})
    assert status == 201
    status, answer = await put(client, "jobs", {"template": "openai"})
    assert status == 200, answer
    push = answer["config"]["push"]
    assert (push["url"], push["mode"], push["ack_timeout"]) == (URL, "ack", 300.0)
    assert "secret" not in push  # the secret did not change, so it is not shown again


async def test_the_template_dead_letter_queue_is_made_on_demand(client: Client) -> None:
    """The template's dead-letter queue is the default ``<queue>.dlq``, created when the first job is
    dead-lettered (as every dead-letter queue is, §6): a nack with retryable false sends one there."""
    assert (await put(client, "claude", {"template": "anthropic", "push": {"url": URL}}))[0] == 201
    # Stop pushing to the example URL; pull the message instead, as any consumer could.
    assert (await put(client, "claude", {"push": None}))[0] == 200
    response = await client.post("/v1/queues/claude/messages", json={"payload": {"n": 1}})
    assert response.status_code == 201
    claimed = await (await client.post("/v1/queues/claude/claim", json={})).get_json()
    lease = claimed["messages"][0]["lease_id"]
    answer = await client.post("/v1/queues/claude/nack", json={"leases": [lease], "retryable": False})
    assert (await answer.get_json())["dead_lettered"] == 1
    dlq = await (await client.get("/v1/queues/claude.dlq/messages")).get_json()
    assert [message["payload"] for message in dlq["messages"]] == [{"n": 1}]


def test_the_expansion_is_pure_and_leaves_other_fields_alone() -> None:
    config = QueueConfig(lease=12.0).updated({"template": "anthropic", "push": {"url": URL}})
    assert config.lease == 12.0
    assert config.dead_letter == DEFAULT_DEAD_LETTER
    assert config.retry_backoff == RetryBackoff("exponential", 2.0, 3600.0)
    assert config.push is not None and config.push.format == "broker"
    with pytest.raises(InvalidRequest, match=r"known fields: .*template"):
        QueueConfig().updated({"templates": "anthropic"})
