"""The Trio shell around one queue's core: receive a command, apply it, journal, reply.

A ``QueueActor`` is the only code that changes its ``QueueCore``; others read it through the actor
(``name``, ``config``, ``stats``), and the registry reads which messages it holds without waking it
(``Registry.holding``). Requests arrive over a bounded memory
channel as ``(command, reply)`` pairs and get exactly one answer through their ``Reply``. The actor never
waits on a disk: it appends the records to the journal and asks the journal to resolve the reply once
they are committed (at once for claims, extends, reads and non-durable queues).

Long-poll claims that find nothing wait in arrival order. They are served again after every command
that may have made messages ready, and when the core's next due time (a delay ending, a lease expiring)
or their own deadline comes, whichever is first; the receive loop sleeps under ``trio.move_on_at`` until
then.

Two policies need time, which the core does not have:

* ``claim_window``: claims are held, not applied, from the first one's arrival until the window
  closes; the whole cohort then goes to ``QueueCore.claim_cohort`` at once (and waiting claimers are
  served as one cohort too).
* Messages leave for other queues (dead letters, TTL expiry, redrive) through the core's outbox; after
  each command the actor hands them to ``forward`` (the registry), which never blocks it. While a queue
  has a policy that moves messages out when time passes (``max_attempts`` or ``message_ttl``), the actor
  also wakes at the core's next due time, so they leave when due rather than at the next request.

Push streams (§7, ``broker/stream.py``) are kept here too. A stream with free slots waits in line like a
long-poll claim that never times out (so it shares the claim window and the rate limit with pollers);
every journaled record that ends one of its leases frees a slot and lines it up again; while streams
hold leases the actor wakes at the core's next due time, so an expired lease is refilled when due. A
stopped stream leaves the line for good but keeps its leases until they are settled or it closes. All
of it costs a queue without streams one truthiness check per command.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import structlog
import trio

from broker.clock import Clock
from broker.core import QueueConfig, QueueCore
from broker.core.commands import (
    DURABLE_COMMANDS,
    Claim,
    Command,
    GetStats,
    Publish,
    Receive,
    Release,
    UpdateConfig,
)
from broker.core.model import ClaimOutcome, Delivery, NewMessage, QueueStats
from broker.core.records import (
    Acked,
    DeadLettered,
    Deferred,
    Deleted,
    Expired,
    LeaseExpired,
    Nacked,
    Record,
    Released,
)
from broker.errors import (
    BrokerError,
    InternalError,
    NotFound,
    QueueNotFound,
    StorageUnavailable,
    quoted_value,
)
from broker.storage import Journal
from broker.stream import (
    CloseStream,
    EndStreams,
    OpenStream,
    ResumeStream,
    StopStream,
    Stream,
    StreamCommand,
)

log = structlog.get_logger("broker.actor")

T = TypeVar("T")

#: Where messages leaving a queue go: ``forward(queue name, messages)``. Must not block.
Forward = Callable[[str, Sequence[NewMessage]], None]
#: Told of each config change the queue applied (``Registry`` keeps the queues with push by it).
ConfigChanged = Callable[["QueueActor"], None]

#: Requests a queue's inbox holds before senders wait: backpressure, not an error.
INBOX_SIZE = 1024

#: The answer to a publish into a durable queue while the journal cannot be written.
REFUSED_WHILE_UNWRITABLE = (
    "the journal cannot be written (a storage fault: see /readyz and the log); this publish was "
    "refused and nothing was taken: retry later"
)

#: Records that end a lease: one of a stream's frees its slot.
_LEASE_ENDING = (Acked, Nacked, Deferred, Released, LeaseExpired, DeadLettered, Expired, Deleted)


class Reply(Generic[T]):
    """A one-shot answer: set once by the actor (or the journal), awaited once by the requester."""

    __slots__ = ("_error", "_event", "_on_hold", "_value", "abandoned")

    def __init__(self, on_hold: Callable[[], None] | None = None) -> None:
        self._event = trio.Event()
        self._value: Any = None
        self._error: BrokerError | None = None
        self._on_hold = on_hold
        #: Set when the requester stopped waiting (cancelled): nobody will read the answer.
        self.abandoned = False

    def hold(self) -> None:
        """The actor keeps the request waiting (a long poll, a claim window) rather than answering it
        within this command: call the requester's ``on_hold``, once. It must not block or fail."""
        on_hold, self._on_hold = self._on_hold, None
        if on_hold is not None and not self.abandoned:
            on_hold()

    @property
    def is_resolved(self) -> bool:
        return self._event.is_set()

    @property
    def value(self) -> Any:
        """The answer stored so far (``None`` before one is set)."""
        return self._value

    def set_value(self, value: T) -> None:
        """Store the answer; it is released by ``resolve`` (possibly after a journal commit)."""
        self._value = value

    def resolve(self) -> None:
        self._event.set()

    def fail(self, error: BrokerError) -> None:
        self._error = error
        self._event.set()

    async def wait(self) -> T:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        value: T = self._value
        return value


