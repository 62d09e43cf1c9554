"""The HTTP stack's own cost per request, without the broker: a calibration, not a target.

Server CPU time per ``GET /healthz`` (from /proc/<pid>/stat) for a bare ASGI callable on Hypercorn's Trio
worker, for the same callable with the broker's connection handler (``broker/http/connection.py``), for
one Quart-trio route on Hypercorn's own, and for the broker itself. The first is the floor any request
pays on stock Hypercorn here; the second, what the broker's handler leaves of it; the difference
between the first and the third is Quart's share.
"""

from __future__ import annotations

import time
from typing import Any

from bench.http_api import process_cpu_seconds
from bench.report import Result, failed, median, percentile, repetitions
from bench.server import Connection, Server, running_server

FLOOR = {
    "full": {"requests": 3_000, "warmup": 200, "repeats": 3},
    "quick": {"requests": 300, "warmup": 50, "repeats": 1},
}

KINDS = [
    ("bare ASGI app on Hypercorn/Trio", ["bench.floor_server", "asgi"]),
    ("bare ASGI app, the broker's connection handler", ["bench.floor_server", "asgi-handler"]),
    ("Quart-trio route on Hypercorn/Trio", ["bench.floor_server", "quart"]),
    ("broker GET /healthz", None),
]


def requests_once(server: Server, requests: int, warmup: int) -> dict[str, Any]:
    connection = Connection(server.host, server.port)
    try:
        for _ in range(warmup):
            connection.call("GET", "/healthz")
        milliseconds = []
        server_cpu = process_cpu_seconds(server.pid)
        for _ in range(requests):
            started = time.perf_counter()
            connection.send("GET", "/healthz")
            status, _ = connection.receive()
            milliseconds.append((time.perf_counter() - started) * 1000)
            if status != 200:
                raise RuntimeError(f"GET /healthz answered {status}")
        server_cpu = process_cpu_seconds(server.pid) - server_cpu
    finally:
        connection.close()
    return {
        "requests": requests,
        "server_cpu_ms_per_request": server_cpu / requests * 1000,
        "round_trip_p50_ms": percentile(milliseconds, 0.5),
    }


def run_floor(scale: str) -> list[Result]:
    counts = FLOOR[scale]
    results = []
    for label, module_args in KINDS:
        name = f"server CPU per request: {label}"
        try:
            with running_server(module_args) as server:
                runs = [
                    requests_once(server, counts["requests"], counts["warmup"])
                    for _ in repetitions(counts["repeats"])
                ]
        except Exception as exc:
            results.append(failed("floor", name, "ms", f"{type(exc).__name__}: {exc}"))
            continue
        samples = [run["server_cpu_ms_per_request"] for run in runs]
        results.append(Result("floor", name, median(samples), "ms", samples=samples, details={"runs": runs}))
    return results
