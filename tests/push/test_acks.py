"""``AckBook`` on its own: which delivery of a message a callback or the dispatcher settles, when the
message is pushed again while an earlier delivery still waits (no broker: a fake actor answers)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from broker.actor import QueueActor
from broker.core.commands import Command, Nack
from broker.errors import Conflict, StorageUnavailable
from broker.push.acks import AckBook, Waiting


class FailingAfterApplying:
    """An actor whose settle is applied, then answered 503 (the journal's fault), while ``meanwhile``
    runs in between: what happens when the applied nack makes the message pushed again at once."""

    def __init__(self, meanwhile: Any) -> None:
        self.meanwhile = meanwhile

    async def request(self, command: Command) -> Any:
        self.meanwhile()
        raise StorageUnavailable("the journal cannot be written; nothing was acknowledged")


async def test_a_delivery_whose_callback_failed_after_a_new_push_began_waits_no_more() -> None:
    """The callback's nack was applied (the 503 of a storage fault keeps its change) and the message was
    pushed again before the 503 came back: the earlier delivery was left waiting in no book, and its push
    held its slot for ever (its ack_timeout never took it: another delivery waited)."""
    book = AckBook()
    second = Waiting("jobs", cast(QueueActor, None), "m.2")
    actor = FailingAfterApplying(lambda: book.enter("m", second))
    first = Waiting("jobs", cast(QueueActor, actor), "m.1")
    book.enter("m", first)
    with pytest.raises(StorageUnavailable):
        await book.settle("m", "nack", lambda leases: Nack(leases), lease_id="m.1")
    assert first.settled.is_set() and first.verb == "superseded"
    assert book.take("m", "m.1", "ack_timeout") is None
    assert book.take("m", "m.2", "ack_timeout") is second  # the new delivery is the one that waits
    with pytest.raises(Conflict, match="pushed again"):
        await book.settle("m", "nack", lambda leases: Nack(leases), lease_id="m.1")


async def test_a_delivery_whose_callback_failed_may_be_called_back_again() -> None:
    book = AckBook()
    waiting = Waiting("jobs", cast(QueueActor, FailingAfterApplying(lambda: None)), "m.1")
    book.enter("m", waiting)
    with pytest.raises(StorageUnavailable):
        await book.settle("m", "nack", lambda leases: Nack(leases), lease_id="m.1")
    assert waiting.verb is None and not waiting.settled.is_set()
    assert book.take("m", "m.1", "ack_timeout") is waiting


async def test_a_callback_that_failed_after_its_push_ended_is_no_superseded_delivery() -> None:
    """No other delivery waits (the push ended meanwhile, its 2xx in): the failed callback was not
    overtaken by a new push, and must not be told so; the settlement it asked for did not happen."""
    book = AckBook()
    waiting: Waiting
    actor = FailingAfterApplying(lambda: book.leave("m", waiting))
    waiting = Waiting("jobs", cast(QueueActor, actor), "m.1")
    book.enter("m", waiting)
    with pytest.raises(StorageUnavailable):
        await book.settle("m", "nack", lambda leases: Nack(leases), lease_id="m.1")
    assert waiting.verb is None and not waiting.settled.is_set()


async def test_a_superseded_delivery_leaves_the_message_s_last_outcome_to_the_new_one() -> None:
    book = AckBook()
    second = Waiting("jobs", cast(QueueActor, None), "m.2")
    first = Waiting("jobs", cast(QueueActor, FailingAfterApplying(lambda: book.enter("m", second))), "m.1")
    book.enter("m", first)
    with pytest.raises(StorageUnavailable):
        await book.settle("m", "nack", lambda leases: Nack(leases), lease_id="m.1")
    second.verb = "ack"  # its own callback is being carried out
    with pytest.raises(Conflict, match="being settled by another call"):
        await book.settle("m", "nack", lambda leases: Nack(leases))
