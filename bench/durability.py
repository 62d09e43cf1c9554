"""Durability benchmarks (issue 4): what the journal costs, how fast a restart is, what a snapshot does
to the requests being served meanwhile.

* ``durable``: the HTTP drain of ``bench.http_api`` on a durable queue of a broker that journals to disk,
  against the same drain on a broker that keeps its journal in memory, in pairs run back to back (in
  either order, alternately), as the median of the pairs' ratios; with
  the fsyncs per second and the records per flush the durable broker logged (``journal_closed``), and,
  where ``perf stat`` counts instructions, the server's user-space instructions per message on each
  side: a figure that, unlike the rates, does not move with what else the machine is doing.
* ``recovery``: a data directory holding a snapshot of N ready messages plus 200,000 journal records
  after it (a fifth of N, below 1M); the time from starting ``broker serve`` on it to its first
  ``/readyz`` 200, for N = 100k, 1M and 2M.
* ``snapshot``: single-message claims against a broker holding 1,000,000 messages while it takes a
  snapshot, against the same claims while it does not; the longest claim is the longest the world
  stopped for the snapshot.
* ``history``: what keeping the finished messages get-one shows in snapshots costs (format 4): writing
  and reading, in process, the snapshot of a queue of 100,000 ready messages plus 10,000 acked ones
  (the default ``finished_history``, each with its claimed and acked records), against the same queue
  without them, as the snapshots of format 3 held it; in pairs, as the medians of the pairs' ratios.

The data directories are written directly with the broker's own core and storage modules (as the broker
would have written them), which takes seconds rather than the minutes publishing over HTTP would.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TypedDict

import orjson

from bench.http_api import PAYLOAD_TEXT, distinct_payload, drain_once
from bench.report import Result, failed, median, percentile, quiet, repetitions
from bench.server import HOST, BenchError, Connection, Server, running_server, stop
from broker.core import NewMessage, QueueCore
from broker.core.commands import Ack, Claim, Publish
from broker.core.config import QueueConfig
from broker.storage.format import encode_frames
from broker.storage.recovery import Recovered
from broker.storage.segments import SegmentWriter
from broker.storage.snapshots import JOURNAL_DIR, list_snapshots, read_snapshot, write_snapshot

QUEUE = "bench"


class RecoveryScale(TypedDict):
    """One scale of the recovery group (``RECOVERY``)."""

    sizes: list[int]  # messages in the snapshot, one benchmark each
    journal: int  # at most this many journal records after it
    repeats: int


DURABLE = {
    "full": {"messages": 100_000, "consumers": 8, "repeats": 4},
    "quick": {"messages": 10_000, "consumers": 8, "repeats": 1},
}
RECOVERY: dict[str, RecoveryScale] = {
    "full": {"sizes": [100_000, 1_000_000, 2_000_000], "journal": 200_000, "repeats": 3},
    "quick": {"sizes": [100_000], "journal": 20_000, "repeats": 1},
}
SNAPSHOT = {
    "full": {"messages": 1_000_000, "repeats": 3},
    "quick": {"messages": 100_000, "repeats": 1},
}

DURABLE_RATIO_TARGET = 0.8  # durable drain / in-memory drain
RECOVERY_TARGET = 5.0  # seconds to ready, 1M-message snapshot + 200k journal records
PAUSE_TARGET = 100.0  # ms: the longest claim while a snapshot is taken
#: The journal records after the snapshot, for snapshots of fewer messages than 1M.
JOURNAL_SHARE = 0.2
START_TIMEOUT = 120.0
#: Records per journal write while building a data directory (the broker's own flushes are similar).
GROUP = 1_000

# -- building a data directory ---------------------------------------------------------------------------


def build_data_dir(data_dir: Path, ready: int, journal_records: int) -> dict[str, Any]:
    """A snapshot of one queue holding ``ready`` messages, then ``journal_records`` records after it:
    half publishes (each message distinct), a quarter claims (batches of 100), a quarter acks of those
    claims."""
    started = time.perf_counter()
    data_dir.mkdir(parents=True)
    now = time.time()
    config = QueueConfig()
    core = QueueCore(QUEUE, config, "bench0")
    payload = orjson.dumps(PAYLOAD_TEXT)
    lsn = 1  # the queue_created record
    for offset in range(0, ready, GROUP):
        batch = [NewMessage(payload)] * min(GROUP, ready - offset)
        _, records = core.apply(Publish(batch), now)
        lsn += len(records)
    write_snapshot(data_dir, Recovered(queues={QUEUE: core}, last_lsn=lsn, last_at=now))
    snapshot_lsn = lsn
    writer = SegmentWriter(data_dir / JOURNAL_DIR, last_lsn=lsn)
    entries: list[bytes] = []
    first = lsn + 1

    def journal(records: list[Any]) -> None:
        """A command's records, framed as the broker frames them (a run of one type as a group)."""
        nonlocal lsn
        entries.extend(encode_frames(lsn + 1, now, QUEUE, records))
        lsn += len(records)
        if lsn - first + 1 >= GROUP:
            flush()

    def flush() -> None:
        nonlocal first
        if entries:
            writer.write(b"".join(entries), first, lsn)
            entries.clear()
            first = lsn + 1

    publishes = journal_records // 2
    for offset in range(0, publishes, GROUP):
        count = min(GROUP, publishes - offset)
        batch = [NewMessage(orjson.dumps(distinct_payload(offset + n))) for n in range(count)]
        _, records = core.apply(Publish(batch), now)
        journal(records)
    settled = (journal_records - publishes) // 2
    while settled > 0:
        claimed, records = core.apply(Claim("bench", max_count=min(100, settled)), now)
        journal(records)
        _, records = core.apply(Ack([claim.lease_id for claim, _ in claimed.deliveries]), now)
        journal(records)
        settled -= len(claimed.deliveries)
    flush()
    writer.sync()
    writer.close()
    return {
        "messages_in_snapshot": ready,
        "snapshot_lsn": snapshot_lsn,
        "journal_records": lsn - snapshot_lsn,
        "messages_at_end": core.depth,
        "build_seconds": round(time.perf_counter() - started, 2),
    }


