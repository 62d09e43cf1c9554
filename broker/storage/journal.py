"""The journal interface both implementations keep: ``InMemoryJournal`` and ``DurableJournal``.

Actors call ``append`` synchronously with a command's records, then ``commit_then`` with a waiter that
answers the client. Neither call blocks: a durable journal buffers records and resolves waiters after
its group commit (one write, one fsync, for every actor's records since the last flush), so an actor
never waits on a disk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

from broker.core.records import Record
from broker.errors import BrokerError


class JournalEntry(NamedTuple):
    """One record as the journal holds it: its ``lsn``, when, and in which queue."""

    lsn: int
    at: float
    queue: str
    record: Record


class CommitWaiter(Protocol):
    """Told once whether the records it waits for are committed."""

    def resolve(self) -> None: ...

    def fail(self, error: BrokerError) -> None: ...


class Journal(Protocol):
    def append(self, queue: str, at: float, records: Sequence[Record]) -> int:
        """Take records in order, giving each the next ``lsn``; return the last ``lsn`` given.

        Never blocks and never raises for a full disk: failures reach the waiters instead.
        """
        ...

    def commit_then(self, lsn: int, waiter: CommitWaiter) -> None:
        """Resolve ``waiter`` once every record up to ``lsn`` is committed (or fail it)."""
        ...

    @property
    def last_lsn(self) -> int: ...

    @property
    def healthy(self) -> bool:
        """False while a storage fault keeps records from being committed."""
        ...

    def has_room(self) -> bool:
        """False when the journal's disk is too full for its next writes (see ``DurableJournal``)."""
        ...

    def entries(self) -> Iterator[JournalEntry]:
        """The records still held, oldest first."""
        ...
