"""How the client commands speak: aligned tables and short lines for people, one JSON document for
scripts (``--json``), one line on stderr for an error, and a progress bar on long work."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

#: Columns for tables when stdout is not a terminal and ``COLUMNS`` is unset (rich would assume 80,
#: and squeeze or fold the cells of a table piped into a file or ``less``).
PIPE_WIDTH = 200
#: The longest payload a table cell shows; ``--json`` shows all of it.
PAYLOAD_WIDTH = 60


class Output:
    def __init__(self, *, as_json: bool) -> None:
        self.as_json = as_json
        self.console = Console(highlight=False, soft_wrap=False, width=_width(sys.stdout))
        self.errors = Console(stderr=True, highlight=False)

    def json(self, document: Any) -> None:
        sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=False) + "\n")

    def line(self, text: str) -> None:
        """A line for people (never in ``--json`` mode)."""
        self.console.print(Text(text))

    def table(
        self, columns: Sequence[str], rows: Iterable[Sequence[Any]], *, right: Iterable[str] = ()
    ) -> None:
        aligned_right = set(right)
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
        for column in columns:
            table.add_column(column, justify="right" if column in aligned_right else "left", no_wrap=True)
        for row in rows:
            table.add_row(*(Text(cell_text(value)) for value in row))
        self._print(table)

    def fields(self, pairs: Iterable[tuple[str, Any]]) -> None:
        """A two-column table of names and values (a queue's config, its stats)."""
        table = Table(box=None, show_header=False, pad_edge=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column(no_wrap=True)
        for name, value in pairs:
            table.add_row(Text(name), Text(cell_text(value)))
        self._print(table)

    def _print(self, table: Table) -> None:
        """Print without the spaces rich pads the last column with (they clutter files and diffs)."""
        with self.console.capture() as capture:
            self.console.print(table)
        lines = capture.get().splitlines()
        sys.stdout.write("".join(line.rstrip() + "\n" for line in lines))
        sys.stdout.flush()

    def error(self, code: str, message: str) -> None:
        message = " ".join(message.split())  # one line, whatever the server wrote
        if self.as_json:
            document = {"error": {"code": code, "message": message}}
            sys.stderr.write(json.dumps(document, ensure_ascii=False) + "\n")
        else:
            sys.stderr.write(f"broker: {code}: {message}\n")
        sys.stderr.flush()

    @contextmanager
    def progress(self, description: str, total: int) -> Iterator[Bar]:
        """A progress bar on stderr for long work; silent in ``--json`` mode or when stderr is not a
        terminal. Yields a ``Bar``: ``bar(count)`` advances it, ``bar.update(…)`` sets it."""
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=self.errors,
            transient=True,
            disable=self.as_json or not self.errors.is_terminal,
        ) as progress:
            yield Bar(progress, progress.add_task(description, total=total))


class Bar:
    """One progress bar: call it with a count to advance it, or ``update`` what it shows."""

    def __init__(self, progress: Progress, task: TaskID) -> None:
        self._progress = progress
        self._task = task

    def __call__(self, count: int) -> None:
        self._progress.advance(self._task, count)

    def update(self, description: str, done: int, total: int) -> None:
        self._progress.update(self._task, description=description, completed=done, total=total)


def _width(stream: Any) -> int | None:
    if "COLUMNS" in os.environ or (hasattr(stream, "isatty") and stream.isatty()):
        return None
    return PIPE_WIDTH


def cell_text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str | int):
        return str(value)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def payload_text(message: Mapping[str, Any]) -> str:
    """A payload for a table cell: compact JSON, bytes as their size, long ones cut with an ellipsis."""
    payload = message.get("payload")
    if message.get("payload_encoding") == "base64" and isinstance(payload, str):
        text = f"<{len(payload) * 3 // 4 - payload.count('=')} bytes>"
    else:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= PAYLOAD_WIDTH else text[: PAYLOAD_WIDTH - 1] + "…"
