"""The data directory: who holds it, what recovery finds in it, and the journal that writes to it.

Layout (``snapshots/`` by default)::

    LOCK             held (flock) by the broker or the offline tool using the directory
    LOCK.snapshot    held (flock) by a snapshot process (storage/compactor.py) while it runs
    boot             the last start's number (``new_boot``), so that the next never repeats it
    journal/         segment files, see docs/journal-format.md
    snapshots.lmdb/  snapshots, see broker/storage/snapshots.py

Opening runs recovery: the newest snapshot that passes its checksum is loaded (older ones stand in for
a corrupt one, with a warning), the journal after it is scanned, a torn or corrupt tail is cut with a
warning naming the lsns cut, and the records after the snapshot are replayed. Synchronous: the server
runs it in a worker thread before it serves.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

import structlog
import trio

from broker.core import FinishedHistory
from broker.core.config import DEFAULT_HISTORY
from broker.errors import StorageUnavailable
from broker.runtime import collector_paused
from broker.storage import durable
from broker.storage.compactor import history_argument
from broker.storage.durable import DurableJournal, SegmentDisk
from broker.storage.recovery import Recovered, replay
from broker.storage.retention import Retention, prune
from broker.storage.segments import (
    DEFAULT_MAX_SEGMENT_BYTES,
    RESERVE_BYTES,
    PartlyDeleted,
    Scan,
    ScanResult,
    repair,
    sync_path,
)
from broker.storage.snapshots import (
    JOURNAL_DIR,
    SNAPSHOTS_DIR,
    DamagedPages,
    SnapshotInfo,
    SnapshotStoreError,
    check_journal_follows,
    check_snapshots_reached,
    finish_rebuild,
    list_snapshots,
    newest_valid,
    rebuild,
    return_freed_memory,
    walk_pages,
)

log = structlog.get_logger("broker.storage")
T = TypeVar("T")

LOCK_FILE = "LOCK"
#: Held by a snapshot process for its whole life, from before it starts (``Snapshotter._compact``).
SNAPSHOT_LOCK_FILE = "LOCK.snapshot"


class DataDirectoryInUse(StorageUnavailable):
    pass


@dataclass(slots=True)
class Opened:
    """An open data directory: recovered queues, and the journal that continues where recovery ended."""

    recovered: Recovered
    journal: DurableJournal
    seconds: float
    lock: IO[str]

    def release(self) -> None:
        self.lock.close()  # closing the file drops the flock


def lock_data_dir(data_dir: Path) -> IO[str]:
    """Hold ``data_dir`` for this process, or raise ``DataDirectoryInUse`` naming the holder: a broker,
    an offline tool, or a snapshot process that a broker started and that is still running."""
    data_dir.mkdir(parents=True, exist_ok=True)
    handle = open(data_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held open for the process's life
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise DataDirectoryInUse(f"the data directory {data_dir} is in use by {holder}") from None
    try:
        _check_no_snapshot_process(data_dir)
    except BaseException:
        handle.close()
        raise
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def _check_no_snapshot_process(data_dir: Path) -> None:
    """Raise ``DataDirectoryInUse`` while a snapshot process holds ``SNAPSHOT_LOCK_FILE``. With
    ``LOCK_FILE`` held, no broker runs here, so such a process outlived the broker that started it
    (killed with -9): it may still be writing a snapshot, which a restore or a new broker must not meet
    half way. It stops by itself, without writing, once it finds its broker gone (compactor.py)."""
    path = data_dir / SNAPSHOT_LOCK_FILE
    if not path.exists():
        return
    with open(path) as snapshot_lock:
        try:
            fcntl.flock(snapshot_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = snapshot_lock.read().strip() or "snapshot process"  # its pid, once its broker wrote it
            raise DataDirectoryInUse(
                f"the data directory {data_dir} is in use by a {holder} that is still running; it stops "
                "by itself without writing now that its broker is gone: try again in a moment"
            ) from None


class StoppedDuringRecovery(Exception):
    """A stop was asked for while the data directory was being read: nothing in it was changed."""


#: Journal records replayed between two looks at whether a stop was asked for.
STOP_CHECK_RECORDS = 10_000


def open_data_dir(
    data_dir: Path,
    *,
    segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES,
    history: FinishedHistory = DEFAULT_HISTORY,
    stop: threading.Event | None = None,
) -> Opened:
    """Lock ``data_dir``, repair the journal's tail if needed, and replay it; the journal returned
    starts a new segment file past ``segment_bytes``, and the queues keep ``history``'s finished
    messages.

    Raises ``StoppedDuringRecovery`` once ``stop`` is set (by a SIGTERM in another thread) while the
    snapshot or the journal is read: a large one takes tens of seconds, and a service manager's stop
    should not wait for it, nor see the broker listen for a moment before it stops. It looks between two
    chunks of the snapshot and every ``STOP_CHECK_RECORDS`` records of the journal, and last before
    anything is written: from then on, the journal's repair and the queues' start go to their end."""

    def check_stop(*_: int) -> None:
        if stop is not None and stop.is_set():
            raise StoppedDuringRecovery("stopped while reading the data directory; nothing was changed")

    started = time.perf_counter()
    lock = lock_data_dir(data_dir)
    try:
        journal_dir = data_dir / JOURNAL_DIR
        journal_dir.mkdir(exist_ok=True)
        damage = walk_pages(data_dir)
        completed = finish_rebuild(data_dir, damaged=damage is not None)
        if completed is not None:
            log.error(
                "snapshots_rebuilt",
                detail="a rebuild of the snapshot file that a crash cut short, completed",
                damaged_kept_as=completed.name,
                advice=REBUILT_ADVICE,
            )
        with collector_paused(freeze=True):
            try:
                base, skipped = newest_valid(data_dir, history=history, progress=check_stop)
            except DamagedPages as error:  # where the snapshots' headers are: none can be told apart
                raise SnapshotStoreError(
                    f"{data_dir / SNAPSHOTS_DIR} is damaged where it lists its snapshots ({error}). Move it "
                    f"aside (mv {SNAPSHOTS_DIR} {SNAPSHOTS_DIR}.damaged) and the next start recovers from "
                    "the journal alone, if retention kept all of it: it refuses, changing nothing, if not"
                ) from None
            after = base.last_lsn if base is not None else 0
            check_journal_reaches_back(data_dir, base, skipped)
            scanning = Scan(journal_dir, after_lsn=after)
            entries = scanning if stop is None else _checked_every(scanning, STOP_CHECK_RECORDS, check_stop)
            recovered = replay(entries, base, history=history)  # the valid records; a tail is cut below
        check_stop()
        check_nothing_lost(data_dir, recovered.last_lsn, scanning.result, skipped)
        for warning in skipped:
            log.warning("snapshot_skipped", detail=warning)
        result = scanning.result
        for damage in result.covered_damage:
            log.warning("journal_damage_under_snapshot", detail=damage, snapshot_lsn=after)
        if result.tail is not None:
            cut = repair(journal_dir, result)
            if cut is not None:
                log.warning(
                    "journal_tail_cut",
                    detail=cut.describe(),
                    last_valid_lsn=result.last_lsn,
                    next_lsn=max(result.last_lsn, recovered.last_lsn) + 1,
                )
        if recovered.strays:
            log.warning("journal_records_without_queue", records=recovered.strays)
        # The journal's records must run on from the newest one: never append behind damage, nor
        # behind a cut that ended the journal below the snapshot's lsn (the next record follows the
        # snapshot, in a segment named after it).
        append_to_newest = not result.covered_damage and result.last_lsn >= recovered.last_lsn
        if recovered.last_lsn < result.last_lsn:
            recovered.last_lsn = result.last_lsn  # records before the journal's first, if pruned
        if damage is not None:
            # Served as it is, every snapshot would fail on the damaged pages (``walk_pages``).
            aside = rebuild(data_dir, recovered)
            log.error(
                "snapshots_rebuilt",
                detail=damage,
                damaged_kept_as=aside.name,
                lsn=recovered.last_lsn,
                advice=REBUILT_ADVICE,
            )
        disk = SegmentDisk(
            journal_dir,
            last_lsn=recovered.last_lsn,
            max_segment_bytes=segment_bytes,
            append_to_newest=append_to_newest,
        )
        journal = DurableJournal(disk, last_lsn=recovered.last_lsn, directory=journal_dir)
    except BaseException:
        lock.close()
        raise
    return_freed_memory()
    seconds = time.perf_counter() - started
    log.info(
        "recovered",
        snapshot=None if base is None else f"{after:020d}",
        queues=len(recovered.queues),
        records=recovered.records,
        last_lsn=recovered.last_lsn,
        unsent_moves=len(recovered.unsent),
        seconds=round(seconds, 3),
    )
    return Opened(recovered, journal, seconds, lock)


#: What ``snapshots_rebuilt`` tells the operator.
REBUILT_ADVICE = (
    "the snapshot file was damaged: it was replaced by one snapshot of what a start recovered, and kept "
    "beside it; the older snapshots are not in the new one, so a restore to a time before that start "
    "needs the journal from its first record"
)

#: What a start that refuses says last: its checks all come before it changes anything.
START_REFUSED = "Nothing was changed."


def check_journal_reaches_back(data_dir: Path, base: Recovered | None, skipped: Sequence[str]) -> None:
    """The start's first refusal (``JournalGap``), before it replays anything: the journal must go on
    from ``base``, the newest snapshot that can be read (``newest_valid``, whose warnings ``skipped``
    name the snapshots skipped), or from the first record. ``broker snapshot verify`` runs it too."""
    check_journal_follows(data_dir / JOURNAL_DIR, base, skipped, START_REFUSED)


def check_nothing_lost(data_dir: Path, lsn: int, scanned: ScanResult, skipped: Sequence[str]) -> None:
    """The start's second refusal (``JournalGap``): no snapshot that cannot be read may cover lsns past
    what the start recovers, ``lsn`` (the snapshot's it reads, 0 for none, or what the replay after it
    reached) or the last valid record of the journal (``scanned``, its scan after the snapshot),
    whichever is later: a replay from the snapshot reads exactly the scan's records. ``broker snapshot
    verify`` runs it too, without the replay."""
    check_snapshots_reached(data_dir, max(lsn, scanned.last_lsn), skipped, START_REFUSED)


BOOT_FILE = "boot"


def new_boot(data_dir: Path, now_ms: int) -> int:
    """This start's number, the start of every id it mints (``Registry``): ``now_ms``, or one past the
    last start's when that is not less (the host's clock read the same or earlier, as it does after it
    was stepped back: the broker's clock then starts from the journal's last record, which a start that
    journals nothing leaves where it was). Written and fsynced before it is used: a lease id must never
    name two deliveries, and a claim answered before its record was fsynced may be lost in a crash."""
    path = data_dir / BOOT_FILE
    try:
        last = int(path.read_text())
    except (FileNotFoundError, ValueError):
        last = 0
    boot = max(now_ms, last + 1)
    written = path.with_name(BOOT_FILE + ".new")
    with written.open("w") as file:
        file.write(f"{boot}\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(written, path)
    sync_path(data_dir)
    return boot


def _checked_every(items: Iterable[T], every: int, check: Callable[[], None]) -> Iterator[T]:
    """``items``, calling ``check`` before the first and then after each ``every`` of them."""
    for number, item in enumerate(items):
        if number % every == 0:
            check()
        yield item


class SnapshotFailed(StorageUnavailable):
    pass


def _hold_snapshot_lock(data_dir: Path) -> IO[str]:
    """``SNAPSHOT_LOCK_FILE``, locked (an empty file: the holder is written once it is known);
    ``SnapshotFailed`` while a snapshot process of a broker before this one still runs."""
    try:
        handle = open(data_dir / SNAPSHOT_LOCK_FILE, "a+")  # noqa: SIM115 - closed by the caller
    except OSError as error:
        raise SnapshotFailed(f"the snapshot failed: {error}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise SnapshotFailed("the snapshot failed: a snapshot process started earlier still runs") from None
    handle.truncate(0)
    return handle


class Snapshotter:
    """Takes snapshots of a running broker's data directory, one at a time, each in a child process
    (``storage/compactor.py``: from files only, so the queues never stop for it), and prunes the
    journal that the snapshots then cover as ``retention`` says (``storage/retention.py``)."""

    def __init__(
        self,
        data_dir: Path,
        journal: DurableJournal,
        retention: Retention | None = None,
        history: FinishedHistory = DEFAULT_HISTORY,
    ) -> None:
        self.data_dir = data_dir
        self._journal = journal
        self._retention = retention if retention is not None else Retention()
        self._history = history
        self._lock = trio.Lock()
        #: Snapshots taken since start, and an event set at the next one.
        self.taken = 0
        self._next_taken = trio.Event()

    async def wait_taken(self, more_than: int) -> None:
        """Return once more than ``more_than`` snapshots have been taken since start."""
        while self.taken <= more_than:
            await self._next_taken.wait()

    async def take(self, at: str = "request") -> SnapshotInfo | None:
        """Snapshot everything committed so far; None when nothing changed since the last one.
        Raises ``SnapshotFailed`` (503) when the child process fails, with its reason, logged as
        ``snapshot_failed`` with ``at`` (who asked: ``request``, ``interval`` or ``shutdown``)."""
        try:
            return await self._take()
        except (StorageUnavailable, OSError) as error:  # the journal still has everything
            log.error("snapshot_failed", at=at, detail=str(error), replayed_at_next_start=True)
            if isinstance(error, StorageUnavailable):
                raise
            raise SnapshotFailed(f"the snapshot failed: {error}") from None  # not a bug's 500

    async def _take(self) -> SnapshotInfo | None:
        async with self._lock:
            until = self._journal.committed_lsn
            started = time.perf_counter()
            kept = await self.list()
            if kept and kept[0].lsn >= until:
                return None  # the newest covers everything committed; no process for nothing
            self._check_room(kept[0].bytes if kept else 0)
            info = await self._compact(until)
            if info is not None:
                self.taken += 1
                self._next_taken.set()
                self._next_taken = trio.Event()
                log.info(
                    "snapshot_taken",
                    id=info.id,
                    messages=info.messages,
                    bytes=info.bytes,
                    seconds=round(time.perf_counter() - started, 3),
                )
            await self._prune()
            return info

    def _check_room(self, last_bytes: int) -> None:
        """Refuse (``SnapshotFailed``) a snapshot the data directory's disk has no room for: twice the
        last one's size, and ``RESERVE_BYTES``. LMDB maps its file, and a write that fails for want of
        space can leave pages mapped that the file system cannot back: reading them kills a process with
        SIGBUS, the snapshot process and then this broker (seen on a full tmpfs). A disk that fills
        while a snapshot is written can still do that; this keeps the broker from filling it itself."""
        needed = 2 * last_bytes + RESERVE_BYTES
        try:
            free = durable.free_bytes(self.data_dir)
        except OSError:
            return  # the snapshot process will say what is wrong
        if free < needed:
            raise SnapshotFailed(
                f"the snapshot failed: {free} bytes are free on the data directory's disk, and a "
                f"snapshot needs about {needed} (twice the last one's size, and {RESERVE_BYTES} more)"
            )

    async def _compact(self, until: int) -> SnapshotInfo | None:
        """Run the snapshot process (storage/compactor.py) and read what it made.

        The process must never write after this broker is gone: a `broker snapshot restore` run meanwhile
        would be undone by a snapshot of the timeline it restored away from. So it holds
        ``SNAPSHOT_LOCK_FILE`` (locked here, before it starts, and passed on to it), which the offline
        tools and a starting broker respect (``lock_data_dir``); and its stdin is a pipe that only this
        process holds open, whose end tells it at once that its broker is gone: it then exits without
        committing. (Not ``PR_SET_PDEATHSIG``: it fires when the *thread* that started the child ends,
        and Trio starts processes from worker threads that end when idle.)"""
        lock = _hold_snapshot_lock(self.data_dir)
        done: list[subprocess.CompletedProcess[bytes]] = []

        async def run(task_status: trio.TaskStatus[trio.Process]) -> None:
            command = [
                sys.executable,
                "-m",
                "broker.storage.compactor",
                str(self.data_dir),
                str(until),
                history_argument(self._history),
            ]
            done.append(
                await trio.run_process(
                    [*command, "--with-parent"],
                    stdin=subprocess.PIPE,  # never written; held open until the process ends
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                    pass_fds=(lock.fileno(),),
                    task_status=task_status,
                )
            )

        try:
            async with trio.open_nursery() as nursery:
                process: trio.Process = await nursery.start(run)
                try:
                    holder = f"snapshot process pid {process.pid} (of broker pid {os.getpid()})\n"
                    # Only for operators' messages: on a full disk the snapshot fails on its own, with a
                    # reason, while the lock (an flock) works whatever the file holds.
                    with contextlib.suppress(OSError):
                        os.write(lock.fileno(), holder.encode())
                    await process.wait()
                finally:
                    if process.stdin is not None:
                        with trio.CancelScope(shield=True):
                            await process.stdin.aclose()
        finally:
            lock.close()  # the process's copy held the lock until it ended
        result = done[0]
        if result.returncode != 0:
            reason = result.stderr.decode(errors="replace").strip().splitlines()
            raise SnapshotFailed(f"the snapshot failed: {reason[-1] if reason else result.returncode}")
        made = json.loads(result.stdout)
        return None if made is None else SnapshotInfo(**made)

    async def _prune(self) -> None:
        """Let retention delete what the oldest snapshot covers. A failure is logged, not raised: the
        snapshot is taken, and the next one prunes again."""
        kept = await self.list()
        if not kept:
            return
        covered = kept[-1].lsn
        failure: OSError | None = None
        try:
            deleted = await trio.to_thread.run_sync(
                prune, self.data_dir / JOURNAL_DIR, covered, self._retention, time.time()
            )
        except OSError as error:
            failure, deleted = error, error.deleted if isinstance(error, PartlyDeleted) else []
        if deleted:
            log.info("journal_pruned", segments=[path.name for path in deleted], covered_lsn=covered)
        if failure is not None:
            log.error("journal_prune_failed", detail=str(failure), covered_lsn=covered)

    async def list(self) -> list[SnapshotInfo]:
        """The snapshots, newest first; ``SnapshotFailed`` (503) when their file cannot be read."""
        try:
            return await trio.to_thread.run_sync(list_snapshots, self.data_dir)
        except OSError as error:
            raise SnapshotFailed(f"the snapshots cannot be read: {error}") from None

    async def run(
        self,
        interval: float,
        max_bytes: int | None = None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Take a snapshot every ``interval`` seconds, or sooner once the journal has grown by
        ``max_bytes`` since the last one (when the journal moved on at all)."""
        task_status.started()
        covered = self._journal.stats.bytes  # the journal's bytes when the last snapshot here began
        while True:
            with trio.move_on_after(interval):
                if max_bytes is None:
                    await trio.sleep_forever()
                await self._journal.wait_written(covered + max_bytes)
            # Counted from where this snapshot begins: what is written while it is taken counts
            # towards the next (counted from where it ended, that was never counted at all).
            covered = self._journal.stats.bytes
            try:
                await self.take(at="interval")
            except (StorageUnavailable, OSError):
                pass  # logged by ``take``: a failed snapshot costs a longer replay, never the broker
            except Exception:  # a bug: say so loudly, and serve on
                log.exception("snapshot_failed", at="interval")
