"""Settings of one broker process: where it listens, where it keeps data, and its request limits."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from broker.storage.retention import Retention
from broker.storage.segments import DEFAULT_MAX_SEGMENT_BYTES

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_DATA_DIR = Path("snapshots")


@dataclass(frozen=True, slots=True)
class Limits:
    """Request limits of the contract (§2); a request beyond one gets 400 or 413, never a 500."""

    max_payload_bytes: int = 1024 * 1024
    max_headers: int = 64
    max_headers_bytes: int = 8 * 1024
    max_batch: int = 1000
    max_body_bytes: int = 16 * 1024 * 1024
    max_key_length: int = 1024
    max_consumer_length: int = 256
    max_reason_length: int = 4096


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    data_dir: Path = DEFAULT_DATA_DIR
    limits: Limits = field(default_factory=Limits)
    #: Keep the journal in memory and nothing on disk (tests; a broker that may forget everything).
    in_memory: bool = False
    #: Seconds between snapshots (taken only when the journal moved on), besides one at clean shutdown.
    snapshot_interval: float = 60.0
    #: A snapshot is also taken once the journal has grown by this many bytes since the last one, which
    #: bounds what a restart replays (64 MiB took ~2.5 s on the benchmark machine). None: by time only.
    snapshot_bytes: int | None = 64 << 20
    #: How much of the journal to keep for audits once snapshots cover it (storage/retention.py).
    journal_retention: Retention = field(default_factory=Retention)
    #: A journal segment file is closed for a new one past this size: the unit retention deletes.
    journal_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES


_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``64MiB``, ``4G``, ``512k`` (units are powers of 1024). ``ValueError`` else."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"a size is a number of bytes with an optional unit (k, M, G, T), not {text!r}")
    unit = (match.group(2) or "").lower().rstrip("b").rstrip("i")
    return int(match.group(1)) * _SIZE_UNITS[unit]
