"""``python -m tools.journal_audit audit|export|schema``: see docs/audit.md.

Exit status of ``audit``: 0 when the journal keeps every invariant, 1 when it breaks one (the violations
are listed), 2 when it could not be audited (no journal there, a journal it cannot read, a Spark
failure): one line says why (``--verbose`` adds the traceback), so that 1 always means "violations".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from tools.journal_audit.schema import describe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.journal_audit",
        description="Load the broker's journal into Spark, export it to Parquet, audit it (CONTRACT §9).",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def spark_options(command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--master", default="local[*]", help="Spark master URL (default: local[*], this machine's cores)"
        )
        command.add_argument("--verbose", action="store_true", help="show Spark's own log (WARN and up)")

    audit = commands.add_parser(
        "audit", help="check the invariants and report volumes, attempts and latencies per queue"
    )
    audit.add_argument(
        "path", type=Path, help="a data directory, its journal/ directory, or a Parquet export"
    )
    spark_options(audit)
    audit.add_argument("--json", type=Path, metavar="OUT", help="also write the whole report to OUT as JSON")
    audit.add_argument(
        "--journal-only",
        action="store_true",
        help="ignore the data directory's snapshots: 'live' means 'no end record in the journal'",
    )
    audit.add_argument("--listed", type=int, default=20, help="violations listed per kind (default 20)")

    export = commands.add_parser("export", help="write the journal as Parquet, partitioned by queue and day")
    export.add_argument("path", type=Path, help="a data directory or its journal/ directory")
    export.add_argument("out", type=Path, help="the directory to write (must not exist, unless --overwrite)")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    export.add_argument(
        "--journal-only",
        action="store_true",
        help="ignore the data directory's snapshots: the export is then audited as a journal alone",
    )
    spark_options(export)

    commands.add_parser("schema", help="print the loader's schema")
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    if arguments.command == "schema":
        print(describe())
        return 0
    from pyspark.sql import SparkSession

    from tools.journal_audit.session import spark_log_path, spark_session

    started = time.perf_counter()
    joined = SparkSession.getActiveSession() is not None  # called from code that has one: leave it running
    try:
        spark = spark_session(arguments.master, verbose=arguments.verbose)
    except Exception as error:
        print(f"error: Spark did not start: {error}", file=sys.stderr)
        if not arguments.verbose:
            print(f"(Spark's log: {spark_log_path()}; --verbose shows it)", file=sys.stderr)
        return 2
    try:
        if arguments.command == "export":
            return _export(spark, arguments)
        return _audit(spark, arguments, started)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # a journal it cannot read, a Spark failure: could not run, not "violations"
        if arguments.verbose:
            traceback.print_exc()
        print(f"error: the {arguments.command} could not run: {_reason(error)}", file=sys.stderr)
        return 2
    finally:
        if not joined:
            spark.stop()


def _reason(error: Exception) -> str:
    """One line for an error: its own first line, or for one raised in a Spark worker (whose message
    carries the worker's traceback) that traceback's last line, the worker's own exception."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):
        return lines[-1]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _export(spark: object, arguments: argparse.Namespace) -> int:
    from tools.journal_audit.source import export_journal

    if arguments.out.exists() and not arguments.overwrite:
        print(f"error: {arguments.out} exists: pass --overwrite to replace it", file=sys.stderr)
        return 2

    exported = export_journal(
        spark,  # type: ignore[arg-type]
        arguments.path,
        arguments.out,
        overwrite=arguments.overwrite,
        journal_only=arguments.journal_only,
    )
    live = exported.live
    state = (
        f"with the state recovered from snapshot {live.snapshot_id}"
        if live is not None
        else "without a recovered state (it will be audited as a journal alone)"
    )
    print(f"exported {arguments.path} to {arguments.out} (Parquet, partitioned by queue and day), {state}")
    return 0


def _audit(spark: object, arguments: argparse.Namespace, started: float) -> int:
    from tools.journal_audit.audit import audit

    report = audit(spark, arguments.path, journal_only=arguments.journal_only)  # type: ignore[arg-type]
    print(report.render(arguments.listed))
    print(f"\naudited in {time.perf_counter() - started:.1f} s, Spark start-up included")
    if arguments.json is not None:
        arguments.json.parent.mkdir(parents=True, exist_ok=True)
        arguments.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
