"""The audit (CONTRACT §9): load a journal into Spark, check the invariants on every message, compare
the journal with the state the broker would recover, and report volumes, attempts, dead-letter reasons
and latencies per queue. docs/audit.md explains each check and each figure.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from tools.journal_audit.live import ExportedState, LiveState, read_exported_state, recovered_state
from tools.journal_audit.reading import SegmentCheck, locate, unreadable_in
from tools.journal_audit.source import (
    SLICE_BYTES,
    is_parquet_export,
    load_journal,
    load_parquet,
    segment_checks,
)
from tools.journal_audit.walk import (
    ENDED_BUT_LIVE,
    JOURNAL_DAMAGE,
    JOURNAL_GAP,
    LOST,
    PURGE_COUNT,
    UNRECOVERABLE,
    QueueHistory,
    group_steps,
    histories,
    walk,
)

if TYPE_CHECKING:
    import pyarrow
    from pyspark.sql import DataFrame, SparkSession

#: Violations fetched to the driver and listed (the counts are always complete).
MAX_LISTED: Final = 1000

#: The loader's columns the audit reads.
READ_COLUMNS: Final = (
    "lsn",
    "at",
    "queue",
    "type",
    "message_id",
    "lease_id",
    "attempt",
    "deadline",
    "reason",
    "refunded",
    "count",
    "max_attempts",
    "segment",
)
_QUEUE_RECORDS: Final = ("queue_created", "queue_updated", "queue_deleted", "purged")
_STEP_COLUMNS: Final = (
    "message_id",
    "queue",
    "lsn",
    "at_us",
    "type",
    "lease_id",
    "attempt",
    "deadline_us",
    "reason",
    "refunded",
)
#: One row per message, as ``walk.Summary`` has it.
SUMMARY_SCHEMA: Final = StructType(
    [
        StructField("queue", StringType()),
        StructField("message_id", StringType()),
        StructField("known", BooleanType()),
        StructField("published_lsn", LongType()),
        StructField("published_us", LongType()),
        StructField("first_claim_us", LongType()),
        StructField("acked_us", LongType()),
        StructField("end", StringType()),
        StructField("end_lsn", LongType()),
        StructField("attempts", IntegerType()),
        StructField("deliveries", IntegerType()),
        StructField("dead_letter_reason", StringType()),
        StructField("purged_by", LongType()),
        StructField(
            "violations",
            ArrayType(
                StructType(
                    [
                        StructField("kind", StringType()),
                        StructField("lsn", LongType()),
                        StructField("lease_id", StringType()),
                        StructField("detail", StringType()),
                    ]
                )
            ),
        ),
    ]
)
#: The record types counted in the per-queue volume table, in this order.
VOLUME_TYPES: Final = (
    "published",
    "claimed",
    "acked",
    "nacked",
    "deferred",
    "extended",
    "released",
    "lease_expired",
    "dead_lettered",
    "expired",
    "redriven",
    "deleted",
    "purged",
)
PERCENTILES: Final = (0.5, 0.9, 0.99)


@dataclass(slots=True)
class Violation:
    kind: str
    queue: str | None
    message_id: str | None
    lsn: int | None
    lease_id: str | None
    detail: str

    def line(self) -> str:
        where = " ".join(
            part
            for part in (
                self.queue or "",
                self.message_id or "",
                f"lsn {self.lsn}" if self.lsn is not None else "",
            )
            if part
        )
        return f"{self.kind:<20} {where}: {self.detail}"


@dataclass(slots=True)
class AuditReport:
    path: str
    #: "data directory", "journal" or "parquet".
    source: str
    #: How "live" was decided: "recovered state" (a snapshot plus replay) or "journal only".
    live_from: str
    snapshot: str | None
    first_lsn: int | None
    last_lsn: int | None
    records: int
    segments: int
    messages: int = 0
    open_messages: int = 0
    #: Messages whose ``published`` record precedes the journal (kept segments start later).
    published_before_journal: int = 0
    #: Messages live in the recovered state (None: live by journal only). With retention it holds more
    #: than ``open_messages``: a message with no record in the kept segments is counted here only.
    live_messages: int | None = None
    violation_counts: dict[str, int] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    queues: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Seconds per phase of the audit (Spark's start-up not included).
    timings: dict[str, float] = field(default_factory=dict)
    #: Violations the per-message walk found (listed among ``violations``); internal bookkeeping.
    violations_in_walk: int = 0

    @property
    def ok(self) -> bool:
        return not self.violation_counts

    def to_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["ok"] = self.ok
        return document

    def render(self, listed_per_kind: int = 20) -> str:
        lines = [f"Journal audit of {self.path} ({self.source})"]
        span = f"lsns {self.first_lsn:,}-{self.last_lsn:,}" if self.first_lsn is not None else "no records"
        lines.append(f"  {self.records:,} records ({span}) in {self.segments} segment(s)")
        live = self.live_from + (f", snapshot {self.snapshot}" if self.snapshot else "")
        if self.live_messages is not None:
            live += f", which holds {self.live_messages:,} live"
        lines.append(
            f"  {self.messages:,} messages, {self.open_messages:,} open (live by {live}); "
            f"{self.published_before_journal:,} published before the journal's first record"
        )
        lines.extend(f"  note: {note}" for note in self.notes)
        lines.append("")
        if self.ok:
            lines.append("Violations: none")
        else:
            total = sum(self.violation_counts.values())
            counts = ", ".join(f"{kind} {count:,}" for kind, count in sorted(self.violation_counts.items()))
            lines.append(f"Violations: {total:,} ({counts})")
            by_kind: dict[str, list[Violation]] = defaultdict(list)
            for violation in self.violations:
                by_kind[violation.kind].append(violation)
            for kind in sorted(self.violation_counts):
                for violation in by_kind[kind][:listed_per_kind]:
                    lines.append("  " + violation.line())
                more = self.violation_counts.get(kind, 0) - min(len(by_kind[kind]), listed_per_kind)
                if more > 0:
                    kept = f"in --json, up to {MAX_LISTED:,} of each kind"
                    lines.append(f"  … and {more:,} more {kind} ({kept})")
        lines.append("")
        lines.extend(self._render_queues())
        return "\n".join(lines)

    def _render_queues(self) -> list[str]:
        if not self.queues:
            return ["No queues."]
        names = sorted(self.queues)
        width = max(len("queue"), *(len(name) for name in names))
        short = {
            "published": "publ",
            "claimed": "claim",
            "acked": "ack",
            "nacked": "nack",
            "deferred": "defer",
            "extended": "ext",
            "released": "rel",
            "lease_expired": "l.exp",
            "dead_lettered": "dead",
            "expired": "ttl",
            "redriven": "redr",
            "deleted": "del",
            "purged": "purge",
        }
        lines = ["Records per queue:"]
        header = (
            f"  {'queue':<{width}}" + "".join(f" {short[kind]:>9}" for kind in VOLUME_TYPES) + f" {'open':>9}"
        )
        lines.append(header)
        for name in names:
            queue = self.queues[name]
            volumes = queue["records"]
            row = f"  {name:<{width}}" + "".join(f" {volumes.get(kind, 0):>9,}" for kind in VOLUME_TYPES)
            lines.append(row + f" {queue['open']:>9,}")
        lines.append("")
        lines.append("Latency, seconds (p50 / p90 / p99 / max):")
        for name in names:
            latency = self.queues[name]["latency"]
            parts = []
            for label, key in (
                ("publish→first claim", "publish_to_first_claim"),
                ("publish→ack", "publish_to_ack"),
            ):
                figures = latency.get(key)
                if figures:
                    parts.append(
                        f"{label} {figures['p50']:.3f} / {figures['p90']:.3f} / {figures['p99']:.3f} / "
                        f"{figures['max']:.3f} (n={figures['count']:,})"
                    )
            lines.append(f"  {name:<{width}}  " + ("; ".join(parts) if parts else "-"))
        lines.append("")
        lines.append("Attempts at the end (attempts: messages), dead letters by reason:")
        for name in names:
            queue = self.queues[name]
            attempts = ", ".join(f"{key}: {value:,}" for key, value in sorted(queue["attempts"].items()))
            reasons = ", ".join(
                f"{key} {value:,}" for key, value in sorted(queue["dead_letter_reasons"].items())
            )
            lines.append(f"  {name:<{width}}  attempts {attempts or '-'}; dead letters {reasons or '-'}")
        return lines


class Findings:
    """Violations as they are found: all counted, the first ``limit`` of each kind kept to be listed
    (one global limit hid whole kinds behind a thousand of another)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.counts: Counter[str] = Counter()
        self.listed: list[Violation] = []
        self._kept: Counter[str] = Counter()

    def add(self, violation: Violation) -> None:
        self.counts[violation.kind] += 1
        if self._kept[violation.kind] < self.limit:
            self._kept[violation.kind] += 1
            self.listed.append(violation)

    def more(self, kind: str, count: int) -> None:
        """``count`` more of ``kind``, counted but not fetched."""
        if count > 0:
            self.counts[kind] += count


