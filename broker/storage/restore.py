"""Offline operations on a data directory (``broker snapshot list|verify|restore``), run while no broker
holds it (they take its lock, so a live broker's directory is refused).

Restoring never deletes history: the journal as it was is moved aside to
``journal.before-restore-<UTC time>/`` (still readable by the Spark tool), snapshots newer than the
point restored to are dropped, and the state restored to becomes the newest snapshot, with a journal
that starts right after it (an empty segment named after its lsn + 1: ``_mark_journal_start``). The next
``broker serve`` starts from exactly that state, and refuses to start without it.

Errors: a request that cannot be met is a ``RestoreError`` (one subclass per reason, each with the
``code`` the ``broker`` command prints); what the file system or LMDB refuses stays an ``OSError``
(``SnapshotStoreError`` for the snapshot file), and ``DataDirectoryInUse`` when a broker holds the
directory. ``verify`` and ``restore`` never create a data directory that does not exist.

Long work reports ``progress(what, done, total)``: reading a snapshot (in bytes of its values), then
replaying the journal (in bytes of its segments, a segment at a time).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

from broker.clock import format_time
from broker.storage.journal import JournalEntry
from broker.storage.recovery import Recovered, replay
from broker.storage.segments import (
    HEADER_SIZE,
    SUFFIX,
    JournalGap,
    ScanResult,
    check_follows,
    read_entries,
    scan,
    segment_header,
    segment_name,
    segments,
    sync_path,
)
from broker.storage.snapshots import (
    JOURNAL_DIR,
    CorruptSnapshot,
    SnapshotInfo,
    check_pages,
    delete_snapshots,
    environment,
    newest_valid,
    read_headers,
    read_snapshot,
    return_freed_memory,
    write_snapshot,
)
from broker.storage.store import check_journal_reaches_back, check_nothing_lost, lock_data_dir

#: ``progress(what, done, total)``: the phase of the work, and how far it is, in that phase's units.
Progress = Callable[[str, int, int], None]


class RestoreError(ValueError):
    """What the operator asked cannot be done; the message says why. Nothing was changed."""

    code = "restore_refused"


class BadRestoreRequest(RestoreError):
    """The request itself is wrong: neither or both of an id and a time, a time that is not one."""

    code = "bad_input"


class DataDirectoryNotFound(RestoreError):
    """There is no data directory where one was named (it is not created)."""

    code = "data_dir_not_found"


class NotADataDirectory(RestoreError):
    """The path named as the data directory is a file."""

    code = "not_a_directory"


class SnapshotNotFound(RestoreError):
    """No snapshot has the id asked for."""

    code = "snapshot_not_found"


class SnapshotUnusable(RestoreError):
    """The snapshot asked for fails its checksum or cannot be decoded."""

    code = "snapshot_corrupt"


class NothingToRestore(RestoreError):
    """Nothing was recorded before the time asked for."""

    code = "nothing_to_restore"


def check_data_dir(data_dir: Path) -> None:
    """Raise unless ``data_dir`` is an existing directory."""
    if not data_dir.exists():
        raise DataDirectoryNotFound(f"there is no data directory {data_dir}")
    if not data_dir.is_dir():
        raise NotADataDirectory(f"{data_dir} is a file, not a data directory")


@dataclass(frozen=True, slots=True)
class Verified:
    snapshot: SnapshotInfo
    problem: str | None


@dataclass(frozen=True, slots=True)
class Verification:
    """What ``verify`` found: each snapshot's problem (None when sound), newest first; the journal's; and
    the start's refusal, in its own words (``cannot start: …``), when ``broker serve`` would refuse."""

    snapshots: list[Verified]
    journal_problem: str | None
    start_problem: str | None
    #: The lsn a start recovers to: the snapshot's it starts from, or the journal's last valid record's.
    last_lsn: int = 0

    @property
    def sound(self) -> bool:
        problems = [result.problem for result in self.snapshots]
        return not any([*problems, self.journal_problem, self.start_problem])