# -- recovery --------------------------------------------------------------------------------------------


def _events(log_path: Path) -> list[dict[str, Any]]:
    events = []
    for line in log_path.read_bytes().splitlines():
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def recovery_once(data_dir: Path, log_path: Path) -> dict[str, Any]:
    """Start ``broker serve`` on ``data_dir``; time it until ``/readyz`` answers 200; kill it (-9, so the
    directory is left as it was: no shutdown snapshot)."""
    args = ["broker", "serve", "--host", HOST, "--port", "0", "--data-dir", str(data_dir)]
    with log_path.open("wb") as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", *args], stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    try:
        port = None
        deadline = started + START_TIMEOUT
        while port is None:
            if time.perf_counter() > deadline or process.poll() is not None:
                raise BenchError(f"the broker did not start: {log_path.read_text()[-500:]}")
            for event in _events(log_path):
                if event.get("event") == "listening":
                    port = int(event["url"].rsplit(":", 1)[1])
            time.sleep(0.005)
        connection = Connection(HOST, port)
        try:
            while True:
                connection.send("GET", "/readyz")
                status, _ = connection.receive()
                if status == 200:
                    break
                if time.perf_counter() > deadline:
                    raise BenchError("/readyz did not answer 200")
                time.sleep(0.005)
        finally:
            connection.close()
        ready = time.perf_counter() - started
    finally:
        process.kill()
        process.wait()
    recovered = next(event for event in _events(log_path) if event.get("event") == "recovered")
    return {
        "ready_seconds": round(ready, 3),
        "recovery_seconds": recovered["seconds"],
        "records_replayed": recovered["records"],
    }


def run_recovery(scale: str) -> list[Result]:
    counts = RECOVERY[scale]
    results = []
    for size in counts["sizes"]:
        journal = min(counts["journal"], max(int(size * JOURNAL_SHARE), 1))
        name = f"recovery, {size:,} msgs snapshot + {journal:,} journal records: time to ready"
        target = RECOVERY_TARGET if size == 1_000_000 else None
        try:
            with tempfile.TemporaryDirectory(prefix="broker-bench-recovery-") as tmp:
                data_dir = Path(tmp) / "data"
                built = build_data_dir(data_dir, size, journal)
                runs = [recovery_once(data_dir, Path(tmp) / f"server-{rep}.log") for rep in repetitions(3)]
        except Exception as exc:
            results.append(failed("recovery", name, "s", f"{type(exc).__name__}: {exc}"))
            continue
        samples = [run["ready_seconds"] for run in runs]
        results.append(
            Result(
                "recovery",
                name,
                median(samples),
                "s",
                target,
                at_least=False,
                samples=samples,
                details={"data_dir": built, "runs": runs},
            )
        )
    return results


