"""``broker snapshot list | verify | restore``: offline tools on a data directory no broker holds; and
``broker snapshot backup DEST``, a copy a broker can start from, made while the broker runs (or not).

They speak like the client commands (``output.py``): tables or ``--json``, one line on stderr for an
error, a progress bar while a restore reads a snapshot and replays the journal, or a backup copies.
The codes they add to the contract's (docs/cli.md): ``data_dir_not_found`` and ``snapshot_not_found``
(exit 4), ``not_a_directory`` and ``bad_input`` (exit 2), ``data_dir_in_use``, ``snapshot_corrupt``,
``nothing_to_restore``, ``unsupported_format`` and ``storage_unavailable`` (exit 1).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from broker.clock import format_time
from broker.commands.exits import Exit
from broker.commands.output import Output
from broker.errors import StorageUnavailable
from broker.storage import restore as operations
from broker.storage.backup import backup
from broker.storage.segments import UnsupportedVersion
from broker.storage.snapshots import CorruptSnapshot, check_pages, list_snapshots
from broker.storage.store import DataDirectoryInUse

#: The exit status of each ``RestoreError`` code that is not ``Exit.FAILED``.
EXIT_BY_CODE = {
    "bad_input": Exit.USAGE,
    "not_a_directory": Exit.USAGE,
    "data_dir_not_found": Exit.NOT_FOUND,
    "snapshot_not_found": Exit.NOT_FOUND,
}


def run_snapshot(args: argparse.Namespace) -> int:
    """Run ``broker snapshot ACTION``; its exit status."""
    out = Output(as_json=args.json)
    data_dir: Path = args.data_dir
    try:
        if args.action == "list":
            return _list(data_dir, out)
        if args.action == "verify":
            return _verify(data_dir, out)
        if args.action == "backup":
            return _backup(data_dir, args.dest, out)
        return _restore(data_dir, args, out)
    except operations.RestoreError as error:
        out.error(error.code, str(error))
        return int(EXIT_BY_CODE.get(error.code, Exit.FAILED))
    except DataDirectoryInUse as error:
        out.error("data_dir_in_use", error.message)
        return int(Exit.FAILED)
    except StorageUnavailable as error:
        out.error(error.code, error.message)
        return int(Exit.FAILED)
    except CorruptSnapshot as error:
        out.error("snapshot_corrupt", f"a snapshot in {data_dir} cannot be read: {error}")
        return int(Exit.FAILED)
    except UnsupportedVersion as error:  # a newer broker's journal: run that broker's tools
        out.error("unsupported_format", f"{error}; nothing was changed")
        return int(Exit.FAILED)
    except OSError as error:  # permissions, a full disk, an LMDB file that is not one (SnapshotStoreError)
        out.error("storage_unavailable", f"cannot use the data directory {data_dir}: {_reason(error)}")
        return int(Exit.FAILED)
    except KeyboardInterrupt:
        out.error("interrupted", "stopped by Ctrl-C")
        return 130


def _reason(error: OSError) -> str:
    if error.strerror and error.filename:
        return f"{error.strerror}: {error.filename}"
    return str(error) or type(error).__name__


def _list(data_dir: Path, out: Output) -> int:
    operations.check_data_dir(data_dir)
    check_pages(data_dir)
    snapshots = list_snapshots(data_dir)
    if out.as_json:
        out.json({"snapshots": [info.to_dict() for info in snapshots]})
        return int(Exit.OK)
    if not snapshots:
        out.line(f"no snapshots in {data_dir}")
        return int(Exit.OK)
    counts = ["lsn", "queues", "messages", "bytes"]
    rows = [
        [
            info.id,
            info.lsn,
            format_time(info.at),
            format_time(info.taken_at),
            info.queues,
            info.messages,
            info.bytes,
        ]
        for info in snapshots
    ]
    out.table(["id", "lsn", "as of", "taken at", "queues", "messages", "bytes"], rows, right=counts)
    return int(Exit.OK)


def _verify(data_dir: Path, out: Output) -> int:
    verified = operations.verify(data_dir)
    if out.as_json:
        out.json(_verification_document(verified))
    else:
        _print_verification(verified, out)
    return int(Exit.OK if verified.sound else Exit.FAILED)


def _verification_document(verified: operations.Verification) -> dict[str, Any]:
    """``verify --json``'s document: ``start`` was added after the others, which kept their shape."""
    snapshots = [
        {"id": result.snapshot.id, "lsn": result.snapshot.lsn, "problem": result.problem}
        for result in verified.snapshots
    ]
    return {
        "ok": verified.sound,
        "snapshots": snapshots,
        "journal": {"problem": verified.journal_problem},
        "start": {"problem": verified.start_problem},
    }


def _print_verification(verified: operations.Verification, out: Output) -> None:
    for result in verified.snapshots:
        out.line(f"snapshot {result.snapshot.id}: {result.problem or 'ok'}")
    out.line(f"journal: {verified.journal_problem or 'ok'}")
    out.line(f"start: {verified.start_problem or 'ok'}")


def _restore(data_dir: Path, args: argparse.Namespace, out: Output) -> int:
    until = None if args.until is None else operations.parse_time(args.until)
    with out.progress("restoring", 1) as bar:
        restored = operations.restore(data_dir, snapshot_id=args.id, until=until, progress=bar.update)
    info = restored.snapshot
    if out.as_json:
        document: dict[str, Any] = {
            "restored": info.to_dict(),
            "until": args.until,
            "replayed": restored.replayed,
            "dropped_snapshots": list(restored.dropped_snapshots),
            "archived_journal": None if restored.archived_journal is None else str(restored.archived_journal),
        }
        out.json(document)
        return int(Exit.OK)
    out.line(f"restored: snapshot {info.id} (lsn {info.lsn}, {info.queues} queues, {info.messages} messages)")
    if restored.replayed:
        out.line(f"  replayed {restored.replayed} journal records up to {args.until}")
    if restored.dropped_snapshots:
        out.line(f"  dropped newer snapshots: {', '.join(restored.dropped_snapshots)}")
    if restored.archived_journal is not None:
        out.line(f"  the journal as it was is kept in {restored.archived_journal}")
    out.line("the next `broker serve` starts from this state")
    return int(Exit.OK)


def _backup(data_dir: Path, dest: Path, out: Output) -> int:
    with out.progress("backing up", 1) as bar:
        made = backup(data_dir, dest, progress=bar.update)
    verified = made.verification
    at = None if made.at is None else format_time(made.at)
    if out.as_json:
        document = {
            "backup": str(made.path),
            "lsn": made.lsn,
            "at": at,
            "snapshots": list(made.snapshots),
            "bytes": made.bytes,
            "verified": _verification_document(verified),
        }
        out.json(document)
    else:
        out.line(f"backup: {made.path}")
        out.line(f"  recovers to lsn {made.lsn}" + ("" if at is None else f" ({at})"))
        out.line(f"  snapshots: {', '.join(made.snapshots) or 'none'}")
        out.line(f"  {made.bytes} bytes")
        if verified.sound:
            out.line("  checked: ok (broker snapshot verify would say so)")
        else:
            out.line("  checked: the copy has problems, as the data directory must have them too:")
            _print_verification(verified, out)
    return int(Exit.OK if verified.sound else Exit.FAILED)
