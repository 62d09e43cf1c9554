"""Segment files: framing, rollover, reading back, torn and corrupt tails, repair, rollback, retention."""

from __future__ import annotations

import errno
import itertools
import os
import re
import struct
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from broker.core.records import Acked, Claimed, Deleted, Nacked, Published, Record
from broker.storage import segments as segments_module
from broker.storage.format import FRAME_OVERHEAD, JOURNAL_VERSION, encode_entry, frame
from broker.storage.journal import JournalEntry
from broker.storage.segments import (
    HEADER_SIZE,
    MAGIC,
    RESERVE_BYTES,
    PartlyDeleted,
    ScanResult,
    SegmentWriter,
    UnsupportedVersion,
    WriteNotRolledBack,
    delete_before,
    read_entries,
    repair,
    scan,
    segment_header,
    segment_name,
    segments,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "journal-format.md"


def a_record(lsn: int) -> Record:
    """A few kinds of record, some with payloads, so frames differ in length."""
    kinds: list[Record] = [
        Published(f"m-{lsn}", lsn, b"p" * (lsn % 7 * 10), False, None, None, 0, 1000.0 + lsn, None),
        Claimed(f"m-{lsn}", f"m-{lsn}.1", "worker", 1, 1030.0 + lsn),
        Acked(f"m-{lsn}", f"m-{lsn}.1"),
        Nacked(f"m-{lsn}", f"m-{lsn}.1", 2.5, "timeout"),
        Deleted(f"m-{lsn}"),
    ]
    return kinds[lsn % len(kinds)]


def entries(first: int, last: int) -> list[JournalEntry]:
    return [JournalEntry(lsn, 1000.0 + lsn, "jobs", a_record(lsn)) for lsn in range(first, last + 1)]


def framed(group: Sequence[JournalEntry]) -> bytes:
    return b"".join(frame(encode_entry(*entry)) for entry in group)


def write_journal(
    directory: Path, written: Sequence[JournalEntry], *, group: int = 3, max_segment_bytes: int = 1 << 20
) -> None:
    """Write ``written`` in groups of ``group`` records (one write call each), then sync."""
    writer = SegmentWriter(directory, max_segment_bytes=max_segment_bytes)
    for start in range(0, len(written), group):
        batch = written[start : start + group]
        writer.write(framed(batch), batch[0].lsn, batch[-1].lsn)
    writer.sync()
    writer.close()


def frame_starts(data: bytes) -> list[int]:
    """The offset of every frame in a segment's bytes, and the end."""
    offsets = [HEADER_SIZE]
    while offsets[-1] < len(data):
        (length,) = struct.unpack_from("<I", data, offsets[-1])
        offsets.append(offsets[-1] + FRAME_OVERHEAD + length)
    return offsets


def files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def restore(directory: Path, saved: dict[str, bytes]) -> None:
    for path in directory.iterdir():
        path.unlink()
    for name, data in saved.items():
        (directory / name).write_bytes(data)


# -- framing and layout ------------------------------------------------------------------------------


def test_a_frame_is_length_checksum_payload_little_endian() -> None:
    payload = encode_entry(1, 1.0, "jobs", Acked("m", "l"))
    data = frame(payload)
    assert data[:8] == struct.pack("<II", len(payload), zlib.crc32(payload))
    assert data[8:] == payload


def test_a_frame_holds_at_least_one_byte() -> None:
    with pytest.raises(ValueError, match="1 to"):
        frame(b"")


def test_a_segment_is_named_by_its_first_lsn_and_starts_with_its_header(tmp_path: Path) -> None:
    write_journal(tmp_path, entries(1, 4))
    (path,) = tmp_path.iterdir()
    assert path.name == segment_name(1) == "00000000000000000001.journal"
    magic, version, first_lsn, checksum = struct.unpack_from("<4sIQI", path.read_bytes())
    assert (magic, version, first_lsn) == (MAGIC, JOURNAL_VERSION, 1) == (b"BRKJ", 2, 1)
    assert checksum == zlib.crc32(path.read_bytes()[:16])
    assert path.read_bytes()[:HEADER_SIZE] == segment_header(1)
    assert sorted(segment_name(lsn) for lsn in (10, 9, 100)) == [
        segment_name(9),
        segment_name(10),
        segment_name(100),
    ]


def test_the_example_in_the_document_is_what_the_code_writes() -> None:
    data = segment_header(1) + frame(encode_entry(1, 1763800000.5, "jobs", Acked("m-1", "m-1.1")))
    block = DOC.read_text().split("<!-- example -->", 1)[1].split("<!-- /example -->", 1)[0]
    documented = bytes.fromhex("".join(line[6:] for line in re.findall(r"^[0-9a-f]{4}  .*$", block, re.M)))
    assert documented == data


# -- writing and reading back ---------------------------------------------------------------------------


def test_what_is_written_reads_back_in_order(tmp_path: Path) -> None:
    written = entries(1, 20)
    write_journal(tmp_path, written)
    assert list(read_entries(tmp_path)) == written
    result = scan(tmp_path)
    assert (result.last_lsn, result.records, result.tail, result.next_lsn) == (20, 20, None, 21)


def test_reading_after_an_lsn_starts_right_after_it_across_segments(tmp_path: Path) -> None:
    written = entries(1, 30)
    write_journal(tmp_path, written, max_segment_bytes=400)
    assert len(segments(tmp_path)) > 3
    for after in range(0, 32):
        assert list(read_entries(tmp_path, after_lsn=after)) == written[after:]
        assert scan(tmp_path, after_lsn=after).last_lsn == 30


def test_an_empty_or_missing_directory_is_an_empty_journal(tmp_path: Path) -> None:
    for directory in (tmp_path, tmp_path / "missing"):
        assert segments(directory) == []
        assert list(read_entries(directory)) == []
        assert scan(directory) == ScanResult((), 0, 0)
        assert delete_before(directory, 10) == []


def test_other_files_in_the_directory_are_not_segments(tmp_path: Path) -> None:
    write_journal(tmp_path, entries(1, 3))
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "1.journal").write_bytes(b"x")
    (tmp_path / (segment_name(9) + ".tmp")).write_bytes(b"x")
    assert [segment.path.name for segment in segments(tmp_path)] == [segment_name(1)]
    assert scan(tmp_path).tail is None


