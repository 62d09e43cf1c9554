"""The ``broker`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

import trio

from broker import __version__
from broker.config import (
    DEFAULT_DATA_DIR,
    DEFAULT_HOST,
    DEFAULT_PORT,
    OPTIONS,
    ConfigError,
    check_exposure,
    load_settings,
)
from broker.errors import BrokerError, StorageUnavailable
from broker.logging import configure
from broker.runtime import tune_gc, tune_threads

E = TypeVar("E", bound=BaseException)


def _first(error: BaseException, kind: type[E]) -> E | None:
    """The first ``kind`` inside ``error`` (Trio nurseries wrap errors in exception groups)."""
    if isinstance(error, kind):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = _first(inner, kind)
            if found is not None:
                return found
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="broker", description="A lease-based job broker over HTTP.")
    parser.add_argument("--version", action="version", version=f"broker {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the broker",
        description="Run the broker. Settings come from defaults, then --config FILE, then BROKER_* "
        "environment variables, then these flags (see docs/operations.md).",
    )
    serve.add_argument("--config", type=Path, metavar="FILE", help="a TOML file of settings, tokens, queues")
    serve.add_argument("--host", help=f"address to listen on (default {DEFAULT_HOST})")
    serve.add_argument("--port", help=f"port (default {DEFAULT_PORT}; 0 = any free)")
    serve.add_argument("--data-dir", help=f"where the broker keeps its data (default ./{DEFAULT_DATA_DIR})")
    serve.add_argument(
        "--in-memory",
        action="store_const",
        const=True,
        help="keep the journal in memory and write nothing: a restart starts empty (tests, benchmarks)",
    )
    serve.add_argument(
        "--insecure",
        action="store_const",
        const=True,
        help="serve on a non-loopback address without tokens (refused otherwise)",
    )
    serve.add_argument(
        "--snapshot-interval", metavar="DURATION", help="time between snapshots, e.g. 60s (default) or 5m"
    )
    serve.add_argument(
        "--snapshot-bytes",
        metavar="SIZE",
        help="also snapshot once the journal grew by SIZE, e.g. 64MiB (default), or 'unlimited'",
    )
    serve.add_argument(
        "--journal-retention-bytes",
        metavar="SIZE",
        help="keep at most SIZE of journal that snapshots cover, e.g. 4GiB (default), or 'unlimited'",
    )
    serve.add_argument(
        "--journal-retention-age",
        metavar="DURATION",
        help="keep journal that snapshots cover for DURATION, e.g. 7d (default), or 'unlimited'",
    )
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")

    snapshot = commands.add_parser("snapshot", help="list, verify or restore snapshots (broker stopped)")
    actions = snapshot.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in (
        ("list", "the snapshots, newest first"),
        ("verify", "check every snapshot's checksum and the journal's frames"),
        ("restore", "make a snapshot, or the state at a time, the newest state"),
    ):
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument(
            "--data-dir",
            type=Path,
            default=DEFAULT_DATA_DIR,
            help=f"the broker's data directory (default ./{DEFAULT_DATA_DIR}); never created",
        )
        action.add_argument("--json", action="store_true", help="print one JSON document, for scripts")
        if name == "restore":
            action.add_argument("id", nargs="?", help="the snapshot to restore (see list)")
            action.add_argument(
                "--until", help="restore the state as of this time, e.g. 2026-11-22T10:00:00Z"
            )
    _add_client_commands(commands)
    return parser


def _client_options() -> argparse.ArgumentParser:
    """The options of every command that talks to a running broker."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--url", help="the broker's address (default $BROKER_URL, else http://127.0.0.1:8080)"
    )
    options.add_argument("--token", help="a bearer token (default $BROKER_TOKEN)")
    options.add_argument("--json", action="store_true", help="print one JSON document, for scripts")
    options.add_argument(
        "--timeout", type=_timeout, default=10.0, metavar="SECONDS", help="for each request (default 10)"
    )
    return options


