"""The Spark journal audit (CONTRACT §9, docs/audit.md) on a journal a real broker wrote.

One SparkSession (``local[2]``) and one real run serve every test here; each test that changes a
journal works on its own copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from broker.core.config import PushConfig, QueueConfig
from broker.core.records import (
    RECORD_TYPES,
    Acked,
    Claimed,
    DeadLettered,
    Deleted,
    LeaseExpired,
    Nacked,
    Published,
    QueueCreated,
    QueueUpdated,
    Record,
)
from broker.storage.format import encode_entry, frame
from broker.storage.recovery import replay
from broker.storage.segments import SegmentWriter, read_entries, scan, segments
from broker.storage.snapshots import newest_valid, write_snapshot
from tests.tools.conftest import RealRun
from tools.journal_audit import walk
from tools.journal_audit.audit import audit
from tools.journal_audit.live import EXPORTED_STATE
from tools.journal_audit.schema import COLUMN_NAMES, SCHEMA
from tools.journal_audit.session import ROOT
from tools.journal_audit.source import export_journal, export_parquet, load_journal, load_parquet

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.e2e


def copy_of(run: RealRun, tmp_path: Path) -> Path:
    target = tmp_path / "data"
    shutil.copytree(run.data_dir, target, ignore=shutil.ignore_patterns("LOCK"))
    return target


def append(journal: Path, records: list[tuple[float, str, Record]]) -> list[int]:
    """Append ``(at, queue, record)`` to the journal with the broker's encoder and segment writer;
    return their lsns."""
    last = scan(journal).last_lsn
    writer = SegmentWriter(journal, last_lsn=last)
    lsns = list(range(last + 1, last + 1 + len(records)))
    data = b"".join(
        frame(encode_entry(lsn, at, queue, record))
        for lsn, (at, queue, record) in zip(lsns, records, strict=True)
    )
    writer.write(data, lsns[0], lsns[-1])
    writer.sync()
    writer.close()
    return lsns


def published(message_id: str, at: float) -> Published:
    return Published(message_id, 1_000_000, b"{}", False, None, None, 0, at, None)


def segmented_journal(journal: Path, groups: int, per_group: int) -> list[int]:
    """A bare journal of ``groups`` segments (one group of ``per_group`` published records each), written
    by the broker's segment writer; the first lsn of each segment."""
    writer = SegmentWriter(journal, max_segment_bytes=1, last_lsn=0)
    for group in range(groups):
        first = group * per_group + 1
        data = b"".join(
            frame(encode_entry(lsn, float(lsn), "q", published(f"m{lsn}", float(lsn))))
            for lsn in range(first, first + per_group)
        )
        writer.write(data, first, first + per_group - 1)
        writer.sync()
    writer.close()
    listed = segments(journal)
    assert len(listed) == groups
    return [segment.first_lsn for segment in listed]


# -- the loader -----------------------------------------------------------------------------------------


def test_the_loader_gives_one_row_per_record_in_the_fixed_schema(
    spark: SparkSession, real_run: RealRun
) -> None:
    entries = list(read_entries(real_run.data_dir / "journal"))
    records = load_journal(spark, real_run.data_dir)
    assert records.schema == SCHEMA
    rows = records.select("lsn", "type", "queue", "message_id", "lease_id", "payload_size").collect()
    assert sorted(row["lsn"] for row in rows) == [entry.lsn for entry in entries]
    assert Counter(row["type"] for row in rows) == Counter(
        RECORD_TYPES[type(entry.record)] for entry in entries
    )
    expected_types = {
        "queue_created",
        "published",
        "claimed",
        "acked",
        "nacked",
        "deferred",
        "extended",
        "lease_expired",
        "dead_lettered",
        "expired",
        "redriven",
        "deleted",
        "purged",
    }
    assert expected_types <= {row["type"] for row in rows}
    assert {row["queue"] for row in rows} == set(real_run.queues)
    assert all(row["payload_size"] > 0 for row in rows if row["type"] == "published")
    # The journal's own sub-directory reads the same.
    assert load_journal(spark, real_run.data_dir / "journal").count() == len(entries)


