"""Benchmarks of the pure queue core: throughput, cost against depth, memory per message.

Each measurement runs in a fresh interpreter (``python -m bench.child``) so that one measurement's heap
and garbage-collector state cannot skew the next. The child calls ``broker.runtime.tune_gc`` as the
server does at start, so the core is measured as the server runs it.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bench.child import run_child
from bench.report import Result, failed, median, repetitions
from broker.config import Limits
from broker.core import NewMessage, QueueConfig, QueueCore
from broker.http import parse
from broker.runtime import tune_gc

BATCH = 100
#: 200 bytes once JSON-encoded (the quotes make up the rest), as the HTTP layer would store it.
PAYLOAD_TEXT = "x" * 198
LIMITS = Limits()

THROUGHPUT = {"full": {"messages": 200_000, "repeats": 5}, "quick": {"messages": 20_000, "repeats": 3}}
DEPTH = {
    "full": {"shallow": 1_000, "deep": 1_000_000, "window": 100_000, "repeats": 5},
    "quick": {"shallow": 1_000, "deep": 100_000, "window": 20_000, "repeats": 3},
}
MEMORY = {"full": {"messages": 1_000_000}, "quick": {"messages": 100_000}}
#: Memory rows: (payload encoding, label, checked against the target, repetitions; 1 when quick).
MEMORY_VARIANTS = [
    ("http", "payloads encoded by the HTTP layer", True, 3),
    ("orjson", "raw orjson.dumps payloads", False, 1),
    ("right_sized", "right-sized payload copies", False, 1),
]

THROUGHPUT_TARGET = 200_000.0  # messages/s, each of publish, claim, ack
DEPTH_TARGET = 1.3  # deep cost / shallow cost
MEMORY_TARGET = 1024.0  # bytes of RSS per ready message


#: How a benchmark batch's payloads are encoded. "http": by the HTTP layer's own parser, from the decoded
#: body of a publish request, so each payload is stored exactly as the server stores it (whatever
#: broker.http.parse does today). "orjson": ``orjson.dumps`` as it comes, whose buffer (orjson 3.12 and
#: later) is over-allocated to about 4 KiB and never shrunk. "right_sized": an exact-size copy.
ENCODINGS = ("http", "orjson", "right_sized")
_REQUEST_BODY = {"messages": [{"payload": PAYLOAD_TEXT}] * BATCH}


def new_batch(encoding: str = "http") -> list[NewMessage]:
    """One publish batch of ``BATCH`` messages; every payload is its own bytes object."""
    if encoding == "http":
        return list(parse.publish(_REQUEST_BODY, LIMITS, False).messages)
    if encoding == "orjson":
        return [NewMessage(payload=orjson.dumps(PAYLOAD_TEXT)) for _ in range(BATCH)]
    if encoding == "right_sized":
        return [NewMessage(payload=b"".join((orjson.dumps(PAYLOAD_TEXT), b""))) for _ in range(BATCH)]
    raise ValueError(f"unknown payload encoding {encoding!r}; expected one of {ENCODINGS}")


class GcWatch:
    """Counts garbage collections and the time they take, per generation, while installed."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = 0.0
        self._started = 0.0

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1

    def snapshot(self) -> dict[str, Any]:
        return {"collections_by_generation": list(self.collections), "seconds": round(self.seconds, 4)}


# -- children: these run in a fresh interpreter and return plain data --------------------------------


def child_throughput(messages: int) -> dict[str, Any]:
    """Publish ``messages`` in batches, claim them all in batches, ack them all in batches."""
    run = ThroughputRun(messages)
    return {"publish": run.publish(), "claim": run.claim(), "ack": run.ack()}


