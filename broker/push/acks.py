"""Ack mode's callbacks: which pushed messages wait for ``POST /v1/messages/{id}/ack|nack|defer``.

Message ids are opaque, but the dispatcher knows what it pushed: while a message pushed in ack mode
waits for its callback, ``AckBook`` maps its id to its queue's actor and the lease the push holds, and
the callback settles that lease like any consumer would (``Ack``, ``Nack`` or ``Defer`` to the actor).

A message is entered when its push starts (a receiver may call back before its own 2xx reaches us)
and leaves when it is settled: by its callback, by the dispatcher (the push failed, or ``ack_timeout``
passed), when the dispatcher stops, or when the message is pushed again (its lease ended another way).
The outcome of the newest ``REMEMBERED`` settlements is kept, so a callback that is retried gets the
same answer (settling is idempotent, §5), and a late one learns what happened instead of a bare 404.

A callback names a message, and a message may be pushed again once settled (a nack, a defer): a
callback retried after that would settle the new delivery. One that also names its delivery (the
envelope's ``lease_id``) settles that delivery only, and is otherwise answered from what became of it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import trio

from broker.actor import QueueActor
from broker.core.commands import Command
from broker.core.model import SettleOutcome
from broker.errors import Conflict, MessageNotFound, quoted_value

#: Callback verb → the key its count has in the answer (as in §5's answers).
PAST = {"ack": "acked", "nack": "nacked", "defer": "deferred"}

#: How the dispatcher's own settlements are described to a late callback.
_ENDED = {
    "ack_timeout": "its ack_timeout passed before a callback came",
    "push_failed": "its push did not succeed, so no callback was expected",
    "stopped": "push stopped for its queue",
    "superseded": "its lease ended and the message was pushed again",
}


#: How a delivery was settled: ``(queue, how, the answer its callback got)`` (``how``: a callback's verb,
#: or the dispatcher's reason; no answer then).
Settled = tuple[str, str, dict[str, Any] | None]


class Waiting:
    """One message waiting for its callback."""

    __slots__ = ("actor", "callback_over", "lease_id", "queue", "settled", "verb")

    def __init__(self, queue: str, actor: QueueActor, lease_id: str) -> None:
        self.queue = queue
        self.actor = actor
        self.lease_id = lease_id
        #: Set once the message is settled, by whom ``verb`` says.
        self.settled = trio.Event()
        #: ``ack``, ``nack``, ``defer``, or the dispatcher's ``ack_timeout``, ``push_failed``,
        #: ``stopped``; ``None`` while nobody has taken it.
        self.verb: str | None = None
        #: Set when the callback being carried out (``verb`` set, ``settled`` not yet) ends, settled or
        #: not (then ``verb`` is ``None`` again): what the dispatcher waits for before deciding itself.
        self.callback_over = trio.Event()

    async def callback_ended(self) -> None:
        """Return once no callback is being carried out for this delivery."""
        while self.verb is not None and not self.settled.is_set():
            await self.callback_over.wait()


class AckBook:
    REMEMBERED = 10_000

    def __init__(self) -> None:
        self._waiting: dict[str, Waiting] = {}
        # By message id, its last delivery's settlement; by (message id, lease id), each delivery's:
        # (queue, how, the answer a callback got).
        self._done: OrderedDict[str, Settled] = OrderedDict()
        self._done_leases: OrderedDict[tuple[str, str], Settled] = OrderedDict()

    def __len__(self) -> int:
        return len(self._waiting)

    def enter(self, message_id: str, waiting: Waiting) -> None:
        earlier = self._waiting.get(message_id)
        if earlier is not None and earlier.verb is None:
            # Its lease ended while it waited (an ``Extend`` that failed), and the message was pushed
            # again: the earlier push stops waiting, and a callback naming its delivery learns why.
            earlier.verb = "superseded"
            self._finish(message_id, earlier, "superseded", None)
        self._waiting[message_id] = waiting
        self._done.pop(message_id, None)  # delivered again: earlier outcomes are history

    def take(self, message_id: str, lease_id: str, verb: str) -> Waiting | None:
        """The dispatcher settles its delivery ``lease_id`` of the message itself (``verb`` says why):
        ``None`` when a callback got there first, or when the message waits as another delivery (its
        lease expired and it was pushed again: that push is not this one's to settle)."""
        waiting = self._waiting.get(message_id)
        if waiting is None or waiting.verb is not None or waiting.lease_id != lease_id:
            return None
        waiting.verb = verb
        self._finish(message_id, waiting, verb, None)
        return waiting

    def leave(self, message_id: str, waiting: Waiting) -> None:
        """Forget the message (its push task is done with it)."""
        if self._waiting.get(message_id) is waiting:
            del self._waiting[message_id]

    def queue_of(self, message_id: str) -> str | None:
        """The queue of a message waiting for (or recently given) its callback."""
        waiting = self._waiting.get(message_id)
        if waiting is not None:
            return waiting.queue
        done = self._done.get(message_id)
        return None if done is None else done[0]

    async def settle(
        self,
        message_id: str,
        verb: str,
        command: Callable[[Sequence[str]], Command],
        lease_id: str | None = None,
    ) -> dict[str, Any]:
        """Settle a waiting message as its callback asks (``verb``: ack, nack or defer), through its
        queue's actor; only its delivery ``lease_id`` when given. Raises ``MessageNotFound`` for a
        message no push waits on, ``Conflict`` for one settled otherwise meanwhile."""
        waiting = self._waiting.get(message_id)
        if lease_id is not None and (waiting is None or waiting.lease_id != lease_id):
            return self._answer_delivery_again(message_id, lease_id, verb, waiting)
        if waiting is None or waiting.verb is not None:
            return self._answer_again(message_id, verb)
        waiting.verb = verb
        waiting.callback_over = trio.Event()
        try:
            outcome: SettleOutcome = await waiting.actor.request(command([waiting.lease_id]))
        except BaseException:
            current = self._waiting.get(message_id)
            if current is None or current is waiting:
                waiting.verb = None  # not settled: the callback may be retried
            else:
                # Applied all the same (a 503 whose change the broker keeps), and the message was pushed
                # again meanwhile: this delivery waits no more, or its push would hold its slot for ever.
                waiting.verb = "superseded"
                self._finish(message_id, waiting, "superseded", None)
            raise
        finally:
            waiting.callback_over.set()
        answer: dict[str, Any] = {"id": message_id, "queue": waiting.queue, PAST[verb]: outcome.settled}
        if verb == "nack":
            answer["dead_lettered"] = outcome.dead_lettered
        if outcome.skipped:  # the lease ended underneath (deleted, purged…): nothing was settled
            self._finish(message_id, waiting, "lease_ended", None)
            raise Conflict(
                f"message {quoted_value(message_id)} is no longer leased to its push; nothing was settled"
            )
        self._finish(message_id, waiting, verb, answer)
        return answer

    def _finish(self, message_id: str, waiting: Waiting, verb: str, answer: dict[str, Any] | None) -> None:
        self.leave(message_id, waiting)
        settled = (waiting.queue, verb, answer)
        if message_id not in self._waiting:  # with a newer delivery waiting, this one is no longer its last
            self._done[message_id] = settled
        self._done_leases[message_id, waiting.lease_id] = settled
        for done in (self._done, self._done_leases):
            if len(done) > self.REMEMBERED:
                done.popitem(last=False)
        waiting.settled.set()

    def _answer_delivery_again(
        self, message_id: str, lease_id: str, verb: str, waiting: Waiting | None
    ) -> dict[str, Any]:
        """A callback for delivery ``lease_id`` of the message, which is not the one awaiting a callback
        (``waiting``, if any): answered from what became of that delivery, never applied to another."""
        done = self._done_leases.get((message_id, lease_id))
        if done is not None:
            return self._again(message_id, done, verb)
        if waiting is not None:
            # Only what is known: ``lease_id`` may be an earlier delivery whose outcome is forgotten, or
            # one never issued (a typo); telling them apart would mean parsing the core's lease ids.
            raise Conflict(
                f"lease {quoted_value(lease_id)} is not the delivery of message {quoted_value(message_id)} "
                f"that waits for a callback (that is {waiting.lease_id!r}); nothing was settled"
            )
        raise MessageNotFound(
            f"no push of message {quoted_value(message_id)} waits for a callback as {quoted_value(lease_id)}"
        )

    def _answer_again(self, message_id: str, verb: str) -> dict[str, Any]:
        done = self._done.get(message_id)
        if done is None:
            waiting = self._waiting.get(message_id)
            if waiting is not None:  # another callback for it is being carried out right now
                raise Conflict(f"message {quoted_value(message_id)} is being settled by another call")
            raise MessageNotFound(f"no push of message {quoted_value(message_id)} waits for a callback")
        return self._again(message_id, done, verb)

    @staticmethod
    def _again(message_id: str, done: Settled, verb: str) -> dict[str, Any]:
        _, how, answer = done
        if how == verb and answer is not None:
            return answer
        if how in PAST:
            raise Conflict(f"message {quoted_value(message_id)} was already {PAST[how]}")
        reason = _ENDED.get(how, "its lease ended")
        raise Conflict(f"message {quoted_value(message_id)} no longer waits for a callback: {reason}")