# -- rollover -------------------------------------------------------------------------------------------


def test_segments_roll_over_at_the_size_without_splitting_a_group(tmp_path: Path) -> None:
    written = entries(1, 60)
    write_journal(tmp_path, written, group=4, max_segment_bytes=700)
    listed = segments(tmp_path)
    assert len(listed) > 4
    for segment in listed:
        data = segment.path.read_bytes()
        assert segment.size <= 700
        assert (segment.first_lsn - 1) % 4 == 0  # each segment starts with a group
        assert data[:HEADER_SIZE] == segment_header(segment.first_lsn)
    assert [segment.first_lsn for segment in listed] == sorted(segment.first_lsn for segment in listed)
    assert list(read_entries(tmp_path)) == written
    assert scan(tmp_path).tail is None


def test_a_group_larger_than_a_segment_goes_whole_into_a_segment_of_its_own(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path, max_segment_bytes=200)
    small, large, after = entries(1, 1), entries(2, 12), entries(13, 13)
    for group in (small, large, after):
        writer.write(framed(group), group[0].lsn, group[-1].lsn)
        writer.sync()
    writer.close()
    listed = segments(tmp_path)
    assert [segment.first_lsn for segment in listed] == [1, 2, 13]
    assert listed[1].size == HEADER_SIZE + len(framed(large)) > 200
    assert list(read_entries(tmp_path)) == small + large + after


def test_a_reopened_writer_appends_to_the_newest_segment(tmp_path: Path) -> None:
    write_journal(tmp_path, entries(1, 6), max_segment_bytes=10_000)
    writer = SegmentWriter(tmp_path, max_segment_bytes=10_000, last_lsn=6)
    assert writer.segment == tmp_path / segment_name(1)
    writer.write(framed(entries(7, 8)), 7, 8)
    writer.sync()
    writer.close()
    assert [segment.first_lsn for segment in segments(tmp_path)] == [1]
    assert list(read_entries(tmp_path)) == entries(1, 8)


