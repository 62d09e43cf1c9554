"""The journal as a Spark DataFrame: a Python data source (``spark.read.format("broker_journal")``), one
partition per segment file (a large segment is read in slices, one partition each), and the Parquet
export that gives the same DataFrame on a cluster (with the recovered state beside it, for the audit).

The reader runs in Spark's Python workers: each reads its segment with ``tools.journal_audit.reading``
(which decodes with the broker's own format module) and hands Spark Arrow record batches.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from tools.journal_audit.schema import COLUMN_NAMES, PARTITION_COLUMNS, SCHEMA

if TYPE_CHECKING:
    import pyarrow
    from pyspark.sql import DataFrame, SparkSession

    from tools.journal_audit.live import ExportedState
    from tools.journal_audit.reading import SegmentCheck

NAME: Final = "broker_journal"
#: Rows per Arrow batch handed to Spark.
BATCH_ROWS: Final = 16_384
#: A segment larger than this is read as several slices, one partition each (a full segment, 64 MiB,
#: makes four), so that a journal of few segments still keeps every core busy.
SLICE_BYTES: Final = 16 * 1024 * 1024


class SegmentPartition(InputPartition):
    """One segment file, or the slice of it whose frames begin in ``[start, stop)`` (byte offsets;
    ``stop`` None: to the end). ``path`` None: an empty journal, read as no rows."""

    def __init__(self, path: str | None, first_lsn: int, start: int = 0, stop: int | None = None) -> None:
        super().__init__((path, start))
        self.path = path
        self.first_lsn = first_lsn
        self.start = start
        self.stop = stop


def plan(
    path: str | os.PathLike[str], *, until_lsn: int | None = None, slice_bytes: int = SLICE_BYTES
) -> list[SegmentPartition]:
    """The partitions that read the journal at ``path``: each segment, in slices of ``slice_bytes``."""
    from broker.storage.segments import HEADER_SIZE, segments
    from tools.journal_audit.reading import locate

    listed = segments(locate(path).journal)
    if until_lsn is not None:
        listed = [segment for segment in listed if segment.first_lsn <= until_lsn]
    planned = []
    for segment in listed:
        body = max(segment.size - HEADER_SIZE, 0)
        count = max(1, -(-body // max(slice_bytes, 1)))
        cuts = [HEADER_SIZE + body * index // count for index in range(count)]
        for index, cut in enumerate(cuts):
            stop = cuts[index + 1] if index + 1 < count else None  # the last slice reads to the end
            planned.append(
                SegmentPartition(str(segment.path), segment.first_lsn, 0 if index == 0 else cut, stop)
            )
    return planned or [SegmentPartition(None, 0)]


class JournalReader(DataSourceReader):
    def __init__(
        self, path: str, schema: StructType, until_lsn: int | None, batch_rows: int, slice_bytes: int
    ) -> None:
        full = {field.name: field for field in SCHEMA.fields}
        for requested in schema.fields:
            known = full.get(requested.name)
            if known is None or known.dataType != requested.dataType:
                raise ValueError(
                    f"column {requested.name} {requested.dataType.simpleString()} is not in the journal's "
                    "schema (python -m tools.journal_audit schema)"
                )
        self.path = path
        self.schema = schema
        self.indexes = [COLUMN_NAMES.index(field.name) for field in schema.fields]
        self.until_lsn = until_lsn
        self.batch_rows = batch_rows
        self.slice_bytes = slice_bytes

    def partitions(self) -> Sequence[InputPartition]:
        return plan(self.path, until_lsn=self.until_lsn, slice_bytes=self.slice_bytes)

    def read(self, partition: InputPartition) -> Iterator[pyarrow.RecordBatch]:
        assert isinstance(partition, SegmentPartition)
        if partition.path is None:
            return
        yield from segment_batches(
            partition.path,
            partition.first_lsn,
            until_lsn=self.until_lsn,
            start=partition.start,
            stop=partition.stop,
            schema=self.schema,
            indexes=self.indexes,
            batch_rows=self.batch_rows,
        )


def segment_batches(
    path: str,
    first_lsn: int,
    *,
    until_lsn: int | None = None,
    start: int = 0,
    stop: int | None = None,
    schema: StructType = SCHEMA,
    indexes: Sequence[int] | None = None,
    batch_rows: int = BATCH_ROWS,
) -> Iterator[pyarrow.RecordBatch]:
    """The rows of one segment (or slice) as Arrow record batches of ``schema``, which holds the
    columns at ``indexes`` of the full schema (all of them by default), in Spark's Arrow form."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    from broker.storage.segments import Segment
    from tools.journal_audit.reading import rows

    arrow = to_arrow_schema(schema, timezone="UTC")
    columns = list(range(len(COLUMN_NAMES))) if indexes is None else list(indexes)
    types = [arrow.field(index).type for index in range(len(arrow))]
    segment = Segment(first_lsn, Path(path), 0)
    batch: list[tuple[Any, ...]] = []
    for row in rows(segment, until_lsn=until_lsn, start=start, stop=stop):
        batch.append(row)
        if len(batch) >= batch_rows:
            yield _to_batch(pa, arrow, types, columns, batch)
            batch = []
    if batch:
        yield _to_batch(pa, arrow, types, columns, batch)


