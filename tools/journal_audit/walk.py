"""One message's life, read from its journal records: the §9 invariants checked on it, and what the
reports need (when it was published, first claimed, acked; how it ended; its attempts).

Pure Python and Spark-free: the audit runs ``walk`` in Spark's workers (``mapInArrow`` over the records
grouped by message and sorted by lsn), and the tests call it directly.

The rules follow the queue core (``broker/core/queue.py``), which the journal records:

* A lease (``lease_id``) is the one that *settles* from its ``claimed`` record until the message is
  settled under it (``acked``, ``nacked``, ``deferred``, ``released``) or claimed again. A noticed
  expiry (``lease_expired``) does not end it: a late ack still lands, and ``extended`` takes it back.
  Any settle, extend or expiry naming another lease is a settle under a stale lease.
* A ``claimed`` record while the previous lease still settles and its deadline (as last set by
  ``claimed`` or ``extended``) is after the claim's time means two unexpired leases overlapped.
* A ``purged`` record (which lists no ids) removes the queue's ready and delayed messages: those whose
  last record left them out of flight. The core's purge does not notice expiries first, so a message
  whose lease ran out unnoticed is still in flight and stays. ``queue_deleted`` removes every message.
* ``dead_lettered`` with reason ``max_attempts`` must come at an attempt at or past the queue's
  ``max_attempts`` then in force (and never while it is 0, unlimited); ``rejected`` (a nack with
  ``retryable: false``) may come at any attempt. A message whose TTL runs out gets an ``expired``
  record, not ``dead_lettered``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

# Violation kinds. Each is explained, with what to do about it, in docs/audit.md.
LOST: Final = "lost"
ENDED_BUT_LIVE: Final = "ended_but_live"
DOUBLE_ACK: Final = "double_ack"
STALE_LEASE: Final = "stale_lease"
OVERLAPPING_LEASES: Final = "overlapping_leases"
EARLY_DEAD_LETTER: Final = "early_dead_letter"
AFTER_END: Final = "record_after_end"
UNKNOWN_MESSAGE: Final = "unknown_message"
DUPLICATE_PUBLISH: Final = "duplicate_publish"
PURGE_COUNT: Final = "purge_count"
JOURNAL_GAP: Final = "journal_gap"
JOURNAL_DAMAGE: Final = "journal_damage"
UNRECOVERABLE: Final = "unrecoverable"

#: How a message ended (``end`` of a summary); None while it is open.
ENDS: Final = ("acked", "dead_lettered", "expired", "redriven", "deleted", "purged", "queue_deleted")
#: Dead-letter reasons that need no attempt count. (A message whose TTL runs out gets an ``expired``
#: record, never ``dead_lettered``: ``expired`` is only the reason its dead-letter copy's header gives.)
EARLY_REASONS: Final = frozenset({"rejected"})

_LEASE_SETTLES: Final = frozenset({"acked", "nacked", "deferred", "released"})


class Step(NamedTuple):
    """The columns of one record that the walk reads (times in microseconds since the epoch)."""

    lsn: int
    at_us: int
    type: str
    lease_id: str | None
    attempt: int | None
    deadline_us: int | None
    reason: str | None
    refunded: bool | None


@dataclass(slots=True)
class QueueHistory:
    """What happened to a queue as a whole, in lsn order: its max_attempts over time, its purges and
    deletions. Small (one entry per config change, purge or deletion), so every worker gets all of it."""

    config_lsns: list[int] = field(default_factory=list)
    max_attempts: list[int] = field(default_factory=list)
    event_lsns: list[int] = field(default_factory=list)
    event_kinds: list[str] = field(default_factory=list)
    event_at_us: list[int] = field(default_factory=list)

    def max_attempts_at(self, lsn: int) -> int | None:
        """The queue's max_attempts in force at ``lsn``; None when no config record comes before it."""
        index = bisect.bisect_left(self.config_lsns, lsn)
        return self.max_attempts[index - 1] if index else None


def histories(rows: Sequence[tuple[int, int, str, str, int | None]]) -> dict[str, QueueHistory]:
    """Queue histories from ``(lsn, at_us, queue, type, max_attempts)`` of the queue-level records."""
    found: dict[str, QueueHistory] = {}
    for lsn, at_us, queue, kind, max_attempts in sorted(rows):
        history = found.setdefault(queue, QueueHistory())
        if kind in ("queue_created", "queue_updated"):
            history.config_lsns.append(lsn)
            history.max_attempts.append(max_attempts or 0)
        elif kind in ("purged", "queue_deleted"):
            history.event_lsns.append(lsn)
            history.event_kinds.append(kind)
            history.event_at_us.append(at_us)
    return found