# -- finished messages in snapshots ---------------------------------------------------------------------

HISTORY = {
    "full": {"ready": 100_000, "finished": 10_000, "repeats": 7},
    "quick": {"ready": 10_000, "finished": 10_000, "repeats": 2},
}


def a_queue_that_served(ready: int, finished: int) -> QueueCore:
    """``ready`` messages waiting, after ``finished`` more were published, claimed by 100 and acked."""
    core = QueueCore(QUEUE, QueueConfig(), "bench0")
    payload = orjson.dumps(PAYLOAD_TEXT)
    now = time.time()
    for offset in range(0, finished, 100):
        count = min(100, finished - offset)
        core.apply(Publish([NewMessage(payload)] * count), now)
        claimed, _ = core.apply(Claim("bench", max_count=count), now)
        core.apply(Ack([claim.lease_id for claim, _ in claimed.deliveries]), now + 0.01)
    for offset in range(0, ready, GROUP):
        core.apply(Publish([NewMessage(payload)] * min(GROUP, ready - offset)), now)
    return core


def history_once(core: QueueCore) -> dict[str, Any]:
    """Write ``core``'s snapshot and read it back, in process: seconds for each, and its bytes."""
    with tempfile.TemporaryDirectory(prefix="broker-bench-history-") as tmp:
        data_dir = Path(tmp)
        started = time.perf_counter()
        write_snapshot(data_dir, Recovered(queues={QUEUE: core}, last_lsn=1, last_at=time.time()))
        written = time.perf_counter()
        (info,) = list_snapshots(data_dir)
        listed = time.perf_counter()
        read_snapshot(data_dir, info)
        read = time.perf_counter()
    return {"write_seconds": written - started, "read_seconds": read - listed, "bytes": info.bytes}


def run_history(scale: str) -> list[Result]:
    counts = HISTORY[scale]
    ready, finished = counts["ready"], counts["finished"]
    names = [
        f"snapshot write, {ready:,} ready + {finished:,} finished msgs / {ready:,} ready alone",
        f"snapshot read, {ready:,} ready + {finished:,} finished msgs / {ready:,} ready alone",
        f"snapshot read, {finished:,} finished msgs: time added",
    ]
    try:
        served, plain = a_queue_that_served(ready, finished), a_queue_that_served(ready, 0)
        pairs = []
        for rep in repetitions(counts["repeats"]):
            first, second = (served, plain) if rep % 2 == 0 else (plain, served)
            runs = {id(first): history_once(first), id(second): history_once(second)}
            pairs.append((runs[id(served)], runs[id(plain)]))
    except Exception as exc:
        return [failed("history", name, "", f"{type(exc).__name__}: {exc}") for name in names]
    ratios = {
        kind: [with_[f"{kind}_seconds"] / without[f"{kind}_seconds"] for with_, without in pairs]
        for kind in ("write", "read")
    }
    added = [(with_["read_seconds"] - without["read_seconds"]) * 1000 for with_, without in pairs]
    details = {"bytes": {"with": pairs[0][0]["bytes"], "without": pairs[0][1]["bytes"]}, "pairs": pairs}
    return [
        Result(
            "history", names[0], median(ratios["write"]), "ratio", samples=ratios["write"], details=details
        ),
        Result("history", names[1], median(ratios["read"]), "ratio", samples=ratios["read"]),
        Result("history", names[2], median(added), "ms", samples=added),
    ]


# -- claims during a snapshot ----------------------------------------------------------------------------


