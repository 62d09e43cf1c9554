"""The state diagram in docs/concepts.md draws exactly the moves of the core's transition table."""

from __future__ import annotations

import re
from pathlib import Path

from broker.core.model import TRANSITIONS

CONCEPTS = Path(__file__).resolve().parent.parent / "docs" / "concepts.md"
ARROW = re.compile(r"^\s*(\[\*\]|\w+) --> (\[\*\]|\w+)(?: : (.+?))?\s*$")


def diagram() -> str:
    [block] = re.findall(r"```mermaid\n(.*?)```", CONCEPTS.read_text(), flags=re.DOTALL)
    return str(block)


def test_concepts_has_one_state_diagram() -> None:
    assert diagram().splitlines()[0] == "stateDiagram-v2"


def test_the_diagram_and_the_transition_table_have_the_same_edges() -> None:
    arrows = [ARROW.match(line) for line in diagram().splitlines()[1:] if line.strip()]
    assert all(arrows), "every line of the diagram is an arrow"
    drawn = {
        (arrow[1], arrow[3], arrow[2]) for arrow in arrows if arrow and "[*]" not in (arrow[1], arrow[2])
    }
    in_code = {(state.value, move, target.value) for (state, move), target in TRANSITIONS.items()}
    assert drawn - in_code == set(), "arrows the core does not have"
    assert in_code - drawn == set(), "moves of the core the diagram does not draw"


def test_the_diagram_starts_at_publish_and_ends_in_every_final_state() -> None:
    arrows = [match for line in diagram().splitlines() if (match := ARROW.match(line))]
    starts = {arrow[2] for arrow in arrows if arrow[1] == "[*]"}
    ends = {arrow[1] for arrow in arrows if arrow[2] == "[*]"}
    live = {state.value for (state, _), _ in TRANSITIONS.items()}
    final = {target.value for target in TRANSITIONS.values()} - live
    assert starts == {"ready", "delayed"}
    assert ends == final
