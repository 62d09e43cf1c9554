"""Settings of one broker process: where it listens, where it keeps data, its limits, its tokens and the
queues it declares; and how they are read from a TOML file, the environment and flags (in rising
precedence), with an error naming the source, the key and the reason for anything wrong.

The file (``broker serve --config broker.toml``) holds any of the keys of ``OPTIONS`` at the top level,
a ``[limits]`` table (``Limits``), ``[[tokens]]`` entries and ``[queues.<name>]`` tables of queue config
(the fields of ``PUT /v1/queues/{queue}``), created or updated at start. An option's environment
variable is ``BROKER_`` and its key in capitals (``BROKER_SNAPSHOT_INTERVAL``, ``BROKER_LIMITS_MAX_BATCH``).
See docs/operations.md for an example.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.core.config import FinishedHistory, QueueConfig, check_queue_name
from broker.core.durations import parse_duration
from broker.errors import InvalidRequest, quoted_value
from broker.storage.retention import Retention
from broker.storage.segments import DEFAULT_MAX_SEGMENT_BYTES

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_DATA_DIR = Path("snapshots")


@dataclass(frozen=True, slots=True)
class Limits:
    """Request limits of the contract (§2); a request beyond one gets 400 or 413, never a 500."""

    max_payload_bytes: int = 1024 * 1024
    max_headers: int = 64
    max_headers_bytes: int = 8 * 1024
    max_batch: int = 1000
    max_body_bytes: int = 16 * 1024 * 1024
    max_key_length: int = 1024
    max_consumer_length: int = 256
    max_reason_length: int = 4096


#: The least each limit may be set to in a file, the environment or a flag. Below it the broker would
#: start but refuse every request of a kind (a claim of at most 0 messages, a payload of at most 0
#: bytes, a body too small for any JSON request, a consumer name of 0 characters). A limit of 0 headers
#: or 0 reason characters is a policy, not a broken broker: those stay allowed.
LIMIT_MINIMUMS: dict[str, int] = {
    "max_payload_bytes": 1,
    "max_headers": 0,
    "max_headers_bytes": 0,
    "max_batch": 1,
    "max_body_bytes": 1024,
    "max_key_length": 1,
    "max_consumer_length": 1,
    "max_reason_length": 0,
}
#: The least ``journal_segment_bytes`` may be: the writer reserves disk 1 MiB at a time, and a smaller
#: segment would make a file per few records (0 made one per record) for retention and readers to walk.
MIN_SEGMENT_BYTES = 1 << 20
#: The least ``snapshot_bytes`` may be: each snapshot starts a process that replays the journal, and 0
#: started them back to back, a core busy for ever on an idle broker.
MIN_SNAPSHOT_BYTES = 1 << 20

SCOPE_KINDS = ("publish", "consume", "read")


@dataclass(frozen=True, slots=True)
class Token:
    """A bearer token and what it may do: ``admin``, or ``publish:``/``consume:``/``read:`` a queue glob."""

    name: str
    secret: str = field(repr=False)  # never printed
    scopes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    data_dir: Path = DEFAULT_DATA_DIR
    limits: Limits = field(default_factory=Limits)
    #: Keep the journal in memory and nothing on disk (tests; a broker that may forget everything).
    in_memory: bool = False
    #: Seconds between snapshots (taken only when the journal moved on), besides one at clean shutdown.
    snapshot_interval: float = 60.0
    #: A snapshot is also taken once the journal has grown by this many bytes since the last one, which
    #: bounds what a restart replays (64 MiB took ~2.5 s on the benchmark machine). None: by time only.
    snapshot_bytes: int | None = 64 << 20
    #: How much of the journal to keep for audits once snapshots cover it (storage/retention.py).
    journal_retention: Retention = field(default_factory=Retention)
    #: A journal segment file is closed for a new one past this size: the unit retention deletes.
    journal_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES
    #: Per queue, how many messages that left it get-one still shows with their history (§6).
    finished_history: FinishedHistory = field(default_factory=FinishedHistory)
    log_level: str = "info"
    #: Seconds a connection may stay idle between requests, and may take to send a request's head (its
    #: line and headers), before the server closes it (Hypercorn's keep-alive timeout covers both). It
    #: stops once a head is in: a slow body, a long poll and a push stream are not cut by it.
    keep_alive_timeout: float = 20.0
    #: Serve on a non-loopback address without tokens (refused otherwise).
    insecure: bool = False
    tokens: tuple[Token, ...] = ()
    #: Queues to create, or whose config to update, at start: name → config fields.
    queues: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Where each option given came from (the file, an environment variable, a flag), for errors found
    #: after loading.
    origins: Mapping[str, str] = field(default_factory=dict, compare=False)


_SIZE = re.compile(r"\s*([0-9]+)\s*([kmgt]i?b?|b)?\s*", re.IGNORECASE | re.ASCII)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``64MiB``, ``4G``, ``512k`` (units are powers of 1024). ``ValueError`` else."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"a size is a number of bytes with an optional unit (k, M, G, T), not {text!r}")
    unit = (match.group(2) or "").lower().rstrip("b").rstrip("i")
    return int(match.group(1)) * _SIZE_UNITS[unit]


# -- reading settings ------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A setting that cannot be used: where it came from, its key, and why."""

    def __init__(self, source: str, key: str, reason: str) -> None:
        where = source if source.startswith("--") else f"{source}: {key}"  # a flag names its key
        super().__init__(f"{where}: {reason}")
        self.source, self.key, self.reason = source, key, reason


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    return value


