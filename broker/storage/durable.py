"""The durable journal: every actor's records, group-committed to segment files with one fsync per flush.

``append`` (called by actors, never blocking) encodes and frames records at once and adds them to a
buffer. One writer task (``run``) takes the whole buffer whenever it is not empty, writes it with one
write and one fsync in a worker thread, and then resolves every waiter whose records that flush
covered. While a flush is on the disk, new records pile up for the next one: the slower the disk, the
bigger the groups, so fsyncs per second stay bounded while throughput follows the load.

Storage faults (a full disk, an I/O error) never acknowledge anything: the failed flush is rolled back
(the file is cut to where it was), its waiters get ``StorageUnavailable`` (503), and so does every
durable request while the fault lasts. The records stay in the buffer, in order, and the writer retries
with a growing pause; when a retry succeeds, the journal is whole again and answers resume. The queue
state in memory keeps the changes whose answer was a 503, so the journal must keep them too: a client
that retries a publish without a key may create a duplicate, which at-least-once allows.

``Disk`` is the seam between the writer and the files, so tests can inject faults (``FaultyDisk``).
"""

from __future__ import annotations

import copy
import errno
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog
import trio

from broker.core.records import Record
from broker.errors import StorageUnavailable
from broker.metrics import FLUSH_RECORDS_BUCKETS, FSYNC_BUCKETS, Histogram, JournalFigures
from broker.storage.format import encode_entry
from broker.storage.journal import CommitWaiter, JournalEntry
from broker.storage.segments import DEFAULT_MAX_SEGMENT_BYTES, SegmentWriter, frame, read_entries

log = structlog.get_logger("broker.journal")

#: Pauses between retries of a failed flush, in seconds; the last one repeats.
RETRY_PAUSES = (0.05, 0.2, 1.0)


class Disk(Protocol):
    """What the writer needs from storage. Called from one worker thread at a time."""

    def write(self, data: bytes, first_lsn: int, last_lsn: int) -> None: ...

    def sync(self) -> None: ...

    def rollback(self) -> None:
        """Undo the bytes of a ``write`` whose ``sync`` (or itself) failed."""
        ...

    def close(self) -> None: ...


class SegmentDisk:
    """The real disk: segment files in a directory."""

    def __init__(
        self,
        directory: Path,
        *,
        last_lsn: int | None = None,
        max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES,
        append_to_newest: bool = True,
    ) -> None:
        self.directory = directory
        self._writer = SegmentWriter(
            directory,
            last_lsn=last_lsn,
            max_segment_bytes=max_segment_bytes,
            append_to_newest=append_to_newest,
        )

    def write(self, data: bytes, first_lsn: int, last_lsn: int) -> None:
        self._writer.write(data, first_lsn, last_lsn)

    def sync(self) -> None:
        self._writer.sync()

    def rollback(self) -> None:
        self._writer.rollback()

    def close(self) -> None:
        self._writer.close()


