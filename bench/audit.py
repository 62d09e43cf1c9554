"""The Spark journal audit (CONTRACT §9, tools/journal_audit) on generated journals.

``python -m bench.audit [--quick] [--sizes 100000,1000000,5000000] [--repeat N] [--master local[2]]``

Journals of 100k, 1M and 5M records are made in a temporary directory by driving the broker's own queue
core (``broker.core.QueueCore``) through a realistic mix (publish, claim, ack mostly; nacks, defers,
extends, lease expiries, dead letters at ``max_attempts``, TTL expiries) and writing its records with the
broker's format encoder and segment writer, so they are real journals, which the audit must find clean.

Measured, each as the median of ``--repeat`` runs:

* ``audit_<n>``: the whole ``python -m tools.journal_audit audit`` in a fresh process on ``local[2]``,
  Spark's start-up included (target at 1M records: ≤ 60 s);
* ``load_<n>``: the loader alone in a running session (``spark.read.format("broker_journal")`` then a
  full scan), as records per second;
* how the audit's time grows from size to size (``growth``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from broker.core import NewMessage, QueueCore
from broker.core.config import QueueConfig
from broker.core.records import QueueCreated, Record
from broker.storage.format import encode_frames
from broker.storage.segments import SegmentWriter

#: Where the journals are made and kept between runs of the same sizes.
WORK = Path(tempfile.gettempdir()) / "broker-bench-audit"
START = 1_763_800_000.0
FLUSH_BYTES = 1 << 20


class _Writer:
    """Encodes records with the broker's format and writes them with its segment writer in groups."""

    def __init__(self, directory: Path) -> None:
        self.segments = SegmentWriter(directory, last_lsn=0)
        self.lsn = 0
        self.buffer: list[bytes] = []
        self.size = 0
        self.first = 1

    def add(self, queue: str, at: float, records: list[Record]) -> None:
        """The records one command made, framed as the broker frames them (runs of a type as groups)."""
        frames = encode_frames(self.lsn + 1, at, queue, records)
        self.lsn += len(records)
        self.buffer += frames
        self.size += sum(map(len, frames))
        if self.size >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            self.segments.write(b"".join(self.buffer), self.first, self.lsn)
            self.buffer, self.size, self.first = [], 0, self.lsn + 1

    def close(self) -> None:
        self.flush()
        self.segments.sync()
        self.segments.close()


def generate(directory: Path, records: int, seed: int = 6) -> int:
    """Write a journal of at least ``records`` records to ``directory``; return how many were written.

    Four work queues (max_attempts 3, lease 5 s, one with a message TTL) and their dead-letter queues.
    Each step publishes a batch to one queue and claims a batch from it; of the deliveries about 85% are
    acked, 5% nacked, 3% deferred, 2% extended then acked, and 5% left to expire (noticed by a later
    claim). The clock advances 20 ms a step.
    """
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    writer = _Writer(directory)
    now = START
    queues: dict[str, QueueCore] = {}
    work = []
    for number in range(4):
        name = f"jobs-{number}"
        config = QueueConfig(lease=5.0, max_attempts=3, message_ttl=10.0 if number == 3 else 0.0)
        for queue_name, queue_config in ((name, config), (f"{name}.dlq", QueueConfig())):
            prefix = f"{int(START * 1000):x}-{len(queues):x}"
            queues[queue_name] = QueueCore(queue_name, queue_config, prefix)
            writer.add(queue_name, now, [QueueCreated(queue_config, prefix)])
        work.append(name)
    payload = b'{"job":"resize","size":1024,"path":"/images/0000000000.png"}'
    headers = {"trace": "0123456789abcdef"}
    pending: list[tuple[str, list[str]]] = []  # (queue, lease ids) to ack after an extend
    while writer.lsn < records:
        now += 0.02
        name = rng.choice(work)
        core = queues[name]
        batch = [NewMessage(payload, headers=headers, priority=rng.choice((0, 0, 0, 1))) for _ in range(20)]
        _, produced = core.publish(batch, now)
        writer.add(name, now, produced)
        outcome, produced = core.claim(f"worker-{rng.randrange(8)}", 20, None, now)
        writer.add(name, now, produced)
        acks, nacks, defers, extends = [], [], [], []
        for claimed, _ in outcome.deliveries:
            roll = rng.random()
            if roll < 0.85:
                acks.append(claimed.lease_id)
            elif roll < 0.90:
                nacks.append(claimed.lease_id)
            elif roll < 0.93:
                defers.append(claimed.lease_id)
            elif roll < 0.95:
                extends.append(claimed.lease_id)
            # else: left to expire
        if acks:
            writer.add(name, now, core.ack(acks, now)[1])
        if nacks:
            writer.add(name, now, core.nack(nacks, 0.0, "failed", now)[1])
        if defers:
            writer.add(name, now, core.defer(defers, 1.0, "busy", now)[1])
        if extends:
            writer.add(name, now, core.extend(extends, 10.0, now)[1])
        for finished_queue, leases in pending:
            _, produced = queues[finished_queue].ack(leases, now)
            writer.add(finished_queue, now, produced)
        pending = [(name, extends)] if extends else []
        for destination, message in core.take_outbox():
            _, produced = queues[destination].publish([message], now, moved=True)
            writer.add(destination, now, produced)
    writer.close()
    return writer.lsn


