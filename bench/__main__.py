"""``python -m bench [GROUP ...] [--quick] [--wait-quiet SECONDS] [--against REV] [--current REV]``: run,
print a table, write JSON.

``GROUP`` is any of the groups below, ``all`` (the default); and, not part of ``all``, ``floor`` (the HTTP
stack's own cost per request, see ``bench.floor``), ``regression`` (the core group on the current code
against commit ``--against``, see ``bench.regression``) and ``profile`` (one extra HTTP drain under
py-spy, see ``bench.profiling``).

Exit status: 0 when every checked figure meets its target, 1 when one misses it or a benchmark could
not run.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from bench import core, durability, floor, http_api, policies, recovery_memory, regression
from bench.report import RESULTS_DIR, CpuWatch, Result, code_version, machine, quiet, table, write_json

GROUPS: dict[str, Callable[[str], list[Result]]] = {
    "core": core.run_core,
    "depth": core.run_depth,
    "memory": core.run_memory,
    "http": http_api.run_http,
    "latency": http_api.run_latency,
    "longpoll": http_api.run_longpoll,
    "policies": policies.run_policies,
    "durable": durability.run_durable,
    "recovery": durability.run_recovery,
    "snapshot": durability.run_snapshot,
    "history": durability.run_history,
    "recovery_memory": recovery_memory.run_recovery_memory,
}
#: Groups that are not part of ``all``: a calibration without targets, and the regression check, which
#: needs the repository's history and takes a minute or two.
EXTRA_GROUPS: dict[str, Callable[[str], list[Result]]] = {
    "floor": floor.run_floor,
    "regression": regression.run_regression,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="Run the broker's benchmarks and check them against targets."
    )
    parser.add_argument(
        "groups",
        nargs="*",
        metavar="GROUP",
        help=f"which benchmarks to run: {', '.join(GROUPS)}, or all of these (the default); also "
        "'floor': the HTTP stack's own CPU cost per request, without the broker; 'regression': the core "
        "group on the current code and on commit --against, alternating, as ratios; and 'profile': one "
        "extra HTTP drain under py-spy that summarises where the server's CPU time goes",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smaller counts and fewer repetitions (smoke check)"
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each repetition, wait up to SECONDS for other processes on the machine to use less "
        f"than {quiet.QUIET_CORES} cores (for shared machines; default 0: do not wait)",
    )
    parser.add_argument(
        "--against",
        default=regression.BASELINE,
        metavar="REV",
        help="the commit the 'regression' group compares the current code with (default "
        f"{regression.BASELINE}, the core issue's last commit)",
    )
    parser.add_argument(
        "--current",
        default=None,
        metavar="REV",
        help="the 'regression' group's current side: this commit rather than the working tree's broker/",
    )
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds, so every server and client process is stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = build_parser()
    args = parser.parse_args(argv)
    known = [*GROUPS, *EXTRA_GROUPS, "all", "profile"]
    unknown = [group for group in args.groups if group not in known]
    if unknown:
        parser.error(f"unknown group {unknown[0]!r}; choose from {', '.join(known)}")
    profile = "profile" in args.groups
    groups: list[str] = []
    for group in args.groups:
        groups += list(GROUPS) if group == "all" else [] if group == "profile" else [group]
    if not args.groups:
        groups = list(GROUPS)
    scale = "quick" if args.quick else "full"
    quiet.limit = args.wait_quiet
    started = datetime.now(UTC)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    document: dict[str, Any] = {
        "started_at": started.isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, "-m", "bench", *(argv if argv is not None else sys.argv[1:])]),
        "scale": scale,
        "machine": machine(),
        "groups": {},
    }
    against = functools.partial(regression.run_regression, against=args.against, current=args.current)
    runners: dict[str, Callable[[str], list[Result]]] = {**GROUPS, **EXTRA_GROUPS, "regression": against}
    results: list[Result] = []
    for group in dict.fromkeys(groups):
        print(f"running {group} ({scale}) ...", file=sys.stderr, flush=True)
        version = code_version()  # per group: the code under test may change during a long run
        watch = CpuWatch()
        group_results = runners[group](scale)
        results += group_results
        document["groups"][group] = cpu = {
            **watch.summary(),
            "waited_seconds": quiet.take_waited(),
            **version,
        }
        for result in group_results:
            print(f"  {result.name}: {result.verdict}", file=sys.stderr, flush=True)
        print(
            f"  ({cpu['seconds']:.0f} s; other tenants of the machine used {cpu['other_tenants_cores']:.2f} "
            "cores on average meanwhile)",
            file=sys.stderr,
            flush=True,
        )
    if profile:
        from bench import profiling

        print("profiling the HTTP drain with py-spy ...", file=sys.stderr, flush=True)
        quiet.wait()
        document["profile"] = profiling.profile_drain(
            scale, RESULTS_DIR / f"{stamp}-http-drain.speedscope.json"
        )
    document["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    document["results"] = [result.to_json() for result in results]
    path = RESULTS_DIR / f"{stamp}.json"
    write_json(path, document)
    if results:
        print(table(results))
        others = ", ".join(
            f"{group} {cpu['other_tenants_cores']:.2f}" for group, cpu in document["groups"].items()
        )
        print(f"\nCPU used by other tenants of the machine meanwhile, average cores per group: {others}")
    if profile:
        print()
        print(profiling.describe(document["profile"]))
    print(f"\nresults written to {path}")
    return 0 if all(result.passed is not False for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
