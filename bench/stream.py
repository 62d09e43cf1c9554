"""§7 push streams: ``python -m bench.stream [--quick]`` (also ``run_stream(scale)`` for ``python -m bench``).

Against a real ``broker serve`` with a data directory (durable queues, fsynced journal):

* **throughput**: a queue filled beforehand, then 8 worker processes, each running the client's worker
  loop (``AsyncClient.work`` with a no-op async handler, acks batched by the client) over one SSE
  stream; messages delivered and acked per second, from the workers' start to the last ack (the queue's
  ``acked_total``, polled every 20 ms);
* **latency**: one idle stream in a child process; the parent publishes one message at a time and the
  child notes when its event arrives (both read CLOCK_MONOTONIC): publish sent → event parsed;
* **idle streams**: 1,000 streams held open by one client process: the server's RSS growth per stream,
  and the server's CPU over a window of heartbeats against the same window with no stream open.

The machine has two cores shared with the client processes and other work: figures are medians over
repetitions and noisy; ``CpuWatch`` reports what other tenants used meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import multiprocessing.synchronize
import resource
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypedDict

import orjson

from bench.http_api import process_cpu_seconds
from bench.report import (
    RESULTS_DIR,
    CpuWatch,
    Result,
    failed,
    machine,
    median,
    percentile,
    repetitions,
    table,
    write_json,
)
from bench.server import HOST, BenchError, Connection, Server, create_queue, running_server
from broker.stream import HEARTBEAT_INTERVAL

GROUP = "stream"
PAYLOAD_TEXT = "x" * 198  # 200 bytes once JSON-encoded, as in bench.http_api
WORKERS = 8


class StreamScale(TypedDict):
    """One scale of the stream group (``SCALES``)."""

    messages: int  # drained per throughput run
    repeats: int
    samples: int  # timed deliveries per latency run
    streams: int  # idle streams held open
    window: float  # seconds the idle streams are watched


SCALES: dict[str, StreamScale] = {
    "full": {"messages": 100_000, "repeats": 3, "samples": 2_000, "streams": 1_000, "window": 31.0},
    "quick": {"messages": 20_000, "repeats": 1, "samples": 300, "streams": 1_000, "window": 16.0},
}
#: Per worker process: handlers at once, and the stream's max (messages held).
CONCURRENCY = 32
PREFETCH = 128

THROUGHPUT_TARGET = 20_000.0  # msg/s
LATENCY_P50_TARGET = 5.0  # ms
LATENCY_P99_TARGET = 20.0  # ms

RUN_TIMEOUT = 300.0
_fork = multiprocessing.get_context("fork")


@contextlib.contextmanager
def durable_server() -> Iterator[Server]:
    """``broker serve`` on a free port with a temporary data directory (not ``--in-memory``)."""
    with tempfile.TemporaryDirectory(prefix="broker-bench-stream-") as data_dir:
        args = ["broker", "serve", "--host", HOST, "--port", "0", "--data-dir", data_dir]
        with running_server(args) as server:
            yield server


def _raise_fd_limit() -> None:
    """1,000 streams need more descriptors than a default soft limit of 1024 leaves (the server, started
    after this, inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _fill(server: Server, path: str, messages: int) -> None:
    connection = Connection(server.host, server.port)
    body = orjson.dumps({"messages": [{"payload": PAYLOAD_TEXT}] * 1000})
    for _ in range(messages // 1000):
        connection.send("POST", f"{path}/messages", body)
        status, data = connection.receive()
        if status != 201:
            raise BenchError(f"publish answered {status}: {data[:200]!r}")
    connection.close()


def _acked_total(connection: Connection, path: str) -> int:
    total: int = connection.call("GET", path)["stats"]["acked_total"]
    return total


# -- throughput --------------------------------------------------------------------------------------


def _worker(
    url: str,
    queue_name: str,
    ready: multiprocessing.synchronize.Barrier,
    stop: multiprocessing.synchronize.Event,
    results: multiprocessing.Queue[dict[str, Any]],
) -> None:
    import anyio

    from broker.client import AsyncClient, Delivery

    async def handle(delivery: Delivery) -> None:
        return None

    async def main() -> dict[str, Any]:
        stopped = threading.Event()

        def relay_stop() -> None:  # the runner's multiprocessing event, as the threading.Event work() takes
            stop.wait()
            stopped.set()

        threading.Thread(target=relay_stop, daemon=True).start()
        async with AsyncClient(url) as client:
            await client.get_queue(queue_name)  # connected
            ready.wait(RUN_TIMEOUT)
            stats = await client.work(
                queue_name,
                handle,
                concurrency=CONCURRENCY,
                prefetch=PREFETCH,
                lease=60,
                stop=stopped,
                handle_signals=False,
            )
        return {"acked": stats.acked, "delivered": stats.delivered, "mode": stats.mode}

    try:
        results.put(anyio.run(main, backend="asyncio"))
    except BaseException as error:
        results.put({"error": f"{type(error).__name__}: {error}"})


def throughput_once(server: Server, messages: int) -> dict[str, Any]:
    queue_name = f"stream-drain-{time.monotonic_ns()}"
    path = create_queue(server, queue_name)
    _fill(server, path, messages)
    url = f"http://{server.host}:{server.port}"
    ready = _fork.Barrier(WORKERS + 1)
    stop = _fork.Event()
    results: multiprocessing.Queue[dict[str, Any]] = _fork.Queue()
    processes = [
        _fork.Process(target=_worker, args=(url, queue_name, ready, stop, results)) for _ in range(WORKERS)
    ]
    for process in processes:
        process.start()
    connection = Connection(server.host, server.port)
    cpu_before = process_cpu_seconds(server.pid)
    try:
        ready.wait(RUN_TIMEOUT)
        started = time.perf_counter()
        give_up = started + RUN_TIMEOUT
        while _acked_total(connection, path) < messages:
            if time.perf_counter() > give_up:
                raise BenchError(f"the workers did not ack {messages} messages within {RUN_TIMEOUT:g} s")
            if not all(process.is_alive() for process in processes):
                raise BenchError("a worker process died")
            time.sleep(0.02)
        finished = time.perf_counter()
        server_cpu = process_cpu_seconds(server.pid) - cpu_before
    finally:
        stop.set()
        outcomes = [results.get(timeout=60) for _ in processes]
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
        connection.close()
    errors = [outcome["error"] for outcome in outcomes if "error" in outcome]
    if errors:
        raise BenchError(f"worker failed: {errors[0]}")
    seconds = finished - started
    return {
        "messages": messages,
        "seconds": round(seconds, 3),
        "rate": messages / seconds,
        "server_cpu_ms_per_message": round(server_cpu * 1000 / messages, 4),
        "acked_by_workers": [outcome["acked"] for outcome in outcomes],
        "modes": sorted({outcome["mode"] for outcome in outcomes}),
    }


# -- latency -----------------------------------------------------------------------------------------


def _reader(
    url: str,
    queue_name: str,
    opened: multiprocessing.synchronize.Event,
    arrivals: multiprocessing.Queue[tuple[float, str]],
) -> None:
    import httpx

    from broker.client.sse import Event, EventParser

    parser = EventParser()
    with (
        httpx.Client(base_url=url, timeout=httpx.Timeout(10, read=None)) as http,
        http.stream(
            "GET",
            f"/v1/queues/{queue_name}/work",
            params={"max": "1000"},
            headers={"Accept": "text/event-stream"},
        ) as response,
    ):
        opened.set()
        for chunk in response.iter_raw():
            now = time.perf_counter()
            for item in parser.feed(chunk):
                if isinstance(item, Event):
                    if item.event != "message":
                        return
                    arrivals.put((now, orjson.loads(item.data)["lease_id"]))


def latency_once(server: Server, samples: int, warmup: int) -> dict[str, Any]:
    queue_name = f"stream-latency-{time.monotonic_ns()}"
    path = create_queue(server, queue_name)
    opened = _fork.Event()
    arrivals: multiprocessing.Queue[tuple[float, str]] = _fork.Queue()
    reader = _fork.Process(
        target=_reader, args=(f"http://{server.host}:{server.port}", queue_name, opened, arrivals)
    )
    reader.start()
    connection = Connection(server.host, server.port)
    body = orjson.dumps({"payload": PAYLOAD_TEXT})
    latencies: list[float] = []
    try:
        if not opened.wait(30):
            raise BenchError("the stream did not open")
        time.sleep(0.2)  # the stream is registered with the queue well before the first publish
        for index in range(samples + warmup):
            sent = time.perf_counter()
            connection.send("POST", f"{path}/messages", body)
            arrived, lease_id = arrivals.get(timeout=10)
            status, data = connection.receive()
            if status != 201:
                raise BenchError(f"publish answered {status}: {data[:200]!r}")
            if index >= warmup:
                latencies.append((arrived - sent) * 1000)
            connection.call("POST", f"{path}/ack", {"leases": [lease_id]})
    finally:
        connection.close()
        reader.kill()
        reader.join(10)
    return {
        "samples": len(latencies),
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        "max_ms": max(latencies),
    }


# -- idle streams ------------------------------------------------------------------------------------


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise BenchError("no VmRSS")


def _open_streams(server: Server, path: str, count: int) -> list[socket.socket]:
    request = f"GET {path}/work?max=1 HTTP/1.1\r\nHost: broker\r\nAccept: text/event-stream\r\n\r\n".encode()
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((server.host, server.port), timeout=30)
        sock.sendall(request)
        sockets.append(sock)
    for sock in sockets:  # each answered (headers and the opening comment): the stream is registered
        if b"200" not in sock.recv(4096).split(b"\r\n", 1)[0]:
            raise BenchError("a stream was not opened")
    return sockets


def idle_once(server: Server, streams: int, window: float) -> dict[str, Any]:
    queue_name = f"stream-idle-{time.monotonic_ns()}"
    path = create_queue(server, queue_name)
    time.sleep(1.0)
    cpu0 = process_cpu_seconds(server.pid)
    time.sleep(window)
    idle_cpu = process_cpu_seconds(server.pid) - cpu0
    rss_before = _rss_bytes(server.pid)
    sockets = _open_streams(server, path, streams)
    try:
        time.sleep(1.0)
        rss_after = _rss_bytes(server.pid)
        cpu1 = process_cpu_seconds(server.pid)
        time.sleep(window)
        streams_cpu = process_cpu_seconds(server.pid) - cpu1
    finally:
        for sock in sockets:
            sock.close()
    heartbeats = streams * int(window // HEARTBEAT_INTERVAL)
    extra = max(streams_cpu - idle_cpu, 0.0)
    return {
        "streams": streams,
        "rss_before_mib": round(rss_before / 2**20, 1),
        "rss_after_mib": round(rss_after / 2**20, 1),
        "kib_per_stream": (rss_after - rss_before) / streams / 1024,
        "window_seconds": window,
        "server_cpu_idle_s": round(idle_cpu, 3),
        "server_cpu_with_streams_s": round(streams_cpu, 3),
        "heartbeats": heartbeats,
        "cpu_us_per_heartbeat": extra * 1e6 / heartbeats if heartbeats else float("nan"),
        "cpu_percent_of_a_core": extra * 100 / window,
    }


# -- the group -----------------------------------------------------------------------------------------


def run_stream(scale: str) -> list[Result]:
    settings = SCALES[scale]
    _raise_fd_limit()
    results: list[Result] = []
    runs: list[dict[str, Any]] = []
    name = f"SSE drain, {settings['messages']:,} msgs, {WORKERS} worker processes, durable"
    try:
        with durable_server() as server:
            for _ in repetitions(settings["repeats"]):
                runs.append(throughput_once(server, settings["messages"]))
        rates = [run["rate"] for run in runs]
        results.append(
            Result(
                GROUP, name, median(rates), "msg/s", THROUGHPUT_TARGET, samples=rates, details={"runs": runs}
            )
        )
    except Exception as error:
        results.append(failed(GROUP, name, "msg/s", f"{type(error).__name__}: {error}"))

    p50_name, p99_name = (
        "publish → delivery on an idle stream p50",
        "publish → delivery on an idle stream p99",
    )
    try:
        latency_runs = []
        with durable_server() as server:
            for _ in repetitions(settings["repeats"]):
                latency_runs.append(latency_once(server, settings["samples"], warmup=50))
        p50s = [run["p50_ms"] for run in latency_runs]
        p99s = [run["p99_ms"] for run in latency_runs]
        details = {"runs": latency_runs}
        results.append(Result(GROUP, p50_name, median(p50s), "ms", LATENCY_P50_TARGET, False, p50s, details))
        results.append(Result(GROUP, p99_name, median(p99s), "ms", LATENCY_P99_TARGET, False, p99s, details))
    except Exception as error:
        results.append(failed(GROUP, p50_name, "ms", f"{type(error).__name__}: {error}"))
        results.append(failed(GROUP, p99_name, "ms", f"{type(error).__name__}: {error}"))

    memory_name = f"{settings['streams']:,} idle streams: server memory per stream"
    cpu_name = f"{settings['streams']:,} idle streams: server CPU per heartbeat"
    share_name = f"{settings['streams']:,} idle streams: heartbeat CPU, % of a core"
    try:
        with durable_server() as server:
            idle = idle_once(server, settings["streams"], settings["window"])
        results.append(Result(GROUP, memory_name, round(idle["kib_per_stream"], 1), "KiB", details=idle))
        results.append(Result(GROUP, cpu_name, round(idle["cpu_us_per_heartbeat"], 1), "µs", details=idle))
        results.append(Result(GROUP, share_name, round(idle["cpu_percent_of_a_core"], 2), "%", details=idle))
    except Exception as error:
        for result_name, unit in ((memory_name, "KiB"), (cpu_name, "µs"), (share_name, "%")):
            results.append(failed(GROUP, result_name, unit, f"{type(error).__name__}: {error}"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages and repetitions")
    args = parser.parse_args(argv)
    scale = "quick" if args.quick else "full"
    started = datetime.now(UTC)
    watch = CpuWatch()
    results = run_stream(scale)
    document: dict[str, Any] = {
        "started_at": started.isoformat(timespec="seconds"),
        "command": " ".join(
            [sys.executable, "-m", "bench.stream", *(argv if argv is not None else sys.argv[1:])]
        ),
        "scale": scale,
        "machine": machine(),
        "groups": {GROUP: watch.summary()},
        "results": [result.to_json() for result in results],
    }
    path = RESULTS_DIR / f"{started.strftime('%Y%m%dT%H%M%SZ')}-stream.json"
    write_json(path, document)
    print(table(results))
    cpu = document["groups"][GROUP]
    print(
        f"\nother tenants of the machine used {cpu['other_tenants_cores']:.2f} cores on average meanwhile; "
        "figures on this shared two-core machine are noisy"
    )
    print(f"results written to {path}")
    return 0 if all(result.passed is not False for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
