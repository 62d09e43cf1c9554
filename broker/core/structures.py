"""Priority structures whose common case costs O(1), so claiming stays flat as a queue grows.

Fresh messages arrive in ``seq`` order and leases are mostly granted with the same duration, so both
are *mostly* ordered: a deque takes every entry that does not go backwards, and a small heap takes the
few that do (a delayed publish becoming due, a lease granted with a shorter override). Popping the
minimum compares the two heads. Entries are ``(key, ticket, message)`` tuples; ``ticket`` is unique,
so ties never compare messages, and an entry is live only while ``message.ticket == ticket``.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from typing import Any

from broker.core.model import Message

Entry = tuple[Any, int, Message]


def is_live(entry: Entry) -> bool:
    return entry[2].ticket == entry[1]


class MostlyOrderedQueue:
    """A min-queue of entries, O(1) for in-order pushes, O(log n) for the rest."""

    __slots__ = ("_in_order", "_out_of_order")

    def __init__(self) -> None:
        self._in_order: deque[Entry] = deque()
        self._out_of_order: list[Entry] = []

    def __len__(self) -> int:
        return len(self._in_order) + len(self._out_of_order)

    def push(self, entry: Entry) -> None:
        in_order = self._in_order
        if not in_order or entry[0] >= in_order[-1][0]:
            in_order.append(entry)
        else:
            heapq.heappush(self._out_of_order, entry)

    def extend_sorted(self, entries: list[Entry]) -> None:
        """Push ``entries``, already in key order: one deque extend when they follow the last entry."""
        in_order = self._in_order
        if entries and (not in_order or entries[0][0] >= in_order[-1][0]):
            in_order.extend(entries)
        else:
            for entry in entries:
                self.push(entry)

    def peek_live(self) -> Entry | None:
        """The smallest live entry, dropping stale ones on the way; ``None`` when none is left."""
        in_order, out_of_order = self._in_order, self._out_of_order
        while True:
            if in_order:
                if out_of_order and out_of_order[0] < in_order[0]:
                    entry = out_of_order[0]
                    if entry[2].ticket == entry[1]:
                        return entry
                    heapq.heappop(out_of_order)
                    continue
                entry = in_order[0]
                if entry[2].ticket == entry[1]:
                    return entry
                in_order.popleft()
            elif out_of_order:
                entry = out_of_order[0]
                if entry[2].ticket == entry[1]:
                    return entry
                heapq.heappop(out_of_order)
            else:
                return None

    def pop_live(self) -> Message | None:
        """Remove and return the message of the smallest live entry, or ``None``."""
        entry = self.peek_live()
        if entry is None:
            return None
        in_order = self._in_order
        if in_order and in_order[0] is entry:
            in_order.popleft()
        else:
            heapq.heappop(self._out_of_order)
        return entry[2]

    def pop_many(self, count: int, into: list[Message]) -> None:
        """Append the messages of up to ``count`` smallest live entries to ``into``, removing them."""
        in_order, out_of_order = self._in_order, self._out_of_order
        popleft = in_order.popleft
        while count > 0:
            if out_of_order:
                message = self.pop_live()
                if message is None:
                    return
                into.append(message)
                count -= 1
                continue
            if not in_order:
                return
            _, ticket, message = popleft()
            if message.ticket == ticket:
                into.append(message)
                count -= 1

    def first_arrivals(self) -> list[Message]:
        """The live messages that arrived first, dropping stale entries at the heads: the first of the
        in-order part (which arrived in key order) and every out-of-order one (the few)."""
        out_of_order = self._out_of_order
        while out_of_order and out_of_order[0][2].ticket != out_of_order[0][1]:
            heapq.heappop(out_of_order)
        found = [entry[2] for entry in out_of_order if entry[2].ticket == entry[1]]
        in_order = self._in_order
        while in_order and in_order[0][2].ticket != in_order[0][1]:
            in_order.popleft()
        if in_order:
            found.append(in_order[0][2])
        return found

    def compact(self) -> None:
        """Drop every stale entry (O(n)); for when stale entries pile up behind a live head."""
        self._in_order = deque(e for e in self._in_order if e[2].ticket == e[1])
        self._out_of_order = [e for e in self._out_of_order if e[2].ticket == e[1]]
        heapq.heapify(self._out_of_order)

    def clear(self) -> None:
        self._in_order.clear()
        self._out_of_order.clear()


class ReadyLanes:
    """Fresh ready messages: one lane per priority, highest priority first, lower ``seq`` first within."""

    __slots__ = ("_lanes", "_priorities")

    def __init__(self) -> None:
        self._lanes: dict[int, MostlyOrderedQueue] = {}
        self._priorities: list[int] = []  # negated priorities, ascending: highest priority first

    def lane(self, priority: int) -> MostlyOrderedQueue:
        """The lane of ``priority``, made on first use; push ``(seq, ticket, message)`` entries."""
        lane = self._lanes.get(priority)
        if lane is None:
            lane = self._lanes[priority] = MostlyOrderedQueue()
            bisect.insort(self._priorities, -priority)
        return lane

    def push(self, message: Message, ticket: int) -> None:
        self.lane(message.priority).push((message.seq, ticket, message))

    def extend_sorted(self, priority: int, entries: list[Entry]) -> None:
        """Push ``(seq, ticket, message)`` entries of ``priority``, already in ``seq`` order."""
        self.lane(priority).extend_sorted(entries)

    def pop_many(self, count: int, into: list[Message]) -> None:
        """Append up to ``count`` messages to ``into``, highest priority first, removing them."""
        lanes, priorities = self._lanes, self._priorities
        wanted = len(into) + count
        while priorities and len(into) < wanted:
            priority = -priorities[0]
            lanes[priority].pop_many(wanted - len(into), into)
            if len(into) < wanted:  # that lane ran dry
                del lanes[priority]
                priorities.pop(0)

    def __len__(self) -> int:
        """Entries in every lane, stale ones included (O(priorities))."""
        return sum(map(len, self._lanes.values()))

    def first_arrivals(self) -> list[Message]:
        """``MostlyOrderedQueue.first_arrivals`` of every lane."""
        return [message for lane in self._lanes.values() for message in lane.first_arrivals()]

    def compact(self) -> None:
        """Drop every stale entry of every lane, and the lanes left empty (O(n)): stale entries of
        messages that left without being claimed (a TTL, a delete) are otherwise only dropped by the
        claims that reach them, and keep those messages in memory until then."""
        for priority, lane in list(self._lanes.items()):
            lane.compact()
            if not lane:
                del self._lanes[priority]
                self._priorities.remove(-priority)

    def clear(self) -> None:
        self._lanes.clear()
        self._priorities.clear()