def _to_batch(
    pa: Any, schema: Any, types: list[Any], columns: list[int], batch: list[tuple[Any, ...]]
) -> Any:
    arrays = []
    for column, kind in zip(columns, types, strict=True):
        values = [row[column] for row in batch]
        try:
            arrays.append(pa.array(values, type=kind))
        except (OverflowError, pa.ArrowInvalid) as error:
            _refuse(pa, column, kind, batch, error)
            raise
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


_LSN: Final = COLUMN_NAMES.index("lsn")
_SEGMENT: Final = COLUMN_NAMES.index("segment")


def _refuse(pa: Any, column: int, kind: Any, batch: list[tuple[Any, ...]], error: Exception) -> None:
    """Raise ``UnreadableJournal`` naming the first record of ``batch`` whose value in ``column`` does
    not fit its type ``kind`` (an integer beyond 64 bits, which the format allows and the broker never
    writes); return if none is found (then ``error`` is another failure)."""
    from tools.journal_audit.reading import UnreadableJournal

    for row in batch:
        value = row[column]
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        try:
            pa.array([value], type=kind)
        except (OverflowError, pa.ArrowInvalid):
            raise UnreadableJournal(
                f"{row[_SEGMENT]}, lsn {row[_LSN]}: field {COLUMN_NAMES[column]} is {value}, beyond the "
                f"{kind.bit_width}-bit integers of its column ({type(error).__name__}); the loader's "
                "integer columns are 64 or 32 bits (docs/audit.md)"
            ) from None


class JournalSource(DataSource):
    """``spark.read.format("broker_journal").load(path)``: path is a data directory or a journal
    directory. Options: ``until_lsn`` (read no record after it), ``slice_bytes`` (segments larger than
    this are read in slices, one partition each), ``batch_rows``. A schema given with ``.schema(…)``
    that names some of the columns (same names and types) reads only those: the rest are never built."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        options = self.options
        path = options.get("path")
        if not path:
            raise ValueError(f'say which journal to read: spark.read.format("{NAME}").load(path)')
        until = options.get("until_lsn")
        return JournalReader(
            str(path),
            schema,
            int(until) if until else None,
            int(options.get("batch_rows", BATCH_ROWS)),
            int(options.get("slice_bytes", SLICE_BYTES)),
        )


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("broker_journal")`` known to this session."""
    spark.dataSource.register(JournalSource)


def load_journal(
    spark: SparkSession,
    path: str | os.PathLike[str],
    *,
    until_lsn: int | None = None,
    columns: Sequence[str] | None = None,
    slice_bytes: int = SLICE_BYTES,
) -> DataFrame:
    """The journal at ``path`` (a data directory or its ``journal/``), one row per record; only the
    ``columns`` named (of the schema) when given; segments over ``slice_bytes`` read in slices."""
    from tools.journal_audit.reading import locate

    journal = locate(path).journal  # fails here, on the driver, rather than in a worker
    register(spark)
    reader = spark.read.format(NAME)
    if columns is not None:
        fields = {field.name: field for field in SCHEMA.fields}
        reader = reader.schema(StructType([fields[name] for name in columns]))
    if until_lsn is not None:
        reader = reader.option("until_lsn", str(until_lsn))
    if slice_bytes != SLICE_BYTES:
        reader = reader.option("slice_bytes", str(slice_bytes))
    return reader.load(str(journal.resolve()))


