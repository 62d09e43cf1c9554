"""Docs that state facts about the code are checked against it."""

from __future__ import annotations

import re
from pathlib import Path

from broker.core.model import TRANSITIONS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BROKER = ROOT / "broker"


def test_the_state_table_in_concepts_matches_the_core() -> None:
    text = (DOCS / "concepts.md").read_text()
    table = text.split("<!-- transitions -->", 1)[1].split("<!-- /transitions -->", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| `(\w+)` \|$", table, flags=re.MULTILINE)
    documented = {(state, move): target for state, move, target in rows}
    in_code = {(state.value, move): target.value for (state, move), target in TRANSITIONS.items()}
    assert documented == in_code


def test_the_api_reference_is_generated_from_the_openapi_document() -> None:
    from broker.http.openapi import reference_markdown

    assert (DOCS / "api-reference.md").read_text() == reference_markdown(), (
        "run: .venv/bin/python -m broker.http.openapi > docs/api-reference.md"
    )


def test_the_reference_names_every_field_of_a_body_with_a_choice_of_fields() -> None:
    """A bulk call takes ``ids`` or ``"all": true``: the reference names both, and says so."""
    from broker.http.openapi import reference_markdown

    redrive = reference_markdown().split("## `POST /v1/queues/{queue}/redrive`", 1)[1].split("\n## ", 1)[0]
    assert "fields `ids`?, `all`?, `to`?; exactly one of `ids` or `all`" in redrive


def logged_events() -> set[str]:
    """Every event name ``broker/`` logs: ``log.info("name", …)``, the name maybe on the next line, or
    ``log.log(level, "name", …)``."""
    call = re.compile(r'\blog\.(?:(?:debug|info|warning|error|exception|critical)\(|log\([^,()]+,)\s*"(\w+)"')
    return {name for path in BROKER.rglob("*.py") for name in call.findall(path.read_text())}


def test_every_logged_event_is_in_the_log_events_table() -> None:
    text = (DOCS / "operations.md").read_text()
    table = text.split("## Log events", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE))
    events = logged_events()
    assert {"recovered", "push_paused", "snapshot_taken"} <= events  # the search finds them
    assert events - documented == set(), "add these to docs/operations.md, Log events"
    assert documented - events == set(), "docs/operations.md documents events nothing logs"