@dataclass(frozen=True, slots=True)
class Restored:
    snapshot: SnapshotInfo
    archived_journal: Path | None
    dropped_snapshots: tuple[str, ...]
    replayed: int


def verify(data_dir: Path) -> Verification:
    """Check every snapshot's checksums (its header's included) and the journal's frames: per
    snapshot ``problem`` (None when sound), and what is wrong with the journal, if anything, in the
    words of what the next ``broker serve`` does about it (nothing is repaired here): a tail it cuts,
    or damage under the newest sound snapshot that it steps over. And the start's own refusals
    (``store.check_journal_reaches_back``, ``store.check_nothing_lost``), run as the start runs them:
    a journal that does not reach back to the newest snapshot that reads, or to the first record, and a
    snapshot that cannot be read covering lsns nothing else reaches."""
    check_data_dir(data_dir)
    lock = lock_data_dir(data_dir)
    try:
        return check_directory(data_dir)
    finally:
        lock.close()


def check_directory(data_dir: Path) -> Verification:
    """``verify``'s checks, on a directory the caller holds or that no broker uses (a backup)."""
    check_pages(data_dir)
    found, damaged = read_headers(data_dir)
    problems: dict[str, str | None] = {}

    def checked(info: SnapshotInfo) -> Recovered:
        try:
            recovered = read_snapshot(data_dir, info)
        except (CorruptSnapshot, ValueError, KeyError) as error:
            problems[info.id] = str(error)
            raise
        problems[info.id] = None
        return recovered

    # The snapshot the start recovers from, chosen as the start chooses it (and read once).
    base, skipped = newest_valid(data_dir, read=checked)
    base_lsn = base.last_lsn if base is not None else 0
    start_problem = None
    try:
        check_journal_reaches_back(data_dir, base, skipped)
    except JournalGap as gap:
        start_problem = f"cannot start: {gap}"
    del base  # only its lsn is needed: the queues read go before the next snapshot is read
    return_freed_memory()
    results = []
    for info in found:
        if info.id not in problems:
            try:
                read_snapshot(data_dir, info)
                problems[info.id] = None
            except (CorruptSnapshot, ValueError, KeyError) as error:
                problems[info.id] = str(error)
            return_freed_memory()  # the queues just read are dropped: their heap goes back to the system
        results.append(Verified(info, problems[info.id]))
    for snapshot in damaged:  # only its id is known: the rest of what it says is not to be trusted
        unknown = SnapshotInfo(snapshot.id, snapshot.lsn, 0.0, 0.0, 0, 0, 0, 0)
        results.append(Verified(unknown, snapshot.problem))
    results.sort(key=lambda result: result.snapshot.lsn, reverse=True)
    journal = data_dir / JOURNAL_DIR
    after_base = scan(journal, after_lsn=base_lsn)  # what the start scans
    if start_problem is None:
        try:
            check_nothing_lost(data_dir, base_lsn, after_base, skipped)
        except JournalGap as gap:
            start_problem = f"cannot start: {gap}"
    sound = [result.snapshot for result in results if result.problem is None]
    newest = sound[0] if sound else None
    journal_problem = _journal_problem(journal, newest, after_base)
    return Verification(results, journal_problem, start_problem, max(base_lsn, after_base.last_lsn))


