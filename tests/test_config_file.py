"""Settings from a TOML file, the environment and flags, in rising precedence; errors that name the
source, the key and the reason; queues declared in the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from broker.config import (
    LIMIT_MINIMUMS,
    ConfigError,
    Limits,
    Settings,
    Token,
    check_exposure,
    load_settings,
)
from broker.core import FinishedHistory
from broker.errors import StorageUnavailable
from broker.server import open_broker, prepare_data_dir
from broker.storage.retention import Retention
from tests.e2e.test_serve import START_TIMEOUT, ServerProcess

SECRET = "s3cret-s3cret-s3cret"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "broker.toml"
    path.write_text(text)
    return path


def test_without_a_file_the_defaults_hold() -> None:
    assert load_settings(environ={}) == Settings()


def test_a_file_the_environment_and_flags_override_each_other_in_that_order(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        """
        port = 9000
        host = "127.0.0.2"
        snapshot_interval = "5m"
        journal_retention_age = "unlimited"
        journal_retention_bytes = "1GiB"
        [limits]
        max_batch = 10
        max_payload_bytes = 2048
        """,
    )
    from_file = load_settings(config_file=config, environ={})
    assert (from_file.port, from_file.host, from_file.snapshot_interval) == (9000, "127.0.0.2", 300.0)
    assert from_file.journal_retention == Retention(max_bytes=1 << 30, max_age=None)
    assert from_file.limits == Limits(max_batch=10, max_payload_bytes=2048)
    environ = {"BROKER_PORT": "9001", "BROKER_SNAPSHOT_INTERVAL": "30s", "BROKER_LIMITS_MAX_BATCH": "20"}
    from_environ = load_settings(config_file=config, environ=environ)
    assert (from_environ.port, from_environ.host, from_environ.snapshot_interval) == (9001, "127.0.0.2", 30.0)
    assert from_environ.limits.max_batch == 20
    flags = {"port": "9002", "snapshot_interval": None, "in_memory": True}
    from_flags = load_settings(config_file=config, environ=environ, flags=flags)
    assert (from_flags.port, from_flags.snapshot_interval, from_flags.in_memory) == (9002, 30.0, True)


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("prot = 9000", "prot", "unknown key; known keys: host, port"),
        ('port = "ninety"', "port", "must be a whole number"),
        ("port = 70000", "port", "must be a port"),
        ('snapshot_interval = "soon"', "snapshot_interval", "must be a number of seconds"),
        ('snapshot_interval = "0s"', "snapshot_interval", "must be at least 0.001 seconds (got '0s')"),
        ('snapshot_bytes = "12 parsecs"', "snapshot_bytes", "a size is a number of bytes"),
        ('snapshot_bytes = "\u0664MiB"', "snapshot_bytes", "a size is a number of bytes"),  # ASCII digits
        ('log_level = "loud"', "log_level", "must be one of debug, info, warning, error"),
        ("[limits]\nmax_bach = 3", "limits.max_bach", "unknown limit"),
        ("[queues.jobs]\nmax_attempts = -1", "queues.jobs", "max_attempts must be an integer"),
        ("[queues.jobs]\nlease = 1\nspeed = 3", "queues.jobs", "unknown queue config field 'speed'"),
        ('[queues."bad name!"]', "queues.bad name!", "queue name"),
        (
            '[queues.jobs]\ndead_letter = "jobs"',
            "queues.jobs",
            "dead_letter must name another queue than 'jobs'",
        ),
        (
            "[queues.jobs]\ndead_letter = true",
            "queues.jobs.dead_letter",
            "false means none (TOML has no null)",
        ),
        ("[queues.jobs]\nrate_limit = true", "queues.jobs.rate_limit", "false means none"),
        ("[queues]\njobs = 5", "queues.jobs", "must be a [queues.jobs] table"),
        (
            "[queues.jobs]\nretry_backoff = { base = 60, max = 20 }",
            "queues.jobs",
            "retry_backoff.base (60 s) must not be over retry_backoff.max (20 s)",
        ),
        ('[[tokens]]\nsecret = "x"\nscopes = ["admin"]', "tokens[0].secret", "at least 16 characters"),
        (
            f'[[tokens]]\nsecret = "{SECRET}"\nscopes = ["write:jobs"]',
            "tokens[0].scopes",
            "'write:jobs' is not a scope",
        ),
        (f'[[tokens]]\nsecret = "{SECRET}"\nscopes = []', "tokens[0].scopes", "non-empty array"),
        ('[[tokens]]\nsecret = "${NOT_SET_ANYWHERE}"\nscopes = ["admin"]', "tokens[0].secret", "NOT_SET"),
        ("port = ", "(syntax)", "Invalid value"),
        ("[limits]\nmax_batch = 0", "limits.max_batch", "must be a whole number, at least 1"),
        ("[limits]\nmax_payload_bytes = 0", "limits.max_payload_bytes", "at least 1"),
        ("[limits]\nmax_body_bytes = 100", "limits.max_body_bytes", "at least 1024"),
        ("[limits]\nmax_consumer_length = 0", "limits.max_consumer_length", "at least 1"),
        ("[limits]\nmax_key_length = -1", "limits.max_key_length", "at least 1"),
        ("journal_segment_bytes = 0", "journal_segment_bytes", "must be at least 1048576 bytes (1MiB)"),
        ('journal_segment_bytes = "512k"', "journal_segment_bytes", "must be at least 1048576"),
        # 0 started snapshots back to back: a core busy for ever on an idle broker.
        ("snapshot_bytes = 0", "snapshot_bytes", 'must be at least 1048576 bytes (1MiB), or "unlimited"'),
        ('[limits]\nmax_body_bytes = "1 parsec"', "limits.max_body_bytes", "must be a size in bytes"),
    ],
)
def test_a_bad_file_names_the_file_the_key_and_the_reason(
    tmp_path: Path, text: str, key: str, reason: str
) -> None:
    config = write(tmp_path, text)
    with pytest.raises(ConfigError) as raised:
        load_settings(config_file=config, environ={})
    assert (raised.value.source, raised.value.key) == (str(config), key)
    assert reason in raised.value.reason
    assert str(raised.value).startswith(f"{config}: {key}: ")


def test_limits_at_their_minimum_are_accepted(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        'journal_segment_bytes = "1MiB"\nsnapshot_bytes = "1MiB"\n[limits]\n'
        + "".join(f"{key} = {low}\n" for key, low in LIMIT_MINIMUMS.items()),
    )
    settings = load_settings(config_file=config, environ={})
    assert settings.limits == Limits(**LIMIT_MINIMUMS)
    assert settings.journal_segment_bytes == settings.snapshot_bytes == 1 << 20
    with pytest.raises(ConfigError, match=r"BROKER_LIMITS_MAX_BATCH: limits\.max_batch: must be a whole"):
        load_settings(environ={"BROKER_LIMITS_MAX_BATCH": "0"})


def test_size_limits_take_a_unit_as_other_sizes_do(tmp_path: Path) -> None:
    config = write(tmp_path, '[limits]\nmax_payload_bytes = "2MiB"\nmax_headers_bytes = "16k"\n')
    limits = load_settings(config_file=config, environ={"BROKER_LIMITS_MAX_BODY_BYTES": "32MiB"}).limits
    assert (limits.max_payload_bytes, limits.max_headers_bytes, limits.max_body_bytes) == (
        2 << 20,
        16 << 10,
        32 << 20,
    )


def test_a_file_that_is_not_utf8_is_named_not_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_bytes(b"port = 9000\n\xff\xfe = 1\n")
    with pytest.raises(ConfigError) as raised:
        load_settings(config_file=config, environ={})
    assert str(raised.value) == (
        f"{config}: (encoding): not UTF-8 text: byte 0xff on line 2 (TOML files are UTF-8)"
    )


def test_a_data_directory_that_is_a_file_is_named_at_load(tmp_path: Path) -> None:
    in_the_way = tmp_path / "afile"
    in_the_way.touch()
    with pytest.raises(ConfigError, match=r"^--data-dir: '.*afile' exists and is not a directory$"):
        load_settings(environ={}, flags={"data_dir": str(in_the_way)})
    environ = {"BROKER_DATA_DIR": str(in_the_way)}
    with pytest.raises(ConfigError, match=r"^environment variable BROKER_DATA_DIR: data_dir: '"):
        load_settings(environ=environ)
    assert load_settings(environ=environ, flags={"in_memory": True}).in_memory  # nothing goes on disk


def test_a_data_directory_that_cannot_be_made_is_a_storage_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "afile").touch()
    with pytest.raises(StorageUnavailable, match=r"the data directory '.*afile/data': Not a directory"):
        prepare_data_dir(tmp_path / "afile" / "data")
    prepare_data_dir(tmp_path / "data")
    assert (tmp_path / "data").is_dir()


@pytest.mark.e2e
def test_in_memory_the_command_makes_no_data_directory(tmp_path: Path) -> None:
    process = ServerProcess(tmp_path / "data", args=["--in-memory"])
    try:
        listening = process.wait_for_event("listening", START_TIMEOUT)
        assert not (tmp_path / "data").exists()
        assert listening["data_dir"] is None  # it named the directory it does not use
    finally:
        process.stop()


def test_a_missing_file_and_a_bad_environment_variable_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"broker.toml: \(file\): No such file"):
        load_settings(config_file=tmp_path / "broker.toml", environ={})
    with pytest.raises(ConfigError, match="environment variable BROKER_IN_MEMORY: in_memory: must be true"):
        load_settings(environ={"BROKER_IN_MEMORY": "perhaps"})
    with pytest.raises(ConfigError, match=r"^--port: must be a port"):
        load_settings(environ={}, flags={"port": "99999"})


def test_token_secrets_come_from_the_environment_and_are_never_printed(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        """
        [[tokens]]
        name = "ci"
        secret = "${CI_TOKEN}"
        scopes = ["publish:jobs-*", "read:*"]
        [[tokens]]
        name = "ops"
        secret = "prefix-${OPS_PART}"
        scopes = ["admin"]
        """,
    )
    settings = load_settings(config_file=config, environ={"CI_TOKEN": SECRET, "OPS_PART": "0123456789ab"})
    assert settings.tokens == (
        Token("ci", SECRET, ("publish:jobs-*", "read:*")),
        Token("ops", "prefix-0123456789ab", ("admin",)),
    )
    assert SECRET not in repr(settings)
    # A secret read with its file's newline could never be matched (the gate strips what is sent):
    # refused at start, where it would have locked its clients out without a word.
    with pytest.raises(ConfigError, match="starts or ends with whitespace") as refused:
        load_settings(config_file=config, environ={"CI_TOKEN": SECRET + "\n", "OPS_PART": "0123456789ab"})
    assert SECRET not in str(refused.value)


def test_a_declared_push_secret_comes_from_the_environment_too(tmp_path: Path) -> None:
    # It was kept as the text "${HOOK_SECRET}": webhooks signed with a key anyone reading the file had.
    config = write(
        tmp_path, '[queues.hooked.push]\nurl = "https://hooks.example.com/in"\nsecret = "${HOOK_SECRET}"\n'
    )
    settings = load_settings(config_file=config, environ={"HOOK_SECRET": SECRET})
    assert settings.queues["hooked"]["push"] == {"url": "https://hooks.example.com/in", "secret": SECRET}
    with pytest.raises(ConfigError, match=r"queues.hooked.push.secret: the environment variable HOOK_SECRET"):
        load_settings(config_file=config, environ={})


def test_beyond_loopback_the_broker_refuses_to_serve_unless_told_it_is_insecure() -> None:
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.3.4.5"):
        check_exposure(Settings(host=host))
    for host in ("0.0.0.0", "::", "192.168.1.10", "broker.example.com"):
        with pytest.raises(ConfigError, match="not a loopback address and no tokens are configured"):
            check_exposure(Settings(host=host))
        check_exposure(Settings(host=host, insecure=True))
        check_exposure(Settings(host=host, tokens=(Token("ci", SECRET, ("admin",)),)))


def test_the_refusal_to_serve_beyond_loopback_names_where_the_host_came_from(tmp_path: Path) -> None:
    config = write(tmp_path, 'host = "0.0.0.0"\n')
    for settings, origin in (
        (load_settings(config_file=config, environ={}, flags={}), f"{config}: host"),
        (
            load_settings(environ={"BROKER_HOST": "0.0.0.0"}, flags={}),
            "environment variable BROKER_HOST: host",
        ),
        (load_settings(environ={}, flags={"host": "0.0.0.0"}), "--host"),  # what it always said
    ):
        with pytest.raises(ConfigError) as refused:
            check_exposure(settings)
        assert str(refused.value).startswith(f"{origin}: 0.0.0.0 is not a loopback address"), refused.value


def test_the_command_stops_with_one_line_naming_the_problem(tmp_path: Path) -> None:
    config = write(tmp_path, "[queues.jobs]\nmax_attempts = -1\n")
    done = subprocess.run(
        [sys.executable, "-m", "broker", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr == (
        f"broker: cannot start: {config}: queues.jobs: max_attempts must be an integer between 0 and "
        "1000000\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "broker", "serve", "--host", "0.0.0.0", "--in-memory"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "0.0.0.0 is not a loopback address" in done.stderr
    config.write_bytes(b"\xff\xfe = 1\n")
    done = subprocess.run(
        [sys.executable, "-m", "broker", "serve", "--config", str(config), "--in-memory"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (
        2,
        f"broker: cannot start: {config}: (encoding): not UTF-8 text: byte 0xff on line 1 (TOML files "
        "are UTF-8)\n",
    )


async def test_queues_in_the_file_are_created_at_start_and_updated_at_the_next(tmp_path: Path) -> None:
    config = write(tmp_path, '[queues.emails]\nlease = "45s"\nmax_attempts = 3\n[queues.reports]\n')
    settings = load_settings(config_file=config, environ={}, flags={"data_dir": str(tmp_path / "data")})
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        emails = await (await client.get("/v1/queues/emails")).get_json()
        assert (emails["config"]["lease"], emails["config"]["max_attempts"]) == (45.0, 3)
        assert (await client.get("/v1/queues/reports")).status_code == 200
        body = {"messages": [{"payload": "kept"}]}
        assert (await client.post("/v1/queues/emails/messages", json=body)).status_code == 201
    write(tmp_path, "[queues.emails]\nmax_attempts = 5\n")
    settings = load_settings(config_file=config, environ={}, flags={"data_dir": str(tmp_path / "data")})
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        emails = await (await client.get("/v1/queues/emails")).get_json()
        assert emails["config"]["max_attempts"] == 5
        assert emails["stats"]["ready"] == 1  # an update, not a new queue


async def test_false_in_a_queue_table_stands_for_the_null_toml_lacks(tmp_path: Path) -> None:
    """``dead_letter = "none"`` made a queue called none; a declared queue could neither drop its dead
    letters nor clear a rate limit or push set before."""
    config = write(tmp_path, '[queues.q]\nrate_limit = { max = 5, per = "1s" }\n')
    settings = load_settings(config_file=config, environ={}, flags={"data_dir": str(tmp_path / "data")})
    async with open_broker(settings):
        pass
    write(tmp_path, "[queues.q]\ndead_letter = false\nrate_limit = false\npush = false\n")
    settings = load_settings(config_file=config, environ={}, flags={"data_dir": str(tmp_path / "data")})
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        queue = await (await app.test_client().get("/v1/queues/q")).get_json()
    assert (queue["config"]["dead_letter"], queue["config"]["rate_limit"], queue["config"]["push"]) == (
        None,
    ) * 3
    write(tmp_path, "[queues.q]\nlease = false\n")
    with pytest.raises(ConfigError, match="lease"):
        load_settings(config_file=config, environ={}, flags={})


async def test_a_queue_declared_with_a_template_is_created_expanded(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        '[queues.claude]\ntemplate = "anthropic"\nmax_attempts = 6\n'
        '[queues.claude.push]\nurl = "https://worker.example.com/hooks"\nconcurrency = 8\n',
    )
    settings = load_settings(config_file=config, environ={}, flags={"data_dir": str(tmp_path / "data")})
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        claude = (await (await client.get("/v1/queues/claude")).get_json())["config"]
    assert claude["max_attempts"] == 6  # the file's field wins over the template's 4
    assert claude["retry_backoff"]["type"] == "exponential" and claude["dead_letter"] == "claude.dlq"
    push = claude["push"]
    assert (push["mode"], push["ack_timeout"], push["concurrency"]) == ("ack", 600.0, 8)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('[queues.claude]\ntemplate = "gemini"\n', "template must be 'anthropic' or 'openai'"),
        ('[queues.claude]\ntemplate = "openai"\n', "template 'openai' needs push.url"),
    ],
)
def test_a_bad_template_in_the_file_stops_the_start_naming_the_queue(
    tmp_path: Path, text: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(config_file=write(tmp_path, text), environ={}, flags={})
    assert "queues.claude" in str(raised.value) and reason in str(raised.value)


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["--insecure", "BROKER_INSECURE", "insecure = true", "tokens"])
def test_beyond_loopback_the_command_starts_when_told_it_is_insecure_or_given_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    args = ["--host", "0.0.0.0", "--in-memory"]
    monkeypatch.delenv("BROKER_INSECURE", raising=False)
    if how == "--insecure":
        args.append("--insecure")
    elif how == "BROKER_INSECURE":
        monkeypatch.setenv("BROKER_INSECURE", "1")
    else:
        text = "insecure = true\n" if how == "insecure = true" else tokens_file()
        args += ["--config", str(write(tmp_path, text))]
    process = ServerProcess(tmp_path / "data", args=args)
    try:
        url = process.wait_for_event("listening", START_TIMEOUT)["url"]
        assert url.startswith("http://0.0.0.0:"), url
    finally:
        process.stop()


def tokens_file() -> str:
    return f'[[tokens]]\nname = "ci"\nsecret = "{SECRET}"\nscopes = ["admin"]\n'


def test_the_keep_alive_timeout_comes_from_the_file_or_the_environment(tmp_path: Path) -> None:
    assert Settings().keep_alive_timeout == 20
    config = write(tmp_path, 'keep_alive_timeout = "500ms"\n')
    assert load_settings(config_file=config, environ={}).keep_alive_timeout == 0.5
    environ = {"BROKER_KEEP_ALIVE_TIMEOUT": "2m"}
    assert load_settings(config_file=config, environ=environ).keep_alive_timeout == 120
    with pytest.raises(ConfigError, match="keep_alive_timeout"):
        load_settings(environ={"BROKER_KEEP_ALIVE_TIMEOUT": "soon"})


def test_finished_history_is_set_by_the_file_or_the_environment(tmp_path: Path) -> None:
    config = write(tmp_path, 'finished_history = 500\nfinished_history_bytes = "8MiB"\n')
    assert load_settings(config_file=config, environ={}).finished_history == FinishedHistory(500, 8 << 20)
    environ = {"BROKER_FINISHED_HISTORY": "0"}
    assert load_settings(config_file=config, environ=environ).finished_history == FinishedHistory(0, 8 << 20)
    assert load_settings(environ={}).finished_history == FinishedHistory(10_000, 64 << 20)


async def test_finished_history_bounds_the_queues_a_broker_makes(tmp_path: Path) -> None:
    settings = Settings(in_memory=True, finished_history=FinishedHistory(count=1))
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        assert (await client.put("/v1/queues/jobs", json={})).status_code == 201
        published = await client.post("/v1/queues/jobs/messages", json={"messages": [{"payload": 1}] * 2})
        ids = [message["id"] for message in (await published.get_json())["messages"]]
        claimed = await (await client.post("/v1/queues/jobs/claim", json={"max": 2})).get_json()
        leases = [delivery["lease_id"] for delivery in claimed["messages"]]
        assert (await client.post("/v1/queues/jobs/ack", json={"leases": leases})).status_code == 200
        states = [(await client.get(f"/v1/queues/jobs/messages/{i}")).status_code for i in ids]
        assert states == [404, 200]
