"""``parse_duration``: seconds as numbers, or strings with a unit (§2)."""

from __future__ import annotations

import math

import pytest

from broker.core import parse_duration
from broker.errors import InvalidRequest


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        (30, 30.0),
        (0.25, 0.25),
        (1.5, 1.5),
        ("30", 30.0),
        ("250ms", 0.25),
        ("0ms", 0.0),
        ("30s", 30.0),
        ("1.5s", 1.5),
        (".5s", 0.5),
        ("5m", 300.0),
        ("12h", 43200.0),
        ("1d", 86400.0),
        (" 30 s ", 30.0),
        ("2.5m", 150.0),
    ],
)
def test_numbers_and_unit_strings(value: object, seconds: float) -> None:
    result = parse_duration(value, "lease")
    assert result == seconds
    assert type(result) is float


@pytest.mark.parametrize(
    "value",
    [
        "",
        "s",
        "abc",
        "30x",
        "30 sec",
        "-5s",
        "+5s",
        "1e3",
        "5.",
        "1,5s",
        "30S",
        "5 m s",
        "ms30",
        "0x10",
        "\u0663s",
        "\uff15m",
        "5\u00a0s",  # Arabic-Indic 3, a full-width 5, a no-break space: ASCII only
    ],
)
def test_bad_strings_are_refused_naming_the_field(value: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_duration(value, "lease")
    assert caught.value.message.startswith("lease ")
    assert repr(value) in caught.value.message
    assert caught.value.status == 400


@pytest.mark.parametrize("value", [True, False])
def test_booleans_are_not_numbers(value: bool) -> None:
    with pytest.raises(InvalidRequest, match=r"^lease .*boolean"):
        parse_duration(value, "lease")


@pytest.mark.parametrize("value", [None, [30], {"s": 30}, b"30s", object()])
def test_other_types_are_refused(value: object) -> None:
    with pytest.raises(InvalidRequest, match=r"^claim_window must be a number of seconds"):
        parse_duration(value, "claim_window")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "9" * 400 + "s"])
def test_non_finite_values_are_refused(value: object) -> None:
    with pytest.raises(InvalidRequest, match=r"^lease must be at least 0 seconds; got "):
        parse_duration(value, "lease")


def test_an_integer_too_large_for_a_float_is_refused() -> None:
    # A CBOR bignum or Python's json module can hand over such an int; it must not surface as a 500.
    with pytest.raises(InvalidRequest, match=r"^lease must be at least 0 seconds"):
        parse_duration(10**400, "lease")
    with pytest.raises(InvalidRequest, match=r"^lease must be at least 0 seconds"):
        parse_duration(-(10**400), "lease")


def test_range_is_inclusive_at_both_ends() -> None:
    assert parse_duration(0.1, "lease", low=0.1, high=43200) == 0.1
    assert parse_duration("12h", "lease", low=0.1, high=43200) == 43200.0
    assert parse_duration("100ms", "lease", low=0.1, high=43200) == 0.1


@pytest.mark.parametrize("value", [0.09, "99ms", 43200.001, "721m", "13h", -1, "1d"])
def test_out_of_range_is_refused_with_the_bounds(value: object) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_duration(value, "lease", low=0.1, high=43200)
    assert caught.value.message == f"lease must be between 0.1 and 43200 seconds; got {value!r}"


def test_a_large_bound_is_written_out_in_full() -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_duration("400d", "message_ttl", high=31_536_000)
    assert caught.value.message == "message_ttl must be between 0 and 31536000 seconds; got '400d'"


def test_negative_zero_is_zero() -> None:
    seconds = parse_duration(-0.0, "message_ttl")
    assert seconds == 0 and math.copysign(1, seconds) == 1  # shown as 0.0 in a config, not -0.0


def test_default_range_is_zero_to_unbounded() -> None:
    assert parse_duration(10**9, "x") == 1e9
    with pytest.raises(InvalidRequest, match=r"^x must be at least 0 seconds; got -0\.001$"):
        parse_duration(-0.001, "x")
