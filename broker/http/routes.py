"""The hot routes, each once, whichever front end serves it.

The hot routes (``POST /v1/queues/{queue}/messages|claim|ack|nack|defer|extend``, and the push
stream's stop call ``POST /v1/queues/{queue}/work/{stream_id}/stop``) are served by two
front ends: the Quart views in ``app.py`` (kept registered, so the URL map lists every route) and the
ASGI fast path in ``fastpath.py``, which serves them in practice. Each route's logic exists once, here,
as a plain function of the queue name and an ``Exchange`` (what the front end offers: the body, the
client's encoding, a long poll that ends when the client hangs up). Both front ends map every error
with the one mapping, ``render.error_answer``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from broker.config import Limits
from broker.core import ClaimOutcome, PublishedRef, SettleOutcome
from broker.core.commands import Command
from broker.core.model import CONFLICT
from broker.errors import PayloadTooLarge
from broker.http import parse, render
from broker.http.observe import bind_request
from broker.registry import Registry
from broker.stream import StopStream

T = TypeVar("T")

#: A route's answer before encoding: ``(status, plain data for JSON or CBOR)``.
Answer = tuple[int, Any]


class Exchange(Protocol):
    """One request as a hot route sees it, whichever front end serves it."""

    #: Whether the client accepts CBOR (``Accept``); the answer is JSON otherwise.
    cbor: bool

    async def read_body(self) -> tuple[Any, bool]:
        """The whole body, decoded, and whether it was CBOR. Raises the errors of ``parse.decode_body``,
        ``PayloadTooLarge`` (``body_too_large``) for a ``Content-Length`` over the limit, and werkzeug's
        413 and 408 for a body that grows past the limit or does not arrive in time."""
        ...

    async def long_poll(self, request: Callable[[Callable[[], None]], Awaitable[T]]) -> T:
        """Await ``request(on_hold)``, which may wait a long time on the client's behalf. From when
        ``on_hold`` is called (the actor keeps the request waiting rather than answering it at once), a
        client that hangs up cancels it (the actor then withdraws the claim), and no answer is sent."""
        ...


def body_too_large(length: int, limit: int) -> PayloadTooLarge:
    """The refusal of a body whose ``Content-Length`` is over the limit, before any of it is read, by
    ``Exchange.read_body`` on either front end: the fast path's, and ``quart_io.read_body``, which the
    Quart routes read with."""
    return PayloadTooLarge(f"the body is {length} bytes; the limit is {limit}")


@dataclass(frozen=True, slots=True)
class HotRoute:
    """``POST /v1/queues/<queue>/<segment>``: its Quart endpoint name and its logic,
    ``handle(queue, exchange, *parameters)``. A segment may hold path parameters in Quart's syntax
    (``work/<stream_id>/stop``); their values follow the exchange, in order."""

    segment: str
    endpoint: str
    handle: Callable[..., Awaitable[Answer]]

    @property
    def parameters(self) -> int:
        """How many path parameters the segment holds."""
        return self.segment.count("<")


#: The push stream's stop call, after ``/v1/queues/<queue>/``.
STOP_WORK = "work/<stream_id>/stop"


def hot_routes(registry: Registry, limits: Limits) -> Mapping[str, HotRoute]:
    """The hot routes by their last path segment. Each looks the queue up before reading the body, so
    a request to a queue that does not exist is 404 whatever its body."""

    async def publish(queue: str, exchange: Exchange) -> Answer:
        actor = registry.get(queue)
        body, from_cbor = await exchange.read_body()
        refs: list[PublishedRef] = await actor.request(parse.publish(body, limits, from_cbor))
        if all(outcome == CONFLICT for _, _, outcome in refs):
            return 409, render.conflict_error(refs[0][0])
        status = 200 if all(outcome for _, _, outcome in refs) else 201
        return status, render.published(refs)

    async def claim(queue: str, exchange: Exchange) -> Answer:
        actor = registry.get(queue)
        body, _ = await exchange.read_body()
        command = parse.claim(body, limits)
        bind_request(consumer=command.consumer)  # on the request's log lines
        outcome: ClaimOutcome
        if command.wait > 0 or actor.holds_claims:
            outcome = await exchange.long_poll(lambda on_hold: actor.request(command, on_hold=on_hold))
        else:
            outcome = await actor.request(command)
        return 200, render.deliveries(outcome, exchange.cbor)

    def settle(verb: str, parser: Callable[[Any, Limits], Command]) -> Callable[..., Awaitable[Answer]]:
        async def handle(queue: str, exchange: Exchange) -> Answer:
            actor = registry.get(queue)
            body, _ = await exchange.read_body()
            outcome: SettleOutcome = await actor.request(parser(body, limits))
            return 200, render.settled(outcome, verb)

        return handle

    async def stop_work(queue: str, exchange: Exchange, stream_id: str) -> Answer:
        """The push stream ``stream_id`` takes no new deliveries from now on (docs/workers.md)."""
        actor = registry.get(queue)
        parse.no_body((await exchange.read_body())[0], "the stop call")
        held: int = await actor.request(StopStream(stream_id))
        return 200, {"stream": stream_id, "held": held}

    routes = [
        HotRoute("messages", "publish", publish),
        HotRoute("claim", "claim", claim),
        HotRoute("ack", "ack", settle("acked", parse.ack)),
        HotRoute("nack", "nack", settle("nacked", parse.nack)),
        HotRoute("defer", "defer", settle("deferred", parse.defer)),
        HotRoute("extend", "extend", settle("extended", parse.extend)),
        HotRoute(STOP_WORK, "stop_work", stop_work),
    ]
    return {route.segment: route for route in routes}
