"""What the Spark audit does with a journal it cannot read whole: damage inside a segment is reported as
``journal_damage`` (and does not make the snapshot look guilty), a torn tail after a crash is a note,
an empty journal audits as zero records, and a record the loader cannot hold is refused by name."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from broker.core.config import QueueConfig
from broker.core.records import Acked, Claimed, Published, Purged, QueueCreated, Record
from broker.storage.format import FRAME_OVERHEAD, encode_frames, frame_span
from broker.storage.segments import HEADER_SIZE, read_entries, scan, segment_header, segments
from broker.storage.snapshots import newest_valid
from tests.conftest import drop_snapshot
from tests.tools.conftest import RealRun
from tools.journal_audit import walk
from tools.journal_audit.audit import audit
from tools.journal_audit.live import EXPORTED_STATE
from tools.journal_audit.reading import UnreadableJournal
from tools.journal_audit.source import SLICE_BYTES, export_journal, segment_checks

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.e2e

T = 1_763_800_000.0


def published(message_id: str, at: float) -> Published:
    return Published(message_id, 1_000_000, b"{}", False, None, None, 0, at, None)


def frames_of(commands: list[tuple[str, list[Record]]]) -> list[bytes]:
    """The frames of ``commands`` (queue, records: a record alone, or a group), lsns from 1 on."""
    frames: list[bytes] = []
    lsn = 1
    for index, (queue, records) in enumerate(commands):
        frames += encode_frames(lsn, T + index, queue, records)
        lsn += len(records)
    return frames


def write_journal(journal: Path, body: bytes) -> Path:
    journal.mkdir(parents=True)
    segment = journal / f"{1:020d}.journal"
    segment.write_bytes(segment_header(1) + body)
    return segment


# Queue q; m1 published, claimed, acked; a group of 10 published (m2 … m11); m12 published alone.
COMMANDS: list[tuple[str, list[Record]]] = [
    ("q", [QueueCreated(QueueConfig(), "q-")]),
    ("q", [published("m1", T)]),
    ("q", [Claimed("m1", "m1.1", "c", 1, T + 60)]),
    ("q", [Acked("m1", "m1.1")]),
    ("q", [published(f"m{n}", T) for n in range(2, 12)]),  # lsns 5-14, one group frame
    ("q", [published("m12", T)]),  # lsn 15
]


def test_damage_inside_a_segment_is_reported_and_exits_1(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.journal_audit.__main__ import main

    assert len(frames_of(COMMANDS)) == 6
    journal = tmp_path / "journal"
    byte = damaged_journal(journal)
    assert [entry.lsn for entry in read_entries(journal)] == [1, 2, 3, 4]

    report = audit(spark, journal)
    assert report.violation_counts == {walk.JOURNAL_DAMAGE: 1}, report.render()
    [damage] = report.violations
    assert damage.lsn == 5
    assert f"00000000000000000001.journal at byte {byte}: a frame fails its checksum" in damage.detail
    assert "lsn 15" in damage.detail  # the frame after the damage still reads
    assert report.records == 4 and not report.ok

    assert main(["audit", str(journal), "--master", "local[1]"]) == 1
    out = capsys.readouterr().out
    assert "journal_damage" in out and f"at byte {byte}" in out


@pytest.mark.parametrize("slice_bytes", [SLICE_BYTES, 100])
def test_a_frame_that_passes_its_checksum_but_holds_no_record_is_damage(
    spark: SparkSession, tmp_path: Path, slice_bytes: int
) -> None:
    """The frames were checked (length, checksum, lsn) but not decoded, so a frame that passes its
    checksum yet holds no record (a type no broker writes) stopped the loader without a word: the audit
    passed the journal, with every record after it unread, that the broker cuts at its next start. In
    slices (100 bytes: the damaged frame in a middle one), the slice that meets it says so."""
    frames = frames_of(COMMANDS)
    ack = frames[3]  # lsn 4, the ack of m1
    payload = ack[FRAME_OVERHEAD:].replace(b"acked", b"ackex")
    assert payload != ack[FRAME_OVERHEAD:]
    frames[3] = struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    journal = tmp_path / "journal"
    write_journal(journal, b"".join(frames))

    checks = segment_checks(spark, journal, slice_bytes=slice_bytes)
    assert len(checks) == 1 and checks[0]["problem"] is not None
    assert checks[0]["problem"].startswith("a frame holds no valid record"), checks
    assert checks[0]["next_lsn"] == 4 and checks[0]["readable_after"] == (11, 5, 15)
    report = audit(spark, journal, slice_bytes=slice_bytes)
    assert report.violation_counts == {walk.JOURNAL_DAMAGE: 1}, report.render()
    assert report.violations[0].lsn == 4 and not report.ok
    # Nothing after it is audited, whichever slice it is in: a later slice read on past it.
    assert (report.records, report.last_lsn) == (3, 3), report.render()


def damaged_journal(journal: Path) -> int:
    """The journal of ``COMMANDS`` with a bit flipped inside its group frame; the damage's byte."""
    frames = frames_of(COMMANDS)
    offset = sum(len(frame) for frame in frames[:4])  # the group frame, lsns 5-14
    body = bytearray(b"".join(frames))
    body[offset + FRAME_OVERHEAD + 20] ^= 0x01
    write_journal(journal, bytes(body))
    return HEADER_SIZE + offset