class FaultyDisk:
    """A ``Disk`` that fails on demand: the fault-injection seam of the storage tests."""

    def __init__(self, disk: Disk) -> None:
        self._disk = disk
        #: While set, every write fails with this error (e.g. ENOSPC), after writing half its bytes.
        self.failing: OSError | None = None
        self.writes = 0

    def fail_with(self, code: int = errno.ENOSPC) -> None:
        self.failing = OSError(code, os.strerror(code))

    def heal(self) -> None:
        self.failing = None

    def write(self, data: bytes, first_lsn: int, last_lsn: int) -> None:
        self.writes += 1
        if self.failing is not None:
            self._disk.write(data[: len(data) // 2], first_lsn, last_lsn)  # a torn write
            raise self.failing
        self._disk.write(data, first_lsn, last_lsn)

    def sync(self) -> None:
        if self.failing is not None:
            raise self.failing
        self._disk.sync()

    def rollback(self) -> None:
        self._disk.rollback()

    def close(self) -> None:
        self._disk.close()


@dataclass(slots=True)
class JournalStats:
    """Counters for metrics and benchmarks."""

    flushes: int = 0
    records: int = 0
    bytes: int = 0
    fsync_seconds: float = 0.0
    faults: int = 0
    #: Per group commit: the time to write and fsync it, and its records.
    fsync_histogram: Histogram = field(default_factory=lambda: Histogram(FSYNC_BUCKETS))
    records_histogram: Histogram = field(default_factory=lambda: Histogram(FLUSH_RECORDS_BUCKETS))


class DurableJournal:
    def __init__(self, disk: Disk, *, last_lsn: int = 0, directory: Path | None = None) -> None:
        self._disk = disk
        self._directory = directory
        self._last_lsn = last_lsn
        self._committed = last_lsn
        self._buffer: list[bytes] = []
        self._buffer_first = last_lsn + 1
        self._waiters: deque[tuple[int, CommitWaiter]] = deque()
        self._wake = trio.Event()
        self._fault: OSError | None = None
        self._healed = trio.Event()  # set while there is no fault
        self._healed.set()
        self._closed = False
        self.stats = JournalStats()
        self._written_goals: list[tuple[int, trio.Event]] = []

    # -- the Journal interface (called by actors) ---------------------------------------------------

    @property
    def last_lsn(self) -> int:
        return self._last_lsn

    @property
    def committed_lsn(self) -> int:
        return self._committed

    @property
    def healthy(self) -> bool:
        return self._fault is None and not self._closed

    def statistics(self) -> JournalFigures:
        """A frozen copy of the counters, for ``GET /metrics``."""
        stats = self.stats
        return JournalFigures(
            self.healthy,
            stats.flushes,
            stats.records,
            stats.bytes,
            stats.faults,
            copy.deepcopy(stats.fsync_histogram),
            copy.deepcopy(stats.records_histogram),
        )

    async def wait_healthy(self) -> None:
        """Return once no storage fault is pending (at once when none is)."""
        await self._healed.wait()

    def append(self, queue: str, at: float, records: Sequence[Record]) -> int:
        lsn = self._last_lsn
        buffer = self._buffer
        for record in records:
            lsn += 1
            buffer.append(frame(encode_entry(lsn, at, queue, record)))
        self._last_lsn = lsn
        self._wake.set()
        return lsn

    async def wait_written(self, total_bytes: int) -> None:
        """Return once ``stats.bytes`` (everything flushed since start) reaches ``total_bytes``."""
        if self.stats.bytes >= total_bytes:
            return
        reached = trio.Event()
        self._written_goals.append((total_bytes, reached))
        try:
            await reached.wait()
        finally:
            if not reached.is_set():
                self._written_goals.remove((total_bytes, reached))

    def commit_then(self, lsn: int, waiter: CommitWaiter) -> None:
        if lsn <= self._committed:
            waiter.resolve()
        elif self._fault is not None:
            waiter.fail(self._unavailable())
        else:
            self._waiters.append((lsn, waiter))

    def entries(self) -> Iterator[JournalEntry]:
        """The committed records on disk, oldest first."""
        if self._directory is None:
            return iter(())
        return (entry for entry in read_entries(self._directory) if entry.lsn <= self._committed)

    # -- the writer -----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Flush whenever there is something to flush, until cancelled (then ``close`` flushes the rest)."""
        task_status.started()
        failures = 0
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if not self._buffer:
                continue
            if await self._flush():
                failures = 0
                continue
            pause = RETRY_PAUSES[min(failures, len(RETRY_PAUSES) - 1)]
            failures += 1
            await trio.sleep(pause)
            self._wake.set()

    async def _flush(self) -> bool:
        """Write and fsync the buffer in a worker thread; resolve (or, on a fault, fail) its waiters."""
        data = b"".join(self._buffer)
        count = len(self._buffer)
        first, last = self._buffer_first, self._last_lsn
        self._buffer = [data]  # kept, in order, until it is on the disk
        try:
            seconds = await trio.to_thread.run_sync(self._write, data, first, last)
        except OSError as error:
            self._buffer = [data, *self._buffer[1:]]
            if self._fault is None:
                log.error("journal_fault", error=str(error), lsns=f"{first}-{last}")
                self._healed = trio.Event()
            self._fault = error
            self.stats.faults += 1
            self._fail_waiters()
            return False
        del self._buffer[0]
        self._buffer_first = last + 1
        if self._fault is not None:
            log.warning("journal_recovered", lsns=f"{first}-{last}")
            self._fault = None
            self._healed.set()
        self._committed = last
        stats = self.stats
        stats.flushes += 1
        stats.records += count
        stats.bytes += len(data)
        stats.fsync_seconds += seconds
        stats.fsync_histogram.observe(seconds)
        stats.records_histogram.observe(count)
        if self._written_goals:
            reached = [goal for goal in self._written_goals if goal[0] <= stats.bytes]
            for goal in reached:
                self._written_goals.remove(goal)
                goal[1].set()
        waiters = self._waiters
        while waiters and waiters[0][0] <= last:
            waiters.popleft()[1].resolve()
        return True

    def _write(self, data: bytes, first: int, last: int) -> float:
        started = time.perf_counter()
        try:
            self._disk.write(data, first, last)
            self._disk.sync()
        except OSError:
            self._disk.rollback()
            raise
        return time.perf_counter() - started

    def _fail_waiters(self) -> None:
        error = self._unavailable()
        waiters, self._waiters = self._waiters, deque()
        for _, waiter in waiters:
            waiter.fail(error)

    def _unavailable(self) -> StorageUnavailable:
        reason = self._fault.strerror if self._fault is not None and self._fault.strerror else "an I/O error"
        return StorageUnavailable(f"the journal cannot be written ({reason}); nothing was acknowledged")

    async def close(self) -> None:
        """Flush what is left (one try) and close the files."""
        if self._buffer:
            await self._flush()
        self._fail_waiters()
        self._closed = True
        await trio.to_thread.run_sync(self._disk.close)
        stats = self.stats
        log.info(
            "journal_closed",
            last_lsn=self._committed,
            flushes=stats.flushes,
            records=stats.records,
            bytes=stats.bytes,
            fsync_seconds=round(stats.fsync_seconds, 3),
            faults=stats.faults,
        )