def _port(value: Any) -> int:
    port = _integer(value)
    if not 0 <= port <= 65535:
        raise ValueError("must be a port, 0-65535 (0 picks a free one)")
    return port


def _integer(value: Any) -> int:
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("must be a whole number, 0 or more")
    return value


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ValueError("must be true or false")


def _seconds(value: Any) -> float:
    try:
        return parse_duration(value, "the duration", low=0.001)
    except InvalidRequest as error:
        reason = error.message.removeprefix("the duration ").removesuffix(f"; got {quoted_value(value)}")
        raise ValueError(reason) from None  # _parse names the value


def _bytes(value: Any) -> int:
    return _integer(value) if not isinstance(value, str) or value.strip().isdigit() else parse_size(value)


def _at_least(low: int, parse: Callable[[Any], int], unit: str = "") -> Callable[[Any], int]:
    """``parse``, refusing values below ``low``: they would start a broker that cannot work."""

    def parse_at_least(value: Any) -> int:
        parsed = parse(value)
        if parsed < low:
            raise ValueError(f"must be at least {low}{unit}")
        return parsed

    return parse_at_least


def _limit(key: str) -> Callable[[Any], int]:
    low = LIMIT_MINIMUMS[key]

    size = key.endswith("_bytes")  # a size takes a unit, as other sizes do: "2MiB"

    def parse_limit(value: Any) -> int:
        try:
            return _at_least(low, _bytes if size else _integer)(value)
        except ValueError:
            kind = "a size in bytes (or with a unit: 512k, 2MiB)" if size else "a whole number"
            raise ValueError(f"must be {kind}, at least {low}") from None

    return parse_limit


