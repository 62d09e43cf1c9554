"""What people and pipes get on stdout: tables whose ids, seqs and times are never cut, one row a
line; and a stdout that goes away (``| head``) or fills up (a full disk) ends the command as docs/cli.md
says, without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pytest

from tests.cli.conftest import Run


def fresh_queue(cli: Run, name: str | None = None) -> str:
    name = name or f"q-{uuid.uuid4().hex[:10]}"
    assert cli("queues", "create", name).status == 0
    return name


def messages(cli: Run, queue: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = cli("queues", "peek", queue, "--state", "all", "--json").json()["messages"]
    return found


# -- tables -------------------------------------------------------------------------------------------


def test_at_80_columns_every_column_shows_and_ids_and_times_are_whole(
    cli: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = fresh_queue(cli)
    payload = json.dumps({"to": "someone.with.a.long.address@example.com", "body": "x" * 80})
    assert cli("publish", queue, "--payload", payload, "--key", "signup-42-" + "k" * 40).status == 0
    [message] = messages(cli, queue)
    monkeypatch.setenv("COLUMNS", "80")  # rich's width for a terminal of 80 columns

    header, _, row = cli("queues", "peek", queue).out.splitlines()
    assert header.split() == ["id", "seq", "state", "attempt", "priority", "key", "published", "payload"]
    cells = row.split()
    assert cells[:5] == [message["id"], "1", "ready", "0", "0"]
    assert cells[6] == message["published_at"]
    assert cells[5].startswith("signup-42") and cells[5].endswith("…")  # the key gives way
    assert cells[7].startswith('{"to":') and cells[7].endswith("…")  # and the payload

    consumed = cli("consume", queue).out.splitlines()
    assert consumed[0].split() == ["id", "seq", "attempt", "priority", "key", "published", "payload"]
    assert consumed[2].split()[:2] == [message["id"], "1"]


def test_at_80_columns_dead_letters_keep_their_ids(cli: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = f"q-{uuid.uuid4().hex[:10]}"
    assert cli("queues", "create", queue, "--max-attempts", "1").status == 0
    assert cli("publish", queue, "--payload", json.dumps({"report": "y" * 100})).status == 0
    assert cli("consume", queue, "--nack", "--reason", "the renderer crashed " * 10).status == 0
    [dead] = cli("queues", "dlq", queue, "--json").json()["messages"]
    monkeypatch.setenv("COLUMNS", "80")

    header, _, row = cli("queues", "dlq", queue).out.splitlines()
    assert header.split() == ["id", "from", "reason", "attempts", "state", "dead-lettered", "payload"]
    assert row.split()[:3] == [dead["id"], queue, "max_attempts"]
    assert row.split()[-2] == dead["published_at"]


def test_a_long_key_shrinks_its_column_rather_than_push_others_out(cli: Run) -> None:
    queue = fresh_queue(cli)
    assert cli("publish", queue, "--payload", "1", "--key", "k" * 300).status == 0
    [message] = messages(cli, queue)

    lines = cli("queues", "peek", queue).out.splitlines()  # a pipe: 200 columns
    header, _, row = lines
    assert header.split() == ["id", "seq", "state", "attempt", "priority", "key", "published", "payload"]
    assert row.split()[0] == message["id"] and row.split()[-2:] == [message["published_at"], "1"]
    assert "k" * 100 in row and "k" * 300 not in row and "…" in row
    assert max(len(line) for line in lines) <= 200


def test_control_characters_are_escaped_so_a_row_is_one_line(cli: Run) -> None:
    queue = fresh_queue(cli)
    key = "two\nlines\x1b[31m"
    assert cli("publish", queue, "--payload", '"a\\u2028b\\u0085c"', "--key", key).status == 0
    assert cli("publish", queue, "--payload", "2").status == 0

    lines = cli("queues", "peek", queue).out.splitlines()
    assert len(lines) == 4  # header, rule, and one line for each message
    assert "two\\nlines\\u001b[31m" in lines[2]
    assert '"a\\u2028b\\u0085c"' in lines[2]
    consumed = cli("consume", queue, "--max", "2").out.splitlines()
    assert len(consumed) == 5 and "two\\nlines" in consumed[2]


def test_long_queue_names_leave_the_headers_whole(cli: Run) -> None:
    name = fresh_queue(cli, "n" * 127 + uuid.uuid4().hex[:1])
    header, _, *rows = cli("queues", "list").out.splitlines()
    assert header.split() == [
        "queue", "ready", "delayed", "in", "flight", "oldest", "ready", "(s)", "published", "acked",
        "dead-lettered",
    ]  # fmt: skip
    assert any(row.split()[0] == name for row in rows)
    assert name in cli("queues", "inspect", name).out  # the config's fields are not cut either


# -- a stdout that goes away --------------------------------------------------------------------------


def broker_command(
    broker_url: str, *argv: str, stdout: int | IO[Any], unbuffered: bool = False
) -> subprocess.CompletedProcess[str]:
    """``broker ARGV`` in a process of its own, its stdout buffered as in a pipe for real (this sandbox
    sets PYTHONUNBUFFERED, which hides failures until the interpreter's last flush), or unbuffered."""
    environment = {**os.environ, "BROKER_URL": broker_url, "PYTHONUNBUFFERED": "1"}
    if not unbuffered:
        environment.pop("PYTHONUNBUFFERED")
    environment.pop("COLUMNS", None)
    return subprocess.run(
        [sys.executable, "-m", "broker", *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=environment,
        timeout=60,
    )


@contextmanager
def closed_pipe() -> Iterator[int]:
    """The write end of a pipe whose reader is gone: every write to it fails (EPIPE)."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        yield writer
    finally:
        os.close(writer)


@pytest.fixture
def many(cli: Run) -> str:
    """A queue whose table is far more than a pipe's buffer holds."""
    queue = fresh_queue(cli)
    lines = "".join(json.dumps({"n": n, "padding": "p" * 40}) + "\n" for n in range(3000))
    assert cli("publish", queue, "--file", "-", stdin=lines).status == 0
    return queue


@pytest.mark.parametrize(
    "argv",
    [
        ("queues", "peek", "{queue}", "--limit", "3000"),  # a table
        ("queues", "peek", "{queue}", "--limit", "3000", "--json"),  # a JSON document
        ("queues", "list"),  # a small table: it fails at the flush
        ("queues", "--help"),  # argparse's own printing
    ],
)
def test_a_reader_that_went_away_ends_the_command_quietly_with_141(
    broker_url: str, many: str, argv: tuple[str, ...]
) -> None:
    with closed_pipe() as stdout:
        result = broker_command(broker_url, *(part.format(queue=many) for part in argv), stdout=stdout)
    assert (result.returncode, result.stderr) == (141, "")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("as_json", [False, True])
def test_a_full_disk_is_one_line_and_exit_1(broker_url: str, as_json: bool) -> None:
    with open("/dev/full", "w") as full:
        result = broker_command(broker_url, "queues", "list", *(["--json"] if as_json else []), stdout=full)
    assert result.returncode == 1
    message = "cannot write to stdout: No space left on device"
    if as_json:
        assert json.loads(result.stderr) == {"error": {"code": "output_failed", "message": message}}
    else:
        assert result.stderr == f"broker: output_failed: {message}\n"


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
def test_a_reader_that_leaves_after_the_first_bytes_ends_the_command_with_141(
    broker_url: str, many: str, unbuffered: bool
) -> None:
    """``| head -1``: the reader takes the first bytes of a table larger than the pipe holds, then goes.
    With PYTHONUNBUFFERED (common in containers), the write under way returned what the pipe had taken,
    stdout said nothing of the rest, and the command exited 0 as if the reader had had it all."""
    environment = {**os.environ, "BROKER_URL": broker_url, "PYTHONUNBUFFERED": "1"}
    if not unbuffered:
        environment.pop("PYTHONUNBUFFERED")
    with subprocess.Popen(
        [sys.executable, "-m", "broker", "queues", "peek", many, "--limit", "3000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=environment,
    ) as command:
        assert command.stdout is not None and command.stderr is not None
        assert command.stdout.read(10)  # blocks until the table is being written
        command.stdout.close()
        assert command.wait(timeout=60) == 141
        assert command.stderr.read() == b""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
def test_a_full_disk_under_a_table_is_one_line_and_exit_1(
    broker_url: str, many: str, unbuffered: bool
) -> None:
    with open("/dev/full", "w") as full:
        result = broker_command(
            broker_url, "queues", "peek", many, "--limit", "5", stdout=full, unbuffered=unbuffered
        )
    assert (result.returncode, result.stderr) == (
        1,
        "broker: output_failed: cannot write to stdout: No space left on device\n",
    )


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_consume_ack_into_a_full_disk_acks_nothing_it_could_not_show(cli: Run, broker_url: str) -> None:
    """consume settled first and printed after: --ack into a stdout that failed acked messages no one
    saw. The table comes first now, and messages it could not show are given back."""
    queue = fresh_queue(cli)
    assert cli("publish", queue, "--payload", '"precious"').status == 0
    with open("/dev/full", "w") as full:
        result = broker_command(broker_url, "consume", queue, "--ack", stdout=full)
    assert result.returncode == 1 and "output_failed" in result.stderr
    [message] = messages(cli, queue)
    assert (message["state"], message["attempt"]) == ("ready", 0)


def test_a_locale_that_cannot_hold_a_payload_gets_it_escaped(cli: Run, broker_url: str) -> None:
    """With PYTHONIOENCODING=ascii the table could not be encoded, and the UnicodeEncodeError was
    reported as 'bad_answer: the answer is not the broker's'. Tables escape, JSON uses its escapes."""
    queue = fresh_queue(cli)
    assert cli("publish", queue, "--payload", '{"s": "é☃"}').status == 0
    environment = {**os.environ, "BROKER_URL": broker_url, "PYTHONIOENCODING": "ascii"}
    for argv, shown in (
        (["queues", "peek", queue], "\\xe9\\u2603"),
        (["queues", "peek", queue, "--json"], None),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "broker", *argv],
            capture_output=True,
            env=environment,
            timeout=60,
            check=False,
        )
        assert (result.returncode, result.stderr) == (0, b""), result.stderr
        if shown is None:
            assert json.loads(result.stdout)["messages"][0]["payload"] == {"s": "é☃"}
        else:
            assert shown.encode() in result.stdout


def test_a_closed_stdout_is_one_line_not_a_traceback(broker_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "broker", "queues", "list"],
        stdout=None,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "BROKER_URL": broker_url},
        timeout=60,
        check=False,
        preexec_fn=lambda: os.close(1),  # as `>&-` does: Python then starts with sys.stdout None
    )
    assert (result.returncode, result.stderr) == (
        1,
        "broker: output_failed: cannot write to stdout: stdout is closed\n",
    )


def test_a_json_error_in_an_ascii_locale_is_json(broker_url: str) -> None:
    """The error line relied on stderr's backslashreplace, which writes \\U0001f600: not JSON."""
    result = subprocess.run(
        [sys.executable, "-m", "broker", "consume", "q", "--lease", "\U0001f600", "--json"],
        capture_output=True,
        env={**os.environ, "BROKER_URL": broker_url, "PYTHONIOENCODING": "ascii"},
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert json.loads(result.stderr)["error"]["code"] == "bad_input"
