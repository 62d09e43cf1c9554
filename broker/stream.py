"""A push stream (``GET /v1/queues/{queue}/work``, §7) as its queue's actor and its HTTP task share it.

The actor owns the bookkeeping: which leases the stream holds (``held``), whether it is lined up for
messages, and the refill. It hands deliveries over with ``deliver_nowait``, which never blocks. The HTTP
task renders what ``receive`` gives it, tells the stream what it wrote (``written_nowait``), and says
which deliveries it never wrote when the stream closes (``close_nowait``), so that those are released
with their attempt refunded.

A slot is taken from the moment a delivery is leased to the stream until it is settled or its lease
ends *and* it is no longer waiting to be written: at most ``max_count`` deliveries are ever leased or
buffered, however slowly the client reads. (Without that, a client that stops reading leaves the HTTP
task blocked in a write while each lease expiry frees a slot, and the stream takes the message again
into a buffer nobody drains: attempts spent on deliveries nobody received, memory without bound.)

Theory of operation, in the actor:

* A stream with free slots (fewer than ``max_count`` leases held) lines up for messages exactly as a
  long-poll claim that waits forever would: behind earlier claimers without a claim window, or in the
  window's cohort with one, and under the queue's ``rate_limit``. So streams and pollers share one
  fairness mechanism.
* Every record the queue journals passes the stream bookkeeping first (only while some stream holds a
  lease): a record that ends one of a stream's leases (acked, nacked, deferred, released, expired,
  dead-lettered, deleted) frees its slot, and the stream lines up again at once.
* A stream that is stopped (``StopStream``, ``POST …/work/{stream_id}/stop``) leaves the line for good:
  it gets no new deliveries, while the leases it holds stay its own until they are settled or the
  stream closes. The actor then hands the HTTP task a ``Stopped`` marker behind every delivery handed
  over before, so the client knows, once it reads the marker, that nothing more is coming.
* A delivery whose lease ends without its client (it expired, or the message was deleted or its TTL
  passed) before the HTTP task has written it is *stale*: the expiry already gave the message back, so it
  is never written (a write under way when it went stale still completes), and the stream *stalls*. A
  lease that runs out on a delivery no write has begun on yet (``undelivered``: the HTTP task writes
  big deliveries in writes of their own, see ``sending``) is released rather than expired, its attempt
  refunded: its client cannot have seen it, so a client that stops
  reading never costs a message an attempt it did not get. One in the write under way may have reached the
  client, so its lease expires as any other. A stalled stream takes nothing more, and the messages stay
  with the queue for other consumers, until its HTTP task has finished the write under way and dropped the
  stale deliveries (``written_nowait``, then ``ResumeStream``). A settle by lease id proves the client has
  the delivery: it frees the slot at once, even before the write that carried it returns.
* When the stream closes, every lease it still holds is released (journaled as ``released``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import secrets
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from broker.core.model import Delivery
from broker.core.records import LeaseExpired, Record, Released
from broker.errors import BrokerError

#: Seconds between heartbeat comments on an idle stream. §7 promises one at least every 15 s: the
#: timer runs out after this, and the write follows a few milliseconds later, so it keeps a margin.
HEARTBEAT_INTERVAL = 14.0


@dataclass(frozen=True, slots=True)
class Stopped:
    """The marker the actor hands the HTTP task when the stream is stopped: every delivery handed over
    before it was; ``held`` leases were still the stream's then."""

    held: int


#: What the actor hands the HTTP task: deliveries, the stop marker, or the error that ends the stream.
StreamItem = Sequence[Delivery] | Stopped | BrokerError


