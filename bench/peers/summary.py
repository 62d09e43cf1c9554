"""Pure arithmetic on the runs: medians per contender, the broker's ratio to each peer within the run,
the checked targets, and the table. No servers, no clocks: unit-tested in ``tests/bench``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from bench.report import Result, median

#: Per-run figures, each with how it is shown; a ratio on one of them is oriented so that > 1 means the
#: broker did better (throughput: broker ÷ peer; latency and CPU: peer ÷ broker).
METRICS: dict[str, tuple[str, bool]] = {
    "publish_per_second": ("published/s", True),
    "drain_per_second": ("drained/s", True),
    "p50_ms": ("claim p50", False),
    "p99_ms": ("claim p99", False),
    "server_cpu_us_per_message": ("server CPU µs/msg", False),
    "clients_cpu_us_per_message": ("client CPU µs/msg", False),
}
#: Per-run counts whose medians are kept beside the metrics, without ratios: claim requests the server
#: answered with nothing, the cost of waiting for work (PostgreSQL's consumers all wake on each commit).
COUNTS = ["messages", "empty_claim_queries"]
#: The targets of issue 9, on the durable drain: (peer contender, at least this ratio).
TARGETS = [("postgres", 1.0), ("redis", 3.0), ("beanstalkd", 3.0)]


def medians(runs: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """``{(mode, contender): {metric: median over the repeats}}``, in the order first seen."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        grouped.setdefault((run["mode"], run["contender"]), []).append(run)
    return {
        key: {
            metric: median([run[metric] for run in group if run.get(metric) is not None])
            for metric in [*METRICS, *COUNTS]
        }
        for key, group in grouped.items()
    }


def ratio(broker_value: float | None, peer_value: float | None, higher_is_better: bool) -> float:
    if broker_value is None or peer_value is None or not broker_value or not peer_value:
        return math.nan
    if math.isnan(broker_value) or math.isnan(peer_value):
        return math.nan
    return broker_value / peer_value if higher_is_better else peer_value / broker_value


def paired_ratios(
    runs: Sequence[dict[str, Any]], mode: str, broker: str, peer: str, metric: str
) -> list[float]:
    """The broker's ratio to ``peer`` in each repeat (both measured in that repeat), oriented as in
    ``METRICS``; repeats where either failed are left out."""
    higher_is_better = METRICS[metric][1]
    by_repeat: dict[int, dict[str, Any]] = {}
    for run in runs:
        if run["mode"] == mode and run["contender"] in (broker, peer):
            by_repeat.setdefault(run["repeat"], {})[run["contender"]] = run
    values = []
    for repeat in sorted(by_repeat):
        pair = by_repeat[repeat]
        if broker in pair and peer in pair:
            value = ratio(pair[broker].get(metric), pair[peer].get(metric), higher_is_better)
            if not math.isnan(value):
                values.append(value)
    return values


def ratio_table(
    runs: Sequence[dict[str, Any]], broker_of_mode: dict[str, str]
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{mode: {peer: {metric: {"median": m, "repeats": [...]}}}}`` for every contender that is not the
    mode's broker."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for mode, contender in medians(runs):
        broker = broker_of_mode.get(mode)
        if broker is None or contender == broker:
            continue
        out.setdefault(mode, {})[contender] = {
            metric: {"median": median(values), "repeats": values}
            for metric in METRICS
            for values in [paired_ratios(runs, mode, broker, contender, metric)]
        }
    return out


def target_results(
    ratios: dict[str, dict[str, dict[str, Any]]],
    labels: dict[str, str],
    broker: str = "broker",
    checked: bool = True,
) -> list[Result]:
    """The durable-drain ratios of ``TARGETS`` as results: checked against their targets, or (``checked``
    false) shown for information only."""
    results = []
    for peer, target in TARGETS:
        drain = ratios.get("durable", {}).get(peer, {}).get("drain_per_second", {})
        name = f"durable drain: {broker} ÷ {labels.get(peer, peer)}"
        value = drain.get("median", math.nan)
        goal = target if checked else None
        if math.isnan(value):
            if checked:
                results.append(
                    Result("peers", name, math.nan, "ratio", goal, error="no paired durable drains")
                )
            continue
        results.append(Result("peers", name, value, "ratio", goal, samples=drain.get("repeats", [])))
    return results


def _cell(value: float | None, kind: str) -> str:
    if value is None or math.isnan(value):
        return "-"
    if kind == "rate":
        return f"{value:,.0f}"
    if kind == "ms":
        return f"{value:.2f} ms"
    if kind == "ratio":
        return f"{value:.2f}x"
    return f"{value:,.0f}"


def format_table(
    runs: Sequence[dict[str, Any]],
    broker_of_mode: dict[str, str],
    labels: Mapping[str | tuple[str, str], str],
    requested: int,
) -> str:
    """A Markdown table: one row per (mode, contender), medians, and the broker's paired ratios. A row is
    named ``labels[(mode, contender)]``, else ``labels[contender]``. A drain cut short by its time budget
    shows how many messages it moved (median) after the system's name."""
    header = [
        "mode",
        "system",
        "published/s",
        "drained/s",
        "claim p50",
        "claim p99",
        "server CPU µs/msg",
        "client CPU µs/msg",
        "broker ÷ it, drain",
        "it ÷ broker, p50",
    ]
    rows = [header, ["---"] * len(header)]
    ratios = ratio_table(runs, broker_of_mode)
    for (mode, contender), figures in medians(runs).items():
        name = labels.get((mode, contender)) or labels.get(contender, contender)
        if figures["messages"] < requested:
            name += f" ({figures['messages']:,.0f} msgs in the budget)"
        if contender == broker_of_mode.get(mode):
            drain_ratio = p50_ratio = "(the broker)"
        else:
            own = ratios.get(mode, {}).get(contender, {})
            drain_ratio = _cell(own.get("drain_per_second", {}).get("median"), "ratio")
            p50_ratio = _cell(own.get("p50_ms", {}).get("median"), "ratio")
        rows.append(
            [
                mode,
                name,
                _cell(figures["publish_per_second"], "rate"),
                _cell(figures["drain_per_second"], "rate"),
                _cell(figures["p50_ms"], "ms"),
                _cell(figures["p99_ms"], "ms"),
                _cell(figures["server_cpu_us_per_message"], "us"),
                _cell(figures["clients_cpu_us_per_message"], "us"),
                drain_ratio,
                p50_ratio,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for row in rows:
        lines.append("| " + " | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)) + " |")
    return "\n".join(lines)