def _journal_problem(journal: Path, newest: SnapshotInfo | None, start: ScanResult) -> str | None:
    """What is wrong with the journal, all of it checked, said as what a start from the snapshot
    ``newest`` (the one it would recover from, after whose lsn ``start`` scanned the journal) does
    about it."""
    whole = start if newest is None else scan(journal)
    if whole.tail is None:
        return None
    problems = []
    if newest is not None:
        covered = list(start.covered_damage)
        # Where the whole journal first fails, when that is not what the start cuts: damage the
        # start steps over, or that lies in a segment it does not read, wholly under the snapshot.
        first = whole.tail
        where = f"{first.path.name} at byte {first.offset}: "
        cut_by_start = start.tail is not None and (start.tail.path, start.tail.offset) == (
            first.path,
            first.offset,
        )
        if not cut_by_start and not any(line.startswith(where) for line in covered):
            covered.insert(0, where + first.reason)
        if covered:
            problems.append(
                f"damage under snapshot {newest.id}, which the next start steps over (the journal goes "
                f"on in a new segment; the audit reports it): {'; '.join(covered)}"
            )
    if start.tail is not None:
        # ``describe`` words what recovery does ("journal tail cut: …"); verify changes nothing.
        found_tail = start.tail.describe().removeprefix("journal tail cut: ")
        problems.append(f"a torn or corrupt tail, which the next start cuts: {found_tail}")
    return "; and ".join(problems)


def restore(
    data_dir: Path,
    *,
    snapshot_id: str | None = None,
    until: float | None = None,
    progress: Progress | None = None,
) -> Restored:
    """Make the state of snapshot ``snapshot_id``, or the state as of time ``until`` (the newest
    snapshot before it plus the journal up to it), the directory's newest state."""
    if snapshot_id is None and until is None:
        raise BadRestoreRequest("say what to restore: a snapshot id, or --until a time")
    if snapshot_id is not None and until is not None:
        raise BadRestoreRequest("say what to restore: a snapshot id or --until a time, not both")
    check_data_dir(data_dir)
    lock = lock_data_dir(data_dir)
    try:
        check_pages(data_dir)
        journal = data_dir / JOURNAL_DIR
        replayed = 0
        if snapshot_id is not None:
            found, damaged = read_headers(data_dir)
            matching = [info for info in found if info.id == snapshot_id.zfill(20)]
            for snapshot in damaged:
                if snapshot.id == snapshot_id.zfill(20):
                    raise SnapshotUnusable(f"snapshot {snapshot_id} cannot be restored: {snapshot.problem}")
            if not matching:
                raise SnapshotNotFound(f"there is no snapshot {snapshot_id} in {data_dir}")
            try:
                state = read_snapshot(data_dir, matching[0], progress=_phase(progress, "reading snapshot"))
            except (CorruptSnapshot, ValueError, KeyError) as error:
                raise SnapshotUnusable(f"snapshot {snapshot_id} cannot be restored: {error}") from None
        else:
            assert until is not None
            reading = _phase(progress, "reading snapshot")
            base, skipped = newest_valid(data_dir, progress=reading)
            while base is not None and _millisecond(base.last_at) > _millisecond(until):
                base, more = newest_valid(data_dir, until_lsn=base.last_lsn - 1, progress=reading)
                skipped += more
            start = base.last_lsn if base is not None else 0
            entries: Iterator[JournalEntry]
            try:
                check_follows(journal, start, "the newest snapshot before that time" if base else None)
            except JournalGap:
                if skipped or not _starts_at_a_restore(data_dir, start):
                    raise RestoreError(_unreachable(data_dir, until, start, skipped)) from None
                # What came between ``start`` and the restored snapshot (which reads) was moved aside:
                # the journal in place holds none of it; the checks below judge the time as they did
                # when a restore left the journal empty.
                entries = iter(())
            else:
                entries = read_entries(journal, after_lsn=start)
            state = base if base is not None else Recovered()
            before = state.records
            if progress is not None:
                entries = _reporting(entries, journal, start, progress)
            bounded = _UntilTime(entries, until)
            state = replay(bounded, state)
            replayed = state.records - before
            if not bounded.passed:
                _check_reached(data_dir, start, state, until)
            _check_not_moved_aside(data_dir, state, until)
            if state.last_lsn == 0:
                first = bounded.first_after
                raise NothingToRestore(
                    f"nothing was recorded before {format_time(until)}"
                    if first is None
                    else f"the journal's first record (lsn {first.lsn}) is from {format_time(first.at)}, "
                    f"after {format_time(until)}: nothing was recorded before it"
                )
        move = _plan_archive(journal)
        return_freed_memory()  # what decoding freed, before the snapshot is encoded
        if move is None:  # an earlier restore's mark goes first: it must not outlive the snapshot it follows
            _clear_start_marks(journal)
        dropped = _drop_snapshots_after(data_dir, state.last_lsn)
        info = write_snapshot(data_dir, state)
        archived = _archive_journal(journal, move)
        _mark_journal_start(journal, info.lsn)
        return Restored(info, archived, dropped, replayed)
    finally:
        lock.close()