class Stream:
    """One open ``/work`` stream: ``max_count`` leases at most, each of ``lease`` seconds (``None``:
    the queue's default), claimed as ``consumer``."""

    __slots__ = (
        "_pending",
        "_pending_leases",
        "_queued_leases",
        "_receive",
        "_send",
        "_sent",
        "_taken",
        "closed",
        "consumer",
        "held",
        "id",
        "lease",
        "lined_up",
        "max_count",
        "stale",
        "stalled",
        "stopped",
    )

    def __init__(self, consumer: str, max_count: int, lease: float | None) -> None:
        #: Opaque and unique per stream: the ``stream-id`` response header, and the stop call's path.
        self.id = secrets.token_urlsafe(12)
        self.consumer = consumer
        self.max_count = max_count
        self.lease = lease
        #: Message id → lease id of every delivery leased to this stream and not yet settled. Only the
        #: actor reads or changes it.
        self.held: dict[str, str] = {}
        #: Whether the actor has it lined up for messages (actor only).
        self.lined_up = False
        #: Set once either side is done with it: the actor no longer fills it.
        self.closed = False
        #: Set when its client stopped it: the actor no longer fills it, but it keeps what it holds.
        self.stopped = False
        #: The batches handed to the HTTP task and not yet written (queued, or in the write under way), in
        #: order: appended by the actor, popped by the HTTP task once the write returns. Per batch, not
        #: per delivery, to keep the hot path as it was; ``_pending_leases`` is their lease ids, made
        #: only when a lease expires while something is pending.
        self._pending: deque[Sequence[Delivery]] = deque()
        self._pending_leases: set[str] | None = None
        #: How many of the pending batches the HTTP task has taken (the writes under way); the rest wait
        #: in the channel. The HTTP task writes what it took in chunks: ``_sent`` counts the deliveries of
        #: the taken batches, in order, that a write has started on (or that were dropped as stale); the
        #: others never reached the client. ``_queued_leases`` is the lease ids of those not sent, taken
        #: or not, made as ``_pending_leases``.
        self._taken = 0
        self._sent = 0
        self._queued_leases: set[str] | None = None
        #: Lease ids of pending deliveries whose lease ended without their client: never written.
        self.stale: set[str] = set()
        #: Set by the actor when a delivery went stale, cleared by the HTTP task once it has caught up:
        #: while set, the stream takes no new deliveries (its client is not reading).
        self.stalled = False
        # Unbounded, yet never holds more than ``max_count`` deliveries: the slots count them.
        self._send, self._receive = trio.open_memory_channel[StreamItem](math.inf)

    @property
    def free(self) -> int:
        """How many more leases the stream may hold: none while it is stalled (a stale delivery is
        still in the HTTP task's hands), else ``max_count`` less those it holds."""
        if self.stalled:
            return 0
        return self.max_count - len(self.held)

    @property
    def taking(self) -> bool:
        """Whether the stream takes new deliveries: neither closed nor stopped."""
        return not (self.closed or self.stopped)

    # -- the actor's side -------------------------------------------------------------------------

    def deliver_nowait(self, deliveries: Sequence[Delivery]) -> None:
        """Hand deliveries (already leased to this stream) to the HTTP task."""
        try:
            self._send.send_nowait(deliveries)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # once the HTTP task is gone its CloseStream, queued behind, releases them
        self._pending.append(deliveries)
        self._pending_leases = self._queued_leases = None

    def undelivered(self, lease_id: str) -> bool:
        """Whether the delivery under ``lease_id`` waits for the HTTP task, no write started on it: its
        client cannot have it (see ``QueueCore.undelivered``)."""
        queued = self._queued_leases
        if queued is None:  # built once for a burst of expiries, not per delivery
            queued = self._queued_leases = set(self._unsent())
        return lease_id in queued

    def _unsent(self) -> list[str]:
        """The lease ids of the deliveries handed over that no write has started on, in order."""
        taken = itertools.islice(self._pending, self._taken)
        in_hand = [claimed.lease_id for batch in taken for claimed, _ in batch][self._sent :]
        waiting = itertools.islice(self._pending, self._taken, None)
        return in_hand + [claimed.lease_id for batch in waiting for claimed, _ in batch]

    def end_lease_nowait(self, message_id: str, record: Record) -> None:
        """``record`` ended the lease the stream holds on ``message_id``. If that delivery is not written
        yet, and the record is not a settle (only the client that read a delivery knows its lease
        id), the delivery is stale: it keeps its slot, and the stream stalls, until the HTTP task
        drops it. (A ``released`` record of a stream's lease is never a settle: the client has no call
        for it, so it comes from ``undelivered``.)"""
        lease_id = self.held.pop(message_id)
        if not self._pending:
            return  # everything handed over was written
        if not isinstance(record, LeaseExpired | Released) and getattr(record, "lease_id", None) is not None:
            return  # a settle
        pending_leases = self._pending_leases
        if pending_leases is None:  # built once for a burst of expiries, not per delivery
            pending_leases = {claimed.lease_id for batch in self._pending for claimed, _ in batch}
            self._pending_leases = pending_leases
        if lease_id in pending_leases:
            self.stale.add(lease_id)
            self.stalled = True

    def stop_nowait(self) -> None:
        """Stop filling the stream; the HTTP task gets the ``Stopped`` marker behind what it has."""
        if self.stopped:
            return
        self.stopped = True
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._send.send_nowait(Stopped(len(self.held)))

    def end_nowait(self, error: BrokerError) -> list[str]:
        """End the stream: the HTTP task writes ``error`` as the stream's last event, and none of the
        deliveries still waiting for it. Returns their lease ids: they never reached the client."""
        self.closed = True
        unsent = self._unsent()
        pending = self._pending
        while len(pending) > self._taken:  # waiting in the channel: take them back out of it
            pending.pop()
        self._queued_leases = self._pending_leases = None
        with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            while True:
                self._receive.receive_nowait()  # the stop marker goes too: the error ends it anyway
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._send.send_nowait(error)
        self._send.close()
        return unsent

    # -- the HTTP task's side ---------------------------------------------------------------------

    async def receive(self) -> StreamItem:
        """The next deliveries, the stop marker, or the error that ends the stream."""
        return self._take(await self._receive.receive())

    def receive_nowait(self) -> StreamItem | None:
        """What is already waiting, or ``None``."""
        try:
            return self._take(self._receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return None

    def _take(self, item: StreamItem) -> StreamItem:
        if not isinstance(item, Stopped | BrokerError):
            self._taken += 1  # pending until ``written_nowait``, but no longer waiting
            self._queued_leases = None
        return item

    def sending(self, count: int) -> None:
        """A write is about to start on the next ``count`` deliveries of what the HTTP task took (stale
        ones dropped from it included): they may reach the client from now on."""
        self._sent += count
        self._queued_leases = None

    def current(self, deliveries: Sequence[Delivery]) -> Sequence[Delivery]:
        """The deliveries of a batch to write: those not stale (the stale ones are dropped; their slot
        is freed by the ``written_nowait`` that counts the batch)."""
        stale = self.stale
        if not stale:
            return deliveries
        return [delivery for delivery in deliveries if delivery[0].lease_id not in stale]

    def written_nowait(self) -> bool:
        """The HTTP task's write returned: the batches it took are no longer pending (written, or
        dropped as stale). True when that ended a stall: the caller then asks the actor to refill the
        stream (``ResumeStream``)."""
        pending = self._pending
        batches, self._taken, self._sent = self._taken, 0, 0
        self._pending_leases = None
        if not self.stalled:
            for _ in range(batches):
                pending.popleft()
            return False
        stale = self.stale
        for _ in range(batches):
            stale.difference_update([claimed.lease_id for claimed, _ in pending.popleft()])
        if stale:
            return False
        self.stalled = False
        return True

    def close_nowait(self) -> list[str]:
        """The HTTP side is done: stop taking deliveries and return the lease ids of those handed over
        that no write started on (those ``undelivered`` until the actor hears)."""
        self.closed = True
        self._receive.close()
        return self._unsent()


@dataclass(frozen=True, slots=True)
class OpenStream:
    """Start filling ``stream`` (sent to the actor, answered once it is registered)."""

    stream: Stream


@dataclass(frozen=True, slots=True)
class CloseStream:
    """The stream's client is gone: release every lease it still holds; those in ``unsent`` never
    reached the client, so their attempt is refunded."""

    stream: Stream
    unsent: Sequence[str] = ()


@dataclass(frozen=True, slots=True)
class ResumeStream:
    """The HTTP task of ``stream`` caught up after a stall (see ``Stream.written_nowait``): line it up
    for messages again."""

    stream: Stream


@dataclass(frozen=True, slots=True)
class StopStream:
    """The client of stream ``stream_id`` asks for no more deliveries (answered with the number of
    leases the stream still holds; ``NotFound`` when no open stream of the queue has that id)."""

    stream_id: str


@dataclass(frozen=True, slots=True)
class EndStreams:
    """The broker is going: end every stream of the queue with ``error`` as its last event, releasing
    their leases, and answer the claims waiting in a long poll now, empty."""

    error: BrokerError


StreamCommand = OpenStream | CloseStream | ResumeStream | StopStream | EndStreams
