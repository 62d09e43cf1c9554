"""What the broker would recover from a data directory: the newest valid snapshot plus the journal
replayed after it, computed here the way ``broker serve`` does at start (``broker.storage.snapshots``,
``broker.storage.recovery``), but read-only: nothing is locked, repaired or written.

The audit compares it with the journal: a message the journal shows published and never ended must be
in it (else it was lost), and one the journal shows ended must not be (else it came back). The replay
after the snapshot adds exactly the messages published after it, so what this really checks is that the
snapshot holds every message open at its lsn and none that had ended. Without a snapshot, recovery is a
replay of the whole journal: its live messages are by construction the journal's open ones, so the
comparison could find nothing and is not made (see docs/audit.md, "What 'live' means").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from broker.storage.journal import JournalEntry


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


def recovered_state(data_dir: Path, journal: Path) -> LiveState | None:
    """The state a broker starting on ``data_dir`` would recover; None when it has no valid snapshot."""
    from broker.storage.recovery import replay
    from broker.storage.segments import read_entries
    from broker.storage.snapshots import newest_valid

    base, skipped = newest_valid(data_dir)
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
    for name, core in recovered.queues.items():
        state.messages.extend((name, message_id) for message_id in core.message_ids())
    return state
