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


async def lenient_body() -> Any:
    """The request's body, decoded as JSON unless it is labelled CBOR."""
    data = await request.get_data(cache=False)
    raw = data if isinstance(data, bytes) else data.encode()
    content_type = request.content_type or ""
    return parse.decode_body(content_type if parse.CBOR in content_type else parse.JSON, raw)[0]


async def object_body() -> Mapping[str, Any]:
    """``lenient_body``, which must be an object."""
    decoded = await lenient_body()
    if not isinstance(decoded, Mapping):
        raise InvalidRequest("the body must be a JSON object")
    return decoded
