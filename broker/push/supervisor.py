"""Keeps one push dispatcher running for every queue whose config has ``push``.

One long-lived task (``await nursery.start(supervisor.run)`` in the root nursery) that reconciles
dispatchers with the queues: every ``poll_interval`` (0.5 s) it reads the queues whose config has push
(``Registry.pushing``, which the registry keeps as configs change, so that tens of thousands of queues
without push cost nothing here), starts a dispatcher for one that has none running (or whose actor
changed: the queue was deleted and made again), and stops the dispatcher of a queue that lost push or
was deleted. The price of polling is that push starts (or stops) up to half a second after the config
says so. Changes within push (URL, mode, concurrency, secret) need no restart: a dispatcher reads its
config before each claim.

``aclose()`` ends every dispatcher and returns once each has released the leases it held (and ``run``
has returned); the server awaits it before stopping the actors, whose inboxes take those releases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import structlog
import trio

from broker.clock import Clock
from broker.core.commands import Command
from broker.push.acks import AckBook
from broker.push.dispatcher import Dispatcher
from broker.push.request import Attempt
from broker.push.transport import Transport
from broker.registry import Registry

log = structlog.get_logger("broker.push")


class PushSupervisor:
    def __init__(
        self,
        registry: Registry,
        clock: Clock,
        *,
        poll_interval: float = 0.5,
        transport: Transport | None = None,
    ) -> None:
        """``transport``: what every dispatcher sends its requests through, instead of a connection
        pool of its own (tests inject an in-memory receiver)."""
        self._registry = registry
        self._clock = clock
        self._poll_interval = poll_interval
        self._transport = transport
        self._dispatchers: dict[str, Dispatcher] = {}
        self._nursery: trio.Nursery | None = None
        self._finished = trio.Event()  # set when ``run`` has returned: every dispatcher is done
        self._claiming = True  # until ``stop_claiming``
        self.acks = AckBook()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.reconcile()
                task_status.started()
                while True:
                    await trio.sleep(self._poll_interval)
                    self.reconcile()
        finally:
            self._finished.set()

    def stop(self) -> None:
        """Stop every dispatcher (each releases its leases as it ends) and the supervisor, without
        waiting for them: ``aclose`` waits."""
        for dispatcher in self._dispatchers.values():
            dispatcher.stop()
        self._dispatchers.clear()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def stop_claiming(self) -> None:
        """The broker begins a graceful stop: no dispatcher claims anything more, and none starts, while
        the pushes in flight go on until ``aclose`` (docs/operations.md, "What a graceful stop does")."""
        self._claiming = False
        for dispatcher in self._dispatchers.values():
            dispatcher.stop_claiming()

    async def aclose(self) -> None:
        """Stop as ``stop`` does and return once every dispatcher has ended, its leases released.

        The server awaits this before it stops the actors: a dispatcher releases its leases by posting
        a ``Release`` to its queue's actor as it ends, which must find the actor still running, or the
        messages would stay leased (and unjournaled) until the broker's next start."""
        self.stop()
        if self._nursery is not None:  # ``run`` started, so it sets ``_finished`` as it returns
            await self._finished.wait()

    def reconcile(self) -> None:
        """Start and stop dispatchers to match the queues' configs now."""
        nursery = self._nursery
        if nursery is None or nursery.cancel_scope.cancel_called:
            return
        wanted = self._registry.pushing()
        for name, dispatcher in list(self._dispatchers.items()):
            if wanted.get(name) is not dispatcher.actor:
                dispatcher.stop()
                del self._dispatchers[name]
        for name, actor in wanted.items():
            running = self._dispatchers.get(name)
            if running is not None:
                running.notice_config(actor.config.push)
            elif self._claiming:
                dispatcher = Dispatcher(name, actor, self._clock, self.acks, self._transport)
                self._dispatchers[name] = dispatcher
                nursery.start_soon(self._run, dispatcher, name=f"push:{name}")

    async def _run(self, dispatcher: Dispatcher) -> None:
        try:
            await dispatcher.run()
        except Exception:  # a bug: the next reconcile starts a fresh dispatcher
            log.exception("push_dispatcher_failed", queue=dispatcher.queue)
            await trio.sleep(self._poll_interval * 10)
        if self._dispatchers.get(dispatcher.queue) is dispatcher:  # it ended on its own
            del self._dispatchers[dispatcher.queue]

    # -- what the HTTP layer asks -----------------------------------------------------------------

    def status(self, queue: str) -> dict[str, Any] | None:
        """The push state of ``queue`` (see ``Dispatcher.status``); ``None`` when none runs for it."""
        dispatcher = self._dispatchers.get(queue)
        return None if dispatcher is None else dispatcher.status()

    def history(self, queue: str, message_id: str) -> list[Attempt] | None:
        """The push attempts of one message (newest ``History.PER_MESSAGE``), ``None`` when unknown."""
        dispatcher = self._dispatchers.get(queue)
        return None if dispatcher is None else dispatcher.history.of(message_id)

    def queue_of(self, message_id: str) -> str | None:
        """The queue of a message that waits for (or recently got) its ack-mode callback."""
        return self.acks.queue_of(message_id)

    async def settle(
        self,
        message_id: str,
        verb: str,
        command: Callable[[Sequence[str]], Command],
        lease_id: str | None = None,
    ) -> dict[str, Any]:
        """Carry out an ack-mode callback (``AckBook.settle``)."""
        return await self.acks.settle(message_id, verb, command, lease_id)
