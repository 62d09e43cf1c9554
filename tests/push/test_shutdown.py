"""A push in flight when its dispatcher ends: at a broker's stop the dispatcher gives the message back (a
``Released`` record in the journal) before the queue's actor stops; when its queue is deleted there is
nothing to give back. Neither is logged as a bug."""

from __future__ import annotations

import signal

import pytest
import structlog
import trio

from broker import server
from broker.actor import QueueActor
from broker.core.records import Claimed, DeadLettered, Released
from broker.http import parse
from tests.push.conftest import Received, Receiver, publish, pushing, put_queue, stats, wait_until

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
    """A full inbox makes ``post_nowait`` refuse: the dispatcher must wait for room, not drop the release
    and leave the message leased until its lease expires."""
    monkeypatch.setattr(QueueActor, "post_nowait", lambda self, command: False)
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


async def test_a_push_that_fails_after_its_queue_was_deleted_settles_nothing_and_says_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Its nack found the queue gone with its messages: ``push_settle_failed`` said the lease would
    expire and the message be pushed again, neither of which happens to a deleted queue."""
    deleted = trio.Event()

    async def delete_then_fail(_: Received) -> tuple[int, dict[str, str]]:
        await deleted.wait()
        return 500, {}

    receiver = Receiver(delete_then_fail)
    with structlog.testing.capture_logs() as logs:
        async with pushing(receiver.transport()) as p:
            # With its one slot taken, the claim loop waits for the slot, not in a claim that would
            # see the queue go and cut the push off.
            await put_queue(p.client, push={"url": HOOK, "concurrency": 1})
            await publish(p.client, "failing as its queue goes")
            await wait_until(lambda: receiver.in_progress == 1)
            assert (await p.client.delete("/v1/queues/jobs")).status_code == 204
            deleted.set()  # the 500 comes before the supervisor notices the delete (every 0.5 s)
            await wait_until(lambda: receiver.in_progress == 0)
            await trio.sleep(1)
    assert [entry for entry in logs if entry["event"] == "push_settle_failed"] == []


async def test_a_broker_that_begins_to_stop_claims_nothing_more_for_push(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """From the signal on (step 1 of a graceful stop), as push streams do: pushes already in flight go on
    (the receiver gets its answer in, the message is acked), but nothing more is claimed and pushed
    during the up to 10 s the broker waits for requests (it did: 100 new pushes in one review's run)."""
    first_in = trio.Event()
    answer_first = trio.Event()

    async def hold_the_first(received: Received) -> tuple[int, dict[str, str]]:
        if not first_in.is_set():
            first_in.set()
            await answer_first.wait()
        return 200, {}

    receiver = Receiver(hold_the_first)
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": HOOK, "concurrency": 1})
        await publish(p.client, "in flight at the signal")
        await publish(p.client, "left for the next start")
        await first_in.wait()
        p.supervisor.stop_claiming()
        answer_first.set()
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 1)
        await trio.sleep(30)
        assert len(receiver.requests) == 1
        counts = await stats(p.client)
        assert (counts["acked_total"], counts["ready"], counts["in_flight"]) == (1, 1, 0)
        await put_queue(p.client, "other", push={"url": HOOK})
        await publish(p.client, "queued after the signal", name="other")
        await trio.sleep(5)
        assert p.supervisor.status("other") is None, "no dispatcher starts once the broker stops"


async def test_the_first_signal_stops_push_claiming() -> None:
    """``serve``'s signal watcher tells the push supervisor, with the registry, at the first signal."""
    async with pushing() as p:
        signals = server._Signals()
        signals.attach(p.broker.registry, p.supervisor)
        async with trio.open_nursery() as nursery:
            await nursery.start(signals.watch)
            signal.raise_signal(signal.SIGTERM)
            with trio.fail_after(10):
                await signals.stop.wait()
            nursery.cancel_scope.cancel()
        # Made through the registry: the HTTP layer refuses requests once the broker stops.
        await p.broker.registry.put("late", parse.queue_config({"push": {"url": HOOK}}))
        p.supervisor.reconcile()
        assert p.supervisor.status("late") is None


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
