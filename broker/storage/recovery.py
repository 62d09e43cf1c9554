"""Recovery: rebuild every queue from the journal (after the newest valid snapshot, when there is one).

Pure and synchronous (it runs in a worker thread at start, and in the offline ``broker snapshot`` tools):
it reads records and feeds them to ``QueueCore.restore``; it never decides anything the live broker did
not decide and journal first.

Moves between queues are two records in two queues: the origin's ``dead_lettered`` (``expired``,
``redriven``) and the destination's ``published`` with ``origin`` set. A crash between them leaves the
first without the second; recovery finds those and hands them back to be sent again, so a message is
never lost on its way to a dead-letter queue. Unless that queue is deleted first: the copies on their way
to a queue are deleted with it, live and here alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from broker.core import FinishedHistory, NewMessage, QueueCore
from broker.core.config import DEFAULT_HISTORY
from broker.core.records import Published, QueueCreated, QueueDeleted
from broker.storage.journal import JournalEntry


@dataclass(slots=True)
class Recovered:
    """The queues as the journal left them, and what recovery read."""

    queues: dict[str, QueueCore] = field(default_factory=dict)
    last_lsn: int = 0
    last_at: float = 0.0
    records: int = 0
    #: Copies that left a queue but never arrived: ``(destination, message)``, to send again.
    unsent: list[tuple[str, NewMessage]] = field(default_factory=list)
    #: Records of a queue that did not exist then, skipped: until 2026-11-23 (``delete_nowait``) a
    #: broker applied commands queued for a queue after journaling its deletion.
    strays: int = 0


def replay(
    entries: Iterable[JournalEntry],
    recovered: Recovered | None = None,
    *,
    history: FinishedHistory = DEFAULT_HISTORY,
) -> Recovered:
    """Apply ``entries`` (in lsn order) on top of ``recovered`` (a snapshot's queues, or nothing);
    queues created on the way keep ``history``'s finished messages."""
    state = recovered if recovered is not None else Recovered()
    queues = state.queues
    in_transit: dict[tuple[str, str], tuple[str, NewMessage]] = {
        message.origin: (destination, message) for destination, message in state.unsent if message.origin
    }
    for entry in entries:
        record = entry.record
        state.last_lsn = entry.lsn
        state.last_at = entry.at
        state.records += 1
        match record:
            case QueueCreated(config, id_prefix):
                queues[entry.queue] = QueueCore(entry.queue, config, id_prefix, history=history)
                continue
            case QueueDeleted():
                queues.pop(entry.queue, None)
                # Copies on their way to it went with it, as they do live: a ``Receive`` still in its
                # inbox is dropped with the queue (``QueueActor._close``), never sent to a new one.
                for origin, (destination, _) in list(in_transit.items()):
                    if destination == entry.queue:
                        del in_transit[origin]
                continue
            case Published(origin=origin) if origin is not None:
                in_transit.pop(origin, None)
        core = queues.get(entry.queue)
        if core is None:
            state.strays += 1
            continue
        core.restore(record, entry.at)
        if core.outbox:
            for destination, message in core.take_outbox():
                assert message.origin is not None
                in_transit[message.origin] = (destination, message)
    state.unsent = list(in_transit.values())
    return state
