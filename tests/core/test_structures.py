"""``MostlyOrderedQueue`` and ``ReadyLanes``: ordering, stale entries, compaction."""

from __future__ import annotations

import itertools

from broker.core.model import READY, Message
from broker.core.structures import MostlyOrderedQueue, ReadyLanes, is_live

_tickets = itertools.count(1)


def a_message(seq: int, priority: int = 0) -> Message:
    return Message(f"m-{seq}", seq, b"{}", False, None, None, priority, 0.0, None, READY)


def entry(key: float, message: Message) -> tuple[float, int, Message]:
    """A live entry for ``message``: it takes a new ticket, which turns its earlier entries stale."""
    ticket = message.ticket = next(_tickets)
    return (key, ticket, message)


def drain(queue: MostlyOrderedQueue) -> list[str]:
    taken: list[Message] = []
    queue.pop_many(10**6, taken)
    return [message.id for message in taken]


# -- MostlyOrderedQueue --------------------------------------------------------------------------


def test_an_entry_is_live_while_its_ticket_is_the_message_s() -> None:
    message = a_message(1)
    first = entry(1, message)
    assert is_live(first)
    second = entry(2, message)
    assert (is_live(first), is_live(second)) == (False, True)
    message.ticket = 0
    assert not is_live(second)


def test_empty_queue() -> None:
    queue = MostlyOrderedQueue()
    assert len(queue) == 0
    assert queue.peek_live() is None
    assert queue.pop_live() is None
    taken: list[Message] = []
    queue.pop_many(3, taken)
    assert taken == []


def test_in_order_pushes_come_out_in_order() -> None:
    queue = MostlyOrderedQueue()
    messages = [a_message(seq) for seq in range(1, 6)]
    for message in messages:
        queue.push(entry(message.seq, message))
    assert len(queue) == 5
    assert drain(queue) == ["m-1", "m-2", "m-3", "m-4", "m-5"]
    assert len(queue) == 0


def test_out_of_order_pushes_come_out_sorted() -> None:
    queue = MostlyOrderedQueue()
    keys = [10, 20, 5, 30, 15, 1, 30, 25, 2]
    messages = [a_message(seq) for seq in range(len(keys))]
    for key, message in zip(keys, messages, strict=True):
        queue.push(entry(key, message))
    popped = []
    while (head := queue.peek_live()) is not None:
        assert queue.pop_live() is head[2]
        popped.append(head[0])
    assert popped == sorted(keys)


def test_equal_keys_come_out_in_push_order() -> None:
    queue = MostlyOrderedQueue()
    first, second, third = a_message(1), a_message(2), a_message(3)
    queue.push(entry(5, first))
    queue.push(entry(5, second))
    queue.push(entry(5, third))
    assert drain(queue) == ["m-1", "m-2", "m-3"]


def test_stale_entries_are_skipped_wherever_they_sit() -> None:
    queue = MostlyOrderedQueue()
    a, b, c, d = (a_message(seq) for seq in (1, 2, 3, 4))
    queue.push(entry(1, a))
    queue.push(entry(2, b))
    queue.push(entry(3, c))
    queue.push(entry(0.5, d))  # out of order
    queue.push(entry(4, a))  # a moved: its entry at 1 is stale now
    d.ticket = 0  # d left the structure: its entry is stale
    assert queue.peek_live() == (2, b.ticket, b)
    assert drain(queue) == ["m-2", "m-3", "m-1"]


def test_peek_drops_stale_heads_but_keeps_the_live_one() -> None:
    queue = MostlyOrderedQueue()
    a, b = a_message(1), a_message(2)
    queue.push(entry(1, a))
    queue.push(entry(2, b))
    a.ticket = 0
    assert queue.peek_live() == (2, b.ticket, b)
    assert len(queue) == 1
    assert queue.peek_live() == (2, b.ticket, b)
    assert queue.pop_live() is b
    assert queue.peek_live() is None


def test_pop_many_respects_count_and_appends() -> None:
    queue = MostlyOrderedQueue()
    messages = [a_message(seq) for seq in range(1, 8)]
    for message in reversed(messages):  # every push after the first goes out of order
        queue.push(entry(message.seq, message))
    taken = [a_message(99)]
    queue.pop_many(3, taken)
    assert [message.id for message in taken] == ["m-99", "m-1", "m-2", "m-3"]
    queue.pop_many(0, taken)
    assert len(taken) == 4
    assert drain(queue) == ["m-4", "m-5", "m-6", "m-7"]


def test_pop_many_interleaves_the_two_halves() -> None:
    queue = MostlyOrderedQueue()
    for key in (2, 4, 6, 8):
        queue.push(entry(key, a_message(key)))
    for key in (1, 3, 7):  # all behind the tail of the in-order run
        queue.push(entry(key, a_message(key)))
    assert drain(queue) == ["m-1", "m-2", "m-3", "m-4", "m-6", "m-7", "m-8"]


def test_compact_drops_every_stale_entry_and_keeps_order() -> None:
    queue = MostlyOrderedQueue()
    messages = [a_message(seq) for seq in range(1, 11)]
    for message in messages[::2]:
        queue.push(entry(message.seq, message))
    for message in messages[1::2]:
        queue.push(entry(message.seq, message))
    for message in messages[:6]:
        message.ticket = 0
    assert len(queue) == 10
    queue.compact()
    assert len(queue) == 4
    assert drain(queue) == ["m-7", "m-8", "m-9", "m-10"]


