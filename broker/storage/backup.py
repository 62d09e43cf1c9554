"""A copy of a data directory that a broker can start from, made while the broker runs (or not):
``broker snapshot backup DEST``.

A copy of the files as they are (``cp -a``, ``tar``, ``rsync``) of a running broker's directory may not
start: LMDB's pages are torn when snapshot commits land while ``data.mdb`` is read, and when the
snapshots are copied before the journal, retention may have pruned the journal they need meanwhile.
So the copy goes in this order, which needs no lock and writes nothing into the data directory:

1. the journal's segments, oldest first. Retention deletes a segment only once the oldest snapshot
   kept covers it, so a snapshot committed later never needs one older than those copied; a segment
   that vanishes while it is copied was pruned, and the older ones copied are dropped with it, so
   the copy never has a gap;
2. the snapshots, with LMDB's own copy (``Environment.copy``) from a read-only environment: one read
   transaction, so a commit meanwhile cannot tear it. Every kept snapshot is covered by the journal
   copied before it;
3. the journal again from the newest segment copied on (it is copied anew, and the segments begun
   since are added): a snapshot taken meanwhile holds lsns past what step 1 copied, and a broker
   started on a copy whose journal ends before its snapshot would go on journaling after a gap, which
   every later scan of that journal reports as damage. The newest segment is caught mid-write: a torn
   frame at its end (the write under way, never acknowledged before it was read) is cut in the copy,
   as a start would cut it;
4. the ``boot`` file (ids keep rising); never ``LOCK``, ``LOCK.snapshot`` nor LMDB's ``lock.mdb``.

Everything is written into ``DEST.partial``, fsynced, renamed to ``DEST`` and the rename made durable;
then the copy is checked as ``broker snapshot verify`` checks a directory (``restore.check_directory``:
the snapshots' checksums, the journal's frames, and the start's own refusals).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import lmdb

from broker.storage.lmdb_walk import open_readonly
from broker.storage.restore import (
    Progress,
    RestoreError,
    Verification,
    check_data_dir,
    check_directory,
    last_record_time,
)
from broker.storage.segments import Segment, repair, scan, segments, sync_path
from broker.storage.snapshots import JOURNAL_DIR, MAP_SIZE, SNAPSHOTS_DIR, SnapshotStoreError, list_snapshots
from broker.storage.store import BOOT_FILE

#: The chunk a file is copied in (and progress reported).
CHUNK_BYTES = 1 << 20
#: Copies of the snapshots, each followed by the journal's second pass, before the backup gives up on
#: a journal retention prunes faster than it copies (the check of the copy then says so).
COPY_ROUNDS = 5


class BadBackupRequest(RestoreError):
    """The destination cannot take a backup: it exists, or lies inside the data directory."""

    code = "bad_input"


class BackupOutpaced(RestoreError):
    """Retention pruned the journal under the backup in every round: the copy could not be made whole."""

    code = "backup_outpaced"


class DamagedBackup(RestoreError):
    """The backup was made, and its check found the snapshot file damaged, as the source's is."""

    code = "snapshot_corrupt"


@dataclass(frozen=True, slots=True)
class BackedUp:
    """What a backup holds: where it is, the lsn and time a start from it recovers to, its snapshots'
    ids (newest first), its bytes, and what checking it found."""

    path: Path
    lsn: int
    at: float | None
    snapshots: tuple[str, ...]
    bytes: int
    verification: Verification


