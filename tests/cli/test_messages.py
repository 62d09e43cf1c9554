"""``broker publish`` and ``broker consume`` against a real broker."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from broker.commands.exits import CommandError
from broker.commands.queues import duration
from broker.core import parse_duration
from broker.errors import InvalidRequest
from tests.cli.conftest import Run


def stats(cli: Run, queue: str) -> dict[str, int]:
    result = cli("queues", "inspect", queue, "--limit", "0", "--json")
    assert result.status == 0, result.err
    body: dict[str, dict[str, int]] = result.json()
    return body["stats"]


def test_publish_one_payload_with_its_options(cli: Run, queue: str) -> None:
    first = cli("publish", queue, "--payload", '{"to": "ada"}', "--key", "k-1", "--priority", "5",
                "--header", "trace=abc", "--json")  # fmt: skip
    assert first.status == 0, first.err
    [ref] = first.json()["messages"]
    assert (ref["seq"], ref["duplicate"]) == (1, False)
    again = cli("publish", queue, "--payload", '{"to": "bob"}', "--key", "k-1")
    assert again.status == 0 and again.out == f"duplicate of {ref['id']} (seq 1) in {queue}\n"

    later = cli("publish", queue, "--payload", "2", "--delay", "1h")
    assert later.out.startswith("published ") and later.out.endswith(f"(seq 2) in {queue}\n")
    [message] = cli("queues", "peek", queue, "--json").json()["messages"]
    assert (message["payload"], message["priority"], message["key"]) == ({"to": "ada"}, 5, "k-1")
    assert message["headers"] == {"trace": "abc"}
    assert (stats(cli, queue)["ready"], stats(cli, queue)["delayed"]) == (1, 1)


def test_a_payload_that_is_not_json_is_refused_before_anything_is_sent(cli: Run, queue: str) -> None:
    for text in ("{nope", "hello", ""):
        bad = cli("publish", queue, "--payload", text)
        assert bad.status == 2
        assert bad.err.startswith("broker: bad_input: --payload is not valid JSON")
        assert bad.err.count("\n") == 1
    assert stats(cli, queue)["published_total"] == 0


def test_publish_to_a_missing_queue_is_exit_4(cli: Run) -> None:
    missing = cli("publish", "ghost", "--payload", "1")
    assert missing.status == 4 and missing.err.startswith("broker: queue_not_found: ")


def test_publish_a_file_in_batches(cli: Run, queue: str, tmp_path: Path) -> None:
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps({"n": n}) + "\n" for n in range(2500)) + "\n")
    published = cli("publish", queue, "--file", str(path), "--priority", "2")
    assert published.status == 0, published.err
    assert published.out == f"published 2500 messages to {queue}\n"
    assert stats(cli, queue)["ready"] == 2500
    [first] = cli("queues", "peek", queue, "--limit", "1", "--json").json()["messages"]
    assert (first["payload"], first["priority"]) == ({"n": 0}, 2)


def test_publish_a_file_of_envelopes(cli: Run, queue: str) -> None:
    lines = (
        '{"payload": 1, "key": "a"}\n{"payload": 2, "key": "a"}\n'
        '{"payload": "aGk=", "payload_encoding": "base64"}\n'
    )
    published = cli("publish", queue, "--file", "-", "--envelope", "--json", stdin=lines)
    assert published.status == 0, published.err
    body = published.json()
    assert body["published"] == 2
    assert [m["duplicate"] for m in body["messages"]] == [False, True, False]
    shown = cli("queues", "peek", queue).out
    assert "<2 bytes>" in shown

    not_envelope = cli("publish", queue, "--file", "-", "--envelope", stdin="1\n")
    assert not_envelope.status == 2 and "stdin line 1" in not_envelope.err


def test_a_file_with_a_bad_line_publishes_nothing(cli: Run, queue: str, tmp_path: Path) -> None:
    path = tmp_path / "jobs.jsonl"
    path.write_text('{"n": 1}\n{"n": 2\n')
    bad = cli("publish", queue, "--file", str(path))
    assert bad.status == 2
    assert bad.err.startswith(f"broker: bad_input: {path} line 2 is not valid JSON")
    assert stats(cli, queue)["published_total"] == 0
    assert cli("publish", queue, "--file", str(tmp_path / "none.jsonl")).status == 2
    assert cli("publish", queue, "--file", str(path), "--key", "k").status == 2
    assert cli("publish", queue).status == 2  # --payload or --file


def test_consume_print_only_is_the_default_and_spends_no_attempt(cli: Run) -> None:
    name = f"once-{id(cli)}"
    assert cli("queues", "create", name, "--max-attempts", "1").status == 0
    assert cli("publish", name, "--payload", '"job"').status == 0
    for _ in range(3):
        shown = cli("consume", name)
        assert shown.status == 0
        assert shown.out.splitlines()[-1] == "given back (attempt refunded): 1 of 1"
    looked = cli("consume", name, "--print-only", "--json").json()
    assert looked["action"] == "print-only" and looked["settled"] == 1
    assert looked["messages"][0]["attempt"] == 1  # each look was attempt 1: nothing was spent
    after = stats(cli, name)
    assert (after["ready"], after["deferred_total"], after["dead_lettered_total"]) == (1, 4, 0)


def test_consume_ack_removes_and_nack_retries(cli: Run, queue: str) -> None:
    for n in range(3):
        assert cli("publish", queue, "--payload", str(n)).status == 0
    acked = cli("consume", queue, "--max", "2", "--ack", "--json")
    assert acked.status == 0
    body = acked.json()
    assert [m["payload"] for m in body["messages"]] == [0, 1] and body["settled"] == 2
    assert body["messages"][0]["lease_id"]
    nacked = cli("consume", queue, "--nack", "--delay", "1h", "--reason", "downstream down")
    assert nacked.status == 0 and nacked.out.splitlines()[-1] == "nacked: 1 of 1"
    after = stats(cli, queue)
    assert (after["ready"], after["delayed"], after["acked_total"], after["nacked_total"]) == (0, 1, 2, 1)

    empty = cli("consume", queue, "--ack")
    assert (empty.status, empty.out) == (0, f"no messages ready in {queue}\n")
    assert cli("consume", queue, "--json").json()["messages"] == []


def test_consume_more_than_one_claim_can_carry(cli: Run, queue: str) -> None:
    lines = "".join(f"{n}\n" for n in range(1200))
    assert cli("publish", queue, "--file", "-", stdin=lines).status == 0
    acked = cli("consume", queue, "--max", "1500", "--ack", "--json").json()
    assert len(acked["messages"]) == 1200 and acked["settled"] == 1200
    assert stats(cli, queue)["acked_total"] == 1200


def test_consume_wait_long_polls_for_the_first_message(cli: Run, queue: str) -> None:
    waited = cli("consume", queue, "--wait", "0.2", "--json")
    assert waited.status == 0 and waited.json()["messages"] == []


@pytest.mark.parametrize(
    ("argv", "stdin", "complaint"),
    [
        (["--payload", "NaN"], None, "--payload is not valid JSON: NaN is not a finite number"),
        (["--payload=-Infinity"], None, "--payload is not valid JSON: -Infinity is not a finite number"),
        (["--payload", "1e999"], None, "--payload is not valid JSON: 1e999 is not a finite number"),
        (["--payload", '{"deep": [1, Infinity]}'], None, "--payload is not valid JSON: Infinity"),
        (["--file", "-"], '{"ok": 1}\n{"big": 1e400}\n', "stdin line 2 is not valid JSON: 1e400 is not a"),
        (["--file", "-", "--envelope"], '{"payload": 1, "delay": NaN}\n', "stdin line 1 is not valid JSON"),
        (["--payload", "1", "--delay", "nan"], None, "--delay 'nan' is not a finite number of seconds"),
        (["--payload", "1", "--delay", "inf"], None, "--delay 'inf' is not a finite number of seconds"),
        (["--payload", "1", "--delay", "1e999"], None, "--delay '1e999' is not a finite number"),
    ],
)
def test_numbers_json_cannot_carry_are_refused_not_published_as_null(
    cli: Run, queue: str, argv: list[str], stdin: str | None, complaint: str
) -> None:
    refused = cli("publish", queue, *argv, stdin=stdin)
    assert refused.status == 2 and refused.err.startswith(f"broker: bad_input: {complaint}"), refused
    assert refused.err.count("\n") == 1
    assert stats(cli, queue)["published_total"] == 0


def test_a_queue_config_with_nan_is_refused(cli: Run, queue: str) -> None:
    for flags in (["--config", '{"lease": NaN}'], ["--lease", "nan"], ["--retry-backoff", "fixed:inf"]):
        refused = cli("queues", "create", queue, *flags)
        assert refused.status == 2 and refused.err.startswith("broker: bad_input: "), refused
    assert cli("queues", "inspect", queue, "--json").json()["config"]["lease"] == 30


@pytest.mark.parametrize(
    "text",
    ["30", "2.5", ".5", "250ms", "30s", " 5m ", "12h", "1d", "0", "1.5h", "5 m", "1e3", "-1", "1_000",
     "nan", "inf", "-inf", "1e999", "", "m", "5x", "1.2.3", "5 ms s", "\u0663s", "\uff15s", "0x10", "1/2"],
)  # fmt: skip
def test_durations_read_as_the_broker_reads_them(text: str) -> None:
    """The CLI checks durations before it sends them (a nack's delay before the claim): it must read
    them as the broker does (broker.core.durations), or refuse what the broker would refuse."""
    try:
        mine: float | None = duration(text, "--flag")
    except CommandError:
        mine = None
    try:
        theirs: float | None = parse_duration(text, "field", low=-math.inf)
    except InvalidRequest:  # the broker's grammar for strings; the CLI sends a number it reads
        theirs = parse_duration(mine, "field", low=-math.inf) if mine is not None else None
    assert mine == theirs