# -- measuring ----------------------------------------------------------------------------------------

SIZES = (100_000, 1_000_000, 5_000_000)
QUICK_SIZES = (100_000, 1_000_000)
#: The end-to-end target at 1M records (issue 6).
TARGET_SECONDS_1M = 60.0


def journal_of(records: int) -> Path:
    """A generated journal of ``records`` records, made once and kept in ``WORK`` for later runs."""
    directory = WORK / f"{records}"
    done = directory / "DONE"
    if not done.exists():
        shutil.rmtree(directory, ignore_errors=True)
        written = generate(directory / "journal", records)
        done.write_text(f"{written}\n")
    return directory / "journal"


def time_audit(journal: Path, master: str) -> tuple[float, dict[str, Any]]:
    """Seconds for ``python -m tools.journal_audit audit`` in a fresh process, and its JSON report."""
    out = Path(tempfile.mkdtemp(prefix="bench-audit-")) / "report.json"
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.journal_audit",
            "audit",
            str(journal),
            "--master",
            master,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(
            f"the audit exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    report: dict[str, Any] = json.loads(out.read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    return seconds, report


def time_loader(journals: dict[int, Path], master: str, repeat: int) -> dict[int, list[float]]:
    """Seconds to read each journal whole through the data source (all columns, into Spark's noop sink)."""
    from tools.journal_audit.session import spark_session
    from tools.journal_audit.source import load_journal

    spark = spark_session(master, app_name="bench-audit-loader")
    try:
        load_journal(spark, journals[min(journals)]).write.format("noop").mode("overwrite").save()  # warm-up
        times: dict[int, list[float]] = {size: [] for size in journals}
        for _ in range(repeat):
            for size, journal in journals.items():
                started = time.perf_counter()
                load_journal(spark, journal).write.format("noop").mode("overwrite").save()
                times[size].append(time.perf_counter() - started)
        return times
    finally:
        spark.stop()


def main(argv: list[str] | None = None) -> int:
    from bench.report import RESULTS_DIR, Result, code_version, machine, table, write_json

    parser = argparse.ArgumentParser(prog="python -m bench.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100k and 1M records, one run each")
    parser.add_argument("--sizes", help="comma-separated record counts (default 100000,1000000,5000000)")
    parser.add_argument("--repeat", type=int, help="runs per figure (default 3; 1 with --quick)")
    parser.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    arguments = parser.parse_args(argv)
    sizes = (
        tuple(int(size) for size in arguments.sizes.split(","))
        if arguments.sizes
        else (QUICK_SIZES if arguments.quick else SIZES)
    )
    repeat = arguments.repeat or (1 if arguments.quick else 3)
    journals = {}
    for size in sizes:
        started = time.perf_counter()
        journals[size] = journal_of(size)
        print(
            f"journal of {size:,} records: {journals[size]} ({time.perf_counter() - started:.1f} s)",
            flush=True,
        )
    results: list[Result] = []
    medians: dict[int, float] = {}
    for size in sizes:
        samples = []
        details: dict[str, Any] = {}
        for _ in range(repeat if size < 5_000_000 or arguments.repeat else 1):
            seconds, report = time_audit(journals[size], arguments.master)
            samples.append(seconds)
            details = {
                "records": report["records"],
                "violations": report["violation_counts"],
                **report["timings"],
            }
            print(f"audit of {size:,} records: {seconds:.1f} s {report['timings']}", flush=True)
        medians[size] = statistics.median(samples)
        target = TARGET_SECONDS_1M if size == 1_000_000 else None
        results.append(
            Result(
                "audit",
                f"audit_{size}",
                medians[size],
                "s",
                target=target,
                at_least=False,
                samples=samples,
                details=details,
            )
        )
    loads = time_loader(journals, arguments.master, repeat)
    for size in sizes:
        rates = [size / seconds for seconds in loads[size]]
        results.append(Result("audit", f"load_{size}", statistics.median(rates), "rec/s", samples=rates))
    ordered = sorted(medians)
    for smaller, larger in itertools.pairwise(ordered):
        ratio = medians[larger] / medians[smaller]
        results.append(
            Result(
                "audit",
                f"growth_{smaller}_to_{larger}",
                ratio,
                "ratio",
                details={"records_ratio": larger / smaller},
            )
        )
    print()
    print(table(results))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = RESULTS_DIR / f"{stamp}-audit.json"
    write_json(
        path,
        {
            "command": "python -m bench.audit " + " ".join(argv if argv is not None else sys.argv[1:]),
            "code": code_version(),
            "machine": machine(),
            "results": [result.to_json() for result in results],
        },
    )
    print(f"\nwritten to {path}")
    return 0 if all(result.passed is not False for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