# -- the Spark side ------------------------------------------------------------------------------------


def _walker(
    queue_histories: dict[str, QueueHistory], complete: bool, unread_from: list[int]
) -> Callable[[Iterator[pyarrow.RecordBatch]], Iterator[pyarrow.RecordBatch]]:
    """The function ``mapInArrow`` runs in each worker: records sorted by message and lsn in, one
    summary row per message out (``unread_from``: see ``walk.walk``)."""

    def run(batches: Iterator[pyarrow.RecordBatch]) -> Iterator[pyarrow.RecordBatch]:
        import pyarrow as pa
        from pyspark.sql.pandas.types import to_arrow_schema

        schema = to_arrow_schema(SUMMARY_SCHEMA, timezone="UTC")

        def rows() -> Iterator[tuple[Any, ...]]:
            for batch in batches:
                yield from zip(*(column.to_pylist() for column in batch.columns), strict=True)

        out: list[tuple[Any, ...]] = []
        for queue, message_id, steps in group_steps(rows()):
            s = walk(queue, message_id, steps, queue_histories.get(queue), complete, unread_from)
            violations = [
                {"kind": kind, "lsn": lsn, "lease_id": lease_id, "detail": detail}
                for kind, lsn, lease_id, detail in s.violations
            ]
            out.append(
                (
                    s.queue,
                    s.message_id,
                    s.known,
                    s.published_lsn,
                    s.published_us,
                    s.first_claim_us,
                    s.acked_us,
                    s.end,
                    s.end_lsn,
                    s.attempts,
                    s.deliveries,
                    s.dead_letter_reason,
                    s.purged_by,
                    violations,
                )
            )
            if len(out) >= 8192:
                yield _batch(pa, schema, out)
                out = []
        if out:
            yield _batch(pa, schema, out)

    return run