def _claims_until(server: Server, path: str, stop_at: threading.Event) -> list[tuple[float, float]]:
    """Single-message claims, one after another, until ``stop_at``: ``(start, seconds)`` of each."""
    connection = Connection(server.host, server.port)
    body = orjson.dumps({"consumer": "latency", "max": 1})
    timings = []
    try:
        while not stop_at.is_set():
            started = time.perf_counter()
            connection.send("POST", f"{path}/claim", body)
            status, data = connection.receive()
            timings.append((started, time.perf_counter() - started))
            if status != 200:
                raise BenchError(f"claim answered {status}: {data[:300]!r}")
    finally:
        connection.close()
    return timings


def snapshot_once(server: Server, baseline_seconds: float) -> dict[str, Any]:
    """Claims for ``baseline_seconds`` with no snapshot, then claims while one snapshot is taken."""
    path = f"/v1/queues/{QUEUE}"
    stop_at = threading.Event()
    timings: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    def claim() -> None:
        try:
            timings.extend(_claims_until(server, path, stop_at))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=claim)
    thread.start()
    try:
        time.sleep(baseline_seconds)
        connection = Connection(server.host, server.port, timeout=START_TIMEOUT)
        try:
            snapshot_started = time.perf_counter()
            connection.send("POST", "/v1/admin/snapshots")
            status, data = connection.receive()
            snapshot_ended = time.perf_counter()
        finally:
            connection.close()
        if status != 201:
            raise BenchError(f"the snapshot answered {status}: {data[:300]!r}")
    finally:
        stop_at.set()
        thread.join()
    if errors:
        raise errors[0]
    before = [seconds * 1000 for started, seconds in timings if started < snapshot_started]
    during = [
        seconds * 1000
        for started, seconds in timings
        if started + seconds > snapshot_started and started < snapshot_ended
    ]
    return {
        "snapshot": orjson.loads(data),
        "snapshot_seconds": round(snapshot_ended - snapshot_started, 3),
        "claims_before": len(before),
        "claims_during": len(during),
        "before_p50_ms": percentile(before, 0.5),
        "before_p99_ms": percentile(before, 0.99),
        "during_p50_ms": percentile(during, 0.5),
        "during_p99_ms": percentile(during, 0.99),
        "during_max_ms": max(during, default=float("nan")),
    }


def run_snapshot(scale: str) -> list[Result]:
    messages = SNAPSHOT[scale]["messages"]
    names = (
        f"claim p99 while a snapshot of {messages:,} msgs is taken",
        f"claim p99 without a snapshot ({messages:,} msgs held)",
        f"longest claim while a snapshot of {messages:,} msgs is taken",
    )
    try:
        with tempfile.TemporaryDirectory(prefix="broker-bench-snapshot-") as tmp:
            data_dir = Path(tmp) / "data"
            built = build_data_dir(data_dir, messages, 0)
            with running_server(durable=True, data_dir=data_dir) as server:
                runs = [snapshot_once(server, 2.0) for _ in repetitions(SNAPSHOT[scale]["repeats"])]
    except Exception as exc:
        return [failed("snapshot", name, "ms", f"{type(exc).__name__}: {exc}") for name in names]
    during = [run["during_p99_ms"] for run in runs]
    before = [run["before_p99_ms"] for run in runs]
    longest = [run["during_max_ms"] for run in runs]
    return [
        Result("snapshot", names[0], median(during), "ms", samples=during, details={"runs": runs}),
        Result("snapshot", names[1], median(before), "ms", samples=before),
        Result(
            "snapshot",
            names[2],
            median(longest),
            "ms",
            PAUSE_TARGET,
            at_least=False,
            samples=longest,
            details={"data_dir": built},
        ),
    ]


# -- durable drain -----------------------------------------------------------------------------------------


def _journal_stats(server: Server) -> dict[str, Any]:
    """What the stopped server's journal logged when it closed."""
    closed = [event for event in _events(server.log_path) if event.get("event") == "journal_closed"]
    if not closed:
        raise BenchError("the durable broker logged no journal_closed")
    return closed[-1]


