"""What scripts see when a real broker refuses: a full queue (exit 1), a token missing or without the
scope (exit 5), a URL that is not one (exit 3); and the answers of ``queues delete --json``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.conftest import Run
from tests.cli.serving import running_broker

ADMIN = "admin-secret-0123456789"
READER = "reader-secret-0123456789"
PRODUCER = "producer-secret-0123456789"


def test_publish_to_a_full_queue_is_exit_1(cli: Run, queue: str) -> None:
    assert cli("queues", "create", queue, "--max-depth", "1").status == 0
    assert cli("publish", queue, "--payload", "1").status == 0
    full = cli("publish", queue, "--payload", "2")
    assert full.status == 1 and full.out == ""
    assert full.err.startswith("broker: queue_full: ") and full.err.count("\n") == 1
    as_json = cli("publish", queue, "--payload", "2", "--json")
    assert as_json.status == 1 and json.loads(as_json.err)["error"]["code"] == "queue_full"


def test_a_file_refused_partway_says_how_many_went_in(cli: Run, queue: str) -> None:
    assert cli("queues", "create", queue, "--max-depth", "1500").status == 0
    lines = "".join(f"{n}\n" for n in range(2500))  # batches of 1000: the second one is refused
    partly = cli("publish", queue, "--file", "-", stdin=lines)
    assert partly.status == 1
    assert partly.err.startswith("broker: queue_full: ") and partly.err.count("\n") == 1
    assert "(the first 1000 of 2500 were published)" in partly.err
    stats = cli("queues", "inspect", queue, "--limit", "0", "--json").json()["stats"]
    assert stats["ready"] == 1000


def test_delete_answers_json(cli: Run, queue: str) -> None:
    deleted = cli("queues", "delete", queue, "--force", "--json")
    assert (deleted.status, deleted.json()) == (0, {"queue": queue, "deleted": True})
    again = cli("queues", "delete", queue, "--force", "--json")
    assert again.status == 4 and json.loads(again.err)["error"]["code"] == "queue_not_found"


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:99999"])
def test_a_url_that_is_not_one_is_exit_3(cli: Run, url: str) -> None:
    bad = cli("queues", "list", "--url", url)
    assert bad.status == 3
    assert bad.err.startswith(f"broker: unreachable: {url} is not a URL: ") and bad.err.count("\n") == 1


@pytest.mark.parametrize("where", ["--url", "BROKER_URL"])
@pytest.mark.parametrize(
    "url",
    [
        *(f"http://ops:{password}@127.0.0.1:8080/" for password in ("s3cr@t-pw", "s3cr/t-pw", "s3cr#t-pw")),
        "http://ops:s3cr?t-pw@127.0.0.1:8080/",
        "ops:s3cr-t-pw@127.0.0.1:8080",  # curl's form, without "//"
        "http:ops:s3cr-t-pw@127.0.0.1:8080",
        "http://ops:s3cr\nt-pw@127.0.0.1:8080/",  # a newline in the password
        "http://127.0.0.1:8080/x?ops=s3cr@t-pw",
        "http://ops:s3cr-t-pw\uff20127.0.0.1:8080/",  # a fullwidth at, which NFKC makes "@"
    ],
)
def test_a_password_in_the_url_is_refused_and_never_printed(
    cli: Run, monkeypatch: pytest.MonkeyPatch, where: str, url: str
) -> None:
    for json_flag in ((), ("--json",)):
        if where == "--url":
            bad = cli("queues", "list", *json_flag, "--url", url)
        else:
            monkeypatch.setenv("BROKER_URL", url)
            bad = cli("queues", "list", *json_flag)
        assert bad.status == 3
        assert "holds an '@'" in bad.err and "--token" in bad.err
        assert "s3cr" not in bad.err and "pw" not in bad.err and "ops" not in bad.err


@pytest.mark.parametrize(
    "arguments",
    [
        ["snapshot", "list", "--url", "http://ops:s3cr-t-pw@127.0.0.1:8080"],  # takes no --url
        ["snapshot", "list", "--token", "s3cr-t-pw-0123456789"],
        ["queues", "list", "--urls=http://ops:s3cr-t-pw@127.0.0.1:8080"],
        ["queues", "list", "extra", "ops:s3cr-t-pw@127.0.0.1"],
        # Before the command's name, where argparse takes the value for the command ("invalid choice").
        ["snapshot", "--token", "s3cr-t-pw-0123456789", "list"],
        ["--url", "http://ops:s3cr-t-pw@127.0.0.1:8080", "snapshot", "list"],
        ["--token", "s3cr-t-pw-0123456789", "queues"],
        ["queues", "--token", "s3cr-t-pw-0123456789", "lst"],
    ],
)
def test_a_usage_error_never_prints_a_value_that_may_be_secret(cli: Run, arguments: list[str]) -> None:
    """The "unrecognized arguments" and "invalid choice" refusals printed them whole: a URL's password,
    a token."""
    bad = cli(*arguments)
    assert bad.status == 2 and "bad_input" in bad.err
    assert "s3cr" not in bad.err and "pw" not in bad.err, bad.err


@pytest.fixture(scope="module")
def guarded_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real broker with two tokens: one ``admin``, one that may only read."""
    directory = tmp_path_factory.mktemp("guarded")
    config = directory / "broker.toml"
    config.write_text(
        f'[[tokens]]\nname = "ops"\nsecret = "{ADMIN}"\nscopes = ["admin"]\n\n'
        f'[[tokens]]\nname = "dashboard"\nsecret = "{READER}"\nscopes = ["read:*"]\n\n'
        f'[[tokens]]\nname = "producer"\nsecret = "{PRODUCER}"\nscopes = ["publish:*"]\n'
    )
    with running_broker(Path(directory), "--config", str(config)) as url:
        yield url


def test_a_missing_or_wrong_token_is_exit_5(cli: Run, guarded_url: str) -> None:
    for token in ([], ["--token", "not-the-secret-at-all"]):
        refused = cli("queues", "create", "jobs", "--url", guarded_url, *token)
        assert refused.status == 5
        assert refused.err.startswith("broker: unauthorized: ") and refused.err.count("\n") == 1
    as_json = cli("queues", "list", "--url", guarded_url, "--json")
    assert as_json.status == 5 and json.loads(as_json.err)["error"]["code"] == "unauthorized"


def test_a_token_without_the_scope_is_exit_5(
    cli: Run, guarded_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli("queues", "create", "jobs", "--url", guarded_url, "--token", ADMIN).status == 0
    monkeypatch.setenv("BROKER_TOKEN", READER)
    assert cli("queues", "inspect", "jobs", "--url", guarded_url).status == 0  # read:* may look
    refused = cli("publish", "jobs", "--payload", "1", "--url", guarded_url)
    assert refused.status == 5
    assert refused.err.startswith("broker: forbidden: ") and refused.err.count("\n") == 1
    assert "publish" in refused.err  # it names the scope needed
    purge = cli("queues", "purge", "jobs", "--force", "--url", guarded_url, "--json")
    assert purge.status == 5 and json.loads(purge.err)["error"]["code"] == "forbidden"
    # create is one PUT, which says whether it created: it asked first with a GET, so a token that may
    # not read was refused for lacking read:<queue> rather than admin
    create = cli("queues", "create", "jobs", "--url", guarded_url, "--token", PRODUCER)
    assert (
        create.status == 5 and create.err == "broker: forbidden: the token 'producer' lacks the scope admin\n"
    )
