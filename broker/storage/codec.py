"""The one place that calls cbor2: CBOR for HTTP bodies now, and for journal records and the Spark
tool later, so every reader and writer agrees on one encoding."""

from __future__ import annotations

from typing import Any

import cbor2

from broker.errors import InvalidRequest


def cbor_dumps(value: Any) -> bytes:
    return cbor2.dumps(value)


def cbor_loads(data: bytes) -> Any:
    """Decode CBOR, turning any decoding failure into ``InvalidRequest``."""
    try:
        return cbor2.loads(data)
    except Exception as error:  # cbor2 raises several unrelated types for bad input
        raise InvalidRequest(f"the body is not valid CBOR: {error}") from None
