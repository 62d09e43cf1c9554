"""Results: one ``Result`` per checked figure, the table printed at the end, and the JSON file."""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Result:
    """One measured figure: the median of ``samples``, checked against ``target`` if there is one.

    ``at_least`` says which side of the target passes: throughput must reach it, latency and memory
    must stay under it. ``error`` is set (and ``value`` is NaN) when the benchmark could not run.
    """

    group: str
    name: str
    value: float
    unit: str
    target: float | None = None
    at_least: bool = True
    samples: list[float] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def passed(self) -> bool | None:
        if self.error is not None:
            return False
        if self.target is None:
            return None
        return self.value >= self.target if self.at_least else self.value <= self.target

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return "ERROR"
        return {True: "PASS", False: "FAIL", None: "info"}[self.passed]

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["value"] = None if math.isnan(self.value) else self.value
        out["passed"] = self.passed
        return out


def failed(group: str, name: str, unit: str, error: str) -> Result:
    return Result(group, name, math.nan, unit, error=error)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``fraction`` of the values at or below."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(math.ceil(fraction * len(ordered)), 1)
    return ordered[rank - 1]


def format_value(value: float, unit: str) -> str:
    if math.isnan(value):
        return "-"
    if unit == "msg/s":
        return f"{value:,.0f} msg/s"
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "ratio":
        return f"{value:.2f}x"
    if unit == "B/msg":
        return f"{value:,.0f} B/msg"
    if unit == "index":
        return f"{value:.4f}"
    return f"{value:g} {unit}"


def format_target(result: Result) -> str:
    if result.target is None:
        return "-"
    return ("≥ " if result.at_least else "≤ ") + format_value(result.target, result.unit)


def table(results: Sequence[Result]) -> str:
    rows = [("benchmark", "measured", "target", "result")]
    rows += [
        (
            r.name,
            format_value(r.value, r.unit),
            format_target(r),
            r.verdict + (f" ({r.error})" if r.error else ""),
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for index, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])) + "  " + row[3])
        if index == 0:
            lines.append("  ".join("-" * width for width in widths) + "  ------")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        **code_version(),
    }


def code_version() -> dict[str, Any]:
    """The commit checked out and whether broker/ differs from it (others may be changing it)."""
    return {
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "broker_dirty": bool(_git("status", "--porcelain", "--", ":/broker")),  # from the top, not bench/
    }


class CpuWatch:
    """How much CPU the whole machine and this benchmark (with its waited-for children) used.

    The difference is what other tenants of a shared machine used meanwhile, in average cores: a
    figure measured while it is high was measured with less than the whole machine.
    """

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        ticks = [int(value) for value in fields[:8]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
        ours = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            usage = resource.getrusage(who)
            ours += usage.ru_utime + usage.ru_stime
        return time.monotonic(), busy, ours

    def summary(self) -> dict[str, float]:
        wall0, busy0, ours0 = self._start
        wall1, busy1, ours1 = self._read()
        wall = max(wall1 - wall0, 1e-9)
        ours = (ours1 - ours0) / wall
        busy = (busy1 - busy0) / wall
        return {
            "seconds": round(wall, 1),
            "machine_busy_cores": round(busy, 2),
            "bench_cores": round(ours, 2),
            "other_tenants_cores": round(max(busy - ours, 0.0), 2),
        }


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=Path(__file__).resolve().parent
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))


class QuietWait:
    """``--wait-quiet``: before each repetition, wait (at most ``limit`` seconds) until other processes
    on the machine use fewer than ``QUIET_CORES`` cores, measured over ``QUIET_WINDOW`` seconds."""

    QUIET_CORES = 0.25
    QUIET_WINDOW = 1.0

    def __init__(self) -> None:
        self.limit = 0.0  # 0: never wait
        self.waited = 0.0  # seconds spent waiting since the last ``take_waited``

    def wait(self) -> None:
        if self.limit <= 0:
            return
        started = time.monotonic()
        while True:
            watch = CpuWatch()
            time.sleep(self.QUIET_WINDOW)
            waited = time.monotonic() - started
            if watch.summary()["other_tenants_cores"] < self.QUIET_CORES or waited >= self.limit:
                self.waited += waited
                return

    def take_waited(self) -> float:
        waited, self.waited = self.waited, 0.0
        return round(waited, 1)


quiet = QuietWait()


def repetitions(count: int) -> Iterator[int]:
    """``range(count)`` for a benchmark's repetitions, waiting for a quiet machine before each one."""
    for index in range(count):
        quiet.wait()
        yield index
