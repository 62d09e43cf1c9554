"""The actor shell: replies, journal commits, long polls and deadlines, with Trio's autojump clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import trio
import trio.testing

from broker.actor import QueueActor
from broker.clock import Clock
from broker.core import NewMessage
from broker.core.commands import Ack, Claim, DeleteMessage, Extend, Publish
from broker.core.model import CREATED
from broker.core.records import Published, Record
from broker.errors import BrokerError, MessageNotFound, QueueNotFound
from broker.registry import Registry
from broker.storage import CommitWaiter, InMemoryJournal


class HeldJournal(InMemoryJournal):
    """An in-memory journal whose commits wait until the test releases them, like a slow fsync."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[CommitWaiter] = []

    def commit_then(self, lsn: int, waiter: CommitWaiter) -> None:
        self.held.append(waiter)

    def release(self) -> None:
        held, self.held = self.held, []
        for waiter in held:
            waiter.resolve()

    def fail(self, error: BrokerError) -> None:
        held, self.held = self.held, []
        for waiter in held:
            waiter.fail(error)


@pytest.fixture
async def journal() -> InMemoryJournal:
    return InMemoryJournal()


@pytest.fixture
async def registry(journal: InMemoryJournal) -> AsyncIterator[Registry]:
    async with trio.open_nursery() as nursery:
        registry = Registry(nursery, journal, Clock())
        yield registry
        registry.stop_all()


async def make(registry: Registry, name: str = "jobs", **config: Any) -> QueueActor:
    await registry.create(name, config).wait()
    return registry.get(name)


def batch(*payloads: str, delay: float = 0.0) -> Publish:
    return Publish([NewMessage(payload.encode(), delay=delay) for payload in payloads])


def payloads(outcome: Any) -> list[bytes]:
    return [message.payload for _, message in outcome.deliveries]


async def test_publish_then_claim_and_ack_are_journaled_in_order(
    registry: Registry, journal: InMemoryJournal
) -> None:
    actor = await make(registry)
    await actor.request(batch('"a"', '"b"'))
    outcome = await actor.request(Claim("w", max_count=2))
    leases = [claimed.lease_id for claimed, _ in outcome.deliveries]
    acked = await actor.request(Ack(leases))
    assert acked.settled == 2
    kinds = [type(entry.record).__name__ for entry in journal.entries()]
    assert kinds == ["QueueCreated", "Published", "Published", "Claimed", "Claimed", "Acked", "Acked"]
    lsns = [entry.lsn for entry in journal.entries()]
    assert lsns == sorted(lsns) and len(set(lsns)) == len(lsns)


async def test_a_publish_wakes_a_waiting_claimer_at_once(registry: Registry, autojump_clock: Any) -> None:
    actor = await make(registry)
    results: list[Any] = []

    async def claimer() -> None:
        results.append(await actor.request(Claim("w", wait=30)))
        results.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(claimer)
        await trio.testing.wait_all_tasks_blocked()
        published_at = trio.current_time()
        await actor.request(batch('"hello"'))
    outcome, answered_at = results
    assert payloads(outcome) == [b'"hello"']
    assert answered_at == published_at  # no polling tick: not a moment of (virtual) time passed


async def test_waiting_claimers_are_served_in_arrival_order(registry: Registry, autojump_clock: Any) -> None:
    actor = await make(registry)
    got: dict[str, list[bytes]] = {}

    async def claimer(name: str) -> None:
        got[name] = payloads(await actor.request(Claim(name, wait=30)))

    async with trio.open_nursery() as nursery:
        for name in ("first", "second", "third"):
            nursery.start_soon(claimer, name)
            await trio.testing.wait_all_tasks_blocked()
        await actor.request(batch('"1"'))
        await trio.testing.wait_all_tasks_blocked()
        assert got == {"first": [b'"1"']}
        await actor.request(batch('"2"', '"3"'))
    assert got == {"first": [b'"1"'], "second": [b'"2"'], "third": [b'"3"']}


async def test_a_long_poll_answers_empty_after_its_wait(registry: Registry, autojump_clock: Any) -> None:
    actor = await make(registry)
    started = trio.current_time()
    outcome = await actor.request(Claim("w", wait=7.5))
    assert outcome.deliveries == []
    assert trio.current_time() - started == pytest.approx(7.5)


async def test_a_waiting_claimer_gets_a_message_when_its_delay_ends(
    registry: Registry, autojump_clock: Any
) -> None:
    actor = await make(registry)
    await actor.request(batch('"later"', delay=4))
    started = trio.current_time()
    outcome = await actor.request(Claim("w", wait=30))
    assert payloads(outcome) == [b'"later"']
    assert trio.current_time() - started == pytest.approx(4)


