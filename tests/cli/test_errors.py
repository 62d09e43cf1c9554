"""What a script can rely on when things go wrong: exit statuses, one line on stderr, no traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

import broker.cli as cli_module
from broker.core.config import QUEUE_NAME
from tests.cli.conftest import Run


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_an_unreachable_broker_is_exit_3(cli: Run) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    down = cli("queues", "list", "--url", url)
    assert down.status == 3
    assert down.err.startswith(f"broker: unreachable: cannot reach {url}") and down.err.count("\n") == 1
    as_json = cli("publish", "jobs", "--payload", "1", "--url", url, "--json")
    assert as_json.status == 3 and json.loads(as_json.err)["error"]["code"] == "unreachable"


def test_usage_errors_are_exit_2(cli: Run) -> None:
    assert cli("queues").status == 2
    assert cli("queues", "inspect").status == 2
    assert cli("queues", "peek", "jobs", "--limit", "many").status == 2
    assert cli("consume", "jobs", "--ack", "--nack").status == 2
    assert cli("queues", "inspect", "not a name!").status == 2


class Refusing(BaseHTTPRequestHandler):
    """A stand-in broker that refuses every token, and remembers the Authorization it was sent."""

    seen: list[str | None] = []

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        body = json.dumps({"error": {"code": "unauthorized", "message": "A valid token is required."}})
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """The URL of an HTTP server on a free port answering with ``handler``, for the block."""
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def refusing_url() -> Iterator[str]:
    with serving(Refusing) as url:
        yield url


def test_the_token_is_sent_as_a_bearer_and_a_refusal_is_exit_5(
    cli: Run, refusing_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    Refusing.seen.clear()
    refused = cli("queues", "list", "--url", refusing_url, "--token", "s3cret-s3cret-s3cret")
    assert refused.status == 5
    assert refused.err == "broker: unauthorized: A valid token is required.\n"
    monkeypatch.setenv("BROKER_TOKEN", "from-the-environment")
    assert cli("queues", "list", "--url", refusing_url).status == 5
    assert Refusing.seen == ["Bearer s3cret-s3cret-s3cret", "Bearer from-the-environment"]


def test_the_installed_command_exits_with_the_status_and_no_traceback(broker_url: str) -> None:
    environment = {**os.environ, "BROKER_URL": broker_url}
    result = subprocess.run(
        [sys.executable, "-m", "broker", "queues", "inspect", "ghost"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 4
    assert result.stderr == "broker: queue_not_found: queue 'ghost' does not exist\n"
    assert result.stdout == ""


@pytest.mark.parametrize(
    "argv",
    [
        ("queues", "list", "--timeout", "0"),
        ("queues", "list", "--timeout", "-1"),
        ("queues", "list", "--timeout", "nan"),
        ("queues", "list", "--timeout", "soon"),
        ("consume", "jobs", "--max", "0"),
        ("consume", "jobs", "--max", "-3"),
        ("consume", "jobs", "--wait", "-1"),
        ("consume", "jobs", "--wait", "31"),
        ("publish", "jobs", "--payload", "1", "--priority", "x"),
        ("queues", "peek", "jobs", "--state", "bogus"),
        ("publish", "jobs"),  # neither --payload nor --file
        ("queues", "list", "--no-such-flag"),
        ("queues",),
        (),
        ("serve", "--log-level", "loud"),  # the commands that share the parser follow the same rule
        ("snapshot", "restore", "--data-dir"),
    ],
)
def test_a_usage_error_is_one_line_naming_bad_input(cli: Run, argv: tuple[str, ...]) -> None:
    result = cli(*argv)
    assert (result.status, result.out) == (2, ""), result
    assert result.err.startswith("broker: bad_input: ") and result.err.count("\n") == 1, result.err
    assert "usage:" not in result.err and "Traceback" not in result.err
    assert result.err.rstrip().endswith("--help)")  # where the command's usage is

    as_json = cli(*argv, "--json")
    assert (as_json.status, as_json.out) == (2, "")
    message = result.err.removeprefix("broker: bad_input: ").rstrip("\n")
    assert json.loads(as_json.err) == {"error": {"code": "bad_input", "message": message}}


def test_a_value_out_of_range_says_which_and_why(cli: Run) -> None:
    result = cli("queues", "list", "--timeout", "0")
    assert result.err == (
        "broker: bad_input: argument --timeout: '0' is out of range: above 0 up to 86400 seconds "
        "(see broker queues list --help)\n"
    )


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (("queues", "list", "--bogus"), "broker queues list"),
        (("snapshot", "list", "--bogus"), "broker snapshot list"),
        (("serve", "--bogus"), "broker serve"),
        (("--bogus", "queues", "list"), "broker"),
        (("queues", "list", "--timeout", "5", "--bogus"), "broker queues list"),
    ],
)
def test_an_unknown_flag_points_at_the_help_of_the_command_it_was_given_to(
    cli: Run, argv: tuple[str, ...], command: str
) -> None:
    result = cli(*argv)
    assert (result.status, result.err) == (
        2,
        f"broker: bad_input: unrecognized arguments: --bogus (see {command} --help)\n",
    )


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--json", "queues", "list"), "--json"),
        (("queues", "--json", "list"), "--json"),
        (
            ("--url", "http://127.0.0.1:1", "--json", "queues", "list"),
            "--url",
        ),  # URL was taken as the command
        (("--url=http://127.0.0.1:1", "--json", "queues", "list"), "--url"),
        (("--timeout", "5", "--json", "queues", "list"), "--timeout"),
        # The first misplaced option is named, however many follow it, and between the words too.
        (("--token", "secret-01234", "--url", "http://127.0.0.1:1", "queues", "list", "--json"), "--token"),
        (("--json", "--url", "http://127.0.0.1:1", "queues", "list"), "--json"),
        (("queues", "--url", "http://127.0.0.1:1", "list", "--json"), "--url"),
    ],
)
def test_a_flag_of_the_command_given_before_its_name_is_told_where_it_goes(
    cli: Run, argv: tuple[str, ...], flag: str
) -> None:
    result = cli(*argv)
    message = (
        f"{flag} goes after the command's name: broker queues list {flag} … (see broker queues list --help)"
    )
    assert (result.status, json.loads(result.err)) == (
        2,
        {"error": {"code": "bad_input", "message": message}},
    )


def test_help_is_still_argparse_s(cli: Run) -> None:
    shown = cli("queues", "list", "--help")
    assert shown.status == 0 and shown.out.startswith("usage: broker queues list ")
    assert "--timeout SECONDS" in shown.out and shown.err == ""


@pytest.mark.parametrize(
    "argv",
    [
        ("queues", "inspect", "bad/name"),
        ("queues", "create", ""),
        ("queues", "peek", "_starts-with-an-underscore"),
        ("queues", "create", "n" * 129),
        ("publish", "a b", "--payload", "1"),
        ("consume", "q?x=1"),
        ("queues", "redrive", "jobs", "--all", "--to", "bad/name"),
        ("queues", "create", "jobs", "--dead-letter", "bad/name"),
    ],
)
def test_a_queue_name_that_is_not_one_is_bad_input_before_any_request(
    cli: Run, refusing_url: str, argv: tuple[str, ...]
) -> None:
    Refusing.seen.clear()
    result = cli(*argv, "--url", refusing_url)
    assert result.status == 2, result
    assert result.err.startswith("broker: bad_input: argument ") and result.err.count("\n") == 1
    assert "is not a queue name: it must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$" in result.err
    assert Refusing.seen == []  # nothing was sent


def test_queue_names_are_checked_as_the_broker_checks_them() -> None:
    assert cli_module.QUEUE_NAME.pattern == QUEUE_NAME.pattern


@pytest.mark.parametrize(
    "token", ["abc\ndef-s3cret", "s3cret with spaces", "s3cr\u00e9t", "s3cret\u2603", "tab\ts3cret"]
)
def test_a_token_no_header_can_carry_is_bad_input_and_never_printed(
    cli: Run, refusing_url: str, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    Refusing.seen.clear()
    expected = "broker: bad_input: the token holds a character a header cannot carry\n"
    flag = cli("queues", "list", "--url", refusing_url, "--token", token)
    assert (flag.status, flag.err) == (2, expected)
    monkeypatch.setenv("BROKER_TOKEN", token)
    environment = cli("queues", "list", "--url", refusing_url, "--json")
    assert environment.status == 2
    assert (
        json.loads(environment.err)["error"]["message"]
        == expected.removeprefix("broker: bad_input: ").rstrip()
    )
    assert "s3cr" not in flag.err + environment.err
    assert Refusing.seen == []


def test_ctrl_c_at_any_moment_of_main_is_exit_130(
    cli: Run, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while the parser is built (it imports broker.config, whose imports take a while)."""

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "build_parser", interrupted)
    try:
        status = cli_module.main(["queues", "list"])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped main: a traceback")
    assert (status, capsys.readouterr().err) == (130, "broker: interrupted: stopped by Ctrl-C\n")