@dataclass(slots=True)
class Summary:
    """One message as the audit sees it."""

    queue: str
    message_id: str
    #: Its ``published`` record is in the journal (else it was published before the journal's start).
    known: bool = False
    published_lsn: int | None = None
    published_us: int | None = None
    first_claim_us: int | None = None
    acked_us: int | None = None
    end: str | None = None
    end_lsn: int | None = None
    #: The message's attempt count at its end (or now): deliveries less refunded ones.
    attempts: int = 0
    deliveries: int = 0
    dead_letter_reason: str | None = None
    #: The lsn of the ``purged`` record that removed it.
    purged_by: int | None = None
    #: ``(kind, lsn, lease_id, detail)``.
    violations: list[tuple[str, int, str | None, str]] = field(default_factory=list)


def walk(
    queue: str,
    message_id: str,
    steps: Sequence[Step],
    history: QueueHistory | None,
    complete: bool,
    unread_from: Sequence[int] = (),
) -> Summary:
    """Follow one message through its records (in lsn order). ``complete``: the journal starts at lsn 1,
    so a message without a ``published`` record was never published. ``unread_from`` (sorted): the
    first lsn of each run of records the journal should hold but that could not be read (damage, a
    gap). Whatever such a run did to the message (claims, settles, refunds) is unknown, so past one its
    lease and attempts are taken up again from its next records, as for a message published before the
    journal."""
    summary = Summary(queue, message_id)
    problems = summary.violations
    lease: str | None = None  # the newest lease seen
    issued: set[str] = set()  # every lease the journal shows claimed for it
    lease_settles = False
    deadline: int | None = None
    in_flight = False
    attempt_known = False
    # Every record of the message since its ``published`` is in hand (none lies in unread records).
    seen_whole = False
    acks = 0
    events = history if history is not None and history.event_lsns else None
    next_event = bisect.bisect_right(events.event_lsns, steps[0].lsn) if events is not None else 0
    # Runs of unread records before the first step do not matter here (``complete`` covers them).
    next_unread = bisect.bisect_right(unread_from, steps[0].lsn) if unread_from else 0
    runs = len(unread_from)

    def queue_events_until(lsn: int | None, *, purges: bool = True) -> None:
        """Apply the queue's purges and deletion before ``lsn`` (all remaining ones when None);
        ``purges`` false: its deletion only (whether a purge took the message is not known)."""
        nonlocal next_event
        assert events is not None
        while next_event < len(events.event_lsns) and summary.end is None:
            event_lsn = events.event_lsns[next_event]
            if lsn is not None and event_lsn >= lsn:
                return
            kind = events.event_kinds[next_event]
            if kind == "queue_deleted" or (purges and not in_flight):
                summary.end, summary.end_lsn = ("purged" if kind == "purged" else "queue_deleted"), event_lsn
                if kind == "purged":
                    summary.purged_by = event_lsn
            next_event += 1

    def settles(step: Step) -> bool:
        """Whether ``step.lease_id`` is the lease that settles the message now."""
        if lease is None:
            return not (seen_whole or attempt_known)  # claimed in records not in hand: unknown
        return step.lease_id == lease and lease_settles

    def stale(step: Step) -> None:
        if lease is None:
            why = "the message was never claimed"
        elif step.lease_id != lease and step.lease_id not in issued and seen_whole:
            why = f"no claim issued that lease (its lease is {lease})"
        elif step.lease_id != lease:
            why = f"the message was claimed again since, under {lease}"
        else:
            why = "that lease was already settled"
        problems.append(
            (STALE_LEASE, step.lsn, step.lease_id, f"{step.type} under lease {step.lease_id}, but {why}")
        )

    if steps[0].type != "published" and complete:
        problems.append(
            (
                UNKNOWN_MESSAGE,
                steps[0].lsn,
                steps[0].lease_id,
                f"{steps[0].type} for a message never published (the journal starts at lsn 1)",
            )
        )
    for index, step in enumerate(steps):
        if next_unread < runs and unread_from[next_unread] < step.lsn:
            # Records of this message may lie in the unread run(s) before this step: forget what they
            # could have changed. (A step read never lies inside such a run: one lsn per run will do.)
            if events is not None:
                queue_events_until(unread_from[next_unread])  # before the run, as the records show
            while next_unread < runs and unread_from[next_unread] < step.lsn:
                next_unread += 1
            lease, lease_settles, deadline = None, False, None
            issued.clear()
            attempt_known = seen_whole = in_flight = False
            # Whether it was in flight is unknown until this step: a purge since may have left it, as
            # it leaves a message in flight, so none is applied (a deletion of its queue still is).
            if events is not None:
                queue_events_until(step.lsn, purges=False)
        if events is not None:
            queue_events_until(step.lsn)
        kind = step.type
        if kind == "acked" and acks:
            problems.append((DOUBLE_ACK, step.lsn, step.lease_id, f"acked again (lease {step.lease_id})"))
            continue
        if summary.end is not None:
            problems.append(
                (AFTER_END, step.lsn, step.lease_id, f"{kind} after the message ended ({summary.end})")
            )
            continue
        if kind == "published":
            if index:
                problems.append((DUPLICATE_PUBLISH, step.lsn, None, "published again under the same id"))
                continue
            summary.known = seen_whole = True
            summary.published_lsn, summary.published_us = step.lsn, step.at_us
        elif kind == "claimed":
            if lease is not None and lease_settles and deadline is not None and step.at_us < deadline:
                problems.append(
                    (
                        OVERLAPPING_LEASES,
                        step.lsn,
                        step.lease_id,
                        f"claimed under {step.lease_id} while lease {lease} still held it "
                        f"for {(deadline - step.at_us) / 1e6:.3f} s",
                    )
                )
            lease, lease_settles, deadline, in_flight = step.lease_id, True, step.deadline_us, True
            if step.lease_id is not None:  # always, from the journal: a ``claimed`` record names its lease
                issued.add(step.lease_id)
            summary.attempts = step.attempt or 0
            attempt_known = True
            summary.deliveries += 1
            if summary.first_claim_us is None:
                summary.first_claim_us = step.at_us
        elif kind in _LEASE_SETTLES:
            if not settles(step):
                stale(step)
            if lease is None:  # claimed before the journal starts
                lease = step.lease_id
            lease_settles = False
            in_flight = False
            if kind == "acked":
                acks += 1
                summary.acked_us = step.at_us
                summary.end, summary.end_lsn = "acked", step.lsn
            elif kind == "deferred" or (kind == "released" and step.refunded):
                summary.attempts -= 1
        elif kind == "extended":
            if not settles(step):
                stale(step)
            elif lease is None:
                lease, lease_settles = step.lease_id, True
            deadline, in_flight = step.deadline_us, True
        elif kind == "lease_expired":
            if not settles(step):
                stale(step)
            elif lease is None:
                lease, lease_settles = step.lease_id, True
            in_flight = False
        elif kind == "dead_lettered":
            reason = step.reason or ""
            summary.dead_letter_reason = reason
            summary.end, summary.end_lsn = "dead_lettered", step.lsn
            used = summary.attempts if attempt_known else (step.attempt or 0)
            why = _early_dead_letter(reason, used, history.max_attempts_at(step.lsn) if history else None)
            if why is not None:
                problems.append((EARLY_DEAD_LETTER, step.lsn, step.lease_id, why))
            summary.attempts = used
        elif kind in ("expired", "redriven", "deleted"):
            summary.end, summary.end_lsn = kind, step.lsn
        elif kind == "replaced":
            # A new payload: the lease of an earlier delivery (one that expired unnoticed, a replace of
            # a message in flight being refused) settles nothing more, as the broker skips it.
            lease_settles = False
    if events is not None:
        queue_events_until(None)
    return summary


