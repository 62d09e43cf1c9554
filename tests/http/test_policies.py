"""The queue policies of §3 to §6 end to end over HTTP: max_attempts and dead letters, nack without retry,
redrive, retry_backoff, on_duplicate "replace", message_ttl, max_depth, rate_limit, claim_window and
dedup_window, and that purge and delete leave the policies alone.

Time passes with ``autojump_clock`` (the broker's clock follows Trio's), never with real sleeps; bad
values for the policy fields are covered by test_bad_input.py, so these tests are about behaviour."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
import trio
import trio.testing

from broker import registry as registry_module
from broker.actor import QueueActor
from broker.core.commands import Redrive
from tests.conftest import Client, make_queue
from tests.http.test_queues import DEFAULT_CONFIG

DLQ_HEADERS = {"x-dead-letter-from", "x-dead-letter-reason", "x-dead-letter-attempts", "x-original-id"}


# -- helpers -----------------------------------------------------------------------------------------


def seconds(timestamp: str) -> float:
    """An RFC 3339 millisecond UTC timestamp as seconds since the epoch."""
    return datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


async def expect_error(response: Any, status: int, code: str) -> str:
    assert response.status_code == status, await response.get_data()
    body = await response.get_json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
    assert body["error"]["code"] == code
    message: str = body["error"]["message"]
    assert message
    return message


async def post(client: Client, path: str, body: Any, status: int = 200) -> Any:
    response = await client.post(path, json=body)
    assert response.status_code == status, await response.get_data()
    return await response.get_json()


async def put(client: Client, queue: str, status: int = 200, **config: Any) -> dict[str, Any]:
    response = await client.put(f"/v1/queues/{queue}", json=config)
    assert response.status_code == status, await response.get_data()
    body: dict[str, Any] = await response.get_json()
    return body


async def publish(
    client: Client, *messages: dict[str, Any], queue: str = "jobs", status: int = 201
) -> list[dict[str, Any]]:
    body = await post(client, f"/v1/queues/{queue}/messages", {"messages": list(messages)}, status)
    refs: list[dict[str, Any]] = body["messages"]
    return refs


async def publish_ids(client: Client, *payloads: Any, queue: str = "jobs") -> list[str]:
    return [ref["id"] for ref in await publish(client, *({"payload": p} for p in payloads), queue=queue)]


async def claim(client: Client, queue: str = "jobs", **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = await post(client, f"/v1/queues/{queue}/claim", fields)
    return body


async def claim_one(client: Client, queue: str = "jobs", **fields: Any) -> dict[str, Any]:
    messages = (await claim(client, queue, **fields))["messages"]
    assert len(messages) == 1, messages
    delivery: dict[str, Any] = messages[0]
    return delivery


async def settle(client: Client, verb: str, queue: str = "jobs", **body: Any) -> dict[str, Any]:
    answer: dict[str, Any] = await post(client, f"/v1/queues/{queue}/{verb}", body)
    return answer


async def queue_info(client: Client, queue: str = "jobs") -> dict[str, Any]:
    response = await client.get(f"/v1/queues/{queue}")
    assert response.status_code == 200, await response.get_data()
    body: dict[str, Any] = await response.get_json()
    return body


async def stats(client: Client, queue: str = "jobs") -> dict[str, Any]:
    result: dict[str, Any] = (await queue_info(client, queue))["stats"]
    return result


async def queue_names(client: Client) -> list[str]:
    body = await (await client.get("/v1/queues")).get_json()
    return [queue["name"] for queue in body["queues"]]


async def browse(client: Client, queue: str = "jobs", query: str = "") -> list[dict[str, Any]]:
    response = await client.get(f"/v1/queues/{queue}/messages{query}")
    assert response.status_code == 200, await response.get_data()
    messages: list[dict[str, Any]] = (await response.get_json())["messages"]
    return messages


async def get_message(client: Client, message_id: str, queue: str = "jobs") -> dict[str, Any]:
    response = await client.get(f"/v1/queues/{queue}/messages/{message_id}")
    assert response.status_code == 200, await response.get_data()
    body: dict[str, Any] = await response.get_json()
    return body


def events(message: dict[str, Any]) -> list[str]:
    return [entry["event"] for entry in message["history"]]


def dead_letter_headers(
    origin_id: str, reason: str, attempts: int, origin: str = "jobs", **own: str
) -> dict[str, str]:
    return {
        **own,
        "x-dead-letter-from": origin,
        "x-dead-letter-reason": reason,
        "x-dead-letter-attempts": str(attempts),
        "x-original-id": origin_id,
    }


async def dead_letter_by_rejecting(client: Client, *payloads: Any, queue: str = "jobs") -> list[str]:
    """Publish ``payloads`` to ``queue``, claim them and nack them with ``retryable: false``: the
    origin ids, in order."""
    ids = await publish_ids(client, *payloads, queue=queue)
    delivered = (await claim(client, queue, max=len(payloads)))["messages"]
    assert [d["id"] for d in delivered] == ids
    answer = await settle(client, "nack", queue, leases=[d["lease_id"] for d in delivered], retryable=False)
    assert answer == {"nacked": len(ids), "dead_lettered": len(ids), "skipped": []}
    return ids


class Claimer:
    """A claim running in a nursery: its answer, and the Trio time it came."""

    def __init__(self, client: Client, queue: str = "jobs", **fields: Any) -> None:
        self.client = client
        self.queue = queue
        self.fields = fields
        self.status: int | None = None
        self.body: Any = None
        self.answered_at: float | None = None

    async def run(self) -> None:
        response = await self.client.post(f"/v1/queues/{self.queue}/claim", json=self.fields)
        self.status = response.status_code
        self.body = await response.get_json()
        self.answered_at = trio.current_time()

    @property
    def messages(self) -> list[dict[str, Any]]:
        assert self.status == 200, self.body
        messages: list[dict[str, Any]] = self.body["messages"]
        return messages

    @property
    def payloads(self) -> list[Any]:
        return [m["payload"] for m in self.messages]


# -- config ------------------------------------------------------------------------------------------


async def test_every_policy_field_is_kept_and_shown(client: Client) -> None:
    policies = {
        "max_attempts": 3,
        "dead_letter": "graveyard",
        "retry_backoff": {"type": "exponential", "base": "500ms", "max": "1m"},
        "max_depth": 100,
        "rate_limit": {"max": 10, "per": "1s"},
        "message_ttl": "1h",
        "claim_window": "250ms",
        "dedup_window": 600,
    }
    created = await make_queue(client, **policies)
    expected = {
        **DEFAULT_CONFIG,
        "max_attempts": 3,
        "dead_letter": "graveyard",
        "retry_backoff": {"type": "exponential", "base": 0.5, "max": 60.0},
        "max_depth": 100,
        "rate_limit": {"max": 10, "per": 1.0},
        "message_ttl": 3600.0,
        "claim_window": 0.25,
        "dedup_window": 600.0,
    }
    assert created["config"] == expected
    assert (await queue_info(client))["config"] == expected
    assert "graveyard" not in await queue_names(client), "a dead-letter queue is created on demand"

    updated = await put(client, "jobs", dead_letter=None, rate_limit=None, claim_window=0, max_attempts=0)
    assert updated["config"] == {
        **expected,
        "dead_letter": None,
        "rate_limit": None,
        "claim_window": 0.0,
        "max_attempts": 0,
    }
    reset = await put(client, "jobs", dead_letter="jobs.dlq")
    assert reset["config"]["dead_letter"] == "jobs.dlq"
    # An object given replaces the whole value, as api.md says: its keys left out take their defaults.
    replaced = await put(client, "jobs", retry_backoff={"type": "fixed", "base": 1})
    assert replaced["config"]["retry_backoff"] == {"type": "fixed", "base": 1.0, "max": 3600.0}
    assert replaced["config"]["max_depth"] == 100, "a field left out keeps its value"


# -- max_attempts and dead letters (§5, §6) ------------------------------------------------------------


async def test_a_nack_that_uses_the_last_attempt_dead_letters_at_once(client: Client) -> None:
    await make_queue(client, max_attempts=2)
    [ref] = await publish(
        client, {"payload": {"order": 17}, "headers": {"trace": "t-1"}, "key": "order-17", "priority": 4}
    )
    first = await claim_one(client, consumer="w1")
    assert first["attempt"] == 1
    assert await settle(client, "nack", leases=[first["lease_id"]], reason="flaky") == {
        "nacked": 1,
        "dead_lettered": 0,
        "skipped": [],
    }
    second = await claim_one(client, consumer="w2")
    assert second["attempt"] == 2
    assert await settle(client, "nack", leases=[second["lease_id"]], reason="still flaky") == {
        "nacked": 1,
        "dead_lettered": 1,
        "skipped": [],
    }

    origin = await stats(client)
    assert (origin["ready"], origin["delayed"], origin["in_flight"]) == (0, 0, 0)
    assert (origin["published_total"], origin["nacked_total"], origin["dead_lettered_total"]) == (1, 2, 1)
    assert origin["expired_total"] == 0
    assert await browse(client) == []
    assert await claim(client) == {"messages": [], "ready": 0}

    assert await queue_names(client) == ["jobs", "jobs.dlq"]
    dlq = await queue_info(client, "jobs.dlq")
    assert dlq["config"] == {**DEFAULT_CONFIG, "dead_letter": "jobs.dlq.dlq"}, "created with the defaults"
    assert (dlq["stats"]["ready"], dlq["stats"]["published_total"]) == (1, 1)
    [moved] = await browse(client, "jobs.dlq")
    assert moved["id"] != ref["id"]
    assert (moved["state"], moved["attempt"], moved["seq"]) == ("ready", 0, 1)
    assert (moved["payload"], moved["key"], moved["priority"]) == ({"order": 17}, "order-17", 4)
    assert moved["headers"] == dead_letter_headers(ref["id"], "max_attempts", 2, trace="t-1")

    original = await get_message(client, ref["id"])
    assert original["state"] == "dead_lettered"
    assert events(original) == ["published", "claimed", "nacked", "claimed", "nacked", "dead_lettered"]
    assert original["history"][4]["reason"] == "still flaky"
    last = original["history"][-1]
    assert {k: last[k] for k in ("lease_id", "reason", "attempt", "to")} == {
        "lease_id": second["lease_id"],
        "reason": "max_attempts",
        "attempt": 2,
        "to": "jobs.dlq",
    }

    # The last lease is stale now: settling it again is skipped, not an error.
    assert await settle(client, "ack", leases=[second["lease_id"]]) == {
        "acked": 0,
        "skipped": [second["lease_id"]],
    }
    # In the dead-letter queue it is an ordinary message.
    delivery = await claim_one(client, "jobs.dlq")
    assert (delivery["attempt"], delivery["payload"]) == (1, {"order": 17})
    assert await settle(client, "ack", "jobs.dlq", leases=[delivery["lease_id"]]) == {
        "acked": 1,
        "skipped": [],
    }


async def test_an_expired_lease_past_max_attempts_is_dead_lettered_not_made_ready(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, max_attempts=1)
    [message_id] = await publish_ids(client, "job")
    delivery = await claim_one(client, consumer="slow", lease=5)
    await trio.sleep(6)

    assert await claim(client, consumer="next") == {"messages": [], "ready": 0}
    origin = await stats(client)
    assert (origin["ready"], origin["in_flight"]) == (0, 0)
    assert (origin["lease_expired_total"], origin["dead_lettered_total"]) == (1, 1)
    [moved] = await browse(client, "jobs.dlq")
    assert moved["payload"] == "job"
    assert moved["headers"] == dead_letter_headers(message_id, "max_attempts", 1)

    original = await get_message(client, message_id)
    assert original["state"] == "dead_lettered"
    assert events(original) == ["published", "claimed", "lease_expired", "dead_lettered"]
    assert original["history"][2]["lease_id"] == delivery["lease_id"]
    assert original["history"][3]["reason"] == "max_attempts"
    # A late ack of the expired lease is skipped: the message is gone.
    assert await settle(client, "ack", leases=[delivery["lease_id"]]) == {
        "acked": 0,
        "skipped": [delivery["lease_id"]],
    }


async def test_the_queue_dead_letters_an_expired_lease_by_itself_at_the_deadline(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, max_attempts=1)
    [message_id] = await publish_ids(client, "job")
    await claim_one(client, lease=5)
    start = trio.current_time()
    await trio.sleep(4.9)
    await expect_error(await client.get("/v1/queues/jobs.dlq"), 404, "queue_not_found")
    await trio.sleep(0.2)
    assert trio.current_time() - start == pytest.approx(5.1)
    # Nothing asked the origin queue anything since the claim: it woke at the deadline on its own.
    [moved] = await browse(client, "jobs.dlq")
    assert moved["headers"] == dead_letter_headers(message_id, "max_attempts", 1)
    assert (await stats(client))["dead_lettered_total"] == 1


async def test_a_nack_with_retryable_false_dead_letters_at_once_as_rejected(client: Client) -> None:
    await make_queue(client)  # max_attempts 0: unlimited, yet a rejection dead-letters
    refs = await publish(
        client, {"payload": "a", "headers": {"h": "1"}, "key": "ka"}, {"payload": "b"}, {"payload": "c"}
    )
    delivered = (await claim(client, max=3))["messages"]
    leases = [d["lease_id"] for d in delivered]
    answer = await settle(
        client, "nack", leases=[leases[0], leases[1], "no-such-lease"], retryable=False, reason="bad input"
    )
    assert answer == {"nacked": 2, "dead_lettered": 2, "skipped": ["no-such-lease"]}
    # A retryable nack on the same queue still returns the message.
    assert await settle(client, "nack", leases=[leases[2]]) == {
        "nacked": 1,
        "dead_lettered": 0,
        "skipped": [],
    }

    origin = await stats(client)
    assert (origin["ready"], origin["in_flight"], origin["nacked_total"], origin["dead_lettered_total"]) == (
        1,
        0,
        3,
        2,
    )
    assert [m["payload"] for m in await browse(client)] == ["c"]
    dead = await browse(client, "jobs.dlq")
    assert [(m["payload"], m["key"], m["headers"]) for m in dead] == [
        ("a", "ka", dead_letter_headers(refs[0]["id"], "rejected", 1, h="1")),
        ("b", None, dead_letter_headers(refs[1]["id"], "rejected", 1)),
    ]
    original = await get_message(client, refs[0]["id"])
    assert original["state"] == "dead_lettered"
    assert events(original) == ["published", "claimed", "nacked", "dead_lettered"]
    assert original["history"][2]["reason"] == "bad input"
    assert (original["history"][3]["reason"], original["history"][3]["to"]) == ("rejected", "jobs.dlq")


async def test_dead_letter_null_drops_the_message_and_counts_it(client: Client) -> None:
    await make_queue(client, max_attempts=1, dead_letter=None)
    [message_id] = await publish_ids(client, "gone")
    delivery = await claim_one(client)
    assert await settle(client, "nack", leases=[delivery["lease_id"]]) == {
        "nacked": 1,
        "dead_lettered": 1,
        "skipped": [],
    }
    assert await queue_names(client) == ["jobs"]
    origin = await stats(client)
    assert (origin["ready"], origin["dead_lettered_total"]) == (0, 1)
    original = await get_message(client, message_id)
    assert original["state"] == "dead_lettered"
    last = original["history"][-1]
    assert (last["event"], last["reason"], last["attempt"]) == ("dead_lettered", "max_attempts", 1)
    assert "to" not in last


async def test_a_named_dead_letter_queue_is_created_on_demand(client: Client) -> None:
    await make_queue(client, dead_letter="graveyard")
    [message_id] = await dead_letter_by_rejecting(client, "x")
    assert await queue_names(client) == ["graveyard", "jobs"]
    graveyard = await queue_info(client, "graveyard")
    assert graveyard["config"] == {**DEFAULT_CONFIG, "dead_letter": "graveyard.dlq"}
    [moved] = await browse(client, "graveyard")
    assert moved["headers"] == dead_letter_headers(message_id, "rejected", 1)


async def test_a_dead_letter_reaches_an_existing_queue_even_past_its_max_depth(client: Client) -> None:
    await make_queue(client, dead_letter="graveyard")
    await make_queue(client, "graveyard", max_depth=1)
    await publish_ids(client, "already here", queue="graveyard")
    [message_id] = await dead_letter_by_rejecting(client, "x")
    assert [m["payload"] for m in await browse(client, "graveyard")] == ["already here", "x"]
    assert (await stats(client, "graveyard"))["ready"] == 2
    # A publish is still refused there.
    response = await client.post("/v1/queues/graveyard/messages", json={"payload": "more"})
    await expect_error(response, 429, "queue_full")
    assert (await get_message(client, message_id))["state"] == "dead_lettered"


async def test_a_defer_never_spends_max_attempts(client: Client) -> None:
    await make_queue(client, max_attempts=1)
    await publish_ids(client, "job")
    first = await claim_one(client)
    assert await settle(client, "defer", leases=[first["lease_id"]]) == {"deferred": 1, "skipped": []}
    second = await claim_one(client)
    assert second["attempt"] == 1, "the deferred delivery was refunded"
    assert await settle(client, "defer", leases=[second["lease_id"]]) == {"deferred": 1, "skipped": []}
    third = await claim_one(client)
    assert third["attempt"] == 1
    assert await settle(client, "nack", leases=[third["lease_id"]]) == {
        "nacked": 1,
        "dead_lettered": 1,
        "skipped": [],
    }
    origin = await stats(client)
    assert (origin["deferred_total"], origin["nacked_total"], origin["dead_lettered_total"]) == (2, 1, 1)


async def test_a_live_change_to_max_attempts_applies_to_the_next_nack(client: Client) -> None:
    await make_queue(client)
    [message_id] = await publish_ids(client, "job")
    for attempt in (1, 2):
        delivery = await claim_one(client)
        assert delivery["attempt"] == attempt
        assert (await settle(client, "nack", leases=[delivery["lease_id"]]))["dead_lettered"] == 0
    delivery = await claim_one(client)
    assert delivery["attempt"] == 3
    assert (await put(client, "jobs", max_attempts=2))["config"]["max_attempts"] == 2
    assert await settle(client, "nack", leases=[delivery["lease_id"]]) == {
        "nacked": 1,
        "dead_lettered": 1,
        "skipped": [],
    }
    [moved] = await browse(client, "jobs.dlq")
    assert moved["headers"] == dead_letter_headers(message_id, "max_attempts", 3)


# -- redrive (§6) ------------------------------------------------------------------------------------


async def test_redrive_by_ids_sends_messages_back_to_their_origin_as_new(client: Client) -> None:
    await make_queue(client, max_attempts=1)
    first_id, second_id = await dead_letter_by_rejecting(client, {"n": 1}, {"n": 2})
    dead = await browse(client, "jobs.dlq")
    assert [m["headers"]["x-original-id"] for m in dead] == [first_id, second_id]
    dead_first = dead[0]["id"]

    answer = await post(
        client, "/v1/queues/jobs.dlq/redrive", {"ids": [dead_first, "no-such-id", dead_first]}
    )
    assert answer == {"redriven": 1, "unknown": ["no-such-id"], "skipped": []}

    [back] = await browse(client)
    assert back["id"] not in (first_id, dead_first)
    assert (back["state"], back["attempt"], back["seq"], back["payload"]) == ("ready", 0, 3, {"n": 1})
    assert back["headers"] == {"x-original-id": first_id}
    assert [m["headers"]["x-original-id"] for m in await browse(client, "jobs.dlq")] == [second_id]
    assert (await stats(client, "jobs.dlq"))["ready"] == 1

    gone = await get_message(client, dead_first, "jobs.dlq")
    assert gone["state"] == "redriven"
    assert events(gone) == ["published", "redriven"]
    assert gone["history"][-1]["to"] == "jobs"

    # It starts over: attempts from zero, so max_attempts applies afresh.
    delivery = await claim_one(client)
    assert (delivery["id"], delivery["attempt"]) == (back["id"], 1)
    assert await settle(client, "ack", leases=[delivery["lease_id"]]) == {"acked": 1, "skipped": []}

    # Redriving the same id again: it is no longer in the dead-letter queue.
    again = await post(client, "/v1/queues/jobs.dlq/redrive", {"ids": [dead_first]})
    assert again == {"redriven": 0, "unknown": [dead_first], "skipped": []}


async def test_redrive_all_to_another_queue(client: Client) -> None:
    await make_queue(client)
    await make_queue(client, "retry")
    ids = await dead_letter_by_rejecting(client, "a", "b", "c")
    answer = await post(client, "/v1/queues/jobs.dlq/redrive", {"all": True, "to": "retry"})
    assert answer == {"redriven": 3, "unknown": [], "skipped": []}
    moved = await browse(client, "retry")
    assert [(m["payload"], m["attempt"], m["headers"]) for m in moved] == [
        (payload, 0, {"x-original-id": origin_id}) for payload, origin_id in zip("abc", ids, strict=True)
    ]
    assert await browse(client, "jobs.dlq") == []
    assert await browse(client) == []
    assert (await stats(client, "jobs.dlq"))["ready"] == 0
    assert (await stats(client, "retry"))["ready"] == 3
    # Nothing left: a second redrive of everything moves nothing.
    assert await post(client, "/v1/queues/jobs.dlq/redrive", {"all": True}) == {
        "redriven": 0,
        "unknown": [],
        "skipped": [],
    }


async def test_redrive_all_moves_a_slice_at_a_time_so_other_work_is_served_between(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One command moved every message: 100,000 held the event loop, every queue with it, for seconds.
    Each command now moves at most ``REDRIVE_SLICE``; the answer adds them up."""
    monkeypatch.setattr(registry_module, "REDRIVE_SLICE", 4)
    commands: list[Any] = []
    request = QueueActor.request

    async def recorded(actor: QueueActor, command: Any) -> Any:
        if actor.core.name == "jobs.dlq":
            commands.append(command)
        return await request(actor, command)

    monkeypatch.setattr(QueueActor, "request", recorded)
    await make_queue(client)
    await make_queue(client, "retry")
    await dead_letter_by_rejecting(client, *range(11))
    delivery = await claim_one(client, "jobs.dlq")
    answer = await post(client, "/v1/queues/jobs.dlq/redrive", {"all": True, "to": "retry"})
    assert answer == {
        "redriven": 10,
        "unknown": [],
        "skipped": [{"id": delivery["id"], "reason": "in_flight"}],
    }
    redrives = [command for command in commands if isinstance(command, Redrive)]
    assert [len(command.ids) for command in redrives] == [4, 4, 2]
    assert sorted(m["payload"] for m in await browse(client, "retry")) == list(range(1, 11))