def _batch(pa: Any, schema: Any, rows: list[tuple[Any, ...]]) -> Any:
    columns = zip(*rows, strict=True)
    return pa.RecordBatch.from_arrays(
        [pa.array(column, type=schema.field(index).type) for index, column in enumerate(columns)],
        schema=schema,
    )


def audit(
    spark: SparkSession,
    path: str | os.PathLike[str],
    *,
    journal_only: bool = False,
    max_listed: int = MAX_LISTED,
    slice_bytes: int = SLICE_BYTES,
) -> AuditReport:
    """Audit the journal at ``path``: a data directory, its journal directory, or a Parquet export
    (segments over ``slice_bytes`` are read in slices, one Spark task each).

    Raises ``reading.UnreadableJournal`` for a record the loader cannot give as a row."""
    given = Path(path)
    try:
        return _run(spark, given, journal_only, max_listed, slice_bytes)
    except Exception as error:
        # A record the loader refuses (reading.UnreadableJournal) reaches the driver wrapped in Spark's
        # own error: give it back as itself.
        unreadable = unreadable_in(error)
        if unreadable is None or unreadable is error:
            raise
        raise unreadable from None


def _run(
    spark: SparkSession, given: Path, journal_only: bool, max_listed: int, slice_bytes: int
) -> AuditReport:
    from pyspark.sql import functions as F

    live: LiveState | None = None
    checks: list[SegmentCheck] | None = None
    recovering = 0.0
    # Whether live could have been decided against a recovered state (a data directory, or an export
    # of one), not ignoring the snapshots: without one, the report says why lost is not checked.
    snapshots_expected = False
    exported: ExportedState | None = None
    if is_parquet_export(given):
        source = "parquet"
        exported = read_exported_state(given)
        checks = exported.segment_checks if exported is not None else None
        if journal_only:
            exported = None
        if exported is not None:
            live, snapshots_expected = exported.live, exported.from_data_directory
        records = load_parquet(spark, given, columns=READ_COLUMNS)
        if live is not None and live.failure is None:
            records = records.filter(F.col("lsn") <= live.last_lsn)
    else:
        location = locate(given)
        source = "data directory" if location.data_dir is not None else "journal"
        if location.data_dir is not None and not journal_only:
            snapshots_expected = True
            started = time.perf_counter()
            live = recovered_state(location.data_dir, location.journal)
            recovering = time.perf_counter() - started
        until = live.last_lsn if live is not None and live.failure is None else None
        # Before the records are read: a broker still writing then only adds records past the checks.
        checks = segment_checks(spark, location.journal, slice_bytes)
        records = load_journal(
            spark, location.journal, until_lsn=until, columns=READ_COLUMNS, slice_bytes=slice_bytes
        )

    for check in checks or ():
        if check["problem"] is not None:
            # Where reading that segment stops: a slice that starts after a frame that passes its
            # checksum yet holds no record reads on (it checks frames before it, not their records).
            beyond = (F.col("segment") == check["segment"]) & (F.col("lsn") >= check["next_lsn"])
            records = records.filter(~beyond)
    steps = records.select(
        "message_id",
        "queue",
        "lsn",
        F.unix_micros("at").alias("at_us"),
        "type",
        "lease_id",
        "attempt",
        F.unix_micros("deadline").alias("deadline_us"),
        "reason",
        "refunded",
        "segment",
        "count",
        "max_attempts",
    ).cache()
    try:
        report = _audit(spark, str(given), source, steps, live, snapshots_expected, max_listed, checks)
        if live is not None and source != "parquet":
            report.timings = {"recovered_state": round(recovering, 3), **report.timings}
        if source == "parquet" and not journal_only and exported is None:
            report.notes.append(
                "the export holds no recovered state (made without it): live means no end record in the "
                "journal (lost is not checked)"
            )
        if checks is None:
            report.notes.append(
                "the export holds no segment checks (made by an older version): damage inside a segment "
                "shows only as a gap between segments, and a torn tail not at all"
            )
        return report
    finally:
        steps.unpersist()


