"""The one lookup the compatibility surfaces share: which lease settles a message now.

qhook settles by message id, and Cloudflare accepts a lease id after its message was delivered again;
both need the message's *current* lease, which only its queue's actor knows. ``current_lease`` asks it
with ``GetMessage`` (no map of ids to leases is kept outside the actor, so nothing here can go stale or
grow): the live lease of a message in flight, else the lease of its latest delivery, which the core
still settles until the message is delivered again (§5) and skips otherwise.
"""

from __future__ import annotations

from broker.actor import QueueActor
from broker.core import MessageView
from broker.core.commands import GetMessage
from broker.core.records import Claimed
from broker.errors import MessageNotFound


async def current_lease(actor: QueueActor, message_id: str) -> str | None:
    """The lease that settles ``message_id`` now, or ``None`` when the message is gone or was never
    delivered."""
    try:
        view: MessageView = await actor.request(GetMessage(message_id))
    except MessageNotFound:
        return None
    if view.lease_id is not None:
        return view.lease_id
    for _, record in reversed(view.history):
        if isinstance(record, Claimed):
            return record.lease_id
    return None


async def current_leases(actor: QueueActor, message_ids: list[str]) -> list[str]:
    """``current_lease`` of each id, leaving out those with none (duplicates once)."""
    leases: list[str] = []
    for message_id in dict.fromkeys(message_ids):
        lease = await current_lease(actor, message_id)
        if lease is not None:
            leases.append(lease)
    return leases