def test_the_command_imports_nothing_slow_before_main_runs() -> None:
    """A Ctrl-C while ``broker.cli`` itself is imported is outside main's reach: keep that short."""
    probe = (
        "import sys, broker.cli; "
        "print([name for name in ('trio', 'httpx', 'rich', 'broker.config', 'broker.commands') "
        "if name in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout == "[]\n"


class NotTheBroker(BaseHTTPRequestHandler):
    """Another HTTP server at the broker's address: answers in HTML, as ``python3 -m http.server``."""

    def _answer(self, status: int) -> None:
        body = b"<html><body>Error</body></html>"
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(404)

    def do_POST(self) -> None:
        self._answer(501)

    def do_PUT(self) -> None:
        self._answer(400)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def other_server_url() -> Iterator[str]:
    with serving(NotTheBroker) as url:
        yield url


@pytest.mark.parametrize(
    "argv",
    [
        ("queues", "list"),  # 404 in HTML
        ("queues", "inspect", "jobs"),
        ("publish", "jobs", "--payload", "1"),  # 501 in HTML
        ("queues", "create", "jobs"),  # 400 in HTML
    ],
)
def test_another_server_at_the_url_is_a_bad_answer(
    cli: Run, other_server_url: str, argv: tuple[str, ...]
) -> None:
    result = cli(*argv, "--url", other_server_url)
    assert (result.status, result.err.split(":")[:2]) == (1, ["broker", " bad_answer"]), result


class JsonOfAnotherShape(NotTheBroker):
    """A server that answers 200 with JSON, but not the broker's (an API of something else)."""

    def _answer(self, status: int) -> None:
        body = b'{"items": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("argv", [("queues", "list"), ("publish", "jobs", "--payload", "1")])
def test_json_of_another_shape_is_a_bad_answer_not_a_traceback(cli: Run, argv: tuple[str, ...]) -> None:
    with serving(JsonOfAnotherShape) as url:
        result = cli(*argv, "--url", url)
    assert (result.status, result.err.split(":")[:2]) == (1, ["broker", " bad_answer"]), result
    assert "Traceback" not in result.err
