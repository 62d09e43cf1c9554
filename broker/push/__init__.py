"""Webhook push (docs/push.md): the broker POSTs each message of a queue to the queue's URL.

``PushSupervisor`` runs one ``Dispatcher`` per queue whose config has ``push``; a dispatcher is one
more consumer of its queue (claims under a lease, settles with ack, nack, defer). ``request`` holds the
envelope, the signature scheme and what each answer means; ``acks`` the ack-mode callbacks by message
id; ``history`` each message's recent push attempts; ``secrets`` shows a new signing secret once.
"""

from __future__ import annotations

from broker.push.dispatcher import Dispatcher
from broker.push.supervisor import PushSupervisor

__all__ = ["Dispatcher", "PushSupervisor"]
