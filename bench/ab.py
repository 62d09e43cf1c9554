"""Interleaved A/B of broker servers: ``python -m bench.ab [--workload W] [--rounds N] PYTHON [PYTHON ...]``.

Each ``PYTHON`` is an interpreter whose environment imports a ``broker`` (a checkout's ``.venv/bin/python``;
``git worktree add /tmp/before <commit>`` and ``make`` there give an old one). One server per
interpreter runs for the whole comparison, and each round runs the workload once against each, in
alternating order, so that a slow minute of a shared machine hits all of them.

Per request, the server's CPU time and, from ``perf stat -p`` (Linux ``perf``, with hardware counters),
the instructions and cycles the server process retired. Time and cycles move with the machine (±30%
here); the instruction count does not (within ~1% between rounds), so it shows differences of a few
percent that no timed benchmark on this machine can. It counts work, not time: a change that only
avoids waiting or cache misses does not show in it. Printed: medians over the rounds, and each
server's ratio to the first one's.

Workloads, one keep-alive connection each:

* ``claim``: 1,000 claims of one message (no wait), as the ``latency`` benchmark sends them;
* ``cycle``: 300 times publish 100, claim 100 (``wait: 1``), ack them: the ``http`` drain's requests,
  one after the other;
* ``healthz``: 1,000 ``GET /healthz``, a request the broker serves through Quart.
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
from pathlib import Path

import orjson

from bench.http_api import BATCH, PAYLOAD_TEXT, process_cpu_seconds
from bench.report import median, quiet
from bench.server import Connection, Server, create_queue, delete_queue, running_server

WORKLOADS = ("claim", "cycle", "healthz")
PERF_EVENTS = ("instructions", "cycles")
PERF_ATTACH_PAUSE = 0.3  # seconds for perf to attach before the workload starts


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


def _healthz(connection: Connection, path: str) -> int:
    for _ in range(1000):
        connection.send("GET", "/healthz")
        connection.receive()
    return 1000


RUNS: dict[str, Callable[[Connection, str], int]] = {"claim": _claims, "cycle": _cycles, "healthz": _healthz}


def measure(server: Server, workload: str, queue_name: str) -> dict[str, float]:
    """Run the workload once; the server's instructions, cycles and CPU milliseconds per request."""
    path = create_queue(server, queue_name)
    connection = Connection(server.host, server.port)
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
        started = time.perf_counter()
        requests = RUNS[workload](connection, path)
        wall = time.perf_counter() - started
        cpu = process_cpu_seconds(server.pid) - cpu
    finally:
        perf.send_signal(signal.SIGINT)
        _, report = perf.communicate(timeout=30)
        connection.close()
    delete_queue(server, queue_name)
    counts = {}
    for line in report.splitlines():  # value,unit,event,...
        fields = line.split(",")
        if len(fields) > 2 and fields[2] in PERF_EVENTS and fields[0].replace(".", "").isdigit():
            counts[fields[2]] = float(fields[0]) / requests
    if set(counts) != set(PERF_EVENTS):
        raise RuntimeError(f"perf stat reported no counts: {report.strip()[-300:]}")
    return {**counts, "cpu_ms": cpu / requests * 1000, "wall_ms": wall / requests * 1000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("pythons", nargs="+", metavar="PYTHON", help="interpreters, each with a broker")
    parser.add_argument("--workload", choices=WORKLOADS, default="claim")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS")
    args = parser.parse_args(argv)
    args.pythons = [str(Path(python).absolute()) for python in args.pythons]  # servers run elsewhere
    if shutil.which("perf") is None:
        parser.error("needs Linux perf (perf stat) with hardware counters")
    quiet.limit = args.wait_quiet
    samples: dict[str, list[dict[str, float]]] = {python: [] for python in args.pythons}
    with ExitStack() as stack:
        servers = {python: stack.enter_context(running_server(python=python)) for python in args.pythons}
        for round_number in range(args.rounds + 1):
            order = args.pythons if round_number % 2 else args.pythons[::-1]
            for python in order:
                quiet.wait()
                measured = measure(servers[python], args.workload, f"ab-{round_number}")
                if round_number:  # round 0 warms up
                    samples[python].append(measured)
    first = {key: median([s[key] for s in samples[args.pythons[0]]]) for key in samples[args.pythons[0]][0]}
    print(f"workload {args.workload}, {args.rounds} rounds; medians per request, ratio to the first server")
    for python, runs in samples.items():
        figures = {key: median([run[key] for run in runs]) for key in runs[0]}
        ratio = {key: figures[key] / first[key] for key in figures}
        spread = [run["instructions"] / 1e6 for run in runs]
        print(
            f"{python}\n    {figures['instructions'] / 1e6:.3f} M instructions "
            f"({ratio['instructions']:.3f}x; rounds {min(spread):.3f}-{max(spread):.3f})"
            f"  {figures['cycles'] / 1e6:.3f} M cycles ({ratio['cycles']:.3f}x)"
            f"  {figures['cpu_ms']:.3f} ms CPU ({ratio['cpu_ms']:.3f}x)"
            f"  {figures['wall_ms']:.3f} ms per request, wall ({ratio['wall_ms']:.3f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
