"""``GET /v1/queues/{queue}/work`` (§7): deliveries pushed as Server-Sent Events, served at the ASGI level.

The route holds no queue logic: it parses the query, hands a ``Stream`` to the queue's actor (which
keeps it filled, see ``broker/stream.py``), and renders what comes out of it:

- a ``stream-id`` response header naming the stream, for its stop call (``POST
  /v1/queues/{queue}/work/{stream_id}/stop``, in ``routes.py``);
- each delivery as ``event: message`` / ``id: <seq>`` / ``data: <delivery JSON>`` (the shape of a claim's
  delivery; bytes as base64 with ``"payload_encoding": "base64"``), all that is waiting in one write
  (in writes of about ``CHUNK`` bytes when it is more);
- ``event: stopped`` with ``{"stream", "held"}`` once the stream was stopped, after every delivery
  pushed before the stop: the client then knows nothing more is coming;
- a comment line (``: heartbeat``) whenever nothing was written for ``STREAM_HEARTBEAT`` seconds (the app
  config, 15 by default), so proxies and clients can tell an idle stream from a dead one;
- ``event: error`` with ``{"code", "message"}`` as the last event when the broker ends the stream (the
  queue was deleted, the broker is shutting down), then the end of the response.

It is served by the fast path (``fastpath.py``) rather than by a Quart view: a stream has no response
timeout here (Quart's ``RESPONSE_TIMEOUT`` would end it after 60 s), and the client hanging up is seen
at once, because one task waits for ``http.disconnect`` while the other writes. Whenever the response
ends, for whatever reason, the stream is closed and the actor releases every lease it still holds;
those the client never received get their attempt refunded.

A client that stops reading blocks the write under way (its socket's buffer is full); the stream's
slots still count what waits to be written, so it takes nothing more. A delivery whose lease ended
while it waited is dropped rather than written, and after every write the pump tells the stream what
went out, asking the actor to refill it when that ended a stall (``broker/stream.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl

import orjson
import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope

from broker.clock import format_time
from broker.config import Limits
from broker.core.model import Delivery
from broker.errors import BrokerError, NotAcceptable
from broker.http import parse, render
from broker.http.asgi import cancel_on_disconnect
from broker.http.connection import ClientLink, client_link
from broker.http.observe import bind_request
from broker.http.render import send_error
from broker.registry import Registry
from broker.stream import (
    HEARTBEAT_INTERVAL,
    CloseStream,
    OpenStream,
    ResumeStream,
    Stopped,
    Stream,
    StreamItem,
)

EVENT_STREAM = "text/event-stream"

#: The app config key of the heartbeat interval in seconds.
HEARTBEAT_CONFIG = "STREAM_HEARTBEAT"

#: Seconds a closing stream may wait for room in the actor's inbox to hand its leases back; past it,
#: they are left to expire.
CLOSE_TIMEOUT = 10.0

_HEADERS = [
    (b"content-type", EVENT_STREAM.encode()),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),  # tells nginx-like proxies not to buffer the stream
]
#: The response header that names the stream (for its stop call).
STREAM_ID_HEADER = b"stream-id"
#: The response header with the broker's time as the stream opens: what its ``lease_deadline``s are
#: measured by, for a worker whose own clock may not agree (docs/workers.md).
BROKER_TIME_HEADER = b"broker-time"
_OPENED = b": stream open\n\n"
#: Bytes of events past which what is waiting goes out in more than one write (see ``_pump``).
CHUNK = 64 * 1024
_HEARTBEAT = b": heartbeat\n\n"


def message_events(deliveries: Sequence[Delivery]) -> list[bytes]:
    """Deliveries as SSE ``message`` events, one each."""
    rendered = render.delivery_list(deliveries, False)
    return [
        b"event: message\nid: %d\ndata: %s\n\n" % (message.seq, orjson.dumps(shown))
        for (_, message), shown in zip(deliveries, rendered, strict=True)
    ]


def stopped_event(stream: Stream, stopped: Stopped) -> bytes:
    """The marker that the stream was stopped, as an SSE ``stopped`` event."""
    return b"event: stopped\ndata: %s\n\n" % orjson.dumps({"stream": stream.id, "held": stopped.held})


def error_event(error: BrokerError) -> bytes:
    return b"event: error\ndata: %s\n\n" % orjson.dumps({"code": error.code, "message": error.message})


def _accepts_event_stream(scope: HTTPScope) -> bool:
    for name, value in scope["headers"]:
        if name.lower() == b"accept" and parse.names_media(value.decode("latin-1"), EVENT_STREAM):
            return True
    return False


class WorkRoute:
    """The ``/work`` stream's ASGI handler, called by the fast path with the queue name."""

    def __init__(self, registry: Registry, limits: Limits, config: Mapping[str, Any]) -> None:
        self._registry = registry
        self._limits = limits
        self._config = config

    async def __call__(
        self, queue: str, scope: HTTPScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        try:
            actor = self._registry.get(queue)
            query = parse.query_values(
                parse_qsl(scope["query_string"].decode("latin1"), keep_blank_values=True)
            )
            claim = parse.work(query, self._limits)
            if not _accepts_event_stream(scope):
                raise NotAcceptable(f"the work stream is only served as {EVENT_STREAM}: send that in Accept")
            self._registry.check_streams_open()
        except Exception as error:
            await send_error(send, scope, error)
            return
        bind_request(consumer=claim.consumer)  # on the stream's log lines, its request line too (§10)
        stream = Stream(claim.consumer, claim.max_count, claim.lease)
        try:
            try:
                await actor.request(OpenStream(stream))
            except BrokerError as error:  # the queue was deleted meanwhile
                await send_error(send, scope, error)
                return
            headers = [
                *_HEADERS,
                (STREAM_ID_HEADER, stream.id.encode()),
                (BROKER_TIME_HEADER, format_time(self._registry.clock.now()).encode()),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": _OPENED, "more_body": True})
            heartbeat: float = self._config.get(HEARTBEAT_CONFIG, HEARTBEAT_INTERVAL)

            async def resume() -> None:
                # A queue deleted meanwhile ends the stream with its error instead.
                with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                    await actor.post(ResumeStream(stream))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_on_disconnect, receive, nursery.cancel_scope)
                await _pump(stream, send, client_link(scope), heartbeat, resume)
                nursery.cancel_scope.cancel()
        finally:
            unsent = stream.close_nowait()
            # The release must happen even though this task is being cancelled (the client left); a
            # queue that is gone took its leases with it.
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(CLOSE_TIMEOUT),
                contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError),
            ):
                await actor.post(CloseStream(stream, unsent))