async def test_a_waiting_claimer_gets_a_message_whose_lease_expired(
    registry: Registry, autojump_clock: Any
) -> None:
    actor = await make(registry, lease=5)
    await actor.request(batch('"job"'))
    first = await actor.request(Claim("slow"))
    started = trio.current_time()
    second = await actor.request(Claim("other", wait=30))
    assert payloads(second) == [b'"job"']
    assert trio.current_time() - started == pytest.approx(5)
    assert [claimed.attempt for claimed, _ in second.deliveries] == [2]
    # The first lease went stale the moment the message was delivered again.
    stale = first.deliveries[0][0].lease_id
    assert (await actor.request(Ack([stale]))).skipped == (stale,)


async def test_an_expired_lease_still_settles_until_redelivered(
    registry: Registry, autojump_clock: Any
) -> None:
    actor = await make(registry, lease=1)
    await actor.request(batch('"job"'))
    lease = (await actor.request(Claim("w"))).deliveries[0][0].lease_id
    await trio.sleep(10)
    extended = await actor.request(Extend([lease], 30))
    assert extended.settled == 1
    assert (await actor.request(Claim("other"))).deliveries == []
    assert (await actor.request(Ack([lease]))).settled == 1


async def test_durable_publish_waits_for_commit_but_claim_does_not() -> None:
    journal = HeldJournal()
    async with trio.open_nursery() as nursery:
        registry = Registry(nursery, journal, Clock())
        created = registry.create("jobs", {})
        journal.release()
        actor = await created.wait()
        answered: list[str] = []

        async def publish() -> None:
            await actor.request(batch('"x"'))
            answered.append("publish")

        nursery.start_soon(publish)
        await trio.testing.wait_all_tasks_blocked()
        assert answered == []  # records appended, not yet committed
        outcome = await actor.request(Claim("w"))  # a claim needs no commit
        assert payloads(outcome) == [b'"x"']
        journal.release()
        await trio.testing.wait_all_tasks_blocked()
        assert answered == ["publish"]
        registry.stop_all()


async def test_a_failed_commit_fails_the_request() -> None:
    journal = HeldJournal()
    async with trio.open_nursery() as nursery:
        registry = Registry(nursery, journal, Clock())
        created = registry.create("jobs", {})
        journal.release()
        actor = await created.wait()
        failures: list[BrokerError] = []

        async def publish() -> None:
            try:
                await actor.request(batch('"x"'))
            except BrokerError as error:
                failures.append(error)

        nursery.start_soon(publish)
        await trio.testing.wait_all_tasks_blocked()
        journal.fail(BrokerError("disk full"))
        await trio.testing.wait_all_tasks_blocked()
        assert [error.message for error in failures] == ["disk full"]
        registry.stop_all()


async def test_a_non_durable_queue_answers_before_commit() -> None:
    journal = HeldJournal()
    async with trio.open_nursery() as nursery:
        registry = Registry(nursery, journal, Clock())
        actor = await registry.create("fast", {"durable": False}).wait()
        refs = await actor.request(batch('"x"'))
        assert [duplicate for _, _, duplicate in refs] == [False]
        assert journal.held == []
        registry.stop_all()


async def test_domain_errors_reach_the_requester_and_the_actor_lives_on(registry: Registry) -> None:
    actor = await make(registry)
    with pytest.raises(MessageNotFound):
        await actor.request(DeleteMessage("nope"))
    assert (await actor.request(batch('"still alive"')))[0][2] == CREATED


async def test_deleting_a_queue_fails_its_waiting_claimers(registry: Registry) -> None:
    actor = await make(registry)
    errors: list[BrokerError] = []

    async def claimer() -> None:
        try:
            await actor.request(Claim("w", wait=30))
        except QueueNotFound as error:
            errors.append(error)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(claimer)
        await trio.testing.wait_all_tasks_blocked()
        await registry.delete("jobs").wait()
    assert len(errors) == 1
    with pytest.raises(QueueNotFound):
        registry.get("jobs")
    with pytest.raises(QueueNotFound):
        await actor.request(batch('"late"'))


async def test_queue_records_name_their_queue(registry: Registry, journal: InMemoryJournal) -> None:
    await make(registry, "a")
    await make(registry, "b")
    await registry.get("b").request(batch('"x"'))
    published: Sequence[tuple[str, Record]] = [
        (entry.queue, entry.record) for entry in journal.entries() if isinstance(entry.record, Published)
    ]
    assert [queue for queue, _ in published] == ["b"]
