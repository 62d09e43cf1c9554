"""The queue: a pure, synchronous state machine.

Theory of operation
-------------------
A ``QueueCore`` owns one queue's messages. Every public method takes ``now`` (seconds since the Unix
epoch, as a float) and returns what it answers plus the list of records it produced, in order; it never
awaits, sleeps, logs, reads a clock or touches a disk. The actor around it supplies the clock and sends
the records to the journal.

Where a message sits, by state:

* ``delayed``: in ``_delayed``, a heap on the time it becomes claimable (publish delay, nack delay,
  defer).
* ``ready``: in ``_reclaimed`` (a heap on priority then seq, for messages that were delivered before:
  expired leases, elapsed nack delays) or in ``_fresh`` (never delivered; one lane per priority). Claims
  drain ``_reclaimed`` first.
* ``in_flight``: in ``_lease_deadlines``, mostly ordered by deadline.

``_leases`` maps every lease id that still settles to its message. Lease expiry is lazy: ``_advance`` runs
before a claim and a stats read and moves what came due; a noticed expiry puts the message on the reclaim
heap but leaves its lease in ``_leases`` until the message is claimed again, so a late ack still lands. A
lease whose delivery had not left the broker when it ran out (``undelivered``: a push stream still held
it, unwritten) is released instead, its attempt refunded and its lease gone. Entries in the heaps and
lanes are never searched for and removed: a message's ``ticket`` changes whenever it moves, which turns
its old entries stale, and stale entries are skipped when they surface, or dropped all at once when they
pile up (``_drop_stale_entries``, and the lease deadlines' compaction): entries of messages that left
unclaimed might never surface, and would keep those messages in memory.

Policies (§3) live here too, each costing nothing while it is off:

* ``max_attempts`` / ``dead_letter``: a message that has used its attempts leaves (nack, release or a
  noticed lease expiry) for the dead-letter queue instead of coming back. The core cannot reach another
  queue: it appends the copy to ``outbox``, which the actor hands on (``Receive`` at the other end).
* ``message_ttl``: ``_ttl_order`` holds live messages in publish order (so publish time order) while a
  TTL is set; ``_advance`` expires from its front.
* ``rate_limit``: ``_recent`` counts deliveries per claim in a sliding window; a claim gets at most what
  the window has left, and is told when more frees up (``retry_after``). The window outlives a restart:
  snapshots keep it, and replayed ``claimed`` records count in it.
* ``claim_window``: the actor holds claims for the window and hands them over together;
  ``claim_cohort`` divides what is ready across them in proportion to what each asked for.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import operator
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

from broker.core import commands
from broker.core.config import DEFAULT_HISTORY, FinishedHistory, QueueConfig
from broker.core.model import (
    ACKED,
    CONFLICT,
    CREATED,
    DELAYED,
    DUPLICATE,
    IN_FLIGHT,
    LIVE_STATES,
    READY,
    REDRIVEN,
    REPLACED,
    TRANSITIONS,
    ClaimOutcome,
    ConfigChange,
    DeadLetterLookup,
    DeadLetterPage,
    Delivery,
    DeliveryLookup,
    Message,
    MessageView,
    NewMessage,
    PublishedRef,
    QueueStats,
    RedriveOutcome,
    SettleOutcome,
    State,
    move,
)
from broker.core.records import (
    Acked,
    Claimed,
    DeadLettered,
    Deferred,
    Deleted,
    Expired,
    Extended,
    HistoryOmitted,
    LeaseExpired,
    Nacked,
    Published,
    Purged,
    QueueUpdated,
    Record,
    Redriven,
    Released,
    Replaced,
)
from broker.core.structures import Entry, MostlyOrderedQueue, ReadyLanes
from broker.errors import IllegalTransition, MessageNotFound, QueueFull, quoted_value

#: The provenance headers a dead-lettered message gains (§6). Redrive removes all but the last.
DEAD_LETTER_FROM = "x-dead-letter-from"
DEAD_LETTER_REASON = "x-dead-letter-reason"
DEAD_LETTER_ATTEMPTS = "x-dead-letter-attempts"
ORIGINAL_ID = "x-original-id"

#: A message on its way to another queue: ``(queue name, message)``.
Transfer = tuple[str, NewMessage]

#: The most entries a message's history keeps (get-one shows them, snapshots store them). A message
#: delivered again and again (a poison message without ``max_attempts``, a consumer that defers it
#: forever) would otherwise grow it, its get-one answer and its snapshot without bound. Past it, the
#: oldest entries after the first are dropped, ``HISTORY_TRIM`` at once (so the hot paths pay a length
#: check, and a slice delete once in ``HISTORY_TRIM`` appends), and counted by a ``HistoryOmitted``
#: entry second in the history. The journal keeps every entry (docs/audit.md).
MAX_HISTORY = 1000
HISTORY_TRIM = 100


def _trim_history(history: list[tuple[float, Any]]) -> None:
    """Drop the ``HISTORY_TRIM`` oldest entries of ``history`` after its first and count them in its
    ``HistoryOmitted`` entry, made on the first trim with the time of the first entry it drops. That
    entry is second, or third when a replace put the ``Published`` record of a plain publish before
    the first (``_with_published``): such a history keeps the publish and the entry after it, as one
    whose publish is rebuilt for get-one does, whether the replace came before the first trim or
    after. Replaying the journal appends the same entries, so it trims the same way: a restored
    history equals the live one."""
    for index in (1, 2):
        at, note = history[index]
        if type(note) is HistoryOmitted:
            history[index] = (at, HistoryOmitted(note.count + HISTORY_TRIM))
            del history[index + 1 : index + 1 + HISTORY_TRIM]
            return
    first = history[0][1]
    plain = type(first) is Published and first.available_at is None and first.origin is None
    start = 2 if plain else 1  # a plain publish stored by a replace: the entry after it stays too
    history[start : start + HISTORY_TRIM] = [(history[start][0], HistoryOmitted(HISTORY_TRIM))]


def _back_since(message: Message) -> float:
    """When a delivered message that a snapshot shows ready became ready again (a snapshot keeps no
    ``ready_at``), as the live queue counts it: at the deadline of a lease that expired however late
    that was noticed, when a nack's or defer's delay ended, at a release; a replace changes nothing."""
    at: float
    for at, record in reversed(message.history or ()):
        match record:
            case Replaced() | HistoryOmitted():
                continue
            case LeaseExpired():
                return message.lease_deadline
            case Nacked(delay=delay) | Deferred(retry_after=delay):
                return at + float(delay)
            case _:
                return at
    return message.published_at


#: The fields of a message in a ``QueueImage``, in the order of its columns.
MESSAGE_FIELDS = (
    "id",
    "seq",
    "payload",
    "binary",
    "headers",
    "key",
    "priority",
    "published_at",
    "available_at",
    "state",
    "attempt",
    "deliveries",
    "lease_id",
    "lease_deadline",
    "consumer",
    "history",
)

#: Some messages field by field: ``columns[i][n]`` is field ``MESSAGE_FIELDS[i]`` of the n-th message.
Columns = Sequence[Sequence[Any]]

_STATES = {state.value: state for state in State}
#: The state table's ``purge`` move, looked up once for the live states it applies to (``_purge``).
_PURGED_FROM = {
    state: TRANSITIONS[state, "purge"] for state in LIVE_STATES if (state, "purge") in TRANSITIONS
}
_STATE = MESSAGE_FIELDS.index("state")
_PAYLOAD = MESSAGE_FIELDS.index("payload")
#: The columns of the fields a new ``Message`` leaves at their defaults, and their indexes.
_DEFAULTED = tuple(
    (name, MESSAGE_FIELDS.index(name))
    for name in ("attempt", "deliveries", "lease_deadline", "consumer", "history")
)
#: The columns ``_load_block`` files live messages by, besides what ``_messages_of`` reads.
_FILING_COLUMNS = operator.itemgetter(
    *(MESSAGE_FIELDS.index(name) for name in ("id", "seq", "priority", "deliveries", "lease_id"))
)


class QueueImage(NamedTuple):
    """One queue as a snapshot holds it (see ``QueueCore.dump``); plain values all through.

    The live messages come in blocks of ``Columns``: column by column, so that a snapshot can store
    them so (they decode faster, see snapshots.py) and ``load`` can make a block's messages with a few
    calls that loop in C rather than with Python statements per message."""

    name: str
    config: QueueConfig
    id_prefix: str
    next_seq: int
    counters: tuple[int, int, int, int, int, int, int]
    keys: list[tuple[str, str, int, float]]
    #: ``dump`` makes one block; ``load`` takes any number (a snapshot's chunks, decoded as it goes).
    messages: Iterable[Columns]
    #: The messages that already left and get-one still shows (``FinishedHistory``), oldest first;
    #: in blocks as ``messages``. Their ``lease_id`` is None: a finished message holds no lease.
    finished: Iterable[Columns] = ()
    #: The ``rate_limit`` window: ``(time, deliveries)``, oldest first.
    recent: Sequence[tuple[float, int]] = ()


class QueueCore:
    """One queue's state and every operation on it. See the module docstring."""

    def __init__(
        self,
        name: str,
        config: QueueConfig,
        id_prefix: str,
        *,
        history: FinishedHistory = DEFAULT_HISTORY,
    ) -> None:
        self.name = name
        self.config = config
        #: The start of every message id minted here; new at every start of the broker
        #: (``Registry.adopt``). A delivery's lease id is ``<message id>.<n>`` (its n-th) for a message
        #: minted under the current prefix, and ``<message id>.<id_prefix><n>`` for one recovered from
        #: before: a claim answers before its ``claimed`` record is fsynced, so after a crash a
        #: recovered message's n-th delivery may already have been handed out, and a lease id must
        #: never name two deliveries (its first holder's late ack would settle the second's).
        self.id_prefix = id_prefix
        self._history = history
        self._next_seq = 1
        self._tickets = itertools.count(1)
        self._messages: dict[str, Message] = {}  # live messages, in publish (seq) order
        self._fresh = ReadyLanes()
        self._reclaimed: list[tuple[int, int, int, Message]] = []  # (-priority, seq, ticket, message)
        self._delayed: list[Entry] = []
        self._lease_deadlines = MostlyOrderedQueue()
        self._leases: dict[str, Message] = {}
        self._keys: dict[str, tuple[str, int, float]] = {}  # key → (id, seq, remembered until)
        self._key_expiry: list[tuple[float, str]] = []  # heap: dedup_window may change
        self._finished: OrderedDict[str, Message] = OrderedDict()  # left the queue; for get-one
        self._finished_bytes = 0  # their payloads'
        #: Finished messages older than those, which get-one shows without their payload: it was let go
        #: past ``FinishedHistory.payload_bytes`` (``_let_go``). Oldest first.
        self._finished_bare: OrderedDict[str, Message] = OrderedDict()
        self._counts = dict.fromkeys(State, 0)
        self._published_total = 0
        self._acked_total = 0
        self._nacked_total = 0
        self._deferred_total = 0
        self._dead_lettered_total = 0
        self._expired_total = 0
        self._lease_expired_total = 0
        self._ttl_order: deque[Message] | None = None  # live messages in publish order, while a TTL is set
        self._recent: deque[tuple[float, int]] = deque()  # (time, deliveries) within the rate window
        self._recent_total = 0
        #: Messages leaving for other queues, for the actor to hand on after each command.
        self.outbox: list[Transfer] = []
        #: Records of what a refused command noticed (expiries) before refusing: see ``take_noticed``.
        self._noticed: list[Record] = []
        #: Set by whoever hands deliveries on (the actor, for push streams): whether the delivery of
        #: message id under lease id has not left the broker yet. Such a lease that runs out is
        #: ``released`` with its attempt refunded rather than expired: no consumer saw it.
        self.undelivered: Callable[[str, str], bool] | None = None
        config.check_for(name)
        if config.message_ttl > 0:
            self._ttl_order = deque()

    def apply(self, command: commands.Command, now: float) -> tuple[Any, list[Record]]:
        """Carry out one command at ``now``: the answer, and the records it produced, in order."""
        match command:
            case commands.Publish(messages):
                return self.publish(messages, now)
            case commands.Claim(consumer, max_count, lease):
                return self.claim(consumer, max_count, lease, now)
            case commands.Ack(lease_ids):
                return self.ack(lease_ids, now)
            case commands.Nack(lease_ids, delay, reason, retryable):
                return self.nack(lease_ids, delay, reason, now, retryable=retryable)
            case commands.Defer(lease_ids, retry_after, reason):
                return self.defer(lease_ids, retry_after, reason, now)
            case commands.Extend(lease_ids, lease):
                return self.extend(lease_ids, lease, now)
            case commands.Release(lease_ids, refund_attempt):
                return self.release(lease_ids, refund_attempt, now)
            case commands.Receive(messages):
                return self.publish(messages, now, moved=True)
            case commands.Redrive(ids, to, destinations):
                return self.redrive(ids, to, destinations, now)
            case commands.ListMovable():
                return self.movable(now)
            case commands.Browse(state, limit, after):
                return self.browse(state, limit, after, now)
            case commands.GetMessage(message_id):
                return self.get(message_id, now)
            case commands.DeleteMessage(message_id):
                return self.delete(message_id, now)
            case commands.Purge():
                return self.purge(now)
            case commands.GetStats():
                return self.stats(now)
            case commands.UpdateConfig(changes, new_push_secret):
                config = self.config.updated(changes)
                return self.update_config(
                    config.with_new_push_secret(self.name) if new_push_secret else config, now
                )
            case commands.FindLeases(message_ids):
                return self.find_leases(message_ids, now)
            case commands.FindDelivery(message_id, consumer, attempt):
                return self.find_delivery(message_id, consumer, attempt, now)
            case commands.BrowseDeadLetters(origin, limit, after):
                return self.browse_dead_letters(origin, limit, after, now)
            case commands.FindDeadLetters(origin, ids):
                return self.find_dead_letters(origin, ids, now)
        raise TypeError(f"not a queue command: {command!r}")

    # -- moves -----------------------------------------------------------------------------------

    def _move(self, message: Message, move_name: str) -> None:
        counts = self._counts
        counts[message.state] -= 1
        move(message, move_name)
        counts[message.state] += 1

    def _make_ready(self, message: Message) -> None:
        """File a message that is now ``ready`` where claims will find it."""
        ticket = message.ticket = next(self._tickets)
        if message.deliveries:
            heapq.heappush(self._reclaimed, (-message.priority, message.seq, ticket, message))
        else:
            self._fresh.push(message, ticket)

    def _make_delayed(self, message: Message, available_at: float) -> None:
        ticket = message.ticket = next(self._tickets)
        message.available_at = available_at
        heapq.heappush(self._delayed, (available_at, ticket, message))

    def _drop_lease(self, message: Message) -> None:
        if message.lease_id is not None:
            del self._leases[message.lease_id]
            message.lease_id = None

    def _remember(self, message: Message, now: float, record: Any) -> None:
        history = message.history
        if history is None:
            message.history = [(now, record)]
        else:
            history.append((now, record))
            if len(history) > MAX_HISTORY:
                _trim_history(history)

    def _leave(self, message: Message, move_name: str, now: float, record: Record) -> None:
        """Take a live message out of the queue for good by the move ``move_name``."""
        self._move(message, move_name)
        self._finish(message, now, record)

    def _finish(self, message: Message, now: float, record: Record | None) -> None:
        """Forget a message that just reached a final state (its entries and lease go stale) and keep
        it, with ``record`` last in its history, among the finished ones get-one can still show."""
        message.ticket = 0
        self._drop_lease(message)
        del self._messages[message.id]
        if record is not None:
            self._remember(message, now, record)
            self._finished[message.id] = message
            self._finished_bytes += len(message.payload)
            self._trim_finished()

    def _trim_finished(self) -> None:
        """Keep the newest ``count`` finished messages. Past ``payload_bytes`` of their payloads, the
        oldest let theirs go and stay, bare: get-one still shows their state and history (§6)."""
        finished, bare = self._finished, self._finished_bare
        size = self._finished_bytes
        excess = len(finished) + len(bare) - self._history.count
        while excess > 0:
            if bare:
                bare.popitem(last=False)
            else:
                size -= len(finished.popitem(last=False)[1].payload)
            excess -= 1
        limit = self._history.payload_bytes
        while size > limit:  # 0 once ``finished`` is empty
            message_id, message = finished.popitem(last=False)
            size -= len(message.payload)
            _let_go(message)
            bare[message_id] = message
        self._finished_bytes = size

    def _dead_letter(
        self, message: Message, lease_id: str | None, reason: str, now: float, records: list[Record]
    ) -> None:
        """Move a message to the dead-letter queue (or drop it, when the queue has none)."""
        to = self.config.dead_letter_queue(self.name)
        record = DeadLettered(message.id, lease_id, reason, message.attempt, to)
        records.append(record)
        self._send_dead(message, to, reason)  # first: leaving may let its payload go (_trim_finished)
        self._leave(message, "dead_letter", now, record)
        self._dead_lettered_total += 1

    def _send_dead(self, message: Message, to: str | None, reason: str) -> None:
        """Hand a copy with the provenance headers of §6 to the dead-letter queue ``to``, if any."""
        if to is None:
            return
        headers = dict(message.headers or {})
        headers[DEAD_LETTER_FROM] = self.name
        headers[DEAD_LETTER_REASON] = reason
        headers[DEAD_LETTER_ATTEMPTS] = str(message.attempt)
        headers[ORIGINAL_ID] = message.id
        self.outbox.append((to, _copy(message, self.name, headers)))

    def _send_redriven(self, message: Message, destination: str) -> None:
        """Hand a copy, without the dead-letter headers but its ``x-original-id``, to ``destination``."""
        headers = dict(message.headers or {})
        for name in (DEAD_LETTER_FROM, DEAD_LETTER_REASON, DEAD_LETTER_ATTEMPTS):
            headers.pop(name, None)
        self.outbox.append((destination, _copy(message, self.name, headers or None)))

    def _exhausted(self, message: Message) -> bool:
        max_attempts = self.config.max_attempts
        return max_attempts > 0 and message.attempt >= max_attempts

    def notice_due(self, now: float) -> list[Record]:
        """Move what came due by ``now`` (delays ended, leases and TTLs run out) and return the records
        of those moves: what a wake-up at a deadline does, without reading stats."""
        records: list[Record] = []
        self._advance(now, records)
        return records

    def take_noticed(self) -> list[Record]:
        """The records of moves a command made before it was refused (a publish past ``max_depth``,
        a get of an unknown id: both notice expiries first). The actor journals them all the same."""
        noticed, self._noticed = self._noticed, []
        return noticed

    def take_outbox(self) -> list[Transfer]:
        """The messages that left for other queues since the last call."""
        outbox, self.outbox = self.outbox, []
        return outbox

    def _advance(self, now: float, records: list[Record]) -> None:
        """Move what came due by ``now``: delayed messages, expired leases (noticed lazily) and messages
        whose TTL passed, the last two in the order they happened, whenever they are noticed."""
        delayed = self._delayed
        while delayed and delayed[0][0] <= now:
            _, ticket, message = heapq.heappop(delayed)
            if message.ticket == ticket:
                self._move(message, "due")
                message.ready_at = message.available_at or now
                message.available_at = None
                self._make_ready(message)
        deadlines = self._lease_deadlines
        ttl_order = self._ttl_order
        while (entry := deadlines.peek_live()) is not None and entry[0] <= now:
            if ttl_order is not None:
                self._expire_ttl(entry[0], now, records)  # TTLs that passed before this lease did
                if entry[2].ticket != entry[1]:
                    continue  # the leased message itself expired
            deadlines.pop_live()
            message = entry[2]
            lease_id = message.lease_id or ""
            if self.undelivered is not None and self.undelivered(message.id, lease_id):
                records += self.release([lease_id], True, now)[1]  # nobody saw it: never dead-lettered
                continue
            self._lease_expired_total += 1
            record = LeaseExpired(message.id, lease_id)
            records.append(record)
            self._remember(message, now, record)
            if self._exhausted(message):
                self._dead_letter(message, lease_id, "max_attempts", now, records)
            else:
                self._move(message, "expire")
                message.ready_at = entry[0]  # its deadline, however late that was noticed
                self._make_ready(message)
        if len(deadlines) > 2 * self._counts[IN_FLIGHT] + 1024:
            deadlines.compact()
        if ttl_order is not None:
            self._expire_ttl(now, now, records)
        self._drop_stale_entries()
        if self._recent:
            self._allowance(now, 0)  # forget deliveries that left the rate window
        if self._key_expiry and self._key_expiry[0][0] <= now:
            self._forget_keys(now)

    def _drop_stale_entries(self) -> None:
        """Compact the ready and delayed structures once their stale entries outnumber the live ones
        (and 1024), as ``_advance`` does the lease deadlines. A message that leaves while ready or
        delayed (its TTL ran out, a delete, a redrive, a late ack of a noticed-expired lease) leaves
        its entry behind, holding the message in memory; claims drop the ones they reach, and a delay
        ending drops its own, but nothing else would: a queue whose messages all expire unclaimed
        would grow without bound. Amortized O(1): a compaction of n entries follows at least n/2 new
        stale ones."""
        counts = self._counts
        fresh, reclaimed, delayed = self._fresh, self._reclaimed, self._delayed
        if len(fresh) + len(reclaimed) > 2 * counts[READY] + 1024:
            fresh.compact()
            reclaimed[:] = [entry for entry in reclaimed if entry[3].ticket == entry[2]]
            heapq.heapify(reclaimed)
        if len(delayed) > 2 * counts[DELAYED] + 1024:
            delayed[:] = [entry for entry in delayed if entry[2].ticket == entry[1]]
            heapq.heapify(delayed)

    def _forget_keys(self, now: float) -> None:
        """Forget the keys whose ``dedup_window`` ran out by ``now``: at each publish, each command that
        advances the queue, and each record replayed, so that neither a queue that stopped publishing
        nor a snapshot (made by replaying) keeps every key it ever saw."""
        keys = self._keys
        expiry = self._key_expiry
        while expiry and expiry[0][0] <= now:
            _, expired_key = heapq.heappop(expiry)
            remembered = keys.get(expired_key)
            if remembered is not None and remembered[2] <= now:
                del keys[expired_key]

    def _expire_ttl(self, until: float, now: float, records: list[Record]) -> None:
        """Expire, at ``now``, the messages whose ``message_ttl`` ran out by ``until`` (≤ ``now``)."""
        order = self._ttl_order
        assert order is not None
        ttl = self.config.message_ttl
        to = self.config.dead_letter_queue(self.name)
        while order:
            message = order[0]
            if message.state not in LIVE_STATES:
                order.popleft()
                continue
            if message.published_at + ttl > until:  # the sum next_due promises, exactly
                break
            order.popleft()
            record = Expired(message.id, to)
            records.append(record)
            self._send_dead(message, to, "expired")  # before it leaves, as in _dead_letter
            self._leave(message, "time_out", now, record)
            self._expired_total += 1

    def next_due(self) -> float | None:
        """When ``_advance`` next has something to do (a delay ends, a lease or a message's TTL
        expires), or when the rate limit next lets a claim have more, if ever."""
        times = []
        while self._delayed and self._delayed[0][2].ticket != self._delayed[0][1]:
            heapq.heappop(self._delayed)
        if self._delayed:
            times.append(self._delayed[0][0])
        entry = self._lease_deadlines.peek_live()
        if entry is not None:
            times.append(entry[0])
        order = self._ttl_order
        if order:
            while order and order[0].state not in LIVE_STATES:
                order.popleft()
            if order:
                times.append(order[0].published_at + self.config.message_ttl)
        rate_limit = self.config.rate_limit
        if (
            rate_limit is not None
            and self._recent
            and self._recent_total >= rate_limit[0]
            and self._counts[READY]
        ):
            times.append(self._recent[0][0] + rate_limit[1])
        return min(times) if times else None

    # -- publish ---------------------------------------------------------------------------------

    def publish(
        self, messages: Sequence[NewMessage], now: float, *, moved: bool = False
    ) -> tuple[list[PublishedRef], list[Record]]:
        """Add a batch. A message whose ``key`` was seen within ``dedup_window`` is answered with the
        existing message (``DUPLICATE``), or, with ``replace``, gives that message its payload and
        headers if it is not leased (``REPLACED``, else ``CONFLICT``); the whole batch is refused with
        ``QueueFull`` if it would take the queue past ``max_depth``.

        ``moved`` messages come from another queue (dead letters, redrives): their keys are not checked
        and ``max_depth`` does not apply, since a move must not lose them. A moved message's key only
        takes over a remembered key whose message is gone (a redrive back to where it was published)."""
        self._forget_keys(now)
        keys = self._keys
        expiry = self._key_expiry
        if moved:
            self._adopt_keys(messages)
            keys = {}
        refs: list[PublishedRef] = []
        records: list[Record] = []
        max_depth = self.config.max_depth
        if max_depth:
            self._advance(now, records)  # expired messages do not count against the depth
        if max_depth and not moved:
            live = self.depth
            fresh_keys = {m.key for m in messages if m.key is not None and m.key not in keys}
            adding = sum(1 for m in messages if m.key is None) + len(fresh_keys)
            if adding and live + adding > max_depth:
                self._noticed.extend(records)
                raise QueueFull(
                    f"queue {self.name!r} holds {live} of its max_depth {max_depth}; "
                    f"the batch of {len(messages)} was rejected"
                )
        added = delayed = 0
        remember_until = now + self.config.dedup_window
        messages_by_id = self._messages
        counts = self._counts
        tickets = self._tickets
        lane_priority = 0
        lane_entries: list[Entry] = []  # ready entries of lane_priority, pushed to its lane together
        ttl_order = self._ttl_order
        for new in messages:
            key = new.key
            if key is not None:
                existing = keys.get(key)
                if existing is not None:
                    if new.replace:
                        refs.append(self._replace(existing[0], existing[1], new, now, records))
                    else:
                        refs.append((existing[0], existing[1], DUPLICATE))
                    continue
            seq = self._next_seq
            self._next_seq = seq + 1
            message_id = f"{self.id_prefix}{seq:x}"
            delay = new.delay
            available_at = now + delay if delay > 0 else None
            message = Message(
                message_id,
                seq,
                new.payload,
                new.binary,
                new.headers,
                key,
                new.priority,
                now,
                available_at,
                READY if available_at is None else DELAYED,
            )
            messages_by_id[message_id] = message
            if ttl_order is not None:
                ttl_order.append(message)
            if available_at is None:
                ticket = message.ticket = next(tickets)
                if new.priority != lane_priority:
                    if lane_entries:
                        self._fresh.extend_sorted(lane_priority, lane_entries)
                        lane_entries = []
                    lane_priority = new.priority
                lane_entries.append((seq, ticket, message))
            else:
                self._make_delayed(message, available_at)
                delayed += 1
            if key is not None and not moved:
                keys[key] = (message_id, seq, remember_until)
                heapq.heappush(expiry, (remember_until, key))
            published = Published(
                message_id,
                seq,
                new.payload,
                new.binary,
                new.headers,
                key,
                new.priority,
                now,
                available_at,
                new.origin,  # None but for moved messages
            )
            records.append(published)
            if available_at is not None or moved:
                message.history = [(now, published)]  # see _with_published
            refs.append((message_id, seq, CREATED))
            added += 1
        if lane_entries:
            self._fresh.extend_sorted(lane_priority, lane_entries)
        counts[READY] += added - delayed
        counts[DELAYED] += delayed
        self._published_total += added
        return refs, records

    def _adopt_keys(self, messages: Sequence[NewMessage]) -> None:
        """Point remembered keys whose message is gone at the moved messages that carry them (in the
        seq order the batch will get), so a later publish with the key finds the live message."""
        keys = self._keys
        seq = self._next_seq
        adopted: set[str] = set()
        for new in messages:
            key = new.key
            remembered = None if key is None or key in adopted else keys.get(key)
            if key is not None and remembered is not None and remembered[0] not in self._messages:
                keys[key] = (f"{self.id_prefix}{seq:x}", seq, remembered[2])
                adopted.add(key)  # the first of the batch takes it, as if they came one by one
            seq += 1

    def _replace(
        self, message_id: str, seq: int, new: NewMessage, now: float, records: list[Record]
    ) -> PublishedRef:
        message = self._messages.get(message_id)
        if message is None:  # acked, or otherwise gone: nothing to replace, like a plain duplicate
            return (message_id, seq, DUPLICATE)
        if message.state is IN_FLIGHT:
            return (message_id, seq, CONFLICT)
        message.history = _with_published(message)  # before the payload changes; see there
        message.payload = new.payload
        message.binary = new.binary
        message.headers = new.headers
        self._drop_lease(message)  # a noticed-expired lease must not ack the new payload unseen
        record = Replaced(message_id, new.payload, new.binary, new.headers)
        records.append(record)
        self._remember(message, now, record)
        return (message_id, seq, REPLACED)

    # -- claim -----------------------------------------------------------------------------------

    def _take_ready(self, count: int) -> list[Message]:
        """Remove up to ``count`` ready messages in claim order: reclaimed first, then fresh."""
        taken: list[Message] = []
        reclaimed = self._reclaimed
        while reclaimed and len(taken) < count:
            _, _, ticket, message = heapq.heappop(reclaimed)
            if message.ticket == ticket:
                taken.append(message)
        if len(taken) < count:
            self._fresh.pop_many(count - len(taken), taken)
        return taken

    def claim(
        self, consumer: str, max_count: int, lease: float | None, now: float
    ) -> tuple[ClaimOutcome, list[Record]]:
        """Lease up to ``max_count`` ready messages to ``consumer`` for ``lease`` seconds (default:
        the queue's). Fewer, or none, is the normal answer of a nearly empty queue or of a
        ``rate_limit`` (which then says, in ``retry_after``, when to ask again)."""
        records: list[Record] = []
        self._advance(now, records)
        rate_limited = self.config.rate_limit is not None
        allowed = self._allowance(now, max_count) if rate_limited else max_count
        taken = self._take_ready(allowed) if allowed else []
        deadline = now + (self.config.lease if lease is None else lease)
        deliveries = self._lease_all(taken, consumer, deadline, now, records)
        ready = self._counts[READY]
        retry_after = None
        if rate_limited:
            self._count_deliveries(now, len(deliveries))
            if allowed < max_count and ready:
                retry_after = self._rate_retry_after(now)
        return ClaimOutcome(deliveries, ready, retry_after), records

    def claim_cohort(
        self, claims: Sequence[commands.Claim], now: float
    ) -> tuple[list[ClaimOutcome], list[Record]]:
        """Serve claims that arrived together (a ``claim_window`` cohort) in one pass: what is ready
        (and allowed by ``rate_limit``) is divided across them in proportion to each ``max_count``,
        and dealt round-robin so that each gets a share of the front of the queue."""
        records: list[Record] = []
        self._advance(now, records)
        wanted = [claim.max_count for claim in claims]
        asked = sum(wanted)
        allowed = self._allowance(now, asked) if self.config.rate_limit is not None else asked
        taken = self._take_ready(allowed) if allowed else []
        shares = divide_fairly(len(taken), wanted)
        hands: list[list[Message]] = [[] for _ in claims]
        remaining = list(shares)
        dealt = iter(taken)
        active = [index for index, share in enumerate(shares) if share]
        while active:
            still = []
            for index in active:
                hands[index].append(next(dealt))
                remaining[index] -= 1
                if remaining[index]:
                    still.append(index)
            active = still
        outcomes: list[ClaimOutcome] = []
        delivered = 0
        for claim, hand in zip(claims, hands, strict=True):
            deadline = now + (self.config.lease if claim.lease is None else claim.lease)
            deliveries = self._lease_all(hand, claim.consumer, deadline, now, records)
            delivered += len(deliveries)
            outcomes.append(ClaimOutcome(deliveries, 0))
        self._count_deliveries(now, delivered)
        ready = self._counts[READY]
        retry_after = self._rate_retry_after(now) if allowed < asked and ready else None
        return [ClaimOutcome(outcome.deliveries, ready, retry_after) for outcome in outcomes], records

    # -- rate limit ------------------------------------------------------------------------------

    def _allowance(self, now: float, wanted: int) -> int:
        """How many of ``wanted`` deliveries the ``rate_limit`` window has left at ``now``."""
        rate_limit = self.config.rate_limit
        if rate_limit is None:
            return wanted
        limit, per = rate_limit
        recent = self._recent
        while recent and recent[0][0] + per <= now:  # the sum next_due and retry_after promise
            self._recent_total -= recent.popleft()[1]
        return min(wanted, max(limit - self._recent_total, 0))

    def _count_deliveries(self, now: float, count: int) -> None:
        if count and self.config.rate_limit is not None:
            recent = self._recent
            if recent and recent[-1][0] == now:  # a claim replayed, one record per delivery
                recent[-1] = (now, recent[-1][1] + count)
            else:
                recent.append((now, count))
            self._recent_total += count

    def rate_limited_for(self, now: float) -> float | None:
        """Seconds until ``rate_limit`` lets more go, when it holds ready messages back at ``now``;
        ``None`` when it does not (no limit, nothing ready, or room left in its window)."""
        if self.config.rate_limit is None or not self._counts[READY] or self._allowance(now, 1):
            return None
        return self._rate_retry_after(now)

    def _rate_retry_after(self, now: float) -> float | None:
        """Seconds until the oldest deliveries in the window leave it, freeing room for more."""
        rate_limit = self.config.rate_limit
        if rate_limit is None or not self._recent:
            return None
        return max(self._recent[0][0] + rate_limit[1] - now, 0.0)

    def _lease_all(
        self, taken: list[Message], consumer: str, deadline: float, now: float, records: list[Record]
    ) -> list[Delivery]:
        """Lease messages just taken from the ready set to ``consumer`` until ``deadline``."""
        deliveries: list[Delivery] = []
        leases = self._leases
        deadline_entries: list[Entry] = []  # all with this deadline, in ticket order
        tickets = self._tickets
        prefix = self.id_prefix
        max_history = MAX_HISTORY
        for message in taken:
            if message.state is not READY:  # the table's (READY, "claim") move, inlined: hot path
                raise IllegalTransition(f"message {message.id} cannot claim from {message.state}")
            previous = message.lease_id
            if previous is not None:
                del leases[previous]  # the expired lease goes stale the moment it is redelivered
            message.state = IN_FLIGHT
            deliveries_count = message.deliveries = message.deliveries + 1
            attempt = message.attempt = message.attempt + 1
            message_id = message.id
            if message_id.startswith(prefix):
                lease_id = f"{message_id}.{deliveries_count}"
            else:  # recovered from before a restart: see ``id_prefix``
                lease_id = f"{message_id}.{prefix}{deliveries_count}"
            message.lease_id = lease_id
            message.lease_deadline = deadline
            message.consumer = consumer
            leases[lease_id] = message
            ticket = message.ticket = next(tickets)
            deadline_entries.append((deadline, ticket, message))
            record = Claimed(message.id, lease_id, consumer, attempt, deadline)
            records.append(record)
            history = message.history
            if history is None:
                message.history = [(now, record)]
            else:
                history.append((now, record))
                if len(history) > max_history:
                    _trim_history(history)
            deliveries.append((record, message))
        self._lease_deadlines.extend_sorted(deadline_entries)
        counts = self._counts
        counts[READY] -= len(deliveries)
        counts[IN_FLIGHT] += len(deliveries)
        return deliveries

    # -- settle ----------------------------------------------------------------------------------

    def ack(self, lease_ids: Iterable[str], now: float) -> tuple[SettleOutcome, list[Record]]:
        """Complete the messages under these leases. Unknown or stale lease ids are skipped."""
        records: list[Record] = []
        skipped: list[str] = []
        leases = self._leases
        messages = self._messages
        acked = self._finished
        from_ready = 0  # leases whose expiry was noticed: the message was ready again
        payload_bytes = 0
        max_history = MAX_HISTORY
        for lease_id in lease_ids:
            message = leases.pop(lease_id, None)
            if message is None:
                skipped.append(lease_id)
                continue
            state = message.state  # the table's (IN_FLIGHT or READY, "ack") moves, inlined: hot path
            if state is READY:
                from_ready += 1
            elif state is not IN_FLIGHT:
                raise IllegalTransition(f"message {message.id} cannot ack from state {state.value}")
            message.state = ACKED
            message.ticket = 0
            message.lease_id = None
            del messages[message.id]
            record = Acked(message.id, lease_id)
            records.append(record)
            history = message.history
            if history is None:
                message.history = [(now, record)]
            else:
                history.append((now, record))
                if len(history) > max_history:  # as _remember does, so a replay trims alike
                    _trim_history(history)
            acked[message.id] = message
            payload_bytes += len(message.payload)
        counts = self._counts
        counts[READY] -= from_ready
        counts[IN_FLIGHT] -= len(records) - from_ready
        counts[ACKED] += len(records)
        self._acked_total += len(records)
        self._finished_bytes += payload_bytes
        self._trim_finished()
        return SettleOutcome(len(records), tuple(skipped)), records

    def _return(self, message: Message, delay: float, now: float) -> None:
        """Put a settled message back: ready on the reclaim heap, or delayed for ``delay`` seconds."""
        message.lease_id = None
        if delay > 0:
            self._move(message, "retry_later")
            self._make_delayed(message, now + delay)
        else:
            self._move(message, "retry")
            message.available_at = None
            message.ready_at = now
            self._make_ready(message)

    def _give_back(
        self,
        lease_ids: Iterable[str],
        now: float,
        decide: Callable[[Message, str], tuple[float, Record]],
        *,
        dead_reason: str | None = None,
        may_dead_letter: bool = True,
    ) -> tuple[SettleOutcome, list[Record]]:
        """Return each leased message to the queue after the delay ``decide`` gives, with the record it
        gives; ``decide`` may also adjust the attempt. A message that has used its ``max_attempts``
        (when ``may_dead_letter``), or every message when ``dead_reason`` is given, is dead-lettered
        instead. Unknown or stale lease ids are skipped."""
        records: list[Record] = []
        skipped: list[str] = []
        settled = dead = 0
        leases = self._leases
        for lease_id in lease_ids:
            message = leases.get(lease_id)
            if message is None:
                skipped.append(lease_id)
                continue
            delay, record = decide(message, lease_id)  # first: should it raise, the lease stays whole
            del leases[lease_id]
            settled += 1
            records.append(record)
            self._remember(message, now, record)
            reason = dead_reason or ("max_attempts" if may_dead_letter and self._exhausted(message) else None)
            if reason is None:
                self._return(message, delay, now)
            else:
                message.lease_id = None
                self._dead_letter(message, lease_id, reason, now, records)
                dead += 1
        return SettleOutcome(settled, tuple(skipped), dead_lettered=dead), records

    def nack(
        self,
        lease_ids: Iterable[str],
        delay: float | None,
        reason: str | None,
        now: float,
        *,
        retryable: bool = True,
    ) -> tuple[SettleOutcome, list[Record]]:
        """Return messages for another attempt after ``delay`` (default: the queue's retry_backoff),
        or dead-letter them: at once when not ``retryable``, or when their attempts are used up."""
        backoff = self.config.retry_backoff

        def decide(message: Message, lease_id: str) -> tuple[float, Record]:
            wait = backoff.delay(message.attempt) if delay is None else delay
            return wait, Nacked(message.id, lease_id, wait, reason)

        outcome, records = self._give_back(
            lease_ids, now, decide, dead_reason=None if retryable else "rejected"
        )
        self._nacked_total += outcome.settled
        return outcome, records

    def defer(
        self, lease_ids: Iterable[str], retry_after: float, reason: str | None, now: float
    ) -> tuple[SettleOutcome, list[Record]]:
        """Return messages after ``retry_after`` seconds and refund the attempt: backpressure, not
        failure, so ``max_attempts`` is never spent by a defer."""

        def decide(message: Message, lease_id: str) -> tuple[float, Record]:
            message.attempt -= 1
            return retry_after, Deferred(message.id, lease_id, retry_after, reason)

        outcome, records = self._give_back(lease_ids, now, decide, may_dead_letter=False)
        self._deferred_total += outcome.settled
        return outcome, records

    def release(
        self, lease_ids: Iterable[str], refund_attempt: bool, now: float
    ) -> tuple[SettleOutcome, list[Record]]:
        """Put leased messages back at once, first in line, as if their leases had expired. With
        ``refund_attempt`` the delivery does not count (it never reached a consumer)."""

        def decide(message: Message, lease_id: str) -> tuple[float, Record]:
            if refund_attempt:
                message.attempt -= 1
            return 0.0, Released(message.id, lease_id, refund_attempt)

        return self._give_back(lease_ids, now, decide)

    def extend(
        self, lease_ids: Iterable[str], lease: float, now: float
    ) -> tuple[SettleOutcome, list[Record]]:
        """Set each lease's deadline to ``now + lease``. A lease whose expiry was already noticed but
        whose message was not delivered again is taken back (the message leaves the ready set). A lease
        named twice is extended once and skipped the second time, as the other settle calls do."""
        records: list[Record] = []
        skipped: list[str] = []
        deadlines: dict[str, float] = {}
        deadline = now + lease
        for lease_id in lease_ids:
            message = self._leases.get(lease_id)
            if message is None or lease_id in deadlines:
                skipped.append(lease_id)
                continue
            self._move(message, "extend")
            message.lease_deadline = deadline
            ticket = message.ticket = next(self._tickets)
            self._lease_deadlines.push((deadline, ticket, message))
            record = Extended(message.id, lease_id, deadline)
            records.append(record)
            self._remember(message, now, record)
            deadlines[lease_id] = deadline
        return SettleOutcome(len(records), tuple(skipped), deadlines), records

    # -- operator calls --------------------------------------------------------------------------

    def delete(self, message_id: str, now: float) -> tuple[None, list[Record]]:
        """Remove one live message, whatever its state; its lease, if any, goes stale."""
        message = self._messages.get(message_id)
        if message is None:
            raise MessageNotFound(f"message {quoted_value(message_id)} is not in queue {self.name!r}")
        self._move(message, "delete")
        self._finish(message, now, None)
        self._drop_stale_entries()  # publish-and-delete alone never advances the queue
        return None, [Deleted(message_id)]

    def purge(self, now: float) -> tuple[int, list[Record]]:
        """Remove every ready and delayed message; leases in flight are left to finish. A lease that ran
        out is noticed first, as a stats read would: it is ready, so it goes too."""
        records: list[Record] = []
        self._advance(now, records)
        purged = self._purge()
        return purged, [*records, Purged(purged)] if purged else records

    def _purge(self) -> int:
        """Keep the messages in flight; every other live message (ready or delayed) is purged. One pass
        that moves each message with no call and builds the kept queue anew, rather than ``_move`` and a
        ``del`` each: a purge holds up every queue, ~1 µs a message that way, ~0.3 µs this way (most of it
        freeing them)."""
        kept: dict[str, Message] = {}
        leases = self._leases
        for message_id, message in self._messages.items():
            state = message.state
            if state is IN_FLIGHT:
                kept[message_id] = message
                continue
            message.state = _PURGED_FROM[state]
            message.ticket = 0  # every entry of it left anywhere is stale
            if message.lease_id is not None:  # one that ran out, noticed: it settles nothing now
                del leases[message.lease_id]
                message.lease_id = None
        purged = len(self._messages) - len(kept)
        self._messages = kept
        counts = self._counts
        for state, purged_state in _PURGED_FROM.items():
            counts[purged_state] += counts[state]
            counts[state] = 0
        self._fresh.clear()
        self._reclaimed.clear()
        self._delayed.clear()
        return purged

    def redrive(
        self, ids: Sequence[str] | None, to: str | None, destinations: AbstractSet[str], now: float
    ) -> tuple[RedriveOutcome, list[Record]]:
        """Move messages out of this queue, typically a dead-letter queue, to ``to`` or else back to the
        queue each came from, as new messages there with their attempts at zero. ``ids`` ``None`` means
        every ready and delayed message. Leased messages stay (their consumer may still ack them)."""
        records: list[Record] = []
        self._advance(now, records)
        unknown: list[str] = []
        skipped: list[tuple[str, str]] = []
        if ids is None:
            chosen = [m for m in self._messages.values() if m.state is READY or m.state is DELAYED]
            skipped.extend((m.id, "in_flight") for m in self._messages.values() if m.state is IN_FLIGHT)
        else:
            chosen = []
            for message_id in dict.fromkeys(ids):  # a repeated id moves once
                message = self._messages.get(message_id)
                if message is None:
                    unknown.append(message_id)
                elif message.state is IN_FLIGHT:
                    skipped.append((message_id, "in_flight"))
                else:
                    chosen.append(message)
        redriven = 0
        for message in chosen:
            headers = dict(message.headers or {})
            destination = to or headers.get(DEAD_LETTER_FROM)
            if destination is None or destination == self.name or destination not in destinations:
                skipped.append((message.id, "no_destination"))
                continue
            record = Redriven(message.id, destination)
            records.append(record)
            self._send_redriven(message, destination)  # before it leaves, as in _dead_letter
            self._leave(message, "redrive", now, record)
            redriven += 1
        return RedriveOutcome(redriven, tuple(unknown), tuple(skipped)), records

    def movable(self, now: float) -> tuple[tuple[list[str], list[str]], list[Record]]:
        """``(ids a redrive of every message would move, ids it would leave in flight)``, in seq order."""
        records: list[Record] = []
        self._advance(now, records)
        waiting: list[str] = []
        leased: list[str] = []
        for message in self._messages.values():
            if message.state is IN_FLIGHT:
                leased.append(message.id)
            elif message.state is READY or message.state is DELAYED:
                waiting.append(message.id)
        return (waiting, leased), records

    def update_config(self, config: QueueConfig, now: float) -> tuple[ConfigChange, list[Record]]:
        """Apply a new config to later operations. Answers with the stats as a read right after would
        (noticing, under the new config, what came due)."""
        config.check_for(self.name)
        before = self.config
        self._apply_config(config)
        stats, records = self.stats(now)
        return ConfigChange(before, config, stats), [QueueUpdated(config), *records]

    def _apply_config(self, config: QueueConfig) -> None:
        """Turning a TTL on starts it for every live message, counted from its publish."""
        if config.message_ttl > 0 and self._ttl_order is None:
            self._ttl_order = deque(self._messages.values())
        elif config.message_ttl == 0:
            self._ttl_order = None
        if config.rate_limit is None:
            self._recent.clear()
            self._recent_total = 0
        self.config = config

    # -- replay ----------------------------------------------------------------------------------

    def restore(self, record: Record, at: float) -> None:
        """Apply one journaled record again, as recovery does, ``at`` the time it was written.

        Records are facts, so this never decides anything: it puts the message where the record says.
        States are set directly rather than through the table, because the moves that are not
        journaled (a delay coming due) happen lazily and may not have happened yet here; the first
        command after recovery runs ``_advance`` and catches up. A message that left for another queue
        goes to the outbox as it did live; recovery drops the copies whose arrival the destination
        journaled (``Published.origin``) and re-sends the rest (a crash came between the two)."""
        if self._key_expiry and self._key_expiry[0][0] <= at:
            self._forget_keys(at)  # as the live queue had by then, at the latest
        match record:
            case Published():
                self._restore_published(record)
            case Replaced(message_id, payload, binary, headers):
                message = self._messages[message_id]
                message.history = _with_published(message)
                message.payload, message.binary, message.headers = payload, binary, headers
                self._drop_lease(message)
                self._remember(message, at, record)
            case Claimed(message_id, lease_id, consumer, attempt, deadline):
                message = self._messages[message_id]
                self._drop_lease(message)
                self._set_state(message, IN_FLIGHT)
                # "<id>.<n>", or "<id>.<prefix><n>" for a message from before a restart (``id_prefix``)
                message.deliveries = int(lease_id.rpartition(".")[2].rpartition("-")[2])
                message.attempt = attempt
                message.lease_id = lease_id
                message.lease_deadline = deadline
                message.consumer = consumer
                message.available_at = None
                self._leases[lease_id] = message
                message.ticket = next(self._tickets)
                self._lease_deadlines.push((deadline, message.ticket, message))
                self._remember(message, at, record)
                if self.config.rate_limit is not None:
                    self._allowance(at, 0)  # forget what left the window, as the claim did
                    self._count_deliveries(at, 1)
            case Extended(message_id, lease_id, deadline):
                message = self._messages[message_id]
                self._set_state(message, IN_FLIGHT)
                message.lease_deadline = deadline
                message.ticket = next(self._tickets)
                self._lease_deadlines.push((deadline, message.ticket, message))
                self._remember(message, at, record)
            case LeaseExpired(message_id):
                message = self._messages[message_id]
                self._lease_expired_total += 1
                self._remember(message, at, record)
                self._set_state(message, READY)
                message.ready_at = message.lease_deadline
                self._make_ready(message)
            case Nacked(message_id, lease_id, delay):
                self._nacked_total += 1
                self._restore_return(self._messages[message_id], lease_id, delay, at, record)
            case Deferred(message_id, lease_id, retry_after):
                self._deferred_total += 1
                message = self._messages[message_id]
                message.attempt -= 1
                self._restore_return(message, lease_id, retry_after, at, record)
            case Released(message_id, lease_id, refunded):
                message = self._messages[message_id]
                if refunded:
                    message.attempt -= 1
                self._restore_return(message, lease_id, 0.0, at, record)
            case Acked(message_id):
                self._acked_total += 1
                self._restore_leave(message_id, ACKED, at, record)
            case DeadLettered(message_id, _, reason, _, to):
                self._dead_lettered_total += 1
                message = self._messages[message_id]
                message.available_at = None  # its Nacked record sent it back only on paper
                self._send_dead(message, to, reason)  # before it leaves, as in _dead_letter
                self._restore_leave(message_id, State.DEAD_LETTERED, at, record)
            case Expired(message_id, to):
                self._expired_total += 1
                message = self._messages[message_id]
                self._came_due(message, at)
                self._send_dead(message, to, "expired")
                self._restore_leave(message_id, State.EXPIRED, at, record)
            case Redriven(message_id, to):
                message = self._messages[message_id]
                self._came_due(message, at)
                self._send_redriven(message, to)
                self._restore_leave(message_id, State.REDRIVEN, at, record)
            case Deleted(message_id):
                self._restore_leave(message_id, State.DELETED, at, None)
            case Purged():
                self._purge()
            case QueueUpdated(config):
                self._apply_config(config)
            case _:
                raise TypeError(f"not a record a queue restores: {record!r}")

    def _came_due(self, message: Message, at: float) -> None:
        """The un-journaled half of ``_advance``: live, a delay that ended by ``at`` was noticed before
        the message left (expiry and redrive both advance first)."""
        if message.state is DELAYED and message.available_at is not None and message.available_at <= at:
            message.available_at = None

    def _set_state(self, message: Message, state: State) -> None:
        counts = self._counts
        counts[message.state] -= 1
        message.state = state
        counts[state] += 1

    def _restore_published(self, record: Published) -> None:
        available_at = record.available_at
        message = Message(
            record.id,
            record.seq,
            record.payload,
            record.binary,
            record.headers,
            record.key,
            record.priority,
            record.published_at,
            available_at,
            READY if available_at is None else DELAYED,
        )
        self._messages[message.id] = message
        self._counts[message.state] += 1
        self._next_seq = max(self._next_seq, record.seq + 1)
        self._published_total += 1
        if self._ttl_order is not None:
            self._ttl_order.append(message)
        if available_at is None:
            self._make_ready(message)
        else:
            self._make_delayed(message, available_at)
        if available_at is not None or record.origin is not None:
            message.history = [(record.published_at, record)]
        if record.key is not None and record.origin is None:
            until = record.published_at + self.config.dedup_window
            self._keys[record.key] = (message.id, message.seq, until)
            heapq.heappush(self._key_expiry, (until, record.key))
        elif record.key is not None:
            remembered = self._keys.get(record.key)
            if remembered is not None and remembered[0] not in self._messages:
                self._keys[record.key] = (message.id, message.seq, remembered[2])

    def _restore_return(
        self, message: Message, lease_id: str, delay: float, at: float, record: Record
    ) -> None:
        self._leases.pop(lease_id, None)
        message.lease_id = None
        self._remember(message, at, record)
        if delay > 0:
            self._set_state(message, DELAYED)
            self._make_delayed(message, at + delay)
        else:
            self._set_state(message, READY)
            message.available_at = None
            message.ready_at = at
            self._make_ready(message)

    def _restore_leave(self, message_id: str, state: State, at: float, record: Record | None) -> None:
        message = self._messages[message_id]
        self._set_state(message, state)
        self._finish(message, at, record)

    # -- snapshots -------------------------------------------------------------------------------

    def dump(self) -> QueueImage:
        """The queue's state as plain values, for a snapshot: every live message with its state,
        attempt, lease and history, the finished messages get-one still shows, the remembered keys and
        the counters and the rate window."""
        blocks = _columns(self._messages.values())
        keys = [(key, id, seq, until) for key, (id, seq, until) in self._keys.items()]
        counters = (
            self._published_total,
            self._acked_total,
            self._nacked_total,
            self._deferred_total,
            self._dead_lettered_total,
            self._expired_total,
            self._lease_expired_total,
        )
        return QueueImage(
            self.name,
            self.config,
            self.id_prefix,
            self._next_seq,
            counters,
            keys,
            blocks,
            [*_bare_columns(self._finished_bare.values()), *_columns(self._finished.values())],
            list(self._recent),
        )

    @classmethod
    def load(cls, image: QueueImage, *, history: FinishedHistory = DEFAULT_HISTORY) -> QueueCore:
        """A queue in the state ``dump`` saw, keeping ``history``'s finished messages from then on."""
        core = cls(image.name, image.config, image.id_prefix, history=history)
        core._next_seq = image.next_seq
        (
            core._published_total,
            core._acked_total,
            core._nacked_total,
            core._deferred_total,
            core._dead_lettered_total,
            core._expired_total,
            core._lease_expired_total,
        ) = image.counters
        for key, message_id, seq, until in image.keys:
            core._keys[key] = (message_id, seq, until)
            heapq.heappush(core._key_expiry, (until, key))
        for at, count in image.recent:
            core._count_deliveries(at, count)
        for columns in image.messages:
            core._load_block(columns)
        finished, bare = core._finished, core._finished_bare
        for columns in image.finished:
            for message in _messages_of(columns)[0]:
                if message.payload is None:  # let go (``_bare_columns``): bare ones come first
                    message.payload = b""
                    bare[message.id] = message
                else:
                    finished[message.id] = message
                    core._finished_bytes += len(message.payload)
        core._trim_finished()
        return core

    def _load_block(self, columns: Columns) -> None:
        """File one block of an image's live messages (see ``load``)."""
        made, states = _messages_of(columns)
        ids, seqs, priorities, deliveries, lease_ids = _FILING_COLUMNS(columns)
        self._messages.update(zip(ids, made, strict=True))
        counts = self._counts
        for state in set(states):
            counts[state] += states.count(state)
        if any(lease_id is not None for lease_id in lease_ids):
            for message, lease_id in zip(made, lease_ids, strict=True):
                if lease_id is not None:
                    message.lease_id = lease_id
                    self._leases[lease_id] = message
        if self._ttl_order is not None:
            self._ttl_order.extend(made)
        # Filing them where claims find them. A backlog is all fresh, ready and of one priority: one
        # sorted list of entries, made in C, joins its lane.
        count = len(made)
        if (
            count
            and states.count(READY) == count
            and not any(deliveries)
            and priorities.count(priorities[0]) == count
        ):
            first = next(self._tickets)
            numbers = range(first, first + count)
            self._tickets = itertools.count(first + count)
            for message, ticket in zip(made, numbers, strict=True):
                message.ticket = ticket
            entries = list(zip(seqs, numbers, made, strict=True))
            entries.sort()  # by seq (unique): mostly in order already
            self._fresh.extend_sorted(priorities[0], entries)
            return
        fresh: dict[int, list[Entry]] = {}
        tickets = self._tickets
        for message in made:
            state = message.state
            if state is IN_FLIGHT:
                message.ticket = next(tickets)
                self._lease_deadlines.push((message.lease_deadline, message.ticket, message))
            elif state is DELAYED:
                available_at = message.available_at
                self._make_delayed(
                    message, available_at if available_at is not None else message.published_at
                )
            elif message.deliveries:
                message.ready_at = _back_since(message)
                self._make_ready(message)
            else:  # ready since its publish, as far as a snapshot tells (not since a delay it had)
                ticket = message.ticket = next(tickets)
                lane = fresh.get(message.priority)
                if lane is None:
                    lane = fresh[message.priority] = []
                lane.append((message.seq, ticket, message))
        for priority, entries in fresh.items():
            entries.sort()  # by seq (unique): a dump lists messages mostly in seq order already
            self._fresh.extend_sorted(priority, entries)

    # -- reads -----------------------------------------------------------------------------------

    def stats(self, now: float) -> tuple[QueueStats, list[Record]]:
        """Gauges and counters, after noticing what came due (so expired leases count as ready)."""
        records: list[Record] = []
        self._advance(now, records)
        return self._stats(now), records

    def stats_if_nothing_due(self, now: float) -> QueueStats | None:
        """What ``stats`` would answer at ``now``, when nothing has come due by then (``next_due``): it
        would then change nothing they show and have no records to journal. None when something has."""
        due = self.next_due()
        if due is not None and due <= now:
            return None
        return self._stats(now)

    def _stats(self, now: float) -> QueueStats:
        oldest = self._oldest_ready_at()
        counts = self._counts
        return QueueStats(
            ready=counts[READY],
            delayed=counts[DELAYED],
            in_flight=counts[IN_FLIGHT],
            published_total=self._published_total,
            acked_total=self._acked_total,
            nacked_total=self._nacked_total,
            deferred_total=self._deferred_total,
            dead_lettered_total=self._dead_lettered_total,
            expired_total=self._expired_total,
            lease_expired_total=self._lease_expired_total,
            oldest_ready_age=None if oldest is None else max(now - oldest, 0.0),
        )

    def _oldest_ready_at(self) -> float | None:
        """When the ready message that has waited longest became ready (``Message.ready_at``), or None.

        A fresh message joins its lane when it becomes ready, so where it joins in order its lane is in
        ``ready_at`` order too (a delay ending behind later publishes joins out of order): only each
        lane's first and its out-of-order few can be the oldest. Messages delivered before, on the
        reclaim heap (by priority and seq), are all looked at: they are few but after a mass expiry."""
        times = [message.ready_at for message in self._fresh.first_arrivals()]
        times += [entry[3].ready_at for entry in self._reclaimed if entry[3].ticket == entry[2]]
        return min(times, default=None)

    def browse(
        self, state: State | None, limit: int, after: int, now: float
    ) -> tuple[list[MessageView], list[Record]]:
        """Up to ``limit`` live messages with ``seq > after``, in seq order, without claiming them;
        ``state`` ``None`` means every live state."""
        records: list[Record] = []
        self._advance(now, records)
        views: list[MessageView] = []
        for message in self._messages.values():
            if len(views) >= limit:
                break
            if message.seq <= after or (state is not None and message.state is not state):
                continue
            views.append(_view(message))
        return views, records

    def get(self, message_id: str, now: float) -> tuple[MessageView, list[Record]]:
        """One message with its state and history; acked ones stay visible for a while."""
        records: list[Record] = []
        self._advance(now, records)
        message = self._known(message_id, records)
        if message_id in self._finished_bare:
            return _view(message)._replace(payload=None), records
        return _view(message), records

    def _remembered(self, message_id: str) -> Message | None:
        """The live message ``message_id``, or the finished one get-one still shows (a bare one: its
        payload let go); None when there is neither."""
        return (
            self._messages.get(message_id)
            or self._finished.get(message_id)
            or self._finished_bare.get(message_id)
        )

    def _known(self, message_id: str, records: list[Record]) -> Message:
        """``_remembered``, or ``MessageNotFound``, keeping ``records`` (what the read noticed came due,
        which a refused command does not answer) for ``take_noticed``."""
        message = self._remembered(message_id)
        if message is None:
            self._noticed.extend(records)
            raise MessageNotFound(f"message {quoted_value(message_id)} is not in queue {self.name!r}")
        return message

    def find_leases(self, message_ids: Iterable[str], now: float) -> tuple[dict[str, str], list[Record]]:
        """The lease of each message's latest delivery, by message id, in the order asked (a repeated id
        once), after noticing what came due, as ``get`` does: for the surfaces that settle by message id
        (qhook's ack and nack, Cloudflare's late ack), which hand these leases to ``ack`` or ``nack``.

        That lease settles the message while the message holds it (``Message.lease_id``): in flight, or
        its expiry noticed and the message not delivered again (§5). Otherwise it is the lease of a
        delivery settled since (nacked, deferred, released, taken back by a replace; or acked,
        dead-lettered … for a finished message get-one still shows), which a settle call skips,
        settling nothing; on a durable queue its answer still waits for the records that did settle
        it, as a native ack of a settled lease does. Ids of messages never delivered, or not here
        (unknown, deleted, purged, forgotten) are left out."""
        records: list[Record] = []
        self._advance(now, records)
        leases: dict[str, str] = {}
        for message_id in message_ids:
            if message_id in leases:
                continue
            message = self._remembered(message_id)
            if message is None:
                continue
            lease_id = message.lease_id
            if lease_id is None:
                for _, record in reversed(message.history or ()):
                    if type(record) is Claimed:
                        lease_id = record.lease_id
                        break
            if lease_id is not None:
                leases[message_id] = lease_id
        return leases, records

    def find_delivery(
        self, message_id: str, consumer: str, attempt: int, now: float
    ) -> tuple[DeliveryLookup, list[Record]]:
        """The lease of the latest delivery of ``message_id`` to ``consumer`` with ``attempt`` (None when
        its history holds none), and the message's attempt now: the push a SimpleQ callback naming that
        attempt answers. Found as ``get`` finds a message (live, or finished and remembered), after
        noticing what came due; ``MessageNotFound`` otherwise."""
        records: list[Record] = []
        self._advance(now, records)
        message = self._known(message_id, records)
        for _, record in reversed(message.history or ()):
            if type(record) is Claimed and record.consumer == consumer and record.attempt == attempt:
                return DeliveryLookup(record.lease_id, message.attempt), records
        return DeliveryLookup(None, message.attempt), records

    def browse_dead_letters(
        self, origin: str, limit: int, after: int, now: float
    ) -> tuple[DeadLetterPage, list[Record]]:
        """A page of the dead letters ``origin`` sent here: of the first ``limit`` live messages with
        ``seq > after`` (in seq order, as ``browse`` takes them), those whose ``x-dead-letter-from``
        header (``_send_dead``) names ``origin``, so a page may hold fewer than ``limit``, or none; and
        the seq of the last message looked at when a live message follows it (0: the last page)."""
        records: list[Record] = []
        self._advance(now, records)
        views: list[MessageView] = []
        looked_at = 0
        last = 0
        for message in self._messages.values():
            if message.seq <= after:
                continue
            if looked_at == limit:
                return DeadLetterPage(views, last), records
            looked_at += 1
            last = message.seq
            headers = message.headers
            if headers is not None and headers.get(DEAD_LETTER_FROM) == origin:
                views.append(_view(message))
        return DeadLetterPage(views, 0), records

    def find_dead_letters(
        self, origin: str, ids: Iterable[str], now: float
    ) -> tuple[DeadLetterLookup, list[Record]]:
        """The live dead letters from ``origin`` (``x-dead-letter-from``, as ``browse_dead_letters``)
        that ``ids`` name: each id that is a dead letter's own id, or the id of the message it was
        (``x-original-id``), maps to the first in seq order that matches it, in the order found. And,
        of the ids that name none, those that are the own id of a message redriven out of this queue
        (from whichever origin) that get-one still shows: SimpleQ's retry of an entry retried already."""
        records: list[Record] = []
        self._advance(now, records)
        asked = list(dict.fromkeys(ids))
        wanted = set(asked)
        entries: dict[str, str] = {}
        for message in self._messages.values():
            if not wanted:
                break
            headers = message.headers
            if headers is None or headers.get(DEAD_LETTER_FROM) != origin:
                continue
            for key in (message.id, headers.get(ORIGINAL_ID)):
                if key is not None and key in wanted:
                    entries[key] = message.id
                    wanted.discard(key)
        redriven = []
        for message_id in asked:
            if message_id in entries:
                continue
            gone = self._remembered(message_id)
            if gone is not None and gone.state is REDRIVEN:
                redriven.append(message_id)
        return DeadLetterLookup(entries, tuple(redriven)), records

    def holds(self, message_id: str) -> bool:
        """Whether ``get`` could find ``message_id`` here (it may not, once what has come due is
        applied): a read of the state as it is, journaling nothing, for a lookup that must not wake
        every queue (``Registry.holding``)."""
        return self._remembered(message_id) is not None

    def message_ids(self) -> list[str]:
        """The ids of the live messages, in publish order."""
        return list(self._messages)

    @property
    def depth(self) -> int:
        """Live messages: ready + delayed + in flight."""
        counts = self._counts
        return counts[READY] + counts[DELAYED] + counts[IN_FLIGHT]

    @property
    def ready_count(self) -> int:
        return self._counts[READY]


