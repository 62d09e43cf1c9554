"""A push in flight when its dispatcher ends: at a broker's stop the dispatcher gives the message back (a
``Released`` record in the journal) before the queue's actor stops; when its queue is deleted there is
nothing to give back. Neither is logged as a bug."""

from __future__ import annotations

import pytest
import structlog
import trio

from broker.actor import QueueActor
from broker.core.records import Claimed, DeadLettered, Released
from tests.push.conftest import Received, Receiver, publish, pushing, put_queue, wait_until

HOOK = "http://receiver.test/hook"


async def never_answers(_: Received) -> tuple[int, dict[str, str]]:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


async def test_a_push_in_flight_at_shutdown_is_released_before_the_actors_stop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With its attempt refunded: the broker cut the push off, so a message on its last attempt is
    pushed again at the next start, not dead-lettered (or dropped, with no dead-letter queue)."""
    receiver = Receiver(never_answers)
    with structlog.testing.capture_logs() as logs:
        async with pushing(receiver.transport()) as p:
            await put_queue(p.client, max_attempts=1, dead_letter=None, push={"url": HOOK, "timeout": 120})
            message_id = await publish(p.client, "in flight at the stop")
            await wait_until(lambda: receiver.in_progress == 1)
            journal = p.broker.journal
        # Leaving the block stops the broker: push first, awaited, then the actors.
    records = [entry.record for entry in journal.entries()]
    claimed = [record for record in records if isinstance(record, Claimed)]
    released = [record for record in records if isinstance(record, Released)]
    assert [record.id for record in claimed] == [message_id]
    assert [(record.id, record.lease_id) for record in released] == [(message_id, claimed[0].lease_id)]
    assert released[0].refunded
    assert not [record for record in records if isinstance(record, DeadLettered)]
    assert [entry["event"] for entry in logs if entry["log_level"] == "error"] == []


async def test_a_push_in_flight_is_released_even_when_its_queue_inbox_is_full(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full inbox makes ``post`` refuse: the dispatcher must wait for room, not drop the release and
    leave the message leased until its lease expires."""
    monkeypatch.setattr(QueueActor, "post", lambda self, command: False)
    receiver = Receiver(never_answers)
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": HOOK, "timeout": 120})
        message_id = await publish(p.client, "in flight at the stop")
        await wait_until(lambda: receiver.in_progress == 1)
        journal = p.broker.journal
    released = [entry.record for entry in journal.entries() if isinstance(entry.record, Released)]
    assert [record.id for record in released] == [message_id]


async def test_a_queue_deleted_while_a_push_is_in_flight_ends_its_dispatcher_quietly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    receiver = Receiver(never_answers)
    with structlog.testing.capture_logs() as logs:
        async with pushing(receiver.transport()) as p:
            await put_queue(p.client, push={"url": HOOK, "timeout": 120})
            await publish(p.client, "in flight at the delete")
            await wait_until(lambda: receiver.in_progress == 1)
            assert (await p.client.delete("/v1/queues/jobs")).status_code == 204
            await wait_until(lambda: p.supervisor.status("jobs") is None and receiver.in_progress == 0)
            await trio.sleep(10)  # a dispatcher that failed would be restarted by now
    assert [entry["event"] for entry in logs if entry["log_level"] == "error"] == []


async def test_removing_push_gives_a_message_on_its_last_attempt_back_unspent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    receiver = Receiver(never_answers)
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, max_attempts=1, dead_letter=None, push={"url": HOOK, "timeout": 120})
        message_id = await publish(p.client, "in flight when push is removed")
        await wait_until(lambda: receiver.in_progress == 1)
        await put_queue(p.client, push=None)
        await wait_until(lambda: p.supervisor.status("jobs") is None)
        message = await (await p.client.get(f"/v1/queues/jobs/messages/{message_id}")).get_json()
    assert (message["state"], message["attempt"]) == ("ready", 0)
    assert [entry["event"] for entry in message["history"]] == ["published", "claimed", "released"]
