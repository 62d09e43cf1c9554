"""A push stream (``GET /v1/queues/{queue}/work``, §7) as its queue's actor and its HTTP task share it.

The actor owns the bookkeeping: which leases the stream holds (``held``), whether it is lined up for
messages, and the refill. It hands deliveries over with ``deliver_nowait``, which never blocks: a
stream holds at most ``max_count`` leases, so at most that many deliveries are ever buffered. The HTTP
task only renders what ``receive`` gives it, and says which deliveries it never wrote when the stream
closes (``close_nowait``), so that those are released with their attempt refunded.

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
* When the stream closes, every lease it still holds is released (journaled as ``released``).
"""

from __future__ import annotations

import contextlib
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from broker.core.model import Delivery
from broker.errors import BrokerError

#: Seconds between heartbeat comments on an idle stream (§7: at least every 15 s).
HEARTBEAT_INTERVAL = 15.0


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
        "_receive",
        "_send",
        "closed",
        "consumer",
        "held",
        "id",
        "lease",
        "lined_up",
        "max_count",
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
        self._send, self._receive = trio.open_memory_channel[StreamItem](math.inf)

    @property
    def free(self) -> int:
        """How many more leases the stream may hold."""
        return self.max_count - len(self.held)

    @property
    def taking(self) -> bool:
        """Whether the stream takes new deliveries: neither closed nor stopped."""
        return not (self.closed or self.stopped)

    # -- the actor's side -------------------------------------------------------------------------

    def deliver_nowait(self, deliveries: Sequence[Delivery]) -> None:
        """Hand deliveries (already leased to this stream) to the HTTP task."""
        # Once the HTTP task is gone its CloseStream, queued behind, releases them.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._send.send_nowait(deliveries)

    def stop_nowait(self) -> None:
        """Stop filling the stream; the HTTP task gets the ``Stopped`` marker behind what it has."""
        if self.stopped:
            return
        self.stopped = True
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._send.send_nowait(Stopped(len(self.held)))

    def end_nowait(self, error: BrokerError) -> None:
        """End the stream: the HTTP task sends ``error`` as the stream's last event."""
        self.closed = True
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._send.send_nowait(error)
        self._send.close()

    # -- the HTTP task's side ---------------------------------------------------------------------

    async def receive(self) -> StreamItem:
        """The next deliveries, the stop marker, or the error that ends the stream."""
        return await self._receive.receive()

    def receive_nowait(self) -> StreamItem | None:
        """What is already waiting, or ``None``."""
        try:
            return self._receive.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return None

    def close_nowait(self) -> list[str]:
        """The HTTP side is done: stop taking deliveries and return the lease ids of those handed over
        but never written to the client."""
        self.closed = True
        unsent: list[str] = []
        while (item := self.receive_nowait()) is not None:
            if not isinstance(item, BrokerError | Stopped):
                unsent.extend(claimed.lease_id for claimed, _ in item)
        self._receive.close()
        return unsent


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
class StopStream:
    """The client of stream ``stream_id`` asks for no more deliveries (answered with the number of
    leases the stream still holds; ``NotFound`` when no open stream of the queue has that id)."""

    stream_id: str


@dataclass(frozen=True, slots=True)
class EndStreams:
    """The broker is going: end every stream of the queue with ``error`` as its last event, releasing
    their leases, and answer the claims waiting in a long poll now, empty."""

    error: BrokerError


StreamCommand = OpenStream | CloseStream | StopStream | EndStreams
