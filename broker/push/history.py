"""The push attempts of recent messages, kept in memory by each queue's dispatcher.

Bounded twice: the newest ``MESSAGES`` messages, each with its newest ``PER_MESSAGE`` attempts. Not
journaled (the journal format stays as it is): the core's own history already shows each push's claim
and its settlement (consumer ``push``, with the reason naming the HTTP status); this adds what only
the dispatcher saw: the status code or error, and how long the receiver took. A restart forgets it.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque

from broker.push.request import Attempt


class History:
    MESSAGES = 10_000
    PER_MESSAGE = 50

    def __init__(self) -> None:
        self._entries: OrderedDict[str, deque[Attempt]] = OrderedDict()

    def add(self, message_id: str, attempt: Attempt) -> None:
        entries = self._entries.get(message_id)
        if entries is None:
            entries = self._entries[message_id] = deque(maxlen=self.PER_MESSAGE)
            if len(self._entries) > self.MESSAGES:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(message_id)
        entries.append(attempt)

    def settled(self, message_id: str, outcome: str) -> None:
        """The push awaiting its callback (ack mode) got it: its ``awaiting_ack`` becomes ``outcome``."""
        entries = self._entries.get(message_id)
        if entries and entries[-1].outcome == "awaiting_ack":
            entries[-1] = dataclasses.replace(entries[-1], outcome=outcome)

    def of(self, message_id: str) -> list[Attempt] | None:
        """The message's attempts, oldest first; ``None`` when none is remembered."""
        entries = self._entries.get(message_id)
        return None if entries is None else list(entries)