def test_the_parquet_export_reads_back_as_the_same_dataframe(
    spark: SparkSession, real_run: RealRun, tmp_path: Path
) -> None:
    records = load_journal(spark, real_run.data_dir)
    export_parquet(records, tmp_path / "parquet")
    assert any(path.name.startswith("queue=jobs.dlq") for path in (tmp_path / "parquet").iterdir())
    exported = load_parquet(spark, tmp_path / "parquet")
    assert exported.schema == records.schema
    assert exported.columns == list(COLUMN_NAMES)
    # Set operations refuse map columns (headers); the journal is small enough to compare whole.
    assert exported.orderBy("lsn").collect() == records.orderBy("lsn").collect()


def test_each_segment_is_one_spark_partition(spark: SparkSession, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    firsts = segmented_journal(tmp_path / "journal", groups=4, per_group=25)
    records = load_journal(spark, tmp_path / "journal")
    assert records.rdd.getNumPartitions() == len(firsts)
    placed = records.select("segment", F.spark_partition_id().alias("partition")).distinct().collect()
    assert sorted(row["segment"] for row in placed) == [f"{lsn:020d}.journal" for lsn in firsts]
    assert len({row["partition"] for row in placed}) == len(firsts)  # no partition holds two segments
    assert records.count() == 100


SECRET = "S3CRET-9f2c51d7a0b84e6f3a1c7d9e5b2f4a68"


def test_no_push_secret_leaves_the_journal(spark: SparkSession, real_run: RealRun, tmp_path: Path) -> None:
    """A push queue's signing secret is in the journal; it is in no row the loader gives, in no file of
    the Parquet export, and in neither form of the report on that export."""
    data_dir = copy_of(real_run, tmp_path)
    journal = data_dir / "journal"
    url = "https://worker.example.com/hooks/pushy-4b1e"
    config = QueueConfig(max_attempts=3, push=PushConfig(url, secret=SECRET))
    at = max(entry.at for entry in read_entries(journal)) + 1.0
    append(
        journal,
        [
            (at, "pushy", QueueCreated(config, "pushy-")),
            (at, "pushy", QueueUpdated(QueueConfig(lease=10.0, push=config.push))),
            (at, "pushy", published("pushy-1", at)),
        ],
    )
    secret = SECRET.encode()
    assert any(secret in path.read_bytes() for path in journal.iterdir())

    rows = load_journal(spark, data_dir).collect()
    assert sum(row["queue"] == "pushy" for row in rows) == 3
    assert not [row["lsn"] for row in rows if secret in repr(tuple(row)).encode() or secret in row["raw"]]

    out = tmp_path / "parquet"
    export_journal(spark, data_dir, out)
    files = [path for path in out.rglob("*") if path.is_file()]
    assert (out / EXPORTED_STATE) in files
    assert any(url.encode() in path.read_bytes() for path in files)  # strings are greppable there
    assert [path for path in files if secret in path.read_bytes()] == []
    assert secret not in repr(load_parquet(spark, out).collect()).encode()

    report = audit(spark, out)
    assert report.ok, report.render()
    assert report.live_from == "recovered state" and "pushy" in report.queues
    assert SECRET not in json.dumps(report.to_json()) and SECRET not in report.render()


# -- the audit ------------------------------------------------------------------------------------------


def test_a_real_run_with_a_crash_keeps_every_invariant(spark: SparkSession, real_run: RealRun) -> None:
    report = audit(spark, real_run.data_dir)
    assert report.violation_counts == {}, report.render()
    assert report.ok
    assert report.live_from == "recovered state" and report.snapshot is not None
    assert report.first_lsn == 1 and report.records == report.last_lsn
    jobs = report.queues["jobs"]
    assert jobs["dead_letter_reasons"] == {"max_attempts": 3, "rejected": 1}
    assert report.queues["ttl"]["dead_letter_reasons"] == {"expired": 3}
    assert report.queues["misc"]["records"]["purged"] == 1
    acked = sum(queue["records"].get("acked", 0) for queue in report.queues.values())
    assert acked == len(real_run.acked)
    assert jobs["latency"]["publish_to_ack"]["count"] == jobs["records"]["acked"]
    assert report.open_messages > 0
    # Journal-only, the same journal says the same.
    alone = audit(spark, real_run.data_dir / "journal", journal_only=True)
    assert alone.ok, alone.render()
    assert alone.live_from == "journal only"
    assert (alone.messages, alone.open_messages) == (report.messages, report.open_messages)


def test_injected_faults_are_each_caught_and_named(
    spark: SparkSession, real_run: RealRun, tmp_path: Path
) -> None:
    data_dir = copy_of(real_run, tmp_path)
    journal = data_dir / "journal"
    at = max(entry.at for entry in read_entries(journal)) + 1.0
    lsns = append(
        journal,
        [
            # Acked twice.
            (at, "jobs", published("fault-double", at)),
            (at, "jobs", Claimed("fault-double", "fault-double.1", "c", 1, at + 30)),
            (at, "jobs", Acked("fault-double", "fault-double.1")),
            (at, "jobs", Acked("fault-double", "fault-double.1")),
            # Acked under the lease of an earlier delivery.
            (at, "jobs", published("fault-stale", at)),
            (at, "jobs", Claimed("fault-stale", "fault-stale.1", "c", 1, at + 1)),
            (at + 1, "jobs", LeaseExpired("fault-stale", "fault-stale.1")),
            (at + 1, "jobs", Claimed("fault-stale", "fault-stale.2", "c", 2, at + 31)),
            (at + 1.5, "jobs", Acked("fault-stale", "fault-stale.1")),
            # Claimed again while the first lease still held it.
            (at, "jobs", published("fault-overlap", at)),
            (at, "jobs", Claimed("fault-overlap", "fault-overlap.1", "c", 1, at + 30)),
            (at + 1, "jobs", Claimed("fault-overlap", "fault-overlap.2", "c", 2, at + 31)),
            # Dead-lettered for max_attempts after 1 of 2.
            (at, "jobs", published("fault-early", at)),
            (at, "jobs", Claimed("fault-early", "fault-early.1", "c", 1, at + 30)),
            (at, "jobs", Nacked("fault-early", "fault-early.1", 0.0, None)),
            (at, "jobs", DeadLettered("fault-early", "fault-early.1", "max_attempts", 1, "jobs.dlq")),
        ],
    )
    report = audit(spark, journal, journal_only=True)
    found = {(v.kind, v.message_id, v.lsn) for v in report.violations}
    assert found == {
        (walk.DOUBLE_ACK, "fault-double", lsns[3]),
        (walk.STALE_LEASE, "fault-stale", lsns[8]),
        (walk.OVERLAPPING_LEASES, "fault-overlap", lsns[11]),
        (walk.EARLY_DEAD_LETTER, "fault-early", lsns[15]),
    }, report.render()
    assert not report.ok
    text = report.render()
    for kind in (walk.DOUBLE_ACK, walk.STALE_LEASE, walk.OVERLAPPING_LEASES, walk.EARLY_DEAD_LETTER):
        assert kind in text


@pytest.mark.parametrize("audited", ["data directory", "parquet export"])
def test_a_message_the_snapshot_lost_or_kept_is_caught(
    spark: SparkSession, real_run: RealRun, tmp_path: Path, audited: str
) -> None:
    """The journal says one message was published and never ended, and another deleted; the snapshot
    the broker would start from (written here by the broker's own snapshot writer, as of a later lsn)
    lacks the first and holds the second. Its Parquet export shows the same two faults."""
    data_dir = copy_of(real_run, tmp_path)
    journal = data_dir / "journal"
    base, _ = newest_valid(data_dir)
    assert base is not None
    state = replay(read_entries(journal, after_lsn=base.last_lsn), base)
    kept = sorted(state.queues["misc"].message_ids())[0]
    at = state.last_at + 1.0
    lost_lsn, deleted_lsn = append(
        journal, [(at, "misc", published("fault-lost", at)), (at, "misc", Deleted(kept))]
    )
    state.last_lsn, state.last_at = deleted_lsn, at  # the snapshot "covers" both records, applies neither
    write_snapshot(data_dir, state)
    if audited == "parquet export":
        export_journal(spark, data_dir, tmp_path / "parquet")
        shutil.rmtree(data_dir)  # the export alone
        report = audit(spark, tmp_path / "parquet")
        assert report.source == "parquet"
    else:
        report = audit(spark, data_dir)
    assert report.live_from == "recovered state"
    assert [(v.kind, v.message_id, v.lsn) for v in report.violations] == [
        (walk.ENDED_BUT_LIVE, kept, deleted_lsn),
        (walk.LOST, "fault-lost", lost_lsn),
    ], report.render()
    assert "yet live in the state the broker recovers" in report.violations[0].detail
    assert "not in the state the broker recovers" in report.violations[1].detail
    # Ignoring the snapshots, neither can be checked.
    alone = audit(spark, tmp_path / "parquet" if audited == "parquet export" else data_dir, journal_only=True)
    assert alone.ok and alone.live_from == "journal only", alone.render()


def test_a_missing_middle_segment_is_a_journal_gap(spark: SparkSession, tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    firsts = segmented_journal(journal, groups=3, per_group=10)
    (journal / f"{firsts[1]:020d}.journal").unlink()
    report = audit(spark, journal)
    assert report.violation_counts == {walk.JOURNAL_GAP: 1}, report.render()
    [gap] = report.violations
    assert (gap.kind, gap.lsn) == (walk.JOURNAL_GAP, firsts[1])
    assert f"no readable records from lsn {firsts[1]} to {firsts[2] - 1}" in gap.detail
    assert walk.JOURNAL_GAP in report.render()


def test_the_command_lists_violations_and_exits_1(
    spark: SparkSession, real_run: RealRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.journal_audit.__main__ import main

    data_dir = copy_of(real_run, tmp_path)
    at = max(entry.at for entry in read_entries(data_dir / "journal")) + 1.0
    append(
        data_dir / "journal",
        [
            (at, "jobs", published("fault-double", at)),
            (at, "jobs", Claimed("fault-double", "fault-double.1", "c", 1, at + 30)),
            (at, "jobs", Acked("fault-double", "fault-double.1")),
            (at, "jobs", Acked("fault-double", "fault-double.1")),
        ],
    )
    arguments = ["audit", str(data_dir), "--master", "local[2]", "--json", str(tmp_path / "r.json")]
    assert main(arguments) == 1
    out = capsys.readouterr().out
    assert "double_ack" in out and "fault-double" in out
    document = json.loads((tmp_path / "r.json").read_text())
    # Replaying the second ack fails too: the broker itself could not start on this directory.
    assert document["violation_counts"] == {"double_ack": 1, "unrecoverable": 1} and not document["ok"]
    assert main([*arguments[:4], "--journal-only"]) == 1
    assert "unrecoverable" not in capsys.readouterr().out
    assert main(["audit", str(real_run.data_dir), "--master", "local[2]"]) == 0
    assert "Violations: none" in capsys.readouterr().out
    assert main(["audit", str(tmp_path / "nowhere")]) == 2


# Lines of Spark's own logging (log4j's, or the JVM's start-up banner), as they would reach stderr.
_SPARK_LOG = re.compile(r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d (INFO|WARN|ERROR)|log4j|setLogLevel", re.MULTILINE)


@pytest.mark.spark
def test_the_command_keeps_sparks_log_off_stderr_unless_verbose(real_run: RealRun, tmp_path: Path) -> None:
    """In a process of its own, as people run it: Spark's log goes to its file; ``--verbose`` shows it."""
    environment = {**os.environ, "TMPDIR": str(tmp_path)}  # the quiet log's directory (spark_log_path)
    command = [sys.executable, "-m", "tools.journal_audit", "audit", str(real_run.data_dir)]
    command += ["--master", "local[1]"]
    quiet = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert "Violations: none" in quiet.stdout
    assert not _SPARK_LOG.search(quiet.stderr), quiet.stderr
    assert _SPARK_LOG.search((tmp_path / "broker-journal-audit-spark.log").read_text())
    verbose = subprocess.run(
        [*command, "--verbose"], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300
    )
    assert verbose.returncode == 0, verbose.stderr
    assert _SPARK_LOG.search(verbose.stderr), verbose.stderr
