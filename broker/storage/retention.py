"""Journal retention: which old segments may go once snapshots cover them, by size or by age.

The journal is kept after snapshots so that audits (tools/) and point-in-time restores can read the
history. A segment may be deleted only when every record in it is at or below the lsn of the *oldest*
snapshot kept: every kept snapshot then still has the journal after it, so recovery can fall back to
any of them and ``broker snapshot restore --until`` can reach any time since the oldest. Among those,
the oldest segments go first while the journal is larger than ``max_bytes`` or while they are older
than ``max_age`` (by the time they were last written). ``None`` keeps the journal on that count.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from broker.storage.segments import delete_before, segments

DEFAULT_MAX_BYTES = 4 << 30  # 4 GiB
DEFAULT_MAX_AGE = 7 * 86400.0  # a week


@dataclass(frozen=True, slots=True)
class Retention:
    max_bytes: int | None = DEFAULT_MAX_BYTES
    max_age: float | None = DEFAULT_MAX_AGE


class SegmentFacts(NamedTuple):
    first_lsn: int
    size: int
    written_at: float


def prunable_until(listed: list[SegmentFacts], covered_lsn: int, retention: Retention, now: float) -> int:
    """The highest lsn whose segment (and every older one) may be deleted; 0 for none. ``listed`` is
    oldest first; the newest segment, being written, is never deleted."""
    total = sum(segment.size for segment in listed)
    until = 0
    for segment, successor in itertools.pairwise(listed):
        last_lsn = successor.first_lsn - 1
        if last_lsn > covered_lsn:
            break
        too_big = retention.max_bytes is not None and total > retention.max_bytes
        too_old = retention.max_age is not None and now - segment.written_at > retention.max_age
        if not (too_big or too_old):
            break  # the segments after it are newer, and the journal is within its size
        total -= segment.size
        until = last_lsn
    return until


def prune(journal_dir: Path, covered_lsn: int, retention: Retention, now: float) -> list[Path]:
    """Delete the segments ``retention`` lets go (see the module docstring); the paths deleted."""
    listed = []
    for segment in segments(journal_dir):
        try:
            written_at = os.stat(segment.path).st_mtime
        except FileNotFoundError:  # gone meanwhile (a restore moved the journal aside)
            return []
        listed.append(SegmentFacts(segment.first_lsn, segment.size, written_at))
    until = prunable_until(listed, covered_lsn, retention, now)
    return delete_before(journal_dir, until) if until else []
