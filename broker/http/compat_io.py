"""How the compatibility surfaces read requests and answer (docs/compat.md), on ``quart_io``'s helpers.

The systems they stand in for read a body as JSON whatever its ``Content-Type`` says (``curl --data``
sends a form type), and answer JSON only; CBOR stays available when a body is labelled so, as on the
native API. A body over the limit is refused as on the native API (``quart_io.read_body``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quart import Response

from broker.http.quart_io import no_content, read_body, read_object, respond

__all__ = [
    "json_response",
    "lenient_body",
    "lenient_body_with_cbor_flag",
    "no_content",
    "object_body",
    "object_body_with_cbor_flag",
]


def json_response(data: Any, status: int = 200) -> Response:
    return respond(data, status, cbor=False)


async def lenient_body_with_cbor_flag() -> tuple[Any, bool]:
    """The request's body, decoded as JSON unless it is labelled CBOR, and whether it was CBOR: a CBOR
    value may hold what JSON cannot (NaN, a date, a UUID…), which a route that keeps a value as JSON
    must refuse (``parse.publish``'s ``from_cbor``) rather than let the encoder change it."""
    return await read_body(lenient=True)


async def lenient_body() -> Any:
    """``lenient_body_with_cbor_flag``'s body, for a route that keeps no value of it as JSON."""
    return (await lenient_body_with_cbor_flag())[0]


async def object_body_with_cbor_flag() -> tuple[Mapping[str, Any], bool]:
    """``lenient_body_with_cbor_flag``, whose body must be an object."""
    return await read_object(lenient=True)


async def object_body() -> Mapping[str, Any]:
    """``object_body_with_cbor_flag``'s body, for a route that keeps no value of it as JSON."""
    return (await object_body_with_cbor_flag())[0]
