"""Durations as the broker reads them (§2): a number of seconds, or a string with a unit (``250ms``,
``30s``, ``5m``, ``12h``, ``1d``). The client side (the worker, the ``broker`` command) checks them
before sending, so it reads them as the broker does; this is its copy of ``broker/core/durations.py``'s
grammar, because the client imports nothing of the server. ``tests/client/test_durations.py`` keeps the
two in step."""

from __future__ import annotations

import math
import re

PATTERN = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*(ms|s|m|h|d)?\s*", re.ASCII)  # ASCII digits
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def seconds(value: float | str) -> float:
    """``value`` in seconds: ``ValueError`` for a string that is no duration, and for NaN and the
    infinities (JSON has neither, and the broker refuses both); ``TypeError`` for anything but a number
    or a string. Ranges are the caller's."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(
            f"a duration is a number of seconds or a string like '30s', not {type(value).__name__}"
        )
    if isinstance(value, str):
        match = PATTERN.fullmatch(value)
        if match is None:
            raise ValueError(f"{value!r} is not a duration: seconds, or with a unit: 250ms, 30s, 5m, 12h, 1d")
        result = float(match.group(1)) * UNITS[match.group(2) or "s"]
    else:
        try:
            result = float(value)
        except OverflowError:  # an integer beyond any float
            result = math.inf
    if not math.isfinite(result):
        raise ValueError(f"{value!r} is not a finite number of seconds")
    return result + 0.0  # -0.0 is 0
