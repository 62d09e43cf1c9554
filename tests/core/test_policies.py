"""Unit tests of the queue policies of ``QueueCore`` (§3, §5, §6): max_attempts and dead letters,
moved messages and redrive, retry_backoff, on_duplicate "replace", message_ttl, max_depth, rate_limit
and claim-window cohorts. Every call takes an explicit ``now``; plain asserts, no event loop.

A dead-letter queue is just another ``QueueCore``: these tests carry the outbox across by hand, as the
actor and registry do (``publish(..., moved=True)``, the ``Receive`` command).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.core import (
    ClaimOutcome,
    FinishedHistory,
    NewMessage,
    QueueConfig,
    QueueCore,
    RetryBackoff,
    State,
    check_queue_name,
    commands,
)
from broker.core.model import CONFLICT, CREATED, DUPLICATE, REPLACED
from broker.core.queue import divide_fairly
from broker.core.records import (
    Acked,
    Claimed,
    DeadLettered,
    Expired,
    LeaseExpired,
    Nacked,
    Published,
    QueueUpdated,
    Redriven,
    Released,
    Replaced,
)
from broker.errors import InvalidRequest, MessageNotFound, QueueFull
from tests.core.test_queue import claim, claim_one, history_types, make_queue, new, publish, state_of

# -- helpers -------------------------------------------------------------------------------------

Transfer = tuple[str, NewMessage]


def dead_copy(
    message: NewMessage, message_id: str, reason: str, attempts: int, *, queue: str = "jobs"
) -> NewMessage:
    """What ``message``, published as ``message_id`` in ``queue``, becomes in its dead-letter queue."""
    headers = {
        **(message.headers or {}),
        "x-dead-letter-from": queue,
        "x-dead-letter-reason": reason,
        "x-dead-letter-attempts": str(attempts),
        "x-original-id": message_id,
    }
    return NewMessage(
        message.payload,
        message.binary,
        headers,
        message.key,
        0.0,
        message.priority,
        origin=(queue, message_id),
    )


def nack_until_dead(queue: QueueCore, times: int, now: float = 0.0) -> list[Any]:
    """Claim and nack the one ready message ``times`` times; the records of the last nack."""
    records: list[Any] = []
    for _ in range(times):
        _, records = queue.nack([claim_one(queue, now=now)], None, None, now)
    return records


def receive(queue: QueueCore, transfers: list[Transfer], now: float, to: str | None = None) -> list[str]:
    """Hand messages that left another queue to ``queue`` as the registry does; their new ids."""
    assert all(name == (to or queue.name) for name, _ in transfers)
    refs, _ = queue.apply(commands.Receive([message for _, message in transfers]), now)
    assert all(outcome == CREATED for _, _, outcome in refs)
    return [message_id for message_id, _, _ in refs]


def dead_letter_queue() -> QueueCore:
    return QueueCore("jobs.dlq", QueueConfig(), "d-")


def dead_lettered(payloads: list[str], now: float = 0.0) -> tuple[QueueCore, QueueCore]:
    """An origin queue ``jobs`` and its dead-letter queue holding one rejected message per payload."""
    origin, dlq = make_queue(), dead_letter_queue()
    publish(origin, *(new(payload) for payload in payloads), now=now)
    leases = [lease_id for _, lease_id in claim(origin, len(payloads), now=now)]
    origin.nack(leases, None, "bad", now, retryable=False)
    receive(dlq, origin.take_outbox(), now)
    return origin, dlq


def payloads_of(queue: QueueCore, now: float) -> list[bytes]:
    views, _ = queue.browse(None, 1000, 0, now)
    return [view.payload for view in views]


def totals(queue: QueueCore, now: float) -> tuple[int, int, int, int, int]:
    """``(ready, delayed, in_flight, dead_lettered_total, expired_total)`` after noticing what is due."""
    snapshot, _ = queue.stats(now)
    return (
        snapshot.ready,
        snapshot.delayed,
        snapshot.in_flight,
        snapshot.dead_lettered_total,
        snapshot.expired_total,
    )


def reason_of(queue: QueueCore) -> str:
    """The ``x-dead-letter-reason`` of the one message in the queue's outbox."""
    [(_, copy)] = queue.take_outbox()
    assert copy.headers is not None
    return copy.headers["x-dead-letter-reason"]


def delivered_ids(outcome: ClaimOutcome) -> list[str]:
    return [record.id for record, _ in outcome.deliveries]


def cohort(queue: QueueCore, maxes: list[int], now: float) -> list[list[str]]:
    """Serve one cohort of claims ``c0, c1, …``, one per max; the message ids each got, in order."""
    claims = [commands.Claim(f"c{index}", count) for index, count in enumerate(maxes)]
    outcomes, records = queue.claim_cohort(claims, now)
    dealt = [record for outcome in outcomes for record, _ in outcome.deliveries]
    assert [record for record in records if isinstance(record, Claimed)] == dealt
    for index, outcome in enumerate(outcomes):
        assert all(record.consumer == f"c{index}" for record, _ in outcome.deliveries)
        assert outcome.ready == queue.ready_count
    return [delivered_ids(outcome) for outcome in outcomes]


# -- max_attempts and dead letters ---------------------------------------------------------------


def test_the_nack_that_uses_the_last_attempt_dead_letters_the_message() -> None:
    queue = make_queue(max_attempts=2)
    message = NewMessage(b'{"n":1}', headers={"h": "v"}, key="k", priority=4)
    [message_id] = publish(queue, message, now=0.0)
    first = claim_one(queue, now=1.0)
    outcome, records = queue.nack([first], None, "boom", now=2.0)
    assert (outcome.settled, outcome.dead_lettered) == (1, 0)
    assert records == [Nacked(message_id, first, 0.0, "boom")]
    assert queue.take_outbox() == []
    second = claim_one(queue, now=3.0)
    outcome, records = queue.nack([second], 5.0, "boom", now=4.0)
    assert (outcome.settled, outcome.dead_lettered, outcome.skipped) == (1, 1, ())
    assert records == [
        Nacked(message_id, second, 5.0, "boom"),
        DeadLettered(message_id, second, "max_attempts", 2, "jobs.dlq"),
    ]
    assert queue.take_outbox() == [("jobs.dlq", dead_copy(message, message_id, "max_attempts", 2))]
    assert queue.take_outbox() == []
    assert queue.depth == 0
    assert totals(queue, 5.0) == (0, 0, 0, 1, 0)
    assert state_of(queue, message_id, 5.0) is State.DEAD_LETTERED
    assert history_types(queue, message_id, 5.0) == [
        "published",
        "claimed",
        "nacked",
        "claimed",
        "nacked",
        "dead_lettered",
    ]


def test_the_dead_letter_copy_keeps_a_binary_payload_key_and_priority() -> None:
    queue = make_queue(max_attempts=1)
    message = NewMessage(b"\x00\xff", binary=True, key="k", priority=-3)
    [message_id] = publish(queue, message)
    nack_until_dead(queue, 1)
    [(to, copy)] = queue.outbox
    assert (to, copy) == ("jobs.dlq", dead_copy(message, message_id, "max_attempts", 1))
    assert (copy.payload, copy.binary, copy.key, copy.priority) == (b"\x00\xff", True, "k", -3)


def test_max_attempts_zero_means_unlimited() -> None:
    queue = make_queue(max_attempts=0)
    [message_id] = publish(queue, new())
    records = nack_until_dead(queue, 50)
    assert [type(record) for record in records] == [Nacked]
    assert queue.take_outbox() == []
    view, _ = queue.get(message_id, 0.0)
    assert (view.state, view.attempt) == (State.READY, 50)


def test_nacks_before_the_last_attempt_return_the_message() -> None:
    queue = make_queue(max_attempts=3)
    [message_id] = publish(queue, new())
    for attempt in (1, 2):
        outcome, _ = queue.claim("w", 1, None, now=0.0)
        assert outcome.deliveries[0][0].attempt == attempt
        assert queue.nack([outcome.deliveries[0][0].lease_id], None, None, 0.0)[0].dead_lettered == 0
    outcome, _ = queue.claim("w", 1, None, now=0.0)
    assert outcome.deliveries[0][0].attempt == 3
    assert queue.nack([outcome.deliveries[0][0].lease_id], None, None, 0.0)[0].dead_lettered == 1
    assert state_of(queue, message_id, 0.0) is State.DEAD_LETTERED


def test_an_expired_lease_of_the_last_attempt_dead_letters_when_a_claim_notices_it() -> None:
    queue = make_queue(max_attempts=1, lease=10.0)
    [message_id, other] = publish(queue, new("a"), new("b"), now=0.0)
    lease = claim_one(queue, now=0.0)
    outcome, records = queue.claim("w", 5, None, now=10.0)
    assert delivered_ids(outcome) == [other]
    assert records[:2] == [
        LeaseExpired(message_id, lease),
        DeadLettered(message_id, lease, "max_attempts", 1, "jobs.dlq"),
    ]
    assert isinstance(records[2], Claimed)
    assert queue.take_outbox() == [("jobs.dlq", dead_copy(new("a"), message_id, "max_attempts", 1))]
    assert history_types(queue, message_id, 10.0) == [
        "published",
        "claimed",
        "lease_expired",
        "dead_lettered",
    ]


