"""The client's copy of the broker's duration grammar (``broker/client/durations.py``) reads every
string as the broker does, and refuses what the broker refuses."""

from __future__ import annotations

import math

import pytest

from broker.client import durations
from broker.core import parse_duration
from broker.errors import InvalidRequest

TEXTS = [
    "30", "2.5", ".5", "250ms", "30s", " 5m ", "12h", "1d", "0", "1.5h", "5 m", "1e3", "-1", "1_000", "nan",
    "inf", "-inf", "1e999", "", "m", "5x", "1.2.3", "5 ms s", "\u0663s", "\uff15s", "0x10", "1/2", "5S",
]  # fmt: skip


@pytest.mark.parametrize("text", TEXTS)
def test_a_string_reads_as_the_broker_reads_it(text: str) -> None:
    try:
        mine: float | None = durations.seconds(text)
    except ValueError:
        mine = None
    try:
        theirs: float | None = parse_duration(text, "field", low=-math.inf)
    except InvalidRequest:
        theirs = None
    assert mine == theirs


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 10**400])
def test_numbers_json_cannot_carry_are_refused(value: float) -> None:
    with pytest.raises(ValueError, match="not a finite number of seconds"):
        durations.seconds(value)


@pytest.mark.parametrize("value", [True, None, [5], b"5s"])
def test_other_types_are_refused(value: object) -> None:
    with pytest.raises(TypeError, match="a duration is a number of seconds"):
        durations.seconds(value)  # type: ignore[arg-type]


def test_negative_zero_is_zero() -> None:
    assert math.copysign(1, durations.seconds(-0.0)) == 1
