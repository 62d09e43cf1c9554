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
from broker.config import DEFAULT_DATA_DIR, DEFAULT_HOST, DEFAULT_PORT, Settings, parse_size
from broker.core.durations import parse_duration
from broker.errors import BrokerError, StorageUnavailable
from broker.logging import configure
from broker.runtime import tune_gc, tune_threads
from broker.storage.retention import Retention

DEFAULTS = Settings()

E = TypeVar("E", bound=BaseException)


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError("a port is 0-65535 (0 picks a free one)")
    return port


def _duration(text: str) -> float:
    try:
        return parse_duration(text, "the duration", low=0.001)
    except BrokerError as error:
        raise argparse.ArgumentTypeError(error.message) from None


def _duration_or_unlimited(text: str) -> float | None:
    return None if text == "unlimited" else _duration(text)


def _size_or_unlimited(text: str) -> int | None:
    if text == "unlimited":
        return None
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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
    serve = commands.add_parser("serve", help="run the broker")
    serve.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    serve.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 = any free)"
    )
    serve.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help=f"where the broker keeps its data (default ./{DEFAULT_DATA_DIR})",
    )
    serve.add_argument(
        "--in-memory",
        action="store_true",
        help="keep the journal in memory and write nothing: a restart starts empty (tests, benchmarks)",
    )
    serve.add_argument(
        "--snapshot-interval",
        type=_duration,
        default=DEFAULTS.snapshot_interval,
        metavar="DURATION",
        help="time between snapshots, e.g. 60s or 5m (default 60s)",
    )
    serve.add_argument(
        "--snapshot-bytes",
        type=_size_or_unlimited,
        default=DEFAULTS.snapshot_bytes,
        metavar="SIZE",
        help="also snapshot once the journal grew by SIZE, e.g. 64MiB (default), or 'unlimited'",
    )
    serve.add_argument(
        "--journal-retention-bytes",
        type=_size_or_unlimited,
        default=DEFAULTS.journal_retention.max_bytes,
        metavar="SIZE",
        help="keep at most SIZE of journal that snapshots cover, e.g. 4GiB (default), or 'unlimited'",
    )
    serve.add_argument(
        "--journal-retention-age",
        type=_duration_or_unlimited,
        default=DEFAULTS.journal_retention.max_age,
        metavar="DURATION",
        help="keep journal that snapshots cover for DURATION, e.g. 7d (default), or 'unlimited'",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

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

        configure(args.log_level)
        tune_gc()
        tune_threads()
        settings = Settings(
            host=args.host,
            port=args.port,
            data_dir=args.data_dir,
            in_memory=args.in_memory,
            snapshot_interval=args.snapshot_interval,
            snapshot_bytes=args.snapshot_bytes,
            journal_retention=Retention(args.journal_retention_bytes, args.journal_retention_age),
        )
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
            print(f"broker: cannot serve on {args.host}:{args.port}: {reason}", file=sys.stderr)
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