def test_a_lease_that_runs_out_before_its_delivery_left_the_broker_is_released_with_a_refund() -> None:
    """``undelivered`` (a push stream had not written it): no consumer saw the delivery, so even on its
    last attempt the message comes back first in line, its attempt refunded, rather than dead-lettered."""
    queue = make_queue(max_attempts=1, lease=10.0)
    [unsent, sent] = publish(queue, new("a"), new("b"), now=0.0)
    [(_, unsent_lease), (_, sent_lease)] = claim(queue, 2, now=0.0)
    queue.undelivered = lambda message_id, lease_id: (message_id, lease_id) == (unsent, unsent_lease)
    outcome, records = queue.claim("w", 5, None, now=10.0)
    assert records[:3] == [
        Released(unsent, unsent_lease, True),
        LeaseExpired(sent, sent_lease),
        DeadLettered(sent, sent_lease, "max_attempts", 1, "jobs.dlq"),
    ]
    assert [(claimed.id, claimed.attempt) for claimed, _ in outcome.deliveries] == [(unsent, 1)]
    assert history_types(queue, unsent, 10.0) == ["published", "claimed", "released", "claimed"]
    assert queue.ack([unsent_lease], 10.0)[0].skipped == (unsent_lease,), "its old lease is gone"


NOTICERS: dict[str, Callable[[QueueCore, float], list[Any]]] = {
    "stats": lambda queue, now: queue.stats(now)[1],
    "browse": lambda queue, now: queue.browse(None, 100, 0, now)[1],
    "get": lambda queue, now: queue.get("m-2", now)[1],
    "claim": lambda queue, now: queue.claim("w", 0, None, now)[1],
    "redrive": lambda queue, now: queue.redrive([], None, frozenset(), now)[1],
}


@pytest.mark.parametrize("noticer", list(NOTICERS))
def test_an_expired_lease_of_the_last_attempt_is_dead_lettered_by_any_read_without_a_claim(
    noticer: str,
) -> None:
    queue = make_queue(max_attempts=2, lease=10.0)
    [message_id, _] = publish(queue, new("a"), new("b"), now=0.0)
    queue.nack([claim_one(queue, now=0.0)], None, None, now=1.0)
    lease = claim_one(queue, now=2.0)
    assert NOTICERS[noticer](queue, 11.999) == []
    assert queue.next_due() == 12.0
    records = NOTICERS[noticer](queue, 12.0)
    assert records == [
        LeaseExpired(message_id, lease),
        DeadLettered(message_id, lease, "max_attempts", 2, "jobs.dlq"),
    ]
    assert queue.take_outbox() == [("jobs.dlq", dead_copy(new("a"), message_id, "max_attempts", 2))]
    snapshot, _ = queue.stats(12.0)
    assert (snapshot.ready, snapshot.in_flight, snapshot.dead_lettered_total) == (1, 0, 1)
    assert snapshot.lease_expired_total == 1
    assert queue.next_due() is None


def test_a_late_settle_of_a_dead_lettered_message_is_skipped() -> None:
    queue = make_queue(max_attempts=1, lease=10.0)
    [message_id] = publish(queue, new())
    lease = claim_one(queue, now=0.0)
    queue.stats(10.0)
    for settle in (
        lambda: queue.ack([lease], 11.0),
        lambda: queue.nack([lease], None, None, 11.0),
        lambda: queue.nack([lease], None, None, 11.0, retryable=False),
        lambda: queue.defer([lease], 0.0, None, 11.0),
        lambda: queue.extend([lease], 30.0, 11.0),
        lambda: queue.release([lease], True, 11.0),
    ):
        outcome, records = settle()
        assert (outcome.settled, outcome.skipped, records) == (0, (lease,), [])
    assert state_of(queue, message_id, 12.0) is State.DEAD_LETTERED
    assert len(queue.take_outbox()) == 1


def test_an_expired_lease_of_the_last_attempt_still_acks_until_noticed() -> None:
    queue = make_queue(max_attempts=1, lease=10.0)
    [message_id] = publish(queue, new())
    lease = claim_one(queue, now=0.0)
    outcome, records = queue.ack([lease], now=15.0)
    assert (outcome.settled, records) == (1, [Acked(message_id, lease)])
    assert queue.stats(20.0)[1] == []
    assert queue.take_outbox() == []


def test_defers_never_spend_attempts_and_never_dead_letter() -> None:
    queue = make_queue(max_attempts=1)
    [message_id] = publish(queue, new())
    for _ in range(5):
        outcome, _ = queue.claim("w", 1, None, now=0.0)
        [(record, _)] = outcome.deliveries
        assert record.attempt == 1
        settled, records = queue.defer([record.lease_id], 0.0, "busy", 0.0)
        assert (settled.settled, settled.dead_lettered, len(records)) == (1, 0, 1)
    view, _ = queue.get(message_id, 0.0)
    assert (view.state, view.attempt) == (State.READY, 0)
    assert queue.take_outbox() == []
    records = nack_until_dead(queue, 1)
    assert records[-1] == DeadLettered(message_id, f"{message_id}.6", "max_attempts", 1, "jobs.dlq")


def test_attempts_count_deliveries_minus_refunded_defers() -> None:
    queue = make_queue(max_attempts=3)
    [message_id] = publish(queue, new())
    queue.nack([claim_one(queue)], None, None, 0.0)  # attempt 1, spent
    queue.defer([claim_one(queue)], 0.0, None, 0.0)  # attempt 2, refunded
    queue.release([claim_one(queue)], True, 0.0)  # attempt 2, refunded (never reached a consumer)
    queue.nack([claim_one(queue)], None, None, 0.0)  # attempt 2, spent
    outcome, _ = queue.claim("w", 1, None, now=0.0)
    [(record, _)] = outcome.deliveries
    assert record.attempt == 3
    queue.defer([record.lease_id], 0.0, None, 0.0)  # the last attempt, refunded
    lease = claim_one(queue)
    _, records = queue.nack([lease], None, None, 0.0)
    assert records[-1] == DeadLettered(message_id, lease, "max_attempts", 3, "jobs.dlq")
    [(_, copy)] = queue.take_outbox()
    assert copy.headers is not None and copy.headers["x-dead-letter-attempts"] == "3"


def test_a_defer_through_an_unnoticed_expired_lease_of_the_last_attempt_refunds_it() -> None:
    queue = make_queue(max_attempts=1, lease=10.0)
    [message_id] = publish(queue, new())
    lease = claim_one(queue, now=0.0)
    outcome, _ = queue.defer([lease], 0.0, None, now=20.0)
    assert (outcome.settled, outcome.dead_lettered) == (1, 0)
    view, _ = queue.get(message_id, 20.0)
    assert (view.state, view.attempt) == (State.READY, 0)
    assert queue.take_outbox() == []


def test_a_release_of_the_last_attempt_dead_letters_unless_the_attempt_is_refunded() -> None:
    queue = make_queue(max_attempts=1)
    [kept, dead] = publish(queue, new("kept"), new("dead"))
    refunded, spent = claim_one(queue), claim_one(queue)
    outcome, records = queue.release([refunded, spent], True, 1.0)
    assert (outcome.settled, outcome.dead_lettered) == (2, 0)
    [kept_lease, dead_lease] = [lease for _, lease in claim(queue, 2, now=2.0)]
    outcome, records = queue.release([dead_lease], False, 3.0)
    assert outcome.dead_lettered == 1
    assert records == [
        Released(dead, dead_lease, False),
        DeadLettered(dead, dead_lease, "max_attempts", 1, "jobs.dlq"),
    ]
    assert state_of(queue, kept, 3.0) is State.IN_FLIGHT
    assert queue.ack([kept_lease], 3.0)[0].settled == 1


def test_a_nack_that_is_not_retryable_dead_letters_at_once_as_rejected() -> None:
    queue = make_queue(max_attempts=0, retry_backoff=RetryBackoff("fixed", 7.0))
    [message_id, other] = publish(queue, new("a"), new("b"))
    [(_, lease), (_, other_lease)] = claim(queue, 2)
    outcome, records = queue.nack([lease, "never-issued", other_lease], None, "poison", 1.0, retryable=False)
    assert (outcome.settled, outcome.dead_lettered, outcome.skipped) == (2, 2, ("never-issued",))
    assert records == [
        Nacked(message_id, lease, 7.0, "poison"),
        DeadLettered(message_id, lease, "rejected", 1, "jobs.dlq"),
        Nacked(other, other_lease, 7.0, "poison"),
        DeadLettered(other, other_lease, "rejected", 1, "jobs.dlq"),
    ]
    assert queue.take_outbox() == [
        ("jobs.dlq", dead_copy(new("a"), message_id, "rejected", 1)),
        ("jobs.dlq", dead_copy(new("b"), other, "rejected", 1)),
    ]
    snapshot, _ = queue.stats(1.0)
    assert (snapshot.nacked_total, snapshot.dead_lettered_total, queue.depth) == (2, 2, 0)


