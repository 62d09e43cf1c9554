"""The actor shell: replies, journal commits, long polls and deadlines, with Trio's autojump clock."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import structlog
import trio
import trio.testing

from broker.actor import QueueActor
from broker.clock import Clock
from broker.core import NewMessage, QueueConfig, QueueCore
from broker.core.commands import Ack, Claim, DeleteMessage, Extend, GetStats, Nack, Publish, UpdateConfig
from broker.core.model import CREATED, ConfigChange
from broker.core.records import LeaseExpired, Published, QueueCreated, QueueDeleted, Record, Redriven
from broker.errors import BrokerError, MessageNotFound, QueueNotFound
from broker.registry import Registry
from broker.storage import CommitWaiter, InMemoryJournal
from broker.storage.recovery import Recovered, replay


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


async def test_on_hold_is_called_once_when_a_claim_is_kept_waiting_and_never_when_answered_at_once(
    registry: Registry, autojump_clock: Any
) -> None:
    actor = await make(registry)
    windowed = await make(registry, "windowed", claim_window=0.05)
    held: list[str] = []
    await actor.request(batch('"ready"'))
    answered = await actor.request(Claim("w", wait=30), on_hold=lambda: held.append("answered"))
    assert payloads(answered) == [b'"ready"'] and held == []
    async with trio.open_nursery() as nursery:
        for name, queue in (("parked", actor), ("behind", actor), ("window", windowed)):
            nursery.start_soon(
                lambda name, queue: queue.request(Claim(name, wait=30), on_hold=lambda: held.append(name)),
                name,
                queue,
            )
            await trio.testing.wait_all_tasks_blocked()
        # "behind" arrived while "parked" waited; the window claim waits for its window to close, then,
        # finding nothing, for a message: held once all the same.
        assert held == ["parked", "behind", "window"]
        await actor.request(batch('"1"', '"2"'))
        await windowed.request(batch('"3"'))
    assert held == ["parked", "behind", "window"]


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


async def held_queue(nursery: trio.Nursery, journal: HeldJournal) -> tuple[Registry, QueueActor]:
    """A registry on ``journal`` with a durable queue ``jobs`` made (its creation committed)."""
    registry = Registry(nursery, journal, Clock())
    created = registry.create("jobs", {})
    journal.release()
    return registry, await created.wait()


async def test_durable_publish_waits_for_commit_but_claim_does_not() -> None:
    journal = HeldJournal()
    async with trio.open_nursery() as nursery:
        registry, actor = await held_queue(nursery, journal)
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


async def test_a_duplicate_publish_or_a_repeated_ack_waits_for_the_commit_of_what_it_reports() -> None:
    """They make no records of their own, so they were answered at once: a retried publish got
    ``duplicate`` (and a retried ack ``skipped``) before the first one's records were fsynced, and a
    crash then lost a message whose publish had a 2xx, or brought back one whose ack had."""
    journal = HeldJournal()
    async with trio.open_nursery() as nursery:
        registry, actor = await held_queue(nursery, journal)
        answered: list[str] = []

        async def request(name: str, command: Any) -> None:
            await actor.request(command)
            answered.append(name)

        keyed = Publish([NewMessage(b'"x"', key="k")])
        nursery.start_soon(request, "publish", keyed)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(request, "the same again", keyed)
        await trio.testing.wait_all_tasks_blocked()
        assert answered == []  # the first is not committed, so neither may answer
        journal.release()
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(answered) == ["publish", "the same again"]

        [(claimed, _)] = (await actor.request(Claim("w"))).deliveries
        answered.clear()
        nursery.start_soon(request, "ack", Ack([claimed.lease_id]))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(request, "ack again", Ack([claimed.lease_id]))
        await trio.testing.wait_all_tasks_blocked()
        assert answered == []
        journal.release()
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(answered) == ["ack", "ack again"]
        registry.stop_all()


async def test_making_a_durable_queue_not_durable_waits_for_the_commit_of_that_change() -> None:
    """Whether to wait was read from the config after the change: the update that turned durability
    off answered before its record was fsynced, and a crash then brought the queue back durable."""
    journal = HeldJournal()
    async with trio.open_nursery() as nursery:
        registry, actor = await held_queue(nursery, journal)
        answered: list[str] = []

        async def update() -> None:
            await actor.request(UpdateConfig({"durable": False}))
            answered.append("update")

        nursery.start_soon(update)
        await trio.testing.wait_all_tasks_blocked()
        assert answered == []  # appended, not yet committed
        journal.release()
        await trio.testing.wait_all_tasks_blocked()
        assert answered == ["update"]
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


async def test_commands_queued_before_a_delete_are_not_applied_after_its_record(
    registry: Registry, journal: InMemoryJournal
) -> None:
    """A publish that reached the inbox just before its queue's DELETE was applied after it, so the
    journal held a ``published`` after ``queue_deleted``, which no replay could place: the broker
    could not start again, nor take a snapshot."""
    actor = await make(registry)
    for payload in ('"a"', '"b"'):
        assert actor.post_nowait(batch(payload))  # queued; the actor has not run since
    await registry.delete("jobs").wait()
    await trio.testing.wait_all_tasks_blocked()
    assert [type(entry.record).__name__ for entry in journal.entries()] == ["QueueCreated", "QueueDeleted"]
    assert replay(journal.entries()).queues == {}
    await make(registry)  # the name is free again, and its new queue starts empty
    assert (await registry.get("jobs").request(GetStats())).published_total == 0


class HeldNursery:
    """A nursery whose ``start_soon`` holds the tasks (the registry's actors) until ``release``: what
    is sent to an actor meanwhile waits in its inbox, as behind a busy actor."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._held: list[tuple[Any, tuple[Any, ...], Any]] = []

    def start_soon(self, function: Any, *args: Any, name: Any = None) -> None:
        self._held.append((function, args, name))

    def release(self) -> None:
        held, self._held = self._held, []
        for function, args, name in held:
            self._nursery.start_soon(function, *args, name=name)


async def test_every_request_waiting_in_the_inbox_of_a_deleted_queue_is_answered_404() -> None:
    """Only the first command the actor met after a delete was answered; the rest of its inbox was
    never received, so their requesters waited forever (a graceful stop waited out its grace period)."""
    answers: list[str] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            held = HeldNursery(nursery)
            registry = Registry(held, InMemoryJournal(), Clock())  # type: ignore[arg-type]
            await registry.create("jobs", {}).wait()
            actor = registry.get("jobs")

            async def publisher(payload: str) -> None:
                try:
                    await actor.request(batch(payload))
                    answers.append("published")
                except QueueNotFound:
                    answers.append("404")

            for n in range(5):
                nursery.start_soon(publisher, f'"{n}"')
            await trio.testing.wait_all_tasks_blocked()  # all five sit in the inbox
            await registry.delete("jobs").wait()
            held.release()
    assert answers == ["404"] * 5


async def test_a_put_whose_update_a_delete_overtook_creates_the_queue_anew() -> None:
    """A PUT that found the queue and sent it its update, which a DELETE then overtook in the inbox,
    answered 404: the update was never applied, so the PUT comes after the delete and creates."""
    results: list[tuple[bool, ConfigChange]] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            held = HeldNursery(nursery)
            registry = Registry(held, InMemoryJournal(), Clock())  # type: ignore[arg-type]
            await registry.create("jobs", {"max_attempts": 3}).wait()

            async def put() -> None:
                results.append(await registry.put("jobs", {"lease": 5}))

            nursery.start_soon(put)
            await trio.testing.wait_all_tasks_blocked()  # its update sits in the old queue's inbox
            await registry.delete("jobs").wait()
            held.release()
            await trio.testing.wait_all_tasks_blocked()
            held.release()  # the new queue's actor
            [(created, change)] = results
            config = registry.get("jobs").core.config
            assert created and change.before is None and change.after is config
            assert config.lease == 5 and config.max_attempts == 0  # a new queue: the old config went
            created, change = await registry.put("jobs", {"lease": 6})
            assert not created and change.before is config and change.after.lease == 6
            assert registry.get("jobs").core.config.lease == 6
            registry.stop_all()


def test_a_journal_with_records_after_its_queues_deletion_still_replays() -> None:
    """Journals written before the fix above hold such records: they are skipped, and counted."""
    journal = InMemoryJournal()
    journal.append("jobs", 1.0, [QueueCreated(QueueConfig(), "p-")])
    journal.append("jobs", 2.0, [QueueDeleted()])
    journal.append("jobs", 2.0, [Published("p-1", 1, b'"late"', False, None, None, 0, 2.0, None, None)])
    recovered = replay(journal.entries())
    assert recovered.queues == {} and recovered.strays == 1 and recovered.last_lsn == 3


async def test_copies_waiting_for_room_in_a_queue_deleted_meanwhile_go_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Moved messages that found the destination's inbox full wait for room; when the queue was deleted
    meanwhile they were sent to a queue made anew on demand, where recovery (and a ``Receive`` already
    in the inbox) has them go with the deleted one."""
    monkeypatch.setattr("broker.actor.INBOX_SIZE", 1)
    with trio.fail_after(5), structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            held = HeldNursery(nursery)
            registry = Registry(held, InMemoryJournal(), Clock())  # type: ignore[arg-type]
            await registry.create("dest", {}).wait()
            registry.forward("dest", [NewMessage(b'"first"')])  # fills its inbox (its actor is held)
            registry.forward("dest", [NewMessage(b'"second"')])  # waits for room
            await registry.delete("dest").wait()
            held.release()
            await trio.testing.wait_all_tasks_blocked()
            held.release()  # whatever that started
            await trio.testing.wait_all_tasks_blocked()
            assert "dest" not in registry.names()
            registry.stop_all()
    dropped = [entry["messages"] for entry in logs if entry["event"] == "moved_messages_deleted_with_queue"]
    assert sorted(dropped) == [1, 1]


def test_copies_on_their_way_to_a_queue_deleted_before_they_arrived_go_with_it() -> None:
    """Live, a ``Receive`` still in a deleted queue's inbox is dropped with it; recovery sent those copies
    again, to a queue it made anew (with the default config) where the broker that ran had none."""
    journal = InMemoryJournal()
    journal.append("jobs.dlq", 1.0, [QueueCreated(QueueConfig(dead_letter=None), "d-")])
    journal.append("retry", 1.0, [QueueCreated(QueueConfig(lease=77), "r-")])
    journal.append("jobs.dlq", 2.0, [Published("d-1", 1, b'"x"', False, None, None, 0, 2.0, None, None)])
    journal.append("jobs.dlq", 3.0, [Redriven("d-1", "retry")])
    journal.append("retry", 3.0, [QueueDeleted()])
    recovered = replay(journal.entries())
    assert sorted(recovered.queues) == ["jobs.dlq"] and recovered.unsent == []
    journal.append("jobs.dlq", 4.0, [Published("d-2", 2, b'"y"', False, None, None, 0, 4.0, None, None)])
    journal.append("jobs.dlq", 5.0, [Redriven("d-2", "retry")])  # after the delete: sent again at start
    assert [to for to, _ in replay(journal.entries()).unsent] == ["retry"]


async def test_queue_records_name_their_queue(registry: Registry, journal: InMemoryJournal) -> None:
    await make(registry, "a")
    await make(registry, "b")
    await registry.get("b").request(batch('"x"'))
    published: Sequence[tuple[str, Record]] = [
        (entry.queue, entry.record) for entry in journal.entries() if isinstance(entry.record, Published)
    ]
    assert [queue for queue, _ in published] == ["b"]


# -- moves between queues, claim windows and timed policies (issue 3) ---------------------------


async def test_a_rejected_nack_lands_in_the_dead_letter_queue_created_on_demand(
    registry: Registry, journal: InMemoryJournal
) -> None:
    actor = await make(registry)
    await actor.request(batch('"poison"'))
    [(claimed, _)] = (await actor.request(Claim("w"))).deliveries
    outcome = await actor.request(Nack([claimed.lease_id], retryable=False, reason="bad input"))
    assert (outcome.settled, outcome.dead_lettered) == (1, 1)
    await trio.testing.wait_all_tasks_blocked()
    assert "jobs.dlq" in registry
    dlq = registry.get("jobs.dlq")
    [(_, message)] = (await dlq.request(Claim("operator"))).deliveries
    assert message.payload == b'"poison"'
    assert message.headers == {
        "x-dead-letter-from": "jobs",
        "x-dead-letter-reason": "rejected",
        "x-dead-letter-attempts": "1",
        "x-original-id": claimed.id,
    }
    kinds = [(entry.queue, type(entry.record).__name__) for entry in journal.entries()]
    # The origin journals the move before the dead-letter queue journals its arrival.
    assert kinds.index(("jobs", "DeadLettered")) < kinds.index(("jobs.dlq", "Published"))
    assert ("jobs.dlq", "QueueCreated") in kinds


async def test_a_full_dead_letter_inbox_delays_the_move_but_loses_nothing(registry: Registry) -> None:
    actor = await make(registry, max_attempts=1)
    dlq = await make(registry, "jobs.dlq")
    await actor.request(Publish([NewMessage(b"1") for _ in range(5)]))
    leases = [claimed.lease_id for claimed, _ in (await actor.request(Claim("w", max_count=5))).deliveries]
    # Fill the dead-letter queue's inbox so that the move cannot be posted at once.
    while dlq.post_nowait(GetStats()):
        pass
    outcome = await actor.request(Nack(leases))
    assert outcome.dead_lettered == 5
    await trio.testing.wait_all_tasks_blocked()
    stats = await dlq.request(GetStats())
    assert stats.ready == 5


async def test_an_expired_lease_is_dead_lettered_at_its_deadline_without_any_request(
    registry: Registry, autojump_clock: Any
) -> None:
    actor = await make(registry, max_attempts=1, lease=5)
    await actor.request(batch('"slow"'))
    await actor.request(Claim("w"))
    await trio.sleep(5.5)  # virtual time: the actor wakes by itself at the lease deadline
    assert "jobs.dlq" in registry
    stats = await registry.get("jobs.dlq").request(GetStats())
    assert stats.ready == 1


async def test_a_message_ttl_moves_expired_messages_when_they_expire(
    registry: Registry, autojump_clock: Any
) -> None:
    actor = await make(registry, message_ttl=10)
    await actor.request(batch('"stale"'))
    await trio.sleep(9.9)
    assert "jobs.dlq" not in registry
    await trio.sleep(0.2)
    [(_, message)] = (await registry.get("jobs.dlq").request(Claim("w"))).deliveries
    assert message.headers is not None and message.headers["x-dead-letter-reason"] == "expired"
    assert (await actor.request(GetStats())).expired_total == 1


async def test_claims_within_the_window_share_the_ready_messages(
    registry: Registry, autojump_clock: Any
) -> None:
    actor = await make(registry, claim_window=0.05)
    await actor.request(Publish([NewMessage(str(i).encode()) for i in range(50)]))
    answers: list[int] = []
    started = trio.current_time()

    async def claimer() -> None:
        outcome = await actor.request(Claim("w", max_count=10))
        answers.append(len(outcome.deliveries))

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(claimer)
    assert sorted(answers) == [5] * 10
    assert trio.current_time() - started == pytest.approx(0.05)


async def test_a_claim_window_claim_that_finds_nothing_waits_then_is_served_by_a_publish(
    registry: Registry, autojump_clock: Any
) -> None:
    actor = await make(registry, claim_window=0.05)
    async with trio.open_nursery() as nursery:
        got: list[list[bytes]] = []

        async def claimer() -> None:
            got.append(payloads(await actor.request(Claim("w", max_count=2, wait=10))))

        nursery.start_soon(claimer)
        await trio.sleep(1)
        await actor.request(batch('"a"'))
    assert got == [[b'"a"']]


async def test_a_rate_limited_long_poll_is_served_when_the_window_frees(
    registry: Registry, autojump_clock: Any
) -> None:
    actor = await make(registry, rate_limit={"max": 2, "per": 1})
    await actor.request(batch('"a"', '"b"', '"c"'))
    first = await actor.request(Claim("w", max_count=3))
    assert len(first.deliveries) == 2 and first.retry_after == pytest.approx(1.0)
    started = trio.current_time()
    second = await actor.request(Claim("w", max_count=3, wait=5))
    assert payloads(second) == [b'"c"']
    assert trio.current_time() - started == pytest.approx(1.0, abs=0.01)


async def test_a_claim_whose_requester_left_while_it_sat_in_the_inbox_leases_nothing(
    journal: InMemoryJournal,
) -> None:
    actor = QueueActor(QueueCore("jobs", QueueConfig(), "m-"), journal, Clock())
    actor.core.apply(batch('"a"'), 0.0)
    # The actor task is not running yet: a claim can sit in its inbox while its requester gives up.
    async with trio.open_nursery() as nursery:
        requester = trio.CancelScope()

        async def claim() -> None:
            with requester:
                await actor.request(Claim("gone"))

        nursery.start_soon(claim)
        await trio.testing.wait_all_tasks_blocked()  # the claim is in the inbox, unanswered
        requester.cancel()
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(actor.run)
        stats = await actor.request(GetStats())
        assert (stats.ready, stats.in_flight) == (1, 0)
        actor.stop_nowait()


async def test_an_actor_made_during_a_request_does_not_log_with_that_requests_context(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = structlog.contextvars.bind_contextvars(request_id="the-request-that-made-it")
    try:
        await make(registry)  # a queue made on demand, as a request does
    finally:
        structlog.contextvars.reset_contextvars(**bound)
    actor = registry.get("jobs")

    def broken(command: Any, now: float) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(actor.core, "apply", broken)
    with (
        structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs,
        pytest.raises(BrokerError),
    ):
        await actor.request(GetStats())
    [line] = [line for line in logs if line["event"] == "queue_command_failed"]
    assert line["queue"] == "jobs" and "request_id" not in line


class TaskSteps(trio.abc.Instrument):
    """Counts the steps each task takes, by task name."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task.name] = self.steps.get(task.name, 0) + 1


async def test_stats_with_nothing_due_are_read_without_waking_the_actor(registry: Registry) -> None:
    """A pass over every queue (GET /metrics, GET /v1/queues) must not wake each actor: each wake
    leaves a new wait of ~20 objects in the collector's young generation (a million at 50,000 queues,
    walked by the next young collections while every request waited)."""
    actor = await make(registry, lease=30)
    await actor.request(batch('"a"', '"b"'))
    await actor.request(Claim("w", max_count=1))
    steps = TaskSteps()
    trio.lowlevel.add_instrument(steps)
    try:
        read = await actor.stats()
        await trio.testing.wait_all_tasks_blocked()
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert "queue:jobs" not in steps.steps
    asked = await actor.request(GetStats())
    assert read == dataclasses.replace(asked, oldest_ready_age=read.oldest_ready_age)  # a moment later
    assert (read.ready, read.in_flight, read.published_total) == (1, 1, 2)


async def test_stats_when_a_lease_expired_go_through_the_actor_which_journals_it(
    registry: Registry, journal: InMemoryJournal, autojump_clock: Any
) -> None:
    actor = await make(registry, lease=5)
    await actor.request(batch('"a"'))
    await actor.request(Claim("w"))
    await trio.sleep(6)  # a queue with no policy that needs time does not wake for an expired lease
    steps = TaskSteps()
    trio.lowlevel.add_instrument(steps)
    try:
        read = await actor.stats()
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert steps.steps.get("queue:jobs", 0) > 0
    assert (read.ready, read.in_flight, read.lease_expired_total) == (1, 0, 1)
    assert type(list(journal.entries())[-1].record) is LeaseExpired


async def test_stats_of_a_deleted_queue_are_not_found(registry: Registry) -> None:
    actor = await make(registry)
    await registry.delete("jobs").wait()
    with pytest.raises(QueueNotFound):
        await actor.stats()


async def test_each_with_stats_lists_the_wanted_queues_in_name_order_leaving_out_deleted_ones(
    registry: Registry,
) -> None:
    for name, count in (("d", 4), ("b", 2), ("a", 1), ("c", 3), ("e", 5)):
        actor = await make(registry, name)
        await actor.request(batch(*['"x"'] * count))
    seen = []
    async for actor, stats in registry.each_with_stats(lambda name: name != "c"):
        seen.append((actor.core.name, stats.ready))
        if actor.core.name == "a":
            await registry.delete("b").wait()  # deleted meanwhile
    assert seen == [("a", 1), ("d", 4), ("e", 5)]


async def test_each_with_stats_lets_other_tasks_run_during_a_long_pass(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stats read without waking actors take no checkpoint of their own: 50,000 queues would hold the
    event loop for the whole pass."""
    monkeypatch.setattr("broker.registry.STATS_PER_CHECKPOINT", 2)
    for name in "abcde":
        await make(registry, name)
    others_ran = []
    async with trio.open_nursery() as nursery:

        async def other() -> None:
            while True:
                others_ran.append(len(passed))
                await trio.lowlevel.checkpoint()

        passed: list[str] = []
        nursery.start_soon(other)
        async for actor, _ in registry.each_with_stats():
            passed.append(actor.core.name)
        nursery.cancel_scope.cancel()
    assert passed == list("abcde")
    assert any(0 < count < 5 for count in others_ran)  # it ran while the pass was under way


def awaiting(task: trio.lowlevel.Task) -> list[Any]:
    """The coroutines a waiting task is suspended in, outermost first (its receive's among them)."""
    chain, link = [], task.coro
    while link is not None:
        chain.append(link)
        link = getattr(link, "cr_await", None) or getattr(link, "gi_yieldfrom", None)
    return chain


async def test_after_start_up_every_queue_waits_for_commands_out_of_the_collectors_sight(
    journal: InMemoryJournal,
) -> None:
    """Each actor's first wait is made when its task first runs, after recovery froze the queues, and
    again when the config declares the queue. Left young, 50,000 queues' waits (a million objects) were
    walked by every collection, 0.3-0.4 s each while every request waited, until they grew old."""
    queues = {f"q{i}": QueueCore(f"q{i}", QueueConfig(), "") for i in range(50)}
    async with trio.open_nursery() as nursery:
        registry = Registry(nursery, journal, Clock())
        registry.adopt(Recovered(queues=queues))
        await registry.put("q3", {"lease": 60})  # as a start does for the queues its config declares
        await registry.freeze_when_waiting()
        await trio.testing.wait_all_tasks_blocked()  # every actor waits for commands
        actor_tasks = [task for task in nursery.child_tasks if task.name.startswith("queue:")]
        assert len(actor_tasks) == 50
        tracked = {id(thing) for thing in gc.get_objects()}  # every generation but the frozen one
        young = [task.name for task in actor_tasks if any(id(link) in tracked for link in awaiting(task))]
        assert not young
        actor = registry.get("q7")
        await actor.request(batch('"a"'))  # a queue that takes a command makes a new wait, and lives on
        assert (await actor.stats()).ready == 1
        registry.stop_all()
