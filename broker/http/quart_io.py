"""How the Quart routes (``app.py``, ``push_routes.py``, the compatibility surfaces through
``compat_io.py``, ``operations.py``) read a request's body and answer.

A body is decoded by ``parse.decode_body``: JSON, or CBOR when labelled so. The compatibility surfaces
read it ``lenient``: as JSON whatever its ``Content-Type`` says, unless that names CBOR (docs/compat.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quart import Response, request

from broker.errors import InvalidRequest
from broker.http import parse
from broker.http.render import encode
from broker.http.routes import body_too_large


def prefers_cbor() -> bool:
    """Whether the request's ``Accept`` prefers CBOR answers (``parse.wants_cbor``)."""
    return parse.wants_cbor(request.headers.get("Accept"))


def respond(data: Any, status: int = 200, *, cbor: bool | None = None) -> Response:
    """``data`` encoded as the request prefers (``prefers_cbor``), or in CBOR or JSON as ``cbor`` says."""
    body, media_type = encode(data, prefers_cbor() if cbor is None else cbor)
    return Response(body, status, content_type=media_type)


def no_content() -> Response:
    """204, with no ``Content-Type`` (there is no content to have a type)."""
    response = Response(b"", 204)
    del response.headers["Content-Type"]
    return response


async def read_body(*, lenient: bool = False) -> tuple[Any, bool]:
    """The request's body, decoded, and whether it was CBOR (a CBOR value may hold what JSON cannot: a
    route that keeps a value as JSON must refuse it, as ``parse.publish``'s ``from_cbor`` does).

    ``lenient``: read as JSON whatever the ``Content-Type`` says, unless it names CBOR (the compatibility
    surfaces), rather than 415 for a type that is neither. A ``Content-Length`` over the limit is refused
    before anything is read, naming both (``routes.body_too_large``, as the fast path does); a body that
    grows past the limit is refused by Quart as it reads, with its own 413."""
    length, limit = request.content_length, request.max_content_length
    if length is not None and limit is not None and length > limit:
        raise body_too_large(length, limit)
    data = await request.get_data(cache=False)
    raw = data if isinstance(data, bytes) else data.encode()
    content_type = request.content_type
    if lenient and not (content_type and parse.CBOR in content_type):
        content_type = parse.JSON
    return parse.decode_body(content_type, raw)


async def read_object(*, lenient: bool = False) -> tuple[Mapping[str, Any], bool]:
    """``read_body``, whose body must be an object: "a JSON object" when read ``lenient`` (the
    compatibility surfaces, where bodies are JSON), else "an object" (JSON or CBOR)."""
    decoded, from_cbor = await read_body(lenient=lenient)
    if not isinstance(decoded, Mapping):
        raise InvalidRequest(f"the body must be {'a JSON object' if lenient else 'an object'}")
    return decoded, from_cbor
