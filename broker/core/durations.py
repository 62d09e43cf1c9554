"""Durations (§2): seconds as numbers, or strings with a unit such as ``250ms``, ``30s``, ``5m``, ``12h``."""

from __future__ import annotations

import math
import re

from broker.errors import InvalidRequest, quoted_value

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
#: A duration string, whole (the OpenAPI document anchors it). Written with ASCII classes only, so that
#: JSON Schema validators (ECMA-262 regexes, whose ``\s`` takes Unicode spaces) accept what this does.
DURATION_PATTERN = r"[ \t\n\r\f\v]*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)[ \t\n\r\f\v]*(ms|s|m|h|d)?[ \t\n\r\f\v]*"
_PATTERN = re.compile(DURATION_PATTERN, re.ASCII)


def parse_duration(value: object, field: str, *, low: float = 0.0, high: float = math.inf) -> float:
    """Seconds from a number or a unit string, checked to lie in ``[low, high]``.

    Raises ``InvalidRequest`` naming ``field`` for anything else.
    """
    if isinstance(value, bool):
        raise InvalidRequest(f"{field} must be a number of seconds or a string like '30s', not a boolean")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # an integer too large for a float, e.g. a CBOR bignum
            seconds = math.inf
    elif isinstance(value, str):
        match = _PATTERN.fullmatch(value)
        if match is None:
            raise InvalidRequest(
                f"{field} must be a number of seconds or a string like '250ms', '30s', '5m', '12h'; "
                f"got {quoted_value(value)}"
            )
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    else:
        raise InvalidRequest(f"{field} must be a number of seconds or a string like '30s'")
    if not math.isfinite(seconds) or not low <= seconds <= high:
        bounds = f"at least {low:.15g}" if high == math.inf else f"between {low:.15g} and {high:.15g}"
        raise InvalidRequest(f"{field} must be {bounds} seconds; got {quoted_value(value)}")
    return seconds + 0.0  # -0.0 is 0
