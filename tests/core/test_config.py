"""``QueueConfig.updated``: validation of a partial config as a client sends it (§3)."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core import QueueConfig, RetryBackoff, check_queue_name
from broker.errors import InvalidRequest

DEFAULTS = QueueConfig()


def refused(changes: Any) -> str:
    """The message of the ``InvalidRequest`` that ``changes`` is refused with."""
    with pytest.raises(InvalidRequest) as caught:
        DEFAULTS.updated(changes)
    assert caught.value.status == 400
    assert caught.value.code == "invalid_request"
    return caught.value.message


def test_defaults_match_the_contract() -> None:
    assert DEFAULTS.to_dict("jobs") == {
        "lease": 30.0,
        "max_attempts": 0,
        "dead_letter": "jobs.dlq",
        "retry_backoff": {"type": "fixed", "base": 0.0, "max": 3600.0},
        "max_depth": 0,
        "rate_limit": None,
        "message_ttl": 0.0,
        "claim_window": 0.0,
        "durable": True,
        "dedup_window": 86400.0,
        "push": None,
    }


def test_an_empty_update_changes_nothing() -> None:
    assert DEFAULTS.updated({}) == DEFAULTS


def test_update_returns_a_copy_and_keeps_other_fields() -> None:
    base = DEFAULTS.updated({"lease": 10})
    changed = base.updated({"max_depth": 5})
    assert (base.lease, base.max_depth) == (10.0, 0)
    assert (changed.lease, changed.max_depth) == (10.0, 5)


def test_the_config_must_be_an_object() -> None:
    assert refused([("lease", 5)]) == "the queue config must be a JSON object"
    assert "JSON object" in refused(None)


def test_unknown_fields_are_refused_with_the_known_ones() -> None:
    message = refused({"visibility_timeout": 30})
    assert "'visibility_timeout'" in message
    for field in ("lease", "max_attempts", "dead_letter", "retry_backoff", "dedup_window"):
        assert field in message


def test_a_bad_field_among_good_ones_applies_nothing() -> None:
    config = DEFAULTS.updated({"lease": 10})
    with pytest.raises(InvalidRequest, match=r"^max_depth"):
        config.updated({"lease": 20, "max_depth": -1})
    assert config.lease == 10.0


# -- lease ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(0.1, 0.1), (30, 30.0), ("250ms", 0.25), ("5m", 300.0), ("12h", 43200.0), (43200, 43200.0)],
)
def test_lease_accepts_durations(value: Any, seconds: float) -> None:
    assert DEFAULTS.updated({"lease": value}).lease == seconds


@pytest.mark.parametrize("value", [0, 0.099, "99ms", 43200.5, "13h", -1, "soon", True, None, [1]])
def test_lease_refuses_bad_values(value: Any) -> None:
    assert refused({"lease": value}).startswith("lease ")


# -- max_attempts, rate_limit, message_ttl, claim_window: stored in the core's units ----------------


@pytest.mark.parametrize(
    ("field", "value", "stored"),
    [
        ("max_attempts", 3, 3),
        ("rate_limit", {"max": 10, "per": 1}, (10, 1.0)),
        ("rate_limit", {"max": 10, "per": "250ms"}, (10, 0.25)),
        ("rate_limit", None, None),
        ("message_ttl", 60, 60.0),
        ("message_ttl", "1h", 3600.0),
        ("claim_window", 0.5, 0.5),
        ("claim_window", "250ms", 0.25),
    ],
)
def test_policy_fields_are_stored_in_seconds_and_counts(field: str, value: Any, stored: Any) -> None:
    assert getattr(DEFAULTS.updated({field: value}), field) == stored


@pytest.mark.parametrize("value", [-1, 1_000_001, 1.5, "3", True, None])
def test_max_attempts_must_be_an_integer_in_range(value: Any) -> None:
    assert refused({"max_attempts": value}) == "max_attempts must be an integer between 0 and 1000000"


@pytest.mark.parametrize(
    ("value", "starts"),
    [
        (5, "rate_limit must be null or"),
        ({"max": 5}, "rate_limit must be null or"),
        ({"max": 5, "per": 1, "burst": 2}, "rate_limit must be null or"),
        ({"max": 0, "per": 1}, "rate_limit.max must be an integer"),
        ({"max": True, "per": 1}, "rate_limit.max must be an integer"),
        ({"max": 2.5, "per": 1}, "rate_limit.max must be an integer"),
        ({"max": 5, "per": 0}, "rate_limit.per must be between"),
        ({"max": 5, "per": "2d"}, "rate_limit.per must be between"),
        ({"max": 5, "per": "often"}, "rate_limit.per must be a number"),
    ],
)
def test_rate_limit_shape_and_ranges(value: Any, starts: str) -> None:
    assert refused({"rate_limit": value}).startswith(starts)


@pytest.mark.parametrize("value", [-1, "1y", 31_536_001, False])
def test_message_ttl_range(value: Any) -> None:
    assert refused({"message_ttl": value}).startswith("message_ttl ")


@pytest.mark.parametrize("value", [-0.1, 5.001, "6s", "1m", None])
def test_claim_window_range(value: Any) -> None:
    assert refused({"claim_window": value}).startswith("claim_window ")


# -- dead_letter ---------------------------------------------------------------------------------


def test_dead_letter_names_a_queue_or_is_null() -> None:
    config = DEFAULTS.updated({"dead_letter": "failures.v2"})
    assert config.dead_letter_queue("jobs") == "failures.v2"
    assert config.to_dict("jobs")["dead_letter"] == "failures.v2"
    dropped = DEFAULTS.updated({"dead_letter": None})
    assert dropped.dead_letter_queue("jobs") is None
    assert dropped.to_dict("jobs")["dead_letter"] is None
    assert DEFAULTS.dead_letter_queue("jobs") == "jobs.dlq"


@pytest.mark.parametrize("value", [5, True, ["q"], {"name": "q"}])
def test_dead_letter_refuses_non_strings(value: Any) -> None:
    assert refused({"dead_letter": value}) == "dead_letter must be a queue name or null"


@pytest.mark.parametrize("value", ["", "bad name", ".hidden", "x" * 129, "a/b"])
def test_dead_letter_refuses_invalid_queue_names(value: str) -> None:
    assert "must match" in refused({"dead_letter": value})


def test_an_invalid_dead_letter_name_is_refused_naming_the_field() -> None:
    assert refused({"dead_letter": "bad name"}).startswith("dead_letter 'bad name' must match")


# -- retry_backoff -------------------------------------------------------------------------------


def test_retry_backoff_fills_in_defaults() -> None:
    assert DEFAULTS.updated({"retry_backoff": {}}).retry_backoff == RetryBackoff("fixed", 0.0, 3600.0)
    config = DEFAULTS.updated({"retry_backoff": {"type": "exponential", "base": "500ms", "max": "5m"}})
    assert config.retry_backoff == RetryBackoff("exponential", 0.5, 300.0)
    assert config.to_dict("q")["retry_backoff"] == {"type": "exponential", "base": 0.5, "max": 300.0}


@pytest.mark.parametrize(
    ("value", "starts"),
    [
        ("fixed", "retry_backoff must be an object"),
        (None, "retry_backoff must be an object"),
        ({"kind": "fixed"}, "unknown retry_backoff field(s): kind"),
        ({"type": "fixed", 1: 2, "zz": 0}, "unknown retry_backoff field(s): 1, zz"),  # CBOR keys: any type
        ({"type": "linear"}, "retry_backoff.type must be"),
        ({"type": None}, "retry_backoff.type must be"),
        ({"base": -1}, "retry_backoff.base "),
        ({"base": "8d"}, "retry_backoff.base "),
        ({"base": True}, "retry_backoff.base "),
        ({"max": 604801}, "retry_backoff.max "),
        ({"max": "later"}, "retry_backoff.max "),
    ],
)
def test_retry_backoff_refuses_bad_values(value: Any, starts: str) -> None:
    assert refused({"retry_backoff": value}).startswith(starts)


@pytest.mark.parametrize(
    ("backoff", "delays"),
    [
        (RetryBackoff("fixed", 5.0, 3600.0), [5.0, 5.0, 5.0, 5.0]),
        (RetryBackoff("fixed", 50.0, 10.0), [10.0, 10.0, 10.0, 10.0]),
        (RetryBackoff("exponential", 1.0, 5.0), [1.0, 2.0, 4.0, 5.0]),
        (RetryBackoff("exponential", 0.5, 3600.0), [0.5, 1.0, 2.0, 4.0]),
        (RetryBackoff("exponential", 0.0, 3600.0), [0.0, 0.0, 0.0, 0.0]),
    ],
)
def test_retry_backoff_delay_per_attempt(backoff: RetryBackoff, delays: list[float]) -> None:
    assert [backoff.delay(attempt) for attempt in (1, 2, 3, 4)] == delays


def test_a_backoff_base_over_the_default_cap_raises_it_and_over_a_given_one_is_refused() -> None:
    """The cap was silent: ``{"type": "fixed", "base": "2h"}`` was accepted and waited 1 h."""
    fixed = QueueConfig().updated({"retry_backoff": {"type": "fixed", "base": "2h"}}).retry_backoff
    assert (fixed.max, fixed.delay(1)) == (7200.0, 7200.0)
    short = QueueConfig().updated({"retry_backoff": {"type": "exponential", "base": 2}}).retry_backoff
    assert short.max == 3600.0
    with pytest.raises(
        InvalidRequest, match=r"retry_backoff.base \(60 s\) must not be over retry_backoff.max \(20 s\)"
    ):
        QueueConfig().updated({"retry_backoff": {"type": "fixed", "base": 60, "max": 20}})
    assert QueueConfig().updated({"retry_backoff": {"base": 20, "max": 20}}).retry_backoff.delay(1) == 20.0
    with pytest.raises(
        InvalidRequest, match=r"\(100000.5 s\) must not be over retry_backoff.max \(100000 s\)"
    ):
        QueueConfig().updated({"retry_backoff": {"base": 100000.5, "max": 100000}})


def test_exponential_backoff_treats_attempt_zero_as_the_first() -> None:
    # After refunded defers a nack can see attempt 0.
    assert RetryBackoff("exponential", 2.0, 100.0).delay(0) == 2.0


# -- max_depth, durable, dedup_window ------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [(0, 0), (1, 1), (1_000_000_000, 1_000_000_000)])
def test_max_depth_accepts_integers_in_range(value: int, expected: int) -> None:
    assert DEFAULTS.updated({"max_depth": value}).max_depth == expected


@pytest.mark.parametrize("value", [-1, 1_000_000_001, 2.0, "10", False, None])
def test_max_depth_refuses_bad_values(value: Any) -> None:
    assert refused({"max_depth": value}) == "max_depth must be an integer between 0 and 1000000000"


def test_durable_is_a_boolean() -> None:
    assert DEFAULTS.updated({"durable": False}).durable is False
    for value in (0, 1, "true", None):
        assert refused({"durable": value}) == "durable must be true or false"


@pytest.mark.parametrize(("value", "seconds"), [(0, 0.0), ("12h", 43200.0), (31_536_000, 31_536_000.0)])
def test_dedup_window_accepts_durations(value: Any, seconds: float) -> None:
    assert DEFAULTS.updated({"dedup_window": value}).dedup_window == seconds


@pytest.mark.parametrize("value", [-1, 31_536_001, "400d", "forever", True])
def test_dedup_window_refuses_bad_values(value: Any) -> None:
    assert refused({"dedup_window": value}).startswith("dedup_window ")


# -- queue names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "jobs", "Jobs.dlq", "0-queue_x", "q" * 128])
def test_valid_queue_names(name: str) -> None:
    assert check_queue_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "-jobs", ".jobs", "_jobs", "q" * 129, "has space", "a/b", "é", "\njobs"]
)
def test_invalid_queue_names(name: str) -> None:
    with pytest.raises(InvalidRequest, match=r"^queue name .* must match"):
        check_queue_name(name)


def test_a_queue_name_with_a_trailing_newline_is_invalid() -> None:
    with pytest.raises(InvalidRequest, match="must match"):
        check_queue_name("jobs\n")


@pytest.mark.parametrize("attempt", [1024, 1025, 5000, 10**9])
def test_exponential_backoff_past_two_to_the_1023_is_its_max(attempt: int) -> None:
    """With max_attempts 0 a message can be nacked thousands of times; 2.0 ** 1024 overflows."""
    assert RetryBackoff("exponential", 0.5, 3600.0).delay(attempt) == 3600.0
    assert RetryBackoff("exponential", 0.0, 3600.0).delay(attempt) == 0.0
