"""§5 long polls over the in-process app. The ``autojump_clock`` moves Trio's clock (and the broker's,
which follows it) only when every task is blocked, so a claim that is woken "at once" spends no virtual
time, and waiting out a ``wait`` costs no real time."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from tests.conftest import Client, make_queue


async def claim(client: Client, **fields: Any) -> dict[str, Any]:
    response = await client.post("/v1/queues/jobs/claim", json=fields)
    assert response.status_code == 200, await response.get_data()
    body: dict[str, Any] = await response.get_json()
    return body


async def publish(client: Client, *payloads: Any, **fields: Any) -> None:
    response = await client.post(
        "/v1/queues/jobs/messages", json={"messages": [{"payload": p, **fields} for p in payloads]}
    )
    assert response.status_code == 201, await response.get_data()


async def stats(client: Client) -> dict[str, Any]:
    result: dict[str, Any] = (await (await client.get("/v1/queues/jobs")).get_json())["stats"]
    return result


class Claimer:
    """A long-poll claim running in a nursery: its answer, and the Trio time it came."""

    def __init__(self, client: Client, **fields: Any) -> None:
        self.client = client
        self.fields = fields
        self.status: int | None = None
        self.body: Any = None
        self.answered_at: float | None = None

    async def run(self) -> None:
        response = await self.client.post("/v1/queues/jobs/claim", json=self.fields)
        self.status = response.status_code
        self.body = await response.get_json()
        self.answered_at = trio.current_time()

    @property
    def payloads(self) -> list[Any]:
        assert self.status == 200, self.body
        return [m["payload"] for m in self.body["messages"]]


async def test_a_publish_wakes_a_waiting_claimer_at_once(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    claimer = Claimer(client, consumer="w", wait=30)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(claimer.run)
        await trio.testing.wait_all_tasks_blocked()
        assert claimer.status is None, "the claim is parked"
        published_at = trio.current_time()
        await publish(client, "hello")
    assert claimer.payloads == ["hello"]
    assert claimer.answered_at == published_at, "woken by the publish itself, not by a tick or a timeout"
    assert claimer.body["ready"] == 0
    assert claimer.body["messages"][0]["attempt"] == 1
    assert (await stats(client))["in_flight"] == 1


async def test_a_waiting_claimer_gets_up_to_max_of_a_batch(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    claimer = Claimer(client, max=3, wait=30)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(claimer.run)
        await trio.testing.wait_all_tasks_blocked()
        await publish(client, 1, 2, 3, 4, 5)
    assert claimer.payloads == [1, 2, 3]
    assert claimer.body["ready"] == 2


async def test_a_claim_with_wait_answers_at_once_when_messages_are_ready(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    await publish(client, "ready")
    start = trio.current_time()
    body = await claim(client, wait=30)
    assert [m["payload"] for m in body["messages"]] == ["ready"]
    assert trio.current_time() == start


@pytest.mark.parametrize(("wait", "seconds"), [(5, 5.0), ("250ms", 0.25), ("30s", 30.0), (0.5, 0.5)])
async def test_a_claim_answers_empty_after_wait(
    autojump_clock: Any, client: Client, wait: Any, seconds: float
) -> None:
    await make_queue(client)
    start = trio.current_time()
    body = await claim(client, wait=wait)
    assert body == {"messages": [], "ready": 0}
    assert trio.current_time() - start == pytest.approx(seconds)


async def test_without_wait_a_claim_never_waits(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    start = trio.current_time()
    assert await claim(client) == {"messages": [], "ready": 0}
    assert await claim(client, wait=0) == {"messages": [], "ready": 0}
    assert trio.current_time() == start


async def test_a_timed_out_claim_holds_no_lease(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    assert (await claim(client, wait=2))["messages"] == []
    await publish(client, "after")
    queue_stats = await stats(client)
    assert (queue_stats["ready"], queue_stats["in_flight"]) == (1, 0)
    assert [m["payload"] for m in (await claim(client))["messages"]] == ["after"]


async def test_waiting_claimers_are_served_in_arrival_order(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    first = Claimer(client, consumer="first", wait=30)
    second = Claimer(client, consumer="second", wait=30)
    third = Claimer(client, consumer="third", wait=30)
    async with trio.open_nursery() as nursery:
        for claimer in (first, second, third):
            nursery.start_soon(claimer.run)
            await trio.testing.wait_all_tasks_blocked()  # parked before the next one arrives
        await publish(client, "m1")
        await trio.testing.wait_all_tasks_blocked()
        assert first.payloads == ["m1"]
        assert second.status is None and third.status is None
        await publish(client, "m2", "m3")
    assert second.payloads == ["m2"]
    assert third.payloads == ["m3"]
    assert first.answered_at == second.answered_at == third.answered_at, "no virtual time passed"


async def test_an_earlier_claimer_that_times_out_lets_the_next_one_be_served(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    short = Claimer(client, wait=5)
    long = Claimer(client, wait=30)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(short.run)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(long.run)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        await trio.sleep(6)
        assert short.payloads == []
        assert short.answered_at == pytest.approx(start + 5)
        assert long.status is None
        await publish(client, "late")
    assert long.payloads == ["late"]


async def test_a_delayed_message_wakes_a_waiting_claimer_when_due(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    await publish(client, "later", delay=3)
    start = trio.current_time()
    body = await claim(client, wait=10)
    assert [m["payload"] for m in body["messages"]] == ["later"]
    assert trio.current_time() - start == pytest.approx(3)


async def test_an_expired_lease_wakes_a_waiting_claimer_at_its_deadline(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    await publish(client, "job")
    await claim(client, lease=2)
    start = trio.current_time()
    body = await claim(client, consumer="rescuer", wait=10)
    [delivery] = body["messages"]
    assert (delivery["payload"], delivery["attempt"]) == ("job", 2)
    assert trio.current_time() - start == pytest.approx(2)


async def test_a_nack_wakes_a_waiting_claimer_at_once(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    await publish(client, "job")
    lease = (await claim(client, consumer="flaky"))["messages"][0]["lease_id"]
    waiting = Claimer(client, consumer="steady", wait=30)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiting.run)
        await trio.testing.wait_all_tasks_blocked()
        nacked_at = trio.current_time()
        response = await client.post("/v1/queues/jobs/nack", json={"leases": [lease], "delay": 0})
        assert response.status_code == 200
    assert waiting.payloads == ["job"]
    assert waiting.answered_at == nacked_at


async def test_deleting_the_queue_answers_a_waiting_claimer_404(autojump_clock: Any, client: Client) -> None:
    await make_queue(client)
    claimer = Claimer(client, wait=30)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(claimer.run)
        await trio.testing.wait_all_tasks_blocked()
        deleted_at = trio.current_time()
        assert (await client.delete("/v1/queues/jobs")).status_code == 204
    assert claimer.status == 404
    assert claimer.body["error"]["code"] == "queue_not_found"
    assert claimer.answered_at == deleted_at


async def test_waiting_claimers_on_one_queue_do_not_take_another_queues_messages(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    await make_queue(client, "other")
    claimer = Claimer(client, wait=5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(claimer.run)
        await trio.testing.wait_all_tasks_blocked()
        response = await client.post("/v1/queues/other/messages", json={"payload": "elsewhere"})
        assert response.status_code == 201
    assert claimer.payloads == []


async def test_an_abandoned_long_poll_does_not_swallow_the_next_message(
    autojump_clock: Any, client: Client
) -> None:
    await make_queue(client)
    with trio.move_on_after(1):  # the client gives up long before its wait of 30 s
        await client.post("/v1/queues/jobs/claim", json={"consumer": "gone", "wait": 30})
        pytest.fail("the claim should still have been waiting")
    await publish(client, "next")
    body = await claim(client, consumer="present")
    assert [m["payload"] for m in body["messages"]] == ["next"]
