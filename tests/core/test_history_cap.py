"""A message's history is capped at ``MAX_HISTORY`` entries, the dropped ones counted.

A message delivered again and again (deferred forever, a poison message whose lease keeps running out
with no ``max_attempts``) would otherwise grow its history, its get-one answer and its snapshot without
bound. Past the cap the oldest entries after the first go, ``HISTORY_TRIM`` at a time, and a
``HistoryOmitted`` entry second in the history counts them. The same records replayed, or the queue
dumped and loaded, give the same history as the live queue.
"""

from __future__ import annotations

from typing import Any

from broker.clock import format_time
from broker.core import NewMessage, QueueConfig, QueueCore
from broker.core.queue import HISTORY_TRIM, MAX_HISTORY
from broker.core.records import Claimed, HistoryOmitted, Published, Record, Replaced
from broker.http.render import history_entry, message_view

Entry = tuple[float, Any]


class Recorded:
    """A live queue, and every record it produced with its time, as the journal keeps them."""

    def __init__(self, **config: Any) -> None:
        self.queue = QueueCore("jobs", QueueConfig(**config), "m-")
        self.journal: list[tuple[float, Record]] = []

    def __call__(self, result: tuple[Any, list[Record]], now: float) -> Any:
        answer, records = result
        self.journal += [(now, record) for record in records]
        return answer

    def of(self, message_id: str) -> list[Entry]:
        """Every record about ``message_id``: its whole history, as the journal has it."""
        return [(at, record) for at, record in self.journal if getattr(record, "id", None) == message_id]

    def replayed(self) -> QueueCore:
        core = QueueCore("jobs", self.queue.config, "m-")
        for at, record in self.journal:
            core.restore(record, at)
        return core


def cycle(recorded: Recorded, now: float) -> None:
    """Claim the one ready message and defer it at once (a consumer that never gets to it)."""
    queue = recorded.queue
    outcome = recorded(queue.claim("worker", 1, None, now), now)
    [(claimed, _)] = outcome.deliveries
    recorded(queue.defer([claimed.lease_id], 0.0, None, now), now)


def a_deferred_message(cycles: int, **config: Any) -> tuple[Recorded, str, float]:
    """A message claimed and deferred ``cycles`` times; the history length is checked after each."""
    recorded = Recorded(**config)
    queue = recorded.queue
    now = 1000.0
    [(message_id, _, _)] = recorded(queue.publish([NewMessage(b'"x"')], now), now)
    for _ in range(cycles):
        now += 1.0
        cycle(recorded, now)
        assert len(stored_history(queue, message_id)) <= MAX_HISTORY
    return recorded, message_id, now


def stored_history(queue: QueueCore, message_id: str) -> list[Entry]:
    message = queue._messages.get(message_id) or queue._finished[message_id]
    return message.history or []


def assert_kept_and_counted(history: list[Entry], everything: list[Entry], before: int = 1) -> None:
    """``history`` holds the first ``before`` entries of ``everything``, then an omitted entry counting
    exactly what is missing, stamped with the first missing entry's time, then all the rest."""
    (at, note) = history[before]
    assert type(note) is HistoryOmitted
    kept = history[before + 1 :]
    assert history[:before] == everything[:before]
    assert note.count == len(everything) - before - len(kept)
    assert at == everything[before][0]
    assert kept == everything[len(everything) - len(kept) :]


def test_a_history_past_the_cap_keeps_its_first_entry_and_counts_what_it_dropped() -> None:
    recorded, message_id, _ = a_deferred_message(2_500)
    history = stored_history(recorded.queue, message_id)
    everything = recorded.of(message_id)[1:]  # a plain publish's record is not stored (_with_published)
    assert len(everything) == 5_000
    assert isinstance(history[0][1], Claimed)
    assert_kept_and_counted(history, everything)
    assert len(history) - 2 >= MAX_HISTORY - HISTORY_TRIM - 1  # at least the last 899 kept
    # Get-one shows the publish, the first claim, the omitted entry, and the newest entries.
    view, _ = recorded.queue.get(message_id, 4_000.0)
    assert isinstance(view.history[0][1], Published)
    assert view.history[1:] == tuple(history)


def test_the_omitted_count_grows_by_one_trim_per_hundred_appends_and_stays_exact() -> None:
    recorded, message_id, now = a_deferred_message(500)  # 1,000 entries: at the cap, nothing dropped
    assert stored_history(recorded.queue, message_id) == recorded.of(message_id)[1:]
    counts = []
    for _ in range(200):  # 400 entries more
        now += 1.0
        cycle(recorded, now)
        history = stored_history(recorded.queue, message_id)
        assert_kept_and_counted(history, recorded.of(message_id)[1:])
        counts.append(history[1][1].count)
    # Trimmed at the 1,001st entry, then once every HISTORY_TRIM entries.
    assert sorted(set(counts)) == [n * HISTORY_TRIM for n in range(1, 6)]


