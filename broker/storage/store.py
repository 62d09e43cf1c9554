"""The data directory: who holds it, what recovery finds in it, and the journal that writes to it.

Layout (``snapshots/`` by default)::

    LOCK        held (flock) by the broker or the offline tool using the directory
    journal/    segment files, see docs/journal-format.md

Opening runs recovery: the journal is scanned, a torn or corrupt tail is cut with a warning naming the
lsns cut, and the records are replayed into fresh queue cores. Synchronous: the server runs it in a
worker thread before it serves.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import structlog

from broker.errors import StorageUnavailable
from broker.storage.durable import DurableJournal, SegmentDisk
from broker.storage.recovery import Recovered, replay
from broker.storage.segments import read_entries, repair, scan

log = structlog.get_logger("broker.storage")

JOURNAL_DIR = "journal"
LOCK_FILE = "LOCK"


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
    """Hold ``data_dir`` for this process, or raise ``DataDirectoryInUse`` naming the holder."""
    data_dir.mkdir(parents=True, exist_ok=True)
    handle = open(data_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held open for the process's life
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise DataDirectoryInUse(f"the data directory {data_dir} is in use by {holder}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def open_data_dir(data_dir: Path) -> Opened:
    """Lock ``data_dir``, repair the journal's tail if needed, and replay it."""
    started = time.perf_counter()
    lock = lock_data_dir(data_dir)
    try:
        journal_dir = data_dir / JOURNAL_DIR
        journal_dir.mkdir(exist_ok=True)
        result = scan(journal_dir)
        if result.tail is not None:
            cut = repair(journal_dir, result)
            if cut is not None:
                log.warning("journal_tail_cut", detail=cut.describe(), last_valid_lsn=result.last_lsn)
        recovered = replay(read_entries(journal_dir))
        if recovered.last_lsn < result.last_lsn:
            recovered.last_lsn = result.last_lsn  # records before the journal's first, if pruned
        disk = SegmentDisk(journal_dir, last_lsn=recovered.last_lsn)
        journal = DurableJournal(disk, last_lsn=recovered.last_lsn, directory=journal_dir)
    except BaseException:
        lock.close()
        raise
    seconds = time.perf_counter() - started
    log.info(
        "recovered",
        queues=len(recovered.queues),
        records=recovered.records,
        last_lsn=recovered.last_lsn,
        unsent_moves=len(recovered.unsent),
        seconds=round(seconds, 3),
    )
    return Opened(recovered, journal, seconds, lock)
