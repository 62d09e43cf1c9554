"""The side-by-side benchmark's arithmetic (bench/peers/summary.py): medians, paired ratios, targets,
table. No server is started here."""

from __future__ import annotations

import math
from typing import Any

from bench.peers import summary
from bench.peers.clients import PAYLOAD_SIZE, payloads


def run(contender: str, mode: str, repeat: int, drain: float, p50: float, **more: Any) -> dict[str, Any]:
    return {
        "contender": contender,
        "mode": mode,
        "repeat": repeat,
        "messages": 1000,
        "publish_per_second": drain,
        "drain_per_second": drain,
        "p50_ms": p50,
        "p99_ms": p50 * 2,
        "server_cpu_us_per_message": 10.0,
        "clients_cpu_us_per_message": 20.0,
        **more,
    }


RUNS = [
    run("broker", "durable", 0, 3000, 2.0),
    run("postgres", "durable", 0, 1000, 4.0),
    run("broker", "durable", 1, 1000, 2.0),  # a slow repeat: paired with postgres's slow one
    run("postgres", "durable", 1, 500, 1.0),
    run("broker", "durable", 2, 2000, 2.0),
    run("postgres", "durable", 2, 1000, 2.0),
]


def test_medians_are_per_mode_and_contender() -> None:
    figures = summary.medians(RUNS)
    assert list(figures) == [("durable", "broker"), ("durable", "postgres")]
    assert figures[("durable", "broker")]["drain_per_second"] == 2000
    assert figures[("durable", "postgres")]["p50_ms"] == 2.0


def test_medians_keep_the_empty_claim_queries() -> None:
    runs = [
        run("postgres", "durable", repeat, 1000, 1.0, empty_claim_queries=count)
        for repeat, count in enumerate([700, 900, 800])
    ]
    assert summary.medians(runs)[("durable", "postgres")]["empty_claim_queries"] == 800


def test_ratios_pair_the_runs_of_one_repeat_and_point_towards_the_broker() -> None:
    assert summary.paired_ratios(RUNS, "durable", "broker", "postgres", "drain_per_second") == [3.0, 2.0, 2.0]
    # latency: the peer's over the broker's, so that above 1 still means the broker did better
    assert summary.paired_ratios(RUNS, "durable", "broker", "postgres", "p50_ms") == [2.0, 0.5, 1.0]
    table = summary.ratio_table(RUNS, {"durable": "broker"})
    assert table["durable"]["postgres"]["drain_per_second"]["median"] == 2.0
    assert "broker" not in table["durable"]


def test_a_repeat_missing_one_side_is_left_out() -> None:
    runs = [*RUNS, run("broker", "durable", 3, 9000, 1.0)]
    assert len(summary.paired_ratios(runs, "durable", "broker", "postgres", "drain_per_second")) == 3


def test_ratio_of_a_missing_or_zero_figure_is_nan() -> None:
    assert math.isnan(summary.ratio(None, 1.0, True))
    assert math.isnan(summary.ratio(1.0, 0.0, False))
    assert summary.ratio(2.0, 4.0, False) == 2.0


def test_targets_are_checked_and_a_missing_peer_is_an_error() -> None:
    ratios = summary.ratio_table(RUNS, {"durable": "broker"})
    results = summary.target_results(ratios, {"postgres": "PostgreSQL"})
    by_name = {result.name: result for result in results}
    assert by_name["durable drain: broker ÷ PostgreSQL"].passed is True
    assert by_name["durable drain: broker ÷ redis"].error is not None
    info = summary.target_results(ratios, {}, broker="other", checked=False)
    assert [result.passed for result in info] == [None]


def test_table_marks_the_broker_and_drains_cut_short() -> None:
    runs = [*RUNS, run("beanstalkd", "durable", 0, 100, 0.1, messages=500)]
    text = summary.format_table(runs, {"durable": "broker"}, {"beanstalkd": "beanstalkd"}, requested=1000)
    lines = text.splitlines()
    assert lines[0].startswith("| mode")
    assert "(the broker)" in lines[2]
    assert "beanstalkd (500 msgs in the budget)" in text
    assert "30.00x" in text  # broker 3000/s ÷ beanstalkd 100/s in repeat 0


def test_table_names_a_row_by_its_mode_label_when_there_is_one() -> None:
    runs = [run("broker", "default", 0, 1000, 1.0), run("postgres", "default", 0, 1000, 1.0)]
    labels = {"postgres": "PostgreSQL", ("default", "postgres"): "PostgreSQL, async commit"}
    text = summary.format_table(runs, {"default": "broker"}, labels, requested=1000)
    assert "| PostgreSQL, async commit " in text


def test_payloads_are_distinct_and_sized() -> None:
    batch = payloads(5, 100)
    assert len(set(batch)) == 100
    assert {len(payload) for payload in batch} == {PAYLOAD_SIZE}
