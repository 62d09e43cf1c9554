"""How the compatibility surfaces read requests and answer (docs/compat.md).

The systems they stand in for read a body as JSON whatever its ``Content-Type`` says (``curl --data``
sends a form type), and answer JSON only; CBOR stays available when a body is labelled so, as on the
native API.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quart import Response, request

from broker.errors import InvalidRequest
from broker.http import parse
from broker.http.routes import encode


def json_response(data: Any, status: int = 200) -> Response:
    body, media_type = encode(data, False)
    return Response(body, status, content_type=media_type)


def no_content() -> Response:
    response = Response(b"", 204)
    del response.headers["Content-Type"]
    return response


async def lenient_body_with_cbor_flag() -> tuple[Any, bool]:
    """The request's body, decoded as JSON unless it is labelled CBOR, and whether it was CBOR: a CBOR
    value may hold what JSON cannot (NaN, a date, a UUID…), which a route that keeps a value as JSON
    must refuse (``parse.publish``'s ``from_cbor``) rather than let the encoder change it."""
    data = await request.get_data(cache=False)
    raw = data if isinstance(data, bytes) else data.encode()
    content_type = request.content_type or ""
    return parse.decode_body(content_type if parse.CBOR in content_type else parse.JSON, raw)


async def lenient_body() -> Any:
    """``lenient_body_with_cbor_flag``'s body, for a route that keeps no value of it as JSON."""
    return (await lenient_body_with_cbor_flag())[0]


async def object_body_with_cbor_flag() -> tuple[Mapping[str, Any], bool]:
    """``lenient_body_with_cbor_flag``, whose body must be an object."""
    decoded, from_cbor = await lenient_body_with_cbor_flag()
    if not isinstance(decoded, Mapping):
        raise InvalidRequest("the body must be a JSON object")
    return decoded, from_cbor


async def object_body() -> Mapping[str, Any]:
    """``object_body_with_cbor_flag``'s body, for a route that keeps no value of it as JSON."""
    return (await object_body_with_cbor_flag())[0]