def _audit(
    spark: SparkSession,
    path: str,
    source: str,
    steps: DataFrame,
    live: LiveState | None,
    snapshots_expected: bool,
    max_listed: int,
    checks: list[SegmentCheck] | None,
) -> AuditReport:
    from pyspark.sql import functions as F

    clock = _Clock()
    # 1. The journal's extent and the volumes, in one pass (which also fills the cache).
    overview = (
        steps.groupBy("segment", "queue", "type")
        .agg(F.count("*").alias("n"), F.min("lsn").alias("low"), F.max("lsn").alias("high"))
        .collect()
    )
    by_segment: dict[str, list[int]] = {}
    volumes: dict[str, Counter[str]] = defaultdict(Counter)
    for row in overview:
        extent = by_segment.setdefault(row["segment"], [row["low"], row["high"], 0])
        extent[0], extent[1] = min(extent[0], row["low"]), max(extent[1], row["high"])
        extent[2] += row["n"]
        volumes[row["queue"]][row["type"]] += row["n"]
    extents = sorted(by_segment.values())
    records = sum(extent[2] for extent in extents)
    first_lsn = extents[0][0] if extents else None
    last_lsn = extents[-1][1] if extents else None
    complete = first_lsn == 1
    findings = Findings(max_listed)
    flag = findings.add
    notes: list[str] = []
    # Where records the journal should hold could not be read: damage, segments that do not join up.
    judged = _judge_segments(checks, live, flag, notes) if checks is not None else []
    recovered_to = live.last_lsn if live is not None and live.failure is None else 0
    snapshot_id = live.snapshot_id if live is not None else None
    unread_from = list(judged)

    for index, (low, high, n) in enumerate(extents):
        next_low = extents[index + 1][0] if index + 1 < len(extents) else None
        if n != high - low + 1:
            unread_from.append(low)
            flag(
                Violation(
                    JOURNAL_GAP,
                    None,
                    None,
                    low,
                    None,
                    f"lsns {low}-{high} hold {n} records, not {high - low + 1}",
                )
            )
        if (
            next_low is not None
            and next_low != high + 1
            and not any(high < lsn <= max(high + 1, next_low - 1) for lsn in judged)
        ):  # a hole the segment checks do not already explain (an export without them, lost files)
            unread_from.append(high + 1)
            cut = (
                "the broker steps over it, as its snapshot covers it"
                if next_low - 1 <= recovered_to
                else "the broker would cut the journal there at its next start"
            )
            flag(
                Violation(
                    JOURNAL_GAP,
                    None,
                    None,
                    high + 1,
                    None,
                    f"no readable records from lsn {high + 1} to {next_low - 1}: a segment is corrupt or "
                    f"missing ({cut})",
                )
            )

    report = AuditReport(
        path=path,
        source=source,
        live_from="recovered state" if live is not None and live.failure is None else "journal only",
        snapshot=live.snapshot_id if live is not None else None,
        first_lsn=first_lsn,
        last_lsn=last_lsn,
        records=records,
        segments=len(extents),
        live_messages=len(live.messages) if live is not None and live.failure is None else None,
    )
    report.notes.extend(notes)
    if live is not None:
        report.notes.extend(live.skipped_snapshots)
        if live.failure is not None:
            lsn, what = live.failure
            start = f"snapshot {live.snapshot_id}" if live.snapshot_id else "the journal alone"
            flag(
                Violation(
                    UNRECOVERABLE,
                    None,
                    None,
                    lsn,
                    None,
                    f"recovery from {start} fails at this lsn ({what}): the broker could not start on "
                    "this directory; lost messages are not checked",
                )
            )
    elif snapshots_expected:
        report.notes.append(
            "no valid snapshot: live means no end record in the journal (lost is not checked)"
        )
    # Whatever records the audit could not read did to a message (an ack, a dead letter …) it cannot
    # see, so where they lie under the state it is compared with, lost would blame the snapshot.
    lost_after: int | None = 0  # lost is checked for messages published after this lsn; None: for none
    unread_under = [lsn for lsn in unread_from if lsn <= recovered_to]
    if recovered_to and (last_lsn or 0) < recovered_to:
        lost_after = None
        seen = [kind for kind in (JOURNAL_DAMAGE, JOURNAL_GAP) if findings.counts[kind]]
        why = f" (see {', '.join(seen)})" if seen else ""
        report.notes.append(
            f"the journal could be read to lsn {last_lsn or 0} only{why}, but the state the broker recovers "
            f"(snapshot {snapshot_id}) reaches lsn {recovered_to}: lost is not checked, as messages "
            "ended in the records it could not read would look lost"
        )
    elif unread_under:
        lost_after = max(unread_under)
        report.notes.append(
            f"records from lsn {lost_after} on could not be read (see journal_damage, journal_gap), under "
            f"the state the broker recovers (snapshot {snapshot_id}, lsn {recovered_to}): lost is "
            f"checked only for messages published after them, as one that ended in the records the audit "
            "could not read would look lost"
        )
    if not complete and first_lsn is not None:
        report.notes.append(
            f"the journal starts at lsn {first_lsn} (older segments deleted): messages published before it "
            "are judged only on what the journal still holds"
        )
    read_past = [lsn for lsn in unread_from if lsn <= (last_lsn or 0)]  # runs with records read after
    if read_past:
        note = (
            f"records from lsn {min(read_past)} on could not all be read: a message whose records span them "
            "is judged from its first record after them on (its lease, its attempts)"
        )
        if complete:
            # A message published in records that could not be read shows up later as one never published.
            complete = False
            note += ", and one first seen after them as if published before the journal"
        report.notes.append(note)

    # 2. Queue-level records: small, so every worker gets them with the walk.
    queue_rows = (
        steps.filter(F.col("type").isin(*_QUEUE_RECORDS))
        .select("lsn", "at_us", "queue", "type", "max_attempts", "count")
        .collect()
    )
    queue_histories = histories(
        [(r["lsn"], r["at_us"], r["queue"], r["type"], r["max_attempts"]) for r in queue_rows]
    )
    purge_counts = {r["lsn"]: (r["queue"], r["count"]) for r in queue_rows if r["type"] == "purged"}

    # 3. Every message's records, together and in order: one summary each.
    summaries = (
        steps.filter(F.col("message_id").isNotNull())
        .select(*_STEP_COLUMNS)
        .repartition("message_id")
        .sortWithinPartitions("message_id", "lsn")
    )
    with warnings.catch_warnings():
        # pyspark warns about pandas 3 whenever it builds an Arrow UDF; the walk does not use pandas.
        warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas", FutureWarning)
        walker = _walker(queue_histories, complete, sorted(set(unread_from)))
        summaries = summaries.mapInArrow(walker, SUMMARY_SCHEMA).cache()
    try:
        clock.lap("read")
        _per_queue(report, summaries, volumes)
        clock.lap("walk")
        _collect_findings(
            spark, report, summaries, live, findings, purge_counts, complete, max_listed, lost_after
        )
        clock.lap("findings")
    finally:
        summaries.unpersist()
    report.violation_counts = dict(sorted(findings.counts.items()))
    report.violations = sorted(findings.listed, key=lambda v: (v.kind, v.lsn if v.lsn is not None else 0))
    report.timings = clock.laps
    return report