def test_writes_must_follow_each_other(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path, last_lsn=0)
    with pytest.raises(ValueError, match="lsn 2 does not follow 0"):
        writer.write(framed(entries(2, 2)), 2, 2)
    writer.write(framed(entries(1, 2)), 1, 2)
    with pytest.raises(ValueError, match="lsn 4 does not follow 2"):
        writer.write(framed(entries(4, 4)), 4, 4)
    with pytest.raises(ValueError, match="at least one frame"):
        writer.write(b"", 3, 3)
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.write(framed(entries(3, 3)), 3, 3)


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: (path.parent / segment_name(3)).write_bytes(segment_header(3)[:7]),
        lambda path: path.write_bytes(path.read_bytes() + frame(b"x")[:5]),
        lambda path: path.write_bytes(path.read_bytes()[:-1]),
        lambda path: path.write_bytes(path.read_bytes()[:-1] + b"!"),
    ],
    ids=["torn header", "torn frame header", "torn frame", "bad checksum"],
)
def test_a_writer_will_not_append_to_a_journal_with_a_tail(
    tmp_path: Path, damage: Callable[[Path], object]
) -> None:
    write_journal(tmp_path, entries(1, 2))
    damage(tmp_path / segment_name(1))
    with pytest.raises(ValueError, match="scan and repair first"):
        SegmentWriter(tmp_path)
    result = scan(tmp_path)
    repair(tmp_path, result)
    writer = SegmentWriter(tmp_path, last_lsn=result.last_lsn)
    following = entries(result.next_lsn, result.next_lsn)
    writer.write(framed(following), result.next_lsn, result.next_lsn)
    writer.sync()
    writer.close()
    assert list(read_entries(tmp_path)) == entries(1, result.next_lsn)


def test_a_segment_with_only_its_header_is_valid_and_is_written_into_next(tmp_path: Path) -> None:
    write_journal(tmp_path, entries(1, 2))
    (tmp_path / segment_name(3)).write_bytes(segment_header(3))  # a crash right after starting a segment
    assert (scan(tmp_path).last_lsn, scan(tmp_path).tail) == (2, None)
    writer = SegmentWriter(tmp_path)
    with pytest.raises(ValueError, match="starts at 3"):
        writer.write(framed(entries(4, 4)), 4, 4)
    writer.write(framed(entries(3, 3)), 3, 3)
    writer.sync()
    writer.close()
    assert list(read_entries(tmp_path)) == entries(1, 3)
    assert [segment.first_lsn for segment in segments(tmp_path)] == [1, 3]


# -- torn tails ----------------------------------------------------------------------------------------


def test_a_tail_torn_at_any_byte_of_the_last_frame_is_cut_at_that_frame(tmp_path: Path) -> None:
    write_journal(tmp_path, entries(1, 3))
    path = tmp_path / segment_name(1)
    whole = path.read_bytes()
    last = frame_starts(whole)[-2]
    for end in range(last + 1, len(whole)):
        path.write_bytes(whole[:end])
        assert list(read_entries(tmp_path)) == entries(1, 2)
        result = scan(tmp_path)
        assert result.last_lsn == 2
        assert result.tail is not None
        assert (result.tail.path, result.tail.offset, result.tail.size) == (path, last, end - last)
        assert result.tail.readable_lsns is None
        assert "torn" in result.tail.reason
        if end % 5 == 0 or end == last + 1:  # repairing (with its fsyncs) at every offset is only slower
            assert repair(tmp_path, result) == result.tail
            assert path.read_bytes() == whole[:last]
            assert scan(tmp_path).tail is None
    path.write_bytes(whole[:last])
    # After a repair the journal takes the next record as if the torn one had never been.
    writer = SegmentWriter(tmp_path, last_lsn=2)
    writer.write(framed(entries(3, 3)), 3, 3)
    writer.sync()
    writer.close()
    assert path.read_bytes() == whole


def test_a_tail_torn_in_a_new_segment_s_header_deletes_that_segment(tmp_path: Path) -> None:
    write_journal(tmp_path, entries(1, 2))
    saved = files(tmp_path)
    for end in range(0, HEADER_SIZE):
        restore(tmp_path, saved)
        (tmp_path / segment_name(3)).write_bytes(segment_header(3)[:end])
        result = scan(tmp_path)
        assert result.tail is not None
        assert (result.last_lsn, result.tail.offset, result.tail.path.name) == (2, 0, segment_name(3))
        repair(tmp_path, result)
        assert files(tmp_path) == saved