def _or_unlimited(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value == "unlimited" else parse(value)


def _log_level(value: Any) -> str:
    if value not in ("debug", "info", "warning", "error"):
        raise ValueError("must be one of debug, info, warning, error")
    return str(value)


#: The options a file, the environment or a flag may set: key → (parser, where it goes in Settings).
OPTIONS: dict[str, Callable[[Any], Any]] = {
    "host": _text,
    "port": _port,
    "data_dir": lambda value: Path(_text(value)),
    "in_memory": _flag,
    "log_level": _log_level,
    "insecure": _flag,
    "keep_alive_timeout": _seconds,
    "snapshot_interval": _seconds,
    "snapshot_bytes": _or_unlimited(_at_least(MIN_SNAPSHOT_BYTES, _bytes, ' bytes (1MiB), or "unlimited"')),
    "journal_retention_bytes": _or_unlimited(_bytes),
    "journal_retention_age": _or_unlimited(_seconds),
    "journal_segment_bytes": _at_least(MIN_SEGMENT_BYTES, _bytes, " bytes (1MiB)"),
    "finished_history": _integer,
    "finished_history_bytes": _bytes,
}
LIMITS = tuple(field.name for field in dataclasses.fields(Limits))


def load_settings(
    *,
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Settings from defaults, then ``config_file``, then ``environ`` (``BROKER_*``), then ``flags``
    (option key → value, ``None`` for a flag not given). Raises ``ConfigError``."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}  # option key → where its value came from, for errors found later
    limits: dict[str, Any] = {}
    tokens: tuple[Token, ...] = ()
    queues: dict[str, Mapping[str, Any]] = {}
    environ = os.environ if environ is None else environ
    if config_file is not None:
        source = str(config_file)
        document = _read_toml(config_file)
        for key, value in document.items():
            if key == "limits":
                limits.update(_limits(source, value))
            elif key == "tokens":
                tokens = _tokens(source, value, environ)
            elif key == "queues":
                queues = _queues(source, value, environ)
            elif key in OPTIONS:
                values[key] = _parse(source, key, OPTIONS[key], value)
                sources[key] = source
            else:
                known = ", ".join([*OPTIONS, "limits", "tokens", "queues"])
                raise ConfigError(source, key, f"unknown key; known keys: {known}")
    for key, parse in OPTIONS.items():
        name = f"BROKER_{key.upper()}"
        if name in environ:
            sources[key] = f"environment variable {name}"
            values[key] = _parse(sources[key], key, parse, environ[name])
    for key in LIMITS:
        name = f"BROKER_LIMITS_{key.upper()}"
        if name in environ:
            limits[key] = _parse(f"environment variable {name}", f"limits.{key}", _limit(key), environ[name])
    for key, value in (flags or {}).items():
        if value is not None:
            sources[key] = f"--{key.replace('_', '-')}"
            values[key] = _parse(sources[key], key, OPTIONS[key], value)
    _check_data_dir(values, sources)
    retention = Retention(
        values.pop("journal_retention_bytes", Retention().max_bytes),
        values.pop("journal_retention_age", Retention().max_age),
    )
    history = FinishedHistory(
        values.pop("finished_history", FinishedHistory().count),
        values.pop("finished_history_bytes", FinishedHistory().payload_bytes),
    )
    return Settings(
        **values,
        limits=Limits(**limits),
        journal_retention=retention,
        finished_history=history,
        tokens=tokens,
        queues=queues,
        origins=sources,
    )


def _check_data_dir(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """Refuse a data directory that is a file now, as a setting that cannot be used: otherwise the start
    fails later, deep in the server, with an error that does not say which setting is wrong."""
    if values.get("in_memory"):
        return  # nothing goes on disk
    data_dir: Path = values.get("data_dir", DEFAULT_DATA_DIR)
    if data_dir.exists() and not data_dir.is_dir():
        source = sources.get("data_dir", "the default")
        raise ConfigError(source, "data_dir", f"{str(data_dir)!r} exists and is not a directory")


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except OSError as error:
        raise ConfigError(str(path), "(file)", error.strerror or str(error)) from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(str(path), "(syntax)", str(error)) from None
    except UnicodeDecodeError as error:  # TOML is UTF-8; tomllib decodes the whole file first
        line = error.object[: error.start].count(b"\n") + 1
        reason = (
            f"not UTF-8 text: byte {error.object[error.start]:#04x} on line {line} (TOML files are UTF-8)"
        )
        raise ConfigError(str(path), "(encoding)", reason) from None


def _parse(source: str, key: str, parse: Callable[[Any], Any], value: Any) -> Any:
    try:
        return parse(value)
    except ValueError as error:
        raise ConfigError(source, key, f"{error} (got {value!r})") from None


def _limits(source: str, table: Any) -> dict[str, int]:
    if not isinstance(table, dict):
        raise ConfigError(source, "limits", "must be a table")
    parsed = {}
    for key, value in table.items():
        if key not in LIMITS:
            raise ConfigError(source, f"limits.{key}", f"unknown limit; known: {', '.join(LIMITS)}")
        parsed[key] = _parse(source, f"limits.{key}", _limit(key), value)
    return parsed


_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _tokens(source: str, entries: Any, environ: Mapping[str, str]) -> tuple[Token, ...]:
    if not isinstance(entries, list):
        raise ConfigError(source, "tokens", "must be an array of tables ([[tokens]])")
    tokens = []
    for index, entry in enumerate(entries):
        where = f"tokens[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError(source, where, "must be a table with name, secret and scopes")
        unknown = set(entry) - {"name", "secret", "scopes"}
        if unknown:
            raise ConfigError(
                source, f"{where}.{sorted(unknown)[0]}", "unknown key; known: name, secret, scopes"
            )
        name = entry.get("name", f"token-{index}")
        if not isinstance(name, str) or not name:
            raise ConfigError(source, f"{where}.name", "must be a non-empty string")
        secret = _secret(source, f"{where}.secret", entry.get("secret"), environ)
        scopes = entry.get("scopes")
        if not isinstance(scopes, list) or not scopes:
            raise ConfigError(source, f"{where}.scopes", "must be a non-empty array of scopes")
        for scope in scopes:
            _check_scope(source, f"{where}.scopes", scope)
        tokens.append(Token(name, secret, tuple(scopes)))
    secrets = [token.secret for token in tokens]
    if len(set(secrets)) != len(secrets):
        raise ConfigError(source, "tokens", "two tokens have the same secret")
    return tuple(tokens)


def _substituted(source: str, key: str, value: str, environ: Mapping[str, str]) -> str:
    """``value`` with each ``${VAR}`` replaced by that environment variable, which must be set."""

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise ConfigError(source, key, f"the environment variable {name} is not set")
        return environ[name]

    return _ENV_REFERENCE.sub(substitute, value)


def _secret(source: str, key: str, value: Any, environ: Mapping[str, str]) -> str:
    if not isinstance(value, str):
        raise ConfigError(source, key, 'must be a string, e.g. "${BROKER_TOKEN_CI}"')
    secret = _substituted(source, key, value, environ)
    if len(secret) < 16:
        raise ConfigError(source, key, "must be at least 16 characters (after ${VAR} substitution)")
    if secret != secret.strip():  # an environment variable read from a file with its newline, often
        raise ConfigError(
            source,
            key,
            "starts or ends with whitespace (after ${VAR} substitution), which no token sent can match",
        )
    return secret


def _check_scope(source: str, key: str, scope: Any) -> None:
    if scope == "admin":
        return
    kind, _, glob = scope.partition(":") if isinstance(scope, str) else ("", "", "")
    if kind not in SCOPE_KINDS or not glob:
        raise ConfigError(
            source, key, f"{scope!r} is not a scope: admin, publish:<glob>, consume:<glob> or read:<glob>"
        )


#: Queue config fields whose null means "none" (no dead-letter queue: drop; no rate limit; no push).
#: TOML has no null, so a queue table says ``false`` for it.
_NULL_AS_FALSE = frozenset({"dead_letter", "rate_limit", "push"})


def _queues(source: str, table: Any, environ: Mapping[str, str]) -> dict[str, Mapping[str, Any]]:
    if not isinstance(table, dict):
        raise ConfigError(source, "queues", "must be a table of [queues.<name>] tables")
    queues: dict[str, Mapping[str, Any]] = {}
    for name, declared in table.items():
        key = f"queues.{name}"
        if not isinstance(declared, dict):  # the API's refusal would say "JSON object"
            raise ConfigError(source, key, f"must be a [{key}] table of the queue's config fields")
        for nullable in _NULL_AS_FALSE:
            if declared.get(nullable) is True:
                reason = "true means nothing here: false means none (TOML has no null)"
                raise ConfigError(source, f"{key}.{nullable}", reason)
        changes = {
            given: None if given in _NULL_AS_FALSE and value is False else value
            for given, value in declared.items()
        }
        push = changes.get("push")
        if isinstance(push, dict) and isinstance(push.get("secret"), str):  # as tokens' secrets are
            secret = _substituted(source, f"{key}.push.secret", push["secret"], environ)
            changes["push"] = {**push, "secret": secret}
        try:
            check_queue_name(name)
            QueueConfig().updated(changes).check_for(name)  # checked now, so that a bad file stops the start
        except InvalidRequest as error:
            raise ConfigError(source, key, error.message) from None
        queues[name] = changes
    return queues


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def check_exposure(settings: Settings) -> None:
    """Refuse to serve beyond loopback without tokens, unless told ``insecure``: nothing would keep
    other hosts out."""
    if not is_loopback(settings.host) and not settings.tokens and not settings.insecure:
        raise ConfigError(
            settings.origins.get("host", "--host"),
            "host",
            f"{settings.host} is not a loopback address and no tokens are configured, so any host could "
            "use this broker; add [[tokens]] to the config file (docs/operations.md), or pass --insecure "
            "if the network is trusted",
        )