def _starts_at_a_restore(data_dir: Path, start: int) -> bool:
    """Whether the journal begins right after a snapshot newer than lsn ``start``: where a restore
    started it (``_mark_journal_start``), the lsns up to that snapshot moved aside with the journal."""
    first = segments(data_dir / JOURNAL_DIR)[0].first_lsn
    return any(lsn == first - 1 for lsn, _ in _snapshots_after(data_dir, start))


def _unreachable(data_dir: Path, until: float, start: int, skipped: list[str]) -> str:
    """Why the journal does not reach back to ``start`` (the lsn of the newest snapshot before
    ``until`` that can be read, or 0), for the ``restore_refused`` message. Retention deletes only what
    the oldest snapshot kept covers, so the lsns before the journal went with snapshots rotated out
    (``snapshots.KEEP`` are kept), unless a snapshot that covered them cannot be read now."""
    first = segments(data_dir / JOURNAL_DIR)[0].first_lsn
    found, _ = read_headers(data_dir)
    message = f"cannot restore as of {format_time(until)}: the journal starts at lsn {first}, "
    if start:
        message += f"and the newest readable snapshot before that time covers lsns up to {start} only: "
    else:
        message += "and no snapshot kept was taken before that time: "
    archived = _archived_journals(data_dir)
    if archived:
        message += (
            f"lsns {start + 1}-{first - 1} were deleted by the journal's retention, or moved aside by "
            f"an earlier restore (to {archived})"
        )
    else:
        message += f"lsns {start + 1}-{first - 1} were deleted by the journal's retention"
    if skipped:
        message += ", and the snapshots that covered them cannot be read now: " + "; ".join(skipped)
    elif found:
        oldest = found[-1]
        message += (
            " once the snapshots that covered them were rotated out (the newest "
            f"{len(found)} are kept). The earliest time that can be restored is "
            f"{format_time(oldest.at, round_up=True)}, the oldest snapshot kept ({oldest.id})"
        )
    return message + ". Nothing was changed."


def _phase(progress: Progress | None, what: str) -> Callable[[int, int], None] | None:
    if progress is None:
        return None
    return lambda done, total: progress(what, done, total)


def _reporting(
    entries: Iterator[JournalEntry], journal: Path, after_lsn: int, progress: Progress
) -> Iterator[JournalEntry]:
    """``entries``, reporting the bytes of the segments passed as replay moves from one to the next."""
    listed = segments(journal)
    first = max([index for index, segment in enumerate(listed) if segment.first_lsn <= after_lsn + 1] or [0])
    listed = listed[first:]
    total = sum(segment.size for segment in listed)
    done = 0
    current = 0
    progress("replaying the journal", done, total)
    for entry in entries:
        while current + 1 < len(listed) and entry.lsn >= listed[current + 1].first_lsn:
            done += listed[current].size
            current += 1
            progress("replaying the journal", done, total)
        yield entry
    progress("replaying the journal", total, total)


def _millisecond(seconds: float) -> int:
    """A time as the API shows it, rounded to the millisecond: what ``--until`` is compared at."""
    return round(seconds * 1000)