def test_a_rejecting_nack_through_the_command_and_a_noticed_expired_lease() -> None:
    queue = make_queue(lease=5.0)
    [message_id] = publish(queue, new())
    lease = claim_one(queue, now=0.0)
    assert state_of(queue, message_id, 6.0) is State.READY  # expiry noticed, the lease still settles
    outcome, records = queue.apply(commands.Nack([lease], retryable=False), 7.0)
    assert outcome.dead_lettered == 1
    assert records[-1] == DeadLettered(message_id, lease, "rejected", 1, "jobs.dlq")
    assert queue.ready_count == 0


def test_dead_letter_null_drops_the_message_and_counts_it() -> None:
    queue = make_queue(max_attempts=1, dead_letter=None, lease=5.0)
    [rejected, expired] = publish(queue, new("a"), new("b"))
    first, _ = claim_one(queue), claim_one(queue)
    _, records = queue.nack([first], None, None, 1.0, retryable=False)
    assert records[-1] == DeadLettered(rejected, first, "rejected", 1, None)
    _, records = queue.stats(5.0)
    assert records[-1] == DeadLettered(expired, f"{expired}.1", "max_attempts", 1, None)
    assert queue.take_outbox() == []
    assert totals(queue, 5.0) == (0, 0, 0, 2, 0)
    assert state_of(queue, rejected, 5.0) is State.DEAD_LETTERED


def test_dead_letters_go_to_the_queue_named_by_dead_letter() -> None:
    queue = make_queue(dead_letter="failures")
    [message_id] = publish(queue, new())
    queue.nack([claim_one(queue)], None, None, 0.0, retryable=False)
    assert queue.take_outbox() == [("failures", dead_copy(new(), message_id, "rejected", 1))]


def test_the_default_dead_letter_queue_is_named_after_the_queue() -> None:
    queue = QueueCore("orders.eu", QueueConfig(max_attempts=1), "o-")
    publish(queue, new())
    nack_until_dead(queue, 1)
    [(to, copy)] = queue.take_outbox()
    assert to == "orders.eu.dlq"
    assert copy.headers is not None and copy.headers["x-dead-letter-from"] == "orders.eu"


def test_config_changes_to_max_attempts_and_dead_letter_apply_to_later_operations() -> None:
    queue = make_queue(max_attempts=1)
    [message_id] = publish(queue, new())
    lease = claim_one(queue)
    before = queue.config
    config = queue.config.updated({"max_attempts": 3, "dead_letter": "elsewhere"})
    change, records = queue.update_config(config, 1.0)
    assert (change.before, change.after, change.stats.in_flight, records) == (
        before,
        config,
        1,
        [QueueUpdated(config)],
    )
    assert queue.nack([lease], None, None, 1.0)[0].dead_lettered == 0
    queue.nack([claim_one(queue)], None, None, 1.0)
    _, records = queue.nack([claim_one(queue)], None, None, 1.0)
    assert records[-1] == DeadLettered(message_id, f"{message_id}.3", "max_attempts", 3, "elsewhere")
    assert [to for to, _ in queue.take_outbox()] == ["elsewhere"]


def test_a_queue_cannot_dead_letter_to_itself() -> None:
    queue = make_queue()
    with pytest.raises(InvalidRequest):
        queue.update_config(queue.config.updated({"dead_letter": "jobs"}), 0.0)
    with pytest.raises(InvalidRequest):
        queue.apply(commands.UpdateConfig({"dead_letter": "jobs"}), 0.0)
    assert queue.config == QueueConfig()
    with pytest.raises(InvalidRequest):
        QueueCore("jobs", QueueConfig(dead_letter="jobs"), "m-")
    # Another queue's dead-letter queue may itself dead-letter elsewhere, or nowhere.
    dlq = dead_letter_queue()
    assert dlq.config.dead_letter_queue("jobs.dlq") == "jobs.dlq.dlq"
    dlq.update_config(dlq.config.updated({"dead_letter": None}), 0.0)


@pytest.mark.parametrize("length", [123, 124, 125, 128])
def test_the_dead_letter_queue_of_a_long_queue_name_can_be_made_with_the_default_config(length: int) -> None:
    # Names are cut to fit 128 characters, so the dead-letter queue of a queue named with 124 or more
    # characters is a 128-character name ending in ".dlq", whose own default must not be itself.
    name = "a" * length
    dlq_name = QueueCore(name, QueueConfig(), "m-").config.dead_letter_queue(name)
    assert dlq_name is not None and dlq_name != name and len(dlq_name) <= 128
    assert check_queue_name(dlq_name) == dlq_name
    dlq = QueueCore(dlq_name, QueueConfig(), "d-")  # what the registry does on demand
    next_name = dlq.config.dead_letter_queue(dlq_name)
    assert next_name is not None and next_name != dlq_name and check_queue_name(next_name) == next_name


# -- moved messages (Receive) --------------------------------------------------------------------


def test_received_messages_neither_check_nor_remember_keys() -> None:
    queue = make_queue()
    [original] = publish(queue, new("original", key="k"), now=0.0)
    moved = [NewMessage(b"1", key="k", origin=("a", "a-1")), NewMessage(b"2", key="j", origin=("a", "a-2"))]
    refs, records = queue.publish([*moved, NewMessage(b"3", key="k", origin=("a", "a-3"))], 1.0, moved=True)
    assert [outcome for _, _, outcome in refs] == [CREATED, CREATED, CREATED]
    assert [record.origin for record in records] == [("a", "a-1"), ("a", "a-2"), ("a", "a-3")]
    assert queue.depth == 4
    # The queue's own key memory is untouched: k still names the original, j is unknown.
    assert queue.publish([new(key="k")], 2.0)[0] == [(original, 1, DUPLICATE)]
    [(_, _, outcome)], _ = queue.publish([new(key="j")], 2.0)
    assert outcome == CREATED


def test_received_messages_are_not_refused_by_max_depth() -> None:
    queue = make_queue(max_depth=1)
    publish(queue, new())
    refs, _ = queue.apply(commands.Receive([new("a"), new("b"), new("c")]), 1.0)
    assert len(refs) == 3
    assert queue.depth == 4
    with pytest.raises(QueueFull):
        queue.publish([new()], 2.0)


def test_a_received_message_records_its_origin_and_a_published_one_none() -> None:
    queue = make_queue()
    _, records = queue.publish([new()], 0.0)
    assert records[0].origin is None
    _, records = queue.apply(commands.Receive([NewMessage(b"{}", origin=("jobs.dlq", "d-1"))]), 1.0)
    [record] = records
    assert record == Published(
        record.id, 2, b"{}", False, None, None, 0, 1.0, None, origin=("jobs.dlq", "d-1")
    )


def test_a_redriven_message_takes_over_its_key_from_the_gone_original() -> None:
    origin, dlq = make_queue(dedup_window=100.0), dead_letter_queue()
    [original] = publish(origin, new("v1", key="k"), now=0.0)
    origin.nack([claim_one(origin, now=0.0)], None, None, 0.0, retryable=False)
    receive(dlq, origin.take_outbox(), 0.0)
    dlq.redrive(None, None, frozenset({"jobs"}), 1.0)
    [back] = receive(origin, dlq.take_outbox(), 1.0, to="jobs")
    assert back != original
    # The key names the live copy now, for what is left of the original's window.
    refs, records = origin.publish([new("v2", key="k", replace=True)], 2.0)
    assert (refs, records) == ([(back, 2, REPLACED)], [Replaced(back, b'"v2"', False, None)])
    assert origin.publish([new(key="k")], 99.0)[0] == [(back, 2, DUPLICATE)]
    [(fresh, _, outcome)], _ = origin.publish([new(key="k")], 100.0)
    assert (fresh not in (original, back), outcome) == (True, CREATED)


def test_a_moved_message_does_not_take_a_key_that_is_forgotten_or_whose_message_is_live() -> None:
    queue = make_queue(dedup_window=10.0)
    [live] = publish(queue, new(key="live"), now=0.0)
    [gone] = publish(queue, new(key="old"), now=0.0)
    queue.delete(gone, 0.0)
    receive(queue, [("jobs", NewMessage(b"1", key="live", origin=("d", "d-1")))], 5.0)
    assert queue.publish([new(key="live")], 6.0)[0] == [(live, 1, DUPLICATE)]
    receive(queue, [("jobs", NewMessage(b"2", key="old", origin=("d", "d-2")))], 10.0)  # forgotten at 10
    [(_, _, outcome)], _ = queue.publish([new(key="old")], 11.0)
    assert outcome == CREATED