class InstructionCounter:
    """``perf stat -e instructions:u`` attached to a process until ``stop``; None where perf is missing
    or the machine does not count (``perf stat -e instructions true`` says "not supported")."""

    def __init__(self, pid: int) -> None:
        self._perf: subprocess.Popen[str] | None = None
        if shutil.which("perf") is not None:
            self._perf = subprocess.Popen(
                ["perf", "stat", "-x,", "-e", "instructions:u", "-p", str(pid)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            time.sleep(0.2)  # perf attaches to every thread of the process before it counts

    def stop(self) -> float | None:
        if self._perf is None:
            return None
        self._perf.send_signal(signal.SIGINT)
        _, report = self._perf.communicate(timeout=30)
        for line in report.splitlines():
            value, _, rest = line.partition(",")
            if "instructions" in rest and value.isdigit():
                return float(value)
        return None


def durable_drain_once(messages: int, consumers: int, *, durable: bool) -> dict[str, Any]:
    with running_server(durable=durable) as server:
        counter = InstructionCounter(server.pid)
        run = drain_once(server, "drain", messages, consumers)
        instructions = counter.stop()
        if instructions is not None:
            run["server_instructions_per_message"] = instructions / messages
        stop(server.process)
        if durable:
            stats = _journal_stats(server)
            run["journal"] = {
                key: stats[key] for key in ("flushes", "records", "bytes", "fsync_seconds", "faults")
            }
            run["fsyncs_per_second"] = stats["flushes"] / run["drain_seconds"]
            run["records_per_flush"] = stats["records"] / max(stats["flushes"], 1)
            run["fsync_ms_mean"] = stats["fsync_seconds"] / max(stats["flushes"], 1) * 1000
    return run


def run_durable(scale: str) -> list[Result]:
    counts = DURABLE[scale]
    messages, consumers = counts["messages"], counts["consumers"]
    names = (
        f"durable drain, {messages:,} msgs, 1 pub + {consumers} cons",
        "the same drain in memory",
        "durable drain / in-memory drain",
        "fsyncs per second during the durable drain",
        "journal records per flush during the durable drain",
        "server instructions per message, in memory / durable",
    )
    try:
        pairs = []
        for index in repetitions(counts["repeats"]):
            # Each pair runs its two drains back to back, in memory first in one pair and durable first
            # in the next: on a shared machine whose speed drifts over minutes (this project's VM moved
            # by 1.5x between runs), a fixed order would charge the drift to the same side every time.
            pair: dict[bool, dict[str, Any]] = {}  # durable? -> its drain
            for durable in (False, True) if index % 2 == 0 else (True, False):
                if pair:
                    quiet.wait()
                pair[durable] = durable_drain_once(messages, consumers, durable=durable)
            pairs.append((pair[True], pair[False]))
    except Exception as exc:
        return [failed("durable", name, "msg/s", f"{type(exc).__name__}: {exc}") for name in names]
    durable_rates = [run["drain_per_second"] for run, _ in pairs]
    memory_rates = [run["drain_per_second"] for _, run in pairs]
    ratios = [run["drain_per_second"] / other["drain_per_second"] for run, other in pairs]
    fsyncs = [run["fsyncs_per_second"] for run, _ in pairs]
    per_flush = [run["records_per_flush"] for run, _ in pairs]
    results = [
        Result(
            "durable",
            names[0],
            median(durable_rates),
            "msg/s",
            samples=durable_rates,
            details={"runs": [run for run, _ in pairs]},
        ),
        Result(
            "durable",
            names[1],
            median(memory_rates),
            "msg/s",
            samples=memory_rates,
            details={"runs": [run for _, run in pairs]},
        ),
        Result("durable", names[2], median(ratios), "ratio", DURABLE_RATIO_TARGET, samples=ratios),
        Result("durable", names[3], median(fsyncs), "/s", samples=fsyncs),
        Result("durable", names[4], median(per_flush), "records", samples=per_flush),
    ]
    counted = [
        (run["server_instructions_per_message"], other["server_instructions_per_message"])
        for run, other in pairs
        if "server_instructions_per_message" in run and "server_instructions_per_message" in other
    ]
    if counted:  # the same ratio in instructions; the details keep both counts
        results.append(
            Result(
                "durable",
                names[5],
                median([memory / durable for durable, memory in counted]),
                "ratio",
                samples=[memory / durable for durable, memory in counted],
                details={"instructions_per_message": [{"durable": d, "in_memory": m} for d, m in counted]},
            )
        )
    return results
