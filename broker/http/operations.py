"""What an operator's tools talk to (§10): ``GET /metrics``, ``GET /openapi.json``, and the layers
every request passes first: ``observe.Observer`` (request id, log line, timing), then
``drain.Drain`` (refusals once a shutdown began), then ``auth.Gate`` (tokens and scopes, when any
are configured).

``install`` adds them to an app that ``create_app`` made, once, before it serves.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio
from quart import Response
from quart_trio import QuartTrio

from broker.config import Token
from broker.http.auth import Gate
from broker.http.drain import Drain
from broker.http.observe import Observer
from broker.http.openapi import document
from broker.http.quart_io import respond
from broker.metrics import CONTENT_TYPE, RequestTimes, render
from broker.registry import Registry
from broker.storage.durable import DurableJournal


def install(app: QuartTrio, registry: Registry, tokens: Sequence[Token] = ()) -> RequestTimes:
    """Add the routes and the outer layers; returns the request timings ``/metrics`` reports."""
    times = RequestTimes()

    @app.get("/metrics")
    async def metrics() -> Response:
        queues = {actor.name: stats async for actor, stats in registry.each_with_stats()}
        journal = registry.journal
        figures = journal.statistics() if isinstance(journal, DurableJournal) else None
        # Written in a thread, from copies: on the event loop, a scrape of 5,000 queues held every other
        # request up for 0.4-0.8 s (an operator review; bench/stalls.py, docs/benchmarks.md).
        text = await trio.to_thread.run_sync(render, queues, figures, times.copy())
        return Response(text, 200, content_type=CONTENT_TYPE)

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return respond(document())

    inner = app.asgi_app
    if tokens:
        inner = Gate(inner, tokens)
    inner = Drain(inner, lambda: registry.shutting_down)
    app.asgi_app = Observer(inner, times)  # type: ignore[method-assign]
    return times
