"""Group frames (journal format version 2) in segments: read record by record from any lsn, cut whole
when damaged or torn, stepped over when a snapshot covers them, and version 1 segments still read."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from broker.core.records import Acked, Claimed, Published, Record
from broker.storage.format import FRAME_OVERHEAD, encode_entry, encode_frames, frame
from broker.storage.journal import JournalEntry
from broker.storage.segments import (
    HEADER_SIZE,
    SegmentWriter,
    read_entries,
    repair,
    scan,
    segment_header,
    segment_name,
    segments,
)

AT = 1000.0


def run(first: int, last: int, kind: str) -> list[JournalEntry]:
    """Records ``first`` … ``last`` of one kind, as one command makes them (one time, one queue)."""

    def record(lsn: int) -> Record:
        if kind == "published":
            return Published(f"m-{lsn}", lsn, b"p" * lsn, False, None, None, 0, AT, None)
        if kind == "claimed":
            return Claimed(f"m-{lsn}", f"l-{lsn}", "worker", 1, AT + 30)
        return Acked(f"m-{lsn}", f"l-{lsn}")

    return [JournalEntry(lsn, AT, "jobs", record(lsn)) for lsn in range(first, last + 1)]


def write_runs(directory: Path, runs: Sequence[list[JournalEntry]]) -> list[JournalEntry]:
    """Write each run as the broker does (one group frame when it has two records or more, one write
    call per run), then sync; returns every record written."""
    writer = SegmentWriter(directory)
    for entries in runs:
        frames = encode_frames(entries[0].lsn, AT, "jobs", [entry.record for entry in entries])
        writer.write(b"".join(frames), entries[0].lsn, entries[-1].lsn)
    writer.sync()
    writer.close()
    return [entry for entries in runs for entry in entries]


def frame_offsets(data: bytes) -> list[int]:
    offsets = [HEADER_SIZE]
    while offsets[-1] < len(data):
        offsets.append(
            offsets[-1] + FRAME_OVERHEAD + int.from_bytes(data[offsets[-1] : offsets[-1] + 4], "little")
        )
    return offsets


RUNS = [run(1, 1, "published"), run(2, 5, "published"), run(6, 8, "claimed"), run(9, 10, "acked")]


def test_groups_read_back_record_by_record_from_any_lsn(tmp_path: Path) -> None:
    written = write_runs(tmp_path, RUNS)
    assert len(frame_offsets((tmp_path / segment_name(1)).read_bytes())) - 1 == 4  # four frames
    for after in range(0, 11):
        assert list(read_entries(tmp_path, after_lsn=after)) == written[after:], after
    result = scan(tmp_path)
    assert (result.last_lsn, result.records, result.tail) == (10, 10, None)


def test_a_damaged_group_is_cut_whole_and_the_next_record_takes_its_first_lsn(tmp_path: Path) -> None:
    written = write_runs(tmp_path, RUNS)
    path = tmp_path / segment_name(1)
    data = bytearray(path.read_bytes())
    data[frame_offsets(bytes(data))[2] + FRAME_OVERHEAD + 20] ^= 0x40  # inside the group of lsns 6-8
    path.write_bytes(bytes(data))
    result = scan(tmp_path)
    assert result.last_lsn == 5 and result.tail is not None
    assert result.tail.reason == "a frame fails its checksum"
    assert (result.tail.readable_records, result.tail.readable_lsns) == (2, (9, 10))  # the group after it
    repair(tmp_path, result)
    assert list(read_entries(tmp_path)) == written[:5]
    again = write_runs(tmp_path, [run(6, 7, "acked")])
    assert list(read_entries(tmp_path)) == written[:5] + again


def test_a_torn_group_at_the_end_is_a_tail(tmp_path: Path) -> None:
    written = write_runs(tmp_path, RUNS)
    path = tmp_path / segment_name(1)
    data = path.read_bytes()
    path.write_bytes(data[: frame_offsets(data)[3] + 11])  # the group of lsns 9-10, cut short
    result = scan(tmp_path)
    assert result.last_lsn == 8 and result.tail is not None and "torn" in result.tail.reason
    assert list(read_entries(tmp_path)) == written[:8]


def test_damage_in_a_group_a_snapshot_covers_is_stepped_over_even_into_a_group_that_straddles_it(
    tmp_path: Path,
) -> None:
    written = write_runs(tmp_path, RUNS)
    path = tmp_path / segment_name(1)
    data = bytearray(path.read_bytes())
    data[frame_offsets(bytes(data))[1] + FRAME_OVERHEAD + 20] ^= 0x40  # the group of lsns 2-5
    path.write_bytes(bytes(data))
    # The snapshot covers lsn 6: the group of 6-8 straddles it, and only 7 and 8 are due.
    assert list(read_entries(tmp_path, after_lsn=6)) == written[6:]
    result = scan(tmp_path, after_lsn=6)
    assert (result.tail, result.last_lsn) == (None, 10)
    assert len(result.covered_damage) == 1 and "a snapshot covers" in result.covered_damage[0]


def test_a_version_1_segment_reads_as_it_is_and_the_writer_goes_on_in_a_new_segment(tmp_path: Path) -> None:
    old = run(1, 3, "published")
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / segment_name(1)).write_bytes(
        segment_header(1, version=1) + b"".join(frame(encode_entry(*entry)) for entry in old)
    )
    assert list(read_entries(tmp_path)) == old
    writer = SegmentWriter(tmp_path, last_lsn=3)
    new = run(4, 6, "claimed")
    writer.write(b"".join(encode_frames(4, AT, "jobs", [entry.record for entry in new])), 4, 6)
    writer.sync()
    writer.close()
    assert [segment.first_lsn for segment in segments(tmp_path)] == [1, 4]
    assert (tmp_path / segment_name(1)).read_bytes()[:HEADER_SIZE] == segment_header(1, version=1)
    assert (tmp_path / segment_name(4)).read_bytes()[:HEADER_SIZE] == segment_header(4)
    assert list(read_entries(tmp_path)) == old + new