class _UntilTime:
    """The entries up to time ``until``, to the millisecond as the API shows times (rounded: an ack shown
    at ``…39.639Z`` and recorded at ``…39.6390698`` is in as of ``…39.639Z``); ``passed`` once one after
    it was met (the replay reached ``until``, rather than the journal's readable end)."""

    def __init__(self, entries: Iterator[JournalEntry], until: float) -> None:
        self._entries = entries
        self._until_ms = _millisecond(until)
        self.passed = False
        #: The entry that came after ``until``, once met.
        self.first_after: JournalEntry | None = None

    def __iter__(self) -> Iterator[JournalEntry]:
        for entry in self._entries:
            if _millisecond(entry.at) > self._until_ms:
                self.passed = True
                self.first_after = entry
                return
            yield entry


def _check_reached(data_dir: Path, start: int, state: Recovered, until: float) -> None:
    """Refuse (``RestoreError``) a restore whose replay ran out before ``until`` with records missing:
    at damage, or where the journal ends though a snapshot shows that more was recorded (an earlier
    restore moved the journal aside). What was recorded past that point, which may be before ``until``,
    cannot be replayed, and restoring less than was asked without a word would serve that loss as the
    state of that time. A time no later than the last record replayed was reached whole."""
    reached = format_time(state.last_at, round_up=True)
    if state.last_lsn and until <= parse_time(reached):
        return
    journal = data_dir / JOURNAL_DIR
    found = scan(journal, after_lsn=start)
    damage = list(found.covered_damage) if found.ended_at_covered_damage else []
    if found.tail is not None:
        damage.append(found.tail.describe().removeprefix("journal tail cut: "))
    if not damage:
        _check_nothing_missing(data_dir, state, until)
        return  # the journal simply ends: nothing was recorded after its last record
    if not state.last_lsn:
        raise RestoreError(
            f"cannot restore as of {format_time(until)}: the journal is damaged before its first record "
            f"({'; '.join(damage)}), and no snapshot kept was taken before that time. Nothing was changed."
        )
    raise RestoreError(
        f"cannot restore as of {format_time(until)}: the journal is damaged after lsn {state.last_lsn} "
        f"({'; '.join(damage)}), so nothing it recorded after {reached} can be replayed. The latest time "
        f"that can be restored is {reached}: restore --until {reached} takes the state up to the damage. "
        "Nothing was changed."
    )


def _check_nothing_missing(data_dir: Path, state: Recovered, until: float) -> None:
    """Refuse when a snapshot covers lsns past the journal's end: they were recorded, so the journal
    read does not hold the whole history up to ``until``."""
    newer = _snapshots_after(data_dir, state.last_lsn)
    if not newer:
        return
    lsn, snapshot_id = newer[0]
    archived = _archived_journals(data_dir)
    where = (
        f" (an earlier restore moved them aside, to {archived}, which the Spark tool can audit)"
        if archived
        else ""
    )
    raise RestoreError(
        f"cannot restore as of {format_time(until)}: snapshot {snapshot_id} shows that lsns "
        f"{state.last_lsn + 1}-{lsn} were recorded, but the journal does not hold them{where}, and "
        "they may be before that time. Restore a snapshot by id instead (broker snapshot list), or a time "
        "that the journal since reaches. Nothing was changed."
    )