def export_parquet(records: DataFrame, out: str | os.PathLike[str], *, mode: str = "error") -> None:
    """Write ``records`` (the loader's DataFrame) as Parquet, partitioned by queue and UTC day.

    The records alone: ``export_journal`` also writes the recovered state the audit compares them with.
    """
    records.write.mode(mode).partitionBy(*PARTITION_COLUMNS).parquet(str(out))


def export_journal(
    spark: SparkSession,
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    journal_only: bool = False,
) -> ExportedState:
    """Export the journal at ``path`` to Parquet in ``out`` (``export_parquet``) with what auditing the
    export needs of the data directory, written beside the Parquet files: the state the broker would
    recover from its newest snapshot (``tools.journal_audit.live``), so that the audit of the export
    checks ``lost`` and ``ended_but_live`` as the audit of the data directory does, and where reading
    each segment stopped (``segment_checks``), so that it reports the same damage and torn tails.
    ``journal_only``: ignore the snapshots (the export is then audited as a journal alone)."""
    from tools.journal_audit.live import ExportedState, recovered_state, write_exported_state
    from tools.journal_audit.reading import locate, unreadable_in

    location = locate(path)
    data_dir = None if journal_only else location.data_dir
    from_data_directory = data_dir is not None
    live = recovered_state(data_dir, location.journal) if data_dir is not None else None
    checks = segment_checks(spark, location.journal)  # before the records: see audit._run
    # The whole journal, even records written after the state was computed: the audit stops at the
    # state's last lsn, as it does on the data directory.
    try:
        export_parquet(load_journal(spark, location.journal), out, mode="overwrite" if overwrite else "error")
    except Exception as error:
        unreadable = unreadable_in(error)
        if unreadable is None:
            raise
        raise unreadable from None
    exported = ExportedState(from_data_directory, live, checks)
    write_exported_state(out, exported)
    return exported


def segment_checks(spark: SparkSession, journal: Path, slice_bytes: int = SLICE_BYTES) -> list[SegmentCheck]:
    """``reading.check_segment`` of every segment of ``journal``, in lsn order: where reading each stops
    before its end, and why (the loader stops there quietly). A large segment is checked in the slices
    the loader reads (one Spark task each: the check decodes every record); its check is the slice's
    that stopped first, or, when none did, the last slice's."""
    from tools.journal_audit.reading import check_segment

    tasks = [
        (partition.path, partition.first_lsn, partition.start, partition.stop)
        for partition in plan(journal, slice_bytes=slice_bytes)
        if partition.path is not None
    ]
    if not tasks:
        return []
    checks = (
        spark.sparkContext.parallelize(tasks, len(tasks)).map(lambda task: check_segment(*task)).collect()
    )
    by_segment: dict[int, SegmentCheck] = {}
    for check in checks:
        kept = by_segment.get(check["first_lsn"])
        if kept is None or _stops_sooner(check, kept):
            by_segment[check["first_lsn"]] = check
    return [by_segment[first_lsn] for first_lsn in sorted(by_segment)]


def _stops_sooner(check: SegmentCheck, other: SegmentCheck) -> bool:
    """Whether ``check`` tells more of its segment than ``other`` (slices of one): a problem sooner,
    or, with neither finding one, reading further (the later slice reads to the end)."""
    if check["problem"] is None:
        return other["problem"] is None and bool(check["next_lsn"] > other["next_lsn"])
    return other["problem"] is None or bool(check["offset"] < other["offset"])


def load_parquet(
    spark: SparkSession, path: str | os.PathLike[str], *, columns: Sequence[str] | None = None
) -> DataFrame:
    """An export of ``export_parquet``, as the same DataFrame the loader gives (columns, order, types)."""
    return spark.read.schema(SCHEMA).parquet(str(path)).select(*(columns or COLUMN_NAMES))


def is_parquet_export(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` looks like an ``export_parquet`` directory (``queue=…`` partitions)."""
    given = Path(path)
    return given.is_dir() and any(child.name.startswith("queue=") for child in given.iterdir())
