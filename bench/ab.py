"""Interleaved A/B of broker servers: ``python -m bench.ab [--workload W] [--rounds N] PYTHON [PYTHON ...]``.

``--tokens 0,8`` runs each interpreter's server twice, without tokens and with 8 configured (every
request then sends one; ``bench.server.tokens_config``): the cost of authentication on one commit.
``--scale quick`` makes the drain, latency and longpoll workloads their quick size, for a smoke test.

Each ``PYTHON`` is an interpreter whose environment imports a ``broker`` (a checkout's ``.venv/bin/python``;
``git worktree add /tmp/before <commit>`` and ``make`` there give an old one). One server per
interpreter runs for the whole comparison, and each round runs the workload once against each, in
alternating order, so that a slow minute of a shared machine hits all of them.

Per request, the server's CPU time and, from ``perf stat -p`` (Linux ``perf``, with hardware counters),
the instructions and cycles the server process retired. Time and cycles move with the machine (±30%
here); the instruction count does not (within ~1% between rounds), so it shows differences of a few
percent that no timed benchmark on this machine can. It counts work, not time: a change that only
avoids waiting or cache misses does not show in it. Printed: medians over the rounds, each server's
ratio to the first one's, and the ratio in each round (the two servers measured minutes apart at
most, so these ratios are steadier than the timed figures themselves).

Workloads:

* ``claim``: 1,000 claims of one message (no wait) on one connection;
* ``cycle``: 300 times publish 100, claim 100 (``wait: 1``), ack them, on one connection: the drain's
  three requests, one after the other;
* ``healthz``: 1,000 ``GET /healthz``, a request the broker serves through Quart;
* ``drain``, ``latency`` and ``longpoll``: one repetition of the ``http`` drain (figures per message),
  of the ``latency`` benchmark and of the ``longpoll`` one, exactly as ``python -m bench`` runs them.

Results go to ``bench/results/ab-<UTC timestamp>.json``.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

import orjson

from bench import http_api
from bench.http_api import BATCH, PAYLOAD_TEXT, process_cpu_seconds
from bench.report import RESULTS_DIR, machine, median, quiet, write_json
from bench.server import Connection, Server, create_queue, delete_queue, running_server

PERF_EVENTS = ("instructions", "cycles")
PERF_ATTACH_PAUSE = 0.3  # seconds for perf to attach before the workload starts

#: A workload runs once against a server (on a queue of the given name, at a scale of ``http_api``'s:
#: "full" or "quick") and returns how many units (requests, or messages for the drain) it made the
#: server handle, and figures of its own (rates, latencies).
Workload = Callable[[Server, str, str], tuple[int, dict[str, float]]]


def _on_one_connection(run: Callable[[Connection, str], int]) -> Workload:
    def workload(server: Server, queue_name: str, scale: str) -> tuple[int, dict[str, float]]:
        path = create_queue(server, queue_name)
        connection = Connection(server.host, server.port, token=server.token)
        try:
            started = time.perf_counter()
            requests = run(connection, path)
            wall = time.perf_counter() - started
        finally:
            connection.close()
        delete_queue(server, queue_name)
        return requests, {"wall_ms_per_request": wall / requests * 1000}

    return workload


@_on_one_connection
def _claims(connection: Connection, path: str) -> int:
    for _ in range(10):
        connection.call("POST", f"{path}/messages", {"messages": [{"payload": PAYLOAD_TEXT}] * BATCH})
    body = orjson.dumps({"consumer": "ab", "max": 1})
    for _ in range(1000):
        connection.send("POST", f"{path}/claim", body)
        status, _ = connection.receive()
        if status != 200:
            raise RuntimeError(f"claim answered {status}")
    return 1000


@_on_one_connection
def _cycles(connection: Connection, path: str) -> int:
    publish = orjson.dumps({"messages": [{"payload": PAYLOAD_TEXT}] * BATCH})
    claim = orjson.dumps({"consumer": "ab", "max": BATCH, "wait": 1})
    for _ in range(300):
        connection.send("POST", f"{path}/messages", publish)
        connection.receive()
        connection.send("POST", f"{path}/claim", claim)
        _, data = connection.receive()
        leases = [message["lease_id"] for message in orjson.loads(data)["messages"]]
        connection.send("POST", f"{path}/ack", orjson.dumps({"leases": leases}))
        connection.receive()
    return 900


@_on_one_connection
def _healthz(connection: Connection, path: str) -> int:
    for _ in range(1000):
        connection.send("GET", "/healthz")
        connection.receive()
    return 1000


def _drain(server: Server, queue_name: str, scale: str) -> tuple[int, dict[str, float]]:
    counts = http_api.DRAIN[scale]
    run = http_api.drain_once(server, queue_name, counts["messages"], counts["consumers"])
    return run["messages"], {"drain_per_second": run["drain_per_second"]}


def _latency(server: Server, queue_name: str, scale: str) -> tuple[int, dict[str, float]]:
    counts = http_api.LATENCY[scale]
    run = http_api.claim_latency_once(server, queue_name, counts["claims"], counts["warmup"])
    return counts["claims"] + counts["warmup"], {"p50_ms": run["p50_ms"], "p99_ms": run["p99_ms"]}


def _longpoll(server: Server, queue_name: str, scale: str) -> tuple[int, dict[str, float]]:
    counts = http_api.LONGPOLL[scale]
    run = http_api.longpoll_once(server, queue_name, counts["rounds"], counts["warmup"])
    # Per round: the parked claim, the publish that wakes it, and the ack.
    return 3 * (counts["rounds"] + counts["warmup"]), {"p50_ms": run["p50_ms"], "p99_ms": run["p99_ms"]}


WORKLOADS: dict[str, Workload] = {
    "claim": _claims,
    "cycle": _cycles,
    "healthz": _healthz,
    "drain": _drain,
    "latency": _latency,
    "longpoll": _longpoll,
}


def measure(server: Server, workload: str, queue_name: str, scale: str = "full") -> dict[str, float]:
    """Run the workload once: the server's instructions, cycles and CPU ms per unit, and its figures."""
    perf = subprocess.Popen(
        ["perf", "stat", "-x", ",", "-e", ",".join(PERF_EVENTS), "-p", str(server.pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(PERF_ATTACH_PAUSE)
        cpu = process_cpu_seconds(server.pid)
        units, figures = WORKLOADS[workload](server, queue_name, scale)
        cpu = process_cpu_seconds(server.pid) - cpu
    finally:
        perf.send_signal(signal.SIGINT)
        _, report = perf.communicate(timeout=30)
    counts = {}
    for line in report.splitlines():  # value,unit,event,...
        fields = line.split(",")
        if len(fields) > 2 and fields[2] in PERF_EVENTS and fields[0].replace(".", "").isdigit():
            counts[fields[2]] = float(fields[0]) / units
    if set(counts) != set(PERF_EVENTS):
        raise RuntimeError(f"perf stat reported no counts: {report.strip()[-300:]}")
    return {**counts, "cpu_ms": cpu / units * 1000, **figures}


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if any(count < 0 for count in counts):
        raise argparse.ArgumentTypeError(f"{text!r} has a negative count")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("pythons", nargs="+", metavar="PYTHON", help="interpreters, each with a broker")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="claim")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument(
        "--tokens",
        type=_counts,
        default=[0],
        metavar="N[,N...]",
        help="configure N bearer tokens and send one with every request (the cost of auth; default 0: "
        "none); several counts run a server for each with each PYTHON, e.g. 0,8 compares a commit "
        "without tokens and with 8",
    )
    parser.add_argument(
        "--scale",
        choices=["full", "quick"],
        default="full",
        help="drain, latency and longpoll: their full size (default) or the quick one (a smoke test)",
    )
    args = parser.parse_args(argv)
    args.pythons = [str(Path(python).absolute()) for python in args.pythons]  # servers run elsewhere
    if shutil.which("perf") is None:
        parser.error("needs Linux perf (perf stat) with hardware counters")
    quiet.limit = args.wait_quiet
    # One server per interpreter and token count, named by the interpreter (and the count, if several).
    labels = {
        (python, count): python if len(args.tokens) == 1 else f"{python} (tokens: {count})"
        for python in args.pythons
        for count in args.tokens
    }
    samples: dict[str, list[dict[str, float]]] = {label: [] for label in labels.values()}
    with ExitStack() as stack:
        servers = {
            label: stack.enter_context(running_server(python=python, tokens=count))
            for (python, count), label in labels.items()
        }
        names = list(servers)
        for round_number in range(args.rounds + 1):
            order = names if round_number % 2 else names[::-1]
            for label in order:
                quiet.wait()
                measured = measure(servers[label], args.workload, f"ab-{round_number}", args.scale)
                if round_number:  # round 0 warms up
                    samples[label].append(measured)
    base = samples[names[0]]
    unit = "message" if args.workload == "drain" else "request"
    print(f"workload {args.workload}: medians of {args.rounds} rounds; CPU, instructions, cycles per {unit};")
    print("in brackets: the ratio to the first server's median, then the ratio to it in each round")
    for label, runs in samples.items():
        print(label)
        for key in runs[0]:
            value = median([run[key] for run in runs])
            paired = ", ".join(f"{run[key] / other[key]:.3f}" for run, other in zip(runs, base, strict=True))
            shown = f"{value / 1e6:.3f} M" if key in PERF_EVENTS else f"{value:,.3f}"
            ratio = value / median([run[key] for run in base])
            print(f"    {key:20s} {shown:>14s}  ({ratio:.3f}x; {paired})")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    write_json(
        RESULTS_DIR / f"ab-{stamp}.json",
        {"command": " ".join(["python -m bench.ab", *(argv or sys.argv[1:])]), "machine": machine(),
         "workload": args.workload, "samples": samples},
    )  # fmt: skip
    print(f"\nresults written to {RESULTS_DIR / f'ab-{stamp}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