def _check_not_moved_aside(data_dir: Path, state: Recovered, until: float) -> None:
    """Refuse when a journal that an earlier restore moved aside holds records of the timeline that was
    the broker's at ``until`` (the restore came after ``until``) which the state replayed misses: the
    ones after its last lsn, recorded after its last record and by ``until``. The journal in place
    continues the restored state's lsns and runs only from the restore on, so it cannot hold them."""
    until_ms, last_ms = _millisecond(until), _millisecond(state.last_at)
    for archive in sorted(data_dir.glob(f"{JOURNAL_DIR}.before-restore-*")):
        moved_at = _archive_time(archive)
        if moved_at is not None and until >= moved_at:
            continue  # at ``until`` the broker was on the timeline the restore began
        for entry in read_entries(archive, after_lsn=state.last_lsn):
            at_ms = _millisecond(entry.at)
            if at_ms > until_ms:
                break
            if at_ms > last_ms:
                raise RestoreError(
                    f"cannot restore as of {format_time(until)}: an earlier restore moved the records "
                    f"from lsn {entry.lsn} ({format_time(entry.at)}) on aside, to {archive.name}/, and the "
                    "journal in place, which runs from that restore on, does not hold them: the state "
                    f"restored would leave out what they recorded by then. To restore a time among "
                    f"them, move {JOURNAL_DIR}/ aside, move {archive.name}/ back to {JOURNAL_DIR}/, and "
                    "restore again. Nothing was changed."
                )


def last_record_time(journal: Path) -> float:
    """The time of the journal's newest valid record, 0 when it has none: read from its newest segment
    that holds one."""
    for segment in reversed(segments(journal)):
        times = [entry.at for entry in read_entries(journal, after_lsn=segment.first_lsn - 1)]
        if times:
            return max(times)
    return 0.0


def _archive_time(archive: Path) -> float | None:
    """When ``_archive_journal`` moved ``archive`` aside: from its ``MOVED_AT`` file, or for an archive
    made before that file was written, from its name, to the second (so the second after its stamp)."""
    with contextlib.suppress(OSError, ValueError):
        return float((archive / MOVED_AT).read_text())
    stamp = archive.name.rpartition("-")[2]
    try:
        return datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).timestamp() + 1.0
    except ValueError:
        return None


def _drop_snapshots_after(data_dir: Path, lsn: int) -> tuple[str, ...]:
    """Delete the snapshots past ``lsn``, those whose header is damaged included (by their id's lsn)."""
    newer = [snapshot_id for _, snapshot_id in _snapshots_after(data_dir, lsn)]
    if not newer:
        return ()
    with environment(data_dir) as env, env.begin(write=True) as txn:
        delete_snapshots(txn, newer)
    return tuple(newer)


def _snapshots_after(data_dir: Path, lsn: int) -> list[tuple[int, str]]:
    """``(lsn, id)`` of every snapshot past ``lsn``, oldest first, those whose header is damaged included
    (by their id's lsn)."""
    found, damaged = read_headers(data_dir)
    return sorted(
        [(info.lsn, info.id) for info in found if info.lsn > lsn]
        + [(bad.lsn, bad.id) for bad in damaged if bad.lsn > lsn]
    )


def _archived_journals(data_dir: Path) -> str:
    """The journals earlier restores moved aside (``_archive_journal``), named for a message."""
    return ", ".join(sorted(path.name + "/" for path in data_dir.glob(f"{JOURNAL_DIR}.before-restore-*")))


#: The file in an archived journal that says when a restore moved it aside (seconds since the epoch):
#: a later ``--until`` before that time is on the archive's timeline. Not a segment: readers skip it.
MOVED_AT = "moved-at"


class _Move(NamedTuple):
    """Where a restore moves the journal aside, and the time it writes as when (``MOVED_AT``)."""

    target: Path
    moved_at: float


def _plan_archive(journal: Path) -> _Move | None:
    """Where ``_archive_journal`` will move ``journal`` (None when it holds nothing): worked out before
    the restore changes anything, so that a journal it cannot read stops the restore unchanged. The time
    is the journal's own when later than the host's: its records may be ahead of the host's clock
    (``clock_behind_journal``), and a later --until between them and the host's time must still see
    that they were moved aside. A name taken already (two restores within a millisecond of journal
    time) gets a number."""
    if not journal.exists() or all(_is_start_mark(path) for path in journal.iterdir()):
        return None  # nothing, or only where an earlier restore marked the start (``_mark_journal_start``)
    moved_at = max(time.time(), last_record_time(journal) + 0.001)
    whole, millis = divmod(round(moved_at * 1000), 1000)
    stamp = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(whole))}.{millis:03d}Z"
    target = journal.with_name(f"{journal.name}.before-restore-{stamp}")
    number = 1
    while target.exists():
        number += 1
        target = journal.with_name(f"{journal.name}.before-restore-{stamp}-{number}")
    return _Move(target, moved_at)