def test_zeros_after_the_last_frame_end_the_segment_and_the_writer_writes_over_them(tmp_path: Path) -> None:
    write_journal(tmp_path, entries(1, 3))
    path = tmp_path / segment_name(1)
    whole = path.read_bytes()
    path.write_bytes(whole + bytes(4096))  # space a writer reserved (or a filesystem left after a crash)
    result = scan(tmp_path)
    assert (result.tail, result.last_lsn, result.records) == (None, 3, 3)
    writer = SegmentWriter(tmp_path, last_lsn=3)
    more = framed(entries(4, 5))
    writer.write(more, 4, 5)
    writer.sync()
    assert path.stat().st_size == len(whole) + 4096  # over the zeros: the file did not grow
    writer.close()
    assert path.read_bytes() == whole + more  # closing cut the zeros left
    assert [entry.lsn for entry in read_entries(tmp_path)] == [1, 2, 3, 4, 5]


def test_zeros_then_anything_else_are_a_tail(tmp_path: Path) -> None:
    write_journal(tmp_path, entries(1, 3))
    path = tmp_path / segment_name(1)
    whole = path.read_bytes()
    path.write_bytes(whole + bytes(4096) + frame(b"x")[:5])  # a page lost in the middle of a write
    result = scan(tmp_path)
    assert result.tail is not None
    assert (result.last_lsn, result.tail.offset, result.tail.size) == (3, len(whole), 4101)
    assert "length 0" in result.tail.reason
    repair(tmp_path, result)
    assert path.read_bytes() == whole


