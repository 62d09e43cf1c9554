"""Long work draws a progress bar on stderr when it is a terminal, and never otherwise."""

from __future__ import annotations

import json

import pytest

from tests.cli.conftest import Run
from tests.cli.test_queues import dead_lettered_queue

BAR = "━"


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make rich take stderr for an interactive terminal (its own switches)."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("TTY_INTERACTIVE", "1")


def test_no_bar_when_stderr_is_not_a_terminal(cli: Run, queue: str) -> None:
    published = cli("publish", queue, "--file", "-", stdin="1\n2\n")
    assert published.status == 0 and published.err == ""


@pytest.mark.usefixtures("terminal")
def test_publishing_a_file_draws_a_bar(cli: Run, queue: str) -> None:
    lines = "".join(f"{n}\n" for n in range(1500))
    published = cli("publish", queue, "--file", "-", stdin=lines)
    assert published.status == 0
    assert BAR in published.err and f"publishing to {queue}" in published.err
    assert "1500/1500" in published.err
    quiet = cli("publish", queue, "--file", "-", "--json", stdin=lines)  # never with --json
    assert quiet.status == 0 and quiet.err == "" and json.loads(quiet.out)["published"] == 1500


def test_redriving_draws_a_bar(cli: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    name = dead_lettered_queue(cli, 3)
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("TTY_INTERACTIVE", "1")
    redriven = cli("queues", "redrive", name, "--all")
    assert redriven.status == 0
    assert BAR in redriven.err and f"redriving {name}.dlq" in redriven.err and "3/3" in redriven.err
