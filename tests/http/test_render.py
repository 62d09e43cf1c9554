from broker.http.render import timestamp


def test_timestamps_are_rfc3339_utc_with_milliseconds() -> None:
    assert timestamp(0.0) == "1970-01-01T00:00:00.000Z"
    assert timestamp(1763805600.1234) == "2025-11-22T10:00:00.123Z"


def test_a_millisecond_rounding_up_carries_into_the_second() -> None:
    assert timestamp(1763805600.9996) == "2025-11-22T10:00:01.000Z"


def test_a_repeated_time_gives_the_same_text_as_a_fresh_one() -> None:
    first = timestamp(1763805601.5)
    timestamp(12.0)
    assert timestamp(1763805601.5) == first == "2025-11-22T10:00:01.500Z"
