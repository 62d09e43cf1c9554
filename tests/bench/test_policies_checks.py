"""The dead-letter benchmark's own check of what it moved (bench/policies.py ``_check_dead_letters``): what
it reports for each way the dead-letter queue can be wrong. No broker is started here."""

from __future__ import annotations

from types import SimpleNamespace

from bench.policies import _check_dead_letters

MAX_ATTEMPTS = 3
ORIGINALS = {"m1": "payload 1", "m2": "payload 2", "m3": "payload 3"}


def dead_letter(original_id: str | None, payload: str) -> SimpleNamespace:
    """A message view as the dead-letter queue's browse returns it, with the §6 headers."""
    headers = {
        "x-dead-letter-from": "work",
        "x-dead-letter-reason": "max_attempts",
        "x-dead-letter-attempts": str(MAX_ATTEMPTS),
    }
    if original_id is not None:
        headers["x-original-id"] = original_id
    return SimpleNamespace(headers=headers, payload=payload)


def test_a_faithful_dead_letter_queue_has_no_problem() -> None:
    moved = [dead_letter(message_id, payload) for message_id, payload in ORIGINALS.items()]

    assert _check_dead_letters(ORIGINALS, moved, MAX_ATTEMPTS) == []


def test_copies_without_their_original_id_are_bad_headers_not_duplicates_nor_bad_payloads() -> None:
    # Two copies with the right payloads lost their x-original-id: their originals are missing (nothing
    # names them), their headers are bad, and nothing was duplicated nor carries a wrong payload.
    moved = [dead_letter("m1", "payload 1"), dead_letter(None, "payload 2"), dead_letter(None, "payload 3")]

    problems = _check_dead_letters(ORIGINALS, moved, MAX_ATTEMPTS)

    assert problems == [
        "the dead-letter queue holds 3 messages for 3 originals: 2 missing, 0 duplicated",
        "2 dead letters lack the §6 headers expected (x-original-id, x-dead-letter-*)",
    ]


def test_a_copy_moved_twice_is_a_duplicate() -> None:
    moved = [dead_letter(message_id, payload) for message_id, payload in ORIGINALS.items()]
    moved.append(dead_letter("m2", "payload 2"))

    problems = _check_dead_letters(ORIGINALS, moved, MAX_ATTEMPTS)

    assert problems == ["the dead-letter queue holds 4 messages for 3 originals: 0 missing, 1 duplicated"]
