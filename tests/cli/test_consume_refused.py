"""``broker consume`` never leaves what it claimed leased when it stops on an error: bad flags stop it
before it claims, and a settle the broker refuses gives the messages back first. A message left leased
would come back at lease expiry with an attempt spent, or be dead-lettered (docs/cli.md, consume)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.client import Client
from tests.cli.conftest import Run
from tests.cli.serving import running_broker

#: The broker of ``strict_url`` takes reasons of at most this many characters.
STRICT_REASON_LENGTH = 5


def precious(cli: Run, *options: str) -> str:
    """A queue where one spent attempt dead-letters its one message."""
    name = f"q-{uuid.uuid4().hex[:10]}"
    assert cli("queues", "create", name, "--max-attempts", "1", *options).status == 0
    assert cli("publish", name, "--payload", '"precious"', *options).status == 0
    return name


def stats(cli: Run, queue: str, *options: str) -> dict[str, Any]:
    result = cli("queues", "inspect", queue, "--limit", "0", "--json", *options)
    assert result.status == 0, result.err
    body: dict[str, Any] = result.json()["stats"]
    return body


def assert_untouched(cli: Run, queue: str, *options: str) -> None:
    """The message is ready, claimable at once, with no attempt spent and nothing dead-lettered."""
    after = stats(cli, queue, *options)
    assert (after["ready"], after["in_flight"], after["dead_lettered_total"]) == (1, 0, 0), after
    [message] = cli("queues", "peek", queue, "--json", *options).json()["messages"]
    assert message["attempt"] == 0


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (["--nack", "--delay", "xyz"], "--delay 'xyz' is not a duration"),
        (["--nack", "--delay", "nan"], "--delay 'nan' is not a finite number of seconds"),
        (["--nack", "--delay", "8d"], "--delay '8d' is out of range"),  # a nack delay is at most 7 days
        (["--nack", "--reason", "x" * 5000], "--reason is 5000 characters long: at most 4096"),
        (["--reason", "x" * 4097], "--reason is 4097 characters long"),
        (["--lease", "nan"], "--lease 'nan' is not a finite number of seconds"),
        (["--lease", "0.01"], "--lease '0.01' is out of range"),
    ],
)
def test_a_flag_the_broker_would_refuse_stops_consume_before_it_claims(
    cli: Run, flags: list[str], complaint: str
) -> None:
    name = precious(cli)
    refused = cli("consume", name, *flags)
    assert refused.status == 2 and refused.out == ""
    assert refused.err.startswith(f"broker: bad_input: {complaint}") and refused.err.count("\n") == 1
    assert_untouched(cli, name)
    assert stats(cli, name)["deferred_total"] == 0  # never claimed, so nothing to give back


@pytest.fixture(scope="module")
def strict_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real broker configured to take only very short reasons."""
    directory = tmp_path_factory.mktemp("strict")
    config = directory / "broker.toml"
    config.write_text(f"[limits]\nmax_reason_length = {STRICT_REASON_LENGTH}\n")
    with running_broker(Path(directory), "--config", str(config)) as url:
        yield url


def test_the_default_look_needs_no_reason_the_broker_may_refuse(cli: Run, strict_url: str) -> None:
    name = precious(cli, "--url", strict_url)
    for _ in range(3):  # it used to defer with a 27-character reason of its own: refused every time
        looked = cli("consume", name, "--url", strict_url)
        assert looked.status == 0, looked.err
        assert looked.out.splitlines()[-1] == "given back (attempt refunded): 1 of 1"
    assert_untouched(cli, name, "--url", strict_url)


@pytest.mark.parametrize("action", [[], ["--print-only"], ["--nack"]])
def test_a_settle_the_broker_refuses_gives_the_messages_back(
    cli: Run, strict_url: str, action: list[str]
) -> None:
    name = precious(cli, "--url", strict_url)
    assert cli("publish", name, "--payload", '"second"', "--url", strict_url).status == 0
    reason = "x" * (STRICT_REASON_LENGTH + 1)  # under the CLI's own limit, over this broker's
    refused = cli("consume", name, "--max", "2", "--reason", reason, "--url", strict_url, *action)
    after = stats(cli, name, "--url", strict_url)
    assert (after["ready"], after["in_flight"], after["dead_lettered_total"]) == (2, 0, 0), after
    messages = cli("queues", "peek", name, "--json", "--url", strict_url).json()["messages"]
    assert [m["attempt"] for m in messages] == [0, 0]
    # The table came first (a settle goes only to messages shown), and no summary line after it.
    assert refused.status == 2 and [line.split()[-1] for line in refused.out.splitlines()[2:]] == [
        '"precious"',
        '"second"',
    ]
    assert refused.err.startswith("broker: invalid_request: ") and refused.err.count("\n") == 1
    assert refused.err.endswith("(the 2 messages claimed were given back, no attempt spent)\n")


def test_ctrl_c_after_the_claim_gives_the_messages_back(cli: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C between the claim and the settle left every claimed message leased, to come back at lease
    expiry with an attempt spent (dead-lettered with max_attempts 1)."""
    name = precious(cli)
    assert cli("publish", name, "--payload", '"second"').status == 0

    def interrupted(*_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(Client, "ack", interrupted)
        stopped = cli("consume", name, "--max", "2", "--ack")
    assert stopped.status == 130 and stopped.err == "broker: interrupted: stopped by Ctrl-C\n"
    after = stats(cli, name)
    assert (after["ready"], after["in_flight"], after["acked_total"], after["deferred_total"]) == (2, 0, 0, 2)