class ThroughputRun:
    """``child_throughput`` a phase at a time (``bench.regression`` runs two of them in lockstep).

    Making one builds the batches and the queue; then ``publish``, ``claim`` and ``ack`` must be called
    once each, in that order, and each returns that phase's figures."""

    def __init__(self, messages: int) -> None:
        self.messages = messages
        self.batches = [new_batch() for _ in range(messages // BATCH)]
        self.core = QueueCore("bench", QueueConfig(), "bench-")
        self.lease_batches: list[list[str]] = []
        # The server calls tune_gc once at start, before any request. Calling it after building the
        # batches treats them as what they stand for, requests that have not arrived yet, rather than as a
        # heap of 'old' objects the collector would keep re-scanning while the core is timed.
        tune_gc()
        self.now = time.time()

    def publish(self) -> dict[str, Any]:
        core, now, messages = self.core, self.now, self.messages
        with GcWatch() as watch:
            started, cpu = time.perf_counter(), time.process_time()
            for batch in self.batches:
                core.publish(batch, now)
            figures = _phase(messages, time.perf_counter() - started, cpu, watch)
        if core.ready_count != messages:
            raise AssertionError(f"published {core.ready_count} of {messages}")
        return figures

    def claim(self) -> dict[str, Any]:
        # Each claim is timed on its own and its outcome dropped once the lease ids are taken (untimed),
        # as the server drops it once rendered: holding all 2,000 outcomes would give the collector
        # 200,000 extra live tuples to scan, which about doubled the time it took in trials.
        core, now, messages = self.core, self.now, self.messages
        lease_batches = self.lease_batches
        perf_counter, process_time = time.perf_counter, time.process_time
        claiming = claiming_cpu = 0.0
        with GcWatch() as watch:
            cpu = process_time()
            for _ in range(messages // BATCH):
                started_cpu = process_time()  # outside the wall-clock timing, so as not to add to it
                started = perf_counter()
                outcome = core.claim("bench", BATCH, None, now)[0]
                claiming += perf_counter() - started
                claiming_cpu += process_time() - started_cpu
                lease_batches.append([claimed.lease_id for claimed, _ in outcome.deliveries])
            figures = _phase(messages, claiming, cpu, watch, claiming_cpu)
        del outcome
        if sum(map(len, lease_batches)) != messages:
            raise AssertionError("the claims did not return every message")
        return figures

    def ack(self) -> dict[str, Any]:
        core, now, messages = self.core, self.now, self.messages
        acked = 0
        with GcWatch() as watch:
            started, cpu = time.perf_counter(), time.process_time()
            for lease_ids in self.lease_batches:
                acked += core.ack(lease_ids, now)[0].settled
            figures = _phase(messages, time.perf_counter() - started, cpu, watch)
        if acked != messages or core.depth != 0:
            raise AssertionError(f"acked {acked} of {messages}")
        return figures


def _phase(
    messages: int, wall: float, cpu_started: float, watch: GcWatch, timed_cpu: float | None = None
) -> dict[str, Any]:
    """A phase's figures; ``cpu_seconds`` and ``gc`` cover the whole phase, untimed steps included.

    ``per_cpu_second`` divides by the CPU time of the timed steps alone (``timed_cpu``; the whole phase
    when it has no untimed steps): unlike the wall-clock rate, it does not count the time this process
    spent waiting for a CPU that other processes held, so it is the steadier figure on a busy machine."""
    cpu_seconds = time.process_time() - cpu_started
    timed_cpu = cpu_seconds if timed_cpu is None else timed_cpu
    return {
        "per_second": messages / wall,
        "wall_seconds": round(wall, 4),
        "cpu_seconds": round(cpu_seconds, 4),
        "per_cpu_second": messages / timed_cpu if timed_cpu > 0 else math.nan,
        "gc": watch.snapshot(),
    }


def child_depth(depth: int, window: int) -> dict[str, Any]:
    """Time claim+ack of ``window`` messages in batches while ``depth`` messages stay ready.

    Each claimed batch is replaced by a fresh published batch outside the timed region, so the depth
    stays within one batch of ``depth`` throughout.
    """
    core = QueueCore("bench", QueueConfig(), "bench-")
    tune_gc()
    now = time.time()
    for _ in range(depth // BATCH):
        core.publish(new_batch(), now)
    if core.ready_count != depth:
        raise AssertionError(f"prefilled {core.ready_count} of {depth}")
    perf_counter = time.perf_counter
    claiming = acking = 0.0
    with GcWatch() as watch:
        cpu = time.process_time()
        for _ in range(window // BATCH):
            started = perf_counter()
            outcome = core.claim("bench", BATCH, None, now)[0]
            claimed = perf_counter()
            lease_ids = [record.lease_id for record, _ in outcome.deliveries]
            settling = perf_counter()
            settled = core.ack(lease_ids, now)[0].settled
            acking += perf_counter() - settling
            claiming += claimed - started
            if settled != BATCH:
                raise AssertionError(f"acked {settled} of a batch of {BATCH}")
            core.publish(new_batch(), now)  # untimed: keeps the depth constant
        cpu_seconds = time.process_time() - cpu
    return {
        "depth": depth,
        "window": window,
        "microseconds_per_message": (claiming + acking) / window * 1e6,
        "claim_microseconds_per_message": claiming / window * 1e6,
        "ack_microseconds_per_message": acking / window * 1e6,
        "timed_seconds": round(claiming + acking, 4),
        "cpu_seconds_whole_loop": round(cpu_seconds, 4),
        "gc_whole_loop": watch.snapshot(),
        "ready_at_end": core.ready_count,
    }


def child_memory(messages: int, encoding: str) -> dict[str, Any]:
    """RSS growth from publishing ``messages``, each batch built just before it is published."""
    core = QueueCore("bench", QueueConfig(), "bench-")
    tune_gc()
    now = time.time()
    before = resident_bytes()
    for _ in range(messages // BATCH):
        core.publish(new_batch(encoding), now)  # the batch, refs and records are dropped at once
    after = resident_bytes()
    if core.ready_count != messages:
        raise AssertionError(f"published {core.ready_count} of {messages}")
    return {
        "messages": messages,
        "payload_encoding": encoding,
        "rss_before_bytes": before,
        "rss_after_bytes": after,
        "bytes_per_message": (after - before) / messages,
    }


def resident_bytes() -> int:
    """VmRSS of this process, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {
    "throughput": child_throughput,
    "depth": child_depth,
    "memory": child_memory,
}


# -- the groups, run from the parent -----------------------------------------------------------------


def run_core(scale: str) -> list[Result]:
    counts = THROUGHPUT[scale]
    messages = counts["messages"]
    runs: list[dict[str, Any]] = []
    error = None
    for _ in repetitions(counts["repeats"]):
        try:
            runs.append(run_child("bench.core", "throughput", {"messages": messages}, timeout=300))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            break
    results = []
    for phase in ("publish", "claim", "ack"):
        name = f"core {phase} (batches of {BATCH})"
        if error is not None:
            results.append(failed("core", name, "msg/s", error))
            continue
        samples = [run[phase]["per_second"] for run in runs]
        results.append(
            Result(
                "core",
                name,
                median(samples),
                "msg/s",
                THROUGHPUT_TARGET,
                samples=samples,
                details={"messages": messages, "runs": [run[phase] for run in runs]},
            )
        )
    return results


def run_depth(scale: str) -> list[Result]:
    counts = DEPTH[scale]
    shallow, deep, window = counts["shallow"], counts["deep"], counts["window"]
    name = f"claim+ack cost at {deep:,} vs {shallow:,} ready"
    runs: dict[int, list[dict[str, Any]]] = {shallow: [], deep: []}
    try:
        # Alternate the two depths so that a noisy minute on a shared machine hits both alike.
        for _ in repetitions(counts["repeats"]):
            for depth in (shallow, deep):
                runs[depth].append(
                    run_child("bench.core", "depth", {"depth": depth, "window": window}, timeout=600)
                )
    except Exception as exc:
        return [failed("depth", name, "ratio", f"{type(exc).__name__}: {exc}")]
    shallow_cost = median([run["microseconds_per_message"] for run in runs[shallow]])
    deep_cost = median([run["microseconds_per_message"] for run in runs[deep]])
    return [
        Result(
            "depth",
            name,
            deep_cost / shallow_cost,
            "ratio",
            DEPTH_TARGET,
            at_least=False,
            samples=[
                d["microseconds_per_message"] / s["microseconds_per_message"]
                for s, d in zip(runs[shallow], runs[deep], strict=True)
            ],
            details={
                "window": window,
                "shallow_depth": shallow,
                "deep_depth": deep,
                "shallow_microseconds_per_message": shallow_cost,
                "deep_microseconds_per_message": deep_cost,
                "shallow_runs": runs[shallow],
                "deep_runs": runs[deep],
            },
        )
    ]


def run_memory(scale: str) -> list[Result]:
    counts = MEMORY[scale]
    messages = counts["messages"]
    results = []
    for encoding, how, checked, repeats in MEMORY_VARIANTS:
        name = f"RSS per ready message at {messages:,} ({how})"
        try:
            runs = [
                run_child("bench.core", "memory", {"messages": messages, "encoding": encoding}, timeout=600)
                for _ in repetitions(repeats if scale == "full" else 1)
            ]
        except Exception as exc:
            results.append(failed("memory", name, "B/msg", f"{type(exc).__name__}: {exc}"))
            continue
        samples = [run["bytes_per_message"] for run in runs]
        results.append(
            Result(
                "memory",
                name,
                median(samples),
                "B/msg",
                MEMORY_TARGET if checked else None,
                at_least=False,
                samples=samples,
                details={"runs": runs},
            )
        )
    return results