def test_the_writer_reserves_zeros_ahead_and_leaves_them_only_in_the_newest_segment(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path, max_segment_bytes=RESERVE_BYTES // 2)
    lsn, sizes = 0, []
    while len(segments(tmp_path)) < 3:
        lsn += 1
        writer.write(framed(entries(lsn, lsn)), lsn, lsn)
        writer.sync()
        sizes.append(segments(tmp_path)[-1].size)
    listed = segments(tmp_path)
    assert sizes[0] == RESERVE_BYTES // 2  # the first write reserved up to the segment's size
    for finished in listed[:-1]:  # cut to their frames before the next one started
        starts = frame_starts(finished.path.read_bytes())
        assert starts[-1] == finished.size and all(
            b - a > FRAME_OVERHEAD for a, b in itertools.pairwise(starts)
        )
    assert listed[-1].size == RESERVE_BYTES // 2
    writer.close()
    starts = frame_starts(listed[-1].path.read_bytes())
    assert starts[-1] == listed[-1].path.stat().st_size
    assert all(b - a > FRAME_OVERHEAD for a, b in itertools.pairwise(starts))
    assert [entry.lsn for entry in read_entries(tmp_path)] == list(range(1, lsn + 1))


# -- corruption anywhere ---------------------------------------------------------------------------------


def test_a_flipped_bit_anywhere_stops_reading_before_its_frame_and_repair_cuts_there(tmp_path: Path) -> None:
    written = entries(1, 9)
    write_journal(tmp_path, written, max_segment_bytes=450)
    saved = files(tmp_path)
    assert len(saved) >= 2
    before = 0  # records in earlier segments
    for name, data in saved.items():
        starts = frame_starts(data)
        for offset in range(len(data)):
            corrupt = bytearray(data)
            corrupt[offset] ^= 1 << (offset % 8)
            restore(tmp_path, {**saved, name: bytes(corrupt)})
            in_segment = sum(1 for start in starts[1:] if start <= offset)  # frames wholly before it
            cut_at = starts[in_segment] if offset >= HEADER_SIZE else 0
            valid = written[: before + in_segment] if offset >= HEADER_SIZE else written[:before]
            assert list(read_entries(tmp_path)) == valid, (name, offset)
            result = scan(tmp_path)
            assert result.tail is not None
            assert (result.tail.path.name, result.tail.offset, result.last_lsn) == (name, cut_at, len(valid))
            if offset % 11 == 0:  # repairing (with its fsyncs) at every offset is only slower
                repair(tmp_path, result)
                assert scan(tmp_path).tail is None
                assert list(read_entries(tmp_path)) == valid
        before += len(starts) - 1


def test_records_after_a_bad_frame_in_the_middle_are_cut_and_reported(tmp_path: Path) -> None:
    write_journal(tmp_path, entries(1, 10), max_segment_bytes=600)
    first, *later = segments(tmp_path)
    data = bytearray(first.path.read_bytes())
    starts = frame_starts(bytes(data))
    data[starts[1] + FRAME_OVERHEAD + 3] ^= 0x40  # inside the payload of lsn 2
    first.path.write_bytes(bytes(data))
    assert list(read_entries(tmp_path)) == entries(1, 1)
    result = scan(tmp_path)
    tail = result.tail
    assert tail is not None
    assert (result.last_lsn, tail.offset, tail.reason) == (1, starts[1], "a frame fails its checksum")
    assert tail.later == tuple(segment.path for segment in later)
    assert (tail.readable_records, tail.readable_lsns) == (8, (3, 10))
    assert tail.size == len(data) - starts[1] + sum(segment.size for segment in later)
    assert tail.describe() == (
        f"journal tail cut: {first.path.name} from byte {starts[1]} and {len(later)} later segments "
        f"({tail.size} bytes, 8 readable records, lsns 3-10): a frame fails its checksum"
    )
    repair(tmp_path, result)
    assert [segment.path for segment in segments(tmp_path)] == [first.path]
    assert first.path.stat().st_size == starts[1]


def test_a_record_that_does_not_decode_is_a_tail_even_with_a_good_checksum(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path)
    writer.write(framed(entries(1, 2)) + frame(b"\xa1\x61x\x01"), 1, 3)
    writer.sync()
    writer.close()
    result = scan(tmp_path)
    assert result.tail is not None
    assert result.last_lsn == 2
    assert "no valid record" in result.tail.reason
    assert "'type' must be one of" in result.tail.reason


# -- lsns must run on by one ---------------------------------------------------------------------------


def journal_of(directory: Path, groups: Sequence[Sequence[JournalEntry]], *, max_segment_bytes: int) -> None:
    """Write ``groups`` as they are, whatever their lsns (the writer does not decode frames)."""
    for group in groups:
        writer = SegmentWriter(directory, max_segment_bytes=max_segment_bytes)
        writer.write(framed(group), group[0].lsn, group[-1].lsn)
        writer.sync()
        writer.close()


@pytest.mark.parametrize(
    ("lsns", "reason"),
    [((1, 2, 4, 5), "lsn 4 where 3 was due (a gap)"), ((1, 2, 2, 3), "lsn 2 where 3 was due (a repeat)")],
)
def test_a_gap_or_repeat_inside_a_segment_is_a_tail(
    tmp_path: Path, lsns: tuple[int, ...], reason: str
) -> None:
    group = [JournalEntry(lsn, 1.0, "jobs", a_record(lsn)) for lsn in lsns]
    journal_of(tmp_path, [group], max_segment_bytes=1 << 20)
    assert [entry.lsn for entry in read_entries(tmp_path)] == [1, 2]
    result = scan(tmp_path)
    assert result.tail is not None
    assert (result.last_lsn, result.tail.reason) == (2, reason)
    assert result.tail.readable_lsns == (lsns[2], lsns[3])


@pytest.mark.parametrize(
    ("second", "reason"),
    [(5, "starts at lsn 5 where 4 was due (a gap)"), (3, "starts at lsn 3 where 4 was due (a repeat)")],
)
def test_a_gap_or_repeat_between_segments_is_a_tail(tmp_path: Path, second: int, reason: str) -> None:
    journal_of(tmp_path, [entries(1, 3), entries(second, second + 1)], max_segment_bytes=1)
    assert [segment.first_lsn for segment in segments(tmp_path)] == [1, second]
    assert list(read_entries(tmp_path)) == entries(1, 3)
    result = scan(tmp_path)
    assert result.tail is not None
    assert (result.last_lsn, result.tail.offset, result.tail.reason) == (3, 0, f"the segment {reason}")
    repair(tmp_path, result)
    assert [segment.first_lsn for segment in segments(tmp_path)] == [1]


def test_a_segment_whose_header_and_name_disagree_is_a_tail(tmp_path: Path) -> None:
    journal_of(tmp_path, [entries(1, 3), entries(4, 5)], max_segment_bytes=1)
    (tmp_path / segment_name(4)).rename(tmp_path / segment_name(6))
    result = scan(tmp_path)
    assert result.tail is not None
    assert result.tail.reason == "the segment header says it starts at lsn 4, its name at 6"


def test_a_journal_starts_where_its_first_segment_does(tmp_path: Path) -> None:
    journal_of(tmp_path, [entries(41, 44)], max_segment_bytes=1 << 20)
    assert list(read_entries(tmp_path)) == entries(41, 44)
    assert scan(tmp_path).last_lsn == 44
    (tmp_path / segment_name(41)).write_bytes(segment_header(41)[:5])
    assert scan(tmp_path).last_lsn == 40  # nothing valid: the numbering still goes on from 41


# -- another version -------------------------------------------------------------------------------------


def test_a_segment_of_another_version_is_refused_and_never_cut(tmp_path: Path) -> None:
    write_journal(tmp_path, entries(1, 3))
    start = struct.pack("<4sIQ", MAGIC, JOURNAL_VERSION + 1, 4)
    newer = start + struct.pack("<I", zlib.crc32(start)) + b"anything at all"
    (tmp_path / segment_name(4)).write_bytes(newer)
    saved = files(tmp_path)
    with pytest.raises(UnsupportedVersion, match="version 3"):
        scan(tmp_path)
    reader = read_entries(tmp_path)
    assert [next(reader) for _ in range(3)] == entries(1, 3)
    with pytest.raises(UnsupportedVersion):
        next(reader)
    assert files(tmp_path) == saved


# -- repair ---------------------------------------------------------------------------------------------


def test_repair_does_nothing_without_a_tail_and_refuses_a_journal_changed_since_its_scan(
    tmp_path: Path,
) -> None:
    write_journal(tmp_path, entries(1, 3))
    assert repair(tmp_path, scan(tmp_path)) is None
    path = tmp_path / segment_name(1)
    path.write_bytes(path.read_bytes() + b"\x05")
    result = scan(tmp_path)
    path.write_bytes(path.read_bytes() + b"\x05")
    with pytest.raises(ValueError, match="changed since it was scanned"):
        repair(tmp_path, result)


# -- rollback after a failed write or sync ------------------------------------------------------------


def test_rollback_undoes_the_writes_since_the_last_sync(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path)
    writer.write(framed(entries(1, 3)), 1, 3)
    writer.sync()
    synced = files(tmp_path)[segment_name(1)]
    half = framed(entries(4, 6))
    writer.write(half[: len(half) // 2], 4, 6)  # a torn write, as a failing disk leaves it
    writer.rollback()
    assert list(files(tmp_path)) == [segment_name(1)]
    after = files(tmp_path)[segment_name(1)]
    # Cut back to the frames synced (the zeros reserved after them go too).
    assert synced.startswith(after) and not synced[len(after) :].strip(b"\0")
    assert [entry.lsn for entry in read_entries(tmp_path)] == [1, 2, 3]
    assert frame_starts(after)[-1] == len(after)
    writer.write(half, 4, 6)
    writer.sync()
    writer.close()
    assert list(read_entries(tmp_path)) == entries(1, 6)


def test_rollback_deletes_the_segments_started_since_the_last_sync(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path, max_segment_bytes=300)
    writer.write(framed(entries(1, 3)), 1, 3)
    writer.sync()
    synced = files(tmp_path)
    for lsn in range(4, 12):
        writer.write(framed(entries(lsn, lsn)), lsn, lsn)
    assert len(segments(tmp_path)) > 2
    writer.rollback()
    assert files(tmp_path) == synced
    writer.write(framed(entries(4, 4)), 4, 4)
    writer.sync()
    writer.close()
    assert list(read_entries(tmp_path)) == entries(1, 4)


def test_rollback_before_any_sync_leaves_an_empty_directory(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path)
    writer.write(framed(entries(1, 2)), 1, 2)
    writer.rollback()
    assert segments(tmp_path) == []
    writer.close()


def failing_after(count: int, error: int) -> Callable[[int, bytes, int], int]:
    """An ``os.pwrite`` that writes ``count`` bytes of what it is given and then fails."""
    real_pwrite = os.pwrite

    def pwrite(descriptor: int, data: bytes, offset: int) -> int:
        written = real_pwrite(descriptor, bytes(data)[:count], offset)
        if written < len(data):
            raise OSError(error, os.strerror(error))
        return written

    return pwrite


def test_after_a_failed_write_the_writer_takes_nothing_until_rolled_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = SegmentWriter(tmp_path)
    writer.write(framed(entries(1, 2)), 1, 2)
    writer.sync()
    group = framed(entries(3, 5))
    with monkeypatch.context() as patch:
        patch.setattr(os, "pwrite", failing_after(len(group) // 3, errno.ENOSPC))
        with pytest.raises(OSError, match="No space"):
            writer.write(group, 3, 5)
    assert scan(tmp_path).tail is not None  # the torn frame is on disk
    with pytest.raises(WriteNotRolledBack):
        writer.write(group, 3, 5)
    with pytest.raises(WriteNotRolledBack):
        writer.sync()
    writer.rollback()
    assert scan(tmp_path).tail is None
    writer.write(group, 3, 5)
    writer.sync()
    writer.close()
    assert list(read_entries(tmp_path)) == entries(1, 5)


def test_after_a_failed_sync_the_writes_since_the_last_sync_are_rolled_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = SegmentWriter(tmp_path)
    writer.write(framed(entries(1, 2)), 1, 2)
    writer.sync()
    writer.write(framed(entries(3, 4)), 3, 4)

    def fail(descriptor: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with monkeypatch.context() as patch:
        patch.setattr(segments_module, "_sync_file", fail)
        with pytest.raises(OSError, match="Input/output error"):
            writer.sync()
    with pytest.raises(WriteNotRolledBack):
        writer.write(framed(entries(5, 5)), 5, 5)
    writer.rollback()
    assert list(read_entries(tmp_path)) == entries(1, 2)
    writer.write(framed(entries(3, 4)), 3, 4)
    writer.sync()
    writer.close()
    assert list(read_entries(tmp_path)) == entries(1, 4)


def test_a_failed_header_write_is_rolled_back_with_its_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = SegmentWriter(tmp_path, max_segment_bytes=1)
    writer.write(framed(entries(1, 2)), 1, 2)
    writer.sync()
    with monkeypatch.context() as patch:
        patch.setattr(os, "pwrite", failing_after(5, errno.ENOSPC))
        with pytest.raises(OSError):
            writer.write(framed(entries(3, 3)), 3, 3)
    assert [segment.first_lsn for segment in segments(tmp_path)] == [1, 3]
    writer.rollback()
    assert [segment.first_lsn for segment in segments(tmp_path)] == [1]
    writer.write(framed(entries(3, 3)), 3, 3)
    writer.sync()
    writer.close()
    assert list(read_entries(tmp_path)) == entries(1, 3)


# -- retention ----------------------------------------------------------------------------------------


def first_lsns(directory: Path) -> list[int]:
    return [segment.first_lsn for segment in segments(directory)]


def test_retention_deletes_only_whole_segments_at_or_below_the_lsn_and_never_the_newest(
    tmp_path: Path,
) -> None:
    journal_of(tmp_path, [entries(1, 4), entries(5, 8), entries(9, 12), entries(13, 14)], max_segment_bytes=1)
    assert first_lsns(tmp_path) == [1, 5, 9, 13]
    assert delete_before(tmp_path, 3) == []
    assert delete_before(tmp_path, 4) == [tmp_path / segment_name(1)]
    assert first_lsns(tmp_path) == [5, 9, 13]
    assert delete_before(tmp_path, 11) == [tmp_path / segment_name(5)]
    assert delete_before(tmp_path, 1000) == [tmp_path / segment_name(9)]
    assert first_lsns(tmp_path) == [13]
    assert list(read_entries(tmp_path)) == entries(13, 14)
    result = scan(tmp_path)
    assert (result.last_lsn, result.tail) == (14, None)


def test_a_journal_after_retention_reads_from_its_first_segment(tmp_path: Path) -> None:
    written = entries(1, 30)
    write_journal(tmp_path, written, max_segment_bytes=400)
    deleted = delete_before(tmp_path, 12)
    assert deleted
    first = segments(tmp_path)[0].first_lsn
    assert first <= 13
    assert list(read_entries(tmp_path)) == written[first - 1 :]
    assert list(read_entries(tmp_path, after_lsn=12)) == written[12:]
    assert scan(tmp_path).tail is None


# -- a scan from a snapshot's lsn ---------------------------------------------------------------------


def test_damage_a_snapshot_covers_is_stepped_over_at_every_byte_and_nothing_after_it_is_lost(
    tmp_path: Path,
) -> None:
    """A flipped bit below the snapshot's lsn (bit rot in old history) must not cost the records after
    the snapshot: they were acknowledged. Every byte of the covered frames, length fields included."""
    written = entries(1, 12)
    write_journal(tmp_path, written)
    path = tmp_path / segment_name(1)
    clean = path.read_bytes()
    starts = frame_starts(clean)
    covered_end = starts[6]  # frames of lsns 1-6; the snapshot covers lsn 6
    for offset in range(HEADER_SIZE, covered_end):
        damaged = bytearray(clean)
        damaged[offset] ^= 0x10
        path.write_bytes(bytes(damaged))
        result = scan(tmp_path, after_lsn=6)
        assert (result.tail, result.last_lsn) == (None, 12), offset
        assert len(result.covered_damage) == 1 and "a snapshot covers" in result.covered_damage[0]
        assert list(read_entries(tmp_path, after_lsn=6)) == written[6:], offset
    path.write_bytes(clean)


def test_covered_damage_with_nothing_after_the_snapshot_ends_the_journal_at_its_lsn_uncut(
    tmp_path: Path,
) -> None:
    write_journal(tmp_path, entries(1, 6))
    path = tmp_path / segment_name(1)
    damaged = bytearray(path.read_bytes())
    damaged[frame_starts(bytes(damaged))[2] + FRAME_OVERHEAD + 3] ^= 1  # lsn 3
    path.write_bytes(bytes(damaged))
    result = scan(tmp_path, after_lsn=6)
    assert (result.tail, result.last_lsn) == (None, 6)
    assert repair(tmp_path, result) is None
    assert path.read_bytes() == bytes(damaged)  # kept for audits, damage and all
    # A writer never appends behind damage: it starts the next segment.
    writer = SegmentWriter(tmp_path, last_lsn=6, append_to_newest=False)
    writer.write(framed(entries(7, 8)), 7, 8)
    writer.sync()
    writer.close()
    assert first_lsns(tmp_path) == [1, 7]
    assert list(read_entries(tmp_path, after_lsn=6)) == entries(7, 8)


def test_damage_right_after_the_snapshot_s_lsn_is_a_tail_as_ever(tmp_path: Path) -> None:
    write_journal(tmp_path, entries(1, 8))
    path = tmp_path / segment_name(1)
    damaged = bytearray(path.read_bytes())
    damaged[frame_starts(bytes(damaged))[4] + FRAME_OVERHEAD + 3] ^= 1  # lsn 5, after the snapshot's 4
    path.write_bytes(bytes(damaged))
    result = scan(tmp_path, after_lsn=4)
    assert result.tail is not None and result.last_lsn == 4
    assert result.covered_damage == ()


def test_a_segment_deleted_while_the_directory_is_listed_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention deleting a segment between the listing and its stat made ``segments`` raise
    ``FileNotFoundError``, which failed a backup of a running broker (a re-check)."""
    for first in (1, 8, 15):
        (tmp_path / f"{first:020d}.journal").write_bytes(b"x" * first)
    listing = os.scandir

    def pruned_meanwhile(directory: Path) -> list[os.DirEntry[str]]:
        entries = list(listing(directory))
        (tmp_path / f"{1:020d}.journal").unlink()
        return entries

    monkeypatch.setattr(segments_module.os, "scandir", pruned_meanwhile)
    assert [(segment.first_lsn, segment.size) for segment in segments(tmp_path)] == [(8, 8), (15, 15)]


def test_a_deletion_that_fails_names_the_segments_deleted_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention's caller logs what it deleted; a failure half way lost the names of those already gone."""
    for first in (1, 5, 9, 13):
        (tmp_path / segment_name(first)).write_bytes(segment_header(first))
    unlink = Path.unlink

    def second_fails(path: Path, *args: Any) -> None:
        if path.name == segment_name(5):
            raise OSError(5, "Input/output error", str(path))
        unlink(path, *args)

    monkeypatch.setattr(Path, "unlink", second_fails)
    with pytest.raises(PartlyDeleted) as failed:
        delete_before(tmp_path, 12)
    assert failed.value.deleted == [tmp_path / segment_name(1)] and failed.value.errno == 5
    assert [segment.first_lsn for segment in segments(tmp_path)] == [5, 9, 13]
