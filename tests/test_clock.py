from broker.clock import format_time


def test_timestamps_are_rfc3339_utc_with_milliseconds() -> None:
    assert format_time(0.0) == "1970-01-01T00:00:00.000Z"
    assert format_time(1763805600.1234) == "2025-11-22T10:00:00.123Z"


def test_a_millisecond_rounding_up_carries_into_the_second() -> None:
    assert format_time(1763805600.9996) == "2025-11-22T10:00:01.000Z"


def test_a_repeated_time_gives_the_same_text_as_a_fresh_one() -> None:
    first = format_time(1763805601.5)
    format_time(12.0)
    assert format_time(1763805601.5) == first == "2025-11-22T10:00:01.500Z"


def test_round_up_reaches_the_next_millisecond_and_is_not_served_from_the_cache() -> None:
    assert format_time(1763805600.1231) == "2025-11-22T10:00:00.123Z"  # now the last answer
    assert format_time(1763805600.1231, round_up=True) == "2025-11-22T10:00:00.124Z"
    assert format_time(1763805600.1231) == "2025-11-22T10:00:00.123Z"


def test_a_time_of_minus_one_second_is_formatted_like_any_other() -> None:
    """The cache of the last answer started as (-1.0, ""): -1.0 was answered "" until another time."""
    assert format_time(-1.0) == "1969-12-31T23:59:59.000Z"
