"""The core's lookups for the compatibility surfaces (docs/compat.md): the lease of a message's latest
delivery, which settles it while it holds it (``find_leases``), the lease of one attempt's delivery
(``find_delivery``), and one origin's dead letters (``browse_dead_letters``, ``find_dead_letters``).
Plain asserts, explicit ``now``, no event loop."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core import FinishedHistory, NewMessage, QueueConfig, QueueCore, State, commands
from broker.core.model import DeadLetterLookup, DeadLetterPage, DeliveryLookup
from broker.core.queue import DEAD_LETTER_FROM, ORIGINAL_ID
from broker.core.records import DeadLettered, LeaseExpired
from broker.errors import MessageNotFound
from tests.core.test_queue import claim, claim_one, make_queue, new, publish


def settles(queue: QueueCore, lease_id: str, now: float) -> bool:
    """Whether ``lease_id`` settles its message at ``now`` (tried with a nack without delay)."""
    outcome, _ = queue.nack([lease_id], 0.0, None, now)
    return outcome.settled == 1


# -- find_leases: the lease of each message's latest delivery, and whether it settles -------------------


def test_a_message_in_flight_is_settled_by_its_live_lease() -> None:
    queue = make_queue(lease=10.0)
    first, second = publish(queue, new("a"), new("b"))
    leases = dict(claim(queue, 2, now=0.0))
    answer, records = queue.find_leases([second, first], now=1.0)
    assert (answer, records) == ({second: leases[second], first: leases[first]}, [])
    assert list(answer) == [second, first]  # in the order asked
    assert queue.ack([leases[first]], now=1.0)[0].settled == 1


def test_ids_never_delivered_unknown_or_repeated() -> None:
    queue = make_queue()
    waiting, delayed = publish(queue, new("a"), new("b", delay=5.0))
    [(taken, lease)] = claim(queue, 1, now=0.0)
    assert taken == waiting
    answer, records = queue.find_leases([delayed, "m-nowhere", taken, taken, delayed], now=1.0)
    assert (answer, records) == ({taken: lease}, [])
    assert list(answer) == [taken]


def test_a_lease_that_ran_out_unnoticed_is_noticed_and_still_settles() -> None:
    """The lookup notices what came due, as ``get`` does, and answers the records to journal: the
    message is ready again, and its lease settles it until it is delivered again (§5)."""
    queue = make_queue(lease=10.0)
    [message_id] = publish(queue, new())
    lease = claim_one(queue, now=0.0)
    answer, records = queue.find_leases([message_id], now=15.0)
    assert (answer, records) == ({message_id: lease}, [LeaseExpired(message_id, lease)])
    assert queue.get(message_id, 15.0)[0].state is State.READY
    assert queue.ack([lease], now=16.0)[0].settled == 1


def test_an_expiry_that_used_the_last_attempt_answers_the_lease_that_settles_nothing() -> None:
    queue = make_queue(lease=10.0, max_attempts=1)
    [message_id] = publish(queue, new())
    lease = claim_one(queue, now=0.0)
    answer, records = queue.find_leases([message_id], now=15.0)
    assert answer == {message_id: lease}
    assert [type(record) for record in records] == [LeaseExpired, DeadLettered]
    assert queue.ack([lease], now=15.0)[0].skipped == (lease,)


def test_a_message_delivered_again_is_settled_by_the_new_lease_not_the_old() -> None:
    queue = make_queue(lease=10.0)
    [message_id] = publish(queue, new())
    old = claim_one(queue, now=0.0)
    new_lease = claim_one(queue, now=20.0)  # the claim notices the expiry and delivers it again
    assert new_lease != old
    assert queue.find_leases([message_id], now=21.0) == ({message_id: new_lease}, [])
    assert queue.ack([old], now=21.0)[0].skipped == (old,)
    assert queue.ack([new_lease], now=21.0)[0].settled == 1


def test_a_settled_delivery_is_answered_and_skipped_by_the_settle_call() -> None:
    """Nacked (back in the queue) or acked (finished and remembered for get-one): the lease of its latest
    delivery is answered still, which a settle call skips (so qhook's ``acked: 0`` waits on a durable
    queue for the records that settled it, as a native ack of a settled lease does)."""
    queue = make_queue(lease=10.0)
    nacked, acked = publish(queue, new("a"), new("b"))
    leases = dict(claim(queue, 2, now=0.0))
    queue.nack([leases[nacked]], 5.0, None, now=1.0)
    queue.ack([leases[acked]], now=1.0)
    answer, records = queue.find_leases([nacked, acked], now=2.0)
    assert (answer, records) == ({nacked: leases[nacked], acked: leases[acked]}, [])
    assert queue.get(acked, 2.0)[0].state is State.ACKED
    outcome, records = queue.ack(list(answer.values()), now=2.0)
    assert (outcome.settled, records) == (0, [])


def test_a_replace_takes_the_lease_away_but_the_latest_delivery_is_still_answered() -> None:
    queue = make_queue(lease=10.0)
    [message_id] = publish(queue, new("a", key="k"))
    lease = claim_one(queue, now=0.0)
    queue.stats(11.0)  # the expiry is noticed: the lease still settles …
    queue.publish([new("b", key="k", replace=True)], now=12.0)  # … until a replace takes it away
    assert queue.find_leases([message_id], now=12.0) == ({message_id: lease}, [])
    assert not settles(queue, lease, 12.0)


def test_finished_messages_are_answered_while_remembered_payload_or_not() -> None:
    queue = make_queue(history=FinishedHistory(count=2, payload_bytes=0))
    ids = publish(queue, new("a"), new("b"), new("c"))
    leases = dict(claim(queue, 3, now=0.0))
    queue.ack([leases[message_id] for message_id in ids], now=1.0)
    # the first is forgotten (count 2), the others are kept bare (their payloads let go)
    assert queue.get(ids[2], 1.0)[0].payload is None
    assert queue.find_leases(ids, now=2.0) == ({ids[1]: leases[ids[1]], ids[2]: leases[ids[2]]}, [])


def test_a_deleted_or_purged_message_is_not_answered() -> None:
    queue = make_queue(lease=10.0)
    deleted, purged = publish(queue, new("a"), new("b"))
    claim(queue, 2, now=0.0)
    queue.delete(deleted, 1.0)
    queue.stats(11.0)
    queue.purge(11.0)
    assert queue.find_leases([deleted, purged], now=12.0) == ({}, [])


def test_a_restored_queue_answers_the_same_leases() -> None:
    """Leases are journaled, so a late ack by message id still lands after a restart."""
    live = make_queue(lease=10.0)
    journal: list[tuple[float, Any]] = []

    def run(command: commands.Command, now: float) -> Any:
        answer, records = live.apply(command, now)
        journal.extend((now, record) for record in records)
        return answer

    refs = run(commands.Publish([new(str(n)) for n in range(4)]), 0.0)
    ids = [message_id for message_id, _, _ in refs]
    outcome = run(commands.Claim("w", 3), 0.0)
    leases = [record.lease_id for record, _ in outcome.deliveries]
    run(commands.Ack(leases[:1]), 1.0)
    run(commands.Nack(leases[1:2], 0.0), 1.0)
    run(commands.GetStats(), 20.0)  # the third's lease ran out
    restored = make_queue(lease=10.0)
    for at, record in journal:
        restored.restore(record, at)
    assert restored.find_leases(ids, 21.0) == live.find_leases(ids, 21.0)
    assert live.find_leases(ids, 21.0)[0] == dict(zip(ids[:3], leases, strict=True))


# -- find_delivery: the lease of the delivery of one attempt to one consumer ------------------------


def test_each_attempt_of_a_consumer_is_found_by_its_latest_delivery() -> None:
    queue = make_queue(lease=10.0)
    [message_id] = publish(queue, new())
    first = queue.claim("push", 1, None, 0.0)[0].deliveries[0][0].lease_id
    queue.nack([first], 0.0, None, 1.0)
    second = queue.claim("push", 1, None, 2.0)[0].deliveries[0][0].lease_id
    queue.defer([second], 0.0, None, 3.0)  # spends no attempt: the next delivery is attempt 2 again
    third = queue.claim("push", 1, None, 4.0)[0].deliveries[0][0].lease_id
    assert len({first, second, third}) == 3

    def found(consumer: str, attempt: int) -> DeliveryLookup:
        lookup, records = queue.find_delivery(message_id, consumer, attempt, 5.0)
        assert records == []
        return lookup

    assert found("push", 1) == DeliveryLookup(first, 2)
    assert found("push", 2) == DeliveryLookup(third, 2)
    assert found("push", 3) == DeliveryLookup(None, 2)
    assert found("w", 1) == DeliveryLookup(None, 2)


def test_a_delivery_is_found_after_the_message_finished_and_after_an_expiry_it_notices() -> None:
    queue = make_queue(lease=10.0, max_attempts=1)
    acked, expired, never = publish(queue, new("a"), new("b"), new("c", delay=100.0))
    leases = {record.id: record.lease_id for record, _ in queue.claim("push", 2, None, 0.0)[0].deliveries}
    queue.ack([leases[acked]], 1.0)
    assert queue.find_delivery(acked, "push", 1, 2.0) == (DeliveryLookup(leases[acked], 1), [])
    lookup, records = queue.find_delivery(expired, "push", 1, 15.0)
    assert lookup == DeliveryLookup(leases[expired], 1)
    assert [type(record) for record in records] == [LeaseExpired, DeadLettered]
    assert queue.find_delivery(never, "push", 1, 16.0) == (DeliveryLookup(None, 0), [])


def test_an_unknown_message_is_not_found_and_what_the_lookup_noticed_is_kept() -> None:
    queue = make_queue(lease=10.0)
    [message_id] = publish(queue, new())
    lease = claim_one(queue, now=0.0)
    with pytest.raises(MessageNotFound):
        queue.find_delivery("m-nowhere", "push", 1, 15.0)
    assert queue.take_noticed() == [LeaseExpired(message_id, lease)]


# -- dead letters: one origin's, by page and by id ----------------------------------------------------


def dead_letter_queue(*headers: dict[str, str] | None) -> tuple[QueueCore, list[str]]:
    """A dead-letter queue holding a message with each of ``headers``, in order, and their ids."""
    dlq = QueueCore("jobs.dlq", QueueConfig(lease=10.0), "d-")
    messages = [NewMessage(f'"{n}"'.encode(), headers=given) for n, given in enumerate(headers)]
    refs, _ = dlq.publish(messages, 0.0, moved=True)
    return dlq, [message_id for message_id, _, _ in refs]


def dead(origin: str, original: str) -> dict[str, str]:
    return {DEAD_LETTER_FROM: origin, ORIGINAL_ID: original}


def old_dlq_page(dlq: QueueCore, origin: str, limit: int, after: int, now: float) -> DeadLetterPage:
    """What the SimpleQ surface computed from a native browse before the core did it."""
    views, _ = dlq.browse(None, limit + 1, after, now)
    page = views[:limit]
    mine = [view for view in page if (view.headers or {}).get(DEAD_LETTER_FROM) == origin]
    return DeadLetterPage(mine, page[-1].seq if len(views) > limit else 0)


def test_a_page_looks_at_limit_messages_and_shows_those_from_the_origin() -> None:
    dlq, ids = dead_letter_queue(
        dead("jobs", "m-1"), None, dead("other", "o-1"), None, dead("jobs", "m-2"), {DEAD_LETTER_FROM: "jobs"}
    )
    page, records = dlq.browse_dead_letters("jobs", 2, 0, 1.0)
    assert records == []
    assert ([view.id for view in page.views], page.after) == ([ids[0]], 2)
    page, _ = dlq.browse_dead_letters("jobs", 2, page.after, 1.0)
    assert ([view.id for view in page.views], page.after) == ([], 4)  # a page may show none
    page, _ = dlq.browse_dead_letters("jobs", 2, page.after, 1.0)
    assert ([view.id for view in page.views], page.after) == ([ids[4], ids[5]], 0)  # exactly full: last
    every, _ = dlq.browse_dead_letters("jobs", 7, 0, 1.0)
    assert ([view.id for view in every.views], every.after) == ([ids[0], ids[4], ids[5]], 0)
    assert every.views == [dlq.get(ids[n], 1.0)[0] for n in (0, 4, 5)]  # the views get-one shows
    assert dlq.browse_dead_letters("nobody", 100, 0, 1.0)[0] == DeadLetterPage([], 0)


def test_pages_are_the_ones_the_surface_computed_from_a_browse() -> None:
    dlq, _ = dead_letter_queue(
        *[dead("jobs" if n % 3 else "other", f"m-{n}") if n % 4 else None for n in range(11)]
    )
    claim(dlq, 2, now=0.0)  # entries in flight are shown too (a native consumer took them)
    dlq.delete(dlq.message_ids()[5], 0.0)  # and a gap in the seqs
    for origin in ("jobs", "other", "nobody"):
        for limit in range(1, 13):
            for after in range(13):
                assert dlq.browse_dead_letters(origin, limit, after, 1.0)[0] == old_dlq_page(
                    dlq, origin, limit, after, 1.0
                ), (origin, limit, after)


def test_a_page_notices_what_came_due_as_a_browse_does() -> None:
    dlq, ids = dead_letter_queue(dead("jobs", "m-1"))
    lease = claim_one(dlq, now=0.0)
    page, records = dlq.browse_dead_letters("jobs", 10, 0, 11.0)
    assert records == [LeaseExpired(ids[0], lease)]
    assert [(view.id, view.state) for view in page.views] == [(ids[0], State.READY)]


def test_dead_letters_are_found_by_their_own_id_or_the_id_they_had() -> None:
    dlq, ids = dead_letter_queue(
        dead("jobs", "m-1"), dead("other", "m-2"), dead("jobs", "m-3"), None, dead("jobs", "m-1")
    )
    lookup, records = dlq.find_dead_letters(
        "jobs", ["m-3", ids[0], "m-1", "m-2", ids[1], ids[3], "m-9", "m-3"], 1.0
    )
    assert records == []
    # in the order found (seq order), each id mapped to the first that matches it
    assert list(lookup.entries.items()) == [(ids[0], ids[0]), ("m-1", ids[0]), ("m-3", ids[2])]
    assert lookup.redriven == ()
    assert dlq.find_dead_letters("jobs", [], 1.0) == (DeadLetterLookup({}, ()), [])


def test_ids_of_dead_letters_redriven_are_told_apart_from_unknown_ones() -> None:
    dlq, ids = dead_letter_queue(dead("jobs", "m-1"), dead("jobs", "m-2"))
    outcome, _ = dlq.redrive([ids[0]], None, {"jobs"}, 1.0)
    assert outcome.redriven == 1
    lookup, _ = dlq.find_dead_letters("jobs", [ids[0], "m-1", ids[1], "d-nowhere"], 2.0)
    # by the entry's id, it was retried; by the job's id there is no entry (as there never was)
    assert (dict(lookup.entries), lookup.redriven) == ({ids[1]: ids[1]}, (ids[0],))


def test_a_redriven_entry_forgotten_is_unknown() -> None:
    dlq = QueueCore("jobs.dlq", QueueConfig(), "d-", history=FinishedHistory(count=1))
    refs, _ = dlq.publish([NewMessage(b"1", headers=dead("jobs", f"m-{n}")) for n in range(2)], 0.0)
    ids = [message_id for message_id, _, _ in refs]
    dlq.redrive(ids, None, {"jobs"}, 1.0)
    assert dlq.find_dead_letters("jobs", ids, 2.0)[0] == DeadLetterLookup({}, (ids[1],))


def test_a_lookup_notices_what_came_due_and_an_entry_dead_lettered_again_leaves() -> None:
    dlq = QueueCore("jobs.dlq", QueueConfig(lease=10.0, max_attempts=1, dead_letter=None), "d-")
    refs, _ = dlq.publish([NewMessage(b"1", headers=dead("jobs", "m-1"))], 0.0, moved=True)
    [(entry, _, _)] = refs
    lease = claim_one(dlq, now=0.0)
    lookup, records = dlq.find_dead_letters("jobs", [entry, "m-1"], 11.0)
    assert [type(record) for record in records] == [LeaseExpired, DeadLettered]
    assert records[0] == LeaseExpired(entry, lease)
    assert lookup == DeadLetterLookup({}, ())


# -- the commands -------------------------------------------------------------------------------------


def test_the_lookups_are_commands_that_journal_nothing_of_their_own_and_are_not_durable() -> None:
    by_command, by_method = make_queue(lease=10.0), make_queue(lease=10.0)
    for queue in (by_command, by_method):
        publish(queue, new("a"), new("b", headers=dead("jobs", "m-1")))
        claim(queue, 1, now=0.0)
    ids = by_method.message_ids()
    steps: list[tuple[commands.Command, Any]] = [
        (commands.FindLeases([ids[0], ids[1]]), lambda q: q.find_leases([ids[0], ids[1]], 20.0)),
        (commands.FindDelivery(ids[0], "worker", 1), lambda q: q.find_delivery(ids[0], "worker", 1, 20.0)),
        (commands.BrowseDeadLetters("jobs", 5, 0), lambda q: q.browse_dead_letters("jobs", 5, 0, 20.0)),
        (commands.FindDeadLetters("jobs", ["m-1"]), lambda q: q.find_dead_letters("jobs", ["m-1"], 20.0)),
    ]
    for index, (command, method) in enumerate(steps):
        answer, expected = by_command.apply(command, 20.0), method(by_method)
        assert answer == expected, command
        # the first notices the lease that ran out at 10.0, and only what came due: nothing after
        assert answer[1] == ([LeaseExpired(ids[0], f"{ids[0]}.1")] if index == 0 else []), command
    assert {
        commands.FindLeases,
        commands.FindDelivery,
        commands.BrowseDeadLetters,
        commands.FindDeadLetters,
    }.isdisjoint(commands.DURABLE_COMMANDS)
