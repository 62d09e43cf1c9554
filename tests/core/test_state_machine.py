"""Hypothesis drives ``QueueCore`` against a small reference model with a clock that only moves forward.

The model keeps, per live message, the one lease that still settles (or none) and follows §3-§6: a
lease past its deadline settles until the message is claimed again; expiry and delay ends are noticed
lazily, on claim, stats and the reads (browse, get, and the compatibility surfaces' lookups, which must
name the lease the model says settles a message); claims serve reclaimed messages first, then higher
priority, then lower seq. Each step ends with a full browse that is compared with the model, so the
rules take a ``dt`` to move the clock first and act on state nobody has noticed yet.

The policies of §3 and §6 join in: ``max_attempts``, nacks that are not retryable, dead letters on a
noticed lease expiry, ``message_ttl`` (turned on, off and changed by config updates) and ``dead_letter``
``null``. A second core plays the dead-letter queue: whatever the first hands to its outbox is received
there at once, and a redrive sends it back the same way (``Receive``, ``publish(moved=True)``). Every
message has a payload of its own, so it can be followed across the two queues: it must be in exactly one
place, live in one of them or finished, never lost and never doubled.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from broker.core import NewMessage, QueueConfig, QueueCore, RetryBackoff, State, commands
from broker.core.model import CREATED
from broker.core.records import (
    Acked,
    Claimed,
    DeadLettered,
    Deferred,
    Deleted,
    Expired,
    Extended,
    LeaseExpired,
    Nacked,
    Published,
    Purged,
    QueueUpdated,
    Redriven,
    Released,
)
from broker.errors import MessageNotFound, QueueFull

LEASE = 10.0
BACKOFF = RetryBackoff("exponential", 1.0, 8.0)
MAX_DEPTH = 12
DEDUP_WINDOW = 40.0
MAX_ATTEMPTS = 2
CONFIG = QueueConfig(
    lease=LEASE,
    retry_backoff=BACKOFF,
    max_depth=MAX_DEPTH,
    dedup_window=DEDUP_WINDOW,
    max_attempts=MAX_ATTEMPTS,
)
ORIGIN, DLQ = "jobs", "jobs.dlq"
PROVENANCE = ("x-dead-letter-from", "x-dead-letter-reason", "x-dead-letter-attempts")

steps = st.sampled_from([0.0, 0.0, 0.0, 0.5, 1.0, 3.0, 10.0, 25.0])
new_messages = st.lists(
    st.tuples(
        st.none() | st.sampled_from("abc"),  # key: few, so that they collide
        st.sampled_from([0.0, 0.0, 0.0, 1.0, 5.0, 15.0]),  # delay
        st.sampled_from([0, 0, 1, -1, 3]),  # priority
    ),
    min_size=1,
    max_size=4,
)


@dataclass
class ModelMessage:
    """What the queue should know about one live message."""

    id: str
    seq: int
    priority: int
    published_at: float
    state: State
    available_at: float | None
    payload: bytes = b"{}"  # unique per message published: follows it across queues
    key: str | None = None
    headers: dict[str, str] | None = None
    lease: str | None = None  # the one lease id that still settles
    deadline: float | None = None
    attempt: int = 0
    deliveries: int = 0
    refunds: int = 0  # defers and refunded releases
    ready_at: float | None = None  # when it last became ready (its publish, until then)

    def __post_init__(self) -> None:
        if self.ready_at is None:
            self.ready_at = self.published_at


@dataclass
class DeadLetter:
    """One live message of the dead-letter queue (never claimed there, so always ready)."""

    id: str
    seq: int
    payload: bytes
    key: str | None
    priority: int
    headers: dict[str, str]
    origin: tuple[str, str]


def by_message(records: list[Any]) -> dict[str, list[Any]]:
    """Records grouped by message, each group in order (the order across messages is not promised)."""
    grouped: dict[str, list[Any]] = {}
    for record in records:
        grouped.setdefault(record.id, []).append(record)
    return grouped


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.queue = QueueCore(ORIGIN, CONFIG, "m-")
        self.dlq = QueueCore(DLQ, QueueConfig(), "d-")
        self.now = 1000.0
        self.next_seq = 1
        self.live: dict[str, ModelMessage] = {}  # in seq order
        self.published: list[str] = []
        self.acked: set[str] = set()
        self.deleted: set[str] = set()
        self.purged: set[str] = set()
        self.dead_lettered: set[str] = set()
        self.expired: set[str] = set()
        self.keys: dict[str, tuple[str, int, float]] = {}
        self.max_depth = MAX_DEPTH
        self.dedup_window = DEDUP_WINDOW
        self.message_ttl = 0.0
        self.dead_letter: str | None = DLQ
        self.lease_owner: dict[str, str] = {}  # every lease id ever issued → its message
        self.lease_attempt: dict[str, int] = {}  # every lease id ever issued → its delivery's attempt
        self.totals = {
            "published": 0,
            "acked": 0,
            "nacked": 0,
            "deferred": 0,
            "lease_expired": 0,
            "dead_lettered": 0,
            "expired": 0,
        }
        # The dead-letter queue, and where every payload ever published is.
        self.dlq_next_seq = 1
        self.dlq_live: dict[str, DeadLetter] = {}  # in seq order
        self.dlq_published: list[str] = []
        self.redriven: set[str] = set()
        self.payloads = 0
        self.created: list[bytes] = []  # the payload of every message published (not moved)
        self.finished: dict[bytes, str] = {}  # payload → how it left for good
        self.outgoing: list[tuple[str, NewMessage]] = []  # what the origin's outbox should hold

    # -- the model's own moves -------------------------------------------------------------------

    def tick(self, dt: float) -> None:
        self.now += dt

    def due(self, when: float | None) -> bool:
        return when is not None and when <= self.now

    def leave_dead(
        self, message: ModelMessage, lease_id: str | None, reason: str, records: list[Any]
    ) -> None:
        """The message is dead-lettered: copied to the dead-letter queue, or dropped."""
        if reason == "max_attempts":
            assert message.attempt == MAX_ATTEMPTS
        records.append(DeadLettered(message.id, lease_id, reason, message.attempt, self.dead_letter))
        self.totals["dead_lettered"] += 1
        self.dead_lettered.add(message.id)
        self.send_away(message, reason)

    def send_away(self, message: ModelMessage, reason: str) -> None:
        del self.live[message.id]
        if self.dead_letter is None:
            self.finished[message.payload] = f"dropped ({reason})"
            return
        headers = {
            **(message.headers or {}),
            "x-dead-letter-from": ORIGIN,
            "x-dead-letter-reason": reason,
            "x-dead-letter-attempts": str(message.attempt),
            "x-original-id": message.id,
        }
        copy = NewMessage(
            message.payload, False, headers, message.key, 0.0, message.priority, origin=(ORIGIN, message.id)
        )
        self.outgoing.append((self.dead_letter, copy))

    def notice(self) -> list[Any]:
        """Delays that ended, leases that expired (dead-lettering the messages that used their
        attempts) and messages whose TTL passed, by now, in the order they happened; answers the
        records the queue should give."""
        records: list[Any] = []
        for message in self.live.values():
            if message.state is State.DELAYED and self.due(message.available_at):
                message.state, message.ready_at, message.available_at = (
                    State.READY,
                    message.available_at,
                    None,
                )
        ttl = self.message_ttl
        for message in list(self.live.values()):
            if message.state is not State.IN_FLIGHT or not self.due(message.deadline):
                continue
            assert message.lease is not None and message.deadline is not None
            if ttl and message.published_at + ttl <= message.deadline:
                continue  # its TTL ran out first, while it was leased: it expires below
            records.append(LeaseExpired(message.id, message.lease))
            self.totals["lease_expired"] += 1
            if message.attempt >= MAX_ATTEMPTS:
                event("lease expiry dead-letters")
                self.leave_dead(message, message.lease, "max_attempts", records)
            else:
                message.state, message.ready_at = State.READY, message.deadline
        self.expire_ttl(records)
        return records

    def expire_ttl(self, records: list[Any]) -> None:
        """Expire the live messages whose TTL ran out by now, whatever their state."""
        if not self.message_ttl:
            return
        for message in list(self.live.values()):
            if message.published_at + self.message_ttl <= self.now:
                event(f"TTL expires a message {message.state.value}")
                records.append(Expired(message.id, self.dead_letter))
                self.totals["expired"] += 1
                self.expired.add(message.id)
                self.send_away(message, "expired")

    def expiring_at_publish(self, adding: int) -> None:
        """A publish to a queue with a ``max_depth`` first notices what came due, exactly as a read
        does (so that expired messages do not count against the depth; test_policies.py checks that
        it tells the same story as a read, and hands over its records even when it is refused). The
        model has the read do it, so the publish then has nothing left to notice."""
        if self.max_depth:
            self.stats(0.0)

    def check_noticed(self, records: list[Any], expected: list[Any]) -> None:
        assert by_message(records) == by_message(expected)
        assert len(records) == len(expected)
        self.check_dead_letters(records)

    def check_dead_letters(self, records: list[Any]) -> None:
        """Nothing is dead-lettered for its attempts before it used them all, or after."""
        for record in records:
            if isinstance(record, DeadLettered):
                assert record.reason in ("max_attempts", "rejected")
                if record.reason == "max_attempts":
                    assert record.attempt == MAX_ATTEMPTS

    def forward(self) -> None:
        """Hand what left the queue to the dead-letter queue, as the registry does (``Receive``)."""
        transfers = self.queue.take_outbox()
        expected, self.outgoing = self.outgoing, []

        def order(transfer: tuple[str, NewMessage]) -> Any:
            return transfer[1].origin

        assert sorted(transfers, key=order) == sorted(expected, key=order)
        assert self.queue.outbox == []
        if not transfers:
            return
        assert {to for to, _ in transfers} == {DLQ}
        refs, records = self.dlq.apply(commands.Receive([message for _, message in transfers]), self.now)
        expected_records = []
        for (_, message), (message_id, seq, outcome) in zip(transfers, refs, strict=True):
            assert (seq, outcome) == (self.dlq_next_seq, CREATED)
            assert message.origin is not None and message.headers is not None
            self.dlq_next_seq += 1
            self.dlq_live[message_id] = DeadLetter(
                message_id,
                seq,
                message.payload,
                message.key,
                message.priority,
                dict(message.headers),
                message.origin,
            )
            self.dlq_published.append(message_id)
            expected_records.append(
                Published(
                    message_id,
                    seq,
                    message.payload,
                    False,
                    message.headers,
                    message.key,
                    message.priority,
                    self.now,
                    None,
                    origin=message.origin,
                )
            )
        assert records == expected_records

    def settleable(self, lease_id: str) -> ModelMessage | None:
        message = self.live.get(self.lease_owner.get(lease_id, ""))
        if message is not None and message.lease == lease_id:
            return message
        return None

    def put_back(self, message: ModelMessage, delay: float) -> None:
        message.lease = message.deadline = None
        if delay > 0:
            message.state, message.available_at = State.DELAYED, self.now + delay
        else:
            message.state, message.ready_at = State.READY, self.now

    def lease_kind(self, lease_id: str, message: ModelMessage | None) -> str:
        if message is None:
            return "stale lease" if lease_id in self.lease_owner else "unknown lease"
        if message.state is State.READY:
            return "expired lease, noticed"
        assert message.deadline is not None
        return "expired lease, not noticed" if message.deadline <= self.now else "live lease"

    def count(self, state: State) -> int:
        return sum(1 for message in self.live.values() if message.state is state)

    def pick_leases(self, data: st.DataObject) -> list[str]:
        settleable = [lease for lease in self.lease_owner if self.settleable(lease)]
        choices = [st.just("never-issued")]
        if self.lease_owner:
            choices.append(st.sampled_from(list(self.lease_owner)))
        if settleable:
            choices += [st.sampled_from(settleable)] * 3
        return data.draw(st.lists(st.one_of(choices), max_size=4), label="leases")

    def look(self) -> tuple[list[Any], list[Any]]:
        """Browse both queues in full (the origin notices what came due first); their views."""
        expected = self.notice()
        views, records = self.queue.browse(None, 10**6, 0, self.now)
        self.check_noticed(records, expected)
        self.forward()
        dlq_views, records = self.dlq.browse(None, 10**6, 0, self.now)
        assert records == []
        return views, dlq_views

    # -- rules -----------------------------------------------------------------------------------

    @initialize(batch=new_messages, more=new_messages, claims=st.integers(0, 5))
    def start_busy(self, batch: list[tuple[str | None, float, int]], more: list[Any], claims: int) -> None:
        """Begin with messages published and some leased, so that settling has something to do."""
        self.publish(batch, 0.0)
        self.publish(more, 0.0)
        self.claim(claims, None, 0.0)

    @rule(batch=new_messages, dt=steps)
    def publish(self, batch: list[tuple[str | None, float, int]], dt: float) -> None:
        self.tick(dt)
        now = self.now
        self.keys = {key: known for key, known in self.keys.items() if known[2] > now}
        fresh_keys = {key for key, _, _ in batch if key is not None and key not in self.keys}
        adding = sum(1 for key, _, _ in batch if key is None) + len(fresh_keys)
        payloads = [f'"{self.payloads + index}"'.encode() for index in range(len(batch))]
        self.payloads += len(batch)
        messages = [
            NewMessage(payload, key=key, delay=delay, priority=prio)
            for payload, (key, delay, prio) in zip(payloads, batch, strict=True)
        ]
        self.expiring_at_publish(adding)
        expired: list[Any] = []
        if self.max_depth:
            self.expire_ttl(expired)
            if expired:
                event("publish expires messages")
        if adding and self.max_depth and len(self.live) + adding > self.max_depth:
            assert expired == []
            with pytest.raises(QueueFull):
                self.queue.publish(messages, now)
            return
        refs, records = self.queue.publish(messages, now)
        assert len(refs) == len(batch)
        published = []
        for payload, (key, delay, priority), (message_id, seq, duplicate) in zip(
            payloads, batch, refs, strict=True
        ):
            if key is not None and key in self.keys:
                known_id, known_seq, _ = self.keys[key]
                assert (message_id, seq, duplicate) == (known_id, known_seq, True)
                continue
            assert (seq, duplicate) == (self.next_seq, False)
            assert message_id not in self.published
            self.next_seq += 1
            available_at = now + delay if delay > 0 else None
            self.live[message_id] = ModelMessage(
                message_id,
                seq,
                priority,
                now,
                State.DELAYED if available_at else State.READY,
                available_at,
                payload,
                key,
            )
            self.published.append(message_id)
            self.created.append(payload)
            if key is not None:
                self.keys[key] = (message_id, seq, now + self.dedup_window)
            published.append(
                Published(message_id, seq, payload, False, None, key, priority, now, available_at)
            )
        assert records == expired + published
        self.totals["published"] += len(published)
        self.forward()

    @rule(max_count=st.integers(0, 5), lease=st.sampled_from([None, None, 1.0, 5.0, 20.0]), dt=steps)
    def claim(self, max_count: int, lease: float | None, dt: float) -> None:
        self.tick(dt)
        noticed = self.notice()
        ready = [message for message in self.live.values() if message.state is State.READY]
        ready.sort(key=lambda message: (message.deliveries == 0, -message.priority, message.seq))
        expected = ready[:max_count]
        outcome, records = self.queue.claim("w", max_count, lease, self.now)
        deadline = self.now + (LEASE if lease is None else lease)
        claimed = [record for record, _ in outcome.deliveries]
        assert [record.id for record in claimed] == [message.id for message in expected]
        self.check_noticed(records[: len(records) - len(claimed)], noticed)
        assert records[len(records) - len(claimed) :] == claimed
        for record, message in zip(claimed, expected, strict=True):
            assert record.id not in self.acked
            assert isinstance(record, Claimed)
            assert record.lease_id not in self.lease_owner, "a lease id was issued twice"
            message.attempt += 1
            message.deliveries += 1
            assert record.attempt <= MAX_ATTEMPTS, "delivered again after using its attempts"
            assert (record.attempt, record.deadline, record.consumer) == (message.attempt, deadline, "w")
            message.state = State.IN_FLIGHT
            message.lease, message.deadline = record.lease_id, deadline
            self.lease_owner[record.lease_id] = message.id
            self.lease_attempt[record.lease_id] = record.attempt
        assert outcome.ready == self.count(State.READY)
        assert outcome.retry_after is None
        self.forward()

    def settle(self, kind: str, lease_ids: list[str], argument: Any, dt: float) -> None:
        self.tick(dt)
        now = self.now
        expected_records: list[Any] = []
        skipped = []
        stale = []
        deadlines = {}
        settled = dead = 0
        for lease_id in lease_ids:
            message = self.settleable(lease_id)
            event(f"{kind}: {self.lease_kind(lease_id, message)}")
            if message is None or lease_id in deadlines:  # an extend's repeat is skipped like the others
                skipped.append(lease_id)
                if message is None:
                    stale.append(lease_id)
                continue
            settled += 1
            if kind == "ack":
                del self.live[message.id]
                self.acked.add(message.id)
                self.finished[message.payload] = "acked"
                expected_records.append(Acked(message.id, lease_id))
            elif kind == "nack":
                delay, retryable = argument
                wait = BACKOFF.delay(message.attempt) if delay is None else delay
                expected_records.append(Nacked(message.id, lease_id, wait, "why"))
                if not retryable or message.attempt >= MAX_ATTEMPTS:
                    event(f"nack dead-letters: {'max_attempts' if retryable else 'rejected'}")
                    self.leave_dead(
                        message, lease_id, "max_attempts" if retryable else "rejected", expected_records
                    )
                    dead += 1
                else:
                    self.put_back(message, wait)
            elif kind == "defer":
                message.attempt -= 1
                message.refunds += 1
                self.put_back(message, argument)
                expected_records.append(Deferred(message.id, lease_id, argument, None))
            elif kind == "release":
                if argument:  # refund_attempt
                    message.attempt -= 1
                    message.refunds += 1
                expected_records.append(Released(message.id, lease_id, argument))
                if message.attempt >= MAX_ATTEMPTS:
                    self.leave_dead(message, lease_id, "max_attempts", expected_records)
                    dead += 1
                else:
                    self.put_back(message, 0.0)
            else:
                message.state, message.deadline = State.IN_FLIGHT, now + argument
                deadlines[lease_id] = now + argument
                expected_records.append(Extended(message.id, lease_id, now + argument))
        if kind == "ack":
            outcome, records = self.queue.ack(lease_ids, now)
        elif kind == "nack":
            delay, retryable = argument
            outcome, records = self.queue.nack(lease_ids, delay, "why", now, retryable=retryable)
        elif kind == "defer":
            outcome, records = self.queue.defer(lease_ids, argument, None, now)
        elif kind == "release":
            outcome, records = self.queue.release(lease_ids, argument, now)
        else:
            outcome, records = self.queue.extend(lease_ids, argument, now)
        assert records == expected_records
        assert (outcome.settled, outcome.dead_lettered) == (settled, dead)
        assert outcome.skipped == tuple(skipped)
        self.check_dead_letters(records)
        if kind == "defer":
            assert not any(isinstance(record, DeadLettered) for record in records), "a defer dead-lettered"
        if kind == "extend":
            assert outcome.deadlines == deadlines
        for lease_id in stale:
            if lease_id in self.lease_owner:  # issued once, settles no more: must stay skipped
                assert self.settleable(lease_id) is None
        total = {"ack": "acked", "nack": "nacked", "defer": "deferred"}.get(kind)
        if total is not None:
            self.totals[total] += settled
        self.forward()

    @rule(data=st.data(), dt=steps)
    def ack(self, data: st.DataObject, dt: float) -> None:
        self.settle("ack", self.pick_leases(data), None, dt)

    @rule(
        data=st.data(),
        delay=st.sampled_from([None, None, 0.0, 2.0]),
        retryable=st.sampled_from([True, True, True, False]),
        dt=steps,
    )
    def nack(self, data: st.DataObject, delay: float | None, retryable: bool, dt: float) -> None:
        self.settle("nack", self.pick_leases(data), (delay, retryable), dt)

    @rule(data=st.data(), retry_after=st.sampled_from([0.0, 3.0]), dt=steps)
    def defer(self, data: st.DataObject, retry_after: float, dt: float) -> None:
        self.settle("defer", self.pick_leases(data), retry_after, dt)

    @rule(data=st.data(), lease=st.sampled_from([1.0, 5.0, 20.0]), dt=steps)
    def extend(self, data: st.DataObject, lease: float, dt: float) -> None:
        self.settle("extend", self.pick_leases(data), lease, dt)

    @rule(data=st.data(), refund=st.booleans(), dt=steps)
    def release(self, data: st.DataObject, refund: bool, dt: float) -> None:
        self.settle("release", self.pick_leases(data), refund, dt)

    @rule(
        max_depth=st.sampled_from([0, 2, MAX_DEPTH]),
        dedup_window=st.sampled_from([2.0, DEDUP_WINDOW, 90.0]),
        message_ttl=st.sampled_from([0.0, 0.0, 30.0, 90.0]),
        dead_letter=st.sampled_from([DLQ, DLQ, None]),
    )
    def update_config(
        self, max_depth: int, dedup_window: float, message_ttl: float, dead_letter: str | None
    ) -> None:
        """Lowering max_depth below the depth, or shrinking dedup_window, must not upset publishing; a
        TTL turned on applies to the messages already there, counted from their publish. The change
        answers with the stats, so it notices what came due, under the new config."""
        changes = {
            "max_depth": max_depth,
            "dedup_window": dedup_window,
            "message_ttl": message_ttl,
            "dead_letter": dead_letter,
        }
        config = self.queue.config.updated(changes)
        self.max_depth, self.dedup_window = max_depth, dedup_window
        self.message_ttl, self.dead_letter = message_ttl, dead_letter
        noticed = self.notice()
        change, records = self.queue.update_config(config, self.now)
        assert records[0] == QueueUpdated(config)
        self.check_noticed(records[1:], noticed)
        self.forward()
        assert change.after is config and change.stats.ready == self.count(State.READY)

    @rule(dt=st.sampled_from([0.5, 1.0, 5.0, 10.0, 30.0, 60.0]))
    def advance_time(self, dt: float) -> None:
        self.tick(dt)

    @rule(data=st.data(), dt=steps)
    def delete(self, data: st.DataObject, dt: float) -> None:
        self.tick(dt)
        message_id = data.draw(st.sampled_from([*self.published, "m-unknown"]), label="id")
        message = self.live.pop(message_id, None)
        if message is None:
            with pytest.raises(MessageNotFound):
                self.queue.delete(message_id, self.now)
            return
        self.deleted.add(message_id)
        self.finished[message.payload] = "deleted"
        assert self.queue.delete(message_id, self.now) == (None, [Deleted(message_id)])

    @rule(dt=steps)
    def purge(self, dt: float) -> None:
        """A lease that ran out is noticed first: its message is ready, so it is purged too."""
        self.tick(dt)
        noticed = self.notice()
        gone = [m for m in self.live.values() if m.state in (State.READY, State.DELAYED)]
        for message in gone:
            del self.live[message.id]
            self.finished[message.payload] = "purged"
        self.purged.update(message.id for message in gone)
        purged, records = self.queue.purge(self.now)
        assert (purged, records[len(noticed) :]) == (len(gone), [Purged(len(gone))] if gone else [])
        self.check_noticed(records[: len(noticed)], noticed)
        self.forward()

    @precondition(lambda self: self.dlq_live)
    @rule(
        data=st.data(),
        everything=st.booleans(),
        to=st.sampled_from([None, None, ORIGIN]),
        origin_exists=st.sampled_from([True, True, True, False]),
        dt=steps,
    )
    def redrive(
        self, data: st.DataObject, everything: bool, to: str | None, origin_exists: bool, dt: float
    ) -> None:
        """Move dead letters back into the origin, where they start over as new messages."""
        self.tick(dt)
        now = self.now
        ids: list[str] | None = None
        if not everything:
            ids = data.draw(
                st.lists(st.sampled_from([*self.dlq_published, "d-unknown"]), max_size=4), label="ids"
            )
        destinations = frozenset({ORIGIN}) if origin_exists else frozenset()
        asked = list(self.dlq_live) if ids is None else list(dict.fromkeys(ids))
        unknown = tuple(message_id for message_id in asked if message_id not in self.dlq_live)
        chosen = [self.dlq_live[message_id] for message_id in asked if message_id in self.dlq_live]
        outcome, records = self.dlq.apply(commands.Redrive(ids, to, destinations), now)
        if not origin_exists:
            assert (outcome.redriven, outcome.unknown, records) == (0, unknown, [])
            assert outcome.skipped == tuple((dead.id, "no_destination") for dead in chosen)
            assert self.dlq.take_outbox() == []
            return
        event(f"redrive of {min(len(chosen), 2)}{'+' if len(chosen) > 2 else ''} dead letters")
        assert (outcome.redriven, outcome.unknown, outcome.skipped) == (len(chosen), unknown, ())
        assert records == [Redriven(dead.id, ORIGIN) for dead in chosen]
        moved = []
        for dead in chosen:
            del self.dlq_live[dead.id]
            self.redriven.add(dead.id)
            headers = {name: value for name, value in dead.headers.items() if name not in PROVENANCE}
            assert headers["x-original-id"] == dead.origin[1]
            moved.append(
                NewMessage(dead.payload, False, headers, dead.key, 0.0, dead.priority, origin=(DLQ, dead.id))
            )
        assert self.dlq.take_outbox() == [(ORIGIN, message) for message in moved]
        if not moved:
            return
        # Back in the origin, a moved message takes over its key if the message remembered for it is
        # gone; within one batch the first one does, as if they came one by one.
        self.keys = {key: known for key, known in self.keys.items() if known[2] > now}
        seq = self.next_seq
        adopted: set[str] = set()
        for message in moved:
            known = None if message.key is None or message.key in adopted else self.keys.get(message.key)
            if message.key is not None and known is not None and known[0] not in self.live:
                event("a redriven message takes over its key")
                self.keys[message.key] = (f"m-{seq:x}", seq, known[2])
                adopted.add(message.key)
            seq += 1
        self.expiring_at_publish(0)
        expected: list[Any] = []
        if self.max_depth:
            self.expire_ttl(expected)
        refs, records = self.queue.apply(commands.Receive(moved), now)
        for message, (message_id, seq, outcome_code) in zip(moved, refs, strict=True):
            assert (seq, outcome_code) == (self.next_seq, CREATED)
            self.next_seq += 1
            self.live[message_id] = ModelMessage(
                message_id,
                seq,
                message.priority,
                now,
                State.READY,
                None,
                message.payload,
                message.key,
                dict(message.headers or {}),
            )
            self.published.append(message_id)
            expected.append(
                Published(
                    message_id,
                    seq,
                    message.payload,
                    False,
                    message.headers,
                    message.key,
                    message.priority,
                    now,
                    None,
                    origin=message.origin,
                )
            )
        assert records == expected
        self.totals["published"] += len(moved)
        self.forward()

    @rule(dt=steps)
    def stats(self, dt: float) -> None:
        self.tick(dt)
        noticed = self.notice()
        # Read without a command where nothing came due: then the same stats, and nothing to journal.
        at_rest = self.queue.stats_if_nothing_due(self.now)
        snapshot, records = self.queue.stats(self.now)
        self.check_noticed(records, noticed)
        if at_rest is not None:
            assert (at_rest, records) == (snapshot, [])
        assert at_rest is None or not noticed
        self.forward()
        oldest = min((m.ready_at for m in self.live.values() if m.state is State.READY), default=None)
        assert snapshot.ready == self.count(State.READY)
        assert snapshot.delayed == self.count(State.DELAYED)
        assert snapshot.in_flight == self.count(State.IN_FLIGHT)
        assert snapshot.published_total == self.totals["published"]
        assert snapshot.acked_total == self.totals["acked"]
        assert snapshot.nacked_total == self.totals["nacked"]
        assert snapshot.deferred_total == self.totals["deferred"]
        assert snapshot.lease_expired_total == self.totals["lease_expired"]
        assert snapshot.dead_lettered_total == self.totals["dead_lettered"]
        assert snapshot.expired_total == self.totals["expired"]
        # How long the ready message that has waited longest has been claimable.
        assert snapshot.oldest_ready_age == (None if oldest is None else self.now - oldest)
        dlq_snapshot, records = self.dlq.stats(self.now)
        assert (records, dlq_snapshot.ready, dlq_snapshot.in_flight) == ([], len(self.dlq_live), 0)
        assert dlq_snapshot.published_total == len(self.dlq_published)

    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        if not self.published:
            return
        message_id = data.draw(st.sampled_from(self.published + self.dlq_published), label="id")
        noticed = self.notice()
        if message_id in self.dlq_published:
            view, records = self.dlq.get(message_id, self.now)
            assert records == []
            if message_id in self.redriven:
                assert view.state is State.REDRIVEN
                assert isinstance(view.history[-1][1], Redriven)
            else:
                assert view.state is State.READY
            return
        if message_id in self.deleted or message_id in self.purged:
            # A get that raises cannot answer the records of what it noticed (an xfail test in
            # test_policies.py): a read notices everything first, so that there is nothing left.
            self.check_noticed(self.queue.stats(self.now)[1], noticed)
            self.forward()
            with pytest.raises(MessageNotFound):
                self.queue.get(message_id, self.now)
            assert self.queue.outbox == []
            return
        view, records = self.queue.get(message_id, self.now)
        self.check_noticed(records, noticed)
        self.forward()
        assert isinstance(view.history[0][1], Published)
        last = view.history[-1][1]
        if message_id in self.acked:
            assert view.state is State.ACKED
            assert isinstance(last, Acked)
        elif message_id in self.dead_lettered:
            assert view.state is State.DEAD_LETTERED
            assert isinstance(last, DeadLettered)
        elif message_id in self.expired:
            assert view.state is State.EXPIRED
            assert isinstance(last, Expired)
        else:
            assert view.state is self.live[message_id].state

    # -- the compatibility surfaces' lookups ------------------------------------------------------

    def latest_leases(self) -> dict[str, str]:
        """Each message ever delivered → the lease of its latest delivery."""
        return {owner: lease for lease, owner in self.lease_owner.items()}

    @rule(data=st.data(), dt=steps)
    def find_leases(self, data: st.DataObject, dt: float) -> None:
        """The lease of each message's latest delivery: the one that settles it while the model says one
        does, else a settled one; none for messages never delivered, deleted, purged or unknown."""
        self.tick(dt)
        ids = data.draw(st.lists(st.sampled_from([*self.published, "m-unknown"]), max_size=5), label="ids")
        noticed = self.notice()
        answer, records = self.queue.apply(commands.FindLeases(ids), self.now)
        self.check_noticed(records, noticed)
        self.forward()
        latest = self.latest_leases()
        gone = self.deleted | self.purged
        expected = {message_id: latest[message_id] for message_id in ids if message_id in latest}
        expected = {message_id: lease for message_id, lease in expected.items() if message_id not in gone}
        assert list(answer.items()) == list(expected.items())
        for message_id, lease in answer.items():
            message = self.live.get(message_id)
            if message is not None and message.lease is not None:
                event("find_leases: a lease that settles")
                assert lease == message.lease
            else:
                event("find_leases: a lease settled already")
                assert self.settleable(lease) is None

    @rule(data=st.data(), consumer=st.sampled_from(["w", "w", "push"]), attempt=st.integers(1, 3))
    def find_delivery(self, data: st.DataObject, consumer: str, attempt: int) -> None:
        message_id = data.draw(st.sampled_from([*self.published, "m-unknown"]), label="id")
        noticed = self.notice()
        if message_id not in self.published or message_id in self.deleted | self.purged:
            with pytest.raises(MessageNotFound):
                self.queue.apply(commands.FindDelivery(message_id, consumer, attempt), self.now)
            self.check_noticed(self.queue.take_noticed(), noticed)
            self.forward()
            return
        lookup, records = self.queue.apply(commands.FindDelivery(message_id, consumer, attempt), self.now)
        self.check_noticed(records, noticed)
        self.forward()
        found = None
        if consumer == "w":
            for lease, owner in self.lease_owner.items():
                if owner == message_id and self.lease_attempt[lease] == attempt:
                    found = lease
        event(f"find_delivery: {'found' if found else 'none'}")
        assert lookup.lease_id == found
        if message_id in self.live:
            assert lookup.attempt == self.live[message_id].attempt

    def dead_letter_origins(self, origin: str) -> list[DeadLetter]:
        """The live dead letters whose ``x-dead-letter-from`` names ``origin``, in seq order."""
        return [dead for dead in self.dlq_live.values() if dead.headers["x-dead-letter-from"] == origin]

    @rule(origin=st.sampled_from([ORIGIN, ORIGIN, "other"]), limit=st.integers(1, 4), data=st.data())
    def browse_dead_letters(self, origin: str, limit: int, data: st.DataObject) -> None:
        after = data.draw(st.integers(0, self.dlq_next_seq), label="after")
        page, records = self.dlq.apply(commands.BrowseDeadLetters(origin, limit, after), self.now)
        assert records == []
        looked_at = [dead for dead in self.dlq_live.values() if dead.seq > after]
        mine = {dead.id for dead in self.dead_letter_origins(origin)}
        assert [view.id for view in page.views] == [dead.id for dead in looked_at[:limit] if dead.id in mine]
        assert page.after == (looked_at[limit - 1].seq if len(looked_at) > limit else 0)

    @rule(origin=st.sampled_from([ORIGIN, ORIGIN, "other"]), data=st.data())
    def find_dead_letters(self, origin: str, data: st.DataObject) -> None:
        """By an entry's own id or the id of the message it was; redriven entries by their own id."""
        choices = [st.sampled_from([*self.dlq_published, *self.published, "d-unknown"])]
        entries = [key for dead in self.dlq_live.values() for key in (dead.id, dead.headers["x-original-id"])]
        if entries:
            choices += [st.sampled_from(entries)] * 2
        ids = data.draw(st.lists(st.one_of(choices), max_size=4), label="ids")
        lookup, records = self.dlq.apply(commands.FindDeadLetters(origin, ids), self.now)
        assert records == []
        expected: dict[str, str] = {}
        for dead in self.dead_letter_origins(origin):
            for key in (dead.id, dead.headers["x-original-id"]):
                if key in ids and key not in expected:
                    expected[key] = dead.id
        assert list(lookup.entries.items()) == list(expected.items())
        asked = list(dict.fromkeys(ids))
        redriven = [message_id for message_id in asked if message_id in self.redriven]
        assert lookup.redriven == tuple(message_id for message_id in redriven if message_id not in expected)
        event(f"find_dead_letters: {'found' if lookup.entries else 'none'}")
        if lookup.redriven:
            event("find_dead_letters: redriven")

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def books_balance(self) -> None:
        live = set(self.live)
        gone = [self.acked, self.deleted, self.purged, self.dead_lettered, self.expired]
        assert len(self.published) == len(set(self.published))
        assert live.union(*gone) == set(self.published)
        assert len(live) + sum(map(len, gone)) == len(self.published)
        assert self.queue.depth == len(live)
        assert set(self.dlq_live) | self.redriven == set(self.dlq_published)
        assert len(self.dlq_live) + len(self.redriven) == len(self.dlq_published)
        assert self.dlq.depth == len(self.dlq_live)

    @invariant()
    def every_message_is_in_exactly_one_place(self) -> None:
        """Live in the origin, live in the dead-letter queue, or finished: never lost, never doubled."""
        views, dlq_views = self.look()
        assert self.queue.outbox == [] and self.dlq.outbox == []
        places = Counter(view.payload for view in views)
        places.update(view.payload for view in dlq_views)
        places.update(list(self.finished))
        assert set(places) == set(self.created)
        assert [payload for payload, count in places.items() if count != 1] == []

    @invariant()
    def attempts_are_deliveries_minus_refunds_and_never_exceed_max_attempts(self) -> None:
        for message in self.live.values():
            assert message.attempt == message.deliveries - message.refunds
            assert 0 <= message.attempt <= MAX_ATTEMPTS
        views, _ = self.look()
        assert all(view.attempt <= MAX_ATTEMPTS for view in views)

    @invariant()
    def browse_matches_the_model(self) -> None:
        views, dlq_views = self.look()
        assert [view.id for view in views] == list(self.live)
        for view in views:
            message = self.live[view.id]
            assert (view.state, view.attempt, view.seq, view.priority) == (
                message.state,
                message.attempt,
                message.seq,
                message.priority,
            )
            assert (view.payload, view.key, view.headers or None) == (
                message.payload,
                message.key,
                message.headers or None,
            )
            if view.state is State.IN_FLIGHT:
                assert (view.lease_id, view.lease_deadline) == (message.lease, message.deadline)
            else:
                assert view.lease_id is None
            if view.state is State.DELAYED:
                assert view.available_at == message.available_at
        assert self.queue.ready_count == self.count(State.READY)
        assert [view.id for view in dlq_views] == list(self.dlq_live)
        for view in dlq_views:
            dead = self.dlq_live[view.id]
            assert (view.state, view.attempt, view.payload, view.key, view.priority) == (
                State.READY,
                0,
                dead.payload,
                dead.key,
                dead.priority,
            )
            assert view.headers == dead.headers

    @invariant()
    def one_settleable_lease_per_message(self) -> None:
        owners = [self.lease_owner[lease] for lease in self.lease_owner if self.settleable(lease)]
        assert len(owners) == len(set(owners))
        for message in self.live.values():
            assert (message.lease is not None) >= (message.state is State.IN_FLIGHT)
            assert message.state is not State.DELAYED or message.lease is None

    @invariant()
    def next_due_matches_the_model(self) -> None:
        times = [m.available_at for m in self.live.values() if m.state is State.DELAYED]
        times += [m.deadline for m in self.live.values() if m.state is State.IN_FLIGHT]
        if self.message_ttl and self.live:
            times.append(min(m.published_at for m in self.live.values()) + self.message_ttl)
        assert self.queue.next_due() == min((t for t in times if t is not None), default=None)
        assert self.dlq.next_due() is None


QueueMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestQueueMachine = QueueMachine.TestCase
