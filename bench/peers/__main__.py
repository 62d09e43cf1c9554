"""``python -m bench.peers [--quick] [--repeats N] [--only SYSTEM ...] [--profile]``: the broker side by
side with beanstalkd, Redis and PostgreSQL; prints a table and writes JSON to bench/results/.

Exit status: 0 when every target of issue 9 is met, 1 when one is missed or a run failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import UTC, datetime
from typing import Any

from bench.peers import clients, runner, summary
from bench.report import RESULTS_DIR, CpuWatch, machine, quiet, repetitions, table, write_json

CONTENDERS = ["broker", "broker-http", "broker-memory", "postgres", "redis", "beanstalkd"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers",
        description="The broker against beanstalkd, Redis and PostgreSQL SKIP LOCKED on this machine.",
    )
    parser.add_argument("--quick", action="store_true", help="10,000 messages, 300 timed claims, 1 repeat")
    parser.add_argument(
        "--repeats", type=int, default=None, help="repeats of the whole set (default 3; 1 with --quick)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="CONTENDER",
        choices=CONTENDERS,
        help="run only these (the ratios need 'broker' among them)",
    )
    parser.add_argument("--modes", nargs="+", choices=runner.MODES, default=list(runner.MODES))
    parser.add_argument(
        "--broker-client",
        choices=sorted(clients.BROKER_PEERS),
        default=clients.BROKER_CLIENT,
        help="the broker's client: broker.client.Client ('client') or bench.server.Connection "
        f"('connection'); default {clients.BROKER_CLIENT!r}",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each repeat, wait up to SECONDS for other processes to use under "
        f"{quiet.QUIET_CORES} cores",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="afterwards, one durable broker drain (bench.profiling) under py-spy, summarised",
    )
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every `with`, so every server is stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = build_parser().parse_args(argv)
    clients.BROKER_CLIENT = args.broker_client
    scale = "quick" if args.quick else "full"
    counts = runner.SCALES[scale].copy()
    if args.repeats is not None:
        counts["repeats"] = args.repeats
    quiet.limit = args.wait_quiet
    started = datetime.now(UTC)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    document: dict[str, Any] = {
        "started_at": started.isoformat(timespec="seconds"),
        "command": " ".join(
            [sys.executable, "-m", "bench.peers", *(argv if argv is not None else sys.argv[1:])]
        ),
        "scale": scale,
        "counts": counts,
        "broker_client": args.broker_client,
        "machine": machine(),
        "load_average_at_start": os.getloadavg(),
    }
    wanted = set(args.only or CONTENDERS)
    setup = runner.Setup({"beanstalkd", "redis", "postgres"} & wanted)
    watch = CpuWatch()
    runs: list[dict[str, Any]] = []
    try:
        document["versions"] = setup.versions()
        selected = [contender for contender in runner.contenders(setup) if contender.key in wanted]
        for repeat in repetitions(counts["repeats"]):
            runs += runner.run_repeat(selected, args.modes, repeat, counts)
    finally:
        setup.close()
    document["cpu"] = {**watch.summary(), "waited_seconds": quiet.take_waited()}
    document["load_average_at_end"] = os.getloadavg()
    labels = {key: label for contender in selected for key, label in contender.labels().items()}
    good = [run for run in runs if "error" not in run]
    ratios = summary.ratio_table(good, runner.BROKER_OF_MODE)
    target_labels = {contender.key: contender.label for contender in selected}
    target_labels |= {"redis": "Redis AOF always", "beanstalkd": "beanstalkd -f 0"}
    results = summary.target_results(ratios, target_labels)
    light_ratios = summary.ratio_table(good, runner.LIGHT_BROKER_OF_MODE)
    results += summary.target_results(
        light_ratios, target_labels, broker="broker (http.client)", checked=False
    )
    document["runs"] = runs
    document["medians"] = [
        {"mode": mode, "contender": contender, **figures}
        for (mode, contender), figures in summary.medians(good).items()
    ]
    document["ratios"] = ratios
    document["ratios_http_client"] = light_ratios
    document["results"] = [result.to_json() for result in results]
    if args.profile:
        from bench import profiling

        print("profiling a durable broker drain with py-spy ...", file=sys.stderr, flush=True)
        document["profile"] = profiling.profile_drain(
            scale, RESULTS_DIR / f"{stamp}-peers-durable-drain.speedscope.json", durable=True
        )
    document["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    path = RESULTS_DIR / f"{stamp}-peers.json"
    write_json(path, document)

    print(summary.format_table(good, runner.BROKER_OF_MODE, labels, counts["messages"]))
    for run in runs:
        if "error" in run:
            print(f"\n{run['mode']} {run['contender']} (repeat {run['repeat'] + 1}) failed: {run['error']}")
    print()
    print(table(results))
    load = document["load_average_at_start"], document["load_average_at_end"]
    print(
        f"\n{counts['messages']:,} messages, {counts['consumers']} consumers, medians of {counts['repeats']} "
        f"repeat(s); load average {load[0][0]:.2f} at the start, {load[1][0]:.2f} at the end; other "
        f"processes used {document['cpu']['other_tenants_cores']:.2f} cores on average meanwhile"
    )
    if args.profile:
        from bench import profiling

        print()
        print(profiling.describe(document["profile"]))
    print(f"\nresults written to {path}")
    failed = any("error" in run for run in runs)
    return 0 if not failed and all(result.passed is not False for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