def test_moved_messages_take_over_a_key_the_same_in_one_batch_as_one_by_one() -> None:
    answers = []
    for batched in (True, False):
        queue = make_queue(dedup_window=100.0)
        [gone] = publish(queue, new(key="k"), now=0.0)
        queue.delete(gone, 0.0)
        moved = [
            NewMessage(b"1", key="k", origin=("d", "d-1")),
            NewMessage(b"2", key="k", origin=("d", "d-2")),
        ]
        if batched:
            receive(queue, [("jobs", message) for message in moved], 1.0)
        else:
            for message in moved:
                receive(queue, [("jobs", message)], 1.0)
        [(message_id, _, _)], _ = queue.publish([new(key="k")], 2.0)
        answers.append(queue.get(message_id, 2.0)[0].payload)
    assert answers == [b"1", b"1"]


# -- redrive -------------------------------------------------------------------------------------


def test_redrive_moves_dead_letters_back_to_their_origin_with_attempts_reset() -> None:
    message = NewMessage(b'"p"', headers={"h": "v"}, key="k", priority=2)
    origin, dlq = make_queue(), dead_letter_queue()
    [original] = publish(origin, message)
    origin.nack([claim_one(origin)], None, None, 0.0, retryable=False)
    [dead] = receive(dlq, origin.take_outbox(), 1.0)
    outcome, records = dlq.apply(commands.Redrive(None, None, frozenset({"jobs", "jobs.dlq"})), 2.0)
    assert (outcome.redriven, outcome.unknown, outcome.skipped) == (1, (), ())
    assert records == [Redriven(dead, "jobs")]
    assert dlq.take_outbox() == [
        (
            "jobs",
            NewMessage(
                b'"p"', False, {"h": "v", "x-original-id": original}, "k", 0.0, 2, origin=("jobs.dlq", dead)
            ),
        )
    ]
    assert dlq.depth == 0
    assert state_of(dlq, dead, 2.0) is State.REDRIVEN
    assert history_types(dlq, dead, 2.0) == ["published", "redriven"]


@pytest.mark.parametrize("leaving", ["rejected", "max_attempts", "expired", "redriven"])
def test_a_message_that_moves_to_another_queue_takes_its_payload_even_when_it_keeps_none(
    leaving: str,
) -> None:
    """With ``payload_bytes`` 0 a finished message lets its payload go at once: the copy that moves on
    (dead letter, TTL expiry, redrive) is made first, so it carries the payload whole."""
    keeps_none = FinishedHistory(count=10, payload_bytes=0)
    origin = QueueCore(
        "jobs", QueueConfig(max_attempts=1, lease=5.0, message_ttl=60.0), "m-", history=keeps_none
    )
    [message_id] = publish(origin, new("whole"), now=0.0)
    if leaving == "expired":
        origin.stats(61.0)
    else:
        lease = claim_one(origin, now=0.0)
        if leaving == "rejected":
            origin.nack([lease], None, None, 1.0, retryable=False)
        else:
            origin.stats(6.0)  # the lease expired on the last attempt
    [(to, copy)] = origin.take_outbox()
    assert (to, copy.payload) == ("jobs.dlq", b'"whole"')
    assert origin.get(message_id, 70.0)[0].payload is None, "the message itself kept none"
    if leaving == "redriven":
        dlq = QueueCore("jobs.dlq", QueueConfig(), "d-", history=keeps_none)
        [dead] = receive(dlq, [(to, copy)], 70.0)
        dlq.redrive(None, None, frozenset({"jobs"}), 71.0)
        [(_, redriven)] = dlq.take_outbox()
        assert redriven.payload == b'"whole"'
        assert dlq.get(dead, 72.0)[0].payload is None


def test_a_redriven_message_starts_over_and_can_be_dead_lettered_again() -> None:
    origin, dlq = dead_lettered(["a"])
    dlq.redrive(None, None, frozenset({"jobs"}), 1.0)
    [again] = receive(origin, dlq.take_outbox(), 1.0, to="jobs")
    outcome, _ = origin.claim("w", 1, None, 2.0)
    [(record, message)] = outcome.deliveries
    assert (record.id, record.attempt, message.payload) == (again, 1, b'"a"')
    origin.nack([record.lease_id], None, None, 3.0, retryable=False)
    [(_, copy)] = origin.take_outbox()
    assert copy.headers is not None
    assert copy.headers["x-dead-letter-reason"] == "rejected"
    assert copy.headers["x-dead-letter-attempts"] == "1"
    assert copy.headers["x-dead-letter-from"] == "jobs"
    assert copy.origin == ("jobs", again)


def test_redrive_to_sends_everything_to_that_queue() -> None:
    _, dlq = dead_lettered(["a", "b"])
    outcome, records = dlq.redrive(None, "retry", frozenset({"jobs", "retry"}), 1.0)
    assert outcome.redriven == 2
    assert [record.to for record in records] == ["retry", "retry"]
    assert [to for to, _ in dlq.take_outbox()] == ["retry", "retry"]


def test_redrive_by_ids_lists_unknown_ids_and_skips_leased_messages() -> None:
    _, dlq = dead_lettered(["a", "b", "c"])
    a, b, c = (view.id for view in dlq.browse(None, 10, 0, 1.0)[0])
    [(leased, _)] = claim(dlq, 1, now=1.0)
    assert leased == a
    outcome, records = dlq.redrive([a, "d-404", c, c, b], None, frozenset({"jobs"}), 2.0)
    assert (outcome.redriven, outcome.unknown, outcome.skipped) == (2, ("d-404",), ((a, "in_flight"),))
    assert records == [Redriven(c, "jobs"), Redriven(b, "jobs")]
    assert len(dlq.take_outbox()) == 2
    # Gone ids are unknown the second time, and a leased message is left with its consumer.
    outcome, _ = dlq.redrive([b], None, frozenset({"jobs"}), 3.0)
    assert outcome.unknown == (b,)
    assert state_of(dlq, a, 3.0) is State.IN_FLIGHT


def test_redrive_of_everything_leaves_leased_messages_in_place_and_says_so() -> None:
    _, dlq = dead_lettered(["a", "b"])
    [(leased, lease)] = claim(dlq, 1, now=1.0)
    outcome, records = dlq.redrive(None, None, frozenset({"jobs"}), 2.0)
    assert (outcome.redriven, outcome.skipped) == (1, ((leased, "in_flight"),))
    assert leased not in [record.id for record in records]
    assert dlq.ack([lease], 3.0)[0].settled == 1


def test_redrive_moves_delayed_messages_and_notices_expired_leases_first() -> None:
    _, dlq = dead_lettered(["a", "b"])
    [(delayed, delayed_lease), (expiring, expiring_lease)] = claim(dlq, 2, now=1.0, lease=5.0)
    dlq.nack([delayed_lease], 100.0, None, 2.0)
    outcome, records = dlq.redrive(None, None, frozenset({"jobs"}), 6.0)
    assert outcome.redriven == 2
    assert records == [
        LeaseExpired(expiring, expiring_lease),
        Redriven(delayed, "jobs"),
        Redriven(expiring, "jobs"),
    ]
    assert dlq.next_due() is None


def test_redrive_without_a_known_destination_leaves_the_message() -> None:
    _, dlq = dead_lettered(["a"])
    [plain] = publish(dlq, new("no provenance"), now=1.0)
    [dead] = [view.id for view in dlq.browse(None, 10, 0, 1.0)[0] if view.id != plain]
    for ids, to, destinations in (
        ([plain], None, frozenset({"jobs"})),  # no x-dead-letter-from
        ([dead], None, frozenset({"other"})),  # its origin no longer exists
        ([dead, plain], "gone", frozenset({"jobs"})),  # to names no existing queue
        ([dead], "jobs.dlq", frozenset({"jobs", "jobs.dlq"})),  # to names the queue itself
    ):
        outcome, records = dlq.redrive(ids, to, destinations, 2.0)
        assert (outcome.redriven, outcome.unknown, records) == (0, (), [])
        assert outcome.skipped == tuple((message_id, "no_destination") for message_id in ids)
    assert dlq.take_outbox() == []
    assert dlq.depth == 2


# -- retry_backoff -------------------------------------------------------------------------------