def test_clear() -> None:
    queue = MostlyOrderedQueue()
    queue.push(entry(2, a_message(1)))
    queue.push(entry(1, a_message(2)))
    queue.clear()
    assert len(queue) == 0
    assert queue.peek_live() is None


# -- ReadyLanes ----------------------------------------------------------------------------------


def push(lanes: ReadyLanes, *messages: Message) -> None:
    for message in messages:
        message.ticket = next(_tickets)
        lanes.push(message, message.ticket)


def pop(lanes: ReadyLanes, count: int) -> list[str]:
    taken: list[Message] = []
    lanes.pop_many(count, taken)
    return [message.id for message in taken]


def test_lanes_serve_highest_priority_first_then_lowest_seq() -> None:
    lanes = ReadyLanes()
    push(
        lanes,
        a_message(1, priority=0),
        a_message(2, priority=5),
        a_message(3, priority=-2),
        a_message(4, priority=5),
        a_message(5, priority=0),
    )
    assert pop(lanes, 10) == ["m-2", "m-4", "m-1", "m-5", "m-3"]
    assert pop(lanes, 10) == []


def test_pop_many_crosses_priorities_and_stops_at_count() -> None:
    lanes = ReadyLanes()
    push(lanes, *(a_message(seq, priority=seq % 3) for seq in range(1, 10)))
    assert pop(lanes, 4) == ["m-2", "m-5", "m-8", "m-1"]
    assert pop(lanes, 1) == ["m-4"]
    assert pop(lanes, 10) == ["m-7", "m-3", "m-6", "m-9"]


def test_pop_many_appends_after_what_is_already_taken() -> None:
    lanes = ReadyLanes()
    push(lanes, a_message(1), a_message(2), a_message(3))
    taken = [a_message(0)]
    lanes.pop_many(2, taken)
    assert [message.id for message in taken] == ["m-0", "m-1", "m-2"]


def test_out_of_order_seq_within_a_lane() -> None:
    lanes = ReadyLanes()
    push(lanes, a_message(5), a_message(9), a_message(2), a_message(7))
    assert pop(lanes, 10) == ["m-2", "m-5", "m-7", "m-9"]


def test_stale_entries_are_skipped_in_every_lane() -> None:
    lanes = ReadyLanes()
    messages = [a_message(seq, priority=seq % 2) for seq in range(1, 7)]
    push(lanes, *messages)
    messages[0].ticket = 0  # m-1, priority 1
    messages[1].ticket = 0  # m-2, priority 0
    push(lanes, messages[2])  # m-3 re-pushed: only the new entry is live
    assert pop(lanes, 10) == ["m-3", "m-5", "m-4", "m-6"]


def test_a_lane_that_ran_dry_is_made_again_on_the_next_push() -> None:
    lanes = ReadyLanes()
    push(lanes, a_message(1, priority=3), a_message(2, priority=0))
    assert pop(lanes, 1) == ["m-1"]
    assert pop(lanes, 5) == ["m-2"]  # both lanes dry now
    push(lanes, a_message(3, priority=0), a_message(4, priority=3))
    assert pop(lanes, 5) == ["m-4", "m-3"]


def test_a_lane_of_only_stale_entries_is_passed_over() -> None:
    lanes = ReadyLanes()
    high, low = a_message(1, priority=9), a_message(2, priority=1)
    push(lanes, high, low)
    high.ticket = 0
    assert pop(lanes, 1) == ["m-2"]


def test_lane_gives_the_same_queue_for_a_priority() -> None:
    lanes = ReadyLanes()
    lane = lanes.lane(4)
    assert lanes.lane(4) is lane
    message = a_message(1, priority=4)
    lane.push(entry(message.seq, message))
    assert pop(lanes, 2) == ["m-1"]


def test_clear_forgets_every_lane() -> None:
    lanes = ReadyLanes()
    push(lanes, a_message(1, priority=1), a_message(2, priority=2))
    lanes.clear()
    assert pop(lanes, 5) == []
    push(lanes, a_message(3, priority=1))
    assert pop(lanes, 5) == ["m-3"]


def test_first_arrivals_drops_stale_heads_of_the_out_of_order_part() -> None:
    queue = MostlyOrderedQueue()
    late = [a_message(seq) for seq in (1, 2, 3)]
    queue.push(entry(10, a_message(10)))
    for message in late:  # behind the tail: the out-of-order part
        queue.push(entry(message.seq, message))
    late[0].ticket = late[1].ticket = 0  # left the queue unclaimed (a TTL ran out)
    assert [message.id for message in queue.first_arrivals()] == ["m-3", "m-10"]
    assert len(queue) == 2


def test_lanes_compact_drops_stale_entries_and_empty_lanes_and_keeps_order() -> None:
    lanes = ReadyLanes()
    messages = [a_message(seq, priority=seq % 3) for seq in range(1, 13)]
    push(lanes, *messages[::2])
    push(lanes, *messages[1::2])  # behind each lane's tail: out of order
    for message in messages:
        if message.priority == 1 or message.seq > 9:
            message.ticket = 0
    assert len(lanes) == 12
    lanes.compact()
    assert len(lanes) == 6
    assert pop(lanes, 20) == ["m-2", "m-5", "m-8", "m-3", "m-6", "m-9"]
    push(lanes, a_message(13, priority=1))  # the emptied lane is made again on use
    assert pop(lanes, 1) == ["m-13"]