def _judge_segments(
    checks: list[SegmentCheck],
    live: LiveState | None,
    flag: Callable[[Violation], None],
    notes: list[str],
) -> list[int]:
    """Where reading the journal stops short of what the broker committed, and why (``checks``, one per
    segment in lsn order, from ``source.segment_checks``, made before any record is filtered out): the
    loader stops at each quietly. Damage inside a segment is a ``journal_damage`` violation; a torn tail,
    the end of the newest segment cut short by a crash (nothing readable after it, no later segment, no
    record the broker would recover beyond it), is a note, as the broker cuts it at its next start with
    a warning. A segment that does not start where the one before it ended is a ``journal_gap``; a
    journal that ends (cleanly) below its newest snapshot's lsn lost records the snapshot was taken
    from: ``journal_damage``. Returns the lsn where each run of records that could not be read begins.
    """
    recovered_to = live.last_lsn if live is not None and live.failure is None else 0
    # The snapshot's lsn: the broker reads the journal after it, and only what lies after it can be cut.
    covered = live.snapshot_lsn if live is not None else 0
    unread: list[int] = []
    for index, check in enumerate(checks):
        name, due, problem = check["segment"], check["next_lsn"], check["problem"]
        later = index + 1 < len(checks)
        if problem is None:
            if later and checks[index + 1]["first_lsn"] != due:
                unread.append(due)
                flag(_segments_apart(checks, index, covered, recovered_to))
            continue
        readable = check["readable_after"]
        where = f"{name} at byte {check['offset']}" if check["offset"] is not None else name
        if readable is None and not later and max(recovered_to, covered) < due:
            notes.append(
                f"torn tail: {where} ({problem}), where lsn {due} was due: the end of the newest segment "
                "was not written whole (normal after a crash, or while a broker writes); the broker cuts "
                "it at its next start"
            )
            continue
        lost = []
        if readable is not None:
            count, low, high = readable
            span = f"lsn {low}" if low == high else f"lsns {low}-{high}"
            lost.append(f"{count} record(s) after it still pass their checksum ({span})")
        if later:
            lost.append("later segments follow")
        if recovered_to >= due:
            lost.append(f"the broker recovers to lsn {recovered_to} past it (damage under its snapshot)")
        elif covered >= due:
            lost.append(f"its newest snapshot covers lsns up to {covered}, past it")
        # read_segment's "lsn N where M was due" already names the lsn due.
        due_said = "" if f"{due} was due" in problem else f" (lsn {due} was due)"
        flag(
            Violation(
                JOURNAL_DAMAGE,
                None,
                None,
                due,
                None,
                f"{where}: {problem}{due_said}; reading stops there, yet {', '.join(lost)}: "
                f"corruption, not a torn tail. The records from lsn {due} on in this segment are not "
                "audited",
            )
        )
        unread.append(due)
    newest = checks[-1] if checks else None
    if newest is not None and newest["problem"] is None and newest["next_lsn"] - 1 < covered:
        # Snapshots are built from the committed journal, and the newest segment is never deleted: an
        # honest journal reaches every snapshot's lsn. One that ends below it cleanly (a file cut short,
        # zeroed to its end) shows no bad frame, yet lost the records up to the snapshot, and any the
        # broker committed after it.
        due = newest["next_lsn"]
        flag(
            Violation(
                JOURNAL_DAMAGE,
                None,
                None,
                due,
                None,
                f"{newest['segment']} at byte {newest['offset']}: the journal ends there, at lsn {due - 1}, "
                f"yet its newest snapshot covers lsns up to {covered}: its records from lsn {due} on (and "
                "any the broker committed after the snapshot) are gone, cut off or zeroed; the broker "
                "starts from the snapshot, without them",
            )
        )
        unread.append(due)
    return unread


