"""One real broker for every CLI test (each test uses queues of its own), and ``cli``: run
``broker …`` in this process, as ``main(argv)``, and get its exit status and output."""

from __future__ import annotations

import io
import json
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from broker.cli import main
from tests.cli.serving import running_broker


@dataclass(frozen=True)
class Result:
    status: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


Run = Callable[..., Result]


@pytest.fixture(scope="package")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_broker(tmp_path_factory.mktemp("broker")) as url:
        yield url


@pytest.fixture
def cli(broker_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Run:
    monkeypatch.setenv("BROKER_URL", broker_url)
    monkeypatch.delenv("BROKER_TOKEN", raising=False)
    monkeypatch.delenv("COLUMNS", raising=False)

    def run(*argv: str, stdin: str | None = None) -> Result:
        capsys.readouterr()
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        try:
            status = main(list(argv))
        except SystemExit as stop:  # argparse's usage errors
            status = stop.code if isinstance(stop.code, int) else 2
        out, err = capsys.readouterr()
        return Result(status, out, err)

    return run


@pytest.fixture
def queue(cli: Run) -> str:
    """A new queue of the default config."""
    name = f"q-{uuid.uuid4().hex[:10]}"
    assert cli("queues", "create", name).status == 0
    return name
