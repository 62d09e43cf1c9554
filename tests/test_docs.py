"""Docs that state facts about the code are checked against it."""

from __future__ import annotations

import re
from pathlib import Path

from broker.core.model import TRANSITIONS

DOCS = Path(__file__).resolve().parent.parent / "docs"


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