def _seconds(text: str, low: float, high: float, *, low_included: bool = True) -> float:
    """A number of seconds in ``low`` … ``high``: out of range is a usage error (exit 2) here, rather
    than whatever the socket or the broker would make of it."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (low <= value <= high) or (value == low and not low_included):  # NaN fails the first
        above = f"above {low:.15g}" if not low_included else f"from {low:.15g}"
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: {above} up to {high:.15g} seconds")
    return value


def _timeout(text: str) -> float:
    return _seconds(text, 0, 86400, low_included=False)


def _wait(text: str) -> float:
    return _seconds(text, 0, 30)  # a claim's wait (§5)


def _at_least_one(text: str) -> int:
    value = _positive(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _add_client_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``queues …``, ``publish`` and ``consume`` (docs/cli.md); run by ``broker.commands``."""
    common = [_client_options()]
    queues = commands.add_parser("queues", help="list, create, inspect and manage queues")
    actions = queues.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, text: str) -> argparse.ArgumentParser:
        parser = actions.add_parser(name, help=text, description=text, parents=common)
        parser.set_defaults(handler=f"queues {name}")
        if name != "list":
            parser.add_argument("name", metavar="NAME", help="the queue")
        return parser

    action("list", "every queue with its depths and counters")
    create = action("create", "create a queue, or update the config of one that exists")
    create.add_argument("--config", metavar="JSON", help="any config fields as a JSON object")
    create.add_argument("--lease", metavar="DURATION", help="default lease of claims (30s)")
    create.add_argument("--max-attempts", type=_positive, metavar="N", help="0 = unlimited")
    create.add_argument("--dead-letter", metavar="QUEUE", help="where dead letters go; 'none' drops them")
    create.add_argument(
        "--retry-backoff", metavar="SPEC", help="nack delay: fixed:BASE or exponential:BASE[:MAX]"
    )
    create.add_argument("--max-depth", type=_positive, metavar="N", help="ready+delayed+in-flight cap")
    create.add_argument("--rate-limit", metavar="N/PER", help="e.g. 100/1s; 'none' for no limit")
    create.add_argument("--message-ttl", metavar="DURATION", help="expire messages not acked in time")
    create.add_argument("--claim-window", metavar="DURATION", help="fair-claiming window, 0 … 5s")
    create.add_argument(
        "--durable", action=argparse.BooleanOptionalAction, help="answer after fsync (default yes)"
    )
    create.add_argument("--dedup-window", metavar="DURATION", help="how long keys are remembered")
    inspect = action("inspect", "a queue's config, stats and first messages")
    inspect.add_argument("--limit", type=_positive, default=10, metavar="N", help="messages shown (10)")
    peek = action("peek", "browse messages without claiming them")
    peek.add_argument("--limit", type=_positive, default=10, metavar="N", help="messages shown (10)")
    peek.add_argument(
        "--state", choices=["ready", "delayed", "in_flight", "all"], default="ready", help="(ready)"
    )
    dlq = action("dlq", "browse the dead letters of a queue (in its dead_letter queue)")
    dlq.add_argument("--limit", type=_positive, default=10, metavar="N", help="messages shown (10)")
    redrive = action("redrive", "move a queue's dead letters back, attempts reset")
    which = redrive.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", dest="ids", action="append", metavar="ID", help="a dead letter (repeat)")
    which.add_argument("--all", action="store_true", help="every dead letter that came from NAME")
    redrive.add_argument("--to", metavar="QUEUE", help="another destination than where they came from")
    for name, text in (
        ("purge", "remove every ready and delayed message (leases in flight finish)"),
        ("delete", "delete a queue and its messages"),
    ):
        action(name, text).add_argument("--force", action="store_true", help="required: there is no undo")

    publish = commands.add_parser("publish", help="publish messages", parents=common)
    publish.set_defaults(handler="publish")
    publish.add_argument("name", metavar="NAME", help="the queue")
    source = publish.add_mutually_exclusive_group(required=True)
    source.add_argument("--payload", metavar="JSON", help="one message's payload, as JSON")
    source.add_argument("--file", metavar="FILE", help="JSON Lines: one payload per line ('-' = stdin)")
    publish.add_argument(
        "--envelope",
        action="store_true",
        help="with --file: each line is a whole message {payload, headers, key, delay, priority}",
    )
    publish.add_argument("--key", help="idempotency key (one message)")
    publish.add_argument("--delay", metavar="DURATION", help="claimable after this long")
    publish.add_argument("--priority", type=int, metavar="N", help="higher is served first (0)")
    publish.add_argument("--header", action="append", metavar="NAME=VALUE", help="a header (repeat)")

    consume = commands.add_parser(
        "consume",
        help="claim messages, show them, then give them back (default), ack or nack them",
        parents=common,
    )
    consume.set_defaults(handler="consume")
    consume.add_argument("name", metavar="NAME", help="the queue")
    consume.add_argument(
        "--max", type=_at_least_one, default=1, metavar="N", help="at most N messages (1), in claims of 1000"
    )
    settle = consume.add_mutually_exclusive_group()
    settle.add_argument("--ack", action="store_true", help="ack them: they are done and removed")
    settle.add_argument("--nack", action="store_true", help="nack them: retried, an attempt spent")
    settle.add_argument(
        "--print-only",
        action="store_true",
        help="the default: defer them for 0 s, so they are back at once and no attempt is spent",
    )
    consume.add_argument("--wait", type=_wait, metavar="SECONDS", help="long-poll up to 30 s for a first")
    consume.add_argument("--lease", metavar="DURATION", help="(the queue's; 60s with --print-only)")
    consume.add_argument("--consumer", default="broker-cli", help="the consumer name claims carry")
    consume.add_argument("--delay", metavar="DURATION", help="with --nack: retry after this long")
    consume.add_argument("--reason", help="with --nack or --print-only: recorded in the history")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from broker.server import serve
        from broker.storage.segments import JournalGap, UnsupportedVersion
        from broker.storage.snapshots import SNAPSHOTS_DIR, SnapshotStoreError

        flags = {key: getattr(args, key, None) for key in OPTIONS}
        try:
            settings = load_settings(config_file=args.config, flags=flags)
            check_exposure(settings)
        except ConfigError as error:
            print(f"broker: cannot start: {error}", file=sys.stderr)
            return 2
        configure(settings.log_level)
        tune_gc()
        tune_threads()
        try:
            trio.run(partial(serve, settings))
        except (OSError, BrokerError, ValueError, BaseExceptionGroup) as error:
            storage_error = _first(error, StorageUnavailable)
            if storage_error is not None:
                print(f"broker: cannot start: {storage_error.message}", file=sys.stderr)
                return 1
            unreadable = _first(error, JournalGap) or _first(error, UnsupportedVersion)
            if unreadable is not None:
                print(f"broker: cannot start: {unreadable}", file=sys.stderr)
                return 1
            snapshot_error = _first(error, SnapshotStoreError)
            if snapshot_error is not None:
                where = settings.data_dir / SNAPSHOTS_DIR
                print(
                    f"broker: cannot start: the snapshots in {where} cannot be read: {snapshot_error}",
                    file=sys.stderr,
                )
                return 1
            os_error = _first(error, OSError)
            if os_error is None:
                raise
            reason = os_error.strerror or os_error
            if os_error.filename is not None:  # a file of the data directory, not the address
                print(f"broker: cannot start: {os_error.filename}: {reason}", file=sys.stderr)
                return 1
            print(f"broker: cannot serve on {settings.host}:{settings.port}: {reason}", file=sys.stderr)
            return 1
        return 0
    if args.command == "snapshot":
        from broker.commands.snapshots import run_snapshot

        return run_snapshot(args)
    if getattr(args, "handler", None):
        from broker.commands import run

        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