class _WaitingClaim:
    """A claim waiting in line (long poll or claim window), or a stream with free slots (``stream``
    set; its claim is made when it is served, for the slots free then)."""

    __slots__ = ("command", "deadline", "reply", "stream")

    def __init__(
        self, command: Claim, reply: Reply[Any], deadline: float, stream: Stream | None = None
    ) -> None:
        self.command = command
        self.reply = reply
        self.deadline = deadline
        self.stream = stream

    @property
    def abandoned(self) -> bool:
        return self.reply.abandoned if self.stream is None else not self.stream.taking

    def claim(self) -> Claim:
        stream = self.stream
        if stream is None:
            return self.command
        return Claim(stream.consumer, stream.free, stream.lease)


class QueueActor:
    """One queue's task. Send commands with ``await actor.request(command)``."""

    def __init__(
        self,
        core: QueueCore,
        journal: Journal,
        clock: Clock,
        forward: Forward | None = None,
        config_changed: ConfigChanged | None = None,
    ) -> None:
        self.core = core
        self._journal = journal
        self._clock = clock
        self._forward = forward
        self._config_changed = config_changed
        self._send, self._receive = trio.open_memory_channel[
            tuple[Command | StreamCommand | None, Reply[Any]]
        ](INBOX_SIZE)
        self._waiting: deque[_WaitingClaim] = deque()
        self._cohort: list[_WaitingClaim] = []  # claims held until the claim_window closes
        self._cohort_closes = math.inf
        self._streams: dict[Stream, _WaitingClaim] = {}  # open streams and their place in line
        self._stream_leases: dict[str, Stream] = {}  # message id → the stream holding its lease
        self._hungry: list[Stream] = []  # streams with free slots, to line up after this command
        self._given_back = False  # a stalled stream gave back what it was just leased (``_fill``)
        self._deleted = False  # ``delete_nowait``: apply nothing more
        self._moves_deleted = 0  # messages of ``Receive`` commands refused as deleted
        self._appended_lsn = 0  # the lsn of the last records this queue journaled
        core.undelivered = self._undelivered

    @property
    def name(self) -> str:
        """The queue's name."""
        return self.core.name

    @property
    def config(self) -> QueueConfig:
        """The queue's config, as its last command left it (a read: changes go through ``request``)."""
        return self.core.config

    @property
    def streams(self) -> list[Stream]:
        """The queue's open push streams."""
        return list(self._streams)

    def post_nowait(self, command: Command | StreamCommand) -> bool:
        """Send a command nobody waits for, without blocking: False when the inbox is full."""
        try:
            self._send.send_nowait((command, Reply()))
        except trio.WouldBlock:
            return False
        return True

    async def post(self, command: Command | StreamCommand) -> None:
        """Send a command nobody waits for, waiting for room in the inbox."""
        await self._send.send((command, Reply()))

    @property
    def holds_claims(self) -> bool:
        """Whether a claim may be held before it is answered even without ``wait`` (a claim window): its
        requester should then watch for its client leaving, as a long poll's does."""
        return self.core.config.claim_window > 0

    async def request(
        self, command: Command | StreamCommand, *, on_hold: Callable[[], None] | None = None
    ) -> Any:
        """Send ``command`` and wait for its answer (after its journal commit, where that applies).
        ``on_hold`` is called from the actor if it keeps the request waiting (``Reply.hold``)."""
        reply: Reply[Any] = Reply(on_hold)
        try:
            try:
                # No checkpoint while the inbox has room (waiting for the answer below is one): a pass
                # through Trio's scheduler costs as much as a small command.
                self._send.send_nowait((command, reply))
            except trio.WouldBlock:
                await self._send.send((command, reply))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise self._gone() from None
        try:
            return await reply.wait()
        except trio.Cancelled:
            self._abandon(reply)
            raise

    async def stats(self) -> QueueStats:
        """The queue's stats. When nothing has come due, they are read at once, without a trip through
        the inbox: the actor's task sleeps on, so a pass over every queue (``GET /metrics``, ``GET
        /v1/queues``) does not make each sleeping actor a new wait. Each is ~20 objects that stay in the
        collector's youngest generation until the queue's next command; at 50,000 queues, a million of
        them, which the next young collections walked, holding every request up 0.3-0.6 s each (bench
        stalls). A read while a command waits in the inbox may show the state before it: no requester
        has been answered for that command yet."""
        if not self._deleted:
            stats = self.core.stats_if_nothing_due(self._clock.now())
            if stats is not None:
                return stats
        stats_now: QueueStats = await self.request(GetStats())
        return stats_now

    def _abandon(self, reply: Reply[Any]) -> None:
        """The requester is gone. A claim still waiting is dropped by the actor; messages already
        leased to it are released at once, their attempt refunded, since no consumer saw them."""
        reply.abandoned = True
        if not reply.is_resolved:
            return
        try:
            outcome = reply.value
            if isinstance(outcome, ClaimOutcome) and outcome.deliveries:
                leases = [claimed.lease_id for claimed, _ in outcome.deliveries]
                self._send.send_nowait((Release(leases, refund_attempt=True), Reply()))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the leases expire on their own instead

    def stop_nowait(self) -> None:
        """Ask the actor to finish: commands already queued are answered first, later ones get 404."""
        try:
            self._send.send_nowait((None, Reply()))
        except trio.WouldBlock:
            # The inbox is full; closing it still ends the loop once the queued commands are done.
            pass
        except trio.ClosedResourceError:
            return
        self._send.close()

    def delete_nowait(self) -> None:
        """The queue is deleted: apply nothing more. Commands still in the inbox get 404 rather than
        being applied after the journal's ``queue_deleted`` record, where a replay (or a queue made
        with the same name since) could not place their records."""
        self._deleted = True
        self.stop_nowait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # A task starts with a copy of its starter's context: an actor made on demand by a request would
        # log with that request's id (bound by the HTTP layer's Observer) for the rest of its life.
        structlog.contextvars.clear_contextvars()
        task_status.started()
        receive = self._receive
        try:
            while True:
                wakeup = self._next_wakeup()
                received: tuple[Command | StreamCommand | None, Reply[Any]] | None = None
                try:
                    if wakeup == math.inf:
                        # Nothing to wake for (most queues, most of the time): a bare wait, without a
                        # cancel scope's cost and its five objects, which a waiting actor keeps alive.
                        received = await receive.receive()
                    else:
                        with trio.move_on_at(wakeup):
                            received = await receive.receive()
                except trio.EndOfChannel:
                    return
                if received is None:  # the deadline came first
                    if self._deleted:
                        return
                    self._woken()
                    continue
                command, reply = received
                if command is None:
                    return
                if self._deleted:
                    self._refuse_deleted(command, reply)
                    return
                self._handle(command, reply)
                if self._waiting or self._hungry:
                    # Any command may have made messages ready: even a claim or a stats read notices
                    # expired leases.
                    self._serve_waiting()
        finally:
            self._close()

    def _refuse_deleted(self, command: Command | StreamCommand | None, reply: Reply[Any]) -> None:
        """Answer a command the deleted queue will not carry out: 404. Copies moved here from another
        queue go with it, as recovery has them go (their move was journaled before the deletion)."""
        if type(command) is Receive:
            self._moves_deleted += len(command.messages)
        reply.fail(self._gone())

    def _gone(self) -> QueueNotFound:
        return QueueNotFound(f"queue {self.core.name!r} was deleted")

    def _woken(self) -> None:
        """A deadline came: a claim window closed, a waiting claim timed out, or something came due."""
        if self._cohort and self._cohort_closes <= trio.current_time():
            self._serve_cohort()
        if not self._waiting:
            now = self._clock.now()
            records = self.core.notice_due(now)
            self._journal_and_reply(None, records, None, now)
        if self._waiting or self._hungry:
            self._serve_waiting()

    def _close(self) -> None:
        # The core and this actor refer to each other (``undelivered``). A recovered core was made
        # while the collector was frozen (``storage/store.py``), and a cycle through a frozen object is
        # never collected: without this, a deleted queue's messages would stay in memory for good.
        self.core.undelivered = None
        gone = self._gone()
        for waiting in (*self._waiting, *self._cohort):
            waiting.reply.fail(gone)
        self._waiting.clear()
        self._cohort.clear()
        for stream in self._streams:
            stream.end_nowait(gone)
        self._streams.clear()
        self._stream_leases.clear()
        self._hungry.clear()
        # Answer what is still in the inbox, then close it (a closed channel gives nothing back), with
        # no checkpoint between: later senders get 404 from the closed channel instead.
        while True:
            try:
                command, reply = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            self._refuse_deleted(command, reply)
        if self._moves_deleted:
            log.info("moved_messages_deleted_with_queue", queue=self.core.name, messages=self._moves_deleted)
        self._receive.close()

    def _next_wakeup(self) -> float:
        wakeup = self._cohort_closes if self._cohort else math.inf
        config = self.core.config
        if self._waiting:
            wakeup = min(wakeup, min(waiting.deadline for waiting in self._waiting))
        elif not (config.max_attempts or config.message_ttl or self._stream_leases):
            return wakeup
        due = self.core.next_due()
        if due is not None:
            wakeup = min(wakeup, self._clock.deadline_for(due))
        return wakeup

    def _handle(self, command: Command | StreamCommand, reply: Reply[Any]) -> None:
        if isinstance(command, StreamCommand):
            self._handle_stream(command, reply)
            return
        if reply.abandoned and isinstance(command, Claim):
            return  # its requester left while it sat in the inbox: leasing to nobody would hide messages
        if isinstance(command, Claim) and self.core.config.claim_window > 0:
            now = trio.current_time()
            if not self._cohort:
                self._cohort_closes = now + self.core.config.claim_window
            self._cohort.append(_WaitingClaim(command, reply, now + command.wait))
            reply.hold()
            return
        if isinstance(command, Claim) and command.wait > 0:
            if self._waiting:  # earlier claimers are served first
                self._park(command, reply)
                return
            if not self._apply(command, reply, park_if_empty=True):
                return
        else:
            self._apply(command, reply, park_if_empty=False)

    def _apply(self, command: Command, reply: Reply[Any], *, park_if_empty: bool) -> bool:
        """Apply one command and arrange its reply; False when a claim found nothing and was parked."""
        if type(command) is Publish and not self._journal.healthy and self.core.config.durable:
            # Its 503 is certain, and a message taken now would wait in memory (and in the journal's
            # buffer) for the disk to recover: clients retrying through a long fault would fill both.
            reply.fail(StorageUnavailable(REFUSED_WHILE_UNWRITABLE))
            return True
        now = self._clock.now()
        try:
            answer, records = self.core.apply(command, now)
        except BrokerError as error:
            self._journal_and_reply(command, self.core.take_noticed(), None, now)
            reply.fail(error)
            return True
        except Exception:
            log.exception("queue_command_failed", queue=self.core.name, command=type(command).__name__)
            reply.fail(InternalError(f"the broker failed to carry out {type(command).__name__}"))
            return True
        if park_if_empty and isinstance(answer, ClaimOutcome) and not answer.deliveries:
            self._journal_and_reply(command, records, None, now)
            self._park(command, reply)  # type: ignore[arg-type]
            return False
        reply.set_value(answer)
        self._journal_and_reply(command, records, reply, now)
        if type(command) is UpdateConfig and self._config_changed is not None:
            self._config_changed(self)
        return True

    def _journal_and_reply(
        self, command: Command | None, records: list[Any], reply: Reply[Any] | None, now: float
    ) -> None:
        """Journal the records of a command applied at ``now`` (the same time, so that replaying them
        gives the same state), hand on what left the queue, and answer now or after the commit.

        A durable command waits for the commit of the queue's last records even when it made none of
        its own: a publish found to be a duplicate, or an ack of a lease already settled, reports what
        earlier records did, and must not be answered before they are on disk (a crash would take back
        what its 2xx promised)."""
        if self._stream_leases and records:
            self._notice_stream_leases(records)
        if records:
            self._appended_lsn = self._journal.append(self.core.name, now, records)
            if self.core.outbox:
                self._hand_on()
        if reply is None:
            return
        # A config change waits whatever it made of ``durable``: one that turned it off must be on disk too.
        durable = self.core.config.durable or type(command) is UpdateConfig
        if self._appended_lsn and durable and type(command) in DURABLE_COMMANDS:
            self._journal.commit_then(self._appended_lsn, reply)
        else:
            reply.resolve()

    def _hand_on(self) -> None:
        """Send the messages that left this queue on to theirs, grouped by destination."""
        by_queue: dict[str, list[NewMessage]] = {}
        for queue, message in self.core.take_outbox():
            by_queue.setdefault(queue, []).append(message)
        if self._forward is None:
            log.error("messages_dropped", queue=self.core.name, destinations=sorted(by_queue))
            return
        for queue, messages in by_queue.items():
            try:
                self._forward(queue, messages)
            except Exception:  # a bug: log it loudly, but keep this queue serving
                log.exception("messages_not_forwarded", queue=self.core.name, to=queue, count=len(messages))

    def _park(self, command: Claim, reply: Reply[Any]) -> None:
        deadline = trio.current_time() + command.wait
        self._waiting.append(_WaitingClaim(command, reply, deadline))
        reply.hold()

    def _serve_cohort(self) -> None:
        """The claim window closed: divide what is ready across the claims that arrived within it.
        Those that got nothing and may wait join the waiting claimers, as do streams with free slots."""
        cohort = [item for item in self._cohort if not item.abandoned]
        self._cohort = []
        self._cohort_closes = math.inf
        if not cohort:
            return
        now = self._clock.now()
        outcomes, records = self.core.claim_cohort([item.claim() for item in cohort], now)
        self._journal_and_reply(None, records, None, now)
        now_trio = trio.current_time()
        for item, outcome in zip(cohort, outcomes, strict=True):
            if item.stream is not None:
                if self._fill(item.stream, outcome.deliveries):
                    self._waiting.append(item)
            elif outcome.deliveries or item.deadline <= now_trio:
                item.reply.set_value(outcome)
                item.reply.resolve()
            else:
                self._waiting.append(item)

    def _serve_waiting(self) -> None:
        """Line up the streams that want messages, then serve the waiting line; again while serving
        it freed stream slots (a claim notices expired leases) or made messages ready again."""
        while True:
            if self._hungry:
                self._line_up_hungry()
            if self._waiting:
                self._serve_waiting_once()
            if not (self._hungry or self._given_back):
                return
            self._given_back = False

    def _serve_waiting_once(self) -> None:
        """Serve waiting claimers and streams while messages last: in arrival order, or as one cohort
        when the queue has a claim window. Then time out the overdue, in order."""
        waiting = deque(item for item in self._waiting if not item.abandoned)
        if self.core.config.claim_window > 0:
            now = self._clock.now()
            outcomes, records = self.core.claim_cohort([item.claim() for item in waiting], now)
            self._journal_and_reply(None, records, None, now)
            unserved: deque[_WaitingClaim] = deque()
            for item, outcome in zip(waiting, outcomes, strict=True):
                if item.stream is not None:
                    if self._fill(item.stream, outcome.deliveries):
                        unserved.append(item)
                elif outcome.deliveries:
                    item.reply.set_value(outcome)
                    item.reply.resolve()
                else:
                    unserved.append(item)
            waiting = unserved
        else:
            while waiting:
                first = waiting[0]
                command = first.claim()
                now = self._clock.now()
                outcome, records = self.core.claim(command.consumer, command.max_count, command.lease, now)
                self._journal_and_reply(command, records, None, now)
                if not outcome.deliveries and command.max_count:
                    break  # the queue ran dry (a stalled stream asks for none: it just leaves the line)
                waiting.popleft()
                if first.stream is None:
                    first.reply.set_value(outcome)
                    first.reply.resolve()
                elif self._fill(first.stream, outcome.deliveries):
                    waiting.append(first)  # the queue ran dry: it waits, behind the others
        now_trio = trio.current_time()
        still: deque[_WaitingClaim] = deque()
        for item in waiting:
            if item.deadline <= now_trio:
                # Empty after its wait: when the rate limit is what held ready messages back, it says
                # when more may go, as an answer that did not wait does.
                retry_after = self.core.rate_limited_for(self._clock.now())
                item.reply.set_value(ClaimOutcome([], self.core.ready_count, retry_after))
                item.reply.resolve()
            else:
                still.append(item)
        self._waiting = still

    # -- push streams (§7) --------------------------------------------------------------------------

    def _handle_stream(self, command: StreamCommand, reply: Reply[Any]) -> None:
        match command:
            case OpenStream(stream):
                if not stream.closed:
                    placeholder = Claim(stream.consumer, stream.max_count, stream.lease)
                    self._streams[stream] = _WaitingClaim(placeholder, Reply(), math.inf, stream)
                    self._want(stream)
            case CloseStream(stream, unsent):
                self._drop_stream(stream, unsent)
            case ResumeStream(stream):
                self._want(stream)
            case StopStream(stream_id):
                stopped = self._stop_stream(stream_id)
                if stopped is None:
                    reply.fail(
                        NotFound(f"no open stream {quoted_value(stream_id)} on queue {self.core.name!r}")
                    )
                    return
                reply.set_value(len(stopped.held))
            case EndStreams(error):
                for stream in list(self._streams):
                    # What waits to be written is not: released with its attempt refunded.
                    self._drop_stream(stream, stream.end_nowait(error))
                for waiting in self._waiting:  # long polls answer now, empty: nothing holds the shutdown
                    if waiting.stream is None:
                        waiting.reply.set_value(ClaimOutcome([], self.core.ready_count))
                        waiting.reply.resolve()
                self._waiting.clear()
        reply.resolve()

    def _want(self, stream: Stream) -> None:
        """The stream has free slots: line it up for messages after the current command."""
        if not stream.lined_up and stream.taking and stream.free > 0:
            stream.lined_up = True
            self._hungry.append(stream)

    def _line_up_hungry(self) -> None:
        """Put streams that want messages in line: in the claim window's cohort when the queue has one,
        else behind the claims waiting already, like a long poll that never times out."""
        hungry, self._hungry = self._hungry, []
        window = self.core.config.claim_window
        for stream in hungry:
            item = self._streams.get(stream)
            if item is None or not stream.taking:
                stream.lined_up = False
            elif window > 0:
                if not self._cohort:
                    self._cohort_closes = trio.current_time() + window
                self._cohort.append(item)
            else:
                self._waiting.append(item)

    def _fill(self, stream: Stream, deliveries: list[Delivery]) -> bool:
        """Hand deliveries just leased to the stream; True while it still has free slots (it keeps
        waiting in line), False once it is full (it leaves the line)."""
        if deliveries and stream.stalled:
            # The claim made for it found one of its unwritten deliveries expired (and may have leased
            # that very message to it again): its client is not reading, so give them back unseen.
            leases = [claimed.lease_id for claimed, _ in deliveries]
            self._apply(Release(leases, refund_attempt=True), Reply(), park_if_empty=False)
            self._given_back = True  # a cohort served at once is served again, for what came back
        elif deliveries:
            held = stream.held
            owners = self._stream_leases
            for claimed, _ in deliveries:
                held[claimed.id] = claimed.lease_id
                owners[claimed.id] = stream
            stream.deliver_nowait(deliveries)
        if stream.free > 0:
            return True
        stream.lined_up = False
        return False

    def _notice_stream_leases(self, records: list[Record]) -> None:
        """Free the slot of every stream lease that one of ``records`` ended."""
        owners = self._stream_leases
        for record in records:
            if isinstance(record, _LEASE_ENDING):
                stream = owners.get(record.id)
                if stream is None:
                    continue
                lease_id = getattr(record, "lease_id", None)  # None: deleted or expired, whatever lease
                if lease_id is not None and stream.held.get(record.id) != lease_id:
                    continue
                del owners[record.id]
                stream.end_lease_nowait(record.id, record)  # keeps the slot of an unwritten delivery
                self._want(stream)

    def _undelivered(self, message_id: str, lease_id: str) -> bool:
        """Whether the delivery of ``message_id`` under ``lease_id`` is one a push stream has not yet
        taken to write: asked by the core when that lease runs out (``QueueCore.undelivered``)."""
        stream = self._stream_leases.get(message_id)
        return stream is not None and stream.held.get(message_id) == lease_id and stream.undelivered(lease_id)

    def _stop_stream(self, stream_id: str) -> Stream | None:
        """Fill the open stream ``stream_id`` no more (it leaves the line when next served, and the
        leases it holds stay its own); None when the queue has no such open stream."""
        for stream in self._streams:
            if stream.id == stream_id and not stream.closed:
                stream.stop_nowait()
                return stream
        return None

    def _drop_stream(self, stream: Stream, unsent: Sequence[str]) -> None:
        """Forget a stream and release every lease it holds (journaled as ``released``), refunding the
        attempt of those that never reached its client. They are claimable again at once."""
        if self._streams.pop(stream, None) is None:
            return
        stream.closed = True
        held = stream.held
        if not held:
            return
        owners = self._stream_leases
        for message_id in held:
            owners.pop(message_id, None)
        never_sent = set(unsent)
        refunded = [lease_id for lease_id in held.values() if lease_id in never_sent]
        seen = [lease_id for lease_id in held.values() if lease_id not in never_sent]
        held.clear()
        for lease_ids, refund in ((seen, False), (refunded, True)):
            if lease_ids:
                self._apply(Release(lease_ids, refund_attempt=refund), Reply(), park_if_empty=False)
