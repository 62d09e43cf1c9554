"""Settings of one broker process: where it listens, where it keeps data, and its request limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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