async def test_a_destination_deleted_while_a_redrive_waits_in_the_inbox_is_not_moved_to(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queues that exist were copied when the command was sent: a destination deleted while it
    waited was moved to all the same, and so made again on demand, with the default config."""
    request = QueueActor.request

    async def deleting_first(actor: QueueActor, command: Any) -> Any:
        if isinstance(command, Redrive):
            assert (await client.delete("/v1/queues/retry")).status_code == 204
        return await request(actor, command)

    await make_queue(client)
    await make_queue(client, "retry", lease=77)
    await dead_letter_by_rejecting(client, "a")
    [moved] = await browse(client, "jobs.dlq")
    monkeypatch.setattr(QueueActor, "request", deleting_first)
    answer = await post(client, "/v1/queues/jobs.dlq/redrive", {"ids": [moved["id"]], "to": "retry"})
    assert answer == {
        "redriven": 0,
        "unknown": [],
        "skipped": [{"id": moved["id"], "reason": "no_destination"}],
    }
    assert (await client.get("/v1/queues/retry")).status_code == 404


async def test_a_dead_letter_queue_deleted_during_a_redrive_of_all_answers_what_moved_before(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It answered 404, as if nothing had moved, while the first slices had."""
    monkeypatch.setattr(registry_module, "REDRIVE_SLICE", 2)
    request = QueueActor.request
    slices = 0

    async def deleting_before_the_second_slice(actor: QueueActor, command: Any) -> Any:
        nonlocal slices
        if isinstance(command, Redrive):
            slices += 1
            if slices == 2:
                assert (await client.delete("/v1/queues/jobs.dlq")).status_code == 204
        return await request(actor, command)

    await make_queue(client)
    await dead_letter_by_rejecting(client, *range(5))
    monkeypatch.setattr(QueueActor, "request", deleting_before_the_second_slice)
    answer = await post(client, "/v1/queues/jobs.dlq/redrive", {"all": True})
    assert answer == {"redriven": 2, "unknown": [], "skipped": []}
    assert sorted(m["payload"] for m in await browse(client)) == [0, 1]


async def test_redrive_all_leaves_leased_messages_where_they_are(client: Client) -> None:
    await make_queue(client)
    await dead_letter_by_rejecting(client, "leased", "free")
    delivery = await claim_one(client, "jobs.dlq")
    answer = await post(client, "/v1/queues/jobs.dlq/redrive", {"all": True})
    # "all" means every ready and delayed message; the leased one stays, and is reported.
    assert answer == {
        "redriven": 1,
        "unknown": [],
        "skipped": [{"id": delivery["id"], "reason": "in_flight"}],
    }
    assert [m["payload"] for m in await browse(client)] == ["free"]
    [left] = await browse(client, "jobs.dlq")
    assert (left["id"], left["state"]) == (delivery["id"], "in_flight")
    assert await settle(client, "ack", "jobs.dlq", leases=[delivery["lease_id"]]) == {
        "acked": 1,
        "skipped": [],
    }


async def test_a_dead_letter_wakes_a_long_poll_on_the_dead_letter_queue_at_once(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    await make_queue(client, "jobs.dlq")
    watcher = Claimer(client, "jobs.dlq", consumer="watcher", wait=30)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watcher.run)
        await trio.testing.wait_all_tasks_blocked()
        rejected_at = trio.current_time()
        [message_id] = await dead_letter_by_rejecting(client, "poison")
    assert watcher.payloads == ["poison"]
    assert watcher.messages[0]["headers"] == dead_letter_headers(message_id, "rejected", 1)
    assert watcher.answered_at == rejected_at


async def test_redrive_to_a_missing_queue_is_404_and_moves_nothing(client: Client) -> None:
    await make_queue(client)
    await dead_letter_by_rejecting(client, "a")
    response = await client.post("/v1/queues/jobs.dlq/redrive", json={"all": True, "to": "nowhere"})
    await expect_error(response, 404, "queue_not_found")
    assert "nowhere" not in await queue_names(client)
    assert [m["payload"] for m in await browse(client, "jobs.dlq")] == ["a"]
    response = await client.post("/v1/queues/ghost/redrive", json={"all": True})
    await expect_error(response, 404, "queue_not_found")


async def test_redrive_skips_leased_messages_and_those_with_no_origin_left(client: Client) -> None:
    await make_queue(client)
    await dead_letter_by_rejecting(client, "leased", "orphan")
    leased, orphan = await browse(client, "jobs.dlq")
    delivery = await claim_one(client, "jobs.dlq")
    assert delivery["id"] == leased["id"]
    assert (await client.delete("/v1/queues/jobs")).status_code == 204

    answer = await post(client, "/v1/queues/jobs.dlq/redrive", {"ids": [leased["id"], orphan["id"]]})
    assert answer == {
        "redriven": 0,
        "unknown": [],
        "skipped": [
            {"id": leased["id"], "reason": "in_flight"},
            {"id": orphan["id"], "reason": "no_destination"},
        ],
    }
    assert "jobs" not in await queue_names(client), "a redrive never creates its destination"
    dlq = await stats(client, "jobs.dlq")
    assert (dlq["ready"], dlq["in_flight"]) == (1, 1)


# -- retry_backoff -----------------------------------------------------------------------------------


async def test_exponential_backoff_delays_each_nack_without_delay_up_to_the_cap(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, retry_backoff={"type": "exponential", "base": 2, "max": 5})
    [message_id] = await publish_ids(client, "job")
    waited = []
    delivery = await claim_one(client)
    for expected in (2.0, 4.0, 5.0, 5.0):
        assert await settle(client, "nack", leases=[delivery["lease_id"]]) == {
            "nacked": 1,
            "dead_lettered": 0,
            "skipped": [],
        }
        origin = await stats(client)
        assert (origin["ready"], origin["delayed"]) == (0, 1)
        nacked_at = trio.current_time()
        view = await get_message(client, message_id)
        assert (view["state"], view["history"][-1]["event"]) == ("delayed", "nacked")
        waits_for = seconds(view["available_at"]) - seconds(view["history"][-1]["at"])
        assert waits_for == pytest.approx(expected, abs=0.002)
        delivery = await claim_one(client, wait=30)
        waited.append(trio.current_time() - nacked_at)
    assert waited == pytest.approx([2.0, 4.0, 5.0, 5.0])
    assert delivery["attempt"] == 5
    history = (await get_message(client, message_id))["history"]
    assert [h["delay"] for h in history if h["event"] == "nacked"] == [2, 4, 5, 5]

    # An explicit delay overrides the backoff.
    assert (await settle(client, "nack", leases=[delivery["lease_id"]], delay=0))["nacked"] == 1
    assert (await stats(client))["ready"] == 1


async def test_fixed_backoff_delays_every_nack_alike(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, retry_backoff={"type": "fixed", "base": 3})
    await publish_ids(client, "job")
    for attempt in (1, 2, 3):
        delivery = await claim_one(client, wait=30)
        assert delivery["attempt"] == attempt
        await settle(client, "nack", leases=[delivery["lease_id"]])
        start = trio.current_time()
        assert await claim(client) == {"messages": [], "ready": 0}
        assert (await stats(client))["delayed"] == 1
        await trio.sleep(2.9)
        assert await claim(client) == {"messages": [], "ready": 0}
        await trio.sleep(0.1)
        assert trio.current_time() - start == pytest.approx(3)
    assert (await stats(client))["ready"] == 1


# -- on_duplicate: "replace" (§4) --------------------------------------------------------------------


async def test_replace_gives_a_ready_duplicate_the_new_payload_and_headers_in_place(client: Client) -> None:
    await make_queue(client)
    [first] = await publish(client, {"payload": "v1", "headers": {"a": "1"}, "key": "k", "priority": 3})
    [again] = await publish(
        client, {"payload": "v2", "headers": {"b": "2"}, "key": "k", "on_duplicate": "replace"}, status=200
    )
    assert again == {"id": first["id"], "seq": first["seq"], "duplicate": True, "replaced": True}
    origin = await stats(client)
    assert (origin["ready"], origin["published_total"]) == (1, 1)
    [view] = await browse(client)
    assert (view["id"], view["payload"], view["headers"], view["priority"]) == (
        first["id"],
        "v2",
        {"b": "2"},
        3,
    )
    message = await get_message(client, first["id"])
    assert events(message) == ["published", "replaced"]
    delivery = await claim_one(client)
    assert (delivery["id"], delivery["payload"], delivery["headers"], delivery["key"]) == (
        first["id"],
        "v2",
        {"b": "2"},
        "k",
    )
    # Without "replace" a duplicate is still answered with the message as it stands.
    [plain] = await publish(client, {"payload": "v3", "key": "k"}, status=200)
    assert plain == {"id": first["id"], "seq": first["seq"], "duplicate": True}


async def test_replace_keeps_a_delayed_duplicate_delayed(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    [first] = await publish(client, {"payload": "v1", "key": "k", "delay": 10})
    [before] = await browse(client)
    await trio.sleep(4)
    [again] = await publish(client, {"payload": "v2", "key": "k", "on_duplicate": "replace"}, status=200)
    assert again == {"id": first["id"], "seq": first["seq"], "duplicate": True, "replaced": True}
    [after] = await browse(client)
    assert (after["state"], after["payload"], after["available_at"]) == (
        "delayed",
        "v2",
        before["available_at"],
    )
    assert await claim(client) == {"messages": [], "ready": 0}
    await trio.sleep(6)
    assert (await claim_one(client))["payload"] == "v2"


async def test_replace_of_a_leased_duplicate_is_409_conflict_and_changes_nothing(client: Client) -> None:
    await make_queue(client)
    [first] = await publish(client, {"payload": "v1", "key": "k"})
    delivery = await claim_one(client)
    response = await client.post(
        "/v1/queues/jobs/messages", json={"payload": "v2", "key": "k", "on_duplicate": "replace"}
    )
    message = await expect_error(response, 409, "conflict")
    assert first["id"] in message
    view = await get_message(client, first["id"])
    assert (view["state"], view["payload"]) == ("in_flight", "v1")
    assert events(view) == ["published", "claimed"]
    assert await settle(client, "ack", leases=[delivery["lease_id"]]) == {"acked": 1, "skipped": []}
    # Once acked there is nothing to replace: the answer is a plain duplicate.
    [late] = await publish(client, {"payload": "v3", "key": "k", "on_duplicate": "replace"}, status=200)
    assert late == {"id": first["id"], "seq": first["seq"], "duplicate": True}
    assert (await stats(client))["published_total"] == 1


async def test_a_batch_mixing_conflicts_with_other_outcomes_answers_each(client: Client) -> None:
    await make_queue(client)
    leased, ready, other = await publish(
        client,
        {"payload": 1, "key": "leased"},
        {"payload": 2, "key": "ready"},
        {"payload": 3, "key": "other"},
    )
    assert (await claim_one(client))["id"] == leased["id"]

    # A conflict beside a new message: 201, the conflict flagged in its entry.
    refs = await publish(
        client,
        {"payload": "x", "key": "leased", "on_duplicate": "replace"},
        {"payload": "new", "key": "fresh", "on_duplicate": "replace"},
    )
    conflict, created = refs
    assert set(conflict) == {"id", "seq", "duplicate", "error"}
    assert (conflict["id"], conflict["seq"], conflict["duplicate"]) == (leased["id"], leased["seq"], True)
    assert conflict["error"]["code"] == "conflict" and conflict["error"]["message"]
    assert (created["seq"], created["duplicate"]) == (4, False)

    # A conflict beside a replacement, nothing created: 200.
    conflict, replaced = await publish(
        client,
        {"payload": "y", "key": "leased", "on_duplicate": "replace"},
        {"payload": "two", "key": "ready", "on_duplicate": "replace"},
        status=200,
    )
    assert conflict["error"]["code"] == "conflict"
    assert replaced == {"id": ready["id"], "seq": ready["seq"], "duplicate": True, "replaced": True}

    # Every message a conflict: 409 with the error body.
    response = await client.post(
        "/v1/queues/jobs/messages",
        json={"messages": [{"payload": "z", "key": "leased", "on_duplicate": "replace"}] * 2},
    )
    await expect_error(response, 409, "conflict")

    views = {m["key"]: m for m in await browse(client)}
    assert {key: m["payload"] for key, m in views.items()} == {
        "leased": 1,
        "ready": "two",
        "other": 3,
        "fresh": "new",
    }
    assert views["other"]["id"] == other["id"]
    assert (await stats(client))["published_total"] == 4


# -- message_ttl -------------------------------------------------------------------------------------


async def test_message_ttl_expires_unacked_messages_into_the_dead_letter_queue(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, message_ttl=10)
    leased_id, ready_id = (
        ref["id"]
        for ref in await publish(
            client, {"payload": "leased", "headers": {"h": "1"}, "key": "k"}, {"payload": "ready"}
        )
    )
    delivery = await claim_one(client, lease=60)
    await trio.sleep(4)
    [later_id] = await publish_ids(client, "later")
    await trio.sleep(5.9)
    assert (await stats(client))["expired_total"] == 0
    await trio.sleep(0.2)

    # Nobody asked the origin queue: it expired them on its own at the deadline.
    dead = await browse(client, "jobs.dlq")
    assert [(m["payload"], m["key"], m["headers"]) for m in dead] == [
        ("leased", "k", dead_letter_headers(leased_id, "expired", 1, h="1")),
        ("ready", None, dead_letter_headers(ready_id, "expired", 0)),
    ]
    origin = await stats(client)
    assert (origin["ready"], origin["in_flight"], origin["delayed"]) == (1, 0, 0)
    assert (origin["expired_total"], origin["dead_lettered_total"], origin["acked_total"]) == (2, 0, 0)
    assert [m["id"] for m in await browse(client)] == [later_id]

    expired = await get_message(client, leased_id)
    assert expired["state"] == "expired"
    assert events(expired) == ["published", "claimed", "expired"]
    assert expired["history"][-1]["to"] == "jobs.dlq"
    # Its lease went with it.
    assert await settle(client, "ack", leases=[delivery["lease_id"]]) == {
        "acked": 0,
        "skipped": [delivery["lease_id"]],
    }

    await trio.sleep(4)
    origin = await stats(client)
    assert (origin["ready"], origin["expired_total"]) == (0, 3)
    assert len(await browse(client, "jobs.dlq")) == 3


async def test_message_ttl_without_a_dead_letter_queue_drops_and_counts(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, message_ttl=5, dead_letter=None)
    [message_id] = await publish_ids(client, "short-lived")
    await trio.sleep(5)
    origin = await stats(client)
    assert (origin["ready"], origin["expired_total"]) == (0, 1)
    assert await queue_names(client) == ["jobs"]
    expired = await get_message(client, message_id)
    assert expired["state"] == "expired"
    assert "to" not in expired["history"][-1]


async def test_an_acked_message_never_expires(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, message_ttl=5)
    [message_id] = await publish_ids(client, "done")
    delivery = await claim_one(client)
    assert (await settle(client, "ack", leases=[delivery["lease_id"]]))["acked"] == 1
    await trio.sleep(10)
    assert (await stats(client))["expired_total"] == 0
    assert (await get_message(client, message_id))["state"] == "acked"
    assert await queue_names(client) == ["jobs"]


async def test_turning_a_ttl_on_counts_from_each_messages_publish(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    [old_id] = await publish_ids(client, "old")
    await trio.sleep(20)
    [new_id] = await publish_ids(client, "new")
    await put(client, "jobs", message_ttl=10)
    origin = await stats(client)
    assert (origin["ready"], origin["expired_total"]) == (1, 1)
    assert (await get_message(client, old_id))["state"] == "expired"
    await trio.sleep(10)
    assert (await get_message(client, new_id))["state"] == "expired"
    # Turned off again, nothing else expires.
    await put(client, "jobs", message_ttl=0)
    await publish_ids(client, "kept")
    await trio.sleep(60)
    origin = await stats(client)
    assert (origin["ready"], origin["expired_total"]) == (1, 2)


# -- max_depth ---------------------------------------------------------------------------------------


async def test_max_depth_refuses_a_whole_batch_with_429(client: Client) -> None:
    await make_queue(client, max_depth=3)
    await publish(client, {"payload": 1, "key": "one"}, {"payload": 2})
    response = await client.post(
        "/v1/queues/jobs/messages", json={"messages": [{"payload": 3}, {"payload": 4}]}
    )
    message = await expect_error(response, 429, "queue_full")
    assert "max_depth" in message
    origin = await stats(client)
    assert (origin["ready"], origin["published_total"]) == (2, 2)
    assert [m["payload"] for m in await browse(client)] == [1, 2]

    # A leased message still counts; duplicates add nothing.
    delivery = await claim_one(client)
    await publish(client, {"payload": 3})
    response = await client.post("/v1/queues/jobs/messages", json={"payload": 4})
    await expect_error(response, 429, "queue_full")
    [dup] = await publish(client, {"payload": "again", "key": "one"}, status=200)
    assert dup["duplicate"] is True

    # Settling makes room; so does raising the cap on the live queue.
    assert (await settle(client, "ack", leases=[delivery["lease_id"]]))["acked"] == 1
    await publish(client, {"payload": 4})
    await expect_error(await client.post("/v1/queues/jobs/messages", json={"payload": 5}), 429, "queue_full")
    await put(client, "jobs", max_depth=4)
    await publish(client, {"payload": 5})
    origin = await stats(client)
    assert (origin["ready"], origin["in_flight"], origin["published_total"]) == (4, 0, 5)


# -- rate_limit --------------------------------------------------------------------------------------


async def test_a_rate_limit_gives_fewer_messages_and_says_when_to_ask_again(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, rate_limit={"max": 3, "per": 10})
    await publish_ids(client, *range(5))
    first = await claim(client, max=5)
    assert [m["payload"] for m in first["messages"]] == [0, 1, 2]
    assert (first["ready"], first["retry_after"]) == (2, 10.0)

    await trio.sleep(4)
    assert await claim(client, max=5) == {"messages": [], "ready": 2, "retry_after": 6.0}
    assert await claim(client) == {"messages": [], "ready": 2, "retry_after": 6.0}
    origin = await stats(client)
    assert (origin["ready"], origin["in_flight"]) == (2, 3)

    await trio.sleep(6)
    last = await claim(client, max=5)
    assert set(last) == {"messages", "ready"}, "the limit held nothing back"
    assert ([m["payload"] for m in last["messages"]], last["ready"]) == ([3, 4], 0)


async def test_a_claim_within_the_rate_limit_has_no_retry_after(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, rate_limit={"max": 2, "per": 10})
    await publish_ids(client, "a", "b", "c")
    body = await claim(client)
    assert set(body) == {"messages", "ready"} and body["ready"] == 2
    body = await claim(client)
    assert set(body) == {"messages", "ready"} and body["ready"] == 1
    assert await claim(client) == {"messages": [], "ready": 1, "retry_after": 10.0}


async def test_a_long_poll_held_back_by_the_rate_limit_is_served_when_the_window_frees(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, rate_limit={"max": 1, "per": 5})
    await publish_ids(client, "a", "b")
    assert [m["payload"] for m in (await claim(client))["messages"]] == ["a"]
    start = trio.current_time()
    body = await claim(client, wait=30)
    assert [m["payload"] for m in body["messages"]] == ["b"]
    assert trio.current_time() - start == pytest.approx(5)


async def test_a_long_poll_that_ends_empty_under_the_rate_limit_says_when_to_ask_again(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, rate_limit={"max": 1, "per": 10})
    ids = await publish_ids(client, "a", "b")
    assert [m["payload"] for m in (await claim(client))["messages"]] == ["a"]
    await trio.sleep(2)
    assert await claim(client, wait=0.5) == {"messages": [], "ready": 1, "retry_after": 7.5}
    assert (await client.delete(f"/v1/queues/jobs/messages/{ids[1]}")).status_code == 204
    assert await claim(client, wait=0.5) == {"messages": [], "ready": 0}, "nothing ready: nothing held back"


async def test_removing_the_rate_limit_applies_to_the_next_claim(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, rate_limit={"max": 1, "per": 60})
    await publish_ids(client, "a", "b", "c")
    assert len((await claim(client, max=3))["messages"]) == 1
    await put(client, "jobs", rate_limit=None)
    body = await claim(client, max=3)
    assert ([m["payload"] for m in body["messages"]], body["ready"]) == (["b", "c"], 0)
    assert "retry_after" not in body


# -- claim_window ------------------------------------------------------------------------------------


async def test_ten_claimers_in_one_window_share_fifty_messages_evenly(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, claim_window=0.5)
    ids = await publish_ids(client, *range(50))
    claimers = [Claimer(client, consumer=f"w{n}", max=10) for n in range(10)]
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for claimer in claimers:
            nursery.start_soon(claimer.run)
    assert [len(c.messages) for c in claimers] == [5] * 10
    delivered = [m["id"] for c in claimers for m in c.messages]
    assert sorted(delivered) == sorted(ids) and len(set(delivered)) == 50
    assert [c.answered_at for c in claimers] == pytest.approx([start + 0.5] * 10)
    assert {c.body["ready"] for c in claimers} == {0}
    origin = await stats(client)
    assert (origin["ready"], origin["in_flight"]) == (0, 50)
    for claimer in claimers:
        consumers = {(await get_message(client, m["id"]))["consumer"] for m in claimer.messages}
        assert consumers == {claimer.fields["consumer"]}


async def test_a_cohort_is_divided_in_proportion_to_each_max(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, claim_window=1)
    await publish_ids(client, *range(20))
    small = Claimer(client, consumer="small", max=10)
    large = Claimer(client, consumer="large", max=30)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(small.run)
        nursery.start_soon(large.run)
    assert (len(small.messages), len(large.messages)) == (5, 15)
    # Plenty for everyone: each gets its max.
    await publish_ids(client, *range(10))
    a = Claimer(client, max=2)
    b = Claimer(client, max=3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.run)
        nursery.start_soon(b.run)
    assert (len(a.messages), len(b.messages), b.body["ready"]) == (2, 3, 5)


async def test_long_poll_claimers_that_get_nothing_in_a_window_keep_waiting(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, claim_window=1)
    await publish_ids(client, "a", "b", "c")
    claimers = [Claimer(client, consumer=f"w{n}", wait=30) for n in range(5)]
    plain = Claimer(client, consumer="no-wait")
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for claimer in claimers:
            nursery.start_soon(claimer.run)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(plain.run)  # in the same cohort, but last: the shares go to the first three
        await trio.sleep(1.5)
        served = [c for c in claimers if c.status is not None]
        assert len(served) == 3
        assert sorted(p for c in served for p in c.payloads) == ["a", "b", "c"]
        assert [c.answered_at for c in served] == pytest.approx([start + 1] * 3)
        assert plain.status == 200 and plain.body == {"messages": [], "ready": 0}
        await trio.sleep(5)
        waiting = [c for c in claimers if c.status is None]
        assert len(waiting) == 2, "the long polls that got nothing are still waiting"
        published_at = trio.current_time()
        await publish_ids(client, "d", "e")
    assert sorted(p for c in waiting for p in c.payloads) == ["d", "e"]
    assert all(len(c.payloads) == 1 for c in waiting)
    assert [c.answered_at for c in waiting] == [published_at, published_at], "woken by the publish at once"


async def test_a_long_poll_in_a_window_answers_empty_after_its_wait(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, claim_window=1)
    start = trio.current_time()
    assert await claim(client, wait=5) == {"messages": [], "ready": 0}
    assert trio.current_time() - start == pytest.approx(5)


# -- dedup_window ------------------------------------------------------------------------------------


async def test_a_key_is_remembered_for_the_dedup_window_acked_or_not(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client, dedup_window=10)
    [first] = await publish(client, {"payload": 1, "key": "k"})
    delivery = await claim_one(client)
    assert (await settle(client, "ack", leases=[delivery["lease_id"]]))["acked"] == 1
    await trio.sleep(9)
    [dup] = await publish(client, {"payload": 2, "key": "k"}, status=200)
    assert dup == {**first, "duplicate": True}
    await trio.sleep(1)
    [fresh] = await publish(client, {"payload": 3, "key": "k"})
    assert fresh["id"] != first["id"] and (fresh["seq"], fresh["duplicate"]) == (2, False)
    # A shorter window set on the live queue applies to later publishes.
    await put(client, "jobs", dedup_window=2)
    [other] = await publish(client, {"payload": 4, "key": "other"})
    await trio.sleep(2)
    [again] = await publish(client, {"payload": 5, "key": "other"})
    assert again["id"] != other["id"] and again["duplicate"] is False
    assert (await stats(client))["published_total"] == 4


# -- purge and delete leave the policies alone -------------------------------------------------------


async def test_purge_frees_room_and_purged_messages_never_expire(autojump_clock: Any, client: Client) -> None:
    policies = {"max_depth": 2, "message_ttl": 10, "max_attempts": 1}
    created = await make_queue(client, **policies)
    leased_id, purged_id = await publish_ids(client, "leased", "purged")
    await expect_error(
        await client.post("/v1/queues/jobs/messages", json={"payload": "x"}), 429, "queue_full"
    )
    delivery = await claim_one(client, lease=60)
    assert delivery["id"] == leased_id
    assert await post(client, "/v1/queues/jobs/purge", {}) == {"purged": 1}
    assert (await queue_info(client))["config"] == created["config"]
    [kept_id] = await publish_ids(client, "after purge")
    await expect_error(
        await client.post("/v1/queues/jobs/messages", json={"payload": "y"}), 429, "queue_full"
    )

    await trio.sleep(10)
    origin = await stats(client)
    assert (origin["ready"], origin["in_flight"], origin["expired_total"]) == (0, 0, 2)
    dead = await browse(client, "jobs.dlq")
    assert [m["headers"]["x-original-id"] for m in dead] == [leased_id, kept_id]
    assert all(m["headers"]["x-dead-letter-reason"] == "expired" for m in dead)
    assert (await get_message(client, leased_id))["state"] == "expired"
    await expect_error(await client.get(f"/v1/queues/jobs/messages/{purged_id}"), 404, "message_not_found")


async def test_a_deleted_leased_message_is_never_dead_lettered(autojump_clock: Any, client: Client) -> None:
    await make_queue(client, max_attempts=1, lease=5)
    deleted_id, kept_id = await publish_ids(client, "deleted", "kept")
    deliveries = (await claim(client, max=2))["messages"]
    assert (await client.delete(f"/v1/queues/jobs/messages/{deleted_id}")).status_code == 204
    await trio.sleep(6)
    origin = await stats(client)
    assert (origin["ready"], origin["in_flight"]) == (0, 0)
    assert (origin["lease_expired_total"], origin["dead_lettered_total"]) == (1, 1)
    [moved] = await browse(client, "jobs.dlq")
    assert moved["headers"] == dead_letter_headers(kept_id, "max_attempts", 1)
    leases = [d["lease_id"] for d in deliveries]
    assert await settle(client, "ack", leases=leases) == {"acked": 0, "skipped": leases}
    await expect_error(await client.get(f"/v1/queues/jobs/messages/{deleted_id}"), 404, "message_not_found")
    assert (await queue_info(client))["config"]["max_attempts"] == 1


# -- found wrong by the first sweep, fixed since ----------------------------------------------------


async def test_a_queue_with_a_124_character_name_can_dead_letter(client: Client) -> None:
    name = "q" * 124
    await make_queue(client, name)
    [message_id] = await publish_ids(client, "x", queue=name)
    delivery = await claim_one(client, name)
    answer = await settle(client, "nack", name, leases=[delivery["lease_id"]], retryable=False)
    assert answer == {"nacked": 1, "dead_lettered": 1, "skipped": []}
    [moved] = await browse(client, f"{name}.dlq")
    assert moved["headers"] == dead_letter_headers(message_id, "rejected", 1, origin=name)


async def test_a_valid_128_character_name_ending_in_dlq_can_be_created(client: Client) -> None:
    name = "q" * 124 + ".dlq"
    created = await make_queue(client, name)
    assert created["name"] == name
    assert created["config"]["dead_letter"] != name


async def test_a_replacement_is_not_lost_to_an_older_leases_ack(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    [first] = await publish(client, {"payload": "v1", "key": "k"})
    delivery = await claim_one(client, lease=2)
    await trio.sleep(3)
    assert (await stats(client))["ready"] == 1  # the expiry is noticed
    response = await client.post(
        "/v1/queues/jobs/messages", json={"payload": "v2", "key": "k", "on_duplicate": "replace"}
    )
    if response.status_code == 409:
        return  # refusing the replace while the old lease still settles keeps v2 from being lost too
    assert response.status_code == 200, await response.get_data()
    assert (await response.get_json())["messages"][0]["replaced"] is True
    # The consumer of v1 finishes late: its ack must not complete v2, which nobody has seen.
    await settle(client, "ack", leases=[delivery["lease_id"]])
    redelivered = await claim_one(client)
    assert (redelivered["id"], redelivered["payload"]) == (first["id"], "v2")
