"""Segment files: the journal on disk as framed records in append-only files (docs/journal-format.md).

A journal is a directory of segment files, each named after the lsn of its first record, zero-padded
so that names sort in lsn order (``00000000000000000001.journal``). A segment is a header and then
frames, little-endian::

    header  "BRKJ" | u32 version | u64 first lsn | u32 CRC32 of the 16 bytes before it    (20 bytes)
    frame   u32 length | u32 CRC32 of the payload | payload (one record, ``broker.storage.format``)

The lsns run on by one from segment to segment, without a gap or a repeat. Everything here is
synchronous and blocking: the durable journal calls it from a worker thread, one call at a time.

Theory of reading. A frame is valid when it is whole, its checksum matches, its payload decodes, and its
lsn is the one due. The journal is its longest valid prefix: readers stop at the first frame that is not
valid, wherever it is. After a crash that frame is normally the torn end of the last write, but a bad
frame in the middle of a segment (a flipped bit) is handled the same way: frames after it cannot be
trusted to be in order or complete, so it and everything after it, later segments included, are the
*tail*. ``scan`` finds the tail and says precisely what it holds; ``repair`` cuts it, so that the next
write follows the last valid record. A segment of another format version is never cut:
``UnsupportedVersion`` stops everything instead.

Theory of writing. ``SegmentWriter.write`` appends a group of whole frames in one ``write`` call and
never splits a group across segments; ``sync`` makes everything written durable. A write or sync that
fails leaves the writer refusing more writes until ``rollback`` has cut the files back to the last
successful sync, so a half-written frame can never end up in front of good ones.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, NamedTuple

from broker.storage.codec import CborReader
from broker.storage.format import (
    FRAME,
    FRAME_OVERHEAD,
    JOURNAL_VERSION,
    LSN_KEY,
    READABLE_VERSIONS,
    CorruptRecord,
    decode_frame,
    decode_frame_at,
    frame_span,
)
from broker.storage.journal import JournalEntry

MAGIC: Final = b"BRKJ"
SUFFIX: Final = ".journal"
DEFAULT_MAX_SEGMENT_BYTES: Final = 64 * 1024 * 1024
#: Zeros a writer puts ahead of its frames at a time (see ``SegmentWriter``).
RESERVE_BYTES: Final = 1024 * 1024
_ZEROS: Final = bytes(RESERVE_BYTES)

_HEADER: Final = struct.Struct("<4sIQI")
#: Bytes of a segment header.
HEADER_SIZE: Final = _HEADER.size

_NAME: Final = re.compile(r"([0-9]{20})" + re.escape(SUFFIX))  # \d would take any Unicode digit

StrPath = str | os.PathLike[str]

#: fdatasync writes a file's data and the size that reaches it, which is all an append needs.
_sync_file: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)


class UnsupportedVersion(ValueError):
    """A segment of a journal format version this broker does not read; it is left as it is."""


class JournalGap(ValueError):
    """The journal starts past the lsn recovery has to go on from: the records between are gone (pruned
    by retention, or moved aside by a restore, after a snapshot that cannot be read now covered them).
    Replaying what is left would lose them, so nothing is."""


class WriteNotRolledBack(OSError):
    """A write or sync failed and ``SegmentWriter.rollback`` has not yet undone it."""


def segment_name(first_lsn: int) -> str:
    """The file name of the segment whose first record has ``first_lsn``."""
    return f"{first_lsn:020d}{SUFFIX}"


def segment_header(first_lsn: int, version: int = JOURNAL_VERSION) -> bytes:
    """The header of a segment of format ``version`` (this one's by default) whose first record has
    ``first_lsn``."""
    start = struct.pack("<4sIQ", MAGIC, version, first_lsn)
    return start + struct.pack("<I", zlib.crc32(start))


class Segment(NamedTuple):
    """One segment file: the lsn in its name, where it is, and its size in bytes when listed."""

    first_lsn: int
    path: Path
    size: int


def segments(directory: StrPath) -> list[Segment]:
    """The segment files in ``directory``, oldest first; other files are not looked at, nor one deleted
    while they are listed (retention, under a reader of a running broker's journal: a backup)."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match is None:
            continue
        try:
            if entry.is_file():
                found.append(Segment(int(match.group(1)), Path(entry.path), entry.stat().st_size))
        except FileNotFoundError:
            continue
    found.sort()
    return found


# -- reading ------------------------------------------------------------------------------------------


class _Problem(NamedTuple):
    segment: Segment
    offset: int
    reason: str


@dataclass(slots=True)
class _Walk:
    """How far a walk through the segments has come, and the first problem it met."""

    #: The lsn the next record must carry.
    next_lsn: int
    records: int = 0
    problem: _Problem | None = None
    #: Damage stepped over because a snapshot covers it (see ``_walk_segment``), one line each.
    covered_damage: list[str] = field(default_factory=list)
    #: No record after ``after_lsn`` was found past covered damage: whatever followed it is lost.
    ended_at_covered_damage: bool = False


def _walk_segment(walk: _Walk, segment: Segment, data: bytes, after_lsn: int) -> Iterator[JournalEntry]:
    """Yield the valid records of ``segment`` (its bytes are ``data``) with lsns above ``after_lsn``.

    Stops at the first invalid frame and records it in ``walk.problem``. Frames whose records are all
    at or below ``after_lsn`` are checked whole, against their checksum and for their lsns (which the
    first bytes of every frame's map give, ``frame_span``) but not decoded. A frame holds one record,
    or (version 2) a group of consecutive records, which may straddle ``after_lsn``.

    Damage at or below ``after_lsn`` (the lsn a snapshot covers) costs nothing that recovery needs, so
    it is stepped over rather than cut: the walk notes it in ``walk.covered_damage`` and, since a
    damaged frame's length may be wrong too, looks for the frame that holds ``after_lsn + 1`` by content
    (``_find_frame``). If it cannot be found, the journal ends at ``after_lsn``, damage and all (nothing
    is cut below a snapshot's lsn: the history stays for audits). A writer must then start a new
    segment rather than append behind the damage (``covered_damage`` tells it so). A damaged header
    of a segment whose first records the snapshot covers (by the segment's name) is such damage too:
    the frames after it carry their own checksums and lsns.
    """
    problem = _header_problem(segment, data, walk.next_lsn)
    damaged_at: int | None = None  # where covered damage was first seen in this segment
    offset = HEADER_SIZE
    if problem is not None:
        if walk.next_lsn > after_lsn or segment.first_lsn > after_lsn:
            walk.problem = _Problem(segment, 0, problem)
            return
        damaged_at = 0
        walk.covered_damage.append(
            f"{segment.path.name} at byte 0: {problem} (its records start at lsn {segment.first_lsn}, at "
            f"or below {after_lsn}, which a snapshot covers)"
        )
        resumed = _resume_after_snapshot(walk, segment, data, damaged_at, after_lsn)
        if resumed is None:
            return
        offset = resumed
    end = len(data)
    view = memoryview(data)
    reader = CborReader(data)
    while offset < end:
        lsn = walk.next_lsn
        problem = None
        if end - offset < FRAME_OVERHEAD:
            problem = f"a frame header is torn ({end - offset} of 8 bytes)"
        else:
            length, checksum = FRAME.unpack_from(data, offset)
            stop = offset + FRAME_OVERHEAD + length
            if length == 0:
                if _zeros_from(data, offset):
                    return  # the end of the segment's frames: space reserved, never written
                problem = "a frame of length 0 (zeroed space, never written)"
            elif stop > end:
                problem = f"a frame is torn ({end - offset} of {stop - offset} bytes present)"
            elif zlib.crc32(view[offset + FRAME_OVERHEAD : stop]) != checksum:
                if lsn <= after_lsn:  # covered: step over it, on the word of its length
                    if damaged_at is None:
                        damaged_at = offset
                        walk.covered_damage.append(
                            f"{segment.path.name} at byte {offset}: a frame fails its checksum (about lsn "
                            f"{lsn}, at or below {after_lsn}, which a snapshot covers)"
                        )
                    walk.next_lsn = lsn + 1
                    offset = stop
                    continue
                problem = "a frame fails its checksum"
        entries: list[JournalEntry] = []
        count = 1
        if problem is None:
            span = frame_span(data, offset + FRAME_OVERHEAD, stop)
            if span is None:
                problem = f"a frame holds no valid record: {_why_not(data[offset + FRAME_OVERHEAD : stop])}"
            elif span[0] != lsn:
                kind = "a repeat" if span[0] < lsn else "a gap"
                problem = f"lsn {span[0]} where {lsn} was due ({kind})"
            else:
                count = span[1]
                if lsn + count - 1 > after_lsn:
                    try:
                        entries = decode_frame_at(reader, offset + FRAME_OVERHEAD, stop)
                    except CorruptRecord as error:
                        problem = f"a frame holds no valid record: {error}"
        if problem is not None and lsn <= after_lsn + 1 and (damaged_at is not None or lsn <= after_lsn):
            # Damage where a snapshot covers the records (or right after damage it covers, whose
            # length may have misled the walk): find the first record recovery needs by its content.
            if damaged_at is None:
                damaged_at = offset
                walk.covered_damage.append(
                    f"{segment.path.name} at byte {offset}: {problem} (about lsn {lsn}, at or below "
                    f"{after_lsn}, which a snapshot covers)"
                )
            resumed = _resume_after_snapshot(walk, segment, data, damaged_at, after_lsn)
            if resumed is None:
                return
            offset = resumed
            continue
        if problem is not None:
            walk.problem = _Problem(segment, offset, problem)
            return
        walk.next_lsn = lsn + count
        walk.records += count
        offset = stop
        for entry in entries:
            if entry.lsn > after_lsn:
                yield entry


def _resume_after_snapshot(
    walk: _Walk, segment: Segment, data: bytes, damaged_at: int, after_lsn: int
) -> int | None:
    """After covered damage at ``damaged_at``: the offset of the frame holding ``after_lsn + 1``, with
    ``walk`` moved to its first lsn; or None, noting that nothing after the snapshot survives in this
    segment. The journal then ends at the snapshot's lsn (a later segment that does not start right
    after it is a gap, cut as a tail), and the damage stays for audits."""
    walk.next_lsn = after_lsn + 1
    found = _find_frame(data, max(damaged_at, HEADER_SIZE), after_lsn + 1)
    if found is None:
        walk.ended_at_covered_damage = True
        walk.covered_damage.append(
            f"{segment.path.name}: no record after lsn {after_lsn} found past the damage; any it held "
            "are lost"
        )
        return None
    offset, walk.next_lsn = found
    return offset


def _find_frame(data: bytes, start: int, lsn: int) -> tuple[int, int] | None:
    """The offset, at or after ``start``, of a whole frame that passes its checksum and holds the
    record of ``lsn``, and the lsn of its first record; None if there is none. Tries every offset, but
    looks closer only where the bytes look like the start of a frame's map."""
    view = memoryview(data)
    end = len(data)
    offset = data.find(LSN_KEY, start + FRAME_OVERHEAD + 1) - FRAME_OVERHEAD - 1
    while offset >= start:
        length, checksum = FRAME.unpack_from(data, offset)
        stop = offset + FRAME_OVERHEAD + length
        if length > 0 and stop <= end and zlib.crc32(view[offset + FRAME_OVERHEAD : stop]) == checksum:
            span = frame_span(data, offset + FRAME_OVERHEAD, stop)
            if span is not None and span[0] <= lsn < span[0] + span[1]:
                with contextlib.suppress(CorruptRecord):
                    decode_frame(data[offset + FRAME_OVERHEAD : stop])
                    return offset, span[0]
        found = data.find(LSN_KEY, offset + FRAME_OVERHEAD + 2)
        offset = found - FRAME_OVERHEAD - 1 if found != -1 else -1
    return None


def _why_not(payload: bytes) -> str:
    """Why ``payload`` is not a frame's record (or group), for a warning."""
    try:
        decode_frame(payload)
    except CorruptRecord as error:
        return str(error)
    return "its map does not begin with its lsn"


def _header_problem(segment: Segment, data: bytes, due_lsn: int) -> str | None:
    """What is wrong with the segment's header, if anything. Raises ``UnsupportedVersion``."""
    if len(data) < HEADER_SIZE:
        return f"the segment header is torn ({len(data)} of {HEADER_SIZE} bytes)"
    magic, version, first_lsn, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC:
        return f"the segment does not start with {MAGIC!r}"
    if zlib.crc32(data[: HEADER_SIZE - 4]) != checksum:
        return "the segment header fails its checksum"
    if version not in READABLE_VERSIONS:
        raise UnsupportedVersion(
            f"{segment.path} is journal format version {version}; this broker reads versions "
            f"{', '.join(map(str, sorted(READABLE_VERSIONS)))} only, and leaves it untouched"
        )
    if first_lsn != segment.first_lsn:
        return f"the segment header says it starts at lsn {first_lsn}, its name at {segment.first_lsn}"
    if first_lsn != due_lsn:
        kind = "a repeat" if first_lsn < due_lsn else "a gap"
        return f"the segment starts at lsn {first_lsn} where {due_lsn} was due ({kind})"
    return None


def check_follows(directory: StrPath, after_lsn: int, covered_by: str | None) -> None:
    """Raise ``JournalGap`` when the journal in ``directory`` starts past ``after_lsn + 1``, the lsn
    after what ``covered_by`` (a snapshot; None: none) holds. An empty journal follows anything."""
    listed = segments(directory)
    if not listed or listed[0].first_lsn <= after_lsn + 1:
        return
    first = listed[0].first_lsn
    if covered_by is None:
        held = "and no snapshot covers the lsns before it"
    else:
        held = f"but {covered_by} covers lsns up to {after_lsn} only"
    raise JournalGap(
        f"the journal starts at lsn {first}, {held}: lsns {after_lsn + 1}-{first - 1} are gone (a snapshot "
        "that cannot be read now covered them: retention pruned them, or a restore moved them aside), and "
        "recovering without them would lose what they held"
    )


def _start_index(listed: list[Segment], after_lsn: int) -> int:
    """The index of the segment that holds lsn ``after_lsn + 1`` (or of the first segment)."""
    start = 0
    for index, segment in enumerate(listed):
        if segment.first_lsn <= after_lsn + 1:
            start = index
    return start


def read_entries(directory: StrPath, *, after_lsn: int = 0) -> Iterator[JournalEntry]:
    """The valid records with lsns above ``after_lsn``, oldest first, from the segments in ``directory``.

    Stops quietly before the first frame that is not valid: a reader of a journal that is being written
    meets a half-written frame at its end as a matter of course. ``scan`` tells whether a journal has a
    tail and what it holds. The first record yielded may come after ``after_lsn + 1`` when older
    segments were deleted (retention); a caller that needs the records to join up checks that itself.
    Raises ``UnsupportedVersion`` on reaching a segment of another format version.
    """
    listed = segments(directory)
    if not listed:
        return
    listed = listed[_start_index(listed, after_lsn) :]
    walk = _Walk(next_lsn=listed[0].first_lsn)
    for segment in listed:
        yield from _walk_segment(walk, segment, _read_file(segment.path), after_lsn)
        if walk.problem is not None:
            return


def _read_file(path: Path) -> bytes:
    with open(path, "rb") as file:
        return file.read()


@dataclass(frozen=True, slots=True)
class Tail:
    """The part of a journal after its last valid frame, which ``repair`` cuts."""

    #: The segment holding the first invalid byte, and the offset the valid frames end at: the file is
    #: cut to this size, or deleted when not even its header is valid (``offset`` < ``HEADER_SIZE``).
    path: Path
    offset: int
    #: What is wrong at ``offset``.
    reason: str
    #: Later segments, deleted whole.
    later: tuple[Path, ...]
    #: Bytes cut in all.
    size: int
    #: Records in the tail that still pass their checksum and decode (they are cut all the same), and
    #: the lowest and highest of their lsns.
    readable_records: int
    readable_lsns: tuple[int, int] | None

    def describe(self) -> str:
        """A one-line warning naming what is cut."""
        cut = f"{self.path.name} from byte {self.offset}"
        if self.later:
            cut += f" and {len(self.later)} later segment{'s' if len(self.later) > 1 else ''}"
        if self.readable_lsns is None:
            held = "no readable record"
        else:
            low, high = self.readable_lsns
            held = f"{self.readable_records} readable record{'s' if self.readable_records > 1 else ''}, "
            held += f"lsn {low}" if low == high else f"lsns {low}-{high}"
        return f"journal tail cut: {cut} ({self.size} bytes, {held}): {self.reason}"


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What ``scan`` found."""

    #: Every segment file, oldest first, with its size at the scan.
    segments: tuple[Segment, ...]
    #: The lsn of the last valid record; with no valid record, the lsn before the first segment's
    #: (so the next record keeps the numbering), or 0 for an empty journal.
    last_lsn: int
    #: Valid records checked.
    records: int
    tail: Tail | None = None
    #: Damage at or below ``after_lsn`` stepped over, one line each (see ``_walk_segment``).
    covered_damage: tuple[str, ...] = ()
    #: The journal ends at such damage: no record after ``after_lsn`` could be found past it.
    ended_at_covered_damage: bool = False

    @property
    def next_lsn(self) -> int:
        return self.last_lsn + 1


def scan(directory: StrPath, *, after_lsn: int = 0) -> ScanResult:
    """Check every frame of every segment in ``directory``; report the last valid lsn and the tail.

    With ``after_lsn`` (the lsn a snapshot covers), segments wholly at or before it are trusted
    unread, and records at or before it are checked against their checksums but not decoded: recovery
    needs only what comes after, and an old journal kept for auditing can be large.
    Raises ``UnsupportedVersion`` for a segment of another format version.
    """
    scanning = Scan(directory, after_lsn=after_lsn)
    for _ in scanning:
        pass
    return scanning.result


class Scan:
    """``scan`` that also yields the valid records above ``after_lsn`` as it checks them, so recovery
    reads and decodes the journal once: iterate it, then read ``result`` (``ValueError`` before the end).
    """

    def __init__(self, directory: StrPath, *, after_lsn: int = 0) -> None:
        self._directory = directory
        self._after_lsn = after_lsn
        self._result: ScanResult | None = None

    @property
    def result(self) -> ScanResult:
        if self._result is None:
            raise ValueError("the scan has not reached the end of the journal yet")
        return self._result

    def __iter__(self) -> Iterator[JournalEntry]:
        listed = segments(self._directory)
        if not listed:
            self._result = ScanResult((), 0, 0)
            return
        start = _start_index(listed, self._after_lsn)
        walk = _Walk(next_lsn=listed[start].first_lsn)
        for index in range(start, len(listed)):
            segment = listed[index]
            data = _read_file(segment.path)
            yield from _walk_segment(walk, segment, data, self._after_lsn)
            if walk.problem is not None:
                tail = _tail(walk.problem, data, listed[index + 1 :])
                damage = tuple(walk.covered_damage)
                self._result = ScanResult(
                    tuple(listed), walk.next_lsn - 1, walk.records, tail, damage, walk.ended_at_covered_damage
                )
                return
        self._result = ScanResult(
            tuple(listed),
            walk.next_lsn - 1,
            walk.records,
            covered_damage=tuple(walk.covered_damage),
            ended_at_covered_damage=walk.ended_at_covered_damage,
        )


def _tail(problem: _Problem, data: bytes, later: list[Segment]) -> Tail:
    """The tail from ``problem`` on (``data`` is its segment's bytes), with the records still readable."""
    lsns = _readable_lsns(data, max(problem.offset, HEADER_SIZE))
    for segment in later:
        lsns += _readable_lsns(_read_file(segment.path), HEADER_SIZE)
    return Tail(
        path=problem.segment.path,
        offset=problem.offset,
        reason=problem.reason,
        later=tuple(segment.path for segment in later),
        size=len(data) - problem.offset + sum(segment.size for segment in later),
        readable_records=len(lsns),
        readable_lsns=(min(lsns), max(lsns)) if lsns else None,
    )


def _readable_lsns(data: bytes, offset: int) -> list[int]:
    """The lsns of the frames from ``offset`` on that pass their checksum and decode, stepping over bad
    ones while their lengths fit the file: what a torn or corrupt tail still holds, for the warning."""
    lsns = []
    view = memoryview(data)
    while offset + FRAME_OVERHEAD <= len(data):
        length, checksum = FRAME.unpack_from(data, offset)
        stop = offset + FRAME_OVERHEAD + length
        if length == 0 or stop > len(data):
            break
        if zlib.crc32(view[offset + FRAME_OVERHEAD : stop]) == checksum:
            with contextlib.suppress(CorruptRecord):
                lsns += [entry.lsn for entry in decode_frame(data[offset + FRAME_OVERHEAD : stop])]
        offset = stop
    return lsns


def repair(directory: StrPath, result: ScanResult) -> Tail | None:
    """Cut the tail ``result`` found: delete the later segments (newest first), then cut the segment
    holding the first invalid frame back to its last valid one (or delete it, when its header is not
    valid), each step made durable. Returns what was cut, for a warning; None when there was no tail.

    Raises ``ValueError`` when the segments changed since the scan, rather than cut what it did not see.
    """
    tail = result.tail
    if tail is None:
        return None
    if [(segment.first_lsn, segment.size) for segment in segments(directory)] != [
        (segment.first_lsn, segment.size) for segment in result.segments
    ]:
        raise ValueError(f"the journal in {directory} changed since it was scanned; scan it again")
    # Newest first, each deletion durable before the next step: a crash part-way leaves a prefix of the
    # segments and the same tail for the next scan to find.
    for path in reversed(tail.later):
        path.unlink()
        sync_path(directory)
    if tail.offset < HEADER_SIZE:
        tail.path.unlink()
        sync_path(directory)
    else:
        descriptor = os.open(tail.path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(descriptor, tail.offset)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    return tail


class PartlyDeleted(OSError):
    """``delete_before`` failed after deleting ``deleted`` (the paths, oldest first; maybe none)."""

    def __init__(self, error: OSError, deleted: list[Path]) -> None:
        super().__init__(error.errno, error.strerror, error.filename)
        self.deleted = deleted


def delete_before(directory: StrPath, lsn: int) -> list[Path]:
    """Delete the segments whose records all have lsns at or below ``lsn``, oldest first; the newest
    segment is always kept. Returns the paths deleted; ``PartlyDeleted`` names them when one fails.

    A segment's records end where the next segment's begin, so only its successor's name is needed.
    Each deletion is made durable before the next, so a crash never leaves a gap in the journal.
    """
    deleted: list[Path] = []
    listed = segments(directory)
    for segment, successor in itertools.pairwise(listed):
        if successor.first_lsn - 1 > lsn:
            break
        try:
            segment.path.unlink()
            sync_path(directory)
        except OSError as error:
            raise PartlyDeleted(error, deleted) from error
        deleted.append(segment.path)
    return deleted


def sync_path(path: StrPath) -> None:
    """fsync ``path``: a file's contents, or a directory's entries (the creation, deletion or renaming
    of files in it)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# -- writing ------------------------------------------------------------------------------------------


class _Mark(NamedTuple):
    """A position in the journal: the current segment (None before the first), its size, the last lsn
    written (None while unknown)."""

    segment: Path | None
    first_lsn: int
    size: int
    last_lsn: int | None


class SegmentWriter:
    """Appends groups of frames to the newest segment of ``directory``, starting a new segment when the
    current one holds frames and the group would take it past ``max_segment_bytes``.

    A group is never split, so a segment can exceed the size by one group that is larger on its own.

    The writer keeps zeros ahead of its frames (``RESERVE_BYTES`` at a time, written when the frames
    reach them) and writes frames over them. An fdatasync after an append that grows the file must also
    commit the file's new size, a filesystem journal commit shared with every other process's metadata;
    over reserved space it writes the data alone (ext4 on this project's VM: 0.17 → 0.07 ms idle, and
    far less waiting under load). So the newest segment may end in zeros, which readers take for its end
    (docs/journal-format.md); a finished segment is cut to its frames, durably, before the next one
    starts, and ``close`` cuts the newest.
    Opening appends to the newest segment as it is, so a journal with a tail must be ``repair``-ed
    first; with ``append_to_newest=False`` the first write starts a new segment instead (after damage
    that a scan stepped over). ``last_lsn``, when given, is the lsn of the journal's last record: writes
    are then checked to follow it (they are always checked to follow each other). One thread at a time.
    """

    def __init__(
        self,
        directory: StrPath,
        *,
        max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES,
        last_lsn: int | None = None,
        append_to_newest: bool = True,
    ) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            self.directory.mkdir(parents=True)
            sync_path(self.directory.parent)
        self._max_segment_bytes = max_segment_bytes
        self._file: int | None = None  # the current segment, opened for writing
        self._segment: Path | None = None
        self._first_lsn = 0
        self._size = 0  # where the frames end
        self._allocated = 0  # where the file ends: zeros from ``_size`` on
        self._last_lsn = last_lsn
        #: Segments finished since the last sync: still open, to be synced by the next ``sync``.
        self._finished: list[int] = []
        #: Segments created since the last sync, which ``rollback`` deletes.
        self._created: list[Path] = []
        self._failed = False
        self._closed = False
        listed = segments(self.directory)
        # A segment of an older version stays as it is: the first write starts a new one.
        if listed and append_to_newest and not _older_version(listed[-1].path):
            newest = listed[-1]
            self._open(newest.path, newest.first_lsn)
        self._mark = self._here()

    @property
    def segment(self) -> Path | None:
        """The segment being written, if any."""
        return self._segment

    def write(self, data: bytes, first_lsn: int, last_lsn: int) -> None:
        """Append ``data``, the frames of the records ``first_lsn`` … ``last_lsn``, with one write call
        (more only when the system writes part of it).

        Not durable until ``sync``. Raises ``OSError`` when the write fails, after which the writer
        takes no more writes until ``rollback``; ``ValueError`` for lsns that do not follow the last.
        """
        self._check_usable()
        if not data or last_lsn < first_lsn:
            raise ValueError(f"a write holds at least one frame (lsns {first_lsn}-{last_lsn})")
        if self._last_lsn is not None and first_lsn != self._last_lsn + 1:
            raise ValueError(f"lsn {first_lsn} does not follow {self._last_lsn}, the last written")
        if self._file is not None and self._size == HEADER_SIZE and first_lsn != self._first_lsn:
            raise ValueError(
                f"lsn {first_lsn} cannot open {self._segment}, which starts at {self._first_lsn}"
            )
        if self._file is None or (
            self._size > HEADER_SIZE and self._size + len(data) > self._max_segment_bytes
        ):
            self._start_segment(first_lsn)
        assert self._file is not None
        self._failed = True  # until every byte is written
        end = self._size + len(data)
        if end > self._allocated:
            allocated = max(end, min(self._allocated + RESERVE_BYTES, self._max_segment_bytes))
            _write_at(self._file, memoryview(_ZEROS)[: allocated - end], end)
            self._allocated = allocated
        _write_at(self._file, data, self._size)
        self._failed = False
        self._size += len(data)
        self._last_lsn = last_lsn

    def sync(self) -> None:
        """Make every write so far durable: sync the segments written and, when a segment was created,
        the directory. After a failure, the writer takes no more writes until ``rollback``."""
        self._check_usable()
        self._failed = True  # until everything is synced: a failed fsync may have lost pages
        for descriptor in self._finished:
            _sync_file(descriptor)
        if self._file is not None:
            _sync_file(self._file)
        if self._created:
            sync_path(self.directory)
        self._failed = False
        while self._finished:
            os.close(self._finished.pop())
        self._created.clear()
        self._mark = self._here()

    def rollback(self) -> None:
        """Undo every write since the last successful ``sync`` (or the opening): delete the segments
        created since, and cut the segment that was current then back to its size then.

        May be called again when it fails; the writer takes writes again once it succeeds.
        """
        if self._closed:
            raise ValueError("the segment writer is closed")
        self._failed = True
        self._close_files()
        removed = False
        while self._created:
            self._created[-1].unlink(missing_ok=True)
            self._created.pop()
            removed = True
        if removed:
            sync_path(self.directory)
        mark = self._mark
        self._segment = None
        self._size = 0
        if mark.segment is not None:
            os.truncate(mark.segment, mark.size)  # the reserved zeros go too
            self._open(mark.segment, mark.first_lsn)
        self._last_lsn = mark.last_lsn
        self._failed = False

    def close(self) -> None:
        """Cut the zeros reserved after the last frame and close the files, without syncing them."""
        if not self._closed:
            self._closed = True
            if self._file is not None and not self._failed and self._allocated > self._size:
                with contextlib.suppress(OSError):  # zeros left behind read as the end anyway
                    os.ftruncate(self._file, self._size)
            self._close_files()

    def _check_usable(self) -> None:
        if self._closed:
            raise ValueError("the segment writer is closed")
        if self._failed:
            raise WriteNotRolledBack(errno.EIO, "a journal write or sync failed and was not rolled back")

    def _here(self) -> _Mark:
        return _Mark(self._segment, self._first_lsn, self._size, self._last_lsn)

    def _open(self, path: Path, first_lsn: int) -> None:
        # Appending after a torn frame would hide every later record behind it, so the segment must
        # end cleanly. Checking lengths and checksums (no decoding) costs ~20 ms for a full segment.
        data = _read_file(path)
        end = _whole_frames_end(data)
        if data[:HEADER_SIZE] != segment_header(first_lsn) or not _zeros_from(data, end):
            raise ValueError(f"{path} does not end with a whole, valid frame; scan and repair first")
        descriptor = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        self._file, self._segment, self._first_lsn, self._size = descriptor, path, first_lsn, end
        self._allocated = len(data)

    def _start_segment(self, first_lsn: int) -> None:
        if self._file is not None and self._allocated > self._size:
            # Only the newest segment may end in zeros, as readers before reserved space expect.
            self._failed = True  # until the cut is durable
            os.ftruncate(self._file, self._size)
            _sync_file(self._file)
            self._failed = False
            self._allocated = self._size
        path = self.directory / segment_name(first_lsn)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._created.append(path)
        if self._file is not None:
            self._finished.append(self._file)
        self._file, self._segment, self._first_lsn, self._size = descriptor, path, first_lsn, 0
        self._allocated = 0
        self._failed = True  # until the header is whole
        _write_at(descriptor, segment_header(first_lsn), 0)
        self._failed = False
        self._size = self._allocated = HEADER_SIZE

    def _close_files(self) -> None:
        while self._finished:
            os.close(self._finished.pop())
        if self._file is not None:
            descriptor, self._file = self._file, None
            os.close(descriptor)


def _older_version(path: Path) -> bool:
    """Whether a segment has a whole, valid header of an older version that this broker reads."""
    with open(path, "rb") as file:
        head = file.read(HEADER_SIZE)
    if len(head) < HEADER_SIZE:
        return False
    magic, version, _, checksum = _HEADER.unpack(head)
    valid = magic == MAGIC and zlib.crc32(head[: HEADER_SIZE - 4]) == checksum
    return valid and version != JOURNAL_VERSION and version in READABLE_VERSIONS


def _whole_frames_end(data: bytes) -> int:
    """The offset where the run of whole frames with matching checksums after the header ends."""
    offset = HEADER_SIZE
    view = memoryview(data)
    while offset + FRAME_OVERHEAD <= len(data):
        length, checksum = FRAME.unpack_from(data, offset)
        stop = offset + FRAME_OVERHEAD + length
        if length == 0 or stop > len(data) or zlib.crc32(view[offset + FRAME_OVERHEAD : stop]) != checksum:
            break
        offset = stop
    return offset


def _zeros_from(data: bytes, offset: int) -> bool:
    """Whether every byte of ``data`` from ``offset`` on is zero (space reserved, never written)."""
    return data.count(0, offset) == len(data) - offset


def _write_at(descriptor: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(descriptor, view, offset)
        view = view[written:]
        offset += written
