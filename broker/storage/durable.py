"""The durable journal: every actor's records, group-committed to segment files with one fsync per flush.

``append`` (called by actors, never blocking) encodes and frames records at once and adds them to a
buffer. One writer thread (started by ``run``) takes the whole buffer whenever it is not empty, writes
it with one write and one fsync, and hands the outcome to the event loop, which resolves every waiter
whose records that flush covered. While a flush is on the disk, new records pile up for the next one:
the slower the disk, the bigger the groups, so fsyncs per second stay bounded while throughput follows
the load.

Storage faults (a full disk, an I/O error) never acknowledge anything: the failed flush is rolled back
(the file is cut to where it was), its waiters get ``StorageUnavailable`` (503), and so does every
durable request while the fault lasts. The records stay in the buffer, in order, and the writer retries
with a growing pause; when a retry succeeds, the journal is whole again and answers resume. The queue
state in memory keeps the changes whose answer was a 503, so the journal must keep them too: a client
that retries a publish without a key may create a duplicate, which at-least-once allows.

``Disk`` is the seam between the writer and the files, so tests can inject faults (``FaultyDisk``).
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import structlog
import trio

from broker.core.records import Record
from broker.errors import StorageUnavailable
from broker.metrics import FLUSH_RECORDS_BUCKETS, FSYNC_BUCKETS, Histogram, JournalFigures
from broker.storage.format import encode_frames
from broker.storage.journal import CommitWaiter, JournalEntry
from broker.storage.segments import DEFAULT_MAX_SEGMENT_BYTES, RESERVE_BYTES, SegmentWriter, read_entries

log = structlog.get_logger("broker.journal")

#: Pauses between retries of a failed flush, in seconds; the last one repeats.
RETRY_PAUSES = (0.05, 0.2, 1.0)


def free_bytes(directory: Path) -> int:
    """The bytes an unprivileged process may still write on ``directory``'s filesystem."""
    return shutil.disk_usage(directory).free


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
    """The group-committing journal. Its writer is one thread of its own (``run`` starts it): a flush
    follows the one before as soon as that fsync returns, without waiting for the event loop to come
    round, and the event loop only hears of each flush's end (``_take_outcomes``) to answer its waiters.
    Under load the loop is busy for a while between two looks at any one task; a writer task driving a
    worker thread paid that wait twice per flush, more than the fsync itself took (issue 4's benchmark).
    """

    def __init__(self, disk: Disk, *, last_lsn: int = 0, directory: Path | None = None) -> None:
        self._disk = disk
        self._directory = directory
        self._last_lsn = last_lsn
        self._committed = last_lsn
        #: Waiters by the lsn they wait for (then the order they came in): an actor whose durable command
        #: made no records waits for its queue's last ones, which may come before lsns other actors
        #: registered waiters for meanwhile. In call order, it waited behind them: for a later flush,
        #: or failed by theirs although its own records were on disk.
        self._waiters: list[tuple[int, int, CommitWaiter]] = []
        self._arrivals = itertools.count()
        self._fault: OSError | None = None
        self._healed = trio.Event()  # set while there is no fault
        self._healed.set()
        self._closed = False
        self.stats = JournalStats()
        self._written_goals: list[tuple[int, trio.Event]] = []
        # Shared with the writer thread, under ``_lock``: the frames not yet taken, the lsn of the
        # first of them, and whether the thread should finish.
        self._lock = threading.Lock()
        self._pending = threading.Condition(self._lock)
        self._buffer: list[bytes] = []
        self._buffer_first = last_lsn + 1
        self._stopping = False
        # From the writer thread to the event loop: what each flush came to, in order.
        self._outcomes: deque[_Flushed | _Failed] = deque()
        self._outcomes_posted = False
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None

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

    def free_bytes(self) -> int | None:
        """The space left on the journal's filesystem (None: no directory, or it cannot be read)."""
        if self._directory is None:
            return None
        try:
            return free_bytes(self._directory)
        except OSError:
            return None

    def has_room(self) -> bool:
        """Whether the journal's filesystem has room for the writer's next reservation: with less than
        ``RESERVE_BYTES`` free, the flush that reaches the end of the space reserved so far fails with
        ENOSPC. (A journal without a directory, or whose space cannot be read, has room.)"""
        free = self.free_bytes()
        return free is None or free >= RESERVE_BYTES

    def statistics(self) -> JournalFigures:
        """A frozen copy of the counters, for ``GET /metrics``."""
        stats = self.stats
        return JournalFigures(
            self.healthy,
            self.free_bytes(),
            stats.flushes,
            stats.records,
            stats.bytes,
            stats.faults,
            stats.fsync_histogram.copy(),
            stats.records_histogram.copy(),
        )

    async def wait_healthy(self) -> None:
        """Return once no storage fault is pending (at once when none is)."""
        await self._healed.wait()

    def append(self, queue: str, at: float, records: Sequence[Record]) -> int:
        lsn = self._last_lsn
        frames = encode_frames(lsn + 1, at, queue, records)
        lsn += len(records)
        with self._lock:
            self._buffer += frames
            self._last_lsn = lsn
            self._pending.notify()
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
            heapq.heappush(self._waiters, (lsn, next(self._arrivals), waiter))

    def entries(self) -> Iterator[JournalEntry]:
        """The committed records on disk, oldest first."""
        if self._directory is None:
            return iter(())
        return (entry for entry in read_entries(self._directory) if entry.lsn <= self._committed)

    # -- the writer -----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the writer thread and keep it until cancelled; ``close`` then flushes the rest."""
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._write_loop, name="journal-writer", daemon=True)
        self._thread.start()
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self._stop_thread()

    def _write_loop(self) -> None:
        """The writer thread: take everything appended, write it once, fsync once, report, repeat.

        A failed flush keeps its bytes in front of whatever comes next and is tried again after a
        growing pause; the thread ends when told to, after one last try at what is left."""
        failures = 0
        held: tuple[bytes, int, int] | None = None  # a failed flush: bytes, first and last lsn
        while True:
            with self._lock:
                while not self._buffer and held is None and not self._stopping:
                    self._pending.wait()
                stopping = self._stopping
                frames, self._buffer = self._buffer, []
                first, last = self._buffer_first, self._last_lsn
                self._buffer_first = last + 1
            if held is not None:
                data, first = held[0] + b"".join(frames), held[1]
                last = last if frames else held[2]
            elif frames:
                data = b"".join(frames)
            else:
                return  # stopping, and nothing is left
            count = last - first + 1  # records (a frame may hold several)
            try:
                seconds = self._write(data, first, last)
            except OSError as error:
                held = (data, first, last)
                self._report(_Failed(error, first, last))
                if stopping:
                    return
                retry_at = time.monotonic() + RETRY_PAUSES[min(failures, len(RETRY_PAUSES) - 1)]
                failures += 1
                with self._lock:  # appends notify meanwhile: only a stop cuts the pause short
                    while not self._stopping and (left := retry_at - time.monotonic()) > 0:
                        self._pending.wait(left)
                continue
            held, failures = None, 0
            self._report(_Flushed(first, last, count, len(data), seconds))
            if stopping:
                with self._lock:
                    if not self._buffer:
                        return

    def _write(self, data: bytes, first: int, last: int) -> float:
        started = time.perf_counter()
        try:
            self._disk.write(data, first, last)
            self._disk.sync()
        except OSError:
            self._disk.rollback()
            raise
        return time.perf_counter() - started

    def _report(self, outcome: _Flushed | _Failed) -> None:
        """Hand a flush's outcome to the event loop (from the writer thread)."""
        with self._lock:
            self._outcomes.append(outcome)
            if self._outcomes_posted:
                return
            self._outcomes_posted = True
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._take_outcomes)

    def _take_outcomes(self) -> None:
        """Apply the flushes' outcomes in the event loop: answer waiters, keep the figures."""
        with self._lock:
            self._outcomes_posted = False
            outcomes, self._outcomes = self._outcomes, deque()
        for outcome in outcomes:
            if isinstance(outcome, _Failed):
                self._on_fault(outcome)
            else:
                self._on_flushed(outcome)

    def _on_flushed(self, flushed: _Flushed) -> None:
        if self._fault is not None:
            log.warning("journal_recovered", lsns=f"{flushed.first}-{flushed.last}")
            self._fault = None
            self._healed.set()
        self._committed = flushed.last
        stats = self.stats
        stats.flushes += 1
        stats.records += flushed.records
        stats.bytes += flushed.bytes
        stats.fsync_seconds += flushed.seconds
        stats.fsync_histogram.observe(flushed.seconds)
        stats.records_histogram.observe(flushed.records)
        if self._written_goals:
            reached = [goal for goal in self._written_goals if goal[0] <= stats.bytes]
            for goal in reached:
                self._written_goals.remove(goal)
                goal[1].set()
        waiters = self._waiters
        while waiters and waiters[0][0] <= flushed.last:
            heapq.heappop(waiters)[2].resolve()

    def _on_fault(self, failed: _Failed) -> None:
        if self._fault is None:
            log.error("journal_fault", error=str(failed.error), lsns=f"{failed.first}-{failed.last}")
            self._healed = trio.Event()
        self._fault = failed.error
        self.stats.faults += 1
        self._fail_waiters()

    def _fail_waiters(self) -> None:
        error = self._unavailable()
        waiters, self._waiters = sorted(self._waiters), []
        for _, _, waiter in waiters:
            waiter.fail(error)

    def _unavailable(self) -> StorageUnavailable:
        reason = self._fault.strerror if self._fault is not None and self._fault.strerror else "an I/O error"
        return StorageUnavailable(f"the journal cannot be written ({reason}); nothing was acknowledged")

    def _stop_thread(self) -> None:
        with self._lock:
            self._stopping = True
            self._pending.notify()

    async def close(self) -> None:
        """Flush what is left (one try), answer every waiter, and close the files."""
        thread = self._thread
        if thread is None:  # never ran: flush here
            self._token = trio.lowlevel.current_trio_token()
            self._stopping = True
            self._thread = thread = threading.Thread(target=self._write_loop, name="journal-writer")
            thread.start()
        self._stop_thread()
        await trio.to_thread.run_sync(thread.join)
        self._take_outcomes()
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


class _Flushed(NamedTuple):
    """A flush that reached the disk: lsns ``first`` … ``last``."""

    first: int
    last: int
    records: int
    bytes: int
    seconds: float


class _Failed(NamedTuple):
    """A flush that did not: its bytes were rolled back and will be tried again."""

    error: OSError
    first: int
    last: int
