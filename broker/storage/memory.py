"""A journal kept in memory: every record is committed the moment it is appended.

It is the journal of tests and of a broker started without durable storage, the fake of the durable
one: tests/storage/test_journal_contract.py runs the same suite over both. It keeps the newest
``retain`` records so a long-running broker does not grow without bound.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

from broker.core.records import Record
from broker.storage.journal import CommitWaiter, JournalEntry

DEFAULT_RETAIN = 100_000


class InMemoryJournal:
    def __init__(self, retain: int = DEFAULT_RETAIN) -> None:
        self._retain = retain
        self._held = 0
        # One entry per append: (first lsn, at, queue, records); cheaper than one tuple per record.
        self._batches: deque[tuple[int, float, str, Sequence[Record]]] = deque()
        self._last_lsn = 0

    @property
    def last_lsn(self) -> int:
        return self._last_lsn

    @property
    def healthy(self) -> bool:
        return True

    def has_room(self) -> bool:
        return True

    def append(self, queue: str, at: float, records: Sequence[Record]) -> int:
        if records:
            self._batches.append((self._last_lsn + 1, at, queue, records))
            self._last_lsn += len(records)
            self._held += len(records)
            while self._held > self._retain:
                self._held -= len(self._batches.popleft()[3])
        return self._last_lsn

    def commit_then(self, lsn: int, waiter: CommitWaiter) -> None:
        waiter.resolve()

    def entries(self) -> Iterator[JournalEntry]:
        for first, at, queue, records in self._batches:
            for offset, record in enumerate(records):
                yield JournalEntry(first + offset, at, queue, record)