def _early_dead_letter(reason: str, used: int, limit: int | None) -> str | None:
    """Why a dead letter for ``reason`` after ``used`` attempts came too early, if it did (``limit``:
    the queue's max_attempts then, None when unknown)."""
    if reason in EARLY_REASONS:
        return None
    if reason != "max_attempts":
        return f"dead-lettered for {reason!r}, not a reason the broker gives (max_attempts, rejected)"
    if limit == 0:
        return "dead-lettered for max_attempts, but the queue's max_attempts is 0 (unlimited)"
    if limit is not None and used < limit:
        return (
            f"dead-lettered for max_attempts after {used} attempt(s), but the queue's max_attempts is {limit}"
        )
    return None


def group_steps(rows: Iterator[tuple[Any, ...]]) -> Iterator[tuple[str, str, list[Step]]]:
    """``(queue, message_id, steps)`` from rows ``(message_id, queue, *Step)`` sorted by message id and
    lsn (one message's rows may run across batches: the caller passes one stream)."""
    current: str | None = None
    queue = ""
    steps: list[Step] = []
    for row in rows:
        message_id = row[0]
        if message_id != current:
            if current is not None:
                yield queue, current, steps
            current, queue, steps = message_id, row[1], []
        steps.append(Step(*row[2:]))
    if current is not None:
        yield queue, current, steps