def _segments_apart(checks: list[SegmentCheck], index: int, covered: int, recovered_to: int) -> Violation:
    """The ``journal_gap`` between segment ``index``, read whole, and the next, which does not start at
    the lsn due after it (``covered``: the snapshot's lsn; ``recovered_to``: what the broker recovers).
    The broker reads on from the segment that holds the lsn after its snapshot: a gap (or a repeat)
    after that lsn ends its journal, and it deletes every segment from the next one on at its start."""
    due = checks[index]["next_lsn"]
    following = checks[index + 1]
    start = following["first_lsn"]
    if start > due:
        what = (
            f"no readable records from lsn {due} to {start - 1}: a segment is missing before "
            f"{following['segment']}"
        )
    else:
        what = f"{following['segment']} starts at lsn {start}, where lsn {due} was due: segments overlap"
    if start - 1 <= covered:
        stepped = f"{what} (the broker steps over it, as its snapshot covers it)"
        return Violation(JOURNAL_GAP, None, None, due, None, stepped)
    after = checks[index + 1 :]
    records = sum(check["next_lsn"] - check["first_lsn"] for check in after)
    cut = (
        f"the broker would cut the journal there at its next start, deleting {len(after)} segment(s) from "
        f"{following['segment']} on, with {records} readable record(s) it had committed"
    )
    if recovered_to and start > recovered_to:
        cut += f"; they are past the state it recovers (lsn {recovered_to}), so not audited"
    return Violation(JOURNAL_GAP, None, None, due, None, f"{what} ({cut})")