def torn_journal(journal: Path) -> None:
    """The journal of ``COMMANDS`` whose last write was cut short by kill -9: over the zeros the broker
    writes ahead, half a frame."""
    frames = frames_of(COMMANDS)
    torn = frames[-1][: len(frames[-1]) // 2]
    write_journal(journal, b"".join(frames[:-1]) + torn + bytes(4096))


def test_a_parquet_export_carries_its_journals_damage_and_torn_tail(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The export has no segment files to read, so it keeps where reading each stopped: its audit then
    reports what the journal's own audit reports, word for word."""
    damaged = tmp_path / "damaged" / "journal"
    byte = damaged_journal(damaged)
    export_journal(spark, damaged, tmp_path / "damaged.parquet")
    direct, exported = audit(spark, damaged), audit(spark, tmp_path / "damaged.parquet")
    assert exported.violation_counts == {walk.JOURNAL_DAMAGE: 1}, exported.render()
    assert exported.violations == direct.violations
    assert f"at byte {byte}" in exported.violations[0].detail and exported.records == 4

    torn = tmp_path / "torn" / "journal"
    torn_journal(torn)
    export_journal(spark, torn, tmp_path / "torn.parquet")
    exported = audit(spark, tmp_path / "torn.parquet")
    assert exported.ok, exported.render()
    assert (
        [note for note in exported.notes if note.startswith("torn tail")]
        == [note for note in audit(spark, torn).notes if note.startswith("torn tail")]
        != []
    )


def test_an_export_made_before_segment_checks_still_audits_and_says_what_it_cannot_see(
    spark: SparkSession, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    damaged_journal(journal)
    out = tmp_path / "export"
    export_journal(spark, journal, out)
    side = out / EXPORTED_STATE
    document = json.loads(side.read_text())
    del document["segment_checks"]
    side.write_text(json.dumps({**document, "format": 1}))
    report = audit(spark, out)
    assert report.ok and report.records == 4, report.render()
    assert any(note.startswith("the export holds no segment checks") for note in report.notes), report.notes


def test_a_torn_tail_after_a_crash_is_a_note_not_a_violation(spark: SparkSession, tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    torn_journal(journal)
    assert scan(journal).tail is not None  # the broker would cut it at its next start

    report = audit(spark, journal)
    assert report.ok, report.render()
    assert report.records == 14
    [note] = [note for note in report.notes if note.startswith("torn tail")]
    assert "00000000000000000001.journal" in note and "lsn 15 was due" in note, note


def test_damage_under_the_snapshot_does_not_blame_the_snapshot(
    spark: SparkSession, real_run: RealRun, tmp_path: Path
) -> None:
    """A flipped byte in a frame the newest snapshot covers: the broker steps over it (and recovers
    past it); the audit reports the damage and does not call the messages it could not follow lost."""
    data_dir = tmp_path / "data"
    shutil.copytree(real_run.data_dir, data_dir, ignore=shutil.ignore_patterns("LOCK"))
    base, _ = newest_valid(data_dir)
    assert base is not None and base.last_lsn > 10
    [segment, *_] = sorted((data_dir / "journal").iterdir())
    data = bytearray(segment.read_bytes())
    offset = HEADER_SIZE
    for _ in range(3):  # the frame of lsn 4 (or the group holding it), well under the snapshot
        (length,) = struct.unpack_from("<I", data, offset)
        offset += FRAME_OVERHEAD + length
    data[offset + FRAME_OVERHEAD + 2] ^= 0x40
    segment.write_bytes(bytes(data))

    report = audit(spark, data_dir)
    assert walk.JOURNAL_DAMAGE in report.violation_counts, report.render()
    assert walk.LOST not in report.violation_counts, report.render()
    assert set(report.violation_counts) <= {walk.JOURNAL_DAMAGE, walk.ENDED_BUT_LIVE}, report.render()
    assert any("lost is not checked" in note for note in report.notes), report.notes
    alone = audit(spark, data_dir, journal_only=True)
    assert walk.JOURNAL_DAMAGE in alone.violation_counts and not alone.ok, alone.render()


def test_damage_under_the_snapshot_in_a_middle_segment_does_not_blame_the_snapshot(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Reading stops at damage, but a later segment is read again: the journal then reached the
    recovered lsn, so lost was checked, and the messages acked in the records between the damage and
    that segment (which the broker recovers from its snapshot) were called lost."""
    data_dir = tmp_path / "data"
    segmented_data_dir(data_dir)
    _, second, *later = segments(data_dir / "journal")
    assert later, "the damaged segment must have a later one"
    data = bytearray(second.path.read_bytes())
    data[HEADER_SIZE + FRAME_OVERHEAD + 2] ^= 0x40  # its first frame: every record after it unread
    second.path.write_bytes(bytes(data))

    report = audit(spark, data_dir)
    assert walk.JOURNAL_DAMAGE in report.violation_counts, report.render()
    assert walk.LOST not in report.violation_counts, report.render()
    assert any("lost is checked only for messages published after" in note for note in report.notes), (
        report.notes
    )
    assert set(report.violation_counts) == {walk.JOURNAL_DAMAGE}, report.render()


def segmented_data_dir(
    data_dir: Path, *, rounds: int = 6, rounds_after: int = 0, left_open: int = 0, segment_bytes: int = 2000
) -> int:
    """A data directory a broker wrote in process, in segments of ``segment_bytes`` (2000: a few records
    each): ``left_open`` messages published to queue idle and never claimed, ``rounds`` of 4 messages
    published to queue jobs, claimed and acked, an admin snapshot, one message published, ``rounds_after``
    more rounds. The
    snapshot of the clean shutdown is dropped, so that recovery starts from the admin one: its lsn is
    returned."""
    import trio

    from broker.config import Settings
    from broker.server import open_broker
    from broker.storage.snapshots import list_snapshots

    settings = Settings(data_dir=data_dir, journal_segment_bytes=segment_bytes)

    async def run() -> None:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            client = app.test_client()
            await client.put("/v1/queues/jobs", json={})
            if left_open:
                await client.put("/v1/queues/idle", json={})
            for n in range(left_open):
                await client.post("/v1/queues/idle/messages", json={"payload": f"open {n}"})

            async def round_trip() -> None:
                await client.post(
                    "/v1/queues/jobs/messages", json={"messages": [{"payload": n} for n in range(4)]}
                )
                claimed = await (await client.post("/v1/queues/jobs/claim", json={"max": 4})).get_json()
                await client.post(
                    "/v1/queues/jobs/ack", json={"leases": [m["lease_id"] for m in claimed["messages"]]}
                )

            for _ in range(rounds):
                await round_trip()
            assert (await client.post("/v1/admin/snapshots")).status_code == 201
            await client.post("/v1/queues/jobs/messages", json={"payload": "after"})
            for _ in range(rounds_after):
                await round_trip()

    trio.run(run)
    newest, admin, *_ = list_snapshots(data_dir)
    drop_snapshot(data_dir, newest.id)  # recovery uses the admin snapshot
    return admin.lsn


def frame_starts(data: bytes) -> list[tuple[int, int]]:
    """``(offset, first lsn)`` of every frame of a segment's bytes, up to the zeros reserved after them."""
    starts = []
    offset = HEADER_SIZE
    while offset + FRAME_OVERHEAD <= len(data):
        length, _ = struct.unpack_from("<II", data, offset)
        if length == 0:
            break
        span = frame_span(data, offset + FRAME_OVERHEAD, offset + FRAME_OVERHEAD + length)
        assert span is not None
        starts.append((offset, span[0]))
        offset += FRAME_OVERHEAD + length
    return starts


def test_a_missing_middle_segment_the_broker_would_cut_is_a_journal_gap(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The segment holding the lsn after the snapshot's is gone, later ones are not: the broker's next
    start reads on to the hole and deletes every segment after it (journal_tail_cut, "a gap"). The
    recovered state stops at the snapshot's lsn, so the audit read the journal only that far: the later
    segments were left out before the segments were checked for holes, and it passed (exit 0)."""
    from tools.journal_audit.__main__ import main

    data_dir = tmp_path / "data"
    snapshot_lsn = segmented_data_dir(data_dir, rounds_after=6)
    journal = data_dir / "journal"
    listed = segments(journal)
    index = max(i for i, segment in enumerate(listed) if segment.first_lsn <= snapshot_lsn + 1)
    assert 0 < index < len(listed) - 1, (snapshot_lsn, listed)
    missing, following = listed[index], listed[index + 1]
    missing.path.unlink()
    tail = scan(journal, after_lsn=snapshot_lsn).tail  # what the broker's next start finds, and cuts
    assert tail is not None and tail.path == following.path and "a gap" in tail.reason

    report = audit(spark, data_dir)
    assert report.violation_counts == {walk.JOURNAL_GAP: 1}, report.render()
    [gap] = report.violations
    assert gap.lsn == missing.first_lsn
    assert f"no readable records from lsn {missing.first_lsn} to {following.first_lsn - 1}" in gap.detail
    assert "the broker would cut the journal there at its next start" in gap.detail
    assert f"{len(listed) - index - 1} segment(s) from {following.path.name} on" in gap.detail
    assert main(["audit", str(data_dir), "--master", "local[1]"]) == 1
    assert "journal_gap" in capsys.readouterr().out
    # Its journal directory, and its export, say the same.
    assert audit(spark, journal).violations == report.violations
    export_journal(spark, data_dir, tmp_path / "export")
    assert audit(spark, tmp_path / "export").violations == report.violations
    # Ignoring the snapshot, the records on both sides are read: the hole is reported once.
    alone = audit(spark, data_dir, journal_only=True)
    assert alone.violation_counts == {walk.JOURNAL_GAP: 1}, alone.render()


def test_a_gap_the_snapshot_covers_is_stepped_over_and_still_reported(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A missing segment wholly under the snapshot's lsn: the broker reads on from the segment after it
    and cuts nothing, but the history there is gone."""
    data_dir = tmp_path / "data"
    snapshot_lsn = segmented_data_dir(data_dir, rounds=10)
    journal = data_dir / "journal"
    listed = segments(journal)
    missing, following = listed[1], listed[2]
    assert following.first_lsn <= snapshot_lsn + 1
    missing.path.unlink()
    assert scan(journal, after_lsn=snapshot_lsn).tail is None

    report = audit(spark, data_dir)
    assert report.violation_counts == {walk.JOURNAL_GAP: 1}, report.render()
    [gap] = report.violations
    assert gap.lsn == missing.first_lsn and "the broker steps over it" in gap.detail


def test_a_journal_cut_back_below_its_snapshot_is_damage(spark: SparkSession, tmp_path: Path) -> None:
    """The newest segment zeroed from a frame under the snapshot's lsn to its end: every frame left is
    valid and the zeros look like the space the broker reserves, so the journal simply ends early. But
    the snapshot was built from the journal, so the journal reached its lsn once: the records past that
    frame (and any committed after the snapshot) are gone. The audit only noted it ("could be read to
    lsn … only"), and passed."""
    data_dir = tmp_path / "data"
    snapshot_lsn = segmented_data_dir(data_dir, rounds_after=2, segment_bytes=1 << 20)
    journal = data_dir / "journal"
    [segment] = segments(journal)
    data = bytearray(segment.path.read_bytes())
    offset, lsn = [start for start in frame_starts(bytes(data)) if start[1] < snapshot_lsn - 4][-1]
    data[offset:] = bytes(len(data) - offset)
    segment.path.write_bytes(bytes(data))
    scanned = scan(journal)
    assert scanned.tail is None and scanned.last_lsn == lsn - 1  # no bad frame: a clean, early end

    report = audit(spark, data_dir)
    assert report.violation_counts == {walk.JOURNAL_DAMAGE: 1}, report.render()
    [damage] = report.violations
    assert damage.lsn == lsn
    assert f"{segment.path.name} at byte {offset}: the journal ends there, at lsn {lsn - 1}" in damage.detail
    assert f"its newest snapshot covers lsns up to {snapshot_lsn}" in damage.detail
    export_journal(spark, data_dir, tmp_path / "export")
    assert audit(spark, tmp_path / "export").violations == report.violations
    # A journal alone has no snapshot to fall short of.
    assert audit(spark, data_dir, journal_only=True).ok


def test_a_repeated_lsn_names_the_lsn_due_once(spark: SparkSession, tmp_path: Path) -> None:
    """A frame deleted from the middle of a segment: the next one carries an lsn other than the one due,
    and the problem says so; the violation said it twice ("where 3 was due (lsn 3 was due)")."""
    frames = frames_of(COMMANDS)
    journal = tmp_path / "journal"
    write_journal(journal, b"".join(frames[:2] + frames[3:]))  # lsn 3 (the claim of m1) gone
    report = audit(spark, journal)
    assert report.violation_counts == {walk.JOURNAL_DAMAGE: 1}, report.render()
    [damage] = report.violations
    assert damage.lsn == 3
    assert "lsn 4 where 3 was due; reading stops there" in damage.detail, damage.detail
    assert damage.detail.count("was due") == 1, damage.detail


def test_the_report_says_how_many_messages_the_recovered_state_holds(
    spark: SparkSession, tmp_path: Path
) -> None:
    """With retention, a message published and left alone in a segment since deleted has no record in
    the journal: it is not among the open messages, but the recovered state holds it, and the report
    gives both figures."""
    data_dir = tmp_path / "data"
    segmented_data_dir(data_dir, left_open=3)
    journal = data_dir / "journal"
    first, second, *_ = segments(journal)
    assert second.first_lsn > 5  # the three left open (lsns 3-5) are in the first segment: delete it
    first.path.unlink()

    report = audit(spark, data_dir)
    assert report.ok, report.render()
    assert report.open_messages == 1  # "after", published after the snapshot
    assert report.live_messages == 4
    assert "(live by recovered state, snapshot " in report.render()
    assert ", which holds 4 live)" in report.render()
    assert report.to_json()["live_messages"] == 4
    assert audit(spark, data_dir, journal_only=True).live_messages is None


def test_an_empty_journal_audits_as_zero_records(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``broker serve`` leaves after a SIGTERM with no request: an empty journal/, no snapshots."""
    from tools.journal_audit.__main__ import main

    data_dir = tmp_path / "data"
    (data_dir / "journal").mkdir(parents=True)
    for given in (data_dir, data_dir / "journal"):
        report = audit(spark, given)
        assert report.ok and report.records == 0 and report.first_lsn is None, report.render()
    assert main(["audit", str(data_dir), "--master", "local[1]"]) == 0
    assert "Violations: none" in capsys.readouterr().out


def test_an_integer_beyond_64_bits_is_refused_by_lsn_and_field(spark: SparkSession, tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    frames = frames_of([("b", [QueueCreated(QueueConfig(), "b-")]), ("b", [Purged(2**64)])])
    write_journal(journal, b"".join(frames))
    with pytest.raises(UnreadableJournal, match=r"lsn 2: field count is 18446744073709551616"):
        audit(spark, journal)
    assert issubclass(UnreadableJournal, ValueError)
