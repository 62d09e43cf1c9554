"""Reading journal segments into rows of the loader's schema, without Spark (the data source's worker
half, and testable on its own).

Records are decoded by the broker's own ``broker.storage.format.decode_frame``; segment headers are
checked against ``broker.storage.segments.segment_header``. What this module adds is a walk over the
frames of *one* segment that also keeps each frame's bytes (the ``raw`` column): ``segments`` reads a
journal as a whole (``read_entries``) and does not hand out frames, so the loop is written here, to the
same rules (docs/journal-format.md, "Torn and corrupt tails"): a segment is read up to its first invalid
frame (torn, zero length, bad checksum, not a record, or not the lsn due) and nothing after it; zeros
to the end of the file are space the broker reserved, where the segment's frames end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from broker.core.config import redacted_url
from broker.core.records import (
    RECORD_TYPES,
    Acked,
    Claimed,
    DeadLettered,
    Deferred,
    Deleted,
    Expired,
    Extended,
    LeaseExpired,
    Nacked,
    Published,
    Purged,
    QueueCreated,
    QueueDeleted,
    QueueUpdated,
    Redriven,
    Released,
    Replaced,
)
from broker.storage.format import (
    FRAME,
    FRAME_OVERHEAD,
    READABLE_VERSIONS,
    CorruptRecord,
    decode_frame,
    encode_entry,
    frame_span,
)
from broker.storage.journal import JournalEntry
from broker.storage.segments import (
    HEADER_SIZE,
    MAGIC,
    Segment,
    UnsupportedVersion,
    _readable_lsns,
    segment_header,
    segments,
)
from tools.journal_audit.schema import COLUMN_NAMES

_VERSION: Final = struct.Struct("<I")

# The data directory's layout (broker.storage.store.JOURNAL_DIR, broker.storage.snapshots.SNAPSHOTS_DIR),
# spelled out so that Spark's workers need not import Trio and LMDB; a test checks they agree.
JOURNAL_DIR: Final = "journal"
SNAPSHOTS_DIR: Final = "snapshots.lmdb"


class UnreadableJournal(ValueError):
    """A valid record the loader cannot give as a row (an integer beyond the 64 bits of its column, which
    the format allows but the broker never writes): the audit cannot run on this journal. The message
    names the segment, the lsn and the field."""


#: How a Spark failure caused by ``UnreadableJournal`` in a worker names it in its text.
_UNREADABLE_MARK: Final = f"{UnreadableJournal.__name__}: "


def unreadable_in(error: BaseException) -> UnreadableJournal | None:
    """The ``UnreadableJournal`` a Spark worker raised, found in the text of the error Spark gives the
    driver for it (a ``PythonException`` or a JVM error wrapping it); None when it is not one."""
    if isinstance(error, UnreadableJournal):
        return error
    text = str(error)
    at = text.rfind(_UNREADABLE_MARK)
    if at == -1:
        return None
    message = text[at + len(_UNREADABLE_MARK) :].splitlines()[0].strip()
    return UnreadableJournal(message)


# -- where the journal is -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Location:
    """A path the tools were given, resolved: the journal's directory, and the data directory it
    belongs to when there is one (for the snapshots: see ``tools.journal_audit.live``)."""

    journal: Path
    data_dir: Path | None


def locate(path: str | os.PathLike[str]) -> Location:
    """Accept a data directory (``<dir>/journal/`` holds the segments) or a journal directory itself.

    A directory named ``journal`` whose parent holds ``snapshots.lmdb`` is that data directory's journal;
    one whose parent holds none is a journal alone (even an empty one).
    A journal moved aside by a restore (``journal.before-restore-…``) no longer matches the snapshots
    beside it, so it is a bare journal. Raises ``FileNotFoundError`` when there is no journal there.
    """
    given = Path(path)
    if not given.is_dir():
        raise FileNotFoundError(f"{given} is not a directory")
    if (given / JOURNAL_DIR).is_dir():
        return Location(given / JOURNAL_DIR, given)
    if given.name == JOURNAL_DIR:
        # A data directory's journal (with its snapshots, when there are any), possibly still empty: a
        # broker that started and stopped without a request leaves an empty journal/ and no snapshots.
        return Location(given, given.parent if (given.parent / SNAPSHOTS_DIR).is_dir() else None)
    if segments(given):
        return Location(given, None)
    raise FileNotFoundError(f"{given} holds no journal: neither segment files nor a {JOURNAL_DIR}/ directory")


# -- one segment ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class SegmentRead:
    """How far reading one segment got: its records, and why it stopped before the end, if it did."""

    segment: Segment
    records: int = 0
    last_lsn: int | None = None
    #: None when every byte of the segment was read; else what is wrong at ``stopped_at``.
    problem: str | None = None
    stopped_at: int = 0
    #: The lsn due where reading stopped (the last valid record's lsn + 1).
    next_lsn: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def read_segment(
    segment: Segment,
    read: SegmentRead | None = None,
    *,
    until_lsn: int | None = None,
    start: int = 0,
    stop: int | None = None,
    raw: bool = True,
) -> Iterator[tuple[JournalEntry, bytes]]:
    """The records of one segment with the bytes of each (its CBOR map), oldest first.

    Stops quietly before the first invalid frame and says why in ``read`` (a half-written frame at the
    end of the newest segment is normal while the broker writes). Stops after ``until_lsn``. Raises
    ``UnsupportedVersion`` for a segment of another format version, as the broker's reader does.

    With ``start`` and ``stop`` (byte offsets), only the frames that begin in ``[start, stop)`` are
    decoded and yielded: a slice of the segment, so that several workers can share a large one. The
    frames before ``start`` are still checked (whole, checksum), so a slice stops where reading the
    whole segment would, and no frame belongs to two slices. ``raw`` False: the bytes of a group's
    record are not made (``b""``), for a caller that only checks the records decode.
    """
    state = read if read is not None else SegmentRead(segment)
    with open(segment.path, "rb") as file:
        data = file.read()
    if all(data[:HEADER_SIZE] != segment_header(segment.first_lsn, version) for version in READABLE_VERSIONS):
        if data[:4] == MAGIC and len(data) >= 8:
            (version,) = _VERSION.unpack_from(data, 4)
            if version not in READABLE_VERSIONS:
                raise UnsupportedVersion(
                    f"{segment.path} is journal format version {version}; this tool reads versions "
                    f"{', '.join(map(str, sorted(READABLE_VERSIONS)))} only"
                )
        state.problem = "the segment header is not valid (torn, bad checksum, or another lsn than its name)"
        state.next_lsn = segment.first_lsn
        return
    end = len(data)
    offset = HEADER_SIZE
    lsn = segment.first_lsn
    view = memoryview(data)
    unpack = FRAME.unpack_from
    crc32 = zlib.crc32
    limit = end if stop is None else min(stop, end)
    while offset < limit:
        if until_lsn is not None and lsn > until_lsn:
            break
        if end - offset < FRAME_OVERHEAD:
            state.problem = "a frame header is torn"
            break
        length, checksum = unpack(data, offset)
        after = offset + FRAME_OVERHEAD + length
        if length == 0 and data.count(0, offset) == end - offset:
            break  # zeros the broker reserved for frames to come: the end of the segment's frames
        if length == 0 or after > end:
            state.problem = "a frame of length 0" if length == 0 else "a frame is torn"
            break
        if crc32(view[offset + FRAME_OVERHEAD : after]) != checksum:
            state.problem = "a frame fails its checksum"
            break
        span = frame_span(data, offset + FRAME_OVERHEAD, after)
        if span is None or span[0] != lsn:
            state.problem = (
                "a frame holds no valid record" if span is None else f"lsn {span[0]} where {lsn} was due"
            )
            break
        count = span[1]
        if offset >= start:
            payload = data[offset + FRAME_OVERHEAD : after]
            try:
                entries = decode_frame(payload)
            except CorruptRecord as error:
                state.problem = f"a frame holds no valid record: {error}"
                break
            for entry in entries:
                if until_lsn is not None and entry.lsn > until_lsn:
                    break
                state.records += 1
                state.last_lsn = entry.lsn
                # A record of a group (format version 2) has no bytes of its own in the file: ``raw``
                # is the map a frame of its own would hold (docs/audit.md).
                if count == 1:
                    yield entry, payload
                else:
                    yield entry, encode_entry(entry.lsn, entry.at, entry.queue, entry.record) if raw else b""
        lsn += count
        offset = after
    state.stopped_at = offset
    state.next_lsn = lsn


#: What ``check_segment`` finds: a dict of plain values, to travel from a Spark worker and in JSON.
SegmentCheck = dict[str, Any]


def check_segment(path: str, first_lsn: int, start: int = 0, stop: int | None = None) -> SegmentCheck:
    """Read one segment, or the slice of it whose frames begin in ``[start, stop)``, as the loader does
    (``read_segment``: every frame before ``stop`` whole, checksum, lsn due; the slice's records
    decoded), and say where and why reading stops, if it stops before the end: what the audit needs to
    tell damage from a torn tail (``read_segment`` keeps it in ``SegmentRead``, which Spark's workers
    cannot hand back with the rows). A frame that passes its checksum yet holds no record that decodes
    stops the loader too, so the records are decoded here (checking the frames alone missed it: the
    audit then passed a journal the broker would cut there). ``source.segment_checks`` joins the slices'
    checks into one per segment. A dict, to travel from a Spark worker:

    ``segment`` (file name), ``first_lsn``, ``next_lsn`` (the lsn due where reading stopped),
    ``problem`` (None: every frame is valid), ``offset`` (the byte it stopped at), and
    ``readable_after``: ``(count, lowest, highest)`` of the records past the problem whose frames still
    pass their checksum and decode (None: none), found as the broker finds them for its warning
    (``broker.storage.segments._readable_lsns``). A problem with records readable after it is damage,
    not a frame cut short by a crash.
    """
    segment = Segment(first_lsn, Path(path), 0)
    state = SegmentRead(segment)
    for _ in read_segment(segment, state, start=start, stop=stop, raw=False):
        pass
    readable = None
    if state.problem is not None:
        with open(path, "rb") as file:
            data = file.read()
        lsns = _readable_lsns(data, max(state.stopped_at, HEADER_SIZE))
        if lsns:
            readable = (len(lsns), min(lsns), max(lsns))
    return {
        "segment": segment.path.name,
        "first_lsn": first_lsn,
        "next_lsn": state.next_lsn,
        "problem": state.problem,
        "offset": state.stopped_at,
        "readable_after": readable,
    }


# -- records as rows ------------------------------------------------------------------------------------

_US: Final = 1_000_000
_DAY: Final = 86_400


def _us(seconds: float | None) -> int | None:
    """Seconds since the epoch as whole microseconds (Spark's timestamp precision); rounding keeps order."""
    return None if seconds is None else round(seconds * _US)


# Every converter returns the record's own columns, from ``message_id`` to ``id_prefix`` in schema order:
# message_id, seq, lease_id, consumer, attempt, deadline, delay, reason, refunded, to_queue,
# payload_size, binary, headers, key, priority, published_at, available_at, origin_queue, origin_id,
# count, max_attempts, config, id_prefix  (23 columns)
_NONE23: Final = (None,) * 23


def _config_columns(config: Any) -> tuple[Any, ...]:
    fields = dataclasses.asdict(config)
    if fields.get("push"):  # a push signing secret never leaves the broker (docs/push.md), nor a password
        fields["push"]["secret"] = None
        fields["push"]["url"] = redacted_url(fields["push"]["url"])
    as_json = json.dumps(fields, sort_keys=True)
    return (config.max_attempts, as_json)


#: What a push signing secret reads as in ``raw``: the field's default, "none" (docs/audit.md).
REDACTED_SECRET: Final = ""


def redacted_raw(entry: JournalEntry, raw: bytes) -> bytes:
    """``raw`` for the ``raw`` column: the record's own bytes, except that a ``queue_created`` or
    ``queue_updated`` whose config holds a push signing secret (or a URL with a password) is re-encoded
    (by the broker's encoder) with them blanked, as the ``config`` column blanks them. It still decodes
    as a record."""
    record = entry.record
    if not isinstance(record, QueueCreated | QueueUpdated):
        return raw
    push = record.config.push
    if push is None or (push.secret == REDACTED_SECRET and redacted_url(push.url) == push.url):
        return raw
    blanked = dataclasses.replace(push, secret=REDACTED_SECRET, url=redacted_url(push.url))
    config = dataclasses.replace(record.config, push=blanked)
    return encode_entry(entry.lsn, entry.at, entry.queue, dataclasses.replace(record, config=config))


def _published(r: Published) -> tuple[Any, ...]:
    origin = r.origin
    return (
        r.id, r.seq, None, None, None, None, None, None, None, None,
        len(r.payload), r.binary, None if r.headers is None else dict(r.headers), r.key, r.priority,
        _us(r.published_at), _us(r.available_at),
        None if origin is None else origin[0], None if origin is None else origin[1],
        None, None, None, None,
    )  # fmt: skip


def _replaced(r: Replaced) -> tuple[Any, ...]:
    return (
        r.id, None, None, None, None, None, None, None, None, None,
        len(r.payload), r.binary, None if r.headers is None else dict(r.headers),
        None, None, None, None, None, None, None, None, None, None,
    )  # fmt: skip


def _claimed(r: Claimed) -> tuple[Any, ...]:
    return (r.id, None, r.lease_id, r.consumer, r.attempt, _us(r.deadline), *_NONE23[6:])


def _lease_only(r: Acked | LeaseExpired) -> tuple[Any, ...]:
    return (r.id, None, r.lease_id, *_NONE23[3:])


def _nacked(r: Nacked) -> tuple[Any, ...]:
    return (r.id, None, r.lease_id, None, None, None, r.delay, r.reason, *_NONE23[8:])


def _deferred(r: Deferred) -> tuple[Any, ...]:
    return (r.id, None, r.lease_id, None, None, None, r.retry_after, r.reason, *_NONE23[8:])


def _extended(r: Extended) -> tuple[Any, ...]:
    return (r.id, None, r.lease_id, None, None, _us(r.deadline), *_NONE23[6:])


def _released(r: Released) -> tuple[Any, ...]:
    return (r.id, None, r.lease_id, None, None, None, None, None, r.refunded, *_NONE23[9:])


def _dead_lettered(r: DeadLettered) -> tuple[Any, ...]:
    return (r.id, None, r.lease_id, None, r.attempt, None, None, r.reason, None, r.to, *_NONE23[10:])


def _moved(r: Expired | Redriven) -> tuple[Any, ...]:
    return (r.id, *_NONE23[1:9], r.to, *_NONE23[10:])


def _deleted(r: Deleted) -> tuple[Any, ...]:
    return (r.id, *_NONE23[1:])


def _purged(r: Purged) -> tuple[Any, ...]:
    return (*_NONE23[:19], r.count, None, None, None)


def _queue_created(r: QueueCreated) -> tuple[Any, ...]:
    return _NONE23[:20] + _config_columns(r.config) + (r.id_prefix,)


def _queue_updated(r: QueueUpdated) -> tuple[Any, ...]:
    return _NONE23[:20] + _config_columns(r.config) + (None,)


def _queue_deleted(r: QueueDeleted) -> tuple[Any, ...]:
    return _NONE23


_CONVERTERS: Final[dict[type[Any], Callable[[Any], tuple[Any, ...]]]] = {
    Published: _published,
    Replaced: _replaced,
    Claimed: _claimed,
    Acked: _lease_only,
    Nacked: _nacked,
    Deferred: _deferred,
    Extended: _extended,
    Released: _released,
    LeaseExpired: _lease_only,
    DeadLettered: _dead_lettered,
    Expired: _moved,
    Redriven: _moved,
    Deleted: _deleted,
    Purged: _purged,
    QueueCreated: _queue_created,
    QueueUpdated: _queue_updated,
    QueueDeleted: _queue_deleted,
}
_CONFIG_RECORDS: Final = frozenset({QueueCreated, QueueUpdated})


def to_row(entry: JournalEntry, raw: bytes, segment_name: str) -> tuple[Any, ...]:
    """One record as a tuple of the schema's columns (timestamps in microseconds, ``day`` in days);
    ``raw`` is the record's bytes, which a queue record holding a push secret does not keep as they are
    (``redacted_raw``)."""
    record = entry.record
    kind = type(record)
    return (
        entry.lsn,
        round(entry.at * _US),
        entry.queue,
        RECORD_TYPES[kind],
        *_CONVERTERS[kind](record),
        segment_name,
        int(entry.at // _DAY),
        redacted_raw(entry, raw) if kind in _CONFIG_RECORDS else raw,
    )


assert len(_NONE23) + 7 == len(COLUMN_NAMES)


def rows(
    segment: Segment,
    read: SegmentRead | None = None,
    *,
    until_lsn: int | None = None,
    start: int = 0,
    stop: int | None = None,
) -> Iterator[tuple[Any, ...]]:
    """The rows of one segment, or of a slice of it (see ``read_segment`` and ``to_row``)."""
    name = segment.path.name
    for entry, raw in read_segment(segment, read, until_lsn=until_lsn, start=start, stop=stop):
        yield to_row(entry, raw, name)
