"""How long an operator's bulk operation holds up every other queue: ``python -m bench.stalls [--messages N]
[--queues Q] [--in-memory] [--python PYTHON]``.

One broker (durable unless ``--in-memory``) holds a dead-letter queue of ``N`` messages (default 100,000,
of ~190 bytes, put there by nacks with ``retryable: false``). While a probe thread publishes, claims and
acks one message on another queue every 10 ms, on its own connection, each operation below runs once:

* ``redrive all``: ``POST …/redrive {"all": true}`` of the whole dead-letter queue;
* ``purge``: ``POST …/purge`` of the ``N`` messages, back in their queue after that redrive;
* ``delete``: ``DELETE`` of a queue refilled with ``N`` messages;
* ``make queues``: ``Q`` more (empty) queues made (default 5,000), one ``PUT`` after another;
* ``idle``: nothing for 5 s: what the broker does on its own for every queue (the push supervisor's
  look every half second);
* ``list queues``: ``GET /v1/queues``, every queue with its config and stats;
* ``metrics scrape``: ``GET /metrics`` three times in a row, each queue a dozen series;
* ``job lookups``: SimpleQ's ``GET /compat/simpleq/v1/jobs/<id>`` three times in a row, of an id no
  queue holds, as one from before a restart is (no queue has its prefix): 404 after every queue is
  looked at.

The broker serves every queue on one event loop, so what an operation does in one go, the probe waits
for. Printed per operation: its own duration and the probe's slowest round trip during it, against the
probe's median and slowest round trip in the quiet second before. ``--python`` runs the broker with
another checkout's interpreter (``bench.ab`` explains how to make one), to compare before and after.
Results go to ``bench/results/stalls-<UTC timestamp>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from bench.report import RESULTS_DIR, code_version, machine, write_json
from bench.server import BenchError, Connection, Server, create_queue, running_server

BATCH = 1000
PAD = "x" * 160  # a message of ~190 bytes, as in the peers benchmark
PROBE_EVERY = 0.01
SCRAPES = 3
LOOKUPS = 3
IDLE_SECONDS = 5.0


class Probe:
    """Publish, claim and ack one message on queue ``probe`` every ``PROBE_EVERY`` seconds; record each
    round trip with the time it ended."""

    def __init__(self, server: Server) -> None:
        self._connection = Connection(server.host, server.port)
        self.samples: list[tuple[float, float]] = []  # (ended at, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._connection.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            self._connection.call("POST", "/v1/queues/probe/messages", {"payload": 1})
            claimed = self._connection.call("POST", "/v1/queues/probe/claim", {})
            leases = [message["lease_id"] for message in claimed["messages"]]
            self._connection.call("POST", "/v1/queues/probe/ack", {"leases": leases})
            ended = time.perf_counter()
            self.samples.append((ended, ended - started))
            time.sleep(PROBE_EVERY)

    def between(self, start: float, end: float) -> list[float]:
        """Round trips that were under way at some moment in ``[start, end]``."""
        return [seconds for ended, seconds in self.samples if ended >= start and ended - seconds <= end]


def fill(server: Server, queue: str, count: int) -> None:
    with _connection(server) as connection:
        for first in range(0, count, BATCH):
            batch = [{"payload": {"n": n, "pad": PAD}} for n in range(first, min(first + BATCH, count))]
            connection.call("POST", f"/v1/queues/{queue}/messages", {"messages": batch})


def dead_letter_all(server: Server, queue: str) -> None:
    with _connection(server) as connection:
        while True:
            claimed = connection.call("POST", f"/v1/queues/{queue}/claim", {"max": BATCH})["messages"]
            if not claimed:
                return
            leases = [message["lease_id"] for message in claimed]
            connection.call("POST", f"/v1/queues/{queue}/nack", {"leases": leases, "retryable": False})


@contextlib.contextmanager
def _connection(server: Server) -> Iterator[Connection]:
    """A connection for one step: the broker closes one left idle for ``keep_alive_timeout`` (20 s), as
    one kept from the set-up would be through a long operation."""
    connection = Connection(server.host, server.port, timeout=600)
    try:
        yield connection
    finally:
        connection.close()


def timed(probe: Probe, action: Any) -> dict[str, float]:
    started = time.perf_counter()
    action()
    ended = time.perf_counter()
    time.sleep(3 * PROBE_EVERY)  # the round trip under way as it ended comes back
    during = probe.between(started, ended)
    return {"seconds": ended - started, "probe_max_ms": max(during, default=0.0) * 1000}


def timed_on_own_connection(probe: Probe, server: Server, action: Any) -> dict[str, float]:
    """``timed(probe, lambda: action(connection))``, on a connection opened for it (``_connection``)."""
    with _connection(server) as connection:
        return timed(probe, lambda: action(connection))


def make_queues(connection: Connection, count: int) -> None:
    for number in range(count):
        connection.call("PUT", f"/v1/queues/many-{number:05d}", {})


def scrape(connection: Connection, times: int) -> None:
    for _ in range(times):
        connection.send("GET", "/metrics", None)
        status, text = connection.receive()
        if status != 200 or b"broker_queue_messages" not in text:
            raise BenchError(f"GET /metrics answered {status}: {text[:300]!r}")


def look_up_jobs(connection: Connection, times: int) -> None:
    for _ in range(times):
        connection.send("GET", "/compat/simpleq/v1/jobs/0-0-1", None)
        status, text = connection.receive()
        if status != 404:
            raise BenchError(f"GET of a job no queue holds answered {status}: {text[:300]!r}")


def run(messages: int, queues: int, durable: bool, python: str | None) -> dict[str, Any]:
    with running_server(durable=durable, python=python) as server:
        create_queue(server, "probe")
        create_queue(server, "work", {"max_attempts": 1})
        fill(server, "work", messages)
        dead_letter_all(server, "work")
        results: dict[str, Any] = {}
        with Probe(server) as probe:
            time.sleep(1.0)
            quiet = [seconds for _, seconds in probe.samples]
            results["quiet"] = {
                "probe_p50_ms": statistics.median(quiet) * 1000,
                "probe_max_ms": max(quiet) * 1000,
            }
            results["redrive all"] = timed_on_own_connection(
                probe,
                server,
                lambda admin: admin.call("POST", "/v1/queues/work.dlq/redrive", {"all": True}),
            )
            results["purge"] = timed_on_own_connection(
                probe, server, lambda admin: admin.call("POST", "/v1/queues/work/purge")
            )
            fill(server, "work", messages)
            results["delete"] = timed_on_own_connection(
                probe, server, lambda admin: admin.call("DELETE", "/v1/queues/work", expect=(204,))
            )
            results["make queues"] = timed_on_own_connection(
                probe, server, lambda admin: make_queues(admin, queues)
            )
            results["idle"] = timed(probe, lambda: time.sleep(IDLE_SECONDS))
            results["list queues"] = timed_on_own_connection(
                probe, server, lambda admin: admin.call("GET", "/v1/queues")
            )
            results["metrics scrape"] = timed_on_own_connection(
                probe, server, lambda admin: scrape(admin, SCRAPES)
            )
            results["job lookups"] = timed_on_own_connection(
                probe, server, lambda admin: look_up_jobs(admin, LOOKUPS)
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stalls", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000, help="messages per bulk operation")
    parser.add_argument(
        "--queues", type=int, default=5_000, help="queues made for the idle, list, metrics and lookup cases"
    )
    parser.add_argument("--in-memory", action="store_true", help="a broker without a journal")
    parser.add_argument("--python", default=None, help="the interpreter to run the broker with")
    args = parser.parse_args(argv)
    results = run(args.messages, args.queues, not args.in_memory, args.python)
    quiet = results["quiet"]
    print(f"{args.messages:,} messages, {'in memory' if args.in_memory else 'durable'}")
    median, slowest = quiet["probe_p50_ms"], quiet["probe_max_ms"]
    print(f"probe round trip, quiet: median {median:.1f} ms, max {slowest:.1f} ms")
    for name, figures in results.items():
        if name != "quiet":
            print(f"{name:>12}: {figures['seconds']:.2f} s, probe max {figures['probe_max_ms']:.0f} ms")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    document = {
        "benchmark": "stalls",
        "messages": args.messages,
        "queues": args.queues,
        "durable": not args.in_memory,
        "python": args.python or sys.executable,
        "code": code_version(),
        "machine": machine(),
        "results": results,
    }
    write_json(RESULTS_DIR / f"stalls-{stamp}.json", document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