def backup(data_dir: Path, dest: Path, *, progress: Progress | None = None) -> BackedUp:
    """Copy ``data_dir`` to ``dest`` (module docstring) and check the copy. ``BadBackupRequest`` when
    ``dest`` exists or lies inside ``data_dir``; ``DataDirectoryNotFound`` or ``NotADataDirectory`` for
    ``data_dir``; ``OSError`` for what the file system refuses (nothing is left behind then)."""
    check_data_dir(data_dir)
    dest = Path(os.path.abspath(dest))
    partial = dest.with_name(dest.name + ".partial")
    source = Path(os.path.realpath(data_dir))
    if Path(os.path.realpath(dest)).is_relative_to(source):
        raise BadBackupRequest(f"{dest} is inside the data directory {data_dir}: back up to another place")
    if os.path.lexists(dest):
        raise BadBackupRequest(f"{dest} exists: back up to a new path (nothing is overwritten)")
    if not dest.parent.is_dir():
        raise BadBackupRequest(f"{dest.parent} is not a directory: make it first")
    if not (source / JOURNAL_DIR).is_dir() and not (source / SNAPSHOTS_DIR).is_dir():
        raise BadBackupRequest(f"{data_dir} holds no broker data (no {JOURNAL_DIR}/, no {SNAPSHOTS_DIR}/)")
    if os.path.lexists(partial):
        raise BadBackupRequest(
            f"{partial} exists, left by a backup that was stopped: remove it, or back up to another path"
        )
    partial.mkdir()
    try:
        _copy_journal(source / JOURNAL_DIR, partial / JOURNAL_DIR, progress)
        for _ in range(COPY_ROUNDS):
            _copy_snapshots(source / SNAPSHOTS_DIR, partial / SNAPSHOTS_DIR, progress)
            if _top_up_journal(source / JOURNAL_DIR, partial / JOURNAL_DIR) and _journal_follows(partial):
                break  # else retention pruned since: the snapshots copied may not cover it
        else:
            raise BackupOutpaced(
                f"retention deleted journal faster than the backup copied it ({COPY_ROUNDS} rounds), so "
                "the copy could not be made whole; nothing was kept. Back up again, or keep more journal "
                "while it runs (journal_retention_bytes, journal_retention_age)"
            )
        _cut_torn_end(partial / JOURNAL_DIR)
        if (source / BOOT_FILE).exists():
            _copy_file(source / BOOT_FILE, partial / BOOT_FILE)
        _sync(partial)
        os.rename(partial, dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _sync(dest.parent)
    size = sum(path.stat().st_size for path in dest.rglob("*") if path.is_file())
    if progress is not None:
        progress("checking the backup", 0, 1)
    try:
        verification = check_directory(dest)
    except SnapshotStoreError as error:  # LMDB's copy moves pages as they are, damaged ones too
        raise DamagedBackup(
            f"the backup is in {dest}, and its snapshot file is damaged, as the data directory's must be: "
            f"{error}"
        ) from None
    snapshots = tuple(info.id for info in list_snapshots(dest))
    sound = [result.snapshot for result in verification.snapshots if result.problem is None]
    journal_at = last_record_time(dest / JOURNAL_DIR)
    journal_lsn = scan(dest / JOURNAL_DIR).last_lsn
    at: float | None = None
    if sound and sound[0].lsn >= journal_lsn:
        at = sound[0].at
    elif journal_at:
        at = journal_at
    if progress is not None:
        progress("checking the backup", 1, 1)
    return BackedUp(dest, verification.last_lsn, at, snapshots, size, verification)


def _copy_journal(journal: Path, target: Path, progress: Progress | None) -> None:
    """Copy the segments of ``journal`` into ``target`` oldest first; a segment pruned meanwhile takes
    the older ones already copied with it (never a gap). Cuts a torn end of the newest."""
    target.mkdir()
    listed = segments(journal)
    total = sum(segment.size for segment in listed)
    done = 0
    copied: list[Path] = []
    for segment in listed:
        if progress is not None:
            progress("copying the journal", done, total)
        copy = target / segment.path.name
        try:
            _copy_file(segment.path, copy)
        except FileNotFoundError:  # pruned: so were all older ones, which the snapshots now cover
            for older in [*copied, copy]:
                older.unlink(missing_ok=True)
            copied = []
            continue
        copied.append(copy)
        done += segment.size
    if progress is not None:
        progress("copying the journal", total, total)


def _top_up_journal(journal: Path, target: Path) -> bool:
    """Copy the newest segment in ``target`` anew from ``journal``, and the segments begun after it
    (module docstring, step 3). False when retention pruned that segment first, or one of the others
    while they were copied: the copy may then have a gap below the oldest segment copied now, so every
    older copy is dropped, and the snapshots must be copied again (they cover what was pruned once
    they are copied after it: retention deletes only journal the oldest snapshot kept covers)."""
    copied = segments(target)
    newest = copied[-1].first_lsn if copied else 0
    listed = [segment for segment in segments(journal) if segment.first_lsn >= newest]
    whole = not copied or (bool(listed) and listed[0].first_lsn == newest)
    done: list[Segment] = []
    for segment in listed:
        try:
            _copy_file(segment.path, target / segment.path.name, replace=True)
        except FileNotFoundError:  # pruned while copied: so were the older ones
            whole, done = False, []
            continue
        done.append(segment)
    if not whole:
        oldest = done[0].first_lsn if done else math.inf
        for copy in segments(target):
            if copy.first_lsn < oldest:
                copy.path.unlink()
    return whole


def _journal_follows(directory: Path) -> bool:
    """Whether the journal copied into ``directory`` goes on from its newest snapshot, or from the
    first record: what a start needs (``store.check_journal_reaches_back``), from the snapshots'
    headers alone. When another round cannot help (headers that cannot be read, no snapshot), yes: the
    check of the copy tells."""
    listed = segments(directory / JOURNAL_DIR)
    if not listed or listed[0].first_lsn == 1:
        return True
    try:
        newest = max((info.lsn for info in list_snapshots(directory)), default=None)
    except OSError:
        return True
    # No snapshot: retention prunes only what one covers, so the source is missing it too.
    return newest is None or listed[0].first_lsn <= newest + 1


def _cut_torn_end(target: Path) -> None:
    """Cut a torn frame at the end of the newest segment copied: the write under way as it was read,
    never acknowledged before it was read."""
    found = scan(target)
    tail = found.tail
    listed = segments(target)
    if (
        tail is not None
        and not tail.later
        and tail.readable_lsns is None
        and listed
        and tail.path == listed[-1].path
    ):
        repair(target, found)  # the write under way as the newest segment was read: nothing acknowledged


def _copy_snapshots(store: Path, target: Path, progress: Progress | None) -> None:
    """LMDB's copy of ``store`` into ``target`` (replacing an earlier one), from one read transaction:
    none when there is none.
    Not compacted: a plain copy moves pages without walking the tree, which aborts on some damaged
    pages; the check of the copy that follows walks it in a process of its own."""
    if not (store / "data.mdb").exists():
        return
    if progress is not None:
        progress("copying the snapshots", 0, 1)
    shutil.rmtree(target, ignore_errors=True)  # an earlier round's copy (``_top_up_journal``)
    target.mkdir()
    # The broker's map size: with a smaller one than the broker's, the copy may fail (MDB_MAP_RESIZED)
    # once a snapshot grows the file meanwhile. The reader's slot in LMDB's lock file (lock.mdb, shared
    # memory) keeps the broker's snapshot process from reusing the pages being copied.
    try:
        env = open_readonly(str(store), MAP_SIZE)
    except lmdb.Error as error:
        raise OSError(f"cannot open {store}: {error}") from None
    try:
        env.copy(str(target))
    except lmdb.Error as error:
        raise OSError(f"cannot copy {store}: {error}") from None
    finally:
        env.close()
    for path in target.iterdir():
        sync_path(path)
    if progress is not None:
        progress("copying the snapshots", 1, 1)


def _copy_file(source: Path, target: Path, *, replace: bool = False) -> None:
    """Copy ``source`` to a new file ``target`` (or over it, with ``replace``) and fsync it."""
    with open(source, "rb") as reading, open(target, "wb" if replace else "xb") as writing:
        while chunk := reading.read(CHUNK_BYTES):
            writing.write(chunk)
        writing.flush()
        os.fsync(writing.fileno())


def _sync(path: Path) -> None:
    """fsync ``path``; for a directory, every directory below it first (files are fsynced as they are
    written)."""
    if path.is_dir():
        for child in path.iterdir():
            if child.is_dir():
                _sync(child)
    sync_path(path)
