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
        action = actions.add_parser(name, help=text)
        action.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
        if name == "restore":
            action.add_argument("id", nargs="?", help="the snapshot to restore (see list)")
            action.add_argument(
                "--until", help="restore the state as of this time, e.g. 2026-11-22T10:00:00Z"
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from broker.server import serve

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
        except (OSError, BrokerError, BaseExceptionGroup) as error:
            storage_error = _first(error, StorageUnavailable)
            if storage_error is not None:
                print(f"broker: cannot start: {storage_error.message}", file=sys.stderr)
                return 1
            os_error = _first(error, OSError)
            if os_error is None:
                raise
            reason = os_error.strerror or os_error
            print(f"broker: cannot serve on {settings.host}:{settings.port}: {reason}", file=sys.stderr)
            return 1
        return 0
    if args.command == "snapshot":
        return _snapshot(args)
    return 2


def _snapshot(args: argparse.Namespace) -> int:
    from broker.storage import restore as operations
    from broker.storage.snapshots import list_snapshots

    data_dir: Path = args.data_dir
    try:
        if args.action == "list":
            snapshots = list_snapshots(data_dir)
            if not snapshots:
                print(f"no snapshots in {data_dir}")
            else:
                print(f"{'id':<22}{'lsn':>12}  {'taken at':<26}{'queues':>7}{'messages':>12}{'bytes':>14}")
            for info in snapshots:
                taken = operations.format_time(info.taken_at)
                counts = f"{info.queues:>7}{info.messages:>12}{info.bytes:>14}"
                print(f"{info.id:<22}{info.lsn:>12}  {taken:<26}{counts}")
            return 0
        if args.action == "verify":
            results, journal_problem = operations.verify(data_dir)
            for result in results:
                print(f"snapshot {result.snapshot.id}: {result.problem or 'ok'}")
            print(f"journal: {journal_problem or 'ok'}")
            return 1 if journal_problem or any(result.problem for result in results) else 0
        until = None if args.until is None else operations.parse_time(args.until)
        restored = operations.restore(data_dir, snapshot_id=args.id, until=until)
    except (operations.RestoreError, StorageUnavailable) as error:
        message = error.message if isinstance(error, StorageUnavailable) else str(error)
        print(f"broker: {message}", file=sys.stderr)
        return 1
    info = restored.snapshot
    print(f"restored: snapshot {info.id} (lsn {info.lsn}, {info.queues} queues, {info.messages} messages)")
    if restored.replayed:
        print(f"  replayed {restored.replayed} journal records up to {args.until}")
    if restored.dropped_snapshots:
        print(f"  dropped newer snapshots: {', '.join(restored.dropped_snapshots)}")
    if restored.archived_journal is not None:
        print(f"  the journal as it was is kept in {restored.archived_journal}")
    print("the next `broker serve` starts from this state")
    return 0


if __name__ == "__main__":
    sys.exit(main())
