"""Hypothesis drives ``QueueCore`` against a small reference model with a clock that only moves forward.

The model keeps, per live message, the one lease that still settles (or none) and follows §3-§6: a
lease past its deadline settles until the message is claimed again; expiry and delay ends are noticed
lazily, on claim, stats and the reads (browse, get); claims serve reclaimed messages first, then higher
priority, then lower seq. Each step ends with a full browse that is compared with the model, so the
rules take a ``dt`` to move the clock first and act on state nobody has noticed yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from broker.core import NewMessage, QueueConfig, QueueCore, RetryBackoff, State
from broker.core.records import (
    Acked,
    Claimed,
    Deferred,
    Deleted,
    Extended,
    LeaseExpired,
    Nacked,
    Published,
    Purged,
    QueueUpdated,
    Released,
)
from broker.errors import MessageNotFound, QueueFull

LEASE = 10.0
BACKOFF = RetryBackoff("exponential", 1.0, 8.0)
MAX_DEPTH = 12
DEDUP_WINDOW = 40.0
CONFIG = QueueConfig(lease=LEASE, retry_backoff=BACKOFF, max_depth=MAX_DEPTH, dedup_window=DEDUP_WINDOW)

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
    lease: str | None = None  # the one lease id that still settles
    deadline: float | None = None
    attempt: int = 0
    delivered: bool = False


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.queue = QueueCore("jobs", CONFIG, "m-")
        self.now = 1000.0
        self.next_seq = 1
        self.live: dict[str, ModelMessage] = {}  # in seq order
        self.published: list[str] = []
        self.acked: set[str] = set()
        self.deleted: set[str] = set()
        self.purged: set[str] = set()
        self.keys: dict[str, tuple[str, int, float]] = {}
        self.max_depth = MAX_DEPTH
        self.dedup_window = DEDUP_WINDOW
        self.lease_owner: dict[str, str] = {}  # every lease id ever issued → its message
        self.totals = {"published": 0, "acked": 0, "nacked": 0, "deferred": 0, "lease_expired": 0}

    # -- the model's own moves -------------------------------------------------------------------

    def tick(self, dt: float) -> None:
        self.now += dt

    def due(self, when: float | None) -> bool:
        return when is not None and when <= self.now

    def notice(self) -> set[tuple[str, str]]:
        """Delays that ended and leases that expired by now; answers the expiries noticed."""
        expired = set()
        for message in self.live.values():
            if message.state is State.DELAYED and self.due(message.available_at):
                message.state, message.available_at = State.READY, None
            elif message.state is State.IN_FLIGHT and self.due(message.deadline):
                message.state = State.READY
                assert message.lease is not None
                expired.add((message.id, message.lease))
        self.totals["lease_expired"] += len(expired)
        return expired

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
            message.state = State.READY

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
        messages = [NewMessage(b"{}", key=key, delay=delay, priority=prio) for key, delay, prio in batch]
        if adding and self.max_depth and len(self.live) + adding > self.max_depth:
            with pytest.raises(QueueFull):
                self.queue.publish(messages, now)
            return
        refs, records = self.queue.publish(messages, now)
        assert len(refs) == len(batch)
        published = []
        for (key, delay, priority), (message_id, seq, duplicate) in zip(batch, refs, strict=True):
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
            )
            self.published.append(message_id)
            if key is not None:
                self.keys[key] = (message_id, seq, now + self.dedup_window)
            published.append(Published(message_id, seq, b"{}", False, None, key, priority, now, available_at))
        assert records == published
        self.totals["published"] += len(published)

    @rule(max_count=st.integers(0, 5), lease=st.sampled_from([None, None, 1.0, 5.0, 20.0]), dt=steps)
    def claim(self, max_count: int, lease: float | None, dt: float) -> None:
        self.tick(dt)
        expired = self.notice()
        ready = [message for message in self.live.values() if message.state is State.READY]
        ready.sort(key=lambda message: (not message.delivered, -message.priority, message.seq))
        expected = ready[:max_count]
        outcome, records = self.queue.claim("w", max_count, lease, self.now)
        deadline = self.now + (LEASE if lease is None else lease)
        claimed = [record for record, _ in outcome.deliveries]
        assert [record.id for record in claimed] == [message.id for message in expected]
        assert {(r.id, r.lease_id) for r in records if isinstance(r, LeaseExpired)} == expired
        assert records == [r for r in records if isinstance(r, LeaseExpired)] + claimed
        for record, message in zip(claimed, expected, strict=True):
            assert record.id not in self.acked
            assert isinstance(record, Claimed)
            assert record.lease_id not in self.lease_owner, "a lease id was issued twice"
            message.attempt += 1
            assert (record.attempt, record.deadline, record.consumer) == (message.attempt, deadline, "w")
            message.state, message.delivered = State.IN_FLIGHT, True
            message.lease, message.deadline = record.lease_id, deadline
            self.lease_owner[record.lease_id] = message.id
        assert outcome.ready == self.count(State.READY)

    def settle(self, kind: str, lease_ids: list[str], argument: Any, dt: float) -> None:
        self.tick(dt)
        now = self.now
        expected_records: list[Any] = []
        skipped = []
        deadlines = {}
        for lease_id in lease_ids:
            message = self.settleable(lease_id)
            event(f"{kind}: {self.lease_kind(lease_id, message)}")
            if message is None:
                skipped.append(lease_id)
                continue
            if kind == "ack":
                del self.live[message.id]
                self.acked.add(message.id)
                expected_records.append(Acked(message.id, lease_id))
            elif kind == "nack":
                wait = BACKOFF.delay(message.attempt) if argument is None else argument
                self.put_back(message, wait)
                expected_records.append(Nacked(message.id, lease_id, wait, "why"))
            elif kind == "defer":
                message.attempt -= 1
                self.put_back(message, argument)
                expected_records.append(Deferred(message.id, lease_id, argument, None))
            elif kind == "release":
                if argument:  # refund_attempt
                    message.attempt -= 1
                self.put_back(message, 0.0)
                expected_records.append(Released(message.id, lease_id, argument))
            else:
                message.state, message.deadline = State.IN_FLIGHT, now + argument
                deadlines[lease_id] = now + argument
                expected_records.append(Extended(message.id, lease_id, now + argument))
        if kind == "ack":
            outcome, records = self.queue.ack(lease_ids, now)
        elif kind == "nack":
            outcome, records = self.queue.nack(lease_ids, argument, "why", now)
        elif kind == "defer":
            outcome, records = self.queue.defer(lease_ids, argument, None, now)
        elif kind == "release":
            outcome, records = self.queue.release(lease_ids, argument, now)
        else:
            outcome, records = self.queue.extend(lease_ids, argument, now)
        assert records == expected_records
        assert outcome.settled == len(expected_records)
        assert outcome.skipped == tuple(skipped)
        if kind == "extend":
            assert outcome.deadlines == deadlines
        for stale in skipped:
            if stale in self.lease_owner:  # issued once, settles no more: must stay skipped
                assert self.settleable(stale) is None
        total = {"ack": "acked", "nack": "nacked", "defer": "deferred"}.get(kind)
        if total is not None:
            self.totals[total] += len(expected_records)

    @rule(data=st.data(), dt=steps)
    def ack(self, data: st.DataObject, dt: float) -> None:
        self.settle("ack", self.pick_leases(data), None, dt)

    @rule(data=st.data(), delay=st.sampled_from([None, None, 0.0, 2.0]), dt=steps)
    def nack(self, data: st.DataObject, delay: float | None, dt: float) -> None:
        self.settle("nack", self.pick_leases(data), delay, dt)

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
        max_depth=st.sampled_from([0, 2, MAX_DEPTH]), dedup_window=st.sampled_from([2.0, DEDUP_WINDOW, 90.0])
    )
    def update_config(self, max_depth: int, dedup_window: float) -> None:
        """Lowering max_depth below the depth, or shrinking dedup_window, must not upset publishing."""
        changes = {"max_depth": max_depth, "dedup_window": dedup_window}
        config = self.queue.config.updated(changes)
        assert self.queue.update_config(config, self.now)[1] == [QueueUpdated(config)]
        self.max_depth, self.dedup_window = max_depth, dedup_window

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
        assert self.queue.delete(message_id, self.now) == (None, [Deleted(message_id)])

    @rule(dt=steps)
    def purge(self, dt: float) -> None:
        self.tick(dt)
        gone = [m.id for m in self.live.values() if m.state in (State.READY, State.DELAYED)]
        for message_id in gone:
            del self.live[message_id]
        self.purged.update(gone)
        assert self.queue.purge(self.now) == (len(gone), [Purged(len(gone))] if gone else [])

    @rule(dt=steps)
    def stats(self, dt: float) -> None:
        self.tick(dt)
        expired = self.notice()
        snapshot, records = self.queue.stats(self.now)
        assert {(r.id, r.lease_id) for r in records} == expired
        assert all(isinstance(r, LeaseExpired) for r in records)
        oldest = next((m for m in self.live.values() if m.state is State.READY), None)
        assert snapshot.ready == self.count(State.READY)
        assert snapshot.delayed == self.count(State.DELAYED)
        assert snapshot.in_flight == self.count(State.IN_FLIGHT)
        assert snapshot.published_total == self.totals["published"]
        assert snapshot.acked_total == self.totals["acked"]
        assert snapshot.nacked_total == self.totals["nacked"]
        assert snapshot.deferred_total == self.totals["deferred"]
        assert snapshot.lease_expired_total == self.totals["lease_expired"]
        assert snapshot.oldest_ready_age == (None if oldest is None else self.now - oldest.published_at)

    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        if not self.published:
            return
        message_id = data.draw(st.sampled_from(self.published), label="id")
        self.notice()
        if message_id in self.deleted or message_id in self.purged:
            with pytest.raises(MessageNotFound):
                self.queue.get(message_id, self.now)
            return
        view, _ = self.queue.get(message_id, self.now)
        assert isinstance(view.history[0][1], Published)
        if message_id in self.acked:
            assert view.state is State.ACKED
            assert isinstance(view.history[-1][1], Acked)
        else:
            assert view.state is self.live[message_id].state

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def books_balance(self) -> None:
        live = set(self.live)
        assert len(self.published) == len(set(self.published))
        assert live | self.acked | self.deleted | self.purged == set(self.published)
        assert len(live) + len(self.acked) + len(self.deleted) + len(self.purged) == len(self.published)
        assert self.queue.depth == len(live)

    @invariant()
    def browse_matches_the_model(self) -> None:
        self.notice()
        views, _ = self.queue.browse(None, 10**6, 0, self.now)
        assert [view.id for view in views] == list(self.live)
        for view in views:
            message = self.live[view.id]
            assert (view.state, view.attempt, view.seq, view.priority) == (
                message.state,
                message.attempt,
                message.seq,
                message.priority,
            )
            if view.state is State.IN_FLIGHT:
                assert (view.lease_id, view.lease_deadline) == (message.lease, message.deadline)
            else:
                assert view.lease_id is None
            if view.state is State.DELAYED:
                assert view.available_at == message.available_at
        assert self.queue.ready_count == self.count(State.READY)

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
        assert self.queue.next_due() == min((t for t in times if t is not None), default=None)


QueueMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestQueueMachine = QueueMachine.TestCase
