"""How the client commands speak: aligned tables and short lines for people, one JSON document for
scripts (``--json``), one line on stderr for an error, and a progress bar on long work.

Everything for stdout goes through ``Output._write``, which turns a failed write (a reader that went
away, a full disk) into ``StdoutFailed``: ``broker.cli.main`` answers it once for every command."""

from __future__ import annotations

import errno
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from rich import box
from rich.cells import cell_len
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
#: How narrow a column that may shrink (a key, a payload, a reason) gets before the table grows wider
#: than the screen instead: the other columns (ids, seqs, times) are never cut, so they can be copied.
#: 12 keeps the reason of most dead letters, ``max_attempts``, whole.
NARROWEST_SHRUNK = 12
#: The spaces between two columns: rich pads each cell with one on either side (the edges with none),
#: and a table with a header has the rule's column separator, a space, between them.
TABLE_GAP = 3
FIELDS_GAP = 2
#: Characters that would break a row into several lines or move the cursor (C0, DEL, C1, and the
#: Unicode line and paragraph separators ``str.splitlines`` splits on): shown as JSON escapes.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class StdoutFailed(Exception):
    """stdout cannot be written: its reader went away (``| head``) or its disk is full. Not an
    ``OSError``, so that a command catching its own (a data directory it cannot use) lets it by."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error) or type(error).__name__)
        self.error = error

    @property
    def broken_pipe(self) -> bool:
        return isinstance(self.error, BrokenPipeError)


class Output:
    def __init__(self, *, as_json: bool) -> None:
        self.as_json = as_json
        self.console = Console(highlight=False, soft_wrap=False, width=_width(sys.stdout))
        self.errors = Console(stderr=True, highlight=False)

    def json(self, document: Any) -> None:
        self._write(_json_text(document, sys.stdout, indent=2) + "\n")

    def line(self, text: str) -> None:
        """A line for people (never in ``--json`` mode)."""
        self._print(Text(text), self.console.width)

    def table(
        self,
        columns: Sequence[str],
        rows: Iterable[Sequence[Any]],
        *,
        right: Iterable[str] = (),
        shrink: Iterable[str] = (),
    ) -> None:
        """Aligned columns under a header. When the table is wider than the screen, the ``shrink``
        columns are cut with an ellipsis, down to ``NARROWEST_SHRUNK``; the others never are, and a table
        that still does not fit is printed wider than the screen (the terminal wraps its lines)."""
        aligned_right = set(right)
        cells = [[cell_text(value) for value in row] for row in rows]
        shrinkable = set(shrink)
        shrinks = [column in shrinkable for column in columns]
        widths = _fit(columns, cells, shrinks, self.console.width, TABLE_GAP)
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
        for column, width in zip(columns, widths, strict=True):
            table.add_column(
                column,
                justify="right" if column in aligned_right else "left",
                no_wrap=True,
                width=width,
                overflow="ellipsis",
            )
        for row in cells:
            table.add_row(*(Text(cell) for cell in row))
        self._print(table, _total(widths, TABLE_GAP))

    def fields(self, pairs: Iterable[tuple[str, Any]]) -> None:
        """A two-column table of names and values (a queue's config, its stats), never cut."""
        cells = [[cell_text(name), cell_text(value)] for name, value in pairs]
        widths = _fit(("", ""), cells, [False, False], self.console.width, FIELDS_GAP)
        table = Table(box=None, show_header=False, pad_edge=False)
        table.add_column(style="bold", no_wrap=True, width=widths[0])
        table.add_column(no_wrap=True, width=widths[1])
        for row in cells:
            table.add_row(*(Text(cell) for cell in row))
        self._print(table, _total(widths, FIELDS_GAP))

    def _print(self, renderable: Table | Text, width: int) -> None:
        """Print ``renderable`` ``width`` columns wide (wider than the screen when it must be), without
        the spaces rich pads the last column with (they clutter files and diffs)."""
        _stdout()  # rich would fail on a closed one with an AttributeError
        screen = self.console.width
        self.console.width = max(screen, width)
        try:
            with self.console.capture() as capture:
                self.console.print(renderable)
        except OSError as error:  # leaving the capture flushes the console's file: stdout
            raise StdoutFailed(error) from None
        finally:
            self.console.width = screen
        lines = capture.get().splitlines()
        self._write("".join(line.rstrip() + "\n" for line in lines))

    def _write(self, text: str) -> None:
        """Write to stdout now (a failure shows here, not at exit), or raise ``StdoutFailed``. Straight
        to the file descriptor, every byte: a buffered write of a large table took the part a pipe
        accepted before its reader left and said nothing of the rest (``| head -1`` exited 0)."""
        stream = _stdout()
        try:
            try:
                descriptor = stream.fileno()
            except (AttributeError, ValueError, OSError):  # no descriptor: a test's capture
                stream.write(text)
                stream.flush()
                return
            stream.flush()
            # A table in a locale that cannot hold a payload's characters shows them escaped (\u2603).
            data = memoryview(text.encode(stream.encoding or "utf-8", "backslashreplace"))
            while data:
                data = data[os.write(descriptor, data) :]
        except OSError as error:
            raise StdoutFailed(error) from None

    def error(self, code: str, message: str) -> None:
        print_error(code, message, as_json=self.as_json)

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


def _stdout() -> Any:
    """``sys.stdout``, or ``StdoutFailed`` when the command started with it closed (``>&-``: Python
    then sets it to None)."""
    if sys.stdout is None:
        raise StdoutFailed(OSError(errno.EBADF, "stdout is closed"))
    return sys.stdout


def _width(stream: Any) -> int | None:
    if "COLUMNS" in os.environ or (hasattr(stream, "isatty") and stream.isatty()):
        return None
    return PIPE_WIDTH


def _json_text(document: Any, stream: Any, indent: int | None = None) -> str:
    """``document`` as JSON text ``stream`` can carry: its characters as they are, or JSON's own escapes
    where the stream's encoding cannot hold them (``PYTHONIOENCODING=ascii``; the stream's
    backslashreplace would write ``\U0001f600``, which is not JSON)."""
    text = json.dumps(document, indent=indent, ensure_ascii=False)
    try:
        text.encode(getattr(stream, "encoding", None) or "utf-8")
    except UnicodeEncodeError:
        return json.dumps(document, indent=indent)
    return text


def print_error(code: str, message: str, *, as_json: bool) -> None:
    """One line on stderr naming the error ``code``: ``broker: CODE: MESSAGE``, or with ``--json`` the
    contract's error body ``{"error": {"code", "message"}}``."""
    message = " ".join(message.split())  # one line, whatever the server wrote
    if as_json:
        document = {"error": {"code": code, "message": message}}
        sys.stderr.write(_json_text(document, sys.stderr) + "\n")
    else:
        sys.stderr.write(f"broker: {code}: {message}\n")
    sys.stderr.flush()


def _fit(
    columns: Sequence[str], cells: list[list[str]], shrinkable: Sequence[bool], screen: int, gap: int
) -> list[int]:
    """The width of each column: its widest cell or header, less what the shrinkable ones give up
    (the widest first, none below ``NARROWEST_SHRUNK`` or its header) for the table to fit ``screen``."""
    widths = [
        max([cell_len(column), *(cell_len(row[index]) for row in cells)])
        for index, column in enumerate(columns)
    ]
    floors = [
        min(width, max(cell_len(column), NARROWEST_SHRUNK)) if can_shrink else width
        for column, width, can_shrink in zip(columns, widths, shrinkable, strict=True)
    ]
    excess = _total(widths, gap) - screen
    while excess > 0:
        over = [index for index, width in enumerate(widths) if width > floors[index]]
        if not over:
            break
        widest = max(over, key=widths.__getitem__)
        widths[widest] -= 1
        excess -= 1
    return widths


def _total(widths: Sequence[int], gap: int) -> int:
    return sum(widths) + gap * max(len(widths) - 1, 0)


def cell_text(value: Any) -> str:
    """A value as one line of a table cell: control characters (a newline in a key) as JSON escapes."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return format(value, ".15g")  # as it was set: 12345.678, 2592000 (":g" said 12345.7, 2.592e+06)
    if isinstance(value, str | int):
        text = str(value)
    else:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    return json.dumps(match.group())[1:-1]  # "\n", "\t", "\u001b"


def payload_text(message: Mapping[str, Any]) -> str:
    """A payload for a table cell: compact JSON, bytes as their size, long ones cut with an ellipsis."""
    payload = message.get("payload")
    if message.get("payload_encoding") == "base64" and isinstance(payload, str):
        text = f"<{len(payload) * 3 // 4 - payload.count('=')} bytes>"
    else:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= PAYLOAD_WIDTH else text[: PAYLOAD_WIDTH - 1] + "…"
