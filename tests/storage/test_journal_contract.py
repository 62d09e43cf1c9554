"""What every caller of the ``Journal`` protocol relies on, asserted alike of both journals: the
in-memory one and the durable one (on a directory, its writer run as ``open_broker`` runs it).

Only what the protocol's docstrings promise is asserted here. Where the two differ by design, the
difference is tested in the implementation's own test file, or not at all:

- the in-memory journal keeps only its newest ``retain`` records; the durable one keeps them all;
- the in-memory journal commits at ``append``; the durable one only after its group commit, and it
  never acknowledges a record before its fsync (``test_durable.py``);
- faults, ``has_room`` on a full disk and ``close`` are the durable journal's (``test_durable.py``);
- an ``append`` of no records, and a ``commit_then`` for an lsn not yet given, have no promised meaning;
- the order in which waiters registered out of lsn order are resolved is not promised; but each must
  be resolved once its records are committed. The durable journal resolved only from the front of its
  waiters in call order: a waiter behind one for a later lsn waited for a later flush, or was failed by
  that one's fault though its own records were on disk (the two tests at the end, durable only).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from broker.core.records import Acked, Claimed, QueueDeleted, Record
from broker.storage.durable import DurableJournal, FaultyDisk, SegmentDisk
from broker.storage.journal import Journal, JournalEntry
from broker.storage.memory import InMemoryJournal
from tests.storage.test_durable import Waiter, published

#: Long enough for a flush on a slow CI disk; a passing test never waits for it.
COMMIT_TIMEOUT = 10


@asynccontextmanager
async def running(journal: DurableJournal) -> AsyncIterator[DurableJournal]:
    """Run a durable journal's writer as ``open_broker`` does: started in a nursery of its own,
    cancelled once nothing more is appended, then ``close``."""
    async with trio.open_nursery() as storage:
        await storage.start(journal.run)
        yield journal
        storage.cancel_scope.cancel()
    await journal.close()


@pytest.fixture(params=["memory", "durable"])
async def journal(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Journal]:
    if request.param == "memory":
        yield InMemoryJournal()
        return
    directory = tmp_path / "journal"
    async with running(DurableJournal(SegmentDisk(directory), directory=directory)) as durable:
        yield durable


class NotingWaiter(Waiter):
    """A waiter that notes its ``lsn`` in ``resolved`` when it is resolved."""

    def __init__(self, lsn: int, resolved: list[int]) -> None:
        super().__init__()
        self._lsn = lsn
        self._resolved = resolved

    def resolve(self) -> None:
        self._resolved.append(self._lsn)
        super().resolve()


async def committed(journal: Journal, lsn: int) -> Waiter:
    """Wait until the journal resolves (or fails) a waiter for ``lsn``; return the waiter."""
    waiter = Waiter()
    journal.commit_then(lsn, waiter)
    with trio.fail_after(COMMIT_TIMEOUT):
        await waiter.done.wait()
    return waiter


def acked(n: int) -> Acked:
    return Acked(f"m-{n}", f"l-{n}")


def claimed(n: int) -> Claimed:
    return Claimed(f"m-{n}", f"l-{n}", "worker-1", 1, 1_700_000_030.25)


async def test_lsns_rise_by_one_per_record_from_the_last_lsn_and_append_returns_the_last(
    journal: Journal,
) -> None:
    start = journal.last_lsn
    assert journal.append("jobs", 1.0, [published(1), published(2), acked(1)]) == start + 3
    assert journal.last_lsn == start + 3
    assert journal.append("other", 2.0, [QueueDeleted()]) == start + 4
    assert journal.last_lsn == start + 4
    await committed(journal, start + 4)
    # Committing does not move ``last_lsn``; the next lsns follow on from it.
    assert journal.append("jobs", 3.0, [claimed(1), claimed(2)]) == start + 6
    assert journal.last_lsn == start + 6
    await committed(journal, start + 6)
    lsns = [entry.lsn for entry in journal.entries() if entry.lsn > start]
    assert lsns == list(range(start + 1, start + 7))


async def test_a_waiter_is_resolved_once_its_records_are_committed(journal: Journal) -> None:
    start = journal.last_lsn
    waiter = await committed(journal, journal.append("jobs", 1.0, [published(1), published(2)]))
    assert waiter.resolved and waiter.error is None
    # Committed: the journal holds them (the durable one lists only what its fsync covered).
    assert [entry.lsn for entry in journal.entries() if entry.lsn > start] == [start + 1, start + 2]


async def test_waiters_are_resolved_in_lsn_order(journal: Journal) -> None:
    """Each waiter registered right after its own append, as the registry and an actor whose command
    made records do."""
    resolved: list[int] = []
    waiters = []
    for n in range(1, 9):
        lsn = journal.append(f"queue-{n % 3}", float(n), [published(n)] * (n % 2 + 1))
        waiter = NotingWaiter(lsn, resolved)
        journal.commit_then(lsn, waiter)
        waiters.append(waiter)
        if n == 4:  # the durable journal: the next appends go in a later flush than these
            with trio.fail_after(COMMIT_TIMEOUT):
                await waiter.done.wait()
    with trio.fail_after(COMMIT_TIMEOUT):
        for waiter in waiters:
            await waiter.done.wait()
    assert all(waiter.resolved for waiter in waiters)
    assert resolved == sorted(resolved) and len(resolved) == 8


async def test_a_waiter_for_lsns_already_committed_is_resolved(journal: Journal) -> None:
    first = journal.append("jobs", 1.0, [published(1)])
    last = journal.append("jobs", 2.0, [published(2), published(3)])
    await committed(journal, last)
    for lsn in (last, first):  # the newest committed lsn, and an older one
        waiter = await committed(journal, lsn)
        assert waiter.resolved and waiter.error is None


async def test_entries_give_back_each_record_with_its_lsn_time_and_queue_oldest_first(
    journal: Journal,
) -> None:
    start = journal.last_lsn
    appended: list[tuple[str, float, list[Record]]] = [
        ("jobs", 1_700_000_000.123456, [published(1), published(2)]),
        ("émails", 1_700_000_001.5, [claimed(1)]),
        ("jobs", 1_700_000_002.000001, [claimed(2), acked(2), acked(3), published(4)]),
        ("émails", 1_700_000_003.25, [QueueDeleted()]),
    ]
    expected = []
    for queue, at, records in appended:
        last = journal.append(queue, at, records)
        first = last - len(records) + 1
        expected += [JournalEntry(first + i, at, queue, record) for i, record in enumerate(records)]
    await committed(journal, journal.last_lsn)
    assert [entry for entry in journal.entries() if entry.lsn > start] == expected
    assert list(journal.entries()) == list(journal.entries())  # reading does not consume them


async def test_a_journal_in_the_normal_state_is_healthy_and_has_room(journal: Journal) -> None:
    assert journal.healthy and journal.has_room()
    await committed(journal, journal.append("jobs", 1.0, [published(1)]))
    assert journal.healthy and journal.has_room()


# -- waiters registered out of lsn order (durable only) -----------------------------------------------
#
# ``commit_then`` promises to resolve a waiter once every record up to its lsn is committed. An actor
# answering a durable command that made no records of its own (a duplicate publish, an ack of a lease
# already settled) waits for its queue's last lsn (``QueueActor._journal_and_reply``), which may be
# lower than the lsn another actor registered a waiter for a moment before. The durable journal kept its
# waiters in the order they came and, after a flush, resolved from the front only while the front
# waiter's lsn was covered: a waiter behind one for a later lsn was held up though its records were on
# disk, and if the next flush failed it was failed with "nothing was acknowledged". It now keeps them
# by lsn (``DurableJournal._waiters``). The in-memory journal cannot be caught between two flushes.


class SteppedDisk(FaultyDisk):
    """A disk whose writes each wait, in the writer thread, until the test lets one through."""

    def __init__(self, disk: SegmentDisk) -> None:
        super().__init__(disk)
        self._started = threading.Semaphore(0)
        self._passes = threading.Semaphore(0)

    async def wait_for_write(self) -> None:
        """Return once a write has started (and waits to be let through)."""
        assert await trio.to_thread.run_sync(self._started.acquire, True, COMMIT_TIMEOUT)

    def let_through(self) -> None:
        self._passes.release()

    def write(self, data: bytes, first_lsn: int, last_lsn: int) -> None:
        self._started.release()
        self._passes.acquire(timeout=COMMIT_TIMEOUT)
        super().write(data, first_lsn, last_lsn)


async def behind_a_later_waiter(journal: DurableJournal, disk: SteppedDisk) -> tuple[Waiter, Waiter]:
    """Commit lsn 1 alone while a waiter for lsn 2 and then one for lsn 1 are registered, and return
    once that flush's outcome is in and the flush of lsn 2 is on the disk (held there): the waiters
    for lsn 2 and for lsn 1."""
    first = journal.append("jobs", 1.0, [published(1)])
    await disk.wait_for_write()  # the writer took lsn 1 alone
    second = journal.append("other", 1.0, [published(2)])
    later, earlier = Waiter(), Waiter()
    journal.commit_then(second, later)  # another actor's command
    journal.commit_then(first, earlier)  # a duplicate publish to "jobs": its answer waits for lsn 1
    disk.let_through()
    # The writer reported lsn 1's flush (to the event loop, in order) before it took lsn 2's, and this
    # wait returns through the same queue of calls, after it: the flush's outcome is applied.
    await disk.wait_for_write()
    await trio.testing.wait_all_tasks_blocked()
    return later, earlier


async def test_a_waiter_behind_one_for_a_later_lsn_is_resolved_once_its_records_are_committed(
    tmp_path: Path,
) -> None:
    disk = SteppedDisk(SegmentDisk(tmp_path / "journal"))
    journal = DurableJournal(disk, directory=tmp_path / "journal")
    async with running(journal):
        later, earlier = await behind_a_later_waiter(journal, disk)
        seen = (journal.committed_lsn, earlier.resolved, later.done.is_set())
        disk.let_through()
        with trio.fail_after(COMMIT_TIMEOUT):
            await earlier.done.wait()
            await later.done.wait()
    assert later.resolved and earlier.resolved  # both in the end, once lsn 2 is committed too
    assert seen == (1, True, False)  # it waited for lsn 2's flush: (1, False, False)


async def test_a_fault_after_a_waiters_records_are_committed_does_not_fail_it(tmp_path: Path) -> None:
    disk = SteppedDisk(SegmentDisk(tmp_path / "journal"))
    journal = DurableJournal(disk, directory=tmp_path / "journal")
    async with running(journal):
        later, earlier = await behind_a_later_waiter(journal, disk)
        disk.fail_with()
        disk.let_through()  # lsn 2's flush fails
        with trio.fail_after(COMMIT_TIMEOUT):
            await later.done.wait()
            await earlier.done.wait()
        committed_lsn = journal.committed_lsn
        disk.heal()
        disk.let_through()  # the writer's retry (after its pause, or at once when the close cuts it short)
    assert committed_lsn == 1 and later.error is not None  # lsn 2 was not committed: failed, rightly
    # It was failed with StorageUnavailable, "nothing was acknowledged", though lsn 1 was on disk.
    assert earlier.error is None and earlier.resolved
