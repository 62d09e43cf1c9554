"""The map from queue names to their actors: creates, finds and deletes queues.

It runs in the server's root nursery, which owns every actor task. Creating and deleting are
synchronous (an actor's inbox exists before its task runs), so two requests for the same new queue
cannot both create it.

It also carries messages between queues (dead letters, TTL expiry, redrive): ``forward`` posts them
to the destination's actor as a ``Receive`` without ever blocking the sender, creating the destination
with the default config if it does not exist (§6: dead-letter queues are created on demand).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import structlog
import trio

from broker.actor import QueueActor, Reply
from broker.clock import Clock
from broker.core import FinishedHistory, NewMessage, QueueConfig, QueueCore, check_queue_name
from broker.core.commands import ListMovable, Receive, Redrive, UpdateConfig
from broker.core.config import DEFAULT_HISTORY
from broker.core.model import NEW_QUEUE_STATS, ConfigChange, QueueStats, RedriveOutcome
from broker.core.records import QueueCreated, QueueDeleted
from broker.errors import BrokerError, InvalidRequest, QueueNotFound, ShuttingDown
from broker.runtime import freeze_survivors
from broker.storage import Journal
from broker.storage.recovery import Recovered
from broker.stream import EndStreams

log = structlog.get_logger("broker.registry")

#: How many messages one command of a redrive of every message moves (see ``Registry.redrive``): the
#: API's batch limit; 11 ms of the event loop for 1,000 (in memory, 2026-11-24).
REDRIVE_SLICE = 1000
#: Queues the broker grows by, past the most it had, before what lives is frozen out of the collector's
#: walks (``runtime.freeze_survivors``): 1,000 queues are ~54,000 objects, what a young collection
#: walks anyway; growth alone counts, so queues made and deleted over and over never freeze anything.
FREEZE_EVERY = 1000
#: Queues ``each_with_stats`` reads between passes through the scheduler: 3-5 ms of the event loop
#: (in memory, 2026-11-24).
STATS_PER_CHECKPOINT = 500
#: Queues looked at for a message id between two passes through the scheduler (``holding``): ~5 ms.
LOOKUPS_PER_CHECKPOINT = 5000


class Registry:
    def __init__(
        self,
        nursery: trio.Nursery,
        journal: Journal,
        clock: Clock,
        *,
        history: FinishedHistory = DEFAULT_HISTORY,
        boot: int | None = None,
    ) -> None:
        self._nursery = nursery
        self._journal = journal
        self._clock = clock
        self._history = history  # how many finished messages each queue keeps for get-one
        self._actors: dict[str, QueueActor] = {}
        #: The queues whose config has webhook push, for the push supervisor to walk: it looks every
        #: half second, and most of tens of thousands of queues have none (``_notice_config``).
        self._pushing: dict[str, QueueActor] = {}
        #: Queues there were when the collector was last told to leave what lives alone (``_start``).
        self._frozen_at = 0
        # Message ids are "<boot>-<n>-<seq>" in hex: unique across queues, re-creations and restarts.
        # ``boot``: the start's number (``storage.store.new_boot``), else the clock's millisecond.
        self._boot = f"{int(clock.now() * 1000) if boot is None else boot:x}"
        self._incarnations = itertools.count()
        self._stopped = False
        self._streams_ended: BrokerError | None = None
        self._shutting_down = False

    @property
    def journal(self) -> Journal:
        return self._journal

    def adopt(self, recovered: Recovered) -> None:
        """Start an actor for every recovered queue, then send on the moves a crash interrupted.

        A recovered queue numbers its new messages under this boot's prefix: a claim answers before
        its publish is fsynced, so a message that a consumer saw may be missing after a crash, and
        its seq taken again; the id (and so every lease id) must not be.

        The registry takes the queues over: ``recovered`` is emptied, so that a queue deleted later
        is freed (the caller keeps ``recovered`` for the broker's whole life)."""
        for core in recovered.queues.values():
            core.id_prefix = self._new_prefix()
            self._start(core)
        recovered.queues.clear()
        for destination, message in recovered.unsent:
            self.forward(destination, [message])
        recovered.unsent.clear()

    async def freeze_when_waiting(self) -> None:
        """At the end of start-up: let every actor run to its wait for commands, then move what lives
        out of the collector's sight (``runtime.freeze_survivors``). An actor makes a new wait (~20
        objects) each time it takes a command, here its first or the config a start declares; young,
        they were walked by every collection until they grew old: 50,000 queues' waits are a million
        objects, 0.3-0.4 s a walk while every request waited. A wait dies by its reference count when
        its queue takes its next command, frozen or not."""
        # A task made runnable now may take its step after this one's next (Trio's batches run in
        # either order), so two passes.
        await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()
        freeze_survivors()

    def _new_prefix(self) -> str:
        return f"{self._boot}-{next(self._incarnations):x}-"

    def __contains__(self, name: str) -> bool:
        return name in self._actors

    @property
    def clock(self) -> Clock:
        """The broker's clock, whose time every queue records and shows."""
        return self._clock

    def names(self) -> list[str]:
        return sorted(self._actors)

    def get(self, name: str) -> QueueActor:
        """The queue's actor; ``QueueNotFound``, or ``InvalidRequest`` for a name no queue can have."""
        actor = self._actors.get(name)
        if actor is None:
            check_queue_name(name)
            raise QueueNotFound(f"queue {name!r} does not exist")
        return actor

    async def each_with_stats(
        self, wanted: Callable[[str], bool] | None = None
    ) -> AsyncIterator[tuple[QueueActor, QueueStats]]:
        """Every queue (whose name is ``wanted``) in name order with its stats, leaving out those
        deleted meanwhile. Stats are mostly read without waking the actor (``QueueActor.stats``), so
        this passes through the scheduler every ``STATS_PER_CHECKPOINT`` queues to let other requests
        in."""
        for count, name in enumerate(self.names(), 1):
            if wanted is not None and not wanted(name):
                continue
            if count % STATS_PER_CHECKPOINT == 0:
                await trio.lowlevel.checkpoint()
            try:
                actor = self.get(name)
                stats = await actor.stats()
            except BrokerError:  # deleted
                continue
            yield actor, stats

    async def holding(self, message_id: str) -> list[str]:
        """The queues that held a message ``message_id`` as they were looked at (``QueueCore.holds``),
        the one whose prefix of this boot it starts with first; to be asked through their inboxes,
        which may then find it gone. Read without waking any actor: an id from before a restart has no
        queue's prefix, and asking every queue for it, or for an id no queue has, took 2.7 s at 20,000
        queues (and left each a new wait: ``freeze_when_waiting``); this pass takes ~1 µs a queue, and
        passes through the scheduler every ``LOOKUPS_PER_CHECKPOINT``."""
        found = []
        for count, actor in enumerate(list(self._actors.values()), 1):
            if count % LOOKUPS_PER_CHECKPOINT == 0:
                await trio.lowlevel.checkpoint()
            if actor.core.holds(message_id):
                found.append(actor)
        found.sort(key=lambda actor: (not message_id.startswith(actor.core.id_prefix), actor.name))
        return [actor.name for actor in found]

    def create(self, name: str, changes: Mapping[str, Any]) -> Reply[QueueActor]:
        """Create a queue with ``changes`` over the default config. The reply resolves once its
        creation is committed. Raises ``InvalidRequest`` for a bad name or config."""
        check_queue_name(name)
        if name in self._actors:
            raise ValueError(f"queue {name!r} exists")
        config = QueueConfig().updated(changes)
        prefix = self._new_prefix()
        actor = self._start(QueueCore(name, config, prefix, history=self._history))
        return self._committed(name, QueueCreated(config, prefix), actor, config.durable)

    def _start(self, core: QueueCore) -> QueueActor:
        actor = QueueActor(core, self._journal, self._clock, self.forward, self._notice_config)
        self._actors[core.name] = actor
        self._notice_config(actor)
        self._nursery.start_soon(actor.run, name=f"queue:{core.name}")
        if len(self._actors) >= self._frozen_at + FREEZE_EVERY:
            freeze_survivors()  # the queues made since are long-lived (``runtime.freeze_survivors``)
            self._frozen_at = len(self._actors)
        return actor

    def _notice_config(self, actor: QueueActor) -> None:
        name = actor.name
        if actor.config.push is not None and self._actors.get(name) is actor:
            self._pushing[name] = actor
        elif self._pushing.get(name) is actor:
            del self._pushing[name]

    def pushing(self) -> dict[str, QueueActor]:
        """The queues whose config has webhook push, and their actors."""
        return dict(self._pushing)

    async def put(self, name: str, changes: Mapping[str, Any]) -> tuple[bool, ConfigChange]:
        """Create queue ``name`` with ``changes`` over the default config, or apply them to the queue
        of that name: whether it was created, and the change (``ConfigChange``). A queue deleted while
        the update waited in its inbox is created anew, as if this came after the delete (which it did:
        the update was never applied). Raises ``InvalidRequest`` for a bad name or config."""
        while True:
            actor = self._actors.get(name)
            if actor is None:
                if self._stopped:
                    raise QueueNotFound(f"queue {name!r} does not exist")  # the broker is stopping
                created = self.create(name, changes)
                config = self._actors[name].config  # as made: nothing ran since
                await created.wait()
                return True, ConfigChange(None, config, NEW_QUEUE_STATS)
            try:
                change: ConfigChange = await actor.request(UpdateConfig(changes))
            except QueueNotFound:
                if self._actors.get(name) is actor:
                    raise
                continue  # deleted meanwhile
            return False, change

    def delete(self, name: str) -> Reply[None]:
        """Remove a queue: commands sent to it and not yet applied get 404, like later ones."""
        actor = self.get(name)
        del self._actors[name]
        self._pushing.pop(name, None)
        actor.delete_nowait()
        return self._committed(name, QueueDeleted(), None, actor.config.durable)

    def _committed(self, name: str, record: Any, value: Any, durable: bool) -> Reply[Any]:
        reply: Reply[Any] = Reply()
        reply.set_value(value)
        lsn = self._journal.append(name, self._clock.now(), [record])
        if durable:
            self._journal.commit_then(lsn, reply)
        else:
            reply.resolve()
        return reply

    def forward(self, name: str, messages: Sequence[NewMessage]) -> None:
        """Hand messages that left one queue to queue ``name`` (created on demand). Never blocks: when
        the destination's inbox is full, a task in the root nursery waits for room."""
        if self._stopped:
            log.error("transfer_dropped_at_shutdown", queue=name, messages=len(messages))
            return
        command = Receive(messages)
        actor = self._actors.get(name)
        if actor is None:
            self.create(name, {})
            actor = self._actors[name]
            log.info("queue_created_on_demand", queue=name)
        if not actor.post_nowait(command):
            self._nursery.start_soon(self._forward_later, name, actor, command)

    async def _forward_later(self, name: str, actor: QueueActor, command: Receive) -> None:
        try:
            await actor.post(command)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            # Deleted meanwhile: the copies go with it, as they would from its inbox, and as recovery has
            # it (their move was journaled before the deletion), rather than to a queue made anew.
            log.info("moved_messages_deleted_with_queue", queue=name, messages=len(command.messages))

    async def redrive(self, queue: str, ids: Sequence[str] | None, to: str | None) -> RedriveOutcome:
        """Move messages out of ``queue`` (a dead-letter queue) to ``to``, or back where each came from.
        Only to queues that exist: ``to`` must, and a message whose origin is gone stays, reported.

        Every message (``ids`` ``None``) is moved ``REDRIVE_SLICE`` at a time, each slice its own command:
        in one, 100,000 messages held the event loop, every queue and ``/healthz`` with it, for 4 to 9
        seconds. Messages that arrive meanwhile stay; one that went meanwhile is not reported."""
        actor = self.get(queue)
        if to is not None:
            if to == queue:
                raise InvalidRequest(f"to must name another queue than {queue!r}")
            self.get(to)
        # The queues that exist when the actor applies the command, not when it was sent: it may wait in
        # the inbox while a destination is deleted, and a move to it would create it again on demand.
        destinations = self._actors.keys()
        if ids is not None:
            outcome: RedriveOutcome = await actor.request(Redrive(ids, to, destinations))
            return outcome
        waiting, leased = await actor.request(ListMovable())
        redriven = 0
        skipped = [(message_id, "in_flight") for message_id in leased]
        for start in range(0, len(waiting), REDRIVE_SLICE):
            chosen = waiting[start : start + REDRIVE_SLICE]
            try:
                outcome = await actor.request(Redrive(chosen, to, destinations))
            except QueueNotFound:
                if start == 0:
                    raise
                break  # deleted meanwhile, with what was left in it: the answer says what moved before
            redriven += outcome.redriven
            skipped += outcome.skipped
        return RedriveOutcome(redriven, (), tuple(skipped))

    @property
    def shutting_down(self) -> bool:
        """True once ``begin_shutdown`` was called: the HTTP layer refuses new requests."""
        return self._shutting_down

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on and end every push stream, releasing its leases."""
        self._shutting_down = True
        self.end_streams()

    def end_streams(self, error: BrokerError | None = None) -> None:
        """End every push stream (§7) with ``error`` as its last event (default: the broker is shutting
        down) and refuse new ones; each queue releases the leases its streams held and answers its
        long polls, empty."""
        error = error or ShuttingDown("the broker is shutting down; reconnect to another or later")
        if self._streams_ended is not None:
            return
        self._streams_ended = error
        command = EndStreams(error)
        for actor in self._actors.values():
            try:
                if not actor.post_nowait(command):
                    self._nursery.start_soon(self._post_when_room, actor, command)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                continue  # its task ended already (the broker is being cancelled): nothing to end

    @staticmethod
    async def _post_when_room(actor: QueueActor, command: EndStreams) -> None:
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            await actor.post(command)

    def check_streams_open(self) -> None:
        """Raise the error streams were ended with, once ``end_streams`` was called."""
        if self._streams_ended is not None:
            raise self._streams_ended

    def stop_all(self) -> None:
        self.end_streams()
        self._stopped = True
        self._pushing.clear()
        for name in list(self._actors):
            self._actors.pop(name).stop_nowait()
