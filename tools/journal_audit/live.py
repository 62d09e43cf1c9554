"""What the broker would recover from a data directory: the newest valid snapshot plus the journal
replayed after it, computed here the way ``broker serve`` does at start (``broker.storage.snapshots``,
``broker.storage.recovery``), but read-only: nothing is locked, repaired or written.

The audit compares it with the journal: a message the journal shows published and never ended must be
in it (else it was lost), and one the journal shows ended must not be (else it came back). The replay
after the snapshot adds exactly the messages published after it, so what this really checks is that the
snapshot holds every message open at its lsn and none that had ended. Without a snapshot, recovery is a
replay of the whole journal: its live messages are by construction the journal's open ones, so the
comparison could find nothing and is not made (see docs/audit.md, "What 'live' means").

A Parquet export has no snapshots, so ``export`` writes the recovered state beside the Parquet files
(``ExportedState``), and the audit of the export compares with that. Nor has it the segment files, so
the same file holds where reading each segment stopped, for the audit to tell damage from a torn tail.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from broker.storage.journal import JournalEntry
from tools.journal_audit.reading import SegmentCheck

#: The file a Parquet export holds beside its partitions: what the audit needs of the data directory
#: that is not in the records (Spark's Parquet reader skips names that start with ``_``).
EXPORTED_STATE: Final = "_recovered_state.json"
#: 2 added ``segment_checks``; format 1 files still read, without them.
_EXPORTED_FORMAT: Final = 2
_READ_FORMATS: Final = (1, 2)


@dataclass(slots=True)
class LiveState:
    """The recovered state's message ids, and where it came from."""

    snapshot_id: str | None
    snapshot_lsn: int
    #: The last lsn replayed: the audit reads the journal up to here, so that both see the same records
    #: even while a broker keeps writing.
    last_lsn: int
    #: ``(queue, message id)`` of every live message.
    messages: list[tuple[str, str]] = field(default_factory=list)
    skipped_snapshots: list[str] = field(default_factory=list)
    #: Recovery itself failed: ``(lsn, what)`` of the record it could not apply; ``messages`` is then
    #: empty and the comparison is not made.
    failure: tuple[int, str] | None = None


#: How a refusal of the broker's start is worded in ``LiveState.failure``.
_REFUSED = "the broker refuses to start"


def recovered_state(data_dir: Path, journal: Path) -> LiveState | None:
    """The state a broker starting on ``data_dir`` would recover; None when it has no valid snapshot and
    would start from the journal alone. One whose start the broker refuses (a journal that does not go
    on from the snapshot, or a snapshot it cannot read that covers lsns nothing else reaches) has its
    ``failure`` set, as one whose replay fails."""
    from broker.storage.recovery import replay
    from broker.storage.segments import JournalGap, read_entries, scan
    from broker.storage.snapshots import (
        SNAPSHOTS_DIR,
        check_journal_follows,
        check_pages,
        check_snapshots_reached,
        environment,
        newest_valid,
    )

    if not (data_dir / SNAPSHOTS_DIR).exists():
        return None
    check_pages(data_dir)  # LMDB aborts the process on some damaged pages
    with environment(data_dir, readonly=True):  # newest_valid reads through it: the audit writes nothing
        base, skipped = newest_valid(data_dir)
        try:
            check_journal_follows(journal, base, skipped, f"{_REFUSED}.")
            if base is None and skipped:  # from the journal alone, which must reach what they covered
                check_snapshots_reached(data_dir, scan(journal).last_lsn, skipped, f"{_REFUSED}.")
        except JournalGap as gap:
            lsn = 0 if base is None else base.last_lsn
            snapshot_id = None if base is None else f"{lsn:020d}"
            return LiveState(snapshot_id, lsn, lsn, skipped_snapshots=skipped, failure=(lsn + 1, str(gap)))
    if base is None:
        return None
    snapshot_lsn = base.last_lsn
    state = LiveState(f"{snapshot_lsn:020d}", snapshot_lsn, snapshot_lsn, skipped_snapshots=skipped)
    last: list[JournalEntry] = []

    def tracked(entries: Iterator[JournalEntry]) -> Iterator[JournalEntry]:
        for entry in entries:
            last[:] = [entry]
            yield entry

    try:
        recovered = replay(tracked(read_entries(journal, after_lsn=snapshot_lsn)), base)
    except Exception as error:  # a record that does not apply: what the broker would meet at start
        where = last[0].lsn if last else snapshot_lsn
        state.failure = (where, f"{type(error).__name__}: {error}")
        state.last_lsn = where
        return state
    state.last_lsn = max(recovered.last_lsn, snapshot_lsn)
    try:
        with environment(data_dir, readonly=True):
            check_snapshots_reached(data_dir, state.last_lsn, skipped, f"{_REFUSED}.")
    except JournalGap as gap:
        state.failure = (state.last_lsn + 1, str(gap))
        return state
    for name, core in recovered.queues.items():
        state.messages.extend((name, message_id) for message_id in core.message_ids())
    return state


@dataclass(slots=True)
class ExportedState:
    """What ``export`` writes beside the Parquet files (``EXPORTED_STATE``), so that auditing the export
    checks what auditing the data directory checks: ``live`` is the recovered state, None when the
    export was made from a journal alone, with ``--journal-only``, or without a valid snapshot;
    ``segment_checks``, ``reading.check_segment`` of each segment (None: a format 1 file)."""

    from_data_directory: bool
    live: LiveState | None
    segment_checks: list[SegmentCheck] | None = None


def write_exported_state(directory: str | os.PathLike[str], exported: ExportedState) -> Path:
    live = exported.live
    document: dict[str, Any] = {
        "format": _EXPORTED_FORMAT,
        "from_data_directory": exported.from_data_directory,
        "segment_checks": exported.segment_checks,
        "live": None
        if live is None
        else {
            "snapshot_id": live.snapshot_id,
            "snapshot_lsn": live.snapshot_lsn,
            "last_lsn": live.last_lsn,
            "skipped_snapshots": live.skipped_snapshots,
            "failure": live.failure,
            "messages": live.messages,
        },
    }
    target = Path(directory) / EXPORTED_STATE
    target.write_text(json.dumps(document, separators=(",", ":")) + "\n")
    return target


def read_exported_state(directory: str | os.PathLike[str]) -> ExportedState | None:
    """The state an export holds; None for an export without one (made before the file existed)."""
    target = Path(directory) / EXPORTED_STATE
    if not target.is_file():
        return None
    document = json.loads(target.read_text())
    if document.get("format") not in _READ_FORMATS:
        raise ValueError(
            f"{target} is of format {document.get('format')!r}; this tool reads formats "
            f"{', '.join(map(str, _READ_FORMATS))}"
        )
    checks = document.get("segment_checks")
    live = document["live"]
    if live is None:
        return ExportedState(bool(document["from_data_directory"]), None, checks)
    failure = live["failure"]
    state = LiveState(
        live["snapshot_id"],
        live["snapshot_lsn"],
        live["last_lsn"],
        messages=[(queue, message_id) for queue, message_id in live["messages"]],
        skipped_snapshots=list(live["skipped_snapshots"]),
        failure=None if failure is None else (failure[0], failure[1]),
    )
    return ExportedState(bool(document["from_data_directory"]), state, checks)
