"""The loader's fixed schema: one row per journal record (docs/audit.md lists it with its meaning).

The columns are the record's envelope (``lsn``, ``at``, ``queue``, ``type``), then one column per record
field that any record type has, named once even when several types carry it (``lease_id`` is the lease
of a ``claimed``, ``acked``, ``nacked`` … record alike), null where the record's type has no such field.
What has no column of its own (a config's retry backoff, say) is in ``config`` (queue records) or in
``raw``, the record's CBOR map as its frame holds it (except a push signing secret, blanked in both).

This module imports only pyspark's type classes, so the schema can be read without a Spark session.
"""

from __future__ import annotations

from typing import Final

from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

#: ``(name, type, nullable, meaning)`` of every column, in order (``nullable`` False: always set).
COLUMNS: Final[tuple[tuple[str, DataType, bool, str], ...]] = (
    ("lsn", LongType(), False, "log sequence number: unique, +1 from each record to the next"),
    ("at", TimestampType(), False, "when the command that produced the record was applied (UTC)"),
    ("queue", StringType(), False, "the queue the record belongs to"),
    ("type", StringType(), False, "record type: published, claimed, acked, … (docs/journal-format.md)"),
    ("message_id", StringType(), True, "the message's id (every per-message record)"),
    ("seq", LongType(), True, "published: the queue's publish order"),
    ("lease_id", StringType(), True, "the lease (one delivery): claimed, acked, nacked, deferred, …"),
    ("consumer", StringType(), True, "claimed: who the message was leased to"),
    ("attempt", IntegerType(), True, "claimed, dead_lettered: the message's attempt count then"),
    ("deadline", TimestampType(), True, "claimed, extended: when the lease ends"),
    ("delay", DoubleType(), True, "nacked: delay; deferred: retry_after (seconds until it is back)"),
    ("reason", StringType(), True, "nacked, deferred: the client's reason; dead_lettered: why"),
    ("refunded", BooleanType(), True, "released: the delivery was given back, not counted"),
    ("to_queue", StringType(), True, "dead_lettered, expired, redriven: where the message went"),
    ("payload_size", IntegerType(), True, "published, replaced: bytes of the stored payload"),
    ("binary", BooleanType(), True, "published, replaced: the payload was sent as bytes, not JSON"),
    ("headers", MapType(StringType(), StringType()), True, "published, replaced: message headers"),
    ("key", StringType(), True, "published: the idempotency key"),
    ("priority", IntegerType(), True, "published: priority"),
    ("published_at", TimestampType(), True, "published: publish time (for a moved message, when it arrived)"),
    ("available_at", TimestampType(), True, "published: when it becomes claimable (null: at once)"),
    ("origin_queue", StringType(), True, "published by a move (dead letter, expiry, redrive): from"),
    ("origin_id", StringType(), True, "published by a move: the message's id in origin_queue"),
    ("count", LongType(), True, "purged: how many ready and delayed messages the purge removed"),
    ("max_attempts", IntegerType(), True, "queue_created, queue_updated: max_attempts (0: unlimited)"),
    ("config", StringType(), True, "queue_created, queue_updated: the whole config as JSON"),
    ("id_prefix", StringType(), True, "queue_created: the prefix of the queue's message ids"),
    ("segment", StringType(), False, "the segment file the record was read from"),
    ("day", DateType(), False, "the UTC day of at (the Parquet export's partition, with queue)"),
    ("raw", BinaryType(), False, "the record's CBOR map as in its frame (a push secret blanked)"),
)

COLUMN_NAMES: Final = tuple(name for name, _, _, _ in COLUMNS)

#: Every field is nullable as Spark sees it, even those always set (``nullable`` False above, and in
#: docs/audit.md): Spark reads every Parquet column back as nullable, and the export must give the same
#: DataFrame as the loader.
SCHEMA: Final = StructType([StructField(name, kind, True) for name, kind, _, _ in COLUMNS])

#: The columns the Parquet export partitions by (directories ``queue=…/day=…``).
PARTITION_COLUMNS: Final = ("queue", "day")


def describe() -> str:
    """The schema as a text table, for ``python -m tools.journal_audit schema``."""
    width = max(len(name) for name in COLUMN_NAMES)
    lines = []
    for name, kind, nullable, meaning in COLUMNS:
        flag = "" if nullable else "not null"
        lines.append(f"{name:<{width}}  {kind.simpleString():<18} {flag:<9} {meaning}")
    return "\n".join(lines)
