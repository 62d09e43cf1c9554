"""The shell examples in the docs run against a real broker and print what the docs say they print.

Every fenced ``sh``, ``shell``, ``bash`` or ``console`` block of README.md and docs/*.md is marked, on
the line before it: ``<!-- doc-test -->`` for an example to run (it must be ``sh``), or
``<!-- doc-test: skip (REASON) -->`` for one that cannot run here, saying why (it needs Java, root,
a stopped broker's data directory). A block with neither fails the suite, so no example goes
untested by accident.

A fenced ``sh`` block right after the line ``<!-- doc-test -->`` is an example to run. Its commands
run in order, each with ``bash -c``, against one ``broker serve --in-memory --port 0`` per document
(so each document's examples start from an empty broker and must set up what they use):

- ``127.0.0.1:8080`` and ``localhost:8080`` become the test broker's address, and ``BROKER_URL`` is
  set, so ``broker …`` commands reach it too;
- a placeholder ``<FIELD from …>`` (``<lease_id from the claim>``, ``<id of …>``) becomes the last value
  of the JSON field ``FIELD`` that an earlier command of the document printed;
- a comment ``# → TEXT`` right after a command is what the command prints (stdout and stderr);
- a ``text`` block right after the ``sh`` block is what its last command prints;
- a comment ``# exit status N`` after a command expects that status; otherwise it must be 0.

Outputs are compared after ids (``1a2040581b3-0-1``) and timestamps are replaced by placeholders,
runs of spaces and of table rules are squeezed, and ``…`` in the expected text matches anything.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.cli.serving import running_broker

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- doc-test -->"
SKIP = re.compile(r"<!-- doc-test: skip \((?P<reason>.*\S.*)\) -->")
SHELL_FENCE = re.compile(r"```(?:sh|shell|bash|console)\s*")
#: Documents this change may not edit, and how many unmarked blocks each still has: mark them, then
#: remove the entry (the test fails when the count is wrong either way).
COMMAND_TIMEOUT = 60

ID = re.compile(r"\b[0-9a-f]{8,16}-\d+-\d+(?:\.\d+)?\b")
TIME = re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z\b")
PLACEHOLDER = re.compile(r"<(\w+) (?:from|of) [^>]*>")


@dataclass
class Command:
    text: str
    line: int
    expected: str | None = None
    status: int = 0


@dataclass
class Example:
    document: Path
    line: int
    commands: list[Command] = field(default_factory=list)


def examples(document: Path) -> list[Example]:
    lines = document.read_text().splitlines()
    found = []
    index = 0
    while index < len(lines):
        if lines[index].strip() != MARKER:
            index += 1
            continue
        start = index + 1
        assert lines[start].strip() == "```sh", f"{document.name}:{start + 1}: {MARKER} needs a ```sh block"
        end = lines.index("```", start + 1)
        example = Example(document, start + 1, parse_block(lines[start + 1 : end], start + 2))
        index = end + 1
        while index < len(lines) and not lines[index].strip():
            index += 1
        if index < len(lines) and lines[index].strip() == "```text":
            text_end = lines.index("```", index + 1)
            assert example.commands, f"{document.name}:{index + 1}: output with no command"
            example.commands[-1].expected = "\n".join(lines[index + 1 : text_end])
            index = text_end + 1
        found.append(example)
    return found


def unmarked_blocks(document: Path) -> list[str]:
    """Where ``document`` has a shell block with neither marker, or a skip marker with no reason."""
    lines = document.read_text().splitlines()
    found = []
    fenced = False
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if fenced:
            fenced = stripped != "```"
            continue
        if not stripped.startswith("```"):
            continue
        fenced = True
        if not SHELL_FENCE.fullmatch(stripped):
            continue
        before = next((text.strip() for text in reversed(lines[: number - 1]) if text.strip()), "")
        if before != MARKER and not SKIP.fullmatch(before):
            found.append(f"{document.name}:{number}: {stripped} after {before[:60]!r}")
    return found


def parse_block(lines: list[str], first_line: int) -> list[Command]:
    commands: list[Command] = []
    pending: list[str] = []
    for offset, line in enumerate(lines):
        stripped = line.strip()
        if pending:
            pending.append(line)
            if not line.endswith("\\"):
                commands.append(Command("\n".join(pending), first_line + offset - len(pending) + 1))
                pending = []
        elif stripped.startswith("# →"):
            assert commands, f"line {first_line + offset}: an expected output with no command"
            commands[-1].expected = stripped.removeprefix("# →").strip()
        elif stripped.startswith("# exit status "):
            commands[-1].status = int(stripped.removeprefix("# exit status "))
        elif stripped and not stripped.startswith("#"):
            if line.endswith("\\"):
                pending.append(line)
            else:
                commands.append(Command(line, first_line + offset))
    assert not pending, "a command ends with a line continuation"
    return commands


def normalize(text: str) -> str:
    text = TIME.sub("<TIME>", ID.sub("<ID>", text))
    text = re.sub(r"[─━═]+", "─", text)
    return "\n".join(" ".join(line.split()) for line in text.strip().splitlines() if line.strip())


def matches(expected: str, actual: str) -> bool:
    pattern = ".*?".join(re.escape(part) for part in normalize(expected).split("…"))
    return re.fullmatch(pattern, normalize(actual), flags=re.DOTALL) is not None


def last_value(name: str, printed: list[str]) -> str:
    """The last value of the JSON field ``name`` in what the earlier commands printed."""
    for output in reversed(printed):
        values = re.findall(rf'"{name}":\s*"([^"]+)"', output)
        if values:
            return str(values[-1])
    pytest.fail(f"no earlier output has a {name!r}")


def run_document(document: Path, url: str) -> None:
    address = url.removeprefix("http://")
    environment = {
        **os.environ,
        "BROKER_URL": url,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    environment.pop("BROKER_TOKEN", None)
    environment.pop("COLUMNS", None)
    printed: list[str] = []
    for example in examples(document):
        for command in example.commands:
            text = command.text.replace("127.0.0.1:8080", address).replace("localhost:8080", address)
            text = PLACEHOLDER.sub(lambda match: last_value(match.group(1), printed), text)
            result = subprocess.run(
                ["bash", "-c", text],
                capture_output=True,
                text=True,
                env=environment,
                timeout=COMMAND_TIMEOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
            )
            output = result.stdout + result.stderr
            printed.append(output)
            where = f"{document.relative_to(ROOT)}:{command.line}: {command.text!r}"
            assert result.returncode == command.status, f"{where} exited {result.returncode}:\n{output}"
            if command.expected is not None:
                assert matches(command.expected, output), (
                    f"{where} printed\n{output}\ninstead of\n{command.expected}"
                )


TESTED = [document for document in DOCUMENTS if MARKER in document.read_text()]


@pytest.mark.e2e
@pytest.mark.parametrize("document", TESTED, ids=[d.name for d in TESTED])
def test_the_examples_of_a_document_run(document: Path, tmp_path: Path) -> None:
    with running_broker(tmp_path) as url:
        run_document(document, url)


def test_the_example_checker_itself() -> None:
    assert matches('{"acked":1,"skipped":[]}', '{"acked":1,"skipped":[]}')
    assert not matches('{"acked":1,"skipped":[]}', '{"acked":0,"skipped":[]}')
    assert matches('{"id":"…","seq":1}', '{"id":"1a2040581b3-0-1","seq":1}')
    assert matches("id  seq\n───\n1a2040581b3-0-1  1", "id    seq\n──────────\n1a2040581b3-0-7    1\n")
    assert matches("at 2026-11-22T10:00:00.000Z", "at 2027-01-02T03:04:05.678Z")
    [command] = parse_block(["curl -s x \\", "  --json '{}'", "# → {}", "# exit status 4"], 1)
    assert (command.expected, command.status) == ("{}", 4)
    assert command.text == "curl -s x \\\n  --json '{}'"


@pytest.mark.parametrize("document", DOCUMENTS, ids=[d.name for d in DOCUMENTS])
def test_every_shell_block_is_run_or_skipped_for_a_reason(document: Path) -> None:
    unmarked = unmarked_blocks(document)
    assert not unmarked, f"mark each block with {MARKER} or <!-- doc-test: skip (why) -->:\n" + "\n".join(
        unmarked
    )


def test_the_marker_checker_itself(tmp_path: Path) -> None:
    document = tmp_path / "doc.md"
    document.write_text(
        "<!-- doc-test -->\n```sh\ntrue\n```\n\n<!-- doc-test: skip (needs Java) -->\n\n```bash\nx\n```\n"
        "```python\nprint()\n```\n```console\n$ x\n```\n<!-- doc-test: skip () -->\n```shell\ny\n```\n"
        "```text\n```sh\n```\n"
    )
    assert [entry.split(": ")[0] for entry in unmarked_blocks(document)] == ["doc.md:14", "doc.md:18"]


def test_every_document_with_examples_is_found() -> None:
    assert {d.name for d in TESTED} >= {"README.md", "api.md", "cli.md"}