def divide_fairly(available: int, wanted: Sequence[int]) -> list[int]:
    """Split ``available`` messages across asks of ``wanted[i]`` each, in proportion to the asks:
    largest remainders get the leftovers, earlier asks first on a tie. Nobody gets more than asked."""
    total = sum(wanted)
    if total <= available:
        return list(wanted)
    shares = [available * want // total for want in wanted]
    left = available - sum(shares)
    by_remainder = sorted(range(len(wanted)), key=lambda index: (-(available * wanted[index] % total), index))
    for index in by_remainder[:left]:
        shares[index] += 1
    return shares


def _copy(message: Message, queue: str, headers: dict[str, str] | None) -> NewMessage:
    """The message as it starts over in another queue: same payload, key and priority."""
    return NewMessage(
        message.payload,
        message.binary,
        headers,
        message.key,
        0.0,
        message.priority,
        origin=(queue, message.id),
    )


def _columns(messages: Iterable[Message]) -> list[Columns]:
    """``messages`` as one block of ``MESSAGE_FIELDS`` columns (none for no messages)."""
    rows = [
        (
            m.id,
            m.seq,
            m.payload,
            m.binary,
            None if m.headers is None else dict(m.headers),
            m.key,
            m.priority,
            m.published_at,
            m.available_at,
            m.state.value,
            m.attempt,
            m.deliveries,
            m.lease_id,
            m.lease_deadline,
            m.consumer,
            None if m.history is None else list(m.history),
        )
        for m in messages
    ]
    return [list(zip(*rows, strict=True))] if rows else []


def _bare_columns(messages: Collection[Message]) -> list[Columns]:
    """``_columns`` of finished messages whose payload was let go, with a payload column of nulls."""
    blocks = _columns(messages)
    if blocks:
        columns = list(blocks[0])
        columns[_PAYLOAD] = (None,) * len(messages)
        blocks = [columns]
    return blocks


def _let_go(message: Message) -> None:
    """Drop a finished message's payload, and its history's copies of it, to save their memory: what
    get-one shows of a bare message (see ``QueueCore._trim_finished``) is its state and history."""
    message.payload = b""
    if message.history:
        message.history = [
            (
                at,
                dataclasses.replace(record, payload=b"")
                if isinstance(record, Published | Replaced)
                else record,
            )
            for at, record in message.history
        ]


def _messages_of(columns: Columns) -> tuple[list[Message], list[State]]:
    """The messages of one block of an image, and their states; filed nowhere yet, and their leases
    not set (``QueueCore._load_block`` files live ones; finished ones hold none)."""
    states = list(map(_STATES.__getitem__, columns[_STATE]))
    made = list(map(Message, *columns[:_STATE], states))  # Message() takes the columns before the state
    # The fields Message() leaves at their defaults, set only where a value differs (any() runs in C).
    for name, index in _DEFAULTED:
        column = columns[index]
        if any(column):
            for message, value in zip(made, column, strict=True):
                setattr(message, name, value)
    return made, states


def _view(message: Message) -> MessageView:
    in_flight = message.state is IN_FLIGHT
    return MessageView(
        id=message.id,
        seq=message.seq,
        state=message.state,
        attempt=message.attempt,
        payload=message.payload,
        binary=message.binary,
        headers=message.headers,
        key=message.key,
        priority=message.priority,
        published_at=message.published_at,
        available_at=message.available_at,
        lease_id=message.lease_id if in_flight else None,
        lease_deadline=message.lease_deadline if in_flight else None,
        consumer=message.consumer if in_flight else None,
        history=_history(message),
    )


def _history(message: Message) -> tuple[tuple[float, Any], ...]:
    """Everything that happened to a message, starting with its publishing."""
    return tuple(_with_published(message))


def _with_published(message: Message) -> list[tuple[float, Any]]:
    """The message's history with its ``Published`` record first. To save memory and time, history
    starts empty for a plain publish, whose record the message itself can rebuild; delayed, moved and
    replaced messages keep the record itself, since the message no longer tells all of it."""
    history = message.history or []
    if history and isinstance(history[0][1], Published):
        return history
    published = Published(
        message.id,
        message.seq,
        message.payload,
        message.binary,
        message.headers,
        message.key,
        message.priority,
        message.published_at,
        None,
    )
    return [(message.published_at, published), *history]