class _Clock:
    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._last, 3)
        self._last = now


def _collect_findings(
    spark: SparkSession,
    report: AuditReport,
    summaries: DataFrame,
    live: LiveState | None,
    findings: Findings,
    purge_counts: dict[int, tuple[str, int]],
    complete: bool,
    max_listed: int,
    lost_after: int | None = 0,
) -> None:
    """The violations: those the walk found per message, purges that do not add up, and the comparison
    with the recovered state (``lost`` only for messages published after lsn ``lost_after``; None: not
    at all)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    flag = findings.add
    if report.violations_in_walk:
        exploded = summaries.filter(F.size("violations") > 0).select(
            "queue", "message_id", F.explode("violations").alias("v")
        )
        kinds = exploded.groupBy("v.kind").count().collect()
        first_of_kind = F.row_number().over(Window.partitionBy("v.kind").orderBy("v.lsn"))
        listed = (
            exploded.withColumn("rank", first_of_kind)
            .filter(F.col("rank") <= max_listed)
            .orderBy("v.lsn")
            .select("queue", "message_id", "v.*")
            .collect()
        )
        shown: Counter[str] = Counter()
        for item in listed:
            shown[item["kind"]] += 1
            flag(
                Violation(
                    item["kind"],
                    item["queue"],
                    item["message_id"],
                    item["lsn"],
                    item["lease_id"],
                    item["detail"],
                )
            )
        for row in kinds:
            findings.more(row["kind"], row["count"] - shown[row["kind"]])

    if purge_counts:
        purged = {
            row["purged_by"]: row["count"]
            for row in summaries.filter(F.col("purged_by").isNotNull()).groupBy("purged_by").count().collect()
        }
        for lsn, (queue, count) in sorted(purge_counts.items()):
            seen = purged.get(lsn, 0)
            if seen > count or (complete and seen != count):
                detail = (
                    f"the purge says it removed {count} message(s); the journal shows {seen} ready or delayed"
                )
                flag(Violation(PURGE_COUNT, queue, None, lsn, None, detail))

    if live is None or live.failure is not None:
        return
    state = spark.createDataFrame([(m,) for _, m in live.messages], "message_id string").withColumn(
        "live", F.lit(True)
    )
    where = f"snapshot {live.snapshot_id} plus the journal to lsn {live.last_lsn}"
    open_not_live = F.col("end").isNull() & F.col("live").isNull()
    if lost_after:
        open_not_live &= F.col("known") & (F.col("published_lsn") > lost_after)
    compared = (
        summaries.select("queue", "message_id", "known", "published_lsn", "end", "end_lsn")
        .join(state, "message_id", "left")
        .filter(open_not_live | (F.col("end").isNotNull() & F.col("live")))
        .cache()
    )
    try:
        counts = {
            row["lost"]: row["count"]
            for row in compared.groupBy(F.col("end").isNull().alias("lost")).count().collect()
        }
        if not counts:
            return
        for lost in (True, False) if lost_after is not None else (False,):
            kind = LOST if lost else ENDED_BUT_LIVE
            count = counts.get(lost, 0)
            if not count:
                continue
            rows = (
                compared.filter(F.col("end").isNull() if lost else F.col("end").isNotNull())
                .orderBy("published_lsn" if lost else "end_lsn")
                .limit(max_listed)
                .collect()
            )
            for row in rows:
                if lost:
                    first = (
                        f"published at lsn {row['published_lsn']}"
                        if row["known"]
                        else "published before the journal"
                    )
                    detail = (
                        f"{first}, never acked, dead-lettered, expired, deleted or purged, "
                        f"yet not in the state the broker recovers ({where})"
                    )
                    lsn = row["published_lsn"]
                else:
                    ended = f"{row['end']} at lsn {row['end_lsn']}"
                    detail = f"{ended}, yet live in the state the broker recovers ({where})"
                    lsn = row["end_lsn"]
                flag(Violation(kind, row["queue"], row["message_id"], lsn, None, detail))
            findings.more(kind, count - len(rows))
    finally:
        compared.unpersist()


def _per_queue(report: AuditReport, summaries: DataFrame, volumes: dict[str, Counter[str]]) -> None:
    """Totals, open messages, latency percentiles, attempts and dead-letter reasons per queue: two jobs."""
    from pyspark.sql import functions as F

    seconds = 1_000_000.0
    known = F.col("known")
    to_claim = F.when(known, (F.col("first_claim_us") - F.col("published_us")) / seconds)
    to_ack = F.when(known, (F.col("acked_us") - F.col("published_us")) / seconds)
    percentiles = F.array(*(F.lit(p) for p in PERCENTILES))
    queue_rows = (
        summaries.groupBy("queue")
        .agg(
            F.count("*").alias("messages"),
            F.count_if(F.col("end").isNull()).alias("open"),
            F.count_if(~known).alias("before"),
            F.sum(F.size("violations")).alias("violations"),
            F.count(to_claim).alias("claim_n"),
            F.percentile_approx(to_claim, percentiles, 10_000).alias("claim_p"),
            F.max(to_claim).alias("claim_max"),
            F.count(to_ack).alias("ack_n"),
            F.percentile_approx(to_ack, percentiles, 10_000).alias("ack_p"),
            F.max(to_ack).alias("ack_max"),
        )
        .collect()
    )
    end_rows = (
        summaries.groupBy(
            "queue",
            F.when(known, F.col("attempts")).alias("attempts"),
            F.when(F.col("end") == "expired", F.lit("expired"))
            .when(F.col("end") == "dead_lettered", F.col("dead_letter_reason"))
            .alias("reason"),
        )
        .count()
        .collect()
    )
    queues: dict[str, dict[str, Any]] = {
        name: {
            "records": dict(sorted(counter.items())),
            "messages": 0,
            "open": 0,
            "latency": {},
            "attempts": {},
            "dead_letter_reasons": {},
        }
        for name, counter in volumes.items()
    }
    for row in queue_rows:
        queue = queues[row["queue"]]
        queue["messages"], queue["open"] = row["messages"], row["open"]
        report.messages += row["messages"]
        report.open_messages += row["open"]
        report.published_before_journal += row["before"]
        report.violations_in_walk += row["violations"] or 0
        for key, n, values, top in (
            ("publish_to_first_claim", row["claim_n"], row["claim_p"], row["claim_max"]),
            ("publish_to_ack", row["ack_n"], row["ack_p"], row["ack_max"]),
        ):
            if n and values is not None:
                figures = {f"p{round(p * 100)}": value for p, value in zip(PERCENTILES, values, strict=True)}
                queue["latency"][key] = {"count": n, **figures, "max": top}
    for row in end_rows:
        queue = queues[row["queue"]]
        if row["attempts"] is not None:
            attempts = queue["attempts"]
            attempts[str(row["attempts"])] = attempts.get(str(row["attempts"]), 0) + row["count"]
        if row["reason"] is not None:
            reasons = queue["dead_letter_reasons"]
            reasons[row["reason"]] = reasons.get(row["reason"], 0) + row["count"]
    for queue in queues.values():
        queue["attempts"] = dict(sorted(queue["attempts"].items(), key=lambda item: int(item[0])))
        queue["dead_letter_reasons"] = dict(sorted(queue["dead_letter_reasons"].items()))
    report.queues = dict(sorted(queues.items()))
