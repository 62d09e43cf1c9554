"""The journal audit's pieces that need no Spark: reading segments (in slices) and walking one
message's records against the invariants (docs/audit.md)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import lmdb
import pytest

from broker.core.config import PushConfig, QueueConfig
from broker.core.records import Published, QueueCreated, QueueUpdated
from broker.storage.format import decode_entry, encode_entry, frame
from broker.storage.recovery import Recovered
from broker.storage.segments import SegmentWriter, segments
from broker.storage.snapshots import SNAPSHOTS_DIR, write_snapshot
from broker.storage.store import JOURNAL_DIR
from tools.journal_audit import reading, walk
from tools.journal_audit.audit import AuditReport, Findings, Violation
from tools.journal_audit.live import recovered_state
from tools.journal_audit.reading import locate
from tools.journal_audit.schema import COLUMN_NAMES, COLUMNS
from tools.journal_audit.source import plan

DOCS = Path(__file__).resolve().parents[2] / "docs"


def published(message_id: str, at: float) -> Published:
    return Published(message_id, 1_000_000, b"{}", False, None, None, 0, at, None)


# -- the walk, without Spark ----------------------------------------------------------------------------


def steps(*rows: tuple[int, float, str, str | None, int | None, float | None]) -> list[walk.Step]:
    return [
        walk.Step(
            lsn,
            round(at * 1e6),
            kind,
            lease,
            attempt,
            None if deadline is None else round(deadline * 1e6),
            None,
            None,
        )
        for lsn, at, kind, lease, attempt, deadline in rows
    ]


def test_a_late_ack_after_a_noticed_expiry_is_not_stale() -> None:
    summary = walk.walk(
        "q",
        "m",
        steps(
            (1, 0, "published", None, None, None),
            (2, 0, "claimed", "m.1", 1, 1),
            (3, 2, "lease_expired", "m.1", None, None),
            (4, 3, "acked", "m.1", None, None),
        ),
        None,
        complete=True,
    )
    assert summary.violations == [] and summary.end == "acked"


def test_a_late_ack_after_a_replace_is_stale() -> None:
    """The broker drops an expired lease when the message is replaced (a late ack must not ack a payload
    its consumer never saw) and skips the ack: an ``acked`` under it in a journal was not the broker's.
    The walk let it through."""
    rows = [
        (1, 0, "published", None, None, None),
        (2, 0, "claimed", "m.1", 1, 1),
        (3, 2, "lease_expired", "m.1", None, None),
        (4, 3, "replaced", None, None, None),
        (5, 4, "acked", "m.1", None, None),
    ]
    summary = walk.walk("q", "m", steps(*rows), None, complete=True)
    assert [(kind, lsn) for kind, lsn, _, _ in summary.violations] == [(walk.STALE_LEASE, 5)]
    # A claim after the replace issues a lease that settles again.
    fresh = [*rows[:4], (5, 4, "claimed", "m.2", 2, 9), (6, 5, "acked", "m.2", None, None)]
    assert walk.walk("q", "m", steps(*fresh), None, complete=True).violations == []


def test_a_settle_under_a_lease_no_claim_issued_says_so_rather_than_a_later_claim() -> None:
    def stale_because(*rows: tuple[int, float, str, str | None, int | None, float | None]) -> str:
        summary = walk.walk(
            "q", "m", steps((1, 0, "published", None, None, None), *rows), None, complete=True
        )
        [(kind, _, _, detail)] = summary.violations
        assert kind == walk.STALE_LEASE
        return detail

    forged = stale_because((2, 0, "claimed", "m.1", 1, 30), (3, 1, "acked", "m.9", None, None))
    assert forged == "acked under lease m.9, but no claim issued that lease (its lease is m.1)"
    late = stale_because(
        (2, 0, "claimed", "m.1", 1, 1),
        (3, 2, "lease_expired", "m.1", None, None),
        (4, 3, "claimed", "m.2", 2, 30),
        (5, 4, "acked", "m.1", None, None),
    )
    assert late == "acked under lease m.1, but the message was claimed again since, under m.2"


def test_a_purge_ends_ready_messages_but_not_leased_ones() -> None:
    history = walk.histories([(1, 0, "q", "queue_created", 0), (5, 5_000_000, "q", "purged", None)])["q"]
    ready = walk.walk("q", "a", steps((2, 0, "published", None, None, None)), history, complete=True)
    leased = walk.walk(
        "q",
        "b",
        steps((3, 0, "published", None, None, None), (4, 0, "claimed", "b.1", 1, 1)),
        history,
        complete=True,
    )
    assert (ready.end, ready.purged_by) == ("purged", 5)
    assert leased.end is None


def test_records_before_a_pruned_journal_start_are_not_judged() -> None:
    summary = walk.walk("q", "m", steps((900, 0, "acked", "m.3", None, None)), None, complete=False)
    assert summary.violations == [] and not summary.known and summary.end == "acked"
    unknown = walk.walk("q", "m", steps((900, 0, "acked", "m.3", None, None)), None, complete=True)
    assert [v[0] for v in unknown.violations] == [walk.UNKNOWN_MESSAGE]


def test_rejected_dead_letters_may_come_at_any_attempt() -> None:
    history = walk.histories([(1, 0, "q", "queue_created", 5)])["q"]
    summary = walk.walk(
        "q",
        "m",
        [
            *steps((2, 0, "published", None, None, None), (3, 0, "claimed", "m.1", 1, 30)),
            walk.Step(4, 0, "nacked", "m.1", None, None, None, None),
            walk.Step(5, 0, "dead_lettered", "m.1", 1, None, "rejected", None),
        ],
        history,
        complete=True,
    )
    assert summary.violations == [] and summary.dead_letter_reason == "rejected"


def test_a_dead_letter_for_a_reason_the_broker_never_writes_is_named() -> None:
    """The core dead-letters for max_attempts or rejected only; a TTL runs out as an ``expired`` record
    (``expired`` is the reason only of the dead-letter copy's header)."""
    history = walk.histories([(1, 0, "q", "queue_created", 5)])["q"]
    summary = walk.walk(
        "q",
        "m",
        [
            *steps((2, 0, "published", None, None, None), (3, 0, "claimed", "m.1", 1, 30)),
            walk.Step(4, 0, "dead_lettered", "m.1", 1, None, "expired", None),
        ],
        history,
        complete=True,
    )
    assert [(kind, lsn) for kind, lsn, _, _ in summary.violations] == [(walk.EARLY_DEAD_LETTER, 4)]


def test_a_message_whose_records_span_unread_ones_is_judged_from_its_first_record_after_them() -> None:
    """Records 10-19 could not be read (damage, a missing segment): m's second claim, m.2, was in them.
    Its ack under m.2 was called stale ("the message was never claimed" or "no claim issued that
    lease"), and a dead letter at its third attempt early, for attempts counted before the hole only."""
    history = walk.histories([(1, 0, "q", "queue_created", 3)])["q"]
    acked = steps(
        (2, 0, "published", None, None, None),
        (3, 0, "claimed", "m.1", 1, 1),
        (4, 0, "nacked", "m.1", None, None),
        (20, 5, "acked", "m.2", None, None),
    )
    dead = [
        *steps((2, 0, "published", None, None, None), (3, 0, "claimed", "m.1", 1, 1)),
        walk.Step(4, 0, "nacked", "m.1", None, None, None, None),
        walk.Step(20, 5, "dead_lettered", "m.3", 3, None, "max_attempts", None),
    ]
    for records in (acked, dead):
        spanning = walk.walk("q", "m", records, history, complete=False, unread_from=[10])
        assert spanning.violations == [] and spanning.known, spanning
        # Without the hole, the same records are violations: the walk does judge them.
        whole = walk.walk("q", "m", records, history, complete=True)
        assert [kind for kind, *_ in whole.violations] in ([walk.STALE_LEASE], [walk.EARLY_DEAD_LETTER])
    # A hole the message's records do not span changes nothing.
    before = walk.walk("q", "m", acked, history, complete=False, unread_from=[1])
    after = walk.walk("q", "m", acked, history, complete=False, unread_from=[30])
    assert before.violations == after.violations != []


def test_a_purge_after_unread_records_leaves_a_message_whose_lease_is_unknown() -> None:
    """In flight before the hole, whether it still was at the purge after it is unknown: the purge is
    not taken to have removed it (its ack after the purge is no record after its end), as a purge
    leaves a message in flight; a deletion of its queue still ends it."""
    history = walk.histories([(1, 0, "q", "queue_created", 0), (15, 5_000_000, "q", "purged", None)])["q"]
    records = steps(
        (2, 0, "published", None, None, None),
        (3, 0, "claimed", "m.1", 1, 1),
        (4, 0, "nacked", "m.1", None, None),
        (20, 6, "acked", "m.2", None, None),
    )
    spanning = walk.walk("q", "m", records, history, complete=False, unread_from=[10])
    assert spanning.violations == [] and (spanning.end, spanning.end_lsn) == ("acked", 20), spanning
    deleted = walk.histories([(1, 0, "q", "queue_created", 0), (15, 5_000_000, "q", "queue_deleted", None)])
    gone = walk.walk("q", "m", records, deleted["q"], complete=False, unread_from=[10])
    assert (gone.end, gone.end_lsn) == ("queue_deleted", 15)
    assert [kind for kind, *_ in gone.violations] == [walk.AFTER_END]


# -- reading, without Spark -----------------------------------------------------------------------------


def test_the_data_directory_layout_is_the_brokers() -> None:
    assert (reading.JOURNAL_DIR, reading.SNAPSHOTS_DIR) == (JOURNAL_DIR, SNAPSHOTS_DIR)


def test_slices_of_a_segment_hold_every_record_once(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    journal.mkdir()
    append_new = [(1.0 + n, "q", published(f"m{n}", 1.0 + n)) for n in range(500)]
    writer = SegmentWriter(journal, last_lsn=0)
    writer.write(
        b"".join(frame(encode_entry(n + 1, *item[:2], item[2])) for n, item in enumerate(append_new)), 1, 500
    )
    writer.sync()
    writer.close()
    [segment] = segments(journal)
    parts = plan(journal, slice_bytes=segment.size // 7)
    assert len(parts) == 7
    lsns = [row[0] for part in parts for row in reading.rows(segment, start=part.start, stop=part.stop)]
    assert lsns == list(range(1, 501))
    assert locate(tmp_path / "journal").data_dir is None


def test_a_live_segment_is_read_to_its_last_frame_and_the_zeros_reserved_after_it_are_no_problem(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "journal"
    writer = SegmentWriter(journal, last_lsn=0)
    writer.write(b"".join(frame(encode_entry(n, 1.0, "q", published(f"m{n}", 1.0))) for n in (1, 2, 3)), 1, 3)
    writer.sync()  # not closed: the broker is still writing, zeros follow the frames
    [segment] = segments(journal)
    assert segment.size > segment.path.read_bytes().rstrip(b"\0").__len__()
    read = reading.SegmentRead(segment)
    assert [entry.lsn for entry, _ in reading.read_segment(segment, read)] == [1, 2, 3]
    assert read.problem is None
    writer.close()


SECRET = "S3CRET-9f2c51d7a0b84e6f3a1c7d9e5b2f4a68"


def test_no_row_carries_a_push_signing_secret(tmp_path: Path) -> None:
    """The ``config`` column blanks the secret, and so does ``raw``: a queue record holding one is
    re-encoded with the secret blanked (and still decodes); every other record's ``raw`` is its bytes."""
    url = f"https://worker:{SECRET}@worker.example.com/hook"  # a password in the URL is blanked too
    push = QueueConfig(max_attempts=3, push=PushConfig(url, secret=SECRET))
    updated = dataclasses.replace(push, lease=10.0)
    records = [
        QueueCreated(push, "pq-"),
        QueueUpdated(updated),
        published("pq-1", 1.0),
        QueueCreated(QueueConfig(), "plain-"),
    ]
    payloads = [encode_entry(n + 1, 1.0, "pushy", record) for n, record in enumerate(records)]
    writer = SegmentWriter(tmp_path, last_lsn=0)
    writer.write(b"".join(frame(payload) for payload in payloads), 1, len(payloads))
    writer.sync()
    writer.close()
    [segment] = segments(tmp_path)
    assert SECRET.encode() in segment.path.read_bytes()

    rows = [dict(zip(COLUMN_NAMES, row, strict=True)) for row in reading.rows(segment)]
    assert len(rows) == 4
    for row in rows:
        for value in row.values():
            assert SECRET not in repr(value) and SECRET.encode() not in repr(value).encode()
    for row, config in ((rows[0], push), (rows[1], updated)):
        assert json.loads(row["config"])["push"]["secret"] is None
        entry = decode_entry(row["raw"])
        assert entry.lsn == row["lsn"]
        shown_url = "https://worker:***@worker.example.com/hook"
        assert json.loads(row["config"])["push"]["url"] == shown_url
        assert entry.record.config == dataclasses.replace(
            config, push=dataclasses.replace(config.push, secret=reading.REDACTED_SECRET, url=shown_url)
        )
    assert [row["raw"] for row in rows[2:]] == payloads[2:]


def test_the_documented_schema_is_the_loaders() -> None:
    """docs/audit.md's table of columns: the names, in order, with their Spark types and whether they
    are always set, as ``schema.COLUMNS`` has them."""
    text = (DOCS / "audit.md").read_text()
    table = text.split("| column | type | from | meaning |", 1)[1].split("\n\n", 1)[0]
    documented = []
    for line in table.strip().splitlines()[1:]:  # after the |---| line
        names, kind, source, _ = (cell.strip() for cell in line.strip().strip("|").split(" | "))
        for name in re.findall(r"`([^`]+)`", names):
            documented.append((name, kind, source == "always"))
    assert documented == [(name, kind.simpleString(), not nullable) for name, kind, nullable, _ in COLUMNS]


def test_the_recovered_state_is_read_without_opening_the_snapshot_file_for_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit reads the files only (docs/audit.md), yet it opened the snapshot file read-write: on a
    read-only mount (a backup) the audit could not run at all."""
    data_dir = tmp_path / "data"
    (data_dir / JOURNAL_DIR).mkdir(parents=True)
    recovered = Recovered()
    recovered.last_lsn = 7
    write_snapshot(data_dir, recovered)
    opened = []
    real_open = lmdb.open

    def open_read_only(path: str, **options: Any) -> Any:
        opened.append(options)
        if not options.get("readonly"):
            raise lmdb.ReadonlyError(f"{path}: Read-only file system")
        return real_open(path, **options)

    monkeypatch.setattr(lmdb, "open", open_read_only)
    state = recovered_state(data_dir, data_dir / JOURNAL_DIR)
    assert state is not None and state.snapshot_lsn == 7 and opened


def test_each_kind_of_violation_is_listed_however_many_another_kind_has() -> None:
    """One limit for all kinds kept the first 1,000 by lsn: 1,500 double acks hid every stale lease
    after them, in the JSON and on the terminal (not even an "… and N more" line)."""
    findings = Findings(limit=3)
    for lsn in range(5):
        findings.add(Violation(walk.DOUBLE_ACK, "q", f"m{lsn}", lsn, None, "acked again"))
    for lsn in range(5, 7):
        findings.add(Violation(walk.STALE_LEASE, "q", f"m{lsn}", lsn, "l", "stale"))
    findings.more(walk.LOST, 4)  # counted, none fetched
    assert [v.kind for v in findings.listed].count(walk.STALE_LEASE) == 2
    report = AuditReport("j", "journal", "journal only", None, 1, 7, 7, 1)
    report.violation_counts, report.violations = dict(findings.counts), findings.listed
    text = report.render(listed_per_kind=1)
    assert f"… and 4 more {walk.DOUBLE_ACK}" in text and f"… and 1 more {walk.STALE_LEASE}" in text
    assert f"… and 4 more {walk.LOST}" in text
