"""A lease-based, at-least-once job broker over HTTP.

Layers, each importing only those before it::

    broker.errors, broker.core   pure queue logic: no I/O, no clock, no event loop
    broker.journal               where records go (the in-memory journal; durable one later)
    broker.actor, broker.registry  one Trio task per queue, and the map of queues to actors
    broker.http                  Quart-trio routes: parse, send one command, serialise the reply
    broker.server, broker.cli    the root nursery and the `broker` command
"""

__version__ = "0.1.0"
