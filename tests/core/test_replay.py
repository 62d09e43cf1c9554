"""Replaying a queue's records (``QueueCore.restore``) rebuilds the queue the records came from.

Hypothesis drives a live core through random commands with a clock that only moves forward, keeping
every record with the time it was produced, as the journal does; a second core restores them. The two
must then be indistinguishable: the same messages in the same states with the same histories, the same
stats, and the same answers to what comes next.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core import FinishedHistory, NewMessage, QueueConfig, QueueCore, RetryBackoff, State, commands
from broker.core import queue as queue_module
from broker.core.records import HistoryOmitted, Published, QueueUpdated, Record
from broker.errors import MessageNotFound

CONFIG = QueueConfig(
    lease=10.0,
    max_attempts=3,
    retry_backoff=RetryBackoff("exponential", 1.0, 8.0),
    dedup_window=40.0,
)
#: Small enough that replays keep few finished messages and let most of their payloads go.
HISTORY = FinishedHistory(count=6, payload_bytes=24)

operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("publish"),
            st.lists(
                st.tuples(
                    st.none() | st.sampled_from("abc"),  # key
                    st.sampled_from([0.0, 0.0, 2.0, 15.0]),  # delay
                    st.sampled_from([0, 1, -1]),  # priority
                    st.booleans(),  # replace
                ),
                min_size=1,
                max_size=3,
            ),
        ),
        st.tuples(st.just("claim"), st.integers(1, 4), st.sampled_from([None, 1.0, 30.0])),
        st.tuples(st.just("ack"), st.integers(0, 50)),
        st.tuples(st.just("nack"), st.integers(0, 50), st.sampled_from([None, 0.0, 3.0]), st.booleans()),
        st.tuples(st.just("defer"), st.integers(0, 50), st.sampled_from([0.0, 4.0])),
        st.tuples(st.just("extend"), st.integers(0, 50), st.sampled_from([1.0, 20.0])),
        st.tuples(st.just("release"), st.integers(0, 50), st.booleans()),
        st.tuples(st.just("delete"), st.integers(0, 50)),
        st.tuples(st.just("undelivered"), st.integers(0, 50)),  # toggles: is it still with a push stream?
        st.tuples(st.just("purge")),
        st.tuples(st.just("wait"), st.sampled_from([0.5, 3.0, 11.0, 45.0])),
        st.tuples(
            st.just("config"),
            st.sampled_from(
                [
                    {"message_ttl": 20},
                    {"message_ttl": 0},
                    {"max_attempts": 1},
                    {"rate_limit": {"max": 3, "per": 60}},  # its window outlives a restart
                    {"rate_limit": None},
                ]
            ),
        ),
    ),
    max_size=40,
)


def run(operations: list[tuple[Any, ...]]) -> tuple[QueueCore, list[tuple[float, Record]], float]:
    """Apply ``operations`` to a live core; return it, its records with their times, and the clock."""
    live = QueueCore("jobs", CONFIG, "m-", history=HISTORY)
    journal: list[tuple[float, Record]] = []
    leases: list[str] = []
    ids: list[str] = []
    undelivered: set[str] = set()  # leases whose running out is a release with the attempt refunded
    live.undelivered = lambda _, lease_id: lease_id in undelivered
    now = 1000.0

    def pick(items: list[str], index: int) -> list[str]:
        return [items[index % len(items)]] if items else []

    for operation in operations:
        name = operation[0]
        command: Any
        if name == "wait":
            now += operation[1]
            continue
        if name == "undelivered":
            undelivered.symmetric_difference_update(pick(leases, operation[1]))
            continue
        if name == "publish":
            command = commands.Publish(
                [
                    NewMessage(f'"{now}"'.encode(), key=key, delay=delay, priority=priority, replace=replace)
                    for key, delay, priority, replace in operation[1]
                    if key is not None or not replace
                ]
            )
        elif name == "claim":
            command = commands.Claim("w", operation[1], operation[2])
        elif name == "ack":
            command = commands.Ack(pick(leases, operation[1]))
        elif name == "nack":
            command = commands.Nack(pick(leases, operation[1]), operation[2], "r", retryable=operation[3])
        elif name == "defer":
            command = commands.Defer(pick(leases, operation[1]), operation[2])
        elif name == "extend":
            command = commands.Extend(pick(leases, operation[1]), operation[2])
        elif name == "release":
            command = commands.Release(pick(leases, operation[1]), operation[2])
        elif name == "delete":
            if not ids:
                continue
            command = commands.DeleteMessage(ids[operation[1] % len(ids)])
        elif name == "purge":
            command = commands.Purge()
        else:
            command = commands.UpdateConfig(operation[1])
        try:
            answer, records = live.apply(command, now)
        except Exception:  # refused commands (a deleted id) change nothing and journal nothing
            continue
        journal.extend((now, record) for record in records)
        for record in records:
            if isinstance(record, Published):
                ids.append(record.id)
        if name == "claim":
            leases.extend(claimed.lease_id for claimed, _ in answer.deliveries)
    live.undelivered = None  # from here on, both are observed alike
    return live, journal, now


def observe(queue: QueueCore, ids: list[str], now: float) -> dict[str, Any]:
    """Everything a client can see, at ``now`` (which notices what came due, on both alike)."""
    stats, _ = queue.stats(now)
    seen: dict[str, Any] = {"stats": stats}
    for message_id in ids:
        try:
            seen[message_id], _ = queue.get(message_id, now)
        except Exception as error:
            seen[message_id] = type(error).__name__
    seen["moved out"] = list(queue.outbox)  # live: handed on; restored: to be matched by recovery
    seen["leases"] = queue.find_leases(ids, now)  # what settles each by id (qhook, Cloudflare)
    claimed, _ = queue.claim("next", 100, None, now)
    seen["next claim"] = [(record, message.payload) for record, message in claimed.deliveries]
    seen["next publish"] = queue.publish([NewMessage(b"1", key=key) for key in "abc"], now)[0]
    return seen


@settings(max_examples=300, deadline=None)
@given(operations)
def test_restoring_the_records_rebuilds_the_queue(operations: list[tuple[Any, ...]]) -> None:
    live, journal, now = run(operations)
    restored = QueueCore("jobs", CONFIG, "m-", history=HISTORY)
    for at, record in journal:
        restored.restore(record, at)
    ids = [record.id for _, record in journal if isinstance(record, Published)]
    assert observe(restored, ids, now + 1) == observe(live, ids, now + 1)


def history_of(queue: QueueCore, message_id: str, now: float) -> tuple[tuple[float, Any], ...] | None:
    """The history get-one shows, None for a message it no longer knows."""
    try:
        return queue.get(message_id, now)[0].history
    except MessageNotFound:
        return None


#: Operations that take a few messages round and round (claimed, deferred, released, run out), so
#: that their histories grow past a small cap, amid replaces, expiries, dead letters and acks. A
#: negative index picks one of the newest leases (``pick`` takes it modulo their number).
newest = st.integers(-2, -1)
looping_operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("publish"),
            st.lists(
                st.tuples(st.sampled_from("ab"), st.sampled_from([0.0, 2.0]), st.just(0), st.booleans()),
                min_size=1,
                max_size=2,
            ),
        ),
        st.tuples(st.just("claim"), st.integers(1, 2), st.sampled_from([None, 1.0])),
        st.tuples(st.just("claim"), st.integers(1, 2), st.sampled_from([None, 1.0])),
        st.tuples(st.just("defer"), newest, st.just(0.0)),
        st.tuples(st.just("defer"), newest, st.just(0.0)),
        st.tuples(st.just("release"), newest, st.booleans()),
        st.tuples(st.just("extend"), newest, st.just(20.0)),
        st.tuples(st.just("nack"), newest, st.just(0.0), st.just(True)),
        st.tuples(st.just("ack"), st.integers(0, 50)),
        st.tuples(st.just("undelivered"), newest),
        st.tuples(st.just("wait"), st.sampled_from([0.5, 3.0, 45.0])),
        st.tuples(st.just("config"), st.sampled_from([{"message_ttl": 60}, {"max_attempts": 0}])),
    ),
    min_size=40,
    max_size=100,
)


@settings(max_examples=200, deadline=None)
@given(looping_operations)
def test_histories_past_a_small_cap_are_trimmed_alike_live_restored_and_loaded(
    operations: list[tuple[Any, ...]],
) -> None:
    # MAX_HISTORY (1,000) is out of reach here: a cap of 5, trimmed 2 at a time, is not.
    with patch.object(queue_module, "MAX_HISTORY", 5), patch.object(queue_module, "HISTORY_TRIM", 2):
        live, journal, now = run(operations)
        journal += [(now, record) for record in live.notice_due(now)]  # what get-one would notice
        restored = QueueCore("jobs", CONFIG, "m-", history=HISTORY)
        for at, record in journal:
            restored.restore(record, at)
        loaded = QueueCore.load(live.dump(), history=HISTORY)
        ids = [record.id for _, record in journal if isinstance(record, Published)]
        for message_id in ids:
            shown = history_of(live, message_id, now)
            assert history_of(restored, message_id, now) == history_of(loaded, message_id, now) == shown
            if shown is None:
                continue
            assert len(shown) <= 5 + 1  # and the publish, which a plain one's history does not store
            omitted = sum(record.count for _, record in shown if isinstance(record, HistoryOmitted))
            everything = [record for _, record in journal if getattr(record, "id", None) == message_id]
            assert omitted + len(shown) - (1 if omitted else 0) == len(everything)
        assert observe(restored, ids, now + 1) == observe(live, ids, now + 1)


def test_a_config_change_is_restored_before_what_follows_it() -> None:
    live = QueueCore("jobs", CONFIG, "m-")
    records = live.apply(commands.UpdateConfig({"lease": 5}), 0.0)[1]
    assert records == [QueueUpdated(CONFIG.updated({"lease": 5}))]
    restored = QueueCore("jobs", CONFIG, "m-")
    restored.restore(records[0], 0.0)
    assert restored.config.lease == 5


def observe_state(queue: QueueCore, now: float) -> dict[str, Any]:
    """What a snapshot must keep: the live messages (without their history), stats, and what the next
    claim and publish get."""
    stats, _ = queue.stats(now)
    views, _ = queue.browse(None, 10_000, 0, now)
    leases = queue.find_leases([view.id for view in views], now)  # what settles each by id
    claimed, _ = queue.claim("next", 100, None, now)
    return {
        "stats": stats,
        "messages": [view._replace(history=()) for view in views],
        "leases": leases,
        "next claim": [(record, message.payload) for record, message in claimed.deliveries],
        "next publish": queue.publish([NewMessage(b"1", key=key) for key in "abc"], now)[0],
    }


@settings(max_examples=200, deadline=None)
@given(operations)
def test_a_snapshot_image_loads_into_the_same_queue(operations: list[tuple[Any, ...]]) -> None:
    live, _, now = run(operations)
    ready_when_dumped = {m.id for m in live._messages.values() if m.state is State.READY and not m.deliveries}
    loaded = QueueCore.load(live.dump())
    # docs/api.md: a message never delivered counts, once loaded, from its publish rather than from
    # when a delay it had ended, if the image shows it ready (a live queue's image no longer says when
    # that delay ended; the broker's own snapshots are written from replayed records, which keep such
    # a message delayed until a later record of it, and so say when its delay ends).
    live.stats(now + 1)  # notices what came due, as observe_state will
    waits = [
        message.published_at if message.id in ready_when_dumped else message.ready_at
        for message in live._messages.values()
        if message.state is State.READY
    ]
    expected_age = None if not waits else now + 1 - min(waits)
    observed_loaded, observed_live = observe_state(loaded, now + 1), observe_state(live, now + 1)
    assert observed_loaded["stats"].oldest_ready_age == expected_age
    observed_loaded["stats"] = dataclasses.replace(observed_loaded["stats"], oldest_ready_age=None)
    observed_live["stats"] = dataclasses.replace(observed_live["stats"], oldest_ready_age=None)
    assert observed_loaded == observed_live