def test_exponential_backoff_is_capped_and_the_last_attempt_dead_letters() -> None:
    queue = make_queue(max_attempts=5, retry_backoff=RetryBackoff("exponential", 1.5, 5.0))
    [message_id] = publish(queue, new())
    now = 0.0
    delays = []
    for _ in range(4):
        outcome, records = queue.nack([claim_one(queue, now=now)], None, None, now)
        assert outcome.dead_lettered == 0
        [nacked] = records
        delays.append(nacked.delay)
        assert queue.next_due() == now + nacked.delay
        now += nacked.delay
    assert delays == [1.5, 3.0, 5.0, 5.0]
    _, records = queue.nack([claim_one(queue, now=now)], None, None, now)
    assert records[-1] == DeadLettered(message_id, f"{message_id}.5", "max_attempts", 5, "jobs.dlq")


def test_a_nack_that_fails_to_decide_leaves_its_lease_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Were the delay to raise (it once overflowed after 1,024 attempts), the lease must stay in the
    table: popped first, the message kept a lease id the table no longer had, and its next claim
    failed with a KeyError after taking other messages off the ready heap."""
    queue = make_queue(retry_backoff=RetryBackoff("exponential", 1.0, 60.0))
    publish(queue, new(), new())
    lease_id = claim_one(queue)

    def overflow(self: RetryBackoff, attempt: int) -> float:
        raise OverflowError("(34, 'Numerical result out of range')")

    monkeypatch.setattr(RetryBackoff, "delay", overflow)
    with pytest.raises(OverflowError):
        queue.nack([lease_id], None, None, 0.0)
    monkeypatch.undo()
    outcome, _ = queue.nack([lease_id], None, None, 0.0)
    assert outcome.settled == 1
    assert sorted(claimed.attempt for claimed, _ in queue.claim("c", 2, 30.0, 1.0)[0].deliveries) == [1, 2]


def test_fixed_backoff_is_capped_by_its_max_and_an_explicit_delay_wins() -> None:
    queue = make_queue(retry_backoff=RetryBackoff("fixed", 60.0, 20.0))
    publish(queue, new())
    [nacked] = queue.nack([claim_one(queue)], None, None, 0.0)[1]
    assert nacked.delay == 20.0
    [nacked] = queue.nack([claim_one(queue, now=20.0)], 0.0, None, 20.0)[1]
    assert nacked.delay == 0.0
    assert queue.ready_count == 1


def test_backoff_follows_the_attempt_after_refunded_defers_and_a_config_change() -> None:
    queue = make_queue(retry_backoff=RetryBackoff("exponential", 1.0, 100.0))
    publish(queue, new())
    queue.nack([claim_one(queue)], 0.0, None, 0.0)  # attempt 1
    for _ in range(3):
        queue.defer([claim_one(queue)], 0.0, None, 0.0)  # attempt 2, refunded each time
    [nacked] = queue.nack([claim_one(queue)], None, None, 0.0)[1]  # attempt 2
    assert nacked.delay == 2.0
    queue.update_config(queue.config.updated({"retry_backoff": {"type": "fixed", "base": 9}}), 2.0)
    [nacked] = queue.nack([claim_one(queue, now=2.0)], None, None, 2.0)[1]
    assert nacked.delay == 9.0


# -- on_duplicate: "replace" ---------------------------------------------------------------------


def test_outcome_constants_are_distinct_and_only_created_is_false() -> None:
    assert len({CREATED, DUPLICATE, REPLACED, CONFLICT}) == 4
    assert not CREATED
    assert all((DUPLICATE, REPLACED, CONFLICT))


def test_replace_gives_a_ready_duplicate_the_new_body_in_place() -> None:
    queue = make_queue()
    [message_id] = publish(queue, NewMessage(b'"old"', headers={"v": "1"}, key="k", priority=3), now=0.0)
    replacement = NewMessage(b"\x01", binary=True, headers={"v": "2"}, key="k", priority=9, replace=True)
    refs, records = queue.publish([replacement], now=1.0)
    assert refs == [(message_id, 1, REPLACED)]
    assert records == [Replaced(message_id, b"\x01", True, {"v": "2"})]
    view, _ = queue.get(message_id, 1.0)
    assert (view.payload, view.binary, view.headers) == (b"\x01", True, {"v": "2"})
    assert (view.seq, view.priority, view.key, view.published_at) == (1, 3, "k", 0.0)  # not a new message
    assert history_types(queue, message_id, 1.0) == ["published", "replaced"]
    snapshot, _ = queue.stats(1.0)
    assert (snapshot.published_total, snapshot.ready) == (1, 1)
    outcome, _ = queue.claim("w", 5, None, 2.0)
    [(record, message)] = outcome.deliveries
    assert (record.id, message.payload) == (message_id, b"\x01")


def test_replace_with_no_headers_clears_them_and_keeps_the_attempt_of_a_returned_message() -> None:
    queue = make_queue()
    [message_id] = publish(queue, NewMessage(b'"old"', headers={"v": "1"}, key="k"))
    queue.nack([claim_one(queue)], None, None, 0.0)
    refs, _ = queue.publish([new("new", key="k", replace=True)], now=1.0)
    assert refs[0][2] == REPLACED
    view, _ = queue.get(message_id, 1.0)
    assert (view.payload, view.headers, view.attempt, view.state) == (b'"new"', None, 1, State.READY)


def test_replace_of_a_delayed_message_keeps_its_delay() -> None:
    queue = make_queue()
    [message_id] = publish(queue, new("old", key="k", delay=30.0), now=0.0)
    refs, _ = queue.publish([new("new", key="k", delay=0.0, replace=True)], now=1.0)
    assert refs == [(message_id, 1, REPLACED)]
    view, _ = queue.get(message_id, 1.0)
    assert (view.state, view.available_at, view.payload) == (State.DELAYED, 30.0, b'"new"')
    assert queue.next_due() == 30.0


def test_replace_of_a_leased_message_is_a_conflict_and_changes_nothing() -> None:
    queue = make_queue()
    [message_id] = publish(queue, new("old", key="k"))
    lease = claim_one(queue)
    refs, records = queue.publish([new("new", key="k", replace=True)], now=1.0)
    assert (refs, records) == ([(message_id, 1, CONFLICT)], [])
    view, _ = queue.get(message_id, 1.0)
    assert view.payload == b'"old"'
    assert queue.ack([lease], 2.0)[0].settled == 1


@pytest.mark.parametrize("fate", ["acked", "dead_lettered", "deleted"])
def test_replace_of_a_message_that_left_is_a_plain_duplicate(fate: str) -> None:
    queue = make_queue()
    [message_id] = publish(queue, new("old", key="k"))
    if fate == "acked":
        queue.ack([claim_one(queue)], 0.0)
    elif fate == "dead_lettered":
        queue.nack([claim_one(queue)], None, None, 0.0, retryable=False)
    else:
        queue.delete(message_id, 0.0)
    refs, records = queue.publish([new("new", key="k", replace=True)], now=1.0)
    assert (refs, records, queue.depth) == ([(message_id, 1, DUPLICATE)], [], 0)


def test_without_replace_a_duplicate_keeps_its_body() -> None:
    queue = make_queue()
    [message_id] = publish(queue, new("old", key="k"))
    assert queue.publish([new("new", key="k")], now=1.0) == ([(message_id, 1, DUPLICATE)], [])
    assert queue.get(message_id, 1.0)[0].payload == b'"old"'


def test_replace_within_one_batch_with_internal_duplicates() -> None:
    queue = make_queue(max_depth=2)
    publish(queue, new("other"))
    refs, records = queue.publish(
        [
            new("a", key="k"),
            new("b", key="k", replace=True),
            new("c", key="k"),
            new("d", key="k", replace=True),
        ],
        now=1.0,
    )
    [message_id] = {message_id for message_id, _, _ in refs}
    assert [outcome for _, _, outcome in refs] == [CREATED, REPLACED, DUPLICATE, REPLACED]
    assert [type(record) for record in records] == [Published, Replaced, Replaced]
    assert records[0].payload == b'"a"'
    assert queue.get(message_id, 1.0)[0].payload == b'"d"'
    assert queue.depth == 2  # one message for the key, within max_depth


def test_replace_after_the_dedup_window_publishes_a_new_message() -> None:
    queue = make_queue(dedup_window=10.0)
    [old] = publish(queue, new("old", key="k"), now=0.0)
    assert queue.publish([new("x", key="k", replace=True)], now=9.0)[0] == [(old, 1, REPLACED)]
    [(fresh, seq, outcome)], _ = queue.publish([new("new", key="k", replace=True)], now=10.0)
    assert (fresh != old, seq, outcome) == (True, 2, CREATED)
    assert payloads_of(queue, 10.0) == [b'"x"', b'"new"']


@pytest.mark.parametrize("how", ["replaced", "received"])
def test_history_starts_with_the_published_record_as_journaled(how: str) -> None:
    queue = make_queue()
    if how == "replaced":
        [(message_id, _, _)], [published] = queue.publish([new("old", key="k")], now=1.0)
        queue.publish([new("new", key="k", replace=True)], now=2.0)
    else:
        [(message_id, _, _)], [published] = queue.publish(
            [NewMessage(b"{}", origin=("other", "o-1"))], now=1.0, moved=True
        )
    view, _ = queue.get(message_id, 3.0)
    assert view.history[0] == (1.0, published)


def test_a_replaced_payload_is_not_lost_to_a_late_ack_of_an_expired_lease() -> None:
    queue = make_queue(lease=10.0)
    [message_id] = publish(queue, new("old", key="k"), now=0.0)
    lease = claim_one(queue, now=0.0)
    assert state_of(queue, message_id, 11.0) is State.READY  # expiry noticed; the lease still settles
    [(_, _, outcome)], _ = queue.publish([new("new", key="k", replace=True)], now=12.0)
    assert outcome == REPLACED
    outcome, records = queue.ack([lease], now=13.0)  # the consumer finished the *old* payload
    assert (outcome.skipped, records) == ((lease,), [])
    assert payloads_of(queue, 14.0) == [b'"new"']
    [(record, message)] = queue.claim("w", 1, None, 14.0)[0].deliveries
    assert (record.id, record.attempt, message.payload) == (message_id, 2, b'"new"')


# -- message_ttl ---------------------------------------------------------------------------------


def test_a_message_not_acked_within_its_ttl_expires_to_the_dead_letter_queue() -> None:
    queue = make_queue(message_ttl=10.0)
    message = NewMessage(b'"p"', headers={"h": "v"}, key="k", priority=1)
    [message_id] = publish(queue, message, now=100.0)
    assert queue.next_due() == 110.0
    assert queue.stats(109.999)[1] == []
    snapshot, records = queue.stats(110.0)
    assert records == [Expired(message_id, "jobs.dlq")]
    assert (snapshot.ready, snapshot.expired_total, snapshot.dead_lettered_total) == (0, 1, 0)
    assert queue.take_outbox() == [("jobs.dlq", dead_copy(message, message_id, "expired", 0))]
    assert state_of(queue, message_id, 110.0) is State.EXPIRED
    assert history_types(queue, message_id, 110.0) == ["published", "expired"]
    assert queue.next_due() is None


def test_ttl_expires_messages_in_publish_order_and_a_claim_gets_the_rest() -> None:
    queue = make_queue(message_ttl=10.0)
    [old] = publish(queue, new("old"), now=0.0)
    [young] = publish(queue, new("young"), now=5.0)
    outcome, records = queue.claim("w", 5, None, 10.0)
    assert delivered_ids(outcome) == [young]
    assert records[0] == Expired(old, "jobs.dlq")
    assert queue.next_due() == 15.0


def test_ttl_counts_from_publish_for_delayed_messages() -> None:
    queue = make_queue(message_ttl=10.0)
    [message_id] = publish(queue, new(delay=20.0), now=0.0)
    assert queue.next_due() == 10.0
    assert totals(queue, 10.0) == (0, 0, 0, 0, 1)
    assert state_of(queue, message_id, 10.0) is State.EXPIRED
    assert claim(queue, 5, now=20.0) == []


def test_ttl_is_not_restarted_by_a_nack_or_redelivery() -> None:
    queue = make_queue(message_ttl=10.0)
    [message_id] = publish(queue, new(), now=0.0)
    queue.nack([claim_one(queue, now=1.0)], 3.0, None, 2.0)
    queue.defer([claim_one(queue, now=5.0)], 100.0, None, 6.0)
    _, records = queue.stats(10.0)
    assert records == [Expired(message_id, "jobs.dlq")]
    [(_, copy)] = queue.take_outbox()
    assert copy.headers is not None and copy.headers["x-dead-letter-attempts"] == "1"


def test_ttl_expires_an_in_flight_message_and_its_lease_goes_stale() -> None:
    queue = make_queue(message_ttl=10.0, lease=60.0)
    [message_id] = publish(queue, new(), now=0.0)
    lease = claim_one(queue, now=1.0)
    assert queue.next_due() == 10.0
    snapshot, records = queue.stats(10.0)
    assert records == [Expired(message_id, "jobs.dlq")]
    assert (snapshot.in_flight, snapshot.expired_total, snapshot.lease_expired_total) == (0, 1, 0)
    assert queue.ack([lease], 11.0)[0].skipped == (lease,)
    assert queue.extend([lease], 5.0, 11.0)[0].skipped == (lease,)
    assert queue.next_due() is None
    assert history_types(queue, message_id, 11.0) == ["published", "claimed", "expired"]


def test_ttl_with_dead_letter_null_drops_and_counts() -> None:
    queue = make_queue(message_ttl=1.0, dead_letter=None)
    [message_id] = publish(queue, new(), now=0.0)
    assert queue.stats(1.0)[1] == [Expired(message_id, None)]
    assert queue.take_outbox() == []
    assert totals(queue, 1.0) == (0, 0, 0, 0, 1)


def test_a_ttl_turned_on_later_counts_from_each_publish() -> None:
    queue = make_queue()
    [old] = publish(queue, new("old"), now=0.0)
    [young] = publish(queue, new("young", delay=100.0), now=50.0)
    lease = claim_one(queue, now=55.0)
    assert queue.next_due() == 85.0  # the lease
    config = queue.config.updated({"message_ttl": 30})
    change, records = queue.update_config(config, 60.0)  # its answer's stats expire what is past
    assert records == [QueueUpdated(config), Expired(old, "jobs.dlq")] and change.stats.expired_total == 1
    assert queue.stats(60.0)[1] == []
    assert queue.ack([lease], 60.0)[0].skipped == (lease,)
    assert queue.next_due() == 80.0
    assert queue.stats(80.0)[1] == [Expired(young, "jobs.dlq")]
    assert len(queue.take_outbox()) == 2


def test_a_ttl_turned_off_or_lengthened_applies_to_live_messages() -> None:
    queue = make_queue(message_ttl=10.0)
    [first] = publish(queue, new(), now=0.0)
    queue.update_config(queue.config.updated({"message_ttl": 0}), 1.0)
    assert queue.next_due() is None
    assert queue.stats(50.0)[1] == []
    queue.update_config(queue.config.updated({"message_ttl": 100}), 50.0)
    [second] = publish(queue, new(), now=60.0)
    assert queue.next_due() == 100.0
    assert queue.stats(100.0)[1] == [Expired(first, "jobs.dlq")]
    queue.update_config(queue.config.updated({"message_ttl": 200}), 100.0)
    assert queue.next_due() == 260.0
    assert queue.stats(259.0)[1] == []
    assert queue.stats(260.0)[1] == [Expired(second, "jobs.dlq")]


def test_ttl_of_a_received_message_counts_from_its_arrival() -> None:
    queue = make_queue(message_ttl=10.0)
    [moved] = receive(queue, [("jobs", NewMessage(b"{}", origin=("x", "x-1")))], 50.0)
    assert queue.next_due() == 60.0
    assert queue.stats(60.0)[1] == [Expired(moved, "jobs.dlq")]


def test_acked_and_deleted_messages_do_not_expire() -> None:
    queue = make_queue(message_ttl=10.0)
    [acked, deleted, _] = publish(queue, new(), new(), new(delay=1.0), now=0.0)
    queue.ack([claim_one(queue, now=0.0)], 1.0)
    queue.delete(deleted, 1.0)
    queue.purge(1.0)
    assert queue.next_due() is None
    assert queue.stats(20.0)[1] == []
    assert [state_of(queue, acked, 20.0)] == [State.ACKED]


def test_a_ttl_that_passed_during_the_lease_expires_the_message_however_late_it_is_noticed() -> None:
    early = make_queue(message_ttl=5.0, max_attempts=1, lease=10.0)
    late = make_queue(message_ttl=5.0, max_attempts=1, lease=10.0)
    for queue in (early, late):
        publish(queue, new(), now=0.0)
        claim_one(queue, now=0.0)
    _, noticed_early = early.stats(6.0)
    _, noticed_late = late.stats(11.0)
    assert noticed_early == noticed_late == [Expired("m-1", "jobs.dlq")]
    assert [reason_of(early), reason_of(late)] == ["expired", "expired"]


def test_a_lease_that_expired_before_the_ttl_is_noticed_first_however_late() -> None:
    # The last attempt's lease expired at 10, before the TTL at 30: a dead letter for its attempts.
    queue = make_queue(message_ttl=30.0, max_attempts=1, lease=10.0)
    [message_id] = publish(queue, new(), now=0.0)
    lease = claim_one(queue, now=0.0)
    assert queue.stats(40.0)[1] == [
        LeaseExpired(message_id, lease),
        DeadLettered(message_id, lease, "max_attempts", 1, "jobs.dlq"),
    ]
    assert reason_of(queue) == "max_attempts"
    # Not the last attempt: the lease expires, and the message later expires from the ready set.
    queue = make_queue(message_ttl=30.0, lease=10.0)
    [message_id] = publish(queue, new(), now=0.0)
    lease = claim_one(queue, now=0.0)
    assert queue.stats(40.0)[1] == [LeaseExpired(message_id, lease), Expired(message_id, "jobs.dlq")]
    assert reason_of(queue) == "expired"


def test_a_ttl_and_a_lease_ending_together_expire_the_message() -> None:
    queue = make_queue(message_ttl=10.0, max_attempts=1, lease=10.0)
    [message_id] = publish(queue, new(), now=0.0)
    claim_one(queue, now=0.0)
    assert queue.stats(10.0)[1] == [Expired(message_id, "jobs.dlq")]


def test_max_depth_does_not_count_messages_whose_ttl_has_passed() -> None:
    queue = make_queue(message_ttl=5.0, max_depth=1)
    [old] = publish(queue, new(), now=0.0)
    refs, records = queue.publish([new("fresh")], 6.0)
    assert [type(record) for record in records] == [Expired, Published]
    assert records[0] == Expired(old, "jobs.dlq")
    assert records[1].id == refs[0][0]
    assert reason_of(queue) == "expired"


def test_a_refused_publish_loses_no_record_of_what_it_expired() -> None:
    queue = make_queue(message_ttl=5.0, max_depth=1)
    [old] = publish(queue, new(), now=0.0)
    with pytest.raises(QueueFull):
        queue.publish([new(), new()], 6.0)
    # What the refused publish did is handed over for the journal all the same.
    assert queue.take_noticed() == [Expired(old, "jobs.dlq")]
    assert queue.take_noticed() == []
    assert queue.stats(6.0)[0].expired_total == 1


def test_a_publish_notices_a_ttl_in_the_same_order_as_a_read() -> None:
    outcomes = []
    for notice_by in ("stats", "publish"):
        queue = make_queue(message_ttl=30.0, max_attempts=1, lease=10.0, max_depth=5)
        publish(queue, new(), now=0.0)
        claim_one(queue, now=0.0)  # its lease expires at 10, its TTL at 30
        if notice_by == "stats":
            queue.stats(31.0)
        else:
            queue.publish([new()], 31.0)
            queue.stats(31.0)
        outcomes.append(reason_of(queue))
    assert outcomes == ["max_attempts", "max_attempts"]


def test_a_get_of_an_unknown_id_loses_no_record_of_what_it_noticed() -> None:
    queue = make_queue(max_attempts=1, lease=10.0)
    [message_id] = publish(queue, new(), now=0.0)
    lease = claim_one(queue, now=0.0)
    with pytest.raises(MessageNotFound):
        queue.get("m-404", 11.0)
    assert queue.take_noticed() == [
        LeaseExpired(message_id, lease),
        DeadLettered(message_id, lease, "max_attempts", 1, "jobs.dlq"),
    ]


@pytest.mark.parametrize("policy", ["message_ttl", "rate_limit"])
def test_what_next_due_promises_is_due_at_that_time(policy: str) -> None:
    if policy == "message_ttl":
        queue = make_queue(message_ttl=0.4)
        [message_id] = publish(queue, new(), now=0.1)
        due = queue.next_due()
        assert due is not None
        assert queue.stats(due)[1] == [Expired(message_id, "jobs.dlq")]
    else:
        queue = make_queue(rate_limit=(1, 0.4))
        publish(queue, new(), new(), now=0.0)
        claim_one(queue, now=0.1)
        outcome, _ = queue.claim("w", 1, None, 0.1)
        assert outcome.retry_after is not None
        due = queue.next_due()
        assert due == 0.1 + outcome.retry_after
        assert len(claim(queue, 1, now=due)) == 1


# -- max_depth -----------------------------------------------------------------------------------


def test_a_dead_lettered_or_expired_message_frees_room_under_max_depth() -> None:
    queue = make_queue(max_depth=2, message_ttl=10.0)
    publish(queue, new(), new(), now=0.0)
    with pytest.raises(QueueFull):
        queue.publish([new()], 1.0)
    queue.nack([claim_one(queue, now=1.0)], None, None, 1.0, retryable=False)
    assert len(publish(queue, new(), now=2.0)) == 1
    queue.stats(10.0)  # the second of the first two expires
    assert len(publish(queue, new(), now=10.0)) == 1
    with pytest.raises(QueueFull):
        queue.publish([new(), new()], 10.0)


def test_a_lowered_max_depth_refuses_the_next_publish_and_keeps_what_is_there() -> None:
    queue = make_queue(max_depth=5)
    publish(queue, new(), new(), new())
    queue.update_config(queue.config.updated({"max_depth": 2}), 1.0)
    with pytest.raises(QueueFull):
        queue.publish([new()], 1.0)
    assert queue.depth == 3
    queue.update_config(queue.config.updated({"max_depth": 0}), 2.0)
    assert len(publish(queue, *(new() for _ in range(10)), now=2.0)) == 10


# -- rate_limit ----------------------------------------------------------------------------------


def test_rate_limit_gives_a_claim_fewer_and_says_when_to_come_back() -> None:
    queue = make_queue(rate_limit=(3, 10.0))
    publish(queue, *(new(str(i)) for i in range(5)))
    outcome, records = queue.claim("w", 5, None, 100.0)
    assert (len(outcome.deliveries), outcome.ready, outcome.retry_after) == (3, 2, 10.0)
    assert len(records) == 3
    outcome, _ = queue.claim("w", 5, None, 104.0)
    assert (outcome.deliveries, outcome.ready, outcome.retry_after) == ([], 2, 6.0)
    assert queue.next_due() == 110.0


def test_the_rate_window_slides_exactly_at_its_boundary() -> None:
    queue = make_queue(rate_limit=(3, 10.0))
    publish(queue, *(new(str(i)) for i in range(10)))
    assert len(claim(queue, 2, now=0.0)) == 2
    outcome, _ = queue.claim("w", 5, None, 4.0)
    assert (len(outcome.deliveries), outcome.retry_after) == (1, 6.0)
    outcome, _ = queue.claim("w", 5, None, 9.5)
    assert (len(outcome.deliveries), outcome.retry_after) == (0, 0.5)
    # At 10 the two deliveries of time 0 leave the window (it is (now - per, now]); the one of 4 stays.
    outcome, _ = queue.claim("w", 5, None, 10.0)
    assert (len(outcome.deliveries), outcome.retry_after) == (2, 4.0)
    assert queue.next_due() == 14.0
    assert claim(queue, 5, now=13.5) == []
    assert len(claim(queue, 5, now=14.0)) == 1
    assert len(claim(queue, 5, now=20.0)) == 2
    assert len(claim(queue, 5, now=30.0)) == 3


def test_the_rate_window_outlives_a_restart_from_records_or_from_a_snapshot() -> None:
    """A restart started the window over: with at most 2 an hour, each restart let 2 more go."""
    queue = make_queue(rate_limit=(2, 3600.0))
    _, published = queue.publish([new(str(i)) for i in range(6)], 0.0)
    records = [(0.0, record) for record in published]
    outcome, claimed = queue.claim("w", 5, None, 10.0)
    records += [(10.0, record) for record in claimed]
    assert len(outcome.deliveries) == 2

    replayed = QueueCore("jobs", queue.config, "m-")
    for at, record in records:
        replayed.restore(record, at)
    loaded = QueueCore.load(replayed.dump())
    for restarted in (replayed, loaded):
        outcome, _ = restarted.claim("w", 5, None, 20.0)
        assert (outcome.deliveries, outcome.retry_after) == ([], 3590.0)
        assert len(claim(restarted, 5, now=3610.0)) == 2  # and it slides on as it would have


def test_retry_after_is_set_only_when_the_limit_held_back_ready_messages() -> None:
    queue = make_queue(rate_limit=(2, 10.0))
    publish(queue, new())
    outcome, _ = queue.claim("w", 5, None, 0.0)
    assert (len(outcome.deliveries), outcome.retry_after) == (1, None)  # the queue ran dry first
    publish(queue, new(), new(), new(), now=1.0)
    outcome, _ = queue.claim("w", 1, None, 1.0)
    assert (len(outcome.deliveries), outcome.retry_after) == (1, None)  # got all it asked for
    outcome, _ = queue.claim("w", 1, None, 2.0)
    assert (len(outcome.deliveries), outcome.ready, outcome.retry_after) == (0, 2, 8.0)
    queue.delete(queue.browse(State.READY, 10, 0, 2.0)[0][0].id, 2.0)
    queue.purge(2.0)
    outcome, _ = queue.claim("w", 1, None, 3.0)
    assert (len(outcome.deliveries), outcome.retry_after) == (0, None)  # limited, but nothing ready


def test_rate_limit_counts_deliveries_not_claims_or_settles() -> None:
    queue = make_queue(rate_limit=(2, 10.0))
    publish(queue, new(), new(), new())
    assert claim(queue, 0, now=0.0) == []
    lease = claim_one(queue, now=1.0)
    queue.nack([lease], None, None, 1.0)
    queue.defer([claim_one(queue, now=2.0)], 0.0, None, 2.0)
    outcome, _ = queue.claim("w", 1, None, 3.0)
    assert (outcome.deliveries, outcome.retry_after) == ([], 8.0)


def test_rate_limit_changes_apply_to_later_claims() -> None:
    queue = make_queue(lease=1000.0)
    publish(queue, *(new(str(i)) for i in range(20)))
    assert len(claim(queue, 5, now=0.0)) == 5
    queue.update_config(queue.config.updated({"rate_limit": {"max": 2, "per": 10}}), 0.0)
    assert len(claim(queue, 5, now=0.0)) == 2  # earlier deliveries were not counted
    queue.update_config(queue.config.updated({"rate_limit": {"max": 4, "per": 10}}), 1.0)
    assert len(claim(queue, 5, now=1.0)) == 2  # the window is kept, with room for two more
    assert queue.next_due() == 10.0  # the window is full until the deliveries of 0 leave it
    queue.update_config(queue.config.updated({"rate_limit": None}), 2.0)
    assert queue.next_due() == 1000.0  # only the leases are left
    assert len(claim(queue, 5, now=2.0)) == 5
    queue.update_config(queue.config.updated({"rate_limit": {"max": 1, "per": 10}}), 3.0)
    assert len(claim(queue, 5, now=3.0)) == 1  # turning it off forgot the window


def test_next_due_includes_the_rate_window_release_only_when_the_window_is_full() -> None:
    queue = make_queue(rate_limit=(2, 10.0), lease=100.0)
    publish(queue, new(), new(), new())
    claim_one(queue, now=0.0)
    assert queue.next_due() == 100.0
    claim_one(queue, now=3.0)
    assert queue.next_due() == 10.0
    assert claim(queue, 1, now=9.0) == []
    assert len(claim(queue, 1, now=10.0)) == 1
    assert queue.next_due() == 100.0  # the window is full again, but nothing is ready to wait for


# -- claim-window cohorts ------------------------------------------------------------------------


def test_ten_claims_of_ten_against_fifty_ready_get_five_each() -> None:
    queue = make_queue()
    ids = publish(queue, *(new(str(i)) for i in range(50)))
    hands = cohort(queue, [10] * 10, 1.0)
    assert [len(hand) for hand in hands] == [5] * 10
    assert sorted(message_id for hand in hands for message_id in hand) == sorted(ids)
    assert queue.ready_count == 0


def test_a_cohort_is_dealt_round_robin_from_the_front_of_the_queue() -> None:
    queue = make_queue()
    a, b, c, d, e = publish(queue, *(new(str(i)) for i in range(5)))
    assert cohort(queue, [2, 2], 0.0) == [[a, c], [b, d]]
    assert queue.ready_count == 1
    assert claim(queue, 5, now=0.0)[0][0] == e


def test_a_cohort_with_uneven_maxes_shares_in_proportion() -> None:
    queue = make_queue()
    publish(queue, *(new(str(i)) for i in range(10)))
    hands = cohort(queue, [10, 5, 5], 0.0)
    assert [len(hand) for hand in hands] == [5, 3, 2]
    queue = make_queue()
    publish(queue, *(new(str(i)) for i in range(7)))
    assert [len(hand) for hand in cohort(queue, [1, 100, 3], 0.0)] == [0, 7, 0]


def test_a_cohort_larger_than_the_queue_gives_one_each_to_the_first_claimers() -> None:
    queue = make_queue()
    a, b, c = publish(queue, new(), new(), new())
    assert cohort(queue, [1, 1, 1, 1, 1], 0.0) == [[a], [b], [c], [], []]
    queue = make_queue()
    a, b = publish(queue, new(), new())
    assert cohort(queue, [4, 4, 4], 0.0) == [[a], [b], []]


def test_a_cohort_that_asks_for_less_than_is_ready_gets_all_it_asked() -> None:
    queue = make_queue()
    publish(queue, *(new(str(i)) for i in range(10)))
    assert [len(hand) for hand in cohort(queue, [3, 1, 2], 0.0)] == [3, 1, 2]
    assert queue.ready_count == 4
    assert cohort(queue, [], 0.0) == []


def test_a_cohort_leases_each_claim_for_its_own_lease_and_notices_expiry_first() -> None:
    queue = make_queue(lease=30.0)
    [expiring, fresh] = publish(queue, new(), new())
    old_lease = claim_one(queue, now=0.0, lease=5.0)
    claims = [commands.Claim("short", 1, lease=2.0), commands.Claim("default", 1)]
    outcomes, records = queue.claim_cohort(claims, 10.0)
    assert records[0] == LeaseExpired(expiring, old_lease)
    [[(first, _)], [(second, _)]] = [outcome.deliveries for outcome in outcomes]
    assert (first.id, first.deadline, first.attempt) == (expiring, 12.0, 2)  # reclaimed first
    assert (second.id, second.deadline, second.attempt) == (fresh, 40.0, 1)


def test_a_cohort_respects_the_rate_limit() -> None:
    queue = make_queue(rate_limit=(4, 10.0))
    publish(queue, *(new(str(i)) for i in range(20)))
    outcomes, _ = queue.claim_cohort([commands.Claim("a", 5), commands.Claim("b", 5)], 0.0)
    assert [len(outcome.deliveries) for outcome in outcomes] == [2, 2]
    assert [outcome.retry_after for outcome in outcomes] == [10.0, 10.0]
    outcomes, _ = queue.claim_cohort([commands.Claim("a", 5)], 5.0)
    assert (outcomes[0].deliveries, outcomes[0].retry_after) == ([], 5.0)
    assert len(claim(queue, 10, now=10.0)) == 4


@given(
    ready=st.integers(0, 30),
    maxes=st.lists(st.integers(1, 12), max_size=8),
    reclaimed=st.integers(0, 5),
)
def test_a_cohort_hands_out_distinct_messages_in_fair_shares(
    ready: int, maxes: list[int], reclaimed: int
) -> None:
    queue = make_queue(lease=1.0)
    publish(queue, *(new(str(i)) for i in range(ready)), now=0.0)
    claim(queue, reclaimed, now=0.0)  # these come back first, once their leases are noticed expired
    queue.stats(2.0)
    available = queue.ready_count
    hands = cohort(queue, maxes, 2.0)
    dealt = [message_id for hand in hands for message_id in hand]
    assert len(dealt) == len(set(dealt)) == min(available, sum(maxes))
    assert [len(hand) for hand in hands] == divide_fairly(available, maxes)
    assert all(len(hand) <= count for hand, count in zip(hands, maxes, strict=True))


def test_divide_fairly_examples() -> None:
    assert divide_fairly(50, [10] * 10) == [5] * 10
    assert divide_fairly(10, [10, 5, 5]) == [5, 3, 2]
    assert divide_fairly(3, [1, 1, 1, 1, 1]) == [1, 1, 1, 0, 0]
    assert divide_fairly(100, [3, 4]) == [3, 4]
    assert divide_fairly(0, [3, 4]) == [0, 0]
    assert divide_fairly(5, []) == []
    assert divide_fairly(1, [1, 3]) == [0, 1]  # the largest remainder wins, not the first ask
    assert divide_fairly(2, [2, 2, 2]) == [1, 1, 0]  # ties go to earlier asks


@given(available=st.integers(0, 500), wanted=st.lists(st.integers(0, 100), max_size=12))
def test_divide_fairly_shares_everything_it_can_never_more_than_asked(
    available: int, wanted: list[int]
) -> None:
    shares = divide_fairly(available, wanted)
    total = sum(wanted)
    assert len(shares) == len(wanted)
    assert sum(shares) == min(available, total)
    assert all(0 <= share <= want for share, want in zip(shares, wanted, strict=True))
    if total > available:  # proportional: each share is its exact part rounded down or up
        for share, want in zip(shares, wanted, strict=True):
            assert available * want // total <= share <= -(-available * want // total)


# -- next_due ------------------------------------------------------------------------------------


def test_next_due_is_the_earliest_of_delay_lease_ttl_and_rate_window() -> None:
    queue = make_queue(lease=50.0, message_ttl=40.0, rate_limit=(1, 30.0))
    publish(queue, new(delay=20.0), now=0.0)
    publish(queue, new(), now=10.0)
    assert queue.next_due() == 20.0  # the delay ends
    claim_one(queue, now=12.0)
    assert queue.next_due() == 20.0
    queue.stats(20.0)
    assert queue.next_due() == 40.0  # the first message's TTL; the window frees at 42, the lease at 62
    queue.stats(40.0)
    # The second message's TTL (before its lease deadline of 62); the window frees at 42, but nothing
    # is ready to claim then.
    assert queue.next_due() == 50.0