def _archive_journal(journal: Path, move: _Move | None) -> Path | None:
    if move is None:
        return None
    journal.rename(move.target)
    (move.target / MOVED_AT).write_text(f"{move.moved_at!r}\n")
    journal.mkdir()
    return move.target


def _mark_journal_start(journal: Path, lsn: int) -> None:
    """Start the journal in place, which a restore leaves empty, with an empty segment named after
    ``lsn + 1``: the restored snapshot, lsn ``lsn``, is then the only copy of the lsns before it, and
    says so outside LMDB. Without it, an empty journal "follows" any snapshot (``check_follows``): a
    damaged page that hid the restored snapshot, header and all, while LMDB still walked the file
    whole, let a start serve an older snapshot's state without a word. With it, the start refuses
    (the journal starts at lsn ``lsn + 1``, and the newest snapshot that reads covers less). The
    broker's first records go on in this segment."""
    journal.mkdir(exist_ok=True)
    _clear_start_marks(journal)
    if segments(journal):
        return
    name = segment_name(lsn + 1)
    written = journal / f"{name}{_PARTIAL}"  # renamed whole into place: a crash leaves no torn mark
    written.write_bytes(segment_header(lsn + 1))
    sync_path(written)
    written.rename(journal / name)
    sync_path(journal)


def _clear_start_marks(journal: Path) -> None:
    """Delete the marks earlier restores left with nothing written after them (and a mark's partial
    write), durably."""
    if not journal.exists():
        return
    marks = [path for path in journal.iterdir() if _is_start_mark(path)]
    for path in marks:
        path.unlink()
    if marks:
        sync_path(journal)


#: The name a mark is written under before it is renamed into place (``_mark_journal_start``).
_PARTIAL = ".partial"


def _is_start_mark(path: Path) -> bool:
    """Whether ``path`` is a segment that holds its header alone, as ``_mark_journal_start`` writes it,
    or a mark's write that a crash cut short."""
    if path.name.endswith(SUFFIX + _PARTIAL):
        return True
    return path.name.endswith(SUFFIX) and path.stat().st_size == HEADER_SIZE


#: RFC 3339's date-time (§5.6): ``datetime.fromisoformat`` alone takes more of ISO 8601 (week dates,
#: ``20261123T1000Z``, an hour alone, a comma before the fraction), which an operator typing a time
#: wrong would have restored to without a word.
_RFC_3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?(?:[Zz]|[+-][0-9]{2}:[0-9]{2})"
)


def parse_time(text: str) -> float:
    """An RFC 3339 time (``2026-11-22T10:00:00Z``, offsets allowed) as seconds since the epoch."""
    if _RFC_3339.fullmatch(text) is None:
        if _RFC_3339.fullmatch(text + "Z") is not None:
            raise BadRestoreRequest(f"{text!r} has no time zone: add Z for UTC")
        raise BadRestoreRequest(f"{text!r} is not a time like 2026-11-22T10:00:00Z (RFC 3339)")
    try:
        parsed = datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
    except ValueError:
        raise BadRestoreRequest(f"{text!r} is not a time like 2026-11-22T10:00:00Z") from None
    if parsed.tzinfo is None:
        raise BadRestoreRequest(f"{text!r} has no time zone: add Z for UTC")
    try:
        parsed.astimezone(UTC)
    except OverflowError:
        raise BadRestoreRequest(
            f"{text!r} is out of range: it is before year 1 or after year 9999 in UTC"
        ) from None
    return parsed.timestamp()