async def _pump(
    stream: Stream,
    send: ASGISendCallable,
    link: ClientLink,
    heartbeat: float,
    resume: Callable[[], Awaitable[None]],
) -> None:
    """Write deliveries as they come, a heartbeat when idle, and the error that ends the stream; after
    the writes, ``resume`` the stream's refill if they ended a stall.

    Everything waiting goes out in one write, or in writes of about ``CHUNK`` bytes when it is more
    (big payloads): the stream is told before each write which deliveries it carries, so when the
    client leaves (or the broker ends the stream) during a write, those not yet in a write are
    released unseen, their attempt refunded, rather than counted with the whole lot. A write that
    waited (its client reads slowly, or not at all) is followed by two checks before anything more is
    counted as sent: that the client is still there (``link``: once a write failed, ``send`` returns at
    once and writes nothing), and that the deliveries still to write did not go stale meanwhile."""
    while True:
        item: StreamItem | None = None
        with trio.move_on_after(heartbeat):
            item = await stream.receive()
        if item is None:
            await send({"type": "http.response.body", "body": _HEARTBEAT, "more_body": True})
            if link.lost:
                return
            continue
        body = bytearray()
        count = 0  # the deliveries taken since the last write (stale ones included)
        while item is not None:
            if isinstance(item, BrokerError):  # what was taken and not written is not: the end released it
                await send({"type": "http.response.body", "body": error_event(item), "more_body": False})
                return
            if isinstance(item, Stopped):
                body += stopped_event(stream, item)
            else:
                # A delivery whose lease ended while it waited is not written: the message went back
                # to the queue (perhaps to another consumer already), and its lease id is stale.
                count += len(item) - len(current := stream.current(item))
                stale = stream.stale  # the stream's own set: it sees what goes stale during a write
                for delivery, event in zip(current, message_events(current), strict=True):
                    count += 1
                    if stale and delivery[0].lease_id in stale:  # during a write of this batch's start
                        continue
                    body += event
                    if len(body) >= CHUNK:
                        stream.sending(count)
                        await send({"type": "http.response.body", "body": bytes(body), "more_body": True})
                        body.clear()
                        count = 0
                        if link.lost:  # nothing more reaches the client: the rest is released unsent
                            return
                        if stream.closed:  # ended meanwhile: the rest was released, never to be written
                            break
            item = stream.receive_nowait()
        if count:
            stream.sending(count)
        if body:
            await send({"type": "http.response.body", "body": bytes(body), "more_body": True})
            if link.lost:
                return
        # Only once the write returned does the client have these: until then they hold their slots.
        if stream.written_nowait():
            await resume()