def test_a_replay_of_the_journal_and_a_dump_and_load_give_the_live_history() -> None:
    recorded, message_id, now = a_deferred_message(1_234)
    live = recorded.queue
    replayed = recorded.replayed()
    loaded = QueueCore.load(live.dump())
    assert stored_history(replayed, message_id) == stored_history(live, message_id)
    assert stored_history(loaded, message_id) == stored_history(live, message_id)
    assert loaded.dump() == replayed.dump() == live.dump()
    # And they go on trimming alike.
    for queue in (live, replayed, loaded):
        going_on = Recorded()
        going_on.queue = queue
        for step in range(150):
            cycle(going_on, now + 1 + step)
    assert stored_history(replayed, message_id) == stored_history(live, message_id)
    assert stored_history(loaded, message_id) == stored_history(live, message_id)


def test_a_replace_after_the_cap_puts_the_publish_first_and_the_count_stays_exact() -> None:
    # A replace stores the record of a plain publish before the first entry (``_with_published``):
    # the omitted entry is then third, and stays so.
    recorded = Recorded()
    queue = recorded.queue
    now = 1000.0
    [(message_id, _, _)] = recorded(queue.publish([NewMessage(b'"a"', key="k")], now), now)
    for step in range(600):
        cycle(recorded, now + 1 + step)
    now += 1_000.0
    recorded(queue.publish([NewMessage(b'"b"', key="k", replace=True)], now), now)
    for step in range(300):
        cycle(recorded, now + 1 + step)
    history = stored_history(queue, message_id)
    assert len(history) <= MAX_HISTORY
    assert isinstance(history[0][1], Published) and isinstance(history[1][1], Claimed)
    assert_kept_and_counted(history, recorded.of(message_id), before=2)
    assert stored_history(recorded.replayed(), message_id) == history
    assert stored_history(QueueCore.load(queue.dump()), message_id) == history


def test_a_replace_before_the_cap_keeps_the_publish_and_the_entry_after_it_too() -> None:
    # The same promise as a replace after the cap: the publish and the entry after it stay first.
    recorded = Recorded()
    queue = recorded.queue
    now = 1000.0
    [(message_id, _, _)] = recorded(queue.publish([NewMessage(b'"a"', key="k")], now), now)
    recorded(queue.publish([NewMessage(b'"b"', key="k", replace=True)], now + 1), now + 1)
    for step in range(600):
        cycle(recorded, now + 2 + step)
    history = stored_history(queue, message_id)
    assert len(history) <= MAX_HISTORY
    assert [type(record) for _, record in history[:3]] == [Published, Replaced, HistoryOmitted]
    assert_kept_and_counted(history, recorded.of(message_id), before=2)
    assert stored_history(recorded.replayed(), message_id) == history
    assert stored_history(QueueCore.load(queue.dump()), message_id) == history


def test_an_ack_past_the_cap_trims_as_a_replay_does() -> None:
    recorded, message_id, now = a_deferred_message(549)  # 1,098 entries: trimmed to 998
    queue = recorded.queue
    outcome = recorded(queue.claim("worker", 1, None, now + 1), now + 1)
    [(claimed, _)] = outcome.deliveries
    assert len(stored_history(queue, message_id)) == MAX_HISTORY  # the ack is the 1,001st
    recorded(queue.ack([claimed.lease_id], now + 2), now + 2)
    history = stored_history(queue, message_id)
    assert len(history) <= MAX_HISTORY
    assert_kept_and_counted(history, recorded.of(message_id)[1:])
    assert stored_history(recorded.replayed(), message_id) == history


def test_a_poison_message_whose_lease_keeps_running_out_keeps_a_bounded_history() -> None:
    recorded = Recorded(lease=1.0)  # max_attempts 0: it comes back forever
    queue = recorded.queue
    now = 1000.0
    [(message_id, _, _)] = recorded(queue.publish([NewMessage(b'"x"')], now), now)
    for _ in range(1_500):
        recorded(queue.claim("worker", 1, None, now), now)
        assert len(stored_history(queue, message_id)) <= MAX_HISTORY  # checked after the claim's append
        now += 2.0  # the lease runs out; the next claim notices it and delivers again
    history = stored_history(queue, message_id)
    assert len(history) <= MAX_HISTORY
    assert_kept_and_counted(history, recorded.of(message_id)[1:])
    assert stored_history(recorded.replayed(), message_id) == history


def test_get_one_renders_the_omitted_entry_between_the_first_and_the_kept_ones() -> None:
    recorded, message_id, _ = a_deferred_message(600)
    view, _ = recorded.queue.get(message_id, 3_000.0)
    rendered = message_view(view, False, with_history=True)["history"]
    assert [entry["event"] for entry in rendered[:4]] == ["published", "claimed", "omitted", "deferred"]
    first_dropped_at, _ = recorded.of(message_id)[2]
    dropped = 1_200 - 1 - (len(view.history) - 3)  # all entries but the publish, less those shown
    assert rendered[2] == {"event": "omitted", "at": format_time(first_dropped_at), "count": dropped}
    assert history_entry(*view.history[2]) == rendered[2]
