"""What the layers served at the ASGI level share (the observer, the drain, the token gate, the fast path
and the push stream): the type of what they wrap, and watching for the client to hang up. Their error
answers are ``render.send_error``'s."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

#: An ASGI application: Quart's ``asgi_app``, or a layer around it.
ASGIApp = Callable[[Scope, ASGIReceiveCallable, ASGISendCallable], Awaitable[None]]


async def cancel_on_disconnect(receive: ASGIReceiveCallable, cancel_scope: trio.CancelScope) -> None:
    """Cancel ``cancel_scope`` once the client hangs up (``http.disconnect``), reading and dropping
    whatever else arrives until then: run beside a response that lasts (a long poll, a push stream)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    cancel_scope.cancel()
